"""What the zoo and outside models share: the record of a net (``NetSpec``) and the losses a step can train
with (``LOSSES``). ``harness.zoo.nets`` (the zoo) and ``harness.zoo.models`` (any other source) both make
``NetSpec``s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class NetSpec:
    build_model: Callable[..., nn.Module]  # keyword options: the builder's own (``build(**options)``)
    batch_size: int  # Kusumoto et al. 2019, Table 1, for its nets
    image_size: int  # the input's side; for token inputs, the sequence length
    paper_nodes: int | None = None  # #V of Kusumoto et al. 2019, Table 1
    paper_vanilla_gb: float | None = None  # vanilla peak of Kusumoto et al. 2019, Table 1 (Chainer, K40c, parameters included)
    loss: str = "classification"  # a key of LOSSES
    input: str = "image"  # "image": (batch, channels, side, side) floats; "tokens": (batch, side) ids
    channels: int = 3
    vocab_size: int = 0  # token inputs draw ids below it
    valid_side: Callable[[int], bool] = lambda side: side >= 32
    side_rule: str = "at least 32"
    # The natural blocks a careful PyTorch user wraps in torch.utils.checkpoint, as module paths
    # ("layer1.0") or slices of an nn.Sequential's children ("features[0:5]"), in execution order.
    blocks: Callable[[nn.Module], list[str]] = lambda model: []
    # The net as a chain for checkpoint_sequential: module paths and functional steps (``FUNCTIONAL``) that,
    # applied in turn, compute what ``forward`` does; empty where no chain exists (U-Net's long skips).
    sequence: Callable[[nn.Module], list[str]] = lambda model: []
    dtype: str = "float32"  # what the net trains in unless the run says otherwise (its parameters and a float input)


def _main_output(output):
    """A model's prediction: the tensor itself, the ``out`` entry of a dict (torchvision segmentation), or
    the first of a tuple (auxiliary classifiers' outputs: GoogLeNet, Inception v3)."""
    if isinstance(output, dict):
        return output["out"]
    return output[0] if isinstance(output, tuple) else output


def classification_loss(output) -> torch.Tensor:
    """Cross-entropy against fixed labels (class ``i % classes`` for sample ``i``)."""
    output = _main_output(output)
    labels = torch.arange(output.shape[0], device=output.device) % output.shape[1]
    return F.cross_entropy(output, labels)


def segmentation_loss(output) -> torch.Tensor:
    """Per-pixel cross-entropy against a fixed label map (class 0 everywhere)."""
    output = _main_output(output)
    labels = torch.zeros(output.shape[0], *output.shape[2:], dtype=torch.long, device=output.device)
    return F.cross_entropy(output, labels)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Language modelling: position ``t`` predicts token ``t + 1`` of the input (the last predicts nothing)."""
    labels = tokens.to(logits.device).roll(-1, dims=1)
    labels[:, -1] = -100  # F.cross_entropy's ignore_index
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def sum_loss(output) -> torch.Tensor:
    """The sum of every tensor the model returns (for a model with no natural target)."""
    return sum(t.sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor))


LOSSES = {"classification": classification_loss, "segmentation": segmentation_loss, "next_token": next_token_loss,
          "sum": sum_loss}
