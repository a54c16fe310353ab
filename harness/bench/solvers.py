"""Solve time of the DPs on the zoo nets (traced at the paper's sizes) and on the paper's own graphs.

``python -m harness.bench.solvers results/solve_times`` writes ``.md`` and ``.csv``: per graph, strategy and
mode, the lower sets in the family, the minimal feasible budget by Kusumoto et al.'s model (parameters and
input excluded) and by the replay (every strategy's budget), and the wall time of ``strategies.solve``
(median of ``--repeat`` runs) for the minimal budget and for one budget, 1.05x the replay's minimum, with the
plan's overhead there. The goals: a budgeted solve in at most 0.2 s (``approx_dp``) and 1 s (``exact_dp``) on
Kusumoto et al.'s seven nets (the zoo's others are reported beside). A minimal mc solve searches the replay
(seconds). The DPs' kernels are compiled by numba on first use and cached on disk; a warm-up solve on a
toy graph loads them first, and its time is reported on its own.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numba
import pandas as pd
from tqdm import tqdm

from harness.bench.common import made_by
import strategies
from harness.cell import make_cell
from harness.run import build
from harness.zoo import nets, paper_graphs
from strategies.lower_sets import all_lower_sets

CELLS = [(s, m) for s in ("approx_dp", "exact_dp") for m in ("tc", "mc")]
BUDGETED = 1.05  # the budget of the timed budgeted solve, over the replay's minimum
GOALS_S = {"approx_dp": 0.2, "exact_dp": 1.0}


def graphs(paper_dir: Path):
    for name in nets.available():
        yield f"zoo/{name}", build(make_cell(name, "approx_dp")).graph
    for name, path in paper_graphs.available(paper_dir).items():
        yield f"paper/{name}", paper_graphs.load(path)


def bench(graph, strategy: str, mode: str, repeat: int, max_lower_sets: int | None) -> dict:
    if strategy == "exact_dp" and max_lower_sets is not None:
        count = len(all_lower_sets(graph))
        if count > max_lower_sets:
            return {"strategy": strategy, "mode": mode, "lower sets": count,
                    "note": f"not run: more than --max-lower-sets {max_lower_sets} lower sets"}
    times, budgeted = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        plan = strategies.solve(strategy, graph, mode=mode)
        times.append(time.perf_counter() - start)
    prediction = strategies.simulate(graph, plan, liveness=False)
    minimum = strategies.simulate(graph, plan).peak_bytes
    budget = int(BUDGETED * minimum)
    for _ in range(repeat):
        start = time.perf_counter()
        within = strategies.solve(strategy, graph, mode=mode, budget_bytes=budget)
        budgeted.append(time.perf_counter() - start)
    return {"strategy": strategy, "mode": mode, "lower sets": plan.info["lower_sets"],
            "min budget GB (model)": (prediction.peak_bytes - sum(graph.profile.param_bytes)) / 1e9,
            "min budget GB (replay)": minimum / 1e9,
            "overhead": prediction.overhead_cost, "stages": len(plan.stages),
            "solve s": statistics.median(times), f"solve s at {BUDGETED}x": statistics.median(budgeted),
            f"overhead at {BUDGETED}x": strategies.simulate(graph, within).overhead_cost, "note": ""}


def warm_up() -> float:
    """Seconds to compile (or load from numba's cache) the DP kernels, on a three-node chain."""
    start = time.perf_counter()
    toy = strategies.Graph(mem_bytes=[1, 1, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
    for strategy, mode in CELLS:
        strategies.solve(strategy, toy, mode=mode)
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.solvers", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output path without suffix")
    parser.add_argument("--paper-dir", type=Path, default=None,
                        help=f"a folder of the paper's graphs (default: ${paper_graphs.ENVIRONMENT}; none: the zoo's "
                             "nets only)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-lower-sets", type=int, default=None,
                        help="report exact_dp as not run on graphs with more lower sets (it needs memory for "
                             "every transition that fits the approximate DP's budget)")
    args = parser.parse_args(argv)
    rows = []
    warm_up_s = warm_up()
    items = list(graphs(args.paper_dir))
    for (name, graph), (strategy, mode) in tqdm([(g, c) for g in items for c in CELLS], desc="solving"):
        rows.append({"graph": name, "nodes": len(graph),
                     **bench(graph, strategy, mode, args.repeat, args.max_lower_sets)})
    table = pd.DataFrame(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out.with_suffix(".csv"), index=False, float_format="%.4f")
    command = " ".join(["python -m harness.bench.solvers", str(args.out)] + [
        f"--repeat {args.repeat}"] + ([f"--max-lower-sets {args.max_lower_sets}"] if args.max_lower_sets else []))
    header = (f"{made_by(command)}, "
              f"{platform.processor() or platform.machine()}, one process, {numba.get_num_threads()} numba threads "
              f"(the DPs' two passes over every transition run on all of them); times are medians of {args.repeat} "
              f"runs, after a warm-up that compiled or loaded the numba kernels in {warm_up_s:.1f} s.\n\n")
    args.out.with_suffix(".md").write_text(header + table.to_markdown(index=False, floatfmt=".3f") + "\n\n"
                                           + goals(table) + "\n")


def goals(table: pd.DataFrame) -> str:
    """The goals line: each DP's slowest budgeted solve on Kusumoto et al.'s seven nets against its goal, and on the
    zoo's other nets beside it."""
    column = f"solve s at {BUDGETED}x"
    paper = table.graph.isin([f"zoo/{net}" for net in nets.PAPER_NETS])
    parts = []
    for strategy, goal in GOALS_S.items():
        for cells, where in ((table[paper], "the seven nets"), (table[~paper & table.graph.str.startswith("zoo/")],
                                                                  "the zoo's others")):
            times = cells[cells.strategy == strategy][column].dropna()
            if times.empty:
                continue
            worst = cells.loc[times.idxmax()]
            verdict = (f"goal {goal:g} s: " + ("met" if times.max() <= goal else "NOT met")
                       if where == "the seven nets" else "no goal there")
            parts.append(f"{strategy} on {where} at most {times.max():.3f} s ({worst.graph}, {worst['mode']}; "
                         f"{verdict})")
    return f"Goals, one solve at {BUDGETED}x the minimal budget: " + "; ".join(parts) + "."


if __name__ == "__main__":
    main()
