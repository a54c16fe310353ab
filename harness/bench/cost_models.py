"""What the cost model changes: ``python -m harness.bench.cost_models OUT_STEM [--device cpu|cuda]``.

Kusumoto et al.'s time-centric DP keeps, within the budget, the plan whose recomputations cost least, by a cost
model: ``paper`` (10 per convolution, 1 per other layer), ``flops``, or ``measured`` (each layer's forward
timed on the device; NOTE [measured costs] in ``harness/tracing/cost_models.py``). For one net: ``vanilla``, then
``approx_dp`` tc at ``--points`` budgets spread from its minimum towards vanilla's peak (vanilla's peak
left out), its plan found under each cost model, each run and timed on the device, eager (``--compile``:
compiled). Writes ``OUT_STEM.md`` and ``.csv``: per budget and cost model, the measured peak, the median
step time and its ratio to vanilla's, the layers recomputed, the step's FLOPs over vanilla's (predicted),
and for ``measured`` the step time it predicts (vanilla's step plus the forward time it recomputes); and
``OUT_STEM.png``, step time against budget, a line per cost model. Every run's row lands in ``--rows``
(resumable; ``--from-rows`` runs nothing and reads them). Guard the main of a script that calls this on
cuda: each cell runs in a spawned process.
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
from harness.bench.frontier import Cells  # noqa: E402
from harness.results import Status  # noqa: E402
from harness.tracing.cost_models import COST_MODELS  # noqa: E402
from harness.zoo import nets  # noqa: E402

SIZES = {"cpu": ("resnet50", 8, 128), "cuda": ("resnet152", 128, 224)}  # net, batch, side by default


def table(vanilla: dict, cells: list[tuple[int, str, dict]]) -> pd.DataFrame:
    base_ms, base_flops = vanilla["step_time_ms"], vanilla["predicted_step_flops"]
    out = []
    for budget, cost_model, row in cells:
        ran = row if row.get("status") == Status.OK else {}

        def per(field, scale):  # the run's ``field`` over ``scale``; None where it did not run
            return None if ran.get(field) is None else ran[field] / scale

        out.append({
            "budget GB": budget / 1e9, "cost model": cost_model, "status": row.get("status"),
            "peak GB": per("measured_peak_bytes", 1e9), "step ms": ran.get("step_time_ms"),
            "x vanilla": per("step_time_ms", base_ms),
            "IQR %": per("step_time_iqr_ms", ran.get("step_time_ms", 0) / 100),
            "layers recomputed": ran.get("recomputed_node_count"),
            "FLOPs x vanilla": per("predicted_step_flops", base_flops),
            "predicted ms": (base_ms + ran["predicted_overhead_cost"]
                             if cost_model == "measured" and ran.get("predicted_overhead_cost") is not None else None),
            "note": "" if ran else str(row.get("error", ""))[:80]})
    return pd.DataFrame(out).astype({"peak GB": float, "step ms": float, "x vanilla": float, "IQR %": float,
                                     "FLOPs x vanilla": float, "predicted ms": float})


def summary(points: pd.DataFrame) -> list[str]:
    """Per budget, each cost model's step against vanilla's, the fastest first."""
    lines = []
    for budget, group in points.groupby("budget GB"):
        ran = group.dropna(subset=["step ms"]).sort_values("step ms")
        if len(ran):
            lines.append(f"- at {budget:.3g} GB: " + "; ".join(
                f"{p['cost model']} {p['step ms']:.4g} ms ({p['x vanilla']:.2f}x vanilla's time, "
                f"{p['FLOPs x vanilla']:.3f}x its FLOPs, {p['layers recomputed']:.0f} layers recomputed)"
                for _, p in ran.iterrows()))
    return lines


def plot(points: pd.DataFrame, vanilla_ms: float, title: str, caption: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (cost_model, group) in enumerate(points.groupby("cost model", sort=False)):
        spread = group["step ms"] * group["IQR %"] / 200  # half the interquartile range each way
        ax.errorbar(group["budget GB"], group["step ms"], yerr=spread, marker="osD"[k % 3], color=f"C{k}", capsize=3,
                    label=f"approx_dp tc, {cost_model} cost model (bars: interquartile range)")
        if group["predicted ms"].notna().any():
            ax.plot(group["budget GB"], group["predicted ms"], linestyle=":", color=f"C{k}",
                    label=f"what the {cost_model} costs predict")
    ax.axhline(vanilla_ms, color="k", linestyle="--", linewidth=1, label="vanilla (holds more than every budget)")
    save_figure(fig, caption, path, ax, ("budget (GB)", "measured step time (ms, median)"), title)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.cost_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--device", default="cpu", choices=list(SIZES), help="meta holds no values to time")
    parser.add_argument("--net", help="a zoo net (default: resnet50 on cpu, resnet152 on cuda)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--side", type=int, help="input side (sequence length)")
    parser.add_argument("--points", type=int, default=4, help="budgets from approx_dp's minimum towards vanilla's peak")
    parser.add_argument("--cost-models", default=",".join(COST_MODELS), help=f"of {', '.join(COST_MODELS)}")
    parser.add_argument("--compile", action="store_true", help="every step under torch.compile")
    parser.add_argument("--timed-steps", type=int, default=15, help="steps timed per point, after 2 warm-ups")
    add_rows_options(parser)
    args = parser.parse_args(argv)
    net, batch, side = SIZES[args.device]
    args.net = args.net or net
    if args.net != net:  # the net's own sizes (Kusumoto et al.'s), named so that --from-rows finds its rows
        batch, side = nets.spec(args.net).batch_size, nets.spec(args.net).image_size
    args.batch, args.side = args.batch or batch, args.side or side
    cost_models = args.cost_models.split(",")
    if unknown := sorted(set(cost_models) - set(COST_MODELS)):
        raise SystemExit(f"unknown cost models {', '.join(unknown)}; valid: {', '.join(COST_MODELS)}")
    progress = tqdm(total=1 + args.points * len(cost_models), desc=f"cost models, {args.net}")
    cells = Cells(args.net, args.batch, args.side, args.device, args.rows, args.from_rows, args.timed_steps, progress)
    vanilla = cells.run("vanilla", compile=args.compile)
    least = cells.least("approx_dp")
    if vanilla.get("status") != Status.OK or least is None:
        raise SystemExit(f"{args.net}: vanilla gave {vanilla.get('status')} ({vanilla.get('error', '')}); "
                         f"approx_dp's minimum: {least}")
    top = vanilla["measured_peak_bytes"]
    budgets = np.linspace(least, top, args.points + 1)[:-1].astype(int) if top > least else [least]
    points = table(vanilla, [(int(budget), cost_model, cells.run("approx_dp", budget=int(budget), compile=args.compile,
                                                                 cost_model=cost_model))
                             for budget in budgets for cost_model in cost_models])
    progress.close()
    command = command_of("cost_models", argv)
    mode = "compiled" if args.compile else "eager"
    where = f"{vanilla.get('device_name') or args.device}, {mode}"
    sizes = f"{args.net}, batch {vanilla['batch_size']}, side {vanilla['image_size']}"
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    plot(points, vanilla["step_time_ms"], f"{sizes}: approx_dp tc's step time under each cost model\n"
         f"measured on {where}", f"{command}  ({datetime.date.today()})", args.out_stem.with_suffix(".png"))
    points.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.4g")
    lines = summary(points)
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}; {sizes}; measured on {where}. Vanilla: "
        f"{top / 1e9:.3g} GB, {vanilla['step_time_ms']:.4g} ms a step; approx_dp's least budget {least / 1e9:.3g} GB. "
        "`predicted ms` (measured cost model only): vanilla's step plus the forward time the plan recomputes, "
        "by the times measured before the run. Step times are medians; where two differ by less than their "
        "`IQR %`, the machine's noise may decide which is first.\n\n" + "\n".join(lines) + "\n\n"
        + points.to_markdown(index=False, floatfmt=".4g") + "\n")
    print("\n".join(lines))
    print(f"cost models: {args.out_stem}.md, .csv, .png")


if __name__ == "__main__":
    main()
