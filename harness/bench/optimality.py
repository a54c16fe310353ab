"""Every strategy's distance to the optimum: ``python -m harness.bench.optimality OUT_STEM``.

For each net (the zoo's at Kusumoto et al.'s sizes, GPT-2 and ViT-B/16) and four budgets (``approx_dp`` tc's
minimal budget, and 25%, 50% and 75% of the way from it to vanilla's peak; all by the replay, the graph's
values only): the least overhead ``optimal`` finds within ``--time-limit`` seconds, the lower bound it proves
(NOTE [a proven optimum in the replay's accounting] in ``strategies/optimal_model.py``), the best plan the executor
runs within the budget (``optimal``'s, or a DP's or Chen's where its search ended first) and the gap between the
two, and each strategy's predicted overhead at that budget as a ratio to that plan ("over": its plan does not
fit the budget). Writes ``OUT_STEM.md``, ``OUT_STEM.csv`` and one PNG per net (overhead against budget, the
best plan and the bound beneath the others); each cell is kept in ``OUT_STEM.cells/`` as it ends, and a run
resumes from them.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

import strategies
from harness.bench.common import command_of, made_by, plt, save_figure
from harness.bench.style import line_style, style
from harness.cell import Cell, make_cell
from harness.results import is_number, label, read_row, write_row
from harness.run import Built, build, plan
from harness.zoo import nets

GB = 1e9
FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # of the way from approx_dp tc's minimal budget to vanilla's peak
NETS = ("unet", "vgg19", "resnet50", "googlenet", "pspnet", "resnet152", "densenet161", "gpt2", "vit_b_16")
STRATEGIES = [("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"}), ("exact_dp", {"mode": "tc"}),
              ("exact_dp", {"mode": "mc"}), ("chen_greedy", {}), ("chen_sqrt", {}), ("torch_checkpoint_blocks", {}),
              ("torch_checkpoint_sequential", {}), ("ilp_optimal", {})]


def strategy_overhead(built: Built, cell: Cell, name: str, options: dict, budget: int,
                      limit_s: float) -> tuple[float | None, str]:
    """The predicted overhead of the strategy's plan at ``budget`` (the graph's, the static part left out), or
    None and why there is none."""
    if name in ("exact_dp", "ilp_optimal"):
        options = {**options, "time_limit_s": limit_s}
    try:
        chosen = plan(cell.but(strategy=name, options=options, budget_bytes=budget + built.static_bytes), built)
    except strategies.InfeasibleBudget:
        return None, "over"
    except strategies.SolverTimeout:
        return None, "timeout"
    except strategies.Inapplicable:
        return None, "not built"
    prediction = strategies.simulate(built.graph, chosen)
    if prediction.peak_bytes > budget:  # a plan with no budget to choose by (chen_sqrt, the peers)
        return None, "over"
    return prediction.overhead_cost, ""


def bench_cell(built: Built, cell: Cell, budget: int, limit_s: float) -> dict:
    """``optimal``'s plan at ``budget`` (the graph's), and every strategy's overhead beside it."""
    best = plan(cell.but(strategy="optimal", options={"time_limit_s": limit_s},
                         budget_bytes=budget + built.static_bytes), built)
    row = {"optimum": strategies.simulate(built.graph, best).overhead_cost, "lower bound": best.info["lower_bound"],
           "gap": best.info["gap"], "status": best.info["optimal_status"], "solve s": round(best.solve_time_s, 1),
           "plans replayed": best.info["plans_replayed"]}
    for name, options in STRATEGIES:
        overhead, why = strategy_overhead(built, cell, name, options, budget, limit_s)
        row[label(name, options)] = overhead
        row[label(name, options) + " note"] = why
    return row


def budgets(graph) -> tuple[int, int, list[int]]:
    least = strategies.simulate(graph, strategies.solve("approx_dp", graph)).peak_bytes
    vanilla = strategies.simulate(graph, strategies.solve("vanilla", graph)).peak_bytes
    return least, vanilla, [int(least + f * (vanilla - least)) for f in FRACTIONS]


def run(net_names, out: Path, limit_s: float) -> pd.DataFrame:
    cells = out.parent / (out.name + ".cells")
    cells.mkdir(parents=True, exist_ok=True)
    rows = []
    for net in tqdm(net_names, desc="nets"):
        built = None
        for k, fraction in enumerate(FRACTIONS):
            path = cells / f"{net}_{k}.json"
            if path.exists():
                rows.append(read_row(path))
                continue
            if built is None:
                cell = make_cell(net, "optimal")
                built = build(cell)
                least, vanilla, budget_list = budgets(built.graph)
            row = {"net": net, "batch": cell.batch_size, "nodes": len(built.graph), "of the way": fraction,
                   "budget GB": budget_list[k] / GB, "vanilla GB": vanilla / GB,
                   **bench_cell(built, cell, budget_list[k], limit_s)}
            write_row(row, cells, path.name)
            rows.append(row)
    return pd.DataFrame(rows)


RUNS = [label(name, options) for name, options in STRATEGIES if name in ("approx_dp", "exact_dp", "chen_greedy",
                                                                             "chen_sqrt")]  # the executor's plans


def best_known(table: pd.DataFrame) -> pd.DataFrame:
    """``best``: the least overhead of a plan the executor runs within the budget, ``optimal``'s or a
    strategy's where ``optimal``'s time ran out first (the peers' checkpointed blocks and the ILP's schedules
    are other spaces), and the gap between it and the lower bound."""
    table = table.copy()
    table["best"] = table[["optimum", *RUNS]].apply(pd.to_numeric, errors="coerce").min(axis=1)
    table["gap"] = [0.0 if s == "optimal" or b == 0 else (b - low) / b
                    for s, b, low in zip(table.status, table.best, table["lower bound"])]
    return table


def ratios(table: pd.DataFrame) -> pd.DataFrame:
    """Each strategy's overhead over the best plan known (1.00 where both are zero), or why there is none."""
    out = table[["net", "batch", "nodes", "of the way", "budget GB", "best", "optimum", "lower bound", "gap",
                 "status", "solve s"]].copy()
    for name, options in STRATEGIES:
        column = label(name, options)

        def ratio(row, column=column):
            value = row[column]
            if not is_number(value):
                return row[column + " note"]
            if row["best"] == 0:
                return "1.00" if value == 0 else "inf"
            return f"{value / row['best']:.2f}"
        out[column] = table.apply(ratio, axis=1)
    out["gap"] = [f"{100 * g:.0f}%" for g in out["gap"]]
    return out


def goals(table: pd.DataFrame) -> str:
    """The goals line: approx_dp tc's worst ratio, to the best plan known and to the bound, and what was proven."""
    column = label("approx_dp", {"mode": "tc"})
    proven = table[table.status == "optimal"]
    cells = table[table[column].notna() & (table.best > 0)]
    parts = [f"Proven optimal (gap 0) in {len(proven)} of {len(table)} cells "
             f"({', '.join(sorted(set(proven.net))) or 'none'})."]
    if not cells.empty:
        worst = cells.loc[(cells[column] / cells.best).idxmax()]
        parts.append(f"approx_dp (tc)'s worst ratio to the best plan known: {worst[column] / worst.best:.2f} "
                     f"({worst.net}, {worst['of the way']:.0%} of the way to vanilla); where proven, at most "
                     f"{(proven[column] / proven.best).max():.2f}." if not proven.empty else ".")
        bounded = cells[cells["lower bound"] > 0]
        if not bounded.empty:
            loose = bounded.loc[(bounded[column] / bounded["lower bound"]).idxmax()]
            parts.append(f"To the proven lower bound, where there is one, it is at most "
                         f"{loose[column] / loose['lower bound']:.2f} ({loose.net}, {loose['of the way']:.0%}).")
    return "Goals: " + " ".join(parts)


def figure(table: pd.DataFrame, net: str, path: Path, caption: str) -> None:
    cells = table[table.net == net].sort_values("budget GB")
    if len(cells) < 2:  # a single budget is no curve: no figure
        return
    fig, ax = plt.subplots(figsize=(9.5, 4.5))
    x = cells["budget GB"]
    ax.fill_between(x, cells["lower bound"], cells.best, color="0.85", label="between the bound and the best plan")
    ax.plot(x, cells.best, "k-", linewidth=2.5, label="best plan known (optimal where proven)")
    ax.plot(x, cells["lower bound"], "k--", linewidth=1, label="proven lower bound")
    drawn = [(label(name, options), pd.to_numeric(cells[label(name, options)], errors="coerce"))
             for name, options in STRATEGIES]
    drawn = [(column, values) for column, values in drawn if values.notna().any()]
    # Strategies often find the same plan: each line a little to the side of the last, so that none hides another.
    step = 0.006 * ((x.max() - x.min()) or 1)
    for k, (column, values) in enumerate(drawn):
        ax.plot(x + (k - (len(drawn) - 1) / 2) * step, values, **style(column), linestyle=line_style(column),
                markersize=5, linewidth=1, label=column)
    ax.set_xlabel("budget, GB (graph values; the replay's peak)")
    ax.set_ylabel("predicted recomputation overhead (cost units)")
    ax.set_title(f"{net}: overhead against budget, every strategy beside the best plan", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: lines overlap
    save_figure(fig, caption, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.optimality", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output path without suffix")
    parser.add_argument("--nets", default=",".join(NETS), help="comma-separated zoo nets")
    parser.add_argument("--time-limit", type=float, default=150.0,
                        help="seconds for each optimal search, and for exact_dp's and the ILP's solves")
    args = parser.parse_args(argv)
    if not args.time_limit > 0:
        parser.error(f"--time-limit must be positive, got {args.time_limit}")
    names = [n for n in args.nets.split(",") if n]
    unknown = [n for n in names if n not in nets.available()]
    if unknown:
        parser.error(f"unknown net {', '.join(unknown)}; valid: {', '.join(nets.available())}")
    table = best_known(run(names, args.out, args.time_limit))
    table.to_csv(args.out.with_suffix(".csv"), index=False)
    command = command_of("optimality", argv)
    header = (f"{made_by(command)}, {platform.processor() or platform.machine()}. Overheads "
              "are predicted by the replay, in cost units; each strategy's is a ratio to `best`, the least overhead "
              "of a plan the executor runs within the budget: `optimal`'s (searched for "
              f"{args.time_limit:g} s; the optimum where its status is `optimal`, gap 0) or a DP's or Chen's where "
              "that search ended first. `lower bound`: no plan the executor runs costs less; `gap`: between it and "
              "`best`. The ILP's schedules may compute a value more than twice and the PyTorch peers checkpoint "
              "blocks, plans outside that space: their ratios may be under 1. Budgets count the graph's values, as "
              "every strategy's solver does.\n\n")
    args.out.with_suffix(".md").write_text(header + ratios(table).to_markdown(index=False, floatfmt=".3f")
                     + "\n\n" + goals(table) + "\n")
    for net in dict.fromkeys(table.net):
        figure(table, net, args.out.parent / f"{args.out.name}_{net}.png", made_by(command))


if __name__ == "__main__":
    main()
