"""Swap against Meng et al.'s Table 1: ``python -m harness.bench.swap OUT_STEM [--device meta]``.

Three tables, written to ``OUT_STEM.md`` and ``OUT_STEM.csv``:
1. the largest ResNet-50 batch (224x224) whose measured peak fits a 12 GiB device, for ``vanilla``,
   ``swap`` and ``swap`` on ``approx_dp`` (Meng et al. 2017: 144 -> 664 on a 12 GB M40), by a gallop and bisection
   (``harness.bench.max_batch.largest_batch``);
2. the measured peak of ResNet-101/200/1001/2000 at batch 32 under ``vanilla`` and under ``swap`` with every
   candidate swapped (Meng et al. 2017 Table 1(b));
3. for each row of table 2, the step time the simulator predicts (compute, and the lower bound max(compute,
   bytes / bandwidth)) on two device models: Meng et al.'s (an M40 at 6 TFLOP/s behind PCIe 3.0 at 12 GB/s)
   and today's (an H100 at 100 TFLOP/s behind PCIe 5.0 at 50 GB/s). These are the cost model's predictions
   at the throughputs named, not measurements; with ``--device cuda`` the measured step times come too.

ResNet-101 is torchvision's; ResNet-200 has bottleneck blocks [3, 24, 36, 3] (He et al. 2016); ResNet-1001
and -2000 are not defined for ImageNet by Meng et al. 2017, so this benchmark builds them with 333 and 666 blocks
split as ResNet-200's stages are ([3, 131, 196, 3] and [3, 264, 396, 3]): 3 layers a block, plus 2.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import pandas as pd
import torch
from torchvision.models.resnet import Bottleneck, ResNet
from tqdm import tqdm

import strategies
from harness.bench.common import command_of, made_by
from harness.bench.max_batch import largest_batch as search_largest
from harness.cell import make_cell
from harness.results import Status
from harness.run import build, measure, plan, run, step
from strategies.simulate import swap_step_time

GIB = 2**30
DEVICE_BUDGET = 12 * GIB
RESNETS = {"resnet101": [3, 4, 23, 3], "resnet200": [3, 24, 36, 3], "resnet1001": [3, 131, 196, 3],
           "resnet2000": [3, 264, 396, 3]}
MENG_2017_PEAK_MB = {"resnet101": (5815, 2660), "resnet200": (10662, 3052), "resnet1001": (None, 5979),
                    "resnet2000": (None, 10650)}  # (TensorFlow r1.2, with swap), batch 32, M40
DEVICE_MODELS = {"M40 + PCIe 3.0": (6.0, 12.0), "H100 + PCIe 5.0": (100.0, 50.0)}  # TFLOP/s, GB/s each way
CELLS = [("vanilla", {}), ("swap", {}), ("swap", {"base": "approx_dp"})]


def label(strategy: str, options: dict) -> str:
    return strategy + (f" on {options['base']}" if options.get("base") else "")


def largest_batch(strategy: str, options: dict, device: str, progress) -> int:
    """The largest ResNet-50 batch whose run fits ``DEVICE_BUDGET`` (the plan's budget and the measured peak)."""
    def fits(batch: int) -> bool:
        row = run(make_cell("resnet50", strategy, batch_size=batch, image_size=224, device=device,
                            budget=DEVICE_BUDGET, options=options, warmup_steps=1, timed_steps=3))
        progress.set_postfix_str(f"{label(strategy, options)} batch {batch}: {row['status']}")
        return row["status"] == Status.OK and row["measured_peak_bytes"] <= DEVICE_BUDGET

    return search_largest(fits, guess=144)  # Meng et al.'s vanilla figure


def meng_resnet(blocks: list[int]) -> torch.nn.Module:
    """A ResNet of bottleneck ``blocks`` per stage (``RESNETS``), as a ``module:`` net's factory."""
    return ResNet(Bottleneck, blocks)


def resnet_rows(name: str, device: str) -> list[dict]:
    """Vanilla and swap (every candidate) on one ResNet at batch 32: measured and predicted peaks, and the
    predicted step time on each device model."""
    built, rows = None, []
    for (strategy, options), paper_mb in zip(CELLS[:2], MENG_2017_PEAK_MB[name]):
        cell = make_cell("module:harness.bench.swap:meng_resnet", strategy, batch_size=32, image_size=224,
                         device=device, options=options, net_options={"kwargs": {"blocks": RESNETS[name]}},
                         warmup_steps=1, timed_steps=3)
        built = built or build(cell)
        chosen = plan(cell, built)
        row = {"net": name, "blocks": str(RESNETS[name]), "strategy": label(strategy, options), "batch": 32}
        try:
            measured = measure(cell, built, chosen, step(cell, built, chosen))
            row.update({"measured GB": measured["measured_peak_bytes"] / 1e9,
                        "host GB": measured["measured_host_peak_bytes"] / 1e9,
                        "measured step ms": measured["step_time_ms"]})
        except torch.cuda.OutOfMemoryError:
            row.update({"measured GB": None, "note": "oom"})
        row["predicted GB"] = (strategies.simulate(built.graph, chosen).peak_bytes + built.static_bytes) / 1e9
        row["Meng et al. 2017 MB"] = paper_mb if paper_mb is not None else "OOM"
        for device_model, (tflops, gbps) in DEVICE_MODELS.items():
            times = swap_step_time(built.graph, chosen, gbps * 1e9, tflops * 1e12)
            row[f"{device_model}: compute ms"] = times["compute_s"] * 1e3
            row[f"{device_model}: bound ms"] = times["step_time_bound_s"] * 1e3
            row[f"{device_model}: overhead %"] = 100 * (times["step_time_bound_s"] / times["compute_s"] - 1)
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_stem", type=Path)
    parser.add_argument("--device", default="meta", choices=["meta", "cuda"])
    parser.add_argument("--nets", default=",".join(RESNETS), help="table 2's nets, comma-separated")
    args = parser.parse_args(argv)
    progress = tqdm(CELLS, desc="ResNet-50 largest batch")
    batches = []
    for (strategy, options), paper in zip(progress, (144, 664, None)):
        batches.append({"net": "resnet50", "strategy": label(strategy, options), "device budget GiB": 12,
                        "largest batch": largest_batch(strategy, options, args.device, progress),
                        "Meng et al. 2017 (M40, TF r1.2)": paper if paper is not None else ""})
    nets = args.nets.split(",")
    peaks = [row for name in tqdm(nets, desc="ResNets at batch 32") for row in resnet_rows(name, args.device)]
    command = command_of("swap", argv)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "meta (tracker)"
    table_1, table_2 = pd.DataFrame(batches), pd.DataFrame(peaks)
    memory_columns = ["net", "blocks", "strategy", "batch", "measured GB", "predicted GB", "host GB", "Meng et al. 2017 MB"]
    time_columns = ["net", "strategy"] + [c for c in table_2.columns if ":" in c]
    if args.device == "cuda":
        time_columns.append("measured step ms")
    lines = [
        f"{made_by(command)}, device {device_name}, {platform.machine()}, torch "
        f"{torch.__version__}.",
        "",
        "## Largest ResNet-50 batch within a 12 GiB device (224x224; measured peak, parameters and gradients "
        "included)",
        "",
        table_1.to_markdown(index=False),
        "",
        "## Peak memory at batch 32 (Meng et al. 2017 Table 1(b)); swap with every candidate (>= 1 MiB) on the host",
        "",
        table_2[memory_columns].to_markdown(index=False, floatfmt=".2f"),
        "",
        "## Predicted step time: compute, and the swap bound max(compute, bytes out / bandwidth, bytes in / "
        "bandwidth)",
        "",
        "The cost model's prediction at the throughputs named (FLOPs at a fixed rate, a backward twice its "
        "forward), not a measurement. Overhead is the bound over compute.",
        "",
        table_2[time_columns].to_markdown(index=False, floatfmt=".1f"),
        "",
    ]
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    args.out_stem.with_suffix(".md").write_text("\n".join(lines))
    pd.concat([table_1.assign(table="largest batch"), table_2.assign(table="batch 32")]).to_csv(
        args.out_stem.with_suffix(".csv"), index=False)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
