"""Kusumoto et al.'s Figure 3, step time against batch size: ``python -m harness.bench.figure3 OUT_STEM
[--device cuda]``.

Per net (ResNet-152 and PSPNet by default), over batch sizes beyond vanilla's largest, on a device of
``--memory`` (11.4 GB, the paper's K40c): ``vanilla`` where it fits, with its straight-line fit extended
over every batch (the paper's extrapolation), ``approx_dp`` time-centric with the memory as its budget
(less the device reserve a first run measured: ``harness.bench.max_batch.run_within``), ``approx_dp`` memory-centric at
its minimal budget, and Chen's sqrt(n) (``chen_sqrt``, the paper's "Chen's").
A point is drawn where its run is ``ok`` and its measured peak is within the memory; a curve stops at its
first batch that does not fit (larger ones are not run).

The time axis: on ``cuda`` the measured step time (median of the timed steps, CUDA events); on ``meta`` the
cost model's prediction, the FLOPs of one step (forward, recomputation, backward at twice its forward;
``predicted_step_flops``), in TFLOP. The plot's axis and title say which. Every run's row lands in
``--rows`` (resumable; ``--from-rows`` draws from stored rows without running); writes ``OUT_STEM.csv``,
``.md`` and one PNG per net, ``OUT_STEM_NET.png``.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from tqdm import tqdm  # noqa: E402

from harness.bench.common import add_rows_options, command_of, made_by, save_figure  # noqa: E402
from harness.bench.max_batch import fits, run_within  # noqa: E402
from harness.bench.style import line_style, style  # noqa: E402
from harness.budget import parse_budget  # noqa: E402
from harness.results import DEVICE_TIME_NOTE, Status, device_time, label  # noqa: E402

BATCHES = {"resnet152": [16, 32, 48, 64, 96, 128, 160, 192, 224, 256], "pspnet": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}
CURVES = [("vanilla", {}), ("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"}), ("chen_sqrt", {})]


def time_axis(device: str) -> tuple[str, str]:
    """(row field, axis label) of the time axis on ``device``."""
    if device == "meta":
        return "predicted_step_flops", "predicted TFLOP per step (cost model)"
    return "step_time_ms", "measured step time (ms, median)"


def points(rows: pd.DataFrame, memory: int) -> pd.DataFrame:
    """One line per run: net, curve, batch, whether it fits ``memory``, its peak and its time value."""
    out = []
    for _, row in rows.iterrows():
        field, _ = time_axis(row.device)
        value = row.get(field) if row.status == Status.OK else None
        scale = 1e-12 if field == "predicted_step_flops" else 1.0
        out.append({"net": row.net, "curve": label(row.strategy, row.options), "batch": int(row.batch_size),
                    "status": row.status, "fits": fits(row.to_dict(), memory),
                    "peak GB": row.get("measured_peak_bytes", float("nan")) / 1e9 if row.status == Status.OK else None,
                    "time": value * scale if value is not None and not pd.isna(value) else None,
                    "device": row.device, **(device_time(row) if row.device == "cuda" else {})})
    return pd.DataFrame(out).sort_values(["net", "curve", "batch"])


def with_extrapolation(table: pd.DataFrame) -> pd.DataFrame:
    """Adds, per net, vanilla's least-squares line through its fitting points at every batch, and each
    point's time over it."""
    table = table.copy()
    table["vanilla line"] = np.nan
    for net, group in table.groupby("net"):
        vanilla = group[(group.curve == "vanilla") & group.fits & group.time.notna()]
        if len(vanilla) >= 2:
            slope, intercept = np.polyfit(vanilla.batch, vanilla.time.astype(float), 1)
            table.loc[group.index, "vanilla line"] = intercept + slope * group.batch
    table["vs vanilla line"] = table.time.astype(float) / table["vanilla line"]
    return table


def tc_against_chen(table: pd.DataFrame) -> list[str]:
    """Per net, Kusumoto et al.'s claim tested: at twice vanilla's largest fitting batch, ``approx_dp`` (tc)'s time
    over ``chen_sqrt``'s (the paper: tc 1.16x faster, a ratio of 0.86)."""
    lines = []
    for net, group in table.groupby("net"):
        vanilla = group[(group.curve == "vanilla") & group.fits]
        if vanilla.empty:
            lines.append(f"{net}: vanilla fits no batch tried")
            continue
        batch = 2 * int(vanilla.batch.max())
        at = {curve: group[(group.curve == curve) & (group.batch == batch) & group.fits & group.time.notna()]
              for curve in ("approx_dp (tc)", "chen_sqrt")}
        measured = {curve for curve in at if ((group.curve == curve) & (group.batch == batch)).any()}
        unmeasured = [curve for curve in at if curve not in measured]
        unfit = [curve for curve, rows in at.items() if rows.empty and curve in measured]
        if unmeasured or unfit:
            said = []
            if unfit:
                said.append(f"no fitting point of {' and '.join(unfit)}")
            if unmeasured:
                said.append(f"{' and '.join(unmeasured)} not measured (no row)")
            lines.append(f"{net}: at batch {batch} (twice vanilla's {batch // 2}) " + "; ".join(said))
            continue
        tc, chen = (float(rows.time.iloc[0]) for rows in at.values())
        gpu = [rows["GPU ms"].iloc[0] if "GPU ms" in rows else None for rows in at.values()]
        in_gpu_time = (f"; in GPU kernel time {gpu[0] / gpu[1]:.2f}" if all(g is not None and not pd.isna(g)
                                                                             for g in gpu) else "")
        lines.append(f"{net}: at batch {batch} (twice vanilla's {batch // 2}), tc/Chen = {tc / chen:.2f} "
                     f"(tc {chen / tc:.2f}x faster; the paper: 1.16x){in_gpu_time}")
    return lines


def plot(table: pd.DataFrame, net: str, memory: int, device: str, device_name: str, caption: str,
         path: Path) -> None:
    group = table[table.net == net]
    if (group.fits & group.time.notna()).sum() < 2:  # a single point is no curve: no figure
        return
    _, axis_label = time_axis(device)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for curve in [label(s, o) for s, o in CURVES]:
        drawn = group[(group.curve == curve) & group.fits & group.time.notna()]
        if drawn.empty:  # the legend lists only what is drawn
            continue
        ax.plot(drawn.batch, drawn.time, **style(curve), linestyle=line_style(curve), label=curve,
                zorder=3 if curve == "vanilla" else 2)
    line = group.drop_duplicates("batch").sort_values("batch")
    if line["vanilla line"].notna().any():
        ax.plot(line.batch, line["vanilla line"], "k--", linewidth=1, label="vanilla, extrapolated (linear)")
    save_figure(fig, caption, path, ax, ("batch size", axis_label),
                f"{net}: step time against batch size within {memory / 1e9:g} GB\n{device_name}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.figure3", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--nets", default=",".join(BATCHES), help=f"comma-separated, of {', '.join(BATCHES)}")
    parser.add_argument("--device", default="meta", choices=["meta", "cuda"])
    parser.add_argument("--memory", default="11.4GB", help="the device memory every point must fit")
    parser.add_argument("--timed-steps", type=int, default=5, help="cuda: steps timed per point, after 2 warm-ups")
    parser.add_argument("--batches", help="comma-separated batch sizes for every net (default: BATCHES)")
    parser.add_argument("--curves", help="comma-separated labels, of " + ", ".join(label(s, o) for s, o in CURVES)
                        + " (default: all)")
    add_rows_options(parser, from_rows="draw from the rows in --rows (made where --device was); a point with no "
                                      "row is left out")
    args = parser.parse_args(argv)
    memory = parse_budget(args.memory)
    names = args.nets.split(",")
    unknown = sorted(set(names) - set(BATCHES)) if args.batches is None else []
    if unknown:
        raise SystemExit(f"no batch sizes for {', '.join(unknown)} (give --batches); nets with them: "
                         f"{', '.join(BATCHES)}")
    batches = {net: [int(b) for b in args.batches.split(",")] if args.batches else BATCHES[net] for net in names}
    labels = [label(strategy, options) for strategy, options in CURVES]
    chosen = labels if args.curves is None else args.curves.split(",")
    unknown = sorted(set(chosen) - set(labels))
    if unknown:
        raise SystemExit(f"unknown curves {', '.join(unknown)}; valid: {', '.join(labels)}")
    curves = [curve for curve, name in zip(CURVES, labels) if name in chosen]
    cells = [(net, batch, strategy, options) for net in names for strategy, options in curves
             for batch in batches[net]]
    rows, past_the_end = [], set()
    progress = tqdm(cells, desc="figure 3")
    for net, batch, strategy, options in progress:
        curve = (net, label(strategy, options))
        if curve in past_the_end:  # a larger batch than one that did not fit: not run
            continue
        progress.set_postfix_str(f"{net} {curve[1]} batch {batch}")
        row = run_within(net, strategy, options, batch, memory, args.device, args.rows, args.from_rows,
                         warmup_steps=2, timed_steps=args.timed_steps, missing_ok=args.from_rows)
        if row is None:  # --from-rows: this point was not run
            continue
        rows.append(row)
        if not fits(row, memory):
            past_the_end.add(curve)
    table = with_extrapolation(points(pd.DataFrame(rows), memory))
    command = command_of("figure3", argv)
    machines = sorted({row["device_name"] for row in rows if row.get("device_name")})
    device_name = (f"measured on {', '.join(machines)}" if args.device == "cuda"
                   else "meta device: the time axis is the cost model's prediction")
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    for net in names:
        plot(table, net, memory, args.device, device_name, f"{command}  ({datetime.date.today()})",
             Path(f"{args.out_stem}_{net}.png"))
    table.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.4g")
    _, axis_label = time_axis(args.device)
    claims = tc_against_chen(table)
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}; {device_name}. Time: {axis_label}. A point fits when "
        f"its run is `ok` and its measured peak is within {memory / 1e9:g} GB; `vs vanilla line` is its time "
        "over vanilla's straight-line fit at the same batch."
        + (f" {DEVICE_TIME_NOTE}" if args.device == "cuda" else "")
        + "\n\n"
        + "".join(f"- {line}\n" for line in claims) + "\n"
        + table.to_markdown(index=False, floatfmt=".3g") + "\n")
    print("\n".join(claims))
    print(f"figure 3: {args.out_stem}.md, .csv, " + ", ".join(f"{args.out_stem}_{n}.png" for n in names))


if __name__ == "__main__":
    main()
