"""The executor's host work: a recomputing step's ATen op calls stay within plain PyTorch's, plus its recomputed
calls' own, plus two per recomputed call (NOTE [what a call needs, found once] in harness/execute/step.py). Op counts
are deterministic, so the bound holds exactly here, on ResNet-50 too, whose recomputed BatchNorms copy their
running statistics (``results/overhead_cpu.md``)."""

import pytest

from harness.bench import overhead


# GoogLeNet's dropouts replay their draws; VGG-19's 100M weights made it the slowest case on the cpu (18 s a pair).
@pytest.mark.parametrize("net", ["googlenet", "gpt2", "resnet50"])
def test_a_recomputing_step_runs_its_recomputed_calls_and_two_ops_each_besides_plain_pytorchs(net):
    vanilla = overhead.measure_cell(net, "vanilla", {}, "cpu", steps=1)
    for strategy, options in [("chen_sqrt", {}), ("approx_dp", {"mode": "mc"})]:
        row = overhead.measure_cell(net, strategy, options, "cpu", steps=1)
        assert row["recomputed calls"] > 0 and row["their ops"] > 0
        bound = vanilla["ops"] + row["their ops"] + overhead.CALL_OPS * row["recomputed calls"]
        assert row["ops"] <= bound, (strategy, row["ops"], bound)


def test_the_overhead_benchmark_refuses_meta_naming_the_devices(capsys):
    with pytest.raises(SystemExit):
        overhead.main(["unused", "--device", "meta"])
    assert "choose one of cpu, cuda" in capsys.readouterr().err


def test_host_time_is_the_median_of_steps_profiled_one_by_one_without_the_cycle_collector():
    """One slow step (the machine busy elsewhere for a moment) does not set a cell's host time."""
    import gc
    import time

    calls = []

    def run():
        calls.append(gc.isenabled())
        time.sleep(0.2 if len(calls) == 1 else 0.002)

    ops, python_ms, _ = overhead.ops_and_python(run, "cpu", steps=5)
    assert calls == [False] * 5 and gc.isenabled()
    assert ops == 0 and 2 <= python_ms < 50, python_ms  # a mean of the five would be over 40 ms


def test_python_work_is_counted_call_by_call_and_the_same_every_run():
    def g():
        return None

    def once():
        g()

    def twice():
        g()
        g()

    assert overhead.python_calls(twice) - overhead.python_calls(once) == 1
    rows = [overhead.measure_cell("unet", "approx_dp", {"mode": "mc"}, "cpu", steps=1) for _ in range(2)]
    assert rows[0]["python calls"] == rows[1]["python calls"] > rows[0]["their python calls"] > 0


def test_a_plan_run_as_checkpoint_regions_is_measured_beside_the_executor_or_said_to_have_no_such_form():
    executor = overhead.measure_cell("gpt2", "chen_sqrt", {}, "cpu", steps=1)
    regions = overhead.measure_cell("gpt2", "chen_sqrt", {}, "cpu", steps=1, regions=True)
    assert regions["strategy"] == "chen_sqrt as checkpoint regions" and regions["wall ms"] > 0
    assert regions["recomputed calls"] == executor["recomputed calls"] > 0 and regions["ops"] > 0
    with pytest.raises(overhead.strategies.Inapplicable, match="BatchNorm2d"):
        overhead.measure_cell("resnet50", "chen_sqrt", {}, "cpu", steps=1, regions=True)
