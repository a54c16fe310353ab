"""One rank's memory under FSDP2, strategy by strategy: ``python -m harness.bench.fsdp OUT_STEM``.

For a net sharded over ``--world-size`` ranks of ``--memory`` each (default: the 8B Llama at sequence 4096
on 8 ranks of 80 GB, AdamW), every strategy and peer at batch 1: the rank's peak, its static part (what
FSDP2 holds, measured with ``fully_shard`` on a fake process group) and its plan's step, beside the
prediction; and the largest micro-batch whose rank fits the memory (NOTE [a rank under FSDP2] in
``harness/execute/sharding.py``). A strategy with a budget to meet is given the memory; the others run as they are.
``exact_dp`` and ``optimal`` are left out: on the 8B graph (1,352 nodes) the exact DP's 906,136 lower sets
outlast its time limit, and the search for the optimum proves no bound in minutes. Every probe is a cell
whose row lands in ``--rows``. Writes ``OUT_STEM.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness.bench.common import command_of, made_by
from harness.bench.max_batch import fits, largest_batch
from harness.budget import parse_budget
from harness.results import label
from harness.run import run_cell

STRATEGIES = [("vanilla", {}), ("chen_sqrt", {}), ("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"}),
              ("torch_checkpoint_blocks", {}), ("sac_ops", {}), ("sac_ops", {"every_second_mm": True}),
              ("megatron_selective", {})]


def rank_row(net: str, strategy: str, options: dict, batch: int, memory: int, world_size: int, optimizer: str,
             sequence: int | None, rows: Path) -> dict:
    budget = memory if options.get("mode") == "tc" else None
    return run_cell(net, strategy, batch_size=batch, image_size=sequence, options=options, budget=budget,
                    world_size=world_size, shard="fsdp2", optimizer=optimizer, results_dir=rows, resume=True,
                    warmup_steps=0, timed_steps=1)


def gb(row: dict | None, key: str) -> float | None:
    return None if row is None or row.get(key) is None else row[key] / 1e9


def table(net: str, memory: int, world_size: int, optimizer: str, sequence: int | None, rows: Path) -> pd.DataFrame:
    records = []
    for strategy, options in tqdm(STRATEGIES, desc=f"{net}, {world_size} ranks"):
        first = rank_row(net, strategy, options, 1, memory, world_size, optimizer, sequence, rows)
        largest = largest_batch(lambda b: fits(rank_row(net, strategy, options, b, memory, world_size, optimizer,
                                                        sequence, rows), memory), guess=1)
        at = (rank_row(net, strategy, options, largest, memory, world_size, optimizer, sequence, rows)
              if largest else None)
        records.append({"strategy": label(strategy, options), "status at batch 1": first["status"],
                        "rank peak GB": gb(first, "measured_peak_bytes"),
                        "predicted GB": gb(first, "predicted_peak_bytes"),
                        "static GB": gb(first, "rank_static_bytes"),
                        "plan's step GB": gb(first, "rank_activations_bytes"),
                        "least rank budget GB": gb(first, "min_feasible_bytes"),
                        "largest micro-batch": largest, "rank peak there GB": gb(at, "measured_peak_bytes")})
    return pd.DataFrame(records)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--net", default="llama_8b")
    parser.add_argument("--sequence", type=int, default=None, help="tokens a sample (default: the net's)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--memory", default="80GB", help="one rank's memory")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--rows", type=Path, default=Path("results/rows_fsdp_meta"))
    args = parser.parse_args(argv)
    memory = parse_budget(args.memory, "meta")
    frame = table(args.net, memory, args.world_size, args.optimizer, args.sequence, args.rows)
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_stem.with_suffix(".csv"), index=False)
    header = (f"{made_by(command_of('fsdp', argv))} (device meta). One rank of {args.world_size} under FSDP2 "
              f"(`shard=fsdp2`, optimizer {args.optimizer}), {args.net}, ranks of {args.memory}: at batch 1 the rank's "
              "peak, its static part (FSDP2's sharded parameters, gradients and optimizer states and its gathered "
              "units, measured with `fully_shard` on a fake process group) and the plan's step (the rest), beside "
              "the prediction (an infeasible row: the least rank budget its strategy names); then the largest "
              "micro-batch whose rank fits. On meta, attention runs as PyTorch's math decomposition, which saves "
              "its probabilities in float32 (a GPU's flash attention saves none of them): the plans' steps are "
              "above what a GPU holds.")
    args.out_stem.with_suffix(".md").write_text(f"{header}\n\n{frame.to_markdown(index=False, floatfmt='.2f')}\n")
    print(frame.to_markdown(index=False, floatfmt=".2f"))


if __name__ == "__main__":
    main()
