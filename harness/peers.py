"""PyTorch's own memory tools, run for real as peers of the strategies (``torch_checkpoint_blocks``,
``torch_checkpoint_sequential``, ``torch_compile_budget``).

A peer's plan (``strategies/torch_*.py``) carries ``info["runner"]``; ``step(plan, ...)`` returns the
training step that runs it: the model itself, with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
installed around the blocks for the step's duration, or the zoo's sequence of the net's modules under
``checkpoint_sequential``. Recomputation runs a block's forward a second time,
which would update BatchNorm running statistics twice; ``batchnorm_once`` keeps them to one update per
step (the harness's exactness promise), which plain PyTorch does not.

NOTE [measuring torch.compile]
The tracker is a dispatch mode, and torch.compile runs a frame eagerly while a dispatch mode is active,
so on ``meta`` the compiled program is replayed instead: AOTAutograd (``aot_module``, the partitioner and
decompositions ``torch.compile`` uses, inductor's table) compiles the model once, its forward and
backward graphs are kept, and each step runs them op by op under ``no_grad`` (the tracker sees every op),
the loss and its gradient eagerly between them; each value, saved ones included, is freed after its last
use in its graph, as inductor's generated code does. That compile, on meta, is ``compile_time_s``. On ``cpu``
and ``cuda`` the step is the real ``torch.compile`` (``aot_eager_decomp_partition`` on cpu, inductor on
cuda), compiled by a first step outside any dispatch mode (``compile_time_s``: dynamo runs a frame first met
under the tracker eagerly and never compiles it after); the cuda allocator measures it (the row's
``tracker_peak_bytes``, taken under the tracker, is the eager step's there), while on cpu nothing can, so
``check_measurable`` refuses a cpu row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from functools import partial

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import strategies
from harness.measure import MemoryTracker
from harness.nets import FUNCTIONAL, MODEL_STEPS
from strategies.torch_checkpoint_sequential import segment_starts


PEERS = ("torch_checkpoint_blocks", "torch_checkpoint_sequential", "torch_compile_budget")  # run here


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
    functions = [FUNCTIONAL[path] if path in FUNCTIONAL else MODEL_STEPS[path](model) if path in MODEL_STEPS
                 else model.get_submodule(path) for path in sequence]
    for start in segment_starts(len(functions), segments):
        if isinstance(functions[start], nn.ReLU) and functions[start].inplace:
            functions[start] = nn.ReLU()
    return functions


def compiled_step(model: nn.Module, example_input: torch.Tensor, loss_fn, budget_ratio: float):
    """The step under ``torch.compile`` with ``activation_memory_budget`` (NOTE [measuring torch.compile]);
    the returned function has ``compile_time_s``. Off meta, the first step runs here, outside any dispatch
    mode: dynamo runs a frame it first meets under one (the tracker's) eagerly, and skips it for good."""
    import torch._functorch.config as functorch_config

    budget = functorch_config.patch(activation_memory_budget=budget_ratio)
    if example_input.device.type == "meta":
        return _replayed_step(model, example_input, loss_fn, budget)
    if _get_current_dispatch_mode() is not None:
        raise RuntimeError("compiled_step: build the step outside any dispatch mode, or dynamo will not compile it")
    backend = "inductor" if example_input.device.type == "cuda" else "aot_eager_decomp_partition"
    compiled = torch.compile(model, backend=backend)

    def run():
        with budget:
            loss = loss_fn(compiled(example_input))
            loss.backward()
        return loss.detach()

    buffers = [b.clone() for b in model.buffers()]  # the compiling step must not count as a step
    start = time.perf_counter()
    run()
    if example_input.device.type == "cuda":
        torch.cuda.synchronize()
    run.compile_time_s = time.perf_counter() - start
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), buffers):
            buffer.copy_(value)
    for p in model.parameters():
        p.grad = None
    return run


def _replayed_step(model, example_input, loss_fn, budget):
    from functorch.compile import aot_module
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    graphs, arguments = {}, []

    def keep(kind):
        def compiler(graph_module, example_inputs):
            graphs[kind] = graph_module

            def call(args):
                if kind == "forward" and not arguments:
                    arguments.extend(args)  # parameters, buffers, input: the order the graph takes them
                return graph_module(*args)

            call._boxed_call = True  # AOTAutograd passes the arguments as one list
            return call
        return compiler

    start = time.perf_counter()
    with budget:
        compiled = aot_module(_untied(model), fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                              partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
        loss_fn(compiled(example_input)).backward()
    compile_time_s = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    placeholders = [n.name for n in graphs["backward"].graph.find_nodes(op="placeholder")]
    saved_count = sum(1 for name in placeholders if not name.startswith("tangents"))

    def run():
        # The forward graph returns the buffers it updates (BatchNorm statistics; nothing to put back on
        # meta), then the model's output, then what the backward graph takes before the output's gradient.
        with torch.no_grad():
            outputs = fx.Interpreter(graphs["forward"]).run(*arguments)
        saved = list(outputs[len(outputs) - saved_count:])
        output = outputs[len(outputs) - saved_count - 1].detach().requires_grad_()
        del outputs
        loss = loss_fn(output)
        (output_grad,) = torch.autograd.grad(loss, output)
        del output
        backward_arguments = saved + [output_grad]
        del saved, output_grad
        with torch.no_grad():  # boxed: the interpreter holds the only references and frees each after use
            grads = fx.Interpreter(graphs["backward"]).boxed_run(backward_arguments)
        tracker = _get_current_dispatch_mode()
        for argument, grad in zip(arguments, grads):
            if isinstance(argument, nn.Parameter) and grad is not None:
                argument.grad = grad
                if isinstance(tracker, MemoryTracker):
                    tracker.mark_grad(argument)
        return loss.detach()

    run.compile_time_s = compile_time_s
    return run


class _Untied(nn.Module):
    """``model`` with each parameter and buffer registered once: ``aot_module`` lists tied weights (GPT-2's
    embedding and output layer) under every name and then refuses them as two values for one tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "model", model)  # not a submodule: its names would come back
        unique_params = list(dict.fromkeys(model.parameters()))
        self.params = nn.ParameterList(unique_params)
        self.tensors = [(name, i) for name, p in model.named_parameters(remove_duplicate=False)
                        for i, q in enumerate(unique_params) if q is p]
        for i, (name, b) in enumerate(model.named_buffers()):
            self.register_buffer(f"buffer{i}", b)
            self.tensors.append((name, f"buffer{i}"))

    def forward(self, *args):
        tensors = {name: self.params[i] if isinstance(i, int) else getattr(self, i) for name, i in self.tensors}
        return torch.func.functional_call(self.model, tensors, args)


def _untied(model: nn.Module) -> nn.Module:
    tied = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
    return _Untied(model) if tied else model


def check_measurable(plan, device: str) -> None:
    """Raise ``Inapplicable`` where the harness cannot measure the peer ``plan`` on ``device``."""
    if plan.info.get("runner") == "torch_compile" and device == "cpu":
        raise strategies.Inapplicable(
            "torch_compile_budget on cpu: the tracker cannot see inside compiled code (NOTE [measuring "
            "torch.compile] in harness/peers.py); use device=meta or device=cuda")


def step(plan, model: nn.Module, structure: dict[str, list[str]], example_input: torch.Tensor, loss_fn):
    """The training step (forward, loss, backward) that runs the peer ``plan``; returns the loss."""
    runner = plan.info.get("runner")
    if runner == "torch_compile":
        return compiled_step(model, example_input, loss_fn, plan.info["budget_ratio"])
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
