"""Does a prediction hold? ``python -m harness.bench.fidelity OUT_STEM [--rows DIR] [--nets a,b]``.

Every strategy that makes a plan in the IR, on the seven nets of Kusumoto et al. 2019 at its batch and at four times
it, and on the zoo's two transformers (ViT-B/16, GPT-2) at their batch and four times it, on ``meta``: the
simulator's predicted peak beside the tracker's measured one, and their gap (``(measured - predicted) /
measured``). Strategies that take a budget (the tc DPs, ``chen_greedy``,
``swap``) run again with one: halfway between the least memory ``approx_dp`` (mc) measured and
``vanilla``'s, and the row says whether the measured peak overshot it. One result row per run lands in
``--rows`` (default ``results/rows_fidelity_meta``, committed); a killed run resumes. Writes
``OUT_STEM.md`` (with the worst gaps and the overshoots) and ``OUT_STEM.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness.bench.common import command_of, made_by
from harness.results import Status, label, load_results
from harness.run import run_cell
from harness.zoo import nets

GB = 1e9
UNBUDGETED = [("vanilla", {}), ("liveness_only", {}), ("chen_sqrt", {}), ("chen_greedy", {}),
              ("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"}), ("exact_dp", {"mode": "tc"}),
              ("exact_dp", {"mode": "mc"}), ("torch_checkpoint_blocks", {}), ("torch_checkpoint_sequential", {}),
              ("swap", {})]
BUDGETED = [("approx_dp", {"mode": "tc"}), ("exact_dp", {"mode": "tc"}), ("chen_greedy", {}), ("swap", {})]
NETS = [*nets.PAPER_NETS, "vit_b_16", "gpt2"]


def cells(net: str, batch: int, rows_dir: Path) -> list[dict]:
    """Run (or resume) every cell of one net and batch; the budgeted ones need two unbudgeted rows first."""
    done = [run_cell(net, strategy, batch_size=batch, options=options, results_dir=rows_dir, resume=True)
            for strategy, options in UNBUDGETED]
    least = next(r for r in done if r["strategy"] == "approx_dp" and r["options"]["mode"] == "mc")
    vanilla = next(r for r in done if r["strategy"] == "vanilla")
    if least["status"] != Status.OK or vanilla["status"] != Status.OK:
        return done
    budget = (least["measured_peak_bytes"] + vanilla["measured_peak_bytes"]) // 2
    return done + [run_cell(net, strategy, batch_size=batch, options=options, budget=budget, results_dir=rows_dir,
                            resume=True) for strategy, options in BUDGETED]


def table(rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    rows = rows[(rows.device == "meta") & rows.net.isin(NETS)].copy()
    out = []
    for row in rows.itertuples():
        measured, predicted, budget = row.measured_peak_bytes, row.predicted_peak_bytes, row.budget_bytes
        ok = row.status == Status.OK and pd.notna(measured) and pd.notna(predicted)
        out.append({
            "net": row.net, "batch": row.batch_size, "strategy": label(row.strategy, row.options),
            "budget GB": budget / GB if pd.notna(budget) else None,
            "predicted GB": predicted / GB if ok else None, "measured GB": measured / GB if ok else None,
            "gap": (measured - predicted) / measured if ok else None,
            "overshoot": ("yes" if ok and pd.notna(budget) and measured > budget else
                          "" if ok or row.status != Status.INFEASIBLE else "infeasible"),
            "status": row.status,
        })
    table = pd.DataFrame(out).sort_values(["net", "batch", "strategy", "budget GB"], na_position="first")
    done = table.dropna(subset=["gap"])
    worst = done.loc[done.gap.abs().sort_values(ascending=False).index[:10]]
    ours = done[~done.strategy.str.startswith("torch_")]  # the PyTorch peers' plans only approximate them
    lines = [f"- runs: {len(table)}; with a prediction and a measurement: {len(done)}; worst gap "
             f"{100 * done.gap.abs().max():.1f}%; gaps over 1%: {(done.gap.abs() > 0.01).sum()}; budget "
             f"overshoots: {(table.overshoot == 'yes').sum()} of {table['budget GB'].notna().sum()} budgeted runs",
             f"- without the PyTorch peers (which run torch.utils.checkpoint itself, predicted by their IR "
             f"plans' replay with checkpointed stages): worst gap "
             f"{100 * ours.gap.abs().max():.2f}%; gaps over 1%: {(ours.gap.abs() > 0.01).sum()} of {len(ours)}",
             "- the ten worst: " + "; ".join(f"{r['net']} b{r['batch']} {r['strategy']}"
                                             + (f" at {r['budget GB']:.2f} GB" if pd.notna(r["budget GB"]) else "")
                                             + f" {100 * r['gap']:+.1f}%" for r in worst.to_dict("records"))]
    table["gap"] = table.gap.map(lambda g: "" if pd.isna(g) else f"{100 * g:+.1f}%")
    return table, "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.fidelity", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output path without suffix (.md and .csv are written)")
    parser.add_argument("--rows", type=Path, default=Path("results/rows_fidelity_meta"))
    parser.add_argument("--nets", default=",".join(NETS))
    args = parser.parse_args(argv)
    work = [(net, factor * nets.spec(net).batch_size) for net in args.nets.split(",") for factor in (1, 4)]
    for net, batch in tqdm(work, desc="fidelity", file=sys.stdout):
        cells(net, batch, args.rows)
    out, summary = table(load_results(args.rows))
    command = command_of("fidelity", argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(args.out.with_suffix(".csv"), index=False, float_format="%.3f")
    header = (f"{made_by(command)}; meta (meta-tracker) for the "
              "measured peaks, the simulator's liveness replay for the predicted. Peaks in decimal GB, "
              "parameters, buffers and the input batch included.\n\n")
    args.out.with_suffix(".md").write_text(header + summary + "\n\n" + out.to_markdown(index=False, floatfmt=".2f") + "\n")
    print(summary)


if __name__ == "__main__":
    main()
