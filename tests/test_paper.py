"""Regenerating the papers: Table 1 and 2 from a sweep, the largest-batch search, Figure 3, the launchers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench import figure3, max_batch, report
from harness.bench.paper_numbers import TABLE1_GB, TABLE2_GB
from harness.bench.report import table1, table2
from harness.budget import parse_budget
from harness.results import load_results, stored_path, write_row
from harness.run import run_cell
from harness.zoo import nets
from test_run import ROOT, _harness


@given(largest=st.integers(0, 5000), guess=st.integers(1, 5000))
@settings(max_examples=300, deadline=None)
def test_largest_batch_finds_the_threshold_from_any_guess(largest, guess):
    probed = []

    def fits_at(batch):
        assert batch >= 1
        probed.append(batch)
        return batch <= largest

    assert max_batch.largest_batch(fits_at, guess) == largest
    assert len(probed) <= 2 * (5000).bit_length() + 2


def test_largest_batch_search_on_real_runs(tmp_path):
    rows_dir = tmp_path / "rows"
    max_batch.main([str(tmp_path / "mb"), "--nets", "vgg19", "--strategies", "vanilla,approx_dp",
                    "--memory", "2GB", "--rows", str(rows_dir)])
    table = pd.read_csv(tmp_path / "mb.csv")
    rows = load_results(rows_dir)
    assert set(table.strategy) == {"vanilla", "approx_dp (tc)", "approx_dp (mc)"}
    for _, found in table.iterrows():
        strategy, _, mode = found.strategy.partition(" (")
        options = rows.options.map(lambda o: o.get("mode", "")) == mode.rstrip(")")
        cells = rows[(rows.strategy == strategy) & options]
        at = cells[cells.batch_size == found["largest batch"]].iloc[-1]
        above = cells[cells.batch_size == found["largest batch"] + 1].iloc[-1]
        assert at.status == "ok" and at.measured_peak_bytes <= 2e9
        assert above.status != "ok" or above.measured_peak_bytes > 2e9
    largest = dict(zip(table.strategy, table["largest batch"]))
    # Recomputation fits more; the memory-centric DP at its minimal budget the most.
    assert largest["vanilla"] <= largest["approx_dp (tc)"] <= largest["approx_dp (mc)"]
    assert largest["vanilla"] < largest["approx_dp (mc)"]
    assert (tmp_path / "mb.md").read_text().startswith("Made by `python -m harness.bench.max_batch")


def test_a_device_search_starts_from_metas_answer(monkeypatch, tmp_path):
    """NOTE [searching on the device from meta's answer]: a device that adds a reserve of a few samples' bytes
    to meta's peak is searched in three probes (meta's answer, over; that less the overshoot's samples; one
    more), each measuring memory only, and gets the device's answer, not meta's."""
    memory = parse_budget("2GB")
    meta = max_batch.search("vgg19", "vanilla", {}, memory, "meta", tmp_path / "meta", None)
    on_meta = {}

    def meta_run(batch):
        if batch not in on_meta:
            on_meta[batch] = run_cell("vgg19", "vanilla", batch_size=batch, device="meta")
        return on_meta[batch]

    per_sample = (meta_run(2)["measured_peak_bytes"] - meta_run(1)["measured_peak_bytes"])
    reserve = int(3.5 * per_sample)
    probed = []

    def device_run(net, strategy, *, batch_size, budget, warmup_steps, timed_steps, **kwargs):
        assert (warmup_steps, timed_steps) == (0, 0)
        probed.append(batch_size)
        row = meta_run(batch_size)
        return {"status": "ok", "measured_peak_bytes": row["measured_peak_bytes"] + reserve,
                "measured_params_bytes": row["measured_params_bytes"], "device_reserve_bytes": reserve}

    monkeypatch.setattr(max_batch, "run_cell", device_run)
    found = max_batch.search("vgg19", "vanilla", {}, memory, "cuda", tmp_path / "cuda", None,
                             guess_from=tmp_path / "meta", timed_steps=0)
    largest = found["largest batch"]
    assert meta_run(largest)["measured_peak_bytes"] + reserve <= memory
    assert meta_run(largest + 1)["measured_peak_bytes"] + reserve > memory
    assert largest < meta["largest batch"] and probed[0] == meta["largest batch"] and len(probed) <= 3


def test_a_search_replayed_over_rows_it_lacks_says_so(tmp_path):
    """``--from-rows`` over a GPU run cut short: a search whose probes were not all run is a row that says which
    is missing, and the rest of the table is drawn."""
    max_batch.main([str(tmp_path / "mb"), "--nets", "vgg19", "--strategies", "vanilla", "--memory", "2GB",
                    "--rows", str(tmp_path / "none"), "--from-rows"])
    table = pd.read_csv(tmp_path / "mb.csv")
    assert table["largest batch"].isna().all()
    assert table["next batch"].str.startswith("not known: no row vgg19__vanilla__").all()


def test_figure3_on_meta(tmp_path):
    figure3.main([str(tmp_path / "f3"), "--nets", "resnet50", "--batches", "2,4,8,16", "--memory", "1GB",
                  "--rows", str(tmp_path / "rows")])
    table = pd.read_csv(tmp_path / "f3.csv")
    png = tmp_path / "f3_resnet50.png"
    assert png.stat().st_size > 10_000
    rows = load_results(tmp_path / "rows")
    for _, point in table.iterrows():  # a point fits exactly when its run is ok and within the memory
        row = rows[(rows.batch_size == point.batch) & (rows.strategy == point.curve.split(" ")[0])]
        assert point.fits == any((row.status == "ok") & (row.measured_peak_bytes <= 1e9))
    vanilla = table[(table.curve == "vanilla") & table.fits]
    assert len(vanilla) >= 2
    # On meta the time axis is FLOPs, exactly linear in the batch: the fitted line goes through vanilla.
    assert ((vanilla["vs vanilla line"] - 1).abs() < 1e-6).all()
    # Recomputation never costs less than the plain step; mc recomputes at least as much as tc.
    drawn = table[table.fits & table.time.notna()]
    assert (drawn["vs vanilla line"] >= 1 - 1e-9).all()
    # Drawn again from the stored rows alone, nothing run: the same figure.
    figure3.main([str(tmp_path / "again"), "--nets", "resnet50", "--batches", "2,4,8,16", "--memory", "1GB",
                  "--rows", str(tmp_path / "rows"), "--from-rows"])
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again.csv"), table)
    assert len(load_results(tmp_path / "rows")) == len(rows)
    # From rows, a point never run (batch 32 here) is left out; --curves draws only the curves named.
    figure3.main([str(tmp_path / "more"), "--nets", "resnet50", "--batches", "2,4,8,16,32", "--memory", "1GB",
                  "--rows", str(tmp_path / "rows"), "--from-rows"])
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "more.csv"), table)
    figure3.main([str(tmp_path / "two"), "--nets", "resnet50", "--batches", "4", "--memory", "1GB",
                  "--curves", "approx_dp (tc),chen_sqrt", "--rows", str(tmp_path / "rows"), "--from-rows"])
    two = pd.read_csv(tmp_path / "two.csv")
    assert sorted(two.curve) == ["approx_dp (tc)", "chen_sqrt"] and set(two.batch) == {4}
    with pytest.raises(SystemExit, match=r"unknown curves tc; valid: vanilla, approx_dp \(tc\)"):
        figure3.main([str(tmp_path / "bad"), "--nets", "resnet50", "--batches", "4", "--curves", "tc"])
    tc = drawn[drawn.curve == "approx_dp (tc)"].set_index("batch").time
    mc = drawn[drawn.curve == "approx_dp (mc)"].set_index("batch").time
    both = tc.index.intersection(mc.index)
    assert len(both) and (mc[both] >= tc[both] - 1e-9).all()
    # Kusumoto et al.'s claim, stated in the table: tc over Chen's at twice vanilla's largest fitting batch.
    twice = 2 * vanilla.batch.max()
    chen = drawn[drawn.curve == "chen_sqrt"].set_index("batch").time
    line, = figure3.tc_against_chen(table)
    if twice in tc.index and twice in chen.index:
        assert f"tc/Chen = {tc[twice] / chen[twice]:.2f}" in line
    else:
        assert "no fitting point" in line
    assert line in (tmp_path / "f3.md").read_text()
    # a curve with no row at that batch (a run cut short) is said to be unmeasured, not to not fit
    line, = figure3.tc_against_chen(table[table.curve != "chen_sqrt"])
    assert line.endswith("chen_sqrt not measured (no row)") and "fitting point of chen_sqrt" not in line


@pytest.mark.slow
def test_table_sweeps_write_tables_beside_the_paper(tmp_path):
    rows_dir = tmp_path / "rows"
    done = _harness("sweep=table1", "+net=vgg19", "+strategy=vanilla,approx_dp,approx_dp_mc",
                    f"results_dir={rows_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = load_results(rows_dir)
    assert len(rows) == 3 and set(rows.status) == {"ok"} and set(rows.batch_size) == {nets.spec("vgg19").batch_size}
    written = pd.read_csv(tmp_path / "results" / "table1.csv")
    assert written.strategy.tolist() == ["approx_dp (mc)", "approx_dp (tc)", "vanilla"]
    for _, line in written.iterrows():
        strategy, _, mode = line.strategy.partition(" (")
        row = rows[(rows.strategy == strategy) & (rows.options.map(lambda o: o.get("mode", "")) == mode.rstrip(")"))]
        assert line["meta GB"] == pytest.approx(row.measured_peak_bytes.iloc[0] / 1e9, abs=1e-3)
        assert line["paper GB"] == TABLE1_GB["vgg19"][(strategy, mode.rstrip(")"))]
    assert "python -m harness sweep=table1" in (tmp_path / "results" / "table1.md").read_text()

    done = _harness("sweep=table2", "+net=vgg19", "+strategy=vanilla,approx_dp_paper,approx_dp_mc_paper",
                    f"results_dir={rows_dir}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = load_results(rows_dir)
    assert len(rows) == 5  # vanilla not measured twice; the DPs again, on Kusumoto et al.'s memory model
    no_liveness = pd.read_csv(tmp_path / "results" / "table2.csv").set_index("strategy")
    vanilla = rows[rows.strategy == "vanilla"].iloc[0]
    paper_model = rows.options.map(lambda o: o.get("memory_model")) == "paper"
    dp = rows[(rows.strategy == "approx_dp") & (rows.options.map(lambda o: o.get("mode")) == "tc") & paper_model].iloc[0]
    assert table1(rows).strategy.tolist() == ["approx_dp (mc)", "approx_dp (tc)", "vanilla"]  # Table 2's stay out
    assert no_liveness.loc["vanilla", "ours GB (no liveness)"] == pytest.approx(
        vanilla.measured_peak_bytes / 1e9, abs=1e-3)
    assert no_liveness.loc["approx_dp (tc)", "ours GB (no liveness)"] == pytest.approx(
        dp.predicted_peak_no_liveness_bytes / 1e9, abs=1e-3)
    assert no_liveness.loc["approx_dp (tc)", "paper GB (no liveness)"] == TABLE2_GB["vgg19"][("approx_dp", "tc")]


def test_tables_put_every_device_beside_the_paper():
    base = {"net": "resnet50", "batch_size": 96, "image_size": 224, "cost_model": "paper", "budget_bytes": None,
            "total_cost": 100.0, "predicted_overhead_cost": 0.0, "predicted_peak_no_liveness_bytes": 20e9,
            "torch_version": "2.x"}
    meta = {"device_name": "meta", "method": "meta-tracker"}
    gpu = {"device_name": "NVIDIA H100 80GB HBM3", "method": "cuda-allocator+nvml+cuda-events"}
    rows = pd.DataFrame([
        {**base, **meta, "strategy": "vanilla", "options": {}, "device": "meta", "status": "ok", "timestamp": "1",
         "measured_peak_bytes": 8e9, "predicted_peak_bytes": 8e9},
        {**base, **gpu, "strategy": "vanilla", "options": {}, "device": "cuda", "status": "ok", "timestamp": "2",
         "measured_peak_bytes": 9e9, "predicted_peak_bytes": 8e9, "step_time_ms": 50.0},
        {**base, **meta, "strategy": "chen_sqrt", "options": {}, "device": "meta", "status": "ok", "timestamp": "3",
         "measured_peak_bytes": 4e9, "predicted_peak_bytes": 4e9},
        {**base, **gpu, "strategy": "chen_sqrt", "options": {}, "device": "cuda", "status": "oom", "timestamp": "4",
         "measured_peak_bytes": None, "predicted_peak_bytes": None},
    ])
    compiled = {**rows.iloc[2].to_dict(), "compiled": True, "timestamp": "5", "measured_peak_bytes": 3e9}
    other_card = {**rows.iloc[1].to_dict(), "device_name": "NVIDIA H200", "timestamp": "6", "step_time_ms": 45.0}
    rows = pd.concat([rows.assign(compiled=False), pd.DataFrame([compiled, other_card])], ignore_index=True)
    table = table1(rows)
    assert "H100: NVIDIA H100 80GB HBM3, cuda-allocator" in table.attrs["devices"]  # the md's first line says it
    assert "H200: NVIDIA H200, cuda-allocator" in table.attrs["devices"]
    table = table.set_index("strategy")
    assert table.loc["vanilla", "H100 GB"] == 9.0 and table.loc["vanilla", "meta GB"] == 8.0
    assert (table.loc["vanilla", "H100 step ms"], table.loc["vanilla", "H200 step ms"]) == (50.0, 45.0)  # one card each
    assert table.loc["chen_sqrt", "meta vs vanilla"] == "-50%"  # the newer compiled row is another program
    assert table.loc["chen_sqrt", "H100 GB"] == "oom"  # a run that did not fit says so
    assert table.loc["chen_sqrt", "paper GB"] == TABLE1_GB["resnet50"][("chen_sqrt", "")]
    assert table2(rows).set_index("strategy").loc["chen_sqrt", "ours GB (no liveness)"] == 20.0


def test_a_table_reads_only_the_row_folders_it_is_given(tmp_path):
    for folder, name in (("meta", "meta"), ("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200")):
        write_row({"schema_version": 2, "net": "resnet50", "strategy": "vanilla", "options": {}, "batch_size": 96,
                   "image_size": 224, "budget_bytes": None, "cost_model": "paper", "status": "ok",
                   "device": "meta" if folder == "meta" else "cuda", "device_name": name, "method": "m",
                   "torch_version": "2.x", "timestamp": folder, "measured_peak_bytes": 8e9, "total_cost": 1.0,
                   "predicted_peak_bytes": 8e9, "step_time_ms": 50.0}, tmp_path / folder)
    report.main(["table1", str(tmp_path / "meta"), str(tmp_path / "h100"), str(tmp_path / "t1")])
    written = (tmp_path / "t1.md").read_text()
    assert f"report table1 {tmp_path / 'meta'} {tmp_path / 'h100'} {tmp_path / 't1'}`" in written
    assert "H100 GB" in written and "H200" not in written  # the folder left out stays out


def test_slurm_launcher_asks_one_gpu_per_job():
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm_gpu", "+net=vgg19", "+strategy=vanilla"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert (cfg.hydra.launcher.gpus_per_node, cfg.hydra.launcher.tasks_per_node, cfg.hydra.launcher.nodes) == (1, 1, 1)


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_sweep(tmp_path):
    done = _harness("-m", "+net=vgg19", "+strategy=vanilla,chen_sqrt", "batch_size=2", "image_size=64",
                    "hydra/launcher=submitit_local", f"results_dir={tmp_path / 'rows'}",
                    f"hydra.sweep.dir={tmp_path / 'multirun'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = load_results(tmp_path / "rows")
    assert sorted(rows.strategy) == ["chen_sqrt", "vanilla"] and set(rows.status) == {"ok"}
    assert list(Path(tmp_path / "multirun").rglob("*_submitted.pkl"))  # the jobs went through submitit


def test_a_plan_that_overshoots_its_budget_runs_again_within_it(monkeypatch, tmp_path):
    asked = []

    def run_cell(net, strategy, *, budget, **kwargs):  # the plan fills its budget; the run measures 0.3 GB more
        asked.append(budget)
        if budget is None:
            return {"status": "ok", "measured_peak_bytes": 5 * 10**9}
        return {"status": "ok", "measured_peak_bytes": budget + 300_000_000 if len(asked) == 1 else budget}

    monkeypatch.setattr(max_batch, "run_cell", run_cell)
    row = max_batch.run_within("resnet50", "approx_dp", {"mode": "tc"}, 128, 10**10, "meta", tmp_path)
    assert asked == [10**10, 10**10 - 300_000_000] and max_batch.fits(row, 10**10)
    # A cuda row says what the device added beyond the accounting (its reserve): that comes off the budget.
    asked.clear()
    monkeypatch.setattr(max_batch, "run_cell", lambda net, strategy, *, budget, **kwargs: asked.append(budget) or {
        "status": "ok", "measured_peak_bytes": budget + 300_000_000 if len(asked) == 1 else budget - 200_000_000,
        "device_reserve_bytes": 500_000_000})
    row = max_batch.run_within("resnet50", "approx_dp", {"mode": "tc"}, 128, 10**10, "cuda", tmp_path / "reserve")
    assert asked == [10**10, 10**10 - 500_000_000] and max_batch.fits(row, 10**10)
    monkeypatch.setattr(max_batch, "run_cell", run_cell)
    asked.clear()
    max_batch.run_within("resnet50", "approx_dp", {"mode": "mc"}, 128, 10**10, "meta", tmp_path)
    assert asked == [None]  # the memory-centric DP runs at its minimal budget, once
    # Re-read from rows stored before the retry existed (the H100's Figure 3): the first run's row stands.
    stored = {"status": "ok", "measured_peak_bytes": 10**10 + 300_000_000}
    first = stored_path(tmp_path / "old", "resnet50", "approx_dp", batch_size=128, device="cuda",
                        image_size=nets.spec("resnet50").image_size, budget_bytes=10**10, options={"mode": "tc"})
    write_row(stored, first.parent, first.name)
    row = max_batch.run_within("resnet50", "approx_dp", {"mode": "tc"}, 128, 10**10, "cuda", tmp_path / "old",
                               from_rows=True)
    assert row == stored and not max_batch.fits(row, 10**10)


def test_table1_gives_every_step_peak_over_the_least_memory_and_whether_it_is_proven():
    base = {"net": "vgg19", "batch_size": 64, "image_size": 224, "cost_model": "paper", "budget_bytes": None,
            "total_cost": 100.0, "predicted_overhead_cost": 0.0, "device": "meta", "status": "ok", "compiled": False,
            "device_name": "meta", "method": "meta-tracker", "torch_version": "2.x", "static_bytes": 1e9}
    rows = pd.DataFrame([
        {**base, "strategy": "vanilla", "options": {}, "timestamp": "1", "measured_peak_bytes": 9e9},
        {**base, "strategy": "chen_sqrt", "options": {}, "timestamp": "2", "measured_peak_bytes": 5e9},
        {**base, "strategy": "optimal", "options": {"mode": "mc"}, "timestamp": "3", "measured_peak_bytes": 3e9,
         "plan_optimal_status": "timeout", "plan_gap": 0.25},
    ])
    table = table1(rows).set_index("strategy")
    assert table.loc["chen_sqrt", "meta step vs least"] == 2.0  # (5 - 1) / (3 - 1): the static part left out
    assert table.loc["vanilla", "meta step vs least"] == 4.0 and table.loc["optimal (mc)", "meta step vs least"] == 1.0
    assert table.loc["optimal (mc)", "least proven"] == "gap 25%" and table.loc["chen_sqrt", "least proven"] == ""
    rows.loc[2, "plan_optimal_status"] = "optimal"
    assert table1(rows).set_index("strategy").loc["optimal (mc)", "least proven"] == "proven"
    assert "meta step vs least" not in table1(rows[rows.strategy != "optimal"]).columns
