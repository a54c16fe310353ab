"""PyTorch's own memory tools, run for real as peers of the strategies (``torch_checkpoint_blocks``,
``torch_checkpoint_sequential``).

A peer's plan (``strategies/torch_*.py``) carries ``info["runner"]``; ``step(plan, ...)`` returns the
training step that runs it: the model itself, with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
installed around the blocks for the step's duration, or the zoo's sequence of the net's modules under
``checkpoint_sequential``. Recomputation runs a block's forward a second time,
which would update BatchNorm running statistics twice; ``batchnorm_once`` keeps them to one update per
step (the harness's exactness promise), which plain PyTorch does not. (Its hooks see the layers a block
calls; a block that is itself a BatchNorm layer would escape them. No zoo block is.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import strategies
from harness.nets import FUNCTIONAL
from strategies.torch_checkpoint_sequential import segment_starts


def zoo_options(strategy: str, structure: dict[str, list[str]]) -> dict:
    """The options a strategy that follows the net's own layout (a peer) takes from the zoo's ``structure``
    (``nets.structure``: ``blocks``, ``sequence``): those its ``Options`` has a field for."""
    fields = {f.name for f in dataclasses.fields(strategies.module(strategy).Options)}
    return {key: tuple(value) for key, value in structure.items() if key in fields}


@contextlib.contextmanager
def batchnorm_once(model: nn.Module):
    """Within the context, a BatchNorm layer's second and later calls (recomputation) leave its running
    statistics as the first call left them."""
    seen: set[int] = set()
    saved: dict[int, list[torch.Tensor]] = {}

    def before(module, args):
        if id(module) in seen:
            saved[id(module)] = [b.clone() for b in module.buffers()]
        seen.add(id(module))

    def after(module, args, output):
        for buffer, value in zip(module.buffers(), saved.pop(id(module), [])):
            buffer.copy_(value)

    handles = []
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _sequential_slice(children: list[nn.Module], x):
    for child in children:
        x = child(x)
    return x


@contextlib.contextmanager
def checkpointed(model: nn.Module, blocks: list[str]):
    """Within the context, each block runs under ``checkpoint(..., use_reentrant=False)``: a module path
    through its ``forward``, a slice ``parent[a:b]`` of an ``nn.Sequential`` through the parent's."""
    patched = []
    slices: dict[str, list[tuple[int, int]]] = {}
    for block in blocks:
        sliced = re.fullmatch(r"(.*)\[(\d+):(\d+)\]", block)
        if sliced:
            slices.setdefault(sliced.group(1), []).append((int(sliced.group(2)), int(sliced.group(3))))
            continue
        module = model.get_submodule(block)
        module.forward = partial(_checkpoint_copying_lists, module.forward)
        patched.append(module)
    for parent_path, ranges in slices.items():
        parent = model.get_submodule(parent_path)
        if not isinstance(parent, nn.Sequential):
            raise TypeError(f"block slice {parent_path}[...]: {parent_path} is not an nn.Sequential")
        parent.forward = partial(_run_with_slices, list(parent), sorted(ranges))
        patched.append(parent)
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to the class's forward


def _checkpoint_copying_lists(forward, *args):
    # checkpoint keeps its arguments by reference for the recomputation; DenseNet's blocks pass a layer the
    # list of features so far and append to it afterwards, so the layer gets its own copy (as torchvision's
    # memory_efficient path does by unpacking the list).
    return checkpoint(forward, *[list(a) if isinstance(a, list) else a for a in args], use_reentrant=False)


def _run_with_slices(children: list[nn.Module], ranges: list[tuple[int, int]], x):
    position = 0
    for start, stop in ranges:
        x = _sequential_slice(children[position:start], x)
        x = checkpoint(_sequential_slice, children[start:stop], x, use_reentrant=False)
        position = stop
    return _sequential_slice(children[position:], x)


def sequential_functions(model: nn.Module, sequence: list[str], segments: int) -> list:
    """The net as ``checkpoint_sequential``'s list of functions. An in-place ReLU that starts a segment
    becomes out-of-place: it would overwrite the segment's input, which ``checkpoint`` keeps to recompute."""
    functions = [FUNCTIONAL[path] if path in FUNCTIONAL else model.get_submodule(path) for path in sequence]
    for start in segment_starts(len(functions), segments):
        if isinstance(functions[start], nn.ReLU) and functions[start].inplace:
            functions[start] = nn.ReLU()
    return functions


def step(plan, model: nn.Module, structure: dict[str, list[str]], example_input: torch.Tensor, loss_fn):
    """The training step (forward, loss, backward) that runs the peer ``plan``; returns the loss."""
    runner = plan.info.get("runner")
    if runner == "torch_checkpoint":
        def forward():
            with checkpointed(model, structure["blocks"]):
                return model(example_input)
    elif runner == "torch_checkpoint_sequential":
        segments = int(plan.info["segments"])
        functions = sequential_functions(model, structure["sequence"], segments)

        def forward():
            return checkpoint_sequential(functions, segments, example_input, use_reentrant=False)
    else:
        raise ValueError(f"no peer runner for plan {plan.strategy!r} (runner {runner!r})")

    def run():
        with batchnorm_once(model):
            loss = loss_fn(forward())
            loss.backward()
        return loss.detach()

    return run
