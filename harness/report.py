"""Tables from result rows (read only through ``load_results``); labels for people live here.

``python -m harness.report TABLE ROWS_DIR OUT_STEM`` writes ``OUT_STEM.md`` and ``OUT_STEM.csv``:
- ``spine``: per net, the graph's size beside seed 004's #V and the measured and predicted peaks of
  ``vanilla`` and ``liveness_only`` beside the paper's vanilla figure;
- ``strategies``: per net and strategy, measured and predicted peaks and the reduction against vanilla,
  beside seed 004's Table 1.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import pandas as pd

from harness import nets
from harness.paper_numbers import TABLE1_GB
from harness.results import load_results

GB = 1e9


def spine_table(rows: pd.DataFrame) -> pd.DataFrame:
    rows = rows[rows.status == "ok"]
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
    """Per net and strategy: measured and predicted peak, reduction against vanilla, beside seed 004."""
    rows = rows[rows.status == "ok"].copy()
    rows["mode"] = [options.get("mode") or (f"on {options['base']}" if options.get("base") else "")
                    for options in rows.options]
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
                "vs vanilla": f"{100 * (row.measured_peak_bytes / base - 1):+.0f}%",
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


TABLES = {"spine": spine_table, "strategies": strategies_table}


def write(table: pd.DataFrame, stem: Path, command: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(stem.with_suffix(".csv"), index=False, float_format="%.3f")
    header = (f"Made by `{command}` on {datetime.date.today().isoformat()}; device and method in each row. "
              "Peaks in decimal GB, parameters, buffers and the input batch included.\n\n")
    stem.with_suffix(".md").write_text(header + table.to_markdown(index=False, floatfmt=".2f") + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.splitlines()[0])
    parser.add_argument("table", choices=sorted(TABLES))
    parser.add_argument("rows", type=Path, help="folder of result rows")
    parser.add_argument("out", type=Path, help="output path without suffix (.md and .csv are written)")
    args = parser.parse_args(argv)
    table = TABLES[args.table](load_results(args.rows))
    write(table, args.out, f"python -m harness.report {args.table} {args.rows} {args.out}")


if __name__ == "__main__":
    main()
