"""Tables from result rows (read only through ``load_results``); labels for people live here.

``python -m harness.bench.report TABLE ROWS_DIR [ROWS_DIR ...] OUT_STEM`` writes ``OUT_STEM.md`` and ``OUT_STEM.csv``
from the rows in the folders named, and no others:
- ``spine``: per net, the graph's size beside Kusumoto et al.'s #V and the measured and predicted peaks of
  ``vanilla`` and ``liveness_only`` beside the paper's vanilla figure;
- ``strategies``: per net and strategy, measured and predicted peaks and the reduction against vanilla,
  beside Kusumoto et al.'s Table 1;
- ``table1``: Kusumoto et al.'s Table 1 (peak GB and reduction against vanilla at the paper's sizes, DPs at their
  minimal budget) with ours beside each published cell: predicted, measured on meta, measured on each GPU card
  (a column per card: rows of two cards never share one);
- ``table2``: Kusumoto et al.'s Table 2 (appendix C, no liveness analysis) beside the simulator's no-liveness replay;
- ``transformers``: ``strategies`` on ``vit_b_16`` and ``gpt2``, with the goal against the PyTorch peers.

``WriteTable`` is a Hydra callback that writes a table when a sweep ends (``configs/sweep/table1.yaml``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from harness.bench.common import made_by
from harness.bench.paper_numbers import K40C_GB, OUT_OF_MEMORY, TABLE1_GB, TABLE2_GB
from harness.execute.peers import PEERS
from harness.results import Status, label, load_results, mode_of
from harness.zoo import nets

GB = 1e9


def spine_table(rows: pd.DataFrame) -> pd.DataFrame:
    rows = rows[rows.status == Status.OK]
    out = []
    for net in nets.available():
        cells = {s: rows[(rows.net == net) & (rows.strategy == s)] for s in ("vanilla", "liveness_only")}
        if any(c.empty for c in cells.values()):
            continue
        vanilla, liveness = cells["vanilla"].iloc[-1], cells["liveness_only"].iloc[-1]
        spec = nets.spec(net)
        out.append({
            "net": net, "batch": vanilla.batch_size, "input": f"{vanilla.image_size}x{vanilla.image_size}",
            "layers": vanilla.layer_count, "IR nodes": vanilla.node_count, "paper #V": spec.paper_nodes,
            "vanilla measured GB": vanilla.measured_peak_bytes / GB,
            "params GB": vanilla.measured_params_bytes / GB, "grads GB": vanilla.measured_grads_bytes / GB,
            "activations GB": vanilla.measured_activations_bytes / GB,
            "vanilla predicted GB": vanilla.predicted_peak_bytes / GB,
            "no-liveness model GB": vanilla.predicted_peak_no_liveness_bytes / GB,
            "liveness_only measured GB": liveness.measured_peak_bytes / GB,
            "static plan GB": liveness.plan_static_plan_bytes / GB + liveness.static_bytes / GB,
            "paper vanilla GB": spec.paper_vanilla_gb,
            "device": vanilla.device, "method": vanilla.method,
        })
    return pd.DataFrame(out)


def _ratio(value, unit) -> float:
    return float("nan") if value is None or pd.isna(value) else value / unit


def strategies_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per net and strategy: measured and predicted peak, reduction against vanilla, beside Kusumoto et al. 2019."""
    rows = rows[rows.status == Status.OK].copy()
    rows["mode"] = [mode_of(options) for options in rows.options]
    out = []
    for net in nets.available():
        cells = rows[rows.net == net]
        vanilla = cells[cells.strategy == "vanilla"]
        if vanilla.empty:
            continue
        base = vanilla.iloc[-1].measured_peak_bytes
        paper = TABLE1_GB.get(net, {})
        for (strategy, mode), group in cells.groupby(["strategy", "mode"], sort=False):
            row = group.iloc[-1]
            published = paper.get((strategy, mode))
            out.append({
                "net": net, "strategy": strategy + (f" ({mode})" if mode else ""), "batch": row.batch_size,
                "measured GB": row.measured_peak_bytes / GB,
                "vs vanilla": (f"{100 * (row.measured_peak_bytes / base - 1):+.0f}%"
                               if pd.notna(row.measured_peak_bytes) else "not run"),  # ilp_optimal: predicted only
                "predicted GB": _ratio(row.predicted_peak_bytes, GB),  # none for torch.compile's peer
                "model (no liveness) GB": _ratio(row.predicted_peak_no_liveness_bytes, GB),
                "overhead / forward": _ratio(row.predicted_overhead_cost, row.total_cost),
                "host GB": _ratio(row.get("plan_host_bytes"), GB),  # swap's copies
                "solve s": row.solve_time_s,
                "paper GB": published,
                "paper vs vanilla": (f"{100 * (published / paper[('vanilla', '')] - 1):+.0f}%"
                                     if published is not None else ""),
                "device": row.device,
            })
    return pd.DataFrame(out)


# Kusumoto et al.'s columns, then ours; labels as ``results.label`` makes them.
PAPER_ORDER = ("approx_dp (mc)", "approx_dp (tc)", "exact_dp (mc)", "exact_dp (tc)", "chen_sqrt", "vanilla",
               "liveness_only", "chen_greedy", "swap", "optimal (mc)")
LEAST = "optimal (mc)"  # the least memory any plan the executor runs reaches (strategies/optimal.py)


def card(row) -> str:
    """What a measured column is named after: the device for meta and cpu, the GPU's model for cuda
    (``NVIDIA H100 80GB HBM3`` -> ``H100``), so that rows of two cards never fill one column."""
    if row.device != "cuda":
        return row.device
    words = str(row.device_name).replace("NVIDIA ", "").split()
    return words[0] if words else "cuda"


def _latest_cells(rows: pd.DataFrame, where: str) -> dict[tuple[str, str], pd.Series]:
    """The newest eager row of each (net, label) measured on ``where`` (a ``card``) at the net's paper sizes and
    the minimal budget (a compiled step is another program: the frontier's compiled points stay out of Kusumoto
    et al.'s tables)."""
    cells = {}
    eager = rows[[card(row) == where for row in rows.itertuples()]]
    if "compiled" in eager:
        eager = eager[~eager.compiled.fillna(False).astype(bool)]
    for _, row in eager.sort_values("timestamp").iterrows():
        spec = nets.spec(row.net)
        if (row.batch_size, row.image_size, row.cost_model) != (spec.batch_size, spec.image_size, "paper"):
            continue
        if pd.notna(row.budget_bytes):
            continue
        cells[(row.net, label(row.strategy, row.options))] = row
    return cells


def _peak(row) -> str | float:
    """A measured peak in GB, or the status where the run did not produce one (oom, infeasible, ...)."""
    if row is None:
        return float("nan")
    return row.measured_peak_bytes / GB if row.status == Status.OK else row.status


def _vs(value, reference) -> str:
    ok = isinstance(value, float) and isinstance(reference, float) and reference > 0 and value == value
    return f"{100 * (value / reference - 1):+.0f}%" if ok else ""


def _paper_cell(published: dict, key: tuple[str, str]) -> tuple[str | float, str]:
    value = published.get(key)
    if value is None:
        return float("nan"), ""
    if value == OUT_OF_MEMORY:
        return f">={K40C_GB}", "oom"
    return value, _vs(value, published[("vanilla", "")])


def _ordered_labels(cells: dict, net: str) -> list[str]:
    names = {name for (n, name) in cells if n == net}
    return [name for name in PAPER_ORDER if name in names] + sorted(names - set(PAPER_ORDER))


def table1(rows: pd.DataFrame) -> pd.DataFrame:
    """Kusumoto et al.'s Table 1 with ours beside each cell: the simulator's prediction, and the measured peak on
    every device that has rows (meta: the tracker's live bytes; a GPU card, named by ``card``: the allocator's
    peak, with its step time)."""
    rows = rows[rows.strategy.isin({name.split(" ")[0] for name in PAPER_ORDER})]
    rows = rows[[o.get("memory_model") != "paper" for o in rows.options]]  # those are Table 2's
    cards = sorted({card(row) for row in rows.itertuples()}, key=lambda c: (c not in ("meta", "cpu"), c))
    by_device = {where: _latest_cells(rows, where) for where in cards}
    out = []
    for net in _paper_net_order():
        labels = _ordered_labels({k: v for cells in by_device.values() for k, v in cells.items()}, net)
        vanilla = {device: _peak(cells.get((net, "vanilla"))) for device, cells in by_device.items()}
        least = by_device.get("meta", {}).get((net, LEAST))
        for name in labels:
            any_row = next(cells[(net, name)] for cells in by_device.values() if (net, name) in cells)
            paper_gb, paper_vs = _paper_cell(TABLE1_GB.get(net, {}), (any_row.strategy, mode_of(any_row.options)))
            line = {"net": net, "strategy": name, "batch": any_row.batch_size,
                    "paper GB": paper_gb, "paper vs vanilla": paper_vs,
                    "predicted GB": _ratio(any_row.get("predicted_peak_bytes"), GB)}
            for device, cells in by_device.items():
                row = cells.get((net, name))
                line[f"{device} GB"] = _peak(row)
                line[f"{device} vs vanilla"] = _vs(line[f"{device} GB"], vanilla[device])
                if device not in ("meta", "cpu"):
                    line[f"{device} step ms"] = (row.step_time_ms if row is not None and row.status == Status.OK
                                                 else float("nan"))
            line["overhead / forward"] = _ratio(any_row.get("predicted_overhead_cost"), any_row.total_cost)
            if least is not None:  # on meta, the step's peak over the least's (the static part left out)
                line["meta step vs least"] = _ratio(_step_peak(by_device["meta"].get((net, name))), _step_peak(least))
                line["least proven"] = _least_status(least) if name == LEAST else ""
            out.append(line)
    table = pd.DataFrame(out)
    table.attrs["devices"] = "columns by device or card: " + _devices(by_device)
    return table


def _step_peak(row) -> float | None:
    """A measured row's peak less what is there before the step (parameters, buffers, the input batch), or None."""
    if row is None or row.status != Status.OK or pd.isna(row.get("static_bytes", float("nan"))):
        return None
    return row.measured_peak_bytes - row.static_bytes


def _least_status(row) -> str:
    """Whether the least memory's row is proven, or its gap to the bound."""
    if row.get("plan_optimal_status") == "optimal":
        return "proven"
    gap = row.get("plan_gap")
    return f"gap {100 * gap:.0f}%" if gap is not None and pd.notna(gap) else "not proven"


def _devices(by_device: dict) -> str:
    """Which machine and method stand behind each device's columns."""
    parts = []
    for device, cells in by_device.items():
        rows = [row for row in cells.values() if row.status == Status.OK]
        names = sorted({f"{row.device_name}, {row.method}, torch {row.torch_version}" for row in rows})
        parts.append(f"{device}: {'; '.join(names)}")
    return " | ".join(parts)


def table2(rows: pd.DataFrame) -> pd.DataFrame:
    """Kusumoto et al.'s Table 2 (no liveness analysis) beside the simulator's replay of each plan without it: every
    value and gradient held to the end of its stage (``simulate(..., liveness=False)``), parameters and
    the input batch included. Vanilla is the measured peak, as the paper's is: its framework frees on its
    own. The measured peak with liveness sits beside, for contrast. ``liveness_only`` and ``swap`` are left
    out: without liveness both are vanilla holding everything. The paper's own reductions in Table 2 are
    not against its vanilla column (3.2 GB is "-57%" of 9.4), so only its GB are printed."""
    rows = rows[rows.strategy.isin({name.split(" ")[0] for name in PAPER_ORDER} - {"liveness_only", "swap", "optimal"})]
    # The DPs' plans on Kusumoto et al.'s memory model (configs approx_dp_paper, ...), labelled as the paper's.
    paper_model = pd.Series([o.get("memory_model") == "paper" for o in rows.options], index=rows.index, dtype=bool)
    rows = rows[~rows.strategy.isin(["approx_dp", "exact_dp"]) | paper_model].copy()
    rows["options"] = [{k: v for k, v in o.items() if k != "memory_model"} for o in rows.options]
    cells = _latest_cells(rows, "meta")
    out = []
    for net in _paper_net_order():
        vanilla = _peak(cells.get((net, "vanilla")))
        for name in _ordered_labels(cells, net):
            row = cells[(net, name)]
            model = vanilla if name == "vanilla" else _ratio(row.get("predicted_peak_no_liveness_bytes"), GB)
            paper_gb, _ = _paper_cell(TABLE2_GB.get(net, {}), (row.strategy, mode_of(row.options)))
            out.append({"net": net, "strategy": name, "batch": row.batch_size, "paper GB (no liveness)": paper_gb,
                        "ours GB (no liveness)": model,
                        "ours vs vanilla": _vs(model, vanilla),
                        "over the K40c": "yes" if isinstance(model, float) and model > K40C_GB else "",
                        "measured GB (liveness)": _peak(row)})
    table = pd.DataFrame(out)
    table.attrs["devices"] = ("the no-liveness columns are the simulator's; the measured one is "
                              + _devices({"meta": cells}))
    return table


def _paper_net_order() -> list[str]:
    return [*TABLE1_GB, *(net for net in nets.available() if net not in TABLE1_GB)]


TRANSFORMERS = ("vit_b_16", "gpt2")


def transformers_table(rows: pd.DataFrame) -> pd.DataFrame:
    """``strategies`` on the zoo's transformers at their sizes, with the goal: ``approx_dp`` (mc) saves at
    least as much as the best PyTorch peer, net by net."""
    sizes = pd.Series([(r.batch_size, r.image_size) == (nets.spec(r.net).batch_size, nets.spec(r.net).image_size)
                       if r.net in TRANSFORMERS else False for r in rows.itertuples()], index=rows.index, dtype=bool)
    table = strategies_table(rows[sizes & rows.budget_bytes.isna()])
    table = table.drop(columns=["paper GB", "paper vs vanilla"])
    notes = []
    for net in TRANSFORMERS:
        cells = table[table.net == net].set_index("strategy")["measured GB"]
        peers = cells[cells.index.isin(PEERS)]
        if "approx_dp (mc)" not in cells or peers.empty:
            notes.append(f"- {net}: not enough rows for the goal")
            continue
        ours, best = cells["approx_dp (mc)"], peers.min()
        notes.append(f"- {net}: approx_dp (mc) {ours:.2f} GB against the best peer ({peers.idxmin()}) {best:.2f} GB: "
                     + ("met" if ours <= best else "NOT met"))
    table.attrs["notes"] = "Goal, approx_dp (mc) saves at least as much as the best peer:\n" + "\n".join(notes)
    return table


TABLES = {"spine": spine_table, "strategies": strategies_table, "table1": table1, "table2": table2,
          "transformers": transformers_table}


def write(table: pd.DataFrame, stem: Path, command: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(stem.with_suffix(".csv"), index=False, float_format="%.3f")
    where = table.attrs.get("devices", "device and method in each row")
    header = (f"{made_by(command)}; {where}. "
              "Peaks in decimal GB, parameters, buffers and the input batch included.\n\n")
    notes = f"\n{table.attrs['notes']}\n" if table.attrs.get("notes") else ""
    stem.with_suffix(".md").write_text(header + table.to_markdown(index=False, floatfmt=".2f") + "\n" + notes)


class WriteTable(Callback):
    """Hydra callback: when a sweep ends, write ``table`` from the rows in its ``results_dir`` to ``out``
    (``.md`` and ``.csv``), with the command that made it."""

    def __init__(self, table: str, out: str) -> None:
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; valid: {', '.join(sorted(TABLES))}")
        self.table, self.out = table, Path(out)

    def on_multirun_end(self, config, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # results_dir may name ${hydra:runtime.cwd}
        rows = load_results(config.results_dir)
        command = "python -m harness " + " ".join(config.hydra.overrides.task)
        write(TABLES[self.table](rows), self.out, command)
        print(f"{self.table}: {self.out.with_suffix('.md')}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("rows", type=Path, nargs="+", help="folders of result rows (only these are read)")
    parser.add_argument("out", type=Path, help="output path without suffix (.md and .csv are written)")
    args = parser.parse_args(argv)
    rows = pd.concat([load_results(folder) for folder in args.rows], ignore_index=True)
    folders = " ".join(str(folder) for folder in args.rows)
    write(TABLES[args.table](rows), args.out, f"python -m harness.bench.report {args.table} {folders} {args.out}")


if __name__ == "__main__":
    main()
