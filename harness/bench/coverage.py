"""Coverage: does every model people train come out exact, and what does recomputation save on it?

``python -m harness.bench.coverage results/coverage [--models a,b] [--rows DIR] [--dtype D]`` takes every torchvision
classification model (``torchvision.models.list_models(module=torchvision.models)``), torchvision's
segmentation models, a small model of each of 46 timm families (``TIMM_MODELS``, at its config's side, with
stochastic depth 0.1 where it takes ``drop_path_rate``), smp's ``Unet``, ``FPN`` and ``PSPNet`` on three
encoders, and Hugging Face
``transformers`` causal LMs by model type (``HF_MODEL_TYPES``: two small layers, ``HF_SMALL``, on the CPU,
sequence 32; their config's defaults on meta, batch 8, sequence up to 1024). For each, on the CPU at a small
input (batch 2, side 64; a ViT at its patch size times 4; ``SIDES`` where a model needs more) with dropout,
attention dropout and stochastic depth switched on (``exact.switch_on_randomness``; each model a cell whose net is
``module:harness.bench.coverage:with_randomness``, run through the stages):
- traces it (or records why not: the module and the construct);
- runs one step under ``approx_dp``, ``chen_sqrt`` and ``swap`` (every value swapped) beside plain
  PyTorch's, and keeps the worst relative gradient difference (``harness.execute.exact``);
- on ``meta`` at the model's usual size (batch 32, side 224; smp at 512), measures ``vanilla`` and
  ``approx_dp`` (mc) and gives the reduction.
One JSON row per model lands in ``--rows`` (default ``OUT_rows``: ``results/coverage_rows``), written
atomically, so a killed run resumes; the table is ``OUT.md`` and ``OUT.csv``, with the totals and every
reason. ``--dtype bfloat16`` trains every model in it (``nets.build``'s ``dtype``), exact within
``harness.execute.exact.tolerance`` of it (NOTE [half precision] there); ``--models hf:`` takes a source's models.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from harness.bench.common import command_of, made_by
from harness.cell import Cell, make_cell
from harness.execute.exact import compare, switch_on_randomness, tolerance
from harness.results import Status, write_row
from harness.run import build, plan, run, step
from harness.zoo import nets

STRATEGIES = ("approx_dp", "chen_sqrt", "swap")
SMP_ARCHITECTURES = ("Unet", "FPN", "PSPNet")
SMP_ENCODERS = ("resnet34", "mobilenet_v2", "efficientnet-b0")
SMALL_BATCH, SMALL_SIDE, META_BATCH = 2, 64, 32
# transformers' causal LMs people train, and what makes each small on the CPU (its defaults on meta).
# (Not Mamba: without its CUDA kernels, transformers runs its scan as a Python loop over the sequence, which
# traces to a graph of layers x sequence nodes, over 10 GB to trace at 1024 tokens.)
HF_MODEL_TYPES = ("gpt2", "gpt_neox", "gptj", "opt", "bloom", "bert", "llama", "mistral", "mixtral", "qwen2", "qwen3",
                  "gemma", "gemma2", "gemma3_text", "olmo2", "phi3", "starcoder2", "stablelm", "granite", "gpt_oss")
# timm: a small model of each family people train, CNNs, ViTs, hybrids and MLPs (its config's side).
TIMM_MODELS = (
    "resnet50d", "efficientnet_b0", "mobilenetv3_large_100", "convnext_atto", "vit_tiny_patch16_224",
    "deit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "regnety_008", "rexnet_100", "ghostnet_100",
    "levit_128s", "mixer_s16_224", "resmlp_12_224", "poolformer_s12", "coat_lite_tiny", "twins_svt_small",
    "pit_ti_224", "cait_xxs24_224", "xcit_nano_12_p16_224", "efficientformer_l1", "mobilevit_xxs",
    "edgenext_xx_small", "coatnet_nano_rw_224", "fastvit_t8", "repvit_m1", "efficientvit_b0", "hgnet_tiny",
    "inception_next_tiny", "caformer_s18", "eva02_tiny_patch14_224", "tiny_vit_5m_224", "nfnet_l0", "dla34",
    "hrnet_w18_small", "cspresnet50", "res2net50_26w_4s", "skresnet18", "resnest14d", "nest_tiny", "gcvit_xxtiny",
    "davit_tiny", "mvitv2_tiny", "focalnet_tiny_srf", "volo_d1_224", "sequencer2d_s", "gmlp_ti16_224")
HF_SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "rotary_dim": 8, "pad_token_id": 0}


def catalogue() -> list[str]:
    """Every model the benchmark covers: ``nets`` names, and ``smp:ARCHITECTURE:ENCODER``."""
    import torchvision.models as tvm

    names = [f"torchvision:{name}" for name in tvm.list_models(module=tvm)]
    names += [f"torchvision:{name}" for name in tvm.list_models(module=tvm.segmentation)]
    names += [f"timm:{name}" for name in TIMM_MODELS]
    names += [f"smp:{arch}:{encoder}" for arch in SMP_ARCHITECTURES for encoder in SMP_ENCODERS]
    names += [f"hf:{model_type}" for model_type in HF_MODEL_TYPES]
    return names


def smp_model(architecture: str, encoder: str, classes: int = 2):
    """An smp model without weights, through the zoo's ``SmpForward`` (smp's forward checks the input's
    shape in Python, which torch.fx cannot trace)."""
    import segmentation_models_pytorch as smp

    return nets.SmpForward(getattr(smp, architecture)(encoder, encoder_weights=None, classes=classes))


def _settings(name: str, side: int | None, batch: int | None, device: str) -> tuple[str, int | None, int | None, dict]:
    """The net (a ``SOURCE:NAME`` of ``harness.zoo.models``), batch, side and net options of a catalogue entry."""
    options = {}
    if name.startswith("smp:"):  # through the module source, as a user's own factory goes
        _, architecture, encoder = name.split(":")
        options = {"kwargs": {"architecture": architecture, "encoder": encoder}, "loss": "segmentation"}
        name = "module:harness.bench.coverage:smp_model"
    elif name.startswith("hf:"):  # on meta at the net's own sizes: batch 8, up to 1024 tokens
        if device == "meta":
            return name, None, None, {}
        options = {"kwargs": HF_SMALL}
    elif name.startswith("timm:") and _takes_drop_path(name.removeprefix("timm:")):
        options = {"kwargs": {"drop_path_rate": 0.1}}
    elif name.startswith("torchvision:vit_"):
        patch = int(name.rsplit("_", 1)[1])
        side = side if side == 224 else 4 * patch
        options = {"kwargs": {"image_size": side}}
    return name, batch, side, options


def with_randomness(name: str, options: dict) -> torch.nn.Module:
    """The net ``name`` (``harness.zoo.models``' ``SOURCE:NAME``, with its net ``options``) with dropout, attention
    dropout and stochastic depth switched on (``exact.switch_on_randomness``): the factory of the ``module:`` net
    each exactness cell runs, so that the trace sees every random op the model can draw."""
    return switch_on_randomness(nets.spec(name, **options).build_model())


def _exactness_cell(name: str, dtype: str) -> Cell:
    """A catalogue entry as a cell on the CPU at its small size, its randomness switched on (``with_randomness``);
    the strategy is set per run."""
    small, _ = _sides(name)
    net, batch, side, options = _settings(name, small, SMALL_BATCH, "cpu")
    spec = nets.spec(net, **options)
    net_options = {"kwargs": {"name": net, "options": options}, "input": spec.input, "channels": spec.channels,
                   "vocab_size": spec.vocab_size, "loss": spec.loss}
    return make_cell("module:harness.bench.coverage:with_randomness", "vanilla", batch_size=batch,
                     image_size=side if side is not None else spec.image_size, device="cpu", dtype=dtype,
                     net_options={key: value for key, value in net_options.items() if value is not None})


@functools.cache  # asked by the CPU build and the meta build of each model
def _takes_drop_path(name: str) -> bool:
    """Whether timm model ``name`` takes ``drop_path_rate`` (stochastic depth)."""
    import timm

    try:
        timm.create_model(name, pretrained=False, drop_path_rate=0.1)
    except TypeError:
        return False
    return True


# (small side on the CPU, usual side on meta) where the defaults do not fit the model.
SIDES = {"torchvision:inception_v3": (299, 299), "torchvision:maxvit_t": (224, 224)}  # aux head; fixed windows


def _sides(name: str) -> tuple[int, int]:
    """(small side on the CPU, usual side on meta)."""
    if name.startswith("smp:"):
        return SMALL_SIDE, 512
    if name.startswith("hf:"):
        return 32, None
    if name.startswith("timm:"):  # its config's, on both: many take no other
        return None, None
    return SIDES.get(name, (SMALL_SIDE, 224))


def cover(name: str, dtype: str = "float32") -> dict:
    """One model's row, trained in ``dtype``."""
    row = {"model": name, "dtype": dtype, "traced": False, "ir_nodes": None, "reason": ""}
    try:
        cell = _exactness_cell(name, dtype)
        torch.manual_seed(0)
        built = build(cell)
    except Exception as error:  # the reason is the row's point
        row["reason"] = _reason(error)
        return row
    row.update(traced=True, ir_nodes=len(built.graph))
    worst = 0.0
    for strategy in STRATEGIES:
        try:
            each = cell.but(strategy=strategy, options={"min_bytes": 0} if strategy == "swap" else {})
            difference = compare(built.model, built.example_input, built.loss_fn,
                                 step(each, built, plan(each, built)))
        except Exception as error:
            row[f"{strategy}_error"] = _reason(error)
            row["reason"] = row["reason"] or f"{strategy}: {_reason(error)}"
            worst = math.inf
            continue
        row[f"{strategy}_worst"] = difference.worst_gradient
        row[f"{strategy}_buffers"] = ",".join(difference.buffers)
        worst = max(worst, difference.worst_gradient, math.inf if difference.buffers else 0.0)
        if not difference.exact and not row["reason"]:
            row["reason"] = (f"{strategy}: gradient of {difference.worst_parameter} off by "
                             f"{difference.worst_gradient:.2g}" + (f"; buffers {difference.buffers}"
                                                                   if difference.buffers else ""))
    row["worst_gradient"] = worst
    row["exact"] = worst <= tolerance(nets.check_dtype(dtype))
    del built
    row.update(_reduction(name, _sides(name)[1], dtype))
    return row


def _reduction(name: str, side: int, dtype: str) -> dict:
    """vanilla and approx_dp (mc) measured on meta at the model's usual size, a cell each."""
    net, batch, side, options = _settings(name, side, META_BATCH, "meta")
    rows = {}
    for label, strategy, strategy_options in (("vanilla", "vanilla", {}),
                                              ("approx_dp_mc", "approx_dp", {"mode": "mc"})):
        try:
            rows[label] = run(make_cell(net, strategy, batch_size=batch, image_size=side, dtype=dtype,
                                        options=strategy_options, net_options=options, warmup_steps=0, timed_steps=0))
        except Exception as error:  # bad settings: the reason is the row's point
            return {"meta_error": _reason(error)}
        if rows[label]["status"] != Status.OK:
            return {"meta_error": str(rows[label].get("error", rows[label]["status"])).splitlines()[0][:800]}
    peaks = {label: row["measured_peak_bytes"] for label, row in rows.items()}
    return {"meta_side": rows["vanilla"]["image_size"], "meta_batch": rows["vanilla"]["batch_size"],
            "vanilla_gb": peaks["vanilla"] / 1e9, "approx_dp_mc_gb": peaks["approx_dp_mc"] / 1e9,
            "reduction": 1 - peaks["approx_dp_mc"] / peaks["vanilla"]}


def _reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text[:800]


def _file(model: str) -> str:
    return model.replace(":", "__").replace("/", "_")


def table(rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The per-model table and the totals paragraph."""
    out = pd.DataFrame({
        "model": rows.model,
        "traced": rows.traced.map({True: "yes", False: "no"}),
        "IR nodes": rows.ir_nodes.astype("Int64"),
        **{f"{s} worst": rows.get(f"{s}_worst") for s in STRATEGIES},
        "exact": rows.get("exact").map({True: "yes", False: "NO"}).fillna("") if "exact" in rows else "",
        "meta vanilla GB": rows.get("vanilla_gb"),
        "approx_dp (mc) GB": rows.get("approx_dp_mc_gb"),
        "reduction": rows.get("reduction").map(lambda r: "" if pd.isna(r) else f"{100 * r:.0f}%"),
        "reason": rows.reason.fillna("") + rows.get("meta_error", pd.Series("", index=rows.index)).fillna("").map(
            lambda e: f" (meta: {e})" if e else ""),
    })
    traced = rows[rows.traced]
    exact = traced[traced.exact == True]  # noqa: E712 (a column of bools)
    tolerances = ", ".join(f"{tolerance(nets.check_dtype(d)):g} ({d})" for d in _dtypes(rows))
    lines = [f"- models: {len(rows)}; traced: {len(traced)}; exact (worst relative gradient difference "
             f"<= {tolerances} under every strategy, buffers equal): {len(exact)}; not exact: "
             f"{len(traced) - len(exact)}; not traced: {len(rows) - len(traced)}"]
    for _, row in rows[~rows.model.isin(exact.model)].iterrows():
        lines.append(f"- {row.model}: {row.reason or 'no reason recorded'}")
    if "reduction" in rows:
        lines.append(f"- approx_dp (mc) against vanilla on meta: median reduction "
                     f"{100 * rows.reduction.median():.0f}%, range {100 * rows.reduction.min():.0f}% to "
                     f"{100 * rows.reduction.max():.0f}% over {rows.reduction.notna().sum()} models")
    return out, "\n".join(lines)


def _dtypes(rows: pd.DataFrame) -> list[str]:
    """The dtypes the rows trained in (a row from before ``--dtype`` trained in float32)."""
    return sorted(set(rows.get("dtype", pd.Series("float32", index=rows.index)).fillna("float32")))


def select(names: list[str], models: str) -> list[str]:
    """``--models``: comma-separated names of the catalogue, where ``SOURCE:`` (``hf:``) takes a source's."""
    def matches(item: str) -> list[str]:
        return [n for n in names if n == item or (item.endswith(":") and n.startswith(item))]

    unknown = [item for item in models.split(",") if not matches(item)]
    if unknown:
        sources = sorted({n.split(":")[0] + ":" for n in names})
        raise SystemExit(f"not in the catalogue: {unknown}; run without --models for all {len(names)}, "
                         f"or name a source: {', '.join(sources)}")
    return [name for item in models.split(",") for name in matches(item)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.bench.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output path without suffix (.md and .csv are written)")
    parser.add_argument("--rows", type=Path, default=None, help="one JSON row per model (default: OUT_rows)")
    parser.add_argument("--models", default=None,
                        help="comma-separated subset of the catalogue; SOURCE: (hf:) takes a source's models")
    parser.add_argument("--dtype", default="float32", help=f"what the models train in: {', '.join(nets.DTYPES)}")
    parser.add_argument("--rerun", action="store_true", help="measure again models whose row exists")
    args = parser.parse_args(argv)
    nets.check_dtype(args.dtype)
    args.rows = args.rows or args.out.with_name(args.out.name + "_rows")
    names = catalogue()
    if args.models:
        names = select(names, args.models)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in tqdm(names, desc="coverage", file=sys.stdout):
        path = args.rows / f"{_file(name)}.json"
        if path.exists() and not args.rerun and json.loads(path.read_text()).get("dtype", "float32") == args.dtype:
            continue
        start = time.perf_counter()
        try:
            row = cover(name, args.dtype)
        except Exception:  # a harness bug: recorded, and the sweep goes on
            row = {"model": name, "traced": False, "reason": "harness error: " + traceback.format_exc(limit=3)}
        row["seconds"] = time.perf_counter() - start
        write_row(row, args.rows, f"{_file(name)}.json")
        tqdm.write(f"{name}: {'exact' if row.get('exact') else row.get('reason', '')} ({row['seconds']:.0f} s)")
    rows = pd.DataFrame([json.loads(p.read_text()) for p in sorted(args.rows.glob("*.json"))])
    rows = rows[rows.model.isin(catalogue())]
    out, totals = table(rows.sort_values("model").reset_index(drop=True))
    command = command_of("coverage", argv)
    header = (f"{made_by(command)}; {', '.join(_dtypes(rows))}; exactness "
              f"on cpu (batch {SMALL_BATCH}, side {SMALL_SIDE}, dropout and stochastic depth on, torch "
              f"{torch.__version__}), reductions measured on meta (meta-tracker, batch {META_BATCH}, side 224; smp "
              f"512; timm: its config's side on both; hf: two small layers and sequence 32 on cpu; the config's "
              f"defaults, batch 8 and up to 1024 tokens on meta).\n\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(args.out.with_suffix(".csv"), index=False, float_format="%.3g")
    args.out.with_suffix(".md").write_text(header + totals + "\n\n" + out.to_markdown(index=False, floatfmt=".2g") + "\n")
    print(totals)


if __name__ == "__main__":
    main()
