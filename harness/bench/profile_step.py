"""Where one training step's time goes: ``python -m harness.bench.profile_step OUT_STEM NET STRATEGY [--budget
6GB] [--device cuda] [--compile]``.

Builds the cell as ``harness.run.run`` does (its stages ``build``, ``plan`` and ``step``), runs ``--warmup``
steps, then ``--steps`` steps
unprofiled, then ``--steps`` steps under ``torch.profiler``, and writes ``OUT_STEM.md``: the step's wall time,
unprofiled and profiled (the profiler's own cost is the difference); the host time the executor's recomputations
took in the backward (``RECOMPUTE_EVENT``: their ops and their Python); the host time spent inside ATen ops
(dispatch and, on cuda, kernel launches; on cpu the compute too) and the rest, which is Python (the executor's and
the model's); on cuda the time the GPU ran kernels, as a fraction of the wall time (well below 1: the GPU waited on
the host), and the CUDA runtime calls that make the host wait (synchronizations, ``cudaMalloc`` and ``cudaFree``);
and the ops by self time on the host and on the device, per step. ``OUT_STEM.csv`` holds every op. ``--trace`` also
writes the profiler's Chrome trace, ``OUT_STEM.json``. Nothing is measured on ``meta`` (there is no time to
profile): use ``cpu`` or ``cuda``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from harness.bench.common import command_of, made_by
from harness.cell import make_cell
from harness.execute import RECOMPUTE_EVENT
from harness.run import build, plan, step


def host_ops(events, steps: int, device: str) -> pd.DataFrame:
    """The ops a profile's ``events`` (``key_averages()``) ran on the host, per step: calls, host self time, and
    on cuda the device time of their kernels. The recomputation marks (``RECOMPUTE_EVENT``) are no op."""
    return pd.DataFrame([{"op": e.key, "calls per step": e.count / steps,
                          "host self ms": e.self_cpu_time_total / 1e3 / steps,
                          "device self ms": e.self_device_time_total / 1e3 / steps if device == "cuda" else None}
                         for e in events if e.device_type == DeviceType.CPU and e.key != RECOMPUTE_EVENT],
                        columns=["op", "calls per step", "host self ms", "device self ms"])


def aten_calls(ops: pd.DataFrame) -> float:
    """The ATen op calls per step of ``host_ops``' table (the CUDA runtime's calls left out)."""
    return ops[~ops["op"].str.startswith("cuda")]["calls per step"].sum()


def profile_cell(model, training_step, device: str, warmup: int, steps: int, trace_path: Path | None = None):
    """(figures, ops table) of ``steps`` profiled steps of ``training_step`` (``harness.run.step``'s) on ``model``,
    after ``warmup`` steps and ``steps`` unprofiled ones."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def ms_per_step(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            model.zero_grad(set_to_none=True)
            training_step()
        sync()
        return (time.perf_counter() - start) * 1e3 / max(count, 1)

    ms_per_step(warmup)
    unprofiled_ms = ms_per_step(steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall_ms = ms_per_step(steps)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    ops = host_ops(events, steps, device)
    in_ops_ms = ops["host self ms"].sum()
    recomputing_ms = sum(e.cpu_time_total for e in events if e.key == RECOMPUTE_EVENT) / 1e3 / steps
    figures = {"wall ms per step, unprofiled": unprofiled_ms, "wall ms per step": wall_ms,
               "host ms recomputing (in the backward)": recomputing_ms, "host ms in ATen ops": in_ops_ms,
               "host ms outside them (Python)": max(0.0, wall_ms - in_ops_ms),
               "ATen op calls per step": aten_calls(ops)}
    if device == "cuda":
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        figures.update({"GPU kernel ms per step": kernel_ms, "GPU busy fraction": kernel_ms / wall_ms})
        for name, pattern in (("synchronizations", "Synchronize"), ("cudaMalloc and cudaFree", "^cuda(?:Malloc|Free)")):
            calls = ops[ops["op"].str.contains(pattern)]
            figures[f"{name} per step"] = calls["calls per step"].sum()
            figures[f"host ms in {name}"] = calls["host self ms"].sum()
    return figures, ops.sort_values("host self ms", ascending=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.profile_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("net")
    parser.add_argument("strategy")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--side", type=int)
    parser.add_argument("--budget")
    parser.add_argument("--mode", choices=["tc", "mc"], help="the DPs' mode")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="ops listed")
    parser.add_argument("--trace", action="store_true", help="also write the Chrome trace, OUT_STEM.json")
    args = parser.parse_args(argv)
    cell = make_cell(args.net, args.strategy, batch_size=args.batch, image_size=args.side, device=args.device,
                     budget=args.budget, options={"mode": args.mode} if args.mode else {}, compile=args.compile)
    built = build(cell)
    chosen = plan(cell, built)
    training_step = step(cell, built, chosen)
    if training_step is None:
        raise SystemExit(f"{args.strategy} gives a general schedule, which the executor does not run")
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    figures, ops = profile_cell(built.model, training_step, args.device, args.warmup, args.steps,
                                args.out_stem.with_suffix(".json") if args.trace else None)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    command = command_of("profile_step", argv)
    lines = [f"- {name}: {value:.4g}" for name, value in figures.items()]
    ops.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.4g")
    args.out_stem.with_suffix(".md").write_text(
        f"{made_by(command)}, on {where} ({'compiled' if args.compile else 'eager'}; "
        f"{args.net} batch {cell.batch_size}, side {cell.image_size}; plan: {len(chosen.stages)} stage(s), "
        f"{bin(chosen.recomputed).count('1')} recomputed IR nodes). Per step, mean of {args.steps} profiled "
        f"steps after {args.warmup} warm-ups and {args.steps} unprofiled steps; every op in `{args.out_stem.name}.csv`."
        "\n\n" + "\n".join(lines) + "\n\n"
        + ops.head(args.top).to_markdown(index=False, floatfmt=".4g") + "\n")
    print("\n".join(lines))
    print(f"profile: {args.out_stem}.md")


if __name__ == "__main__":
    main()
