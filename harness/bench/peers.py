"""Every strategy and PyTorch peer beside the optimum: ``python -m harness.bench.peers OUT_STEM``.

For each zoo net at Kusumoto et al.'s sizes and each strategy (at its default budget, the DPs at their minimum):
the measured peak and reduction against vanilla, read from the result rows (``--rows``, made by ``python -m
harness sweep=strategies`` and ``sweep=strategies_mc``); the peak and overhead the simulator predicts; and
``ilp_optimal``'s overhead within that same predicted peak, judged by the same replay (NOTE [judging the
ILP's budget] in ``strategies/ilp_optimal.py``), the strategy's own plan its first candidate and warm
start (so the ILP is never worse), with the status of the MILP that found it. "vs ILP" is the strategy's
overhead over the ILP's. Writes ``OUT_STEM.md`` and ``OUT_STEM.csv``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness.bench.common import made_by
import strategies
from harness.cell import make_cell
from harness.execute.peers import PEERS
from harness.results import Status, load_results
from harness.run import build, plan
from harness.zoo import nets
from strategies.ilp_optimal import Options as IlpOptions
from strategies.ilp_optimal import within_replay

GB = 1e9
STRATEGIES = [("vanilla", ""), ("liveness_only", ""), ("chen_sqrt", ""), ("chen_greedy", ""),
              ("approx_dp", "tc"), ("approx_dp", "mc"), ("exact_dp", "tc"), ("exact_dp", "mc"),
              ("torch_checkpoint_blocks", ""), ("torch_checkpoint_sequential", ""), ("torch_compile_budget", "")]


def measured_peaks(rows: pd.DataFrame, net: str) -> dict[tuple[str, str], float]:
    """(strategy, mode) -> measured peak bytes of the net's default-budget rows on ``meta``."""
    if rows.empty:
        return {}
    cells = rows[(rows.net == net) & (rows.status == Status.OK) & (rows.device == "meta") & rows.budget_bytes.isna()
                 & (rows.batch_size == nets.spec(net).batch_size)]
    cells = cells[[o.get("memory_model") != "paper" for o in cells.options]]  # Table 2's plans, not these
    return {(r.strategy, r.options.get("mode", "")): r.measured_peak_bytes for r in cells.itertuples()}


def bench_net(net: str, rows: pd.DataFrame, time_limit_s: float, max_stages: int) -> list[dict]:
    cell = make_cell(net, "vanilla")
    built = build(cell)
    graph, static = built.graph, built.static_bytes
    measured = measured_peaks(rows, net)
    vanilla = measured.get(("vanilla", ""))
    out = []
    for name, mode in STRATEGIES:
        row = {"net": net, "strategy": name + (f" ({mode})" if mode else ""), "batch": nets.spec(net).batch_size}
        peak = measured.get((name, mode))
        row["measured GB"] = peak / GB if peak else math.nan
        row["vs vanilla"] = f"{100 * (peak / vanilla - 1):+.0f}%" if peak and vanilla else ""
        try:
            chosen = plan(cell.but(strategy=name, options={"mode": mode} if mode else {}), built)
        except strategies.Inapplicable as error:
            out.append({**row, "note": str(error).split(": ", 1)[-1]})
            continue
        if not chosen.predicted:
            out.append({**row, "note": "chosen inside torch.compile: no plan in the IR to compare"})
            continue
        predicted = strategies.simulate(graph, chosen)
        row.update({"overhead / forward": predicted.overhead_cost / sum(graph.cost),
                    "predicted GB": (predicted.peak_bytes + static) / GB})
        if predicted.overhead_cost == 0:
            row["note"] = "recomputes nothing: the optimum at this memory too"
        elif 2 * len(graph) > max_stages:
            row["note"] = f"ILP not built: {2 * len(graph)} stages > {max_stages}"
        else:
            began = time.perf_counter()
            ilp = within_replay(graph, predicted.peak_bytes, chosen, time_limit_s)
            best = strategies.simulate(graph, ilp).overhead_cost
            row.update({"ILP overhead": best, "ILP status": ilp.info["ilp_status"], "ILP MILPs": ilp.info["ilp_probes"],
                        "ILP s": time.perf_counter() - began,
                        "vs ILP": predicted.overhead_cost / best if best else math.inf})
        out.append(row)
    return out


def goals(table: pd.DataFrame) -> list[str]:
    """The goals for our side, net by net, from the table itself."""
    lines = []
    for net, cells in table.groupby("net", sort=False):
        by = cells.set_index("strategy")
        ours = by["measured GB"].get("approx_dp (mc)", math.nan)
        peer = by["measured GB"].reindex(PEERS).min()
        verdict = "met" if ours <= peer else "NOT met"
        line = f"- {net}: approx_dp (mc) {ours:.2f} GB against the best PyTorch peer's {peer:.2f} GB: {verdict}"
        ratio = by["vs ILP"].get("approx_dp (tc)", math.nan) if "vs ILP" in by else math.nan
        status = by["ILP status"].get("approx_dp (tc)") if "ILP status" in by else None
        if math.isnan(ratio):
            line += "; approx_dp (tc) against the ILP: not built here"
        elif status != "optimal" and ratio <= 1.05:
            line += f"; approx_dp (tc) at {ratio:.2f}x the ILP's best schedule ({status}): not proven"
        else:
            line += (f"; approx_dp (tc) at {ratio:.2f}x the ILP's best schedule ({status}): "
                     f"{'met' if ratio <= 1.05 else 'NOT met'}")
        lines.append(line)
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_stem")
    parser.add_argument("--rows", default="results/runs")
    parser.add_argument("--nets", default=",".join(nets.available()))
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per plan's ILP search")
    parser.add_argument("--max-stages", type=int, default=IlpOptions().max_stages)
    args = parser.parse_args(argv)
    rows = load_results(args.rows) if Path(args.rows).exists() else pd.DataFrame()
    table = []
    for net in tqdm(args.nets.split(","), desc="nets"):
        table += bench_net(net, rows, args.time_limit, args.max_stages)
    table = pd.DataFrame(table)
    out = Path(args.out_stem)
    table.to_csv(out.with_suffix(".csv"), index=False)
    command = (f"python -m harness.bench.peers {args.out_stem} --rows {args.rows} --time-limit {args.time_limit:g}"
               + (f" --nets {args.nets}" if args.nets != ",".join(nets.available()) else "")
               + (f" --max-stages {args.max_stages}" if args.max_stages != IlpOptions().max_stages else ""))
    out.with_suffix(".md").write_text(
        f"{made_by(command)} (rows from `{args.rows}`, device `meta`; ILP: HiGHS, "
        f"one thread, {args.time_limit:g} s a search, on the CPU). Peaks in decimal GB, parameters "
        "included; overheads in cost units of the paper's cost model.\n\n"
        + table.to_markdown(index=False, floatfmt=".2f") + "\n\n## Goals\n\n" + "\n".join(goals(table)) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
