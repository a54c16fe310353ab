"""The entry point: configs, result rows, bad input, a tiny multirun."""

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import harness.run
import strategies
from harness.__main__ import net_name, net_options
from harness.results import load_results, umask
from harness.run import run_cell
from harness.zoo import nets

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


def stems(group):
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


SOURCES = {"torchvision": ["net.name=convnext_tiny"], "timm": ["net.name=resnet10t"],
           "module": ["net.target=my_pkg.models:build"], "hf": ["net.name=gpt2"]}


def test_every_config_composes():
    assert sorted(set(stems("net")) - set(SOURCES)) == nets.available()
    # The groups are independent: each net, strategy and device once, beside a first choice of the others.
    net_names, strategy_names, device_names = stems("net"), stems("strategy"), stems("device")
    choices = ([(net, strategy_names[0], device_names[0]) for net in net_names]
               + [(net_names[0], strategy, device_names[0]) for strategy in strategy_names]
               + [(net_names[0], strategy_names[0], device) for device in device_names])
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        for net, strategy, device in choices:
            cfg = compose("config", overrides=[f"+net={net}", f"+strategy={strategy}", f"device={device}",
                                               *SOURCES.get(net, [])])
            assert cfg.device.name == device
            assert net_name(cfg.net) == (net if net not in SOURCES else f"{net}:{SOURCES[net][0].split('=')[1]}")
            # approx_dp_mc is approx_dp with options of its own
            assert cfg.strategy.name == strategy or strategy.startswith(cfg.strategy.name + "_")
            fields = {f.name for f in dataclasses.fields(strategies.module(cfg.strategy.name).Options)}
            assert set(cfg.strategy.options) <= fields
        for sweep in stems("sweep"):
            compose("config", overrides=["+net=vgg19", "+strategy=vanilla", f"sweep={sweep}"])


def test_a_run_writes_one_row(tmp_path):
    row = run_cell("resnet50", "liveness_only", batch_size=2, image_size=64, results_dir=tmp_path)
    assert row["status"] == "ok" and row["device"] == "meta" and row["method"] == "meta-tracker"
    # The simulator replays what the executor does, to the byte.
    assert row["predicted_peak_bytes"] == row["measured_peak_bytes"]
    assert row["predicted_peak_no_liveness_bytes"] > row["predicted_peak_bytes"]
    assert row["plan_naive_bytes"] >= row["plan_static_plan_bytes"] > 0
    assert row["step_time_ms"] is None and row["paper_node_count"] == 176 and row["git_commit"] is not None
    table = load_results(tmp_path)
    assert len(table) == 1 and table.loc[0, "net"] == "resnet50"
    # Rows follow the umask (mkstemp alone makes 0600, unreadable to teammates on a shared file system).
    assert os.stat(row["row_path"]).st_mode & 0o777 == 0o666 & ~umask()


def test_a_copy_whose_git_is_stale_is_told_its_commit(monkeypatch):
    """A GPU node gets the working tree with a stale .git: the script that sends it tells the rows the commit it was sent at."""
    from harness.run import _environment

    here = _environment()
    assert len(here["git_commit"]) == 40 and isinstance(here["git_dirty"], bool)
    for told, dirty in (("0123abc", False), ("0123abc dirty", True)):
        monkeypatch.setenv("HARNESS_GIT_COMMIT", told)
        row = _environment()
        assert (row["git_commit"], row["git_dirty"]) == ("0123abc", dirty)


def test_an_unmeetable_budget_is_an_infeasible_row(tmp_path):
    row = run_cell("vgg19", "vanilla", batch_size=1, image_size=32, budget="1MB", results_dir=tmp_path)
    assert row["status"] == "infeasible" and row["min_feasible_bytes"] > 10**6
    assert "minimal feasible budget is" in row["error"]


def test_resume_skips_finished_cells(tmp_path):
    first = run_cell("unet", "vanilla", batch_size=1, image_size=188, results_dir=tmp_path)
    again = run_cell("unet", "vanilla", batch_size=1, image_size=188, results_dir=tmp_path, resume=True)
    assert again["timestamp"] == first["timestamp"]
    rerun = run_cell("unet", "vanilla", batch_size=1, image_size=188, results_dir=tmp_path)
    assert rerun["timestamp"] != first["timestamp"] and len(load_results(tmp_path)) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(net="resnet51", strategy="vanilla"), KeyError, "valid nets"),
    (dict(net="resnet50", strategy="vanila"), KeyError, "valid strategies"),
    (dict(net="resnet50", strategy="vanilla", device="tpu"), ValueError, "valid devices"),
    (dict(net="resnet50", strategy="vanilla", batch_size=0), ValueError, "at least 1"),
    (dict(net="resnet50", strategy="vanilla", budget="lots"), ValueError, "malformed budget"),
    (dict(net="resnet50", strategy="vanilla", cost_model="seconds"), ValueError, "valid: paper, flops, measured"),
    (dict(net="resnet50", strategy="vanilla", cost_model="measured"), ValueError, "use device=cpu or device=cuda"),
])
def test_bad_input_is_refused_before_anything_runs(kwargs, error, message):
    with pytest.raises(error, match=message):
        run_cell(**kwargs)


def _harness(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_tiny_multirun(tmp_path):
    done = _harness("-m", "+net=unet,vgg19", "+strategy=vanilla,liveness_only", "batch_size=1",
                    "image_size=188", f"results_dir={tmp_path / 'rows'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    table = load_results(tmp_path / "rows")
    assert sorted(zip(table.net, table.strategy)) == [("unet", "liveness_only"), ("unet", "vanilla"),
                                                      ("vgg19", "liveness_only"), ("vgg19", "vanilla")]
    assert set(table.status) == {"ok"}


@pytest.mark.slow
def test_command_line_errors_name_the_choices(tmp_path):
    done = _harness("+strategy=vanilla", cwd=tmp_path)
    assert done.returncode != 0 and "valid nets: densenet161" in done.stderr + done.stdout
    if torch.cuda.is_available():
        return  # device=cuda is valid here
    done = _harness("+net=resnet50", "+strategy=vanilla", "device=cuda", cwd=tmp_path)
    assert done.returncode != 0 and "no CUDA GPU" in done.stderr, "device=cuda ran without a GPU"


@pytest.mark.slow
def test_a_cell_whose_row_is_an_error_exits_non_zero_naming_it(tmp_path):
    (tmp_path / "broken_model.py").write_text(
        "import torch\n\n\nclass Broken(torch.nn.Module):\n    def forward(self, x):\n"
        "        raise RuntimeError('a forward that always fails')\n\n\ndef build():\n    return Broken()\n")
    done = _harness("+net=module", "net.target=broken_model:build", "+strategy=vanilla", "batch_size=1",
                    "image_size=8", f"results_dir={tmp_path / 'rows'}", cwd=tmp_path)
    assert done.returncode != 0
    assert "a forward that always fails" in done.stderr and "module:broken_model:build__vanilla" in done.stderr
    assert len(list((tmp_path / "rows").iterdir())) == 1  # the error row is written: a sweep records it and goes on
    sweep = _harness("-m", "+net=module", "net.target=broken_model:build", "+strategy=vanilla,chen_sqrt,liveness_only",
                     "batch_size=1", "image_size=8", f"results_dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert sweep.returncode != 0 and "3 cells ended in error" in sweep.stderr
    assert all(f"module:broken_model:build__{strategy}__" in sweep.stderr
               for strategy in ("vanilla", "chen_sqrt", "liveness_only"))
    assert len(list((tmp_path / "sweep").iterdir())) == 3  # every cell ran


@pytest.mark.slow
def test_bad_input_found_by_building_the_model_exits_with_one_line_and_no_row(tmp_path):
    done = _harness("+net=module", "net.target=os:getcwd", "+strategy=vanilla", f"results_dir={tmp_path / 'rows'}",
                    cwd=tmp_path)
    assert done.returncode != 0 and not (tmp_path / "rows").exists()
    assert done.stderr.strip() == "module model 'os:getcwd': the factory returned a str, not an nn.Module"


def test_a_run_in_bfloat16_holds_half_of_float32_and_says_so(tmp_path):
    rows = {dtype: run_cell("resnet50", "approx_dp", batch_size=4, image_size=64, dtype=dtype, results_dir=tmp_path)
            for dtype in ("float32", "bfloat16")}
    for dtype, row in rows.items():
        assert row["status"] == "ok" and row["dtype"] == dtype, row.get("error")
        assert row["predicted_peak_bytes"] == row["measured_peak_bytes"]
    assert 0.45 < rows["bfloat16"]["measured_peak_bytes"] / rows["float32"]["measured_peak_bytes"] < 0.55
    # The parameters and BatchNorm statistics halve; the counts of batches tracked stay int64.
    assert 0.5 < rows["bfloat16"]["measured_params_bytes"] / rows["float32"]["measured_params_bytes"] < 0.501
    assert Path(rows["bfloat16"]["row_path"]).name.endswith("__meta__bfloat16.json")
    assert Path(rows["float32"]["row_path"]).name.endswith("__meta.json")  # the names rows had before dtype
    with pytest.raises(ValueError, match="unknown dtype 'int8'; valid: float32, bfloat16, float16, float64"):
        run_cell("resnet50", "vanilla", dtype="int8")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        assert compose("config", overrides=["+net=resnet50", "+strategy=vanilla", "dtype=bfloat16"]).dtype.value == "bfloat16"


@pytest.mark.parametrize("override, message", [
    ("compile=maybe", "'maybe' is not a valid bool"),
    ("dtype=float8", "'float8', expected one of [float32, bfloat16, float16, float64]"),
    ("cost_model=seconds", "'seconds', expected one of [paper, flops, measured]"),
    ("batch_size=big", "'big' of type 'str' could not be converted to Integer"),
    ("resume=later", "'later' is not a valid bool"),
])
def test_the_configuration_refuses_a_value_of_the_wrong_type_naming_the_key(override, message):
    """``harness/config.py``: a typed schema under configs/config.yaml; a value it does not take fails before anything
    runs (``compile=maybe`` used to run compiled without a word)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        with pytest.raises(Exception) as refused:
            compose("config", overrides=["+net=resnet50", "+strategy=vanilla", override])
    chain, error = [], refused.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__
    assert message in "\n".join(chain) and f"full_key: {override.split('=')[0]}" in "\n".join(chain)


def test_any_model_from_the_command_line_configs(tmp_path, caplog):
    """``+net=torchvision net.name=...`` with builder options reaches run_cell; the row names the model and
    its options, and a bad name fails with the near matches."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["+net=torchvision", "net.name=vit_b_16", "+strategy=chen_sqrt",
                                           "+net.options.kwargs.image_size=32", "batch_size=2", "image_size=32"])
    assert net_name(cfg.net) == "torchvision:vit_b_16"
    assert net_options(cfg.net) == {"kwargs": {"image_size": 32}}  # defaults left out: they name the file
    row = run_cell(net_name(cfg.net), "chen_sqrt", batch_size=2, image_size=32, results_dir=tmp_path,
                   net_options=net_options(cfg.net))
    assert row["status"] == "ok", row.get("error")
    assert row["net"] == "torchvision:vit_b_16" and row["net_options"] == {"kwargs": {"image_size": 32}}
    assert row["paper_node_count"] is None and Path(row["row_path"]).exists()
    assert "image_size-32" in Path(row["row_path"]).name
    with pytest.raises(KeyError, match="near matches: convnext_tiny"):
        run_cell("torchvision:convnext_tiyn", "vanilla")
    small = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        config = [f"+net.options.kwargs.{key}={value}" for key, value in small.items()]
        cfg = compose("config", overrides=["+net=hf", "net.name=llama", "+strategy=approx_dp", "batch_size=2",
                                           "image_size=32", *config])
    assert net_name(cfg.net) == "hf:llama" and net_options(cfg.net) == {"kwargs": small}  # nulls left out too
    with caplog.at_level("INFO", logger="harness.run"):
        row = run_cell(net_name(cfg.net), "approx_dp", batch_size=2, image_size=32, results_dir=tmp_path,
                       net_options=net_options(cfg.net))
    assert row["status"] == "ok", row.get("error")
    assert "hf:llama / approx_dp: batch 2, 32 tokens, device meta -> ok" in caplog.text
    assert row["predicted_peak_bytes"] == row["measured_peak_bytes"]


# The entry point with one cell's measurement planted: a CUDA out-of-memory (batch 3), or a cell that hangs
# until it is killed (batch 4), each after a marker file says it started.
PLANTED = """
import pathlib, sys, time
import torch
import harness.run as run

measure, markers = run._measure_cell, pathlib.Path(sys.argv.pop(1))

def planted(cell, *rest):
    (markers / f"started_{cell.batch_size}").touch()
    if cell.batch_size == 3:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (planted)")
    if cell.batch_size == 4:
        time.sleep(600)
    return measure(cell, *rest)

run._measure_cell = planted
import runpy
runpy.run_module("harness", run_name="__main__")  # as ``python -m harness`` runs: Hydra finds configs/ so
"""


def _planted_harness(markers: Path, *args, cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return subprocess.Popen([sys.executable, "-c", PLANTED, str(markers), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_an_out_of_memory_is_an_oom_row_and_the_sweep_goes_on(tmp_path):
    rows = tmp_path / "rows"
    done = _planted_harness(tmp_path, "-m", "+net=vgg19", "+strategy=vanilla", "batch_size=3,2", "image_size=32",
                            f"results_dir={rows}", cwd=tmp_path)
    output, _ = done.communicate(timeout=600)
    assert done.returncode == 0, output
    table = load_results(rows).set_index("batch_size")
    assert table.loc[3, "status"] == "oom" and "out of memory" in table.loc[3, "error"]
    assert table.loc[2, "status"] == "ok" and table.loc[2, "measured_peak_bytes"] > 0


@pytest.mark.slow
def test_a_sweep_killed_mid_cell_resumes_where_it_stopped(tmp_path):
    rows = tmp_path / "rows"
    sweep = ["-m", "+net=vgg19", "+strategy=vanilla", "batch_size=2,4,5", "image_size=32", f"results_dir={rows}"]
    killed = _planted_harness(tmp_path, *sweep, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not (tmp_path / "started_4").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # the second cell hangs once it has started
    killed.kill()
    output, _ = killed.communicate()
    assert (tmp_path / "started_4").exists(), output
    first = [p.read_text() for p in rows.iterdir()]
    assert len(first) == 1 and '"batch_size": 2' in first[0]  # one row, whole; nothing of the killed cell
    done = _harness(*sweep, "resume=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    table = load_results(rows)
    assert sorted(table.batch_size) == [2, 4, 5] and set(table.status) == {"ok"}
    assert [p.read_text() for p in rows.iterdir() if '"batch_size": 2,' in p.read_text()] == first  # not rerun
    assert not list(rows.glob("*.tmp"))


def test_a_cell_measured_in_a_process_of_its_own_is_the_cell_measured_here(tmp_path, monkeypatch):
    """``isolate`` (the default on cuda: a CUDA OOM leaves its process's device full) on meta, where it costs
    one process start. Measuring is broken in this process: only a fresh one measures."""
    here = run_cell("vgg19", "chen_sqrt", batch_size=2, image_size=32)
    monkeypatch.setattr(harness.run, "_measure_cell", lambda cell, plan_out: 1 / 0)
    assert run_cell("vgg19", "chen_sqrt", batch_size=2, image_size=32)["status"] == "error"
    apart = run_cell("vgg19", "chen_sqrt", batch_size=2, image_size=32, isolate=True, results_dir=tmp_path)
    assert apart["status"] == "ok", apart.get("error")
    assert apart["measured_peak_bytes"] == here["measured_peak_bytes"] and load_results(tmp_path).shape[0] == 1


def test_meta_cells_on_one_net_and_size_share_a_trace_and_measure_what_fresh_cells_do(monkeypatch):
    """NOTE [traces kept between cells]: a sweep's meta cells on one net and size trace once; each measures to the
    byte what it measures traced afresh (a step's gradients left on the shared model would show here); a cell that
    compiles, or on another size, traces anew."""
    traced_net, traces = harness.run.traced_net, []

    def counted(*args, **kwargs):
        traces.append(args[:3])
        return traced_net(*args, **kwargs)

    monkeypatch.setattr(harness.run, "traced_net", counted)
    monkeypatch.setattr(harness.run, "_KEPT_TRACES", {})
    fields = ["status", "measured_peak_bytes", "predicted_peak_bytes", "measured_grads_bytes", "measured_step_flops"]
    cells = [("vanilla", {}), ("chen_sqrt", {}), ("approx_dp", {"budget": 1}), ("torch_checkpoint_blocks", {})]
    kept = [run_cell("resnet50", strategy, batch_size=2, image_size=32, **kwargs) for strategy, kwargs in cells]
    assert traces == [("resnet50", 2, 32)]
    fresh = []
    for strategy, kwargs in cells:
        harness.run._KEPT_TRACES.clear()
        fresh.append(run_cell("resnet50", strategy, batch_size=2, image_size=32, **kwargs))
    assert [[row.get(f) for f in fields] for row in kept] == [[row.get(f) for f in fields] for row in fresh]
    assert kept[1]["status"] == "ok" and kept[2]["status"] == "infeasible"
    traces.clear()
    run_cell("resnet50", "chen_sqrt", batch_size=2, image_size=32)
    run_cell("resnet50", "chen_sqrt", batch_size=4, image_size=32)
    run_cell("vgg19", "chen_sqrt", batch_size=1, image_size=32)
    run_cell("vgg19", "chen_sqrt", batch_size=1, image_size=32, compile=True)
    assert traces == [("resnet50", 4, 32), ("vgg19", 1, 32), ("vgg19", 1, 32)]


@pytest.mark.parametrize("overrides, message", [
    (["+strategy=approx_dp", "+strategy.option.mode=mc"], "unknown key strategy.option; valid keys there: base, name, options"),
    (["+strategy=approx_dp", "strategy.options.mode=xyz"], "unknown mode 'xyz'; valid modes: tc"),
    (["+strategy=approx_dp", "+strategy.options.budget=1"], "unknown key strategy.options.budget; valid keys there: mode"),
    (["+strategy=chen_sqrt", "+strategy.options.mode=mc"],
     "chen_sqrt has no memory-centric mode; strategies with one: approx_dp, brute_force, exact_dp, optimal"),
    (["+strategy=optimal", "strategy.options.time_limit_s=0"], "time_limit_s must be positive, got 0"),
    (["+strategy=exact_dp", "+strategy.options.time_limit_s=-1"], "time_limit_s must be positive"),
    (["+strategy=vanilla", "+net.depth=3"], "unknown key net.depth; valid keys there: name, options, source, target"),
    (["+strategy=vanilla", "+net=module", "net.target=a:b", "+net.options.kwarg.x=1"],
     "unknown key net.options.kwarg; valid keys there: channels, input, kwargs"),
])
def test_a_key_nothing_reads_or_an_option_refused_stops_the_run_before_anything_is_built(overrides, message,
                                                                                          monkeypatch):
    import harness.__main__ as entry

    monkeypatch.setattr(entry, "run", lambda *args, **kwargs: pytest.fail("the cell ran"))
    net = [] if any(o.startswith("+net=") for o in overrides) else ["+net=vgg19"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=[*net, *overrides])
    with pytest.raises(SystemExit, match=message.replace("(", r"\(")):
        entry.main.__wrapped__(cfg)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        entry.check_keys(compose("config", overrides=["+net=vgg19", "+strategy=approx_dp", "strategy.options.mode=mc"]))


def test_a_factory_that_returns_no_module_stops_the_run_with_one_line_and_no_row(tmp_path):
    import harness.__main__ as entry

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["+net=module", "net.target=os:getcwd", "+strategy=vanilla",
                                            f"results_dir={tmp_path}"])
    with pytest.raises(SystemExit, match=r"^module model 'os:getcwd': the factory returned a str, not an nn.Module$"):
        entry.main.__wrapped__(cfg)
    assert not list(tmp_path.iterdir())


def test_every_run_the_readme_shows_passes_the_checks_at_the_edge():
    """Each ``python -m harness +net=... +strategy=...`` line of the README composes, and no key of it is refused
    (``strategy.base`` is swap's own key, set in its config)."""
    import shlex

    from harness.__main__ import check_keys

    lines = [line.split("#")[0] for line in (ROOT / "README.md").read_text().splitlines()
             if line.startswith("python -m harness +net=")]
    assert len(lines) > 10
    for line in lines:
        overrides = [word.replace(",", " ").split()[0] if word.startswith("+") else word
                     for word in shlex.split(line)[3:]]
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            check_keys(compose("config", overrides=overrides))


def test_the_stages_example_in_the_harness_readme_runs_as_written(tmp_path, monkeypatch):
    """The README's stages, run as printed: the plan fits, the stages measure what ``run`` writes, and the least
    budget is below the cell's."""
    text = (Path(__file__).resolve().parent.parent / "harness" / "README.md").read_text()
    example = text.split("## A cell and its stages", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(example, scope)
    assert scope["row"]["status"] == "ok" and scope["row"]["measured_peak_bytes"] <= scope["cell"].budget_bytes
    assert scope["fields"]["measured_peak_bytes"] == scope["row"]["measured_peak_bytes"]
    assert scope["least_budget"](scope["cell"]) < scope["cell"].budget_bytes
    assert (tmp_path / "results" / "runs" / scope["cell"].name).exists()
