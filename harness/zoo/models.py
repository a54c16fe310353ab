"""Any model, by name: ``SOURCE:NAME`` nets beside the zoo (``nets.spec`` and ``nets.build`` take them).

- ``torchvision:NAME``: a classification or segmentation model of ``torchvision.models`` (``weights=None``;
  a segmentation model's backbone too), e.g. ``torchvision:convnext_tiny``, ``torchvision:fcn_resnet50``.
- ``timm:NAME``: ``timm.create_model(NAME, pretrained=False)``; its default input side from its config.
- ``module:PACKAGE.MODULE:FACTORY``: a user's own factory, imported and called; it must return an
  ``nn.Module``.
- ``hf:MODEL_TYPE``: a Hugging Face ``transformers`` causal language model made from its config class's
  defaults (``AutoConfig.for_model``; ``kwargs`` are config fields, e.g. ``{num_hidden_layers: 2}``), never
  pretrained: ``hf:gpt2`` is GPT-2 small, ``hf:llama`` a 7B Llama. Fed token ids, it returns the logits,
  without a KV cache; the loss is next-token cross-entropy.

Options (``nets.build(name, **options)``; on the command line ``net.options.KEY=VALUE``):
``kwargs`` (the builder's keyword arguments, e.g. ``{image_size: 32}`` for ``vit_b_16``, ``{img_size:
64}`` for a timm ViT, ``{drop_path_rate: 0.1}``), ``input`` (``image`` or ``tokens``), ``channels``,
``vocab_size`` (token inputs) and ``loss`` (``classification``, ``segmentation``, ``next_token``, ``sum``).
Sizes are the run's ``batch_size`` and ``image_size`` (for tokens, the sequence length): 32 and the
model's usual side (224, or its config's) by default.
"""

from __future__ import annotations

import difflib
import importlib
import inspect

from torch import nn

from harness.zoo.netspec import LOSSES, NetSpec

SOURCES = ("torchvision", "timm", "module", "hf")
DEFAULT_BATCH = 32
OPTIONS = ("kwargs", "input", "channels", "vocab_size", "loss")


def spec(name: str, **options) -> NetSpec:
    """The ``NetSpec`` of ``SOURCE:NAME``; bad names and options fail here, with the valid choices."""
    source, _, model = name.partition(":")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown net options {unknown}; valid: {', '.join(OPTIONS)}")
    if (options.get("loss") or "classification") not in LOSSES:
        raise ValueError(f"unknown loss {options['loss']!r}; valid: {', '.join(LOSSES)}")
    if (options.get("input") or "image") not in ("image", "tokens"):
        raise ValueError(f"unknown input {options['input']!r}; valid: image, tokens")
    if source == "torchvision":
        base = _torchvision(model, dict(options.get("kwargs") or {}))
    elif source == "timm":
        base = _timm(model, dict(options.get("kwargs") or {}))
    elif source == "module":
        base = _module(model, dict(options.get("kwargs") or {}))
    elif source == "hf":
        base = _hugging_face(model, dict(options.get("kwargs") or {}))
    else:
        raise KeyError(f"unknown model source {source!r} in {name!r}; valid sources: {', '.join(SOURCES)}")
    fields = {key: options[key] for key in ("input", "channels", "vocab_size", "loss") if options.get(key) is not None}
    if fields.get("input") == "tokens":
        if not fields.get("vocab_size"):
            raise ValueError(f"{name}: token inputs need net.options.vocab_size")
        fields.setdefault("loss", "next_token")
        fields["valid_side"] = lambda side: side >= 2
        fields["side_rule"] = "at least 2"
    return NetSpec(**{**base, **fields})


def _near(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=8, cutoff=0.5)
    return f"; near matches: {', '.join(near)}" if near else ""


def _torchvision(name: str, kwargs: dict) -> dict:
    import torchvision.models as tvm  # NOTE [imported where used] in harness/zoo/nets.py

    classification = tvm.list_models(module=tvm)
    segmentation = tvm.list_models(module=tvm.segmentation)
    if name not in classification + segmentation:
        other = name in tvm.list_models()
        raise KeyError(f"torchvision model {name!r} " + (
            "takes other inputs than an image batch (detection, video, optical flow); wrap it with "
            "+net=module" if other else f"is unknown{_near(name, classification + segmentation)}"))
    builder = tvm.get_model_builder(name)
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs.setdefault("weights_backbone", None)  # never a download

    def build():
        return builder(weights=None, **kwargs)

    side = kwargs.get("image_size", 224)  # a ViT's side is fixed at construction
    spec = {"build_model": build, "batch_size": DEFAULT_BATCH, "image_size": side}
    if name.startswith("vit_"):
        spec.update(valid_side=lambda s: s == side, side_rule=f"{side} (set net.options.kwargs.image_size)")
    if name in segmentation:
        spec["loss"] = "segmentation"
    return spec


def _timm(name: str, kwargs: dict) -> dict:
    import timm

    if not timm.is_model(name):
        raise KeyError(f"timm model {name!r} is unknown{_near(name, timm.list_models())}")

    def build():
        return timm.create_model(name, pretrained=False, **kwargs)

    config = timm.get_pretrained_cfg(name)
    side = kwargs.get("img_size") or (config.input_size[-1] if config and config.input_size else 224)
    return {"build_model": build, "batch_size": DEFAULT_BATCH, "image_size": side}


class NotAModel(TypeError):
    """A model's factory returned no ``nn.Module``: bad input, refused with no row written (``run_cell``)."""


def _module(target: str, kwargs: dict) -> dict:
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"module model {target!r}: give it as PACKAGE.MODULE:FACTORY, e.g. my_pkg.models:build")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise KeyError(f"module model {target!r}: cannot import it ({error})") from error

    def build():
        model = factory(**kwargs)
        if not isinstance(model, nn.Module):
            raise NotAModel(f"module model {target!r}: the factory returned a {type(model).__name__}, not an "
                            "nn.Module")
        return model

    return {"build_model": build, "batch_size": DEFAULT_BATCH, "image_size": 224, "valid_side": lambda side: side >= 1,
            "side_rule": "at least 1"}


class CausalLM(nn.Module):
    """A ``transformers`` causal LM fed token ids alone: its logits, with no KV cache (the cache would hold
    every layer's keys and values past the step, a value no plan could free)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(input_ids=tokens, use_cache=False).logits


def _hugging_face(model_type: str, kwargs: dict) -> dict:
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as error:
        raise KeyError(f"hf:{model_type} needs Hugging Face transformers: pip install '.[hf]' ({error})") from error
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise KeyError(f"hf model type {model_type!r} has no causal language model in transformers "
                       f"{transformers.__version__}{_near(model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))}")
    config = transformers.AutoConfig.for_model(model_type, **kwargs)

    def build():
        return CausalLM(transformers.AutoModelForCausalLM.from_config(config))

    longest = getattr(config, "max_position_embeddings", None)
    return {"build_model": build, "batch_size": 8, "image_size": min(1024, longest or 1024), "input": "tokens",
            "vocab_size": config.vocab_size, "loss": "next_token", "blocks": decoder_layers,
            "valid_side": lambda side: 2 <= side <= (longest or side),
            "side_rule": f"from 2 to {longest} (the config's max_position_embeddings)" if longest else "at least 2"}


def decoder_layers(model: nn.Module) -> list[str]:
    """The layers of the model's longest ``nn.ModuleList`` of one class (a decoder's), which
    ``gradient_checkpointing_enable()`` checkpoints one by one."""
    lists = [(path, layers) for path, layers in model.named_modules() if isinstance(layers, nn.ModuleList)
             and len({type(layer) for layer in layers}) == 1]
    if not lists:
        return []
    path, layers = max(lists, key=lambda found: len(found[1]))
    return [f"{path}.{i}" for i in range(len(layers))]
