"""The memory tracker against answers worked out by hand."""

import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.execute import execute
from harness.measure import check_device, measure
from harness.tracing.trace import trace


def test_tracker_peak_on_a_toy_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20, bias=False), nn.ReLU(), nn.Linear(20, 5, bias=False)).to("meta")
    x = torch.randn(4, 10, device="meta")
    traced = trace(model, x)
    plan_vanilla = __import__("strategies").solve("vanilla", traced.graph)
    m = measure(lambda: execute(traced, plan_vanilla, x), model, (x,), "meta")
    # float32 bytes. At the start: W1 800 + W2 400 (parameters) and x 160.
    # Forward: h = x W1^T 320, r = relu(h) 320 (h dies: ReLU saves its output), o = r W2^T 80,
    # loss 4 (o dies). Backward: grad of the loss 4; lin2 gives grad r 320 and grad W2 400 (-> .grad);
    # ReLU gives grad h 320, then r and grad r die; lin1 gives grad W1 800 while grad h still lives.
    # Peak there: 1200 + 160 + 4 + 4 + 400 + 320 + 800 = 2888, with W1's gradient not yet in .grad.
    assert m.peak_bytes == 2888
    assert (m.params_bytes, m.grads_bytes, m.activations_bytes) == (1200, 400, 1288)
    assert m.method == "meta-tracker" and m.step_time_ms is None
    # FLOPs, 2 a multiply-add: forward 2*4*10*20 + 2*4*20*5; backward grad r and grad W2 2*4*20*5 each, grad W1
    # 2*4*10*20 (x needs no gradient)
    assert m.step_flops == 1600 + 800 + 800 + 800 + 1600


def test_cpu_measures_time_too():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU())
    x = torch.randn(4, 10)
    traced = trace(model, x)
    plan = __import__("strategies").solve("vanilla", traced.graph)
    m = measure(lambda: execute(traced, plan, x), model, (x,), "cpu", warmup_steps=1, timed_steps=3)
    assert m.step_time_ms > 0 and m.step_time_iqr_ms >= 0 and m.peak_bytes > 0
    assert all(p.grad is None for p in model.parameters())  # measurement leaves no gradients behind


def test_the_cycle_collector_runs_between_timed_steps_not_inside_them():
    """The timing protocol (harness.results.TIMING_PROTOCOL): a full collection falling inside a timed step
    would add its milliseconds to that step alone."""
    import gc

    from harness.measure import _timed, _wall_ms

    collector_on = []
    times = _timed(lambda: collector_on.append(gc.isenabled()), nn.Linear(2, 2), 1, 3, _wall_ms)
    assert collector_on == [True, False, False, False] and len(times) == 3 and gc.isenabled()


def test_devices_are_checked():
    with pytest.raises(ValueError, match="valid devices: meta, cpu, cuda"):
        check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            check_device("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_figures_agree_with_the_tracker():
    # Activations of about 0.5 GB, so that cuBLAS's workspace (tens of MB on Hopper, which the allocator
    # counts and the tracker does not) stays within the tolerance.
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10)).cuda()
    x = torch.randn(16384, 1024, device="cuda")
    traced = trace(model, x)
    plan = __import__("strategies").solve("vanilla", traced.graph)
    m = measure(lambda: execute(traced, plan, x), model, (x,), "cuda", warmup_steps=1, timed_steps=3)
    assert m.reserved_bytes >= m.peak_bytes > 0 and m.nvml_used_bytes > 0 and m.step_time_ms > 0
    assert abs(m.peak_bytes - m.tracker_peak_bytes) <= 0.1 * m.peak_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_oom_row_leaves_the_device_free_for_the_next_cell():
    from harness.run import run_cell

    # ResNet-50 at 224x224 holds about 85 MB a sample: twice the device's memory cannot fit.
    too_big = int(2 * torch.cuda.get_device_properties(0).total_memory / 85e6)
    row = run_cell("resnet50", "vanilla", batch_size=too_big, device="cuda", warmup_steps=0, timed_steps=1)
    assert row["status"] == "oom" and "out of memory" in row["error"].lower()
    after = run_cell("resnet50", "vanilla", batch_size=16, device="cuda", warmup_steps=0, timed_steps=1)
    assert after["status"] == "ok"


def test_a_profile_says_where_a_steps_time_goes(tmp_path):
    """``harness.bench.profile_step``: a recomputing plan runs more ATen ops a step than vanilla (its
    recomputed convolutions among them), and the ops' host time lies within the step's."""
    from harness.bench import profile_step

    figures = {}
    for strategy in ("vanilla", "chen_sqrt"):
        profile_step.main([str(tmp_path / strategy), "vgg19", strategy, "--batch", "2", "--side", "32",
                           "--warmup", "1", "--steps", "1", "--trace"])
        text = (tmp_path / f"{strategy}.md").read_text()
        figures[strategy] = {line[2:].split(": ")[0]: float(line.split(": ")[1]) for line in text.splitlines()
                             if line.startswith("- ")}
        assert "aten::convolution" in text and (tmp_path / f"{strategy}.json").stat().st_size > 1000
        every_op = pd.read_csv(tmp_path / f"{strategy}.csv")
        assert (every_op["calls per step"] > 0).all() and len(every_op) > 25  # more than the .md's top 25
        parts = figures[strategy]
        assert 0 < parts["host ms in ATen ops"] <= 1.05 * parts["wall ms per step"]  # no op counted twice
        assert parts["wall ms per step, unprofiled"] > 0
        assert (parts["host ms recomputing (in the backward)"] > 0) == (strategy == "chen_sqrt")
        assert parts["host ms recomputing (in the backward)"] < parts["wall ms per step"]
    assert figures["chen_sqrt"]["ATen op calls per step"] > figures["vanilla"]["ATen op calls per step"]
    with pytest.raises(SystemExit):  # meta has no time to profile
        profile_step.main([str(tmp_path / "meta"), "vgg19", "vanilla", "--device", "meta"])


def test_a_cuda_rows_kernel_time_says_whether_the_host_set_the_step():
    from harness.results import device_time

    assert device_time({"gpu_kernel_ms": 100.0, "step_time_ms": 105.0}) == {
        "GPU ms": 100.0, "GPU busy": 100.0 / 105.0, "host-bound": "no"}
    assert device_time({"gpu_kernel_ms": 100.0, "step_time_ms": 150.0})["host-bound"] == "yes"
    assert device_time({"step_time_ms": 150.0}) == {"GPU ms": None, "GPU busy": None, "host-bound": ""}
    # a row read into a DataFrame beside rows that have a kernel time: NaN where it has none
    assert device_time({"gpu_kernel_ms": float("nan"), "step_time_ms": 150.0}) == {
        "GPU ms": None, "GPU busy": None, "host-bound": ""}


def test_cuda_tables_put_gpu_time_ratios_beside_wall_time_ratios():
    from harness.bench import figure3, frontier

    def row(strategy, wall, kernel, batch=8, point=None):
        return {"net": "resnet152", "point": point or strategy, "strategy": strategy, "options": {}, "status": "ok",
                "device": "cuda", "batch_size": batch, "measured_peak_bytes": 5e9, "budget_bytes": None,
                "step_time_ms": wall, "step_time_iqr_ms": 1.0, "gpu_kernel_ms": kernel}

    rows = [row("vanilla", 100.0, 95.0), row("approx_dp", 150.0, 114.0)]
    table = frontier.points(rows, "cuda").set_index("strategy")
    assert table.loc["approx_dp", "time / vanilla"] == 1.5
    assert table.loc["approx_dp", "GPU / vanilla"] == 114.0 / 95.0
    assert "time / compiled vanilla" not in table  # no compiled vanilla measured: no column
    compiled = [{**row("vanilla", 80.0, 76.0), "compiled": True},
                {**row("approx_dp", 92.0, 87.4), "compiled": True, "compile_excess_bytes": 1.4e8}]
    both = frontier.points(rows + compiled, "cuda").set_index(["strategy", "compiled"])
    assert both.loc[("approx_dp", True), "time / compiled vanilla"] == 92.0 / 80.0
    assert both.loc[("approx_dp", True), "GPU / compiled vanilla"] == 87.4 / 76.0
    assert both.loc[("approx_dp", False), "time / compiled vanilla"] == 150.0 / 80.0
    assert both.loc[("approx_dp", True), "time / vanilla"] == 92.0 / 100.0  # eager vanilla's stays the base there
    assert both.loc[("approx_dp", True), "note"].startswith("solved again 0.14 GB lower")
    assert table.loc["approx_dp", "host-bound"] == "yes" and table.loc["vanilla", "host-bound"] == "no"
    assert "GPU ms" not in frontier.points(rows, "meta")  # no kernel time on meta: no column
    curves = pd.DataFrame([row("vanilla", 100.0, 95.0, 4), {**row("approx_dp", 150.0, 120.0), "options": {"mode": "tc"}},
                           row("chen_sqrt", 200.0, 130.0)])
    claim = figure3.tc_against_chen(figure3.points(curves, 10**10))
    assert claim == ["resnet152: at batch 8 (twice vanilla's 4), tc/Chen = 0.75 (tc 1.33x faster; the paper: "
                     "1.16x); in GPU kernel time 0.92"]


def _layouts(out):
    outputs = out if isinstance(out, tuple) else (out,)
    return [None if t is None else (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
            for t in outputs]


def test_a_meta_kernel_remembered_makes_the_layouts_the_kernel_made(monkeypatch):
    """NOTE [meta kernels remembered]: an op called again on the same layouts hands back new outputs of the
    layouts its kernel made (channels-last, bfloat16, a missing gradient); a scalar of another type is another
    call; views and in-place ops are never remembered."""
    from harness import measure

    aten = torch.ops.aten
    monkeypatch.setattr(measure, "_META_OUTPUTS", {})
    x = torch.empty(2, 8, 5, 5, device="meta").to(memory_format=torch.channels_last)
    w, b, mean, var = (torch.empty(8, device="meta") for _ in range(4))
    ints = torch.empty(3, dtype=torch.int64, device="meta")
    calls = [(aten.native_batch_norm.default, (x, w, b, mean, var, True, 0.1, 1e-5)),
             (aten.native_batch_norm.default, (x.bfloat16(), None, None, None, None, True, 0.1, 1e-5)),
             (aten.native_batch_norm_backward.default, (x, x, w, mean, var, mean, var, True, 1e-5,
                                                         [True, False, True])),
             (aten.upsample_bilinear2d.default, (x, [9, 7], False)),
             (aten.add.Tensor, (ints, 1)), (aten.add.Tensor, (ints, 1.0)), (aten.add.Tensor, (ints, True))]
    for func, args in calls:
        made = func(*args)
        first = measure.meta_call(func, args, {})
        again = measure.meta_call(func, args, {})
        assert _layouts(first) == _layouts(again) == _layouts(made), func
        assert all(a is None or a.untyped_storage()._cdata != b.untyped_storage()._cdata
                   for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (first, again))))
    assert len(measure._META_OUTPUTS) == len(calls)
    assert [measure.meta_call(aten.add.Tensor, (ints, s), {}).dtype for s in (1, 1.0)] == [torch.int64, torch.float32]

    class Seen(TorchDispatchMode):  # a mode outside the tracker's sees every op, remembered or not
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    seen = []
    with Seen():
        measure.meta_call(*calls[0], {})
    assert seen == [calls[0][0]]
    flat = x.contiguous()
    measure.meta_call(aten.view.default, (flat, [-1]), {})
    measure.meta_call(aten.add_.Tensor, (flat, flat), {})
    assert len(measure._META_OUTPUTS) == len(calls)


def test_a_meta_run_measures_and_traces_what_it_does_with_no_kernel_remembered(monkeypatch):
    """Every measured and predicted figure of a meta cell (a BatchNorm net under a recomputing plan: the
    recomputation's kernels are remembered from the forward's, and the trace's from its probe's) is what it is
    with every kernel run."""
    import harness.run
    import harness.tracing.tracer
    from harness import measure
    from harness.run import run_cell

    cell = dict(batch_size=2, image_size=64)
    fields = ["measured_peak_bytes", "measured_params_bytes", "measured_grads_bytes", "measured_activations_bytes",
              "measured_step_flops", "predicted_peak_bytes", "predicted_peak_no_liveness_bytes", "predicted_step_flops"]
    rows = []
    for remembered in (True, False):
        monkeypatch.setattr(harness.run, "_KEPT_TRACES", {})
        monkeypatch.setattr(measure, "_META_OUTPUTS", {})
        if not remembered:  # the tracker's, and the trace's probe's (``Draws``)
            for module in (measure, harness.tracing.tracer):
                monkeypatch.setattr(module, "meta_call", lambda func, args, kwargs: func(*args, **kwargs))
        row = run_cell("googlenet", "chen_sqrt", **cell)
        assert row["status"] == "ok", row.get("error")
        rows.append({field: row[field] for field in fields})
        assert all(figure > 0 for figure in rows[-1].values()), rows[-1]
        assert bool(measure._META_OUTPUTS) == remembered
    assert rows[0] == rows[1]
