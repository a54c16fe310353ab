"""The executor's host work against what its recomputations cannot avoid: ``python -m harness.bench.overhead
OUT_STEM [--device cpu|cuda] [--nets a,b] [--strategies a,b]``.

Every strategy the executor runs (and PyTorch's own checkpointing, the peers) on the zoo nets at small sizes
(``SIZES``), eager. For each cell, per training step after a warm-up step: the ATen op calls and the host
time outside ATen ops (Python: the executor's and the model's), the median of ``--steps`` steps profiled one by
one (``ops_and_python``), and the same for the calls the plan recomputed run plainly, one after
another under ``no_grad`` (``plain_recomputation``): the ops and Python a recomputation cannot avoid. The
goals a lean executor meets:

- ops: at most vanilla's, plus the recomputed calls' own, plus 2 per recomputed call;
- Python: at most 1.2x vanilla's, plus the recomputed calls' own.

Each row says whether it meets them, and by how much it exceeds vanilla's and ``torch_checkpoint_blocks``'.
``approx_dp`` (tc) and ``chen_sqrt`` also run as ``torch.utils.checkpoint`` regions (``harness.train``, NOTE [a plan
as checkpoint regions]), a second answer to how much host work a plan needs; a net whose recomputed calls write
its state (BatchNorm) has no such form, and says so. The wall time of a step (median) is beside each row.
Op counts are deterministic (the same every run); Python times are a machine's, and on a busy one move by a
third between runs. So the Python work is counted too, on ``cpu``: the Python function calls
of one more step (``python_calls``, the same every run), held to the same goal (1.2x vanilla's, plus the
recomputed calls' own). Writes ``OUT_STEM.md`` and ``OUT_STEM.csv``. ``meta`` runs no ops and has no host time to
measure: it is refused.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.fx as fx
from torch.profiler import profile
from tqdm import tqdm

import strategies
from harness.bench.common import command_of, made_by
from harness.bench.profile_step import aten_calls, host_ops
from harness.cell import make_cell
from harness.execute import call_node, recorded_recomputations
from harness.measure import clear_grads, collected_then_held_off
from harness.results import label
from harness.run import build, plan, step as plan_step
from harness.tracing.state import generators_of, state_kept
from harness.tracing.traced import Traced
from harness.train import CheckpointedStages

DEVICES = ("cpu", "cuda")
SIZES = {"resnet50": (2, 64), "vgg19": (2, 64), "googlenet": (2, 64), "densenet161": (2, 64), "pspnet": (1, 64),
         "unet": (1, 188), "resnet152": (2, 64), "gpt2": (1, 64), "vit_b_16": (1, 224)}
STRATEGIES = [("vanilla", {}), ("torch_checkpoint_blocks", {}), ("torch_checkpoint_sequential", {}),
              ("liveness_only", {}), ("chen_sqrt", {}), ("chen_greedy", {}), ("approx_dp", {"mode": "tc"}),
              ("approx_dp", {"mode": "mc"}), ("exact_dp", {"mode": "tc"}), ("exact_dp", {"mode": "mc"})]
REGIONS = [("approx_dp", {"mode": "tc"}), ("chen_sqrt", {})]  # also run as checkpoint regions
CALL_OPS = 2  # ops a recomputed call may add beside its own
PYTHON_FACTOR = 1.2  # of vanilla's host time outside ATen


def ops_and_python(run, device: str, steps: int = 1) -> tuple[float, float, float]:
    """(ATen op calls, host ms outside ATen ops, wall ms) of one call of ``run``: the median over ``steps`` calls, each
    profiled on its own, with Python's cycle collector run before it and held off during it (the timing
    protocol, ``harness.results.TIMING_PROTOCOL``). One slow call (the machine busy elsewhere for a moment)
    moves a mean of a few calls by half; it does not move their median."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples = []
    for _ in range(steps):
        with collected_then_held_off(), profile() as prof:
            start = time.perf_counter()
            run()
            sync()
            wall_ms = (time.perf_counter() - start) * 1e3
        ops = host_ops(prof.key_averages(), 1, device)
        samples.append((aten_calls(ops), max(0.0, wall_ms - ops["host self ms"].sum()), wall_ms))
    return tuple(statistics.median(sample[i] for sample in samples) for i in range(3))


def python_calls(run) -> int:
    """The Python function calls (and the C functions Python calls) in one call of ``run`` on this thread, with
    the cycle collector held off: the host work the Python column times, counted. On ``cpu`` the backward runs
    on this thread too; on ``cuda`` autograd runs it on a thread of its own, which this does not see."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    with collected_then_held_off():
        sys.setprofile(count)
        try:
            run()
        finally:
            sys.setprofile(None)
    return calls


def plain_recomputation(traced: Traced, example_input: torch.Tensor, names: list[str],
                        steps: int = 1) -> tuple[float, float, int]:
    """(ATen op calls, host ms outside them, Python calls) of the fx nodes ``names`` run plainly, one after another
    in that order under ``no_grad``, from the values a plain forward pass made: what recomputing them costs with
    nothing around it. The module's state and generators are left as they were found."""
    module = traced.module
    rng = ({example_input.device}, generators_of(module))
    nodes = {node.name: node for node in module.graph.nodes}
    submodules = {name: m for name, m in module.named_modules() if name}
    calls = {}
    with torch.no_grad(), state_kept(module, rng):
        values = {}
        for node in module.graph.nodes:
            if node.op == "output":
                break
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: values[a.name])
            values[node.name] = (example_input if node.op == "placeholder"
                                  else call_node(module, submodules, node, args, kwargs))
        for name in names:
            calls[name] = fx.node.map_arg((nodes[name].args, nodes[name].kwargs), lambda a: values[a.name])

        def run():
            for name in names:
                args, kwargs = calls[name]
                call_node(module, submodules, nodes[name], args, kwargs)

        run()  # warm-up
        return (*ops_and_python(run, example_input.device.type, steps)[:2], python_calls(run))


def measure_cell(net: str, strategy: str, options: dict, device: str, steps: int, regions: bool = False) -> dict:
    """The cell's row of figures (``regions``: its plan run as checkpoint regions); ``strategies.Inapplicable``
    where the strategy has no plan for the net, or the plan no such form."""
    batch, side = SIZES[net]
    cell = make_cell(net, strategy, batch_size=batch, image_size=side, device=device, options=options)
    built = build(cell)
    chosen = plan(cell, built)
    run = plan_step(cell, built, chosen)
    with recorded_recomputations() as stages:
        clear_grads(built.model)
        run()  # the first step learns what each call needs
    recomputed = [name for stage in stages for name in stage]
    if regions:
        try:
            module = CheckpointedStages(built.traced, chosen, built.example_input)
        except ValueError as error:
            raise strategies.Inapplicable(str(error)) from None

        def run():
            built.loss_fn(module(built.example_input)).backward()

        clear_grads(built.model)
        run()  # the regions' own warm-up step

    def step():
        clear_grads(built.model)
        run()

    ops, python_ms, wall_ms = ops_and_python(step, device, steps)
    calls = python_calls(step) if device == "cpu" else None
    own_ops, own_python, own_calls = plain_recomputation(built.traced, built.example_input, recomputed, steps) \
        if recomputed else (0.0, 0.0, 0)
    name = label(strategy, options) + (" as checkpoint regions" if regions else "")
    return {"net": net, "batch": batch, "side": side, "strategy": name, "wall ms": wall_ms,
            "ops": ops, "python ms": python_ms, "python calls": calls,
            "recomputed calls": len(recomputed), "their ops": own_ops, "their python ms": own_python,
            "their python calls": own_calls}


def table(rows: pd.DataFrame) -> pd.DataFrame:
    """The goals per row: ``ops bound`` and ``python bound`` from the net's vanilla row."""
    out = []
    for net, group in rows.groupby("net", sort=False):
        vanilla = group[group.strategy == "vanilla"].iloc[0]
        blocks = group[group.strategy == "torch_checkpoint_blocks"]
        for _, row in group.iterrows():
            # PyTorch's checkpointing (the peers, and a plan as checkpoint regions): a reference, not held to a goal
            peer = row.strategy.startswith("torch_") or row.strategy.endswith(" as checkpoint regions")
            ops_bound = None if peer else vanilla.ops + row["their ops"] + CALL_OPS * row["recomputed calls"]
            python_bound = None if peer else PYTHON_FACTOR * vanilla["python ms"] + row["their python ms"]
            counted = not pd.isna(row["python calls"])
            calls_bound = PYTHON_FACTOR * vanilla["python calls"] + row["their python calls"] \
                if counted and not peer else None
            out.append({"net": net, "strategy": row.strategy, "recomputed calls": row["recomputed calls"],
                        "ops": row.ops, "ops bound": ops_bound,
                        "ops ok": "" if peer else "yes" if row.ops <= ops_bound else "no",
                        "ops / vanilla": row.ops / vanilla.ops,
                        "ops / checkpoint_blocks": row.ops / blocks.ops.iloc[0] if len(blocks) else None,
                        "python ms": row["python ms"], "python bound": python_bound,
                        "python ok": "" if peer else "yes" if row["python ms"] <= python_bound else "no",
                        "python / vanilla": row["python ms"] / vanilla["python ms"],
                        "python calls": row["python calls"], "calls bound": calls_bound,
                        "calls ok": "" if calls_bound is None
                        else "yes" if row["python calls"] <= calls_bound else "no",
                        "calls / vanilla": row["python calls"] / vanilla["python calls"] if counted else None,
                        "wall ms": row["wall ms"], "wall / vanilla": row["wall ms"] / vanilla["wall ms"]})
    return pd.DataFrame(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--device", default="cpu", help=f"one of {', '.join(DEVICES)}")
    parser.add_argument("--nets", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--strategies", help="comma-separated strategy names (default: every one listed above)")
    parser.add_argument("--steps", type=int, default=5, help="steps profiled one by one per cell (median)")
    args = parser.parse_args(argv)
    if args.device not in DEVICES:
        parser.error(f"--device {args.device!r}: the overhead is host time and ATen ops, which {args.device!r} "
                     f"does not run; choose one of {', '.join(DEVICES)}")
    net_names = args.nets.split(",")
    unknown = [n for n in net_names if n not in SIZES]
    if unknown:
        parser.error(f"unknown net(s) {unknown}; choose from {', '.join(SIZES)}")
    chosen = STRATEGIES if not args.strategies else [
        (s, o) for s, o in STRATEGIES if s in args.strategies.split(",") or s == "vanilla"]
    cells = [(net, strategy, options, regions) for net in net_names for strategy, options in chosen
             for regions in ((False, True) if (strategy, options) in REGIONS else (False,))]
    rows, inapplicable = [], []
    for net, strategy, options, regions in tqdm(cells, desc="overhead", unit="cell"):
        try:
            rows.append(measure_cell(net, strategy, options, args.device, args.steps, regions))
        except strategies.Inapplicable as error:
            form = " as checkpoint regions" if regions else ""
            inapplicable.append(f"- {net}, {label(strategy, options)}{form}: {error}")
    frame = table(pd.DataFrame(rows))
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.4g")
    command = command_of("overhead", argv)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    recomputing = frame[(frame["recomputed calls"] > 0) & (frame["ops ok"] != "")]  # the executor's cells
    goals = (f"Goals: ops within the bound in {(recomputing['ops ok'] == 'yes').sum()} of {len(recomputing)} "
             f"recomputing cells, Python time within it in {(recomputing['python ok'] == 'yes').sum()}"
             + (f", Python calls in {(recomputing['calls ok'] == 'yes').sum()}." if args.device == "cpu" else "."))
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}, on {where}, eager; per step, the median of {args.steps} steps profiled one by one "
        "after one warm-up, the cycle collector run between them. Bounds: ops at most vanilla's + the recomputed "
        "calls' own + 2 per recomputed call; "
        "Python (host time outside ATen ops) at most 1.2x vanilla's + the recomputed calls' own, run plainly; "
        "Python calls (one more step, counted, the same every run) likewise. A plan \"as checkpoint regions\" "
        "runs as torch.utils.checkpoint regions (harness.train): like the peers, a reference, held to no bound.\n\n"
        f"{goals}\n\n" + frame.to_markdown(index=False, floatfmt=".4g") + "\n"
        + ("\nNot run (no plan for the net):\n\n" + "\n".join(inapplicable) + "\n" if inapplicable else ""))
    print(goals)
    print(f"table: {args.out_stem}.md")


if __name__ == "__main__":
    main()
