"""The memory-time frontier, eager and compiled: ``python -m harness.bench.frontier OUT_STEM [--device cuda]``.

Per net (ResNet-152 at batch 128, PSPNet at batch 8, GPT-2 at batch 8 and sequence 1024), every strategy's
measured (peak, step time):
- ``vanilla``, eager and compiled;
- ``torch_compile_budget`` at ``activation_memory_budget`` 0, 0.2, 0.5, 0.8 and 1;
- ``torch_checkpoint_blocks`` and ``torch_checkpoint_sequential``, eager and compiled (where the net has them);
- ``approx_dp`` time-centric at ``--dp-points`` budgets from its minimum to vanilla's peak, eager and compiled;
- ``chen_sqrt``, eager and compiled;
- ``swap`` at ``--swap-points`` budgets from its minimum up towards vanilla's peak, eager (it cannot be
  compiled: ``harness.run.check_compilable``);
- the transformer peers ``sac_ops`` (and with ``every_second_mm``) and ``megatron_selective``, where they apply;
- with ``--all-strategies``, the rest once each: ``liveness_only``, ``chen_greedy`` and both DPs memory-centric
  at their minimal budgets, ``optimal`` at the middle ``approx_dp`` budget (``--time-limit`` for it and
  ``exact_dp``; a search that runs out is a ``timeout`` point).

``--nets llama_1b,llama_8b,gpt2 --modes eager --cost-model flops --all-strategies`` is the transformers'
frontier (``results/frontier_llm_meta``): the DPs then minimise FLOPs, and the table adds the cost model's
step (``cost model TFLOP (forward + recomputed)``: the graph's forward FLOPs plus the plan's predicted
recomputation).

The time axis: on ``cuda`` the measured step time (median, CUDA events); on ``meta`` the FLOPs the step ran
(``measured_step_flops``: recomputations included, swap's copies not). Writes ``OUT_STEM.csv`` and ``.md``
(every point, the Pareto front, and for each PyTorch peer point whether a compiled ``approx_dp`` point
dominates it: peak and time both at most the peer's) and one PNG per net, ``OUT_STEM_NET.png``. Every run's
row lands in ``--rows`` (resumable; ``--from-rows`` runs nothing and reads them).
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
from harness.bench.style import style  # noqa: E402
from harness.budget import parse_budget  # noqa: E402
from harness.cell import make_cell  # noqa: E402
from harness.results import DEVICE_TIME_NOTE, Status, device_time, label, read_row, stored_path  # noqa: E402
from harness.run import least_budget, run  # noqa: E402
from harness.zoo import nets  # noqa: E402

NETS = {"resnet152": (128, 224), "pspnet": (8, 712), "gpt2": (8, 1024), "llama_1b": (4, 2048), "llama_8b": (1, 4096)}
RATIOS = (0.0, 0.2, 0.5, 0.8, 1.0)
PEERS = ("torch_compile_budget", "torch_checkpoint_blocks", "torch_checkpoint_sequential", "sac_ops",
         "megatron_selective")
TRANSFORMER_PEERS = (("sac_ops", {}), ("sac_ops", {"every_second_mm": True}), ("megatron_selective", {}))
MODES = ("eager", "compiled")


def time_axis(device: str) -> tuple[str, float, str]:
    """(row field, scale, axis label) of the time axis on ``device``."""
    if device == "meta":
        return "measured_step_flops", 1e-12, "TFLOP per step (the ops the step ran; meta)"
    return "step_time_ms", 1.0, "measured step time (ms, median)"


class Cells:
    """Runs (or, ``from_rows``, reads) the cells of one net and keeps their rows."""

    def __init__(self, net, batch, side, device, rows_dir, from_rows, timed_steps, progress, cost_model="paper"):
        self.net, self.batch, self.side, self.device = net, batch, side, device
        self.rows_dir, self.from_rows, self.timed_steps, self.progress = rows_dir, from_rows, timed_steps, progress
        self.cost_model = cost_model
        self.rows: list[dict] = []

    def cell(self, strategy, *, budget=None, options=None, compile=False, cost_model=None):
        return make_cell(self.net, strategy, batch_size=self.batch, image_size=self.side, device=self.device,
                         budget=budget, options=options or {}, warmup_steps=2, timed_steps=self.timed_steps,
                         compile=compile, cost_model=cost_model or self.cost_model)

    def run(self, strategy, *, budget=None, options=None, compile=False, point=None, cost_model=None) -> dict:
        cost_model = cost_model or self.cost_model
        self.progress.set_postfix_str(f"{self.net} {strategy}{' compiled' if compile else ''}"
                                      + (f" {budget / 1e9:.2f} GB" if budget else ""))
        if self.from_rows:
            path = stored_path(self.rows_dir, self.net, strategy, batch_size=self.batch, image_size=self.side,
                               device=self.device, budget_bytes=budget, options=options, compiled=compile,
                               cost_model=cost_model, dtype=nets.spec(self.net).dtype)
            row = read_row(path) if path.exists() else {"status": "missing", "net": self.net,
                                                         "strategy": strategy, "compiled": compile,
                                                         "error": "no row in --rows: not run"}
        else:
            row = run(self.cell(strategy, budget=budget, options=options, compile=compile, cost_model=cost_model),
                      results_dir=self.rows_dir, resume=True)
        self.progress.update()
        self.rows.append({**row, "point": point or strategy})
        return row

    def least(self, strategy) -> int | None:
        """The least budget any plan of ``strategy`` fits (``harness.run.least_budget``), where its spread of budgets
        starts; ``from_rows``, the least budget an eager row of it under --rows was run at."""
        if not self.from_rows:
            return least_budget(self.cell(strategy))
        stem = f"{self.net}__{strategy}__b{self.batch}__s{self.side}__"
        budgets = [row["budget_bytes"] for row in map(read_row, Path(self.rows_dir).glob(f"{stem}*.json"))
                   if row.get("budget_bytes") and not row.get("options") and not row.get("compiled")
                   and row.get("cost_model") == self.cost_model and row.get("status") != Status.INFEASIBLE]
        return min(budgets, default=None)


def net_points(cells: Cells, dp_points: int, swap_points: int, strategies=None, ratios=RATIOS,
               dp_budgets=None, modes=MODES, all_strategies=False, time_limit=60.0) -> None:
    """Every point of one net, this project's own first (so that a run cut short has measured those before
    the peers); ``strategies`` (default: all) picks which run, ``dp_budgets`` (bytes) replaces approx_dp's
    ``dp_points`` spread from its minimum to vanilla's peak, ``modes`` ("eager", "compiled") which runs of
    each (eager vanilla runs in any case: the others are read against it)."""
    def wanted(strategy):
        return strategies is None or strategy in strategies

    def compiles(choices=(False, True)):
        return tuple(c for c in choices if ("compiled" if c else "eager") in modes)

    vanilla = cells.run("vanilla")
    middle = None
    if vanilla.get("status") == Status.OK:
        top = vanilla["measured_peak_bytes"]
        for strategy, count, runs in (("approx_dp", dp_points, compiles()), ("swap", swap_points, compiles((False,)))):
            if not wanted(strategy) or not runs:
                continue
            if strategy == "approx_dp" and dp_budgets:
                budgets = list(dp_budgets)
            else:
                least = cells.least(strategy)
                if least is None:
                    continue
                top = max(top, least)
                stop = top if strategy == "approx_dp" else least + (top - least) * (count - 1) / count
                budgets = np.linspace(least, stop, count).astype(int)
            if strategy == "approx_dp" and len(budgets):
                middle = int(budgets[len(budgets) // 2])
            for budget in budgets:
                for compile in runs:
                    cells.run(strategy, budget=int(budget), compile=compile,
                              point=f"{strategy} @ {budget / 1e9:.2f} GB")
    if compiles((True,)):
        cells.run("vanilla", compile=True, point="vanilla")
    if wanted("torch_compile_budget") and compiles((True,)):
        for ratio in ratios:
            cells.run("torch_compile_budget", options={"budget_ratio": ratio},
                      point=f"torch_compile_budget {ratio:g}")
    for strategy in ("torch_checkpoint_blocks", "torch_checkpoint_sequential", "chen_sqrt"):
        for compile in compiles() if wanted(strategy) else ():
            cells.run(strategy, compile=compile)
    for strategy, options in TRANSFORMER_PEERS:
        for compile in compiles() if wanted(strategy) else ():
            cells.run(strategy, options=options, compile=compile, point=label(strategy, options))
    if not all_strategies:
        return
    rest = [("liveness_only", {}, None), ("chen_greedy", {}, None), ("approx_dp", {"mode": "mc"}, None),
            ("exact_dp", {"mode": "mc", "time_limit_s": time_limit}, None)]
    if middle is not None:
        rest.append(("optimal", {"time_limit_s": time_limit}, middle))
    for strategy, options, budget in rest:
        if wanted(strategy):
            at = f" @ {budget / 1e9:.2f} GB" if budget else ""
            cells.run(strategy, options=options, budget=budget, point=label(strategy, options) + at)


def points(rows: list[dict], device: str) -> pd.DataFrame:
    field, scale, _ = time_axis(device)
    out = []
    for row in rows:
        ok = row.get("status") == Status.OK and row.get("measured_peak_bytes") is not None and row.get(field) is not None
        out.append({"net": row["net"], "point": row["point"], "strategy": row["strategy"],
                    "compiled": bool(row.get("compiled")) or row["strategy"] == "torch_compile_budget",
                    "status": row.get("status"), "budget GB": (row.get("budget_bytes") or np.nan) / 1e9,
                    "peak GB": row["measured_peak_bytes"] / 1e9 if ok else np.nan,
                    "time": row[field] * scale if ok else np.nan,
                    "IQR %": (100 * row["step_time_iqr_ms"] / row["step_time_ms"]
                              if ok and row.get("step_time_iqr_ms") is not None else np.nan),
                    "compile s": row.get("compile_time_s"), "host GB": (row.get("plan_host_bytes") or np.nan) / 1e9,
                    **({"cost model TFLOP (forward + recomputed)":
                        (row["total_cost"] + row["predicted_overhead_cost"]) / 1e12
                        if ok and row.get("cost_model") == "flops" and row.get("predicted_overhead_cost") is not None
                        else np.nan} if device == "meta" else {}),
                    "note": note(row),
                    **(device_time(row) if device == "cuda" else {})})
    table = pd.DataFrame(out)
    if device == "cuda":  # each point's wall time and GPU time over eager vanilla's, PyTorch's own eager
        for net, group in table.groupby("net"):  # checkpointing's and compiled vanilla's, side by side
            for base, compiled, short in (("vanilla", False, "vanilla"), ("torch_checkpoint_blocks", False,
                                          "checkpoint_blocks"), ("vanilla", True, "compiled vanilla")):
                ran = group[(group.strategy == base) & (group.compiled == compiled)].dropna(subset=["time"])
                if len(ran):
                    table.loc[group.index, f"time / {short}"] = group.time / ran.time.iloc[0]
                    table.loc[group.index, f"GPU / {short}"] = group["GPU ms"].astype(float) / ran["GPU ms"].iloc[0] \
                        if pd.notna(ran["GPU ms"].iloc[0]) else np.nan
    table["pareto"] = False
    for net, group in table.groupby("net"):
        ok = group.dropna(subset=["peak GB", "time"])
        if device == "meta":  # FLOPs leave out swap's copies: its points would sit on every front
            ok = ok[ok.strategy != "swap"]
        for i, point in ok.iterrows():
            table.loc[i, "pareto"] = not ((ok["peak GB"] <= point["peak GB"]) & (ok["time"] <= point["time"])
                                          & ((ok["peak GB"] < point["peak GB"]) | (ok["time"] < point["time"]))).any()
    return table


def note(row: dict) -> str:
    """Why a point has no figures, or how its plan was found again (NOTE [what the compiler holds besides the
    plan] in ``harness/run.py``)."""
    if row.get("status") != Status.OK:
        return str(row.get("error", ""))[:80]
    if row.get("compile_excess_bytes"):
        return (f"solved again {row['compile_excess_bytes'] / 1e9:.2f} GB lower: the first plan, compiled, held "
                "that over its eager run")
    return ""


def _point(row) -> str:
    """A point as the dominance lines name it: ``NAME (compiled)`` for a compiled run of a strategy that has both."""
    return f"{row.point}{' (compiled)' if row.compiled and row.strategy != 'torch_compile_budget' else ''}"


def _dominated(net: str, peer, by: str, best) -> str:
    """``peer`` dominated by ``best`` (named ``by``): both points, and how much less memory and time."""
    return (f"- {net}, {_point(peer)} ({peer['peak GB']:.2f} GB, {peer.time:.4g}): dominated by {by} "
            f"({best['peak GB']:.2f} GB, {best.time:.4g}: {1 - best['peak GB'] / peer['peak GB']:.0%} less memory, "
            f"{1 - best.time / peer.time:.0%} less time)")


def dominance(table: pd.DataFrame) -> list[str]:
    """For each PyTorch peer point (and vanilla), whether a compiled ``approx_dp`` point (eager, where none
    was compiled) dominates it, and by how much."""
    lines = []
    for net, group in table.groupby("net", sort=False):
        ours = group[(group.strategy == "approx_dp") & group.compiled].dropna(subset=["peak GB", "time"])
        mode = "compiled"
        if ours.empty:
            ours, mode = group[group.strategy == "approx_dp"].dropna(subset=["peak GB", "time"]), "eager"
        if ours.empty:
            lines.append(f"- {net}: no approx_dp point measured")
            continue
        peers = group[group.strategy.isin(PEERS + ("vanilla",))].dropna(subset=["peak GB", "time"])
        for _, peer in peers.iterrows():
            better = ours[(ours["peak GB"] <= peer["peak GB"]) & (ours.time <= peer.time)]
            if len(better):
                best = better.sort_values("time").iloc[0]
                lines.append(_dominated(net, peer, f"{mode} {best.point}", best))
            else:
                lines.append(f"- {net}, {_point(peer)} ({peer['peak GB']:.2f} GB, {peer.time:.4g}): not dominated by "
                             f"any {mode} approx_dp point")
    return lines


def front_lines(table: pd.DataFrame) -> list[str]:
    """For each PyTorch peer point, whether it is on its net's Pareto front, else the front point that dominates
    it with the least time, and by how much."""
    lines = []
    for net, group in table.groupby("net", sort=False):
        front = group[group.pareto]
        for _, peer in group[group.strategy.isin(PEERS)].dropna(subset=["peak GB", "time"]).iterrows():
            if peer.pareto:
                lines.append(f"- {net}, {_point(peer)}: on the front")
                continue
            better = front[(front["peak GB"] <= peer["peak GB"]) & (front.time <= peer.time)].sort_values("time")
            best = better.iloc[0]
            lines.append(_dominated(net, peer, f"{best.point}{' (compiled)' if best.compiled else ''}", best))
    return lines


def plot(table: pd.DataFrame, net: str, device: str, where: str, caption: str, path: Path) -> None:
    _, _, axis_label = time_axis(device)
    group = table[table.net == net].dropna(subset=["peak GB", "time"])
    if len(group) < 2:  # a single point is no curve: no figure
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for (strategy, compiled), points_ in group.groupby(["strategy", "compiled"], sort=False):
        look = style(strategy)  # eager: a larger hollow marker, compiled: a smaller filled one inside it
        ax.scatter(points_["peak GB"], points_.time, marker=look["marker"], s=22 if compiled else 70,
                   zorder=4 if compiled else 3, facecolors=look["color"] if compiled else "none",
                   edgecolors=look["color"], linewidths=1.2,
                   label=f"{strategy}, {'compiled' if compiled else 'eager'}")
    front = group[group.pareto].sort_values("peak GB")
    ax.step(front["peak GB"], front.time, where="post", color="k", linewidth=1, label="Pareto front")
    save_figure(fig, caption, path, ax, ("measured peak (GB)", axis_label),
                f"{net}: memory against time, every strategy (hollow: eager, filled: compiled)\n{where}", legend_size=7)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--nets", default=",".join(NETS), help=f"comma-separated, of {', '.join(NETS)}")
    parser.add_argument("--device", default="meta", choices=["meta", "cuda"])
    parser.add_argument("--batch", type=int, help="one batch size for every net (default: NETS)")
    parser.add_argument("--side", type=int, help="one input side (sequence length) for every net")
    parser.add_argument("--dp-points", type=int, default=6, help="approx_dp budgets, its minimum to vanilla's peak")
    parser.add_argument("--dp-budgets", help="comma-separated approx_dp budgets (10GB, ...) instead of --dp-points")
    parser.add_argument("--swap-points", type=int, default=3)
    parser.add_argument("--strategies", help="comma-separated: run only these (vanilla always runs; default: all)")
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS),
                        help="torch_compile_budget's activation_memory_budget values")
    parser.add_argument("--timed-steps", type=int, default=10, help="cuda: steps timed per point, after 2 warm-ups")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated, of eager, compiled: which runs of each strategy (eager vanilla always)")
    parser.add_argument("--cost-model", default="paper", choices=["paper", "flops"],
                        help="the DPs' cost model (flops: the transformers' frontier)")
    parser.add_argument("--all-strategies", action="store_true",
                        help="also liveness_only, chen_greedy, the memory-centric DPs and optimal, once each")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for exact_dp and optimal")
    add_rows_options(parser)
    args = parser.parse_args(argv)
    names = args.nets.split(",")
    unknown = sorted(set(names) - set(NETS)) if args.batch is None or args.side is None else []
    if unknown:
        raise SystemExit(f"no sizes for {', '.join(unknown)} (give --batch and --side); nets with them: "
                         f"{', '.join(NETS)}")
    chosen = None if args.strategies is None else set(args.strategies.split(","))
    modes = args.modes.split(",")
    if not modes or set(modes) - set(MODES):
        raise SystemExit(f"--modes {args.modes!r}: valid modes are {', '.join(MODES)}")
    ratios = [float(r) for r in args.ratios.split(",")]
    dp_budgets = None if args.dp_budgets is None else [parse_budget(b) for b in args.dp_budgets.split(",")]
    cells_per_net = (2 + len(ratios) + 6 + 2 * len(dp_budgets or range(args.dp_points)) + args.swap_points + 2
                     + 2 * len(TRANSFORMER_PEERS) + 5 * args.all_strategies)
    progress = tqdm(total=cells_per_net * len(names), desc="frontier")
    rows = []
    for net in names:
        batch, side = NETS.get(net, (None, None))
        cells = Cells(net, args.batch or batch, args.side or side, args.device, args.rows, args.from_rows,
                      args.timed_steps, progress, args.cost_model)
        net_points(cells, args.dp_points, args.swap_points, chosen, ratios, dp_budgets, modes, args.all_strategies,
                   args.time_limit)
        rows += cells.rows
    progress.close()
    table = points(rows, args.device)
    command = command_of("frontier", argv)
    machines = sorted({row["device_name"] for row in rows if row.get("device_name")})
    where = (f"measured on {', '.join(machines)}" if args.device == "cuda"
             else "meta device: peaks measured by the tracker (compiled points: the AOT replay), time is FLOPs run")
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    for net in names:
        plot(table, net, args.device, where, f"{command}  ({datetime.date.today()})",
             Path(f"{args.out_stem}_{net}.png"))
    table.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.4g")
    _, _, axis_label = time_axis(args.device)
    lines = dominance(table)
    sizes = "; ".join(f"{net} batch {args.batch or NETS[net][0]}, side {args.side or NETS[net][1]}" for net in names)
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}; {where}. {sizes}. Time: {axis_label}. `pareto`: no "
        "other point has both less memory and less time (on meta, swap is left out: the FLOPs do not count its "
        "copies). Swap's host link: the rows' `plan_host_bytes` each "
        "way (`host GB`); on meta its copies cost no time here."
        + (f" {DEVICE_TIME_NOTE} `time / vanilla`, `GPU / vanilla`: over eager vanilla's; `time / checkpoint_blocks`, "
           "`GPU / checkpoint_blocks`: over eager `torch_checkpoint_blocks`' (PyTorch's own recomputation); "
           "`time / compiled vanilla`, `GPU / compiled vanilla`: over compiled vanilla's."
           if args.device == "cuda"
           else "") + "\n\n"
        "Each PyTorch peer point against the `approx_dp` points (the compiled ones, where any ran):\n\n"
        + "\n".join(lines) + "\n\nEach PyTorch peer point against the Pareto front:\n\n"
        + "\n".join(front_lines(table)) + "\n\n"
        + table.to_markdown(index=False, floatfmt=".4g") + "\n")
    print("\n".join(lines))
    print(f"frontier: {args.out_stem}.md, .csv, " + ", ".join(f"{args.out_stem}_{n}.png" for n in names))


if __name__ == "__main__":
    main()
