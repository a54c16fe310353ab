"""PyTorch's own memory tools, run for real as peers of the strategies (``torch_checkpoint_blocks``,
``torch_checkpoint_sequential``, ``torch_compile_budget``, ``sac_ops``, ``megatron_selective``).

A peer's plan (``strategies/torch_*.py``, ``sac_ops.py``, ``megatron_selective.py``) names its ``runner``;
``step(plan, ...)`` returns the training step that runs it: the model itself, with
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` installed around the blocks for the step's duration
(with the plan's selective checkpointing policy as its ``context_fn``, ``selective_context``), or around each
call of ``F.scaled_dot_product_attention`` (``attention_checkpointed``), or the zoo's sequence of the net's
modules under ``checkpoint_sequential``. Recomputation runs a block's forward a second time,
which would update BatchNorm running statistics twice; ``batchnorm_once`` keeps them to one update per
step (the harness's exactness promise), which plain PyTorch does not.
Under ``torch.compile`` the peers run as NOTE [measuring torch.compile] (``harness/execute/compiled.py``) says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import traceback
from functools import partial
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint, checkpoint_sequential,
                                    create_selective_checkpoint_contexts)

import strategies
from harness.execute import compiled
from harness.zoo.nets import FUNCTIONAL, MODEL_STEPS
from strategies.plan import Runner
from strategies.torch_checkpoint_sequential import segment_starts


PEERS = ("torch_checkpoint_blocks", "torch_checkpoint_sequential", "torch_compile_budget", "sac_ops",
         "megatron_selective")  # run here


def zoo_options(strategy: str, structure: dict[str, list[str]]) -> dict:
    """The options a strategy that follows the net's own layout (a peer) takes from the zoo's ``structure``
    (``nets.structure``: ``blocks``, ``sequence``): those its ``Options`` has a field for."""
    fields = {f.name for f in dataclasses.fields(strategies.module(strategy).Options)}
    return {key: tuple(value) for key, value in structure.items() if key in fields}


@contextlib.contextmanager
def batchnorm_once(model: nn.Module):
    """Within the context, a BatchNorm layer's second and later calls (recomputation) leave its running
    statistics as the first call left them: they are saved before the second call and put back when the
    context closes. (Not in a forward hook: non-reentrant checkpoint stops a recomputation as soon as it
    has what backward needs, sometimes inside the layer, before its hooks.)"""
    seen: set[int] = set()
    saved: dict[int, tuple[nn.Module, list[torch.Tensor]]] = {}

    def before(module, args):
        if id(module) not in seen:
            seen.add(id(module))
        elif id(module) not in saved:
            saved[id(module)] = (module, [b.clone() for b in module.buffers()])

    handles = [module.register_forward_pre_hook(before) for module in model.modules()
               if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for module, values in saved.values():
                for buffer, value in zip(module.buffers(), values):
                    buffer.copy_(value)


def _sequential_slice(children: list[nn.Module], x):
    for child in children:
        x = child(x)
    return x


def _op_sets():
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default}
    fused = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    return matmuls, {getattr(aten, name).default for name in fused if hasattr(aten, name)}


MATMULS, FUSED_ATTENTION = _op_sets()


def selective_context(policy: str | None):
    """``checkpoint``'s ``context_fn`` for a selective checkpointing policy (``strategies.plan.POLICIES``), or
    None. "ops" saves the outputs of matmuls (``mm``, ``addmm``) and fused attention kernels and recomputes
    every other op, as torchtitan's op policy does; "ops_every_second_mm" recomputes each block's second,
    fourth, ... matmul too, counted apart in the forward and in the recomputation so that both choose alike."""
    if policy is None:
        return None

    def context_fn():
        counts = {False: 0, True: 0}  # matmuls so far, in the forward and in the recomputation

        def choose(ctx, op, *args, **kwargs):
            if op in MATMULS:
                counts[ctx.is_recompute] += 1
                skip = policy == "ops_every_second_mm" and counts[ctx.is_recompute] % 2 == 0
                return CheckpointPolicy.PREFER_RECOMPUTE if skip else CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.MUST_SAVE if op in FUSED_ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(choose)

    return context_fn


class attention_checkpointed(TorchFunctionMode):
    """Within the context, every call of ``F.scaled_dot_product_attention`` runs under ``checkpoint(...,
    use_reentrant=False)``, as Megatron-LM's selective recomputation runs its attention core: its inputs and
    output are kept, what it saves is dropped and made again in the backward. The backward must run outside
    the context (the recomputation calls the function itself)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def checkpointed(model: nn.Module, blocks: list[str], policy: str | None = None):
    """Within the context, each block runs under ``checkpoint(..., use_reentrant=False)``: a module path
    through its ``forward``, a slice ``parent[a:b]`` of an ``nn.Sequential`` through the parent's; with
    ``policy``, a selective one (``selective_context``)."""
    return installed(checkpoint_forwards(model, blocks, policy))


def checkpoint_forwards(model: nn.Module, blocks: list[str], policy: str | None = None) -> dict[nn.Module, object]:
    """The ``forward`` each patched module gets for ``checkpointed`` (made once, so that a compiled step,
    which guards on them, sees the same ones at every call)."""
    context_fn = selective_context(policy)
    options = {"context_fn": context_fn} if context_fn else {}
    forwards = {}
    slices: dict[str, list[tuple[int, int]]] = {}
    for block in blocks:
        sliced = re.fullmatch(r"(.*)\[(\d+):(\d+)\]", block)
        if sliced:
            slices.setdefault(sliced.group(1), []).append((int(sliced.group(2)), int(sliced.group(3))))
            continue
        module = model.get_submodule(block)
        forwards[module] = partial(_checkpoint_copying_lists, module.forward, options)
    for parent_path, ranges in slices.items():
        parent = model.get_submodule(parent_path)
        if not isinstance(parent, nn.Sequential):
            raise TypeError(f"block slice {parent_path}[...]: {parent_path} is not an nn.Sequential")
        forwards[parent] = partial(_run_with_slices, list(parent), sorted(ranges), options)
    return forwards


@contextlib.contextmanager
def installed(forwards: dict[nn.Module, object]):
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module in forwards:
            del module.forward  # back to the class's forward


def _checkpoint_copying_lists(forward, options: dict, *args, **kwargs):
    # checkpoint keeps its arguments by reference for the recomputation; DenseNet's blocks pass a layer the
    # list of features so far and append to it afterwards, so the layer gets its own copy (as torchvision's
    # memory_efficient path does by unpacking the list). Keyword arguments (a decoder layer's attention mask
    # and position embeddings) go to the block as they came; ``options`` are checkpoint's own.
    return checkpoint(forward, *[list(a) if isinstance(a, list) else a for a in args], use_reentrant=False,
                      **options, **kwargs)


def _run_with_slices(children: list[nn.Module], ranges: list[tuple[int, int]], options: dict, x):
    position = 0
    for start, stop in ranges:
        x = _sequential_slice(children[position:start], x)
        x = checkpoint(_sequential_slice, children[start:stop], x, use_reentrant=False, **options)
        position = stop
    return _sequential_slice(children[position:], x)


def _checkpoint_sequential(functions: list, segments: int, x):
    return checkpoint_sequential(functions, segments, x, use_reentrant=False)


def _checkpoint_segments(functions: list, segments: int, x):
    """``checkpoint_sequential(functions, segments, x, use_reentrant=False)``, written out as its
    ``checkpoint`` calls (the same segments), which dynamo compiles."""
    size = len(functions) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        x = checkpoint(_sequential_slice, functions[start:end + 1], x, use_reentrant=False)
    return _sequential_slice(functions[end + 1:], x)


def sequential_functions(model: nn.Module, sequence: list[str], segments: int) -> list:
    """The net as ``checkpoint_sequential``'s list of functions. An in-place ReLU that starts a segment
    becomes out-of-place: it would overwrite the segment's input, which ``checkpoint`` keeps to recompute."""
    functions = [FUNCTIONAL[path] if path in FUNCTIONAL else MODEL_STEPS[path](model) if path in MODEL_STEPS
                 else model.get_submodule(path) for path in sequence]
    for start in segment_starts(len(functions), segments):
        if isinstance(functions[start], nn.ReLU) and functions[start].inplace:
            functions[start] = nn.ReLU()
    return functions


def compiled_step(model: nn.Module, example_input: torch.Tensor, loss_fn, budget_ratio: float):
    """The step under ``torch.compile`` with ``activation_memory_budget`` (NOTE [measuring torch.compile] in
    ``harness/execute/compiled.py``); the returned function has ``compile_time_s``."""
    return compiled.compiled_step(model, model, example_input, loss_fn, budget_ratio=budget_ratio)


def _blocks_checkpointed(plan, model, structure, compile):
    return model, partial(installed, checkpoint_forwards(model, structure["blocks"], plan.policy))


def _attention_checkpointed(plan, model, structure, compile):
    return partial(_with_attention_checkpointed, model), contextlib.nullcontext


def _sequential_checkpointed(plan, model, structure, compile):
    functions = sequential_functions(model, structure["sequence"], plan.segments)
    # Compiled: dynamo skips checkpoint_sequential itself, so the same checkpoints, one call each.
    return (partial(_checkpoint_segments if compile else _checkpoint_sequential, functions, plan.segments),
            contextlib.nullcontext)


# How each runner but torch.compile's own makes the step's forward, and the context it runs in.
FORWARDS = {Runner.TORCH_CHECKPOINT: _blocks_checkpointed, Runner.TORCH_CHECKPOINT_ATTENTION: _attention_checkpointed,
            Runner.TORCH_CHECKPOINT_SEQUENTIAL: _sequential_checkpointed}


def step(plan, model: nn.Module, structure: dict[str, list[str]], example_input: torch.Tensor, loss_fn,
         compile: bool = False):
    """The training step (forward, loss, backward) that runs the peer ``plan``, under ``torch.compile`` with
    ``compile`` (``torch_compile_budget`` always is); returns the loss. A compiled recomputation happens in
    the backward graph, which updates no BatchNorm statistics: ``batchnorm_once`` is for eager steps."""
    if plan.runner == Runner.TORCH_COMPILE:
        return compiled_step(model, example_input, loss_fn, plan.budget_ratio)
    if plan.runner not in FORWARDS:
        raise ValueError(f"no peer runner for plan {plan.strategy!r} (runner {plan.runner!r}); valid: "
                         f"{', '.join([Runner.TORCH_COMPILE, *FORWARDS])}")
    forward, context = FORWARDS[plan.runner](plan, model, structure, compile)
    if compile:
        return compiled.compiled_step(forward, model, example_input, loss_fn, context=context)

    branches = traced_branches if example_input.device.type == "meta" else contextlib.nullcontext

    def run():
        try:
            with batchnorm_once(model), context(), branches():
                loss = loss_fn(forward(example_input))
                loss.backward()
        except RuntimeError as error:
            if example_input.device.type == "meta" and "on meta tensors" in str(error):
                raise RuntimeError(
                    f"{plan.strategy} runs the model's own code, which reads a tensor's value in Python"
                    f"{_user_code(error)}, and meta tensors hold none; measure this peer with device=cpu or cuda "
                    "(the IR strategies run the traced program, which took the branch the trace saw)") from error
            raise
        return loss.detach()

    return run


@contextlib.contextmanager
def traced_branches():
    """On meta, Hugging Face's mask code takes the branches it takes when traced. It reads values to choose a
    branch (are the sequences packed? is the padding mask all ones?), which meta tensors hold none of, and
    skips those reads under a tracer: the trace took those branches, and the peers run the program the IR
    strategies run. Without ``transformers`` loaded, nothing to do."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    with mock.patch.object(masking, "is_tracing", lambda *args, **kwargs: True):
        yield


def _with_attention_checkpointed(model: nn.Module, x):
    with attention_checkpointed():
        return model(x)


def _user_code(error: Exception) -> str:
    """Where outside torch and the harness ``error`` was raised from: the model's code."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "/torch/" not in f.filename and "/harness/" not in f.filename]
    return f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
