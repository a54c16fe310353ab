"""The largest batch each strategy fits in a stated device memory: ``python -m harness.bench.max_batch OUT_STEM``.

For every net and strategy, and each memory (``--memory 11.4GB,80GB``: Kusumoto et al.'s K40c and an H100), the
largest batch whose run fits: status ``ok`` and a measured peak within the memory. A strategy that can
trade time for memory gets the memory as its budget (the time-centric DPs, the budget greedy, swap), less
the device reserve a first run measured (``run_within``); the memory-centric DPs run at their minimal budget
(Kusumoto et al. 2019, section 5.1), and so does the least memory (``optimal``, mode mc, 20 s a probe, proven or
the best plan found), and the others as they are. The
search starts from a guess (the paper's batch scaled by the memory left over, from a measured first run),
gallops to a bracket and bisects; every probe is a real run whose row lands in ``--rows``, so a killed
search resumes from the rows already there. Writes ``OUT_STEM.md`` and ``.csv``.

NOTE [searching on the device from meta's answer]
On meta the tracker's peak is the one accounting's, and on cuda the tracker sees the same bytes (to the byte
in every eager H200 row); the device adds only its reserve (workspaces, rounding: ``device_reserve_bytes``).
So the device's largest batch is meta's or a few fewer. Started there (``--guess-from`` the meta search's
rows) a batch at a time, a search takes two or three probes instead of six to eight, each a minute or more
near batch 2,000 on a GPU; a first probe over the memory steps down at once by as many samples as its
overshoot holds. The answer is still the device's: every probe is a run there.
"""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from tqdm import tqdm

from harness.bench.common import add_rows_options, command_of, made_by
from harness.bench.paper_numbers import TABLE1_GB
from harness.budget import parse_budget
from harness.results import DEVICE_TIME_NOTE, Status, device_time, label, read_row, stored_path
from harness.run import run_cell
from harness.zoo import nets

# (strategy, options), Kusumoto et al.'s columns first; options as the strategy configs give them.
STRATEGIES = [("vanilla", {}), ("liveness_only", {}), ("chen_sqrt", {}), ("chen_greedy", {}),
              ("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"}), ("exact_dp", {"mode": "tc"}),
              ("exact_dp", {"mode": "mc"}), ("swap", {}), ("optimal", {"mode": "mc", "time_limit_s": 20})]
USES_DEVICE_BUDGET = {"chen_greedy", "swap"}


def cell_budget(strategy: str, options: dict, memory: int) -> int | None:
    """The budget a strategy is run with on a device of ``memory`` bytes (module docstring)."""
    if options.get("mode") == "tc" or strategy in USES_DEVICE_BUDGET:
        return memory
    return None


def fits(row: dict, memory: int) -> bool:
    return row["status"] == Status.OK and row["measured_peak_bytes"] <= memory


def largest_batch(fits_at: Callable[[int], bool], guess: int, step: int | None = None) -> int:
    """The largest batch b with ``fits_at(b)`` (0 when batch 1 does not fit), for a monotone ``fits_at``:
    gallop from ``guess`` in steps that double (the first ``step``, by default a sixteenth of the guess),
    then bisect the bracket."""
    step = max(1, guess // 16) if step is None else step
    if fits_at(guess):
        low = guess
        while fits_at(low + step):
            low, step = low + step, 2 * step
        high = low + step
    else:
        high = guess
        while True:
            low = max(0, high - step)
            if low == 0 or fits_at(low):
                break
            high, step = low, 2 * step
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits_at(middle) else (low, middle)
    return low


class MissingRow(LookupError):
    """A search replayed over stored rows (``--from-rows``) needs a probe that was never run."""


def stored_row(net: str, strategy: str, batch: int, device: str, budget: int | None, options: dict,
               rows_dir: Path, required: bool = True) -> dict | None:
    """The row a probe wrote earlier (``--from-rows``: a search re-read where its device is not at hand);
    None when there is none and it is not ``required``."""
    path = stored_path(rows_dir, net, strategy, batch_size=batch, image_size=nets.spec(net).image_size,
                       device=device, budget_bytes=budget, options=options)
    if not path.exists():
        if not required:
            return None
        raise MissingRow(f"no row {path.name}: run the search where device {device} is")
    return read_row(path)


def run_within(net: str, strategy: str, options: dict, batch: int, memory: int, device: str, rows_dir: Path,
               from_rows: bool = False, warmup_steps: int = 1, timed_steps: int = 3,
               missing_ok: bool = False, tried: list | None = None) -> dict | None:
    """The row of ``strategy`` at ``batch`` on a device of ``memory`` bytes (``cell_budget``). A plan given
    the memory as its budget fills it by the one accounting, which leaves out what the device adds
    (allocator rounding, cuDNN's and cuBLAS's workspaces: the row's ``device_reserve_bytes``, measured on
    cuda as the allocator's peak less the tracker's); where the run measures more than the memory, it runs
    once more with that reserve taken off the budget, as a user would. Rows stored before rows carried the
    reserve take the overshoot off instead, and rows stored before that retry existed (the H100's Figure 3)
    have none: the first run's row stands. ``missing_ok`` (``from_rows``): None where no row was stored.
    ``tried`` gets every row, the first run's too."""
    def probe(budget, required=True):
        if from_rows:
            row = stored_row(net, strategy, batch, device, budget, options, rows_dir, required)
        else:
            row = run_cell(net, strategy, batch_size=batch, device=device, budget=budget, options=options,
                           warmup_steps=warmup_steps, timed_steps=timed_steps, results_dir=rows_dir, resume=True)
        if tried is not None and row is not None:
            tried.append(row)
        return row

    budget = cell_budget(strategy, options, memory)
    row = probe(budget, required=not missing_ok)
    if row is None:
        return None
    if budget is not None and row["status"] == Status.OK and memory < row["measured_peak_bytes"] < 2 * memory:
        reserve = row.get("device_reserve_bytes") or row["measured_peak_bytes"] - memory
        row = probe(budget - reserve, required=False) or row
    return row


def search(net: str, strategy: str, options: dict, memory: int, device: str, rows_dir: Path,
           progress: tqdm | None, from_rows: bool = False, guess_from: Path | None = None,
           timed_steps: int = 3) -> dict:
    """Probe runs of one (net, strategy, memory) until its largest batch is known; its row in the table.
    ``guess_from``: the rows of the same search on meta, whose answer the search starts from, a step of one
    batch (NOTE [searching on the device from meta's answer]); ``timed_steps`` per probe (0: memory only)."""
    spec = nets.spec(net)
    probes: dict[int, dict] = {}
    over: dict[int, dict] = {}  # batch -> a run of it that measured more than the memory

    def fits_at(batch: int) -> bool:
        tried = []
        row = run_within(net, strategy, options, batch, memory, device, rows_dir, from_rows,
                         warmup_steps=min(1, timed_steps), timed_steps=timed_steps, tried=tried)
        over.update({batch: r for r in tried if r["status"] == Status.OK and r["measured_peak_bytes"] > memory})
        probes[batch] = row
        if progress is not None:
            progress.set_postfix_str(f"{net} {label(strategy, options)} batch {batch}: {row['status']}")
        return fits(row, memory)

    if guess_from is not None:
        guess = search(net, strategy, options, memory, "meta", guess_from, None, from_rows=True)["largest batch"]
        step = 1
        if not fits_at(guess) and guess in over:  # over by the device's reserve: that many samples fewer
            row = over[guess]
            per_sample = max(1, (row["measured_peak_bytes"] - 2 * row["measured_params_bytes"]) / guess)
            guess = max(1, guess - math.ceil((row["measured_peak_bytes"] - memory) / per_sample))
    else:
        fits_at(spec.batch_size)
        first = probes[spec.batch_size]
        guess, step = spec.batch_size, None
        if first["status"] == Status.OK:  # peak = fixed + batch * per-sample bytes, from one measured point
            fixed = 2 * first["measured_params_bytes"]  # parameters and their gradients
            per_sample = max(1, (first["measured_peak_bytes"] - fixed) / spec.batch_size)
            guess = max(1, int((memory - fixed) / per_sample))
    batch = largest_batch(fits_at, guess, step)
    return _search_row(net, strategy, options, memory, device, batch, probes.get(batch),
                       _why_not(probes.get(batch + 1), memory), len(probes))


def _search_row(net: str, strategy: str, options: dict, memory: int, device: str, batch=float("nan"),
                best: dict | None = None, next_batch: str = "", probes=float("nan")) -> dict:
    """A search's row in the table: its answer ``batch``, the probe's row there (``best``), why one more does
    not fit; NaN where the search is not known."""
    return {"net": net, "strategy": label(strategy, options), "memory GB": memory / 1e9, "largest batch": batch,
            "peak GB there": best["measured_peak_bytes"] / 1e9 if best else float("nan"),
            "device reserve GB there": (best.get("device_reserve_bytes") or 0) / 1e9 if best else float("nan"),
            "next batch": next_batch, "probes": probes, "paper batch": nets.spec(net).batch_size, "device": device,
            **({"step ms there": best.get("step_time_ms") if best else None, **device_time(best or {})}
               if device == "cuda" else {})}


def replayed(net: str, strategy: str, options: dict, memory: int, args, progress: tqdm) -> dict:
    """``search``'s row; replayed over stored rows (``--from-rows``), a search whose probes were not all run (a
    GPU run cut short) is a row that says so, and the table is drawn from the rest."""
    try:
        return search(net, strategy, options, memory, args.device, args.rows, progress, args.from_rows,
                      args.guess_from, args.timed_steps)
    except MissingRow as missing:
        if not args.from_rows:
            raise
        return _search_row(net, strategy, options, memory, args.device, next_batch=f"not known: {missing}")


def _why_not(row: dict | None, memory: int) -> str:
    if row is None:
        return ""
    if row["status"] != Status.OK:
        return row["status"]
    return f"{row['measured_peak_bytes'] / 1e9:.2f} GB" + (" (over)" if row["measured_peak_bytes"] > memory else "")


def _rows_of(rows_dir: Path, device: str) -> list[dict]:
    return [read_row(path) for path in rows_dir.glob(f"*__{device}.json")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.max_batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--memory", default="11.4GB,80GB", help="device memories, comma-separated")
    parser.add_argument("--nets", default=",".join(TABLE1_GB), help="comma-separated")
    parser.add_argument("--strategies", default=",".join(sorted({s for s, _ in STRATEGIES})),
                        help="comma-separated; the DPs run both tc and mc")
    parser.add_argument("--device", default="meta", choices=["meta", "cuda"])
    add_rows_options(parser, "probe", "replay the searches over the rows in --rows (made where --device was)")
    parser.add_argument("--guess-from", type=Path, help="the rows of the same searches on meta: each search "
                        "starts from meta's answer, a batch at a time (for a device where a probe is slow)")
    parser.add_argument("--timed-steps", type=int, default=3, help="steps timed per probe (0: memory only)")
    args = parser.parse_args(argv)
    memories = [parse_budget(m) for m in args.memory.split(",")]
    chosen = set(args.strategies.split(","))
    cells = [(net, strategy, options, memory) for memory in memories for net in args.nets.split(",")
             for strategy, options in STRATEGIES if strategy in chosen]
    progress = tqdm(cells, desc="largest batch")
    table = pd.DataFrame([replayed(net, strategy, options, memory, args, progress) for net, strategy, options, memory
                          in progress])
    table[["largest batch", "probes"]] = table[["largest batch", "probes"]].astype("Int64")  # NaN: not known
    command = command_of("max_batch", argv)
    measured = [r for r in _rows_of(args.rows, args.device) if r.get("device_name")]
    device_name = ("meta (the tracker's live bytes)" if args.device == "meta"
                   else ", ".join(sorted({r["device_name"] for r in measured})))
    torch_version = ", ".join(sorted({r["torch_version"] for r in measured})) if args.from_rows else torch.__version__
    wide = table.pivot(index=["net", "strategy"], columns="memory GB", values="largest batch")
    wide.columns = [f"largest batch in {m:g} GB" for m in wide.columns]
    order = {label(s, o): i for i, (s, o) in enumerate(STRATEGIES)}
    wide = wide.reset_index().sort_values(["net", "strategy"], key=lambda c: c.map(order) if c.name == "strategy"
                                          else c.map(list(TABLE1_GB).index))
    lines = [f"{made_by(command)}, device {device_name}, {platform.machine()}, "
             f"torch {torch_version}. A batch fits when its run is `ok` and its measured peak (parameters, "
             "gradients and the input batch included) is within the memory; `next batch` says why one more "
             "does not." + (f" At the largest batch: `step ms there`, the step's wall time. {DEVICE_TIME_NOTE}"
                            if args.device == "cuda" else ""),
             "", wide.to_markdown(index=False), "", "## Every search", "",
             table.to_markdown(index=False, floatfmt=".2f"), ""]
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    args.out_stem.with_suffix(".md").write_text("\n".join(lines))
    table.to_csv(args.out_stem.with_suffix(".csv"), index=False, float_format="%.3f")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
