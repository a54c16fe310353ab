"""The program's state a step must leave as plain PyTorch leaves it: the random generators it draws from and
the buffers its layers write. The executor (``harness/execute/``), the compiled step (``harness/execute/compiled.py``)
and the measured cost model take, compare and put back both through these (NOTE [replaying side effects] in
``harness/execute/side_effects.py``); the tracer marks which calls draw and which write."""

from __future__ import annotations

import contextlib
import ctypes

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves


def grad_mode(node: fx.Node):
    """The grad mode the model's code ran ``node`` in (NOTE [grad mode] in ``harness/tracing/tracer.py``)."""
    return torch.no_grad() if node.meta.get("no_grad") else contextlib.nullcontext()


def generators_of(module: torch.nn.Module) -> list[torch.Generator]:
    """The ``torch.Generator``s a program draws from besides the default ones: those among its calls'
    arguments (an fx module's) and those its modules hold."""
    nodes = module.graph.nodes if isinstance(module, fx.GraphModule) else ()
    found = [g for node in nodes for g in tree_leaves((node.args, node.kwargs)) if isinstance(g, torch.Generator)]
    found += [g for m in module.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    return list({id(g): g for g in found}.values())


def rng_state(rng: tuple) -> tuple:
    """The states of the default CPU generator, of the CUDA devices' and of the program's own generators. A
    CUDA generator's whole state is its seed and Philox offset, kept as two numbers: taking and comparing
    them makes no tensor (the executor does both around every layer call it may recompute)."""
    devices, generators = rng
    cuda = sorted({_cuda_index(d) for d in devices if d.type == "cuda"})
    return (torch.get_rng_state(), [(i, _philox(torch.cuda.default_generators[i])) for i in cuda],
            [(g, _philox(g) if g.device.type == "cuda" else g.get_state()) for g in generators])


def set_rng_state(state: tuple):
    cpu, cuda, generators = state
    torch.set_rng_state(cpu)
    for index, s in cuda:
        _set_philox(torch.cuda.default_generators[index], s)
    for generator, s in generators:
        _set_philox(generator, s) if isinstance(s, tuple) else generator.set_state(s)


@contextlib.contextmanager
def state_kept(module: torch.nn.Module, rng: tuple):
    """Runs within leave ``module``'s buffers (running statistics) and the generators of ``rng`` (as
    ``rng_state`` takes it) as they found them: a run that must not count as a training step."""
    buffers = [(m, name, b, b.clone()) for m in module.modules() for name, b in m.named_buffers(recurse=False)]
    drawn_from = rng_state(rng)
    try:
        yield
    finally:
        set_rng_state(drawn_from)
        with torch.no_grad():
            for m, name, buffer, value in buffers:
                setattr(m, name, buffer)  # a layer may have assigned a new tensor rather than written this one
                buffer.copy_(value)


def same_rng_state(a: tuple, b: tuple) -> bool:
    return _same_bytes(a[0], b[0]) and a[1] == b[1] and all(
        x == y if isinstance(x, tuple) else _same_bytes(x, y) for (_, x), (_, y) in zip(a[2], b[2]))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two CPU generator states (byte tensors) compared as bytes: ``torch.equal`` is two ATen ops, and the
    executor compares states once a stage, every step."""
    return a.nbytes == b.nbytes and ctypes.string_at(a.data_ptr(), a.nbytes) == ctypes.string_at(b.data_ptr(), b.nbytes)


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _philox(generator: torch.Generator) -> tuple[int, int]:
    return generator.initial_seed(), generator.get_offset()


def _set_philox(generator: torch.Generator, state: tuple[int, int]):
    generator.manual_seed(state[0])  # which sets the offset to 0
    generator.set_offset(state[1])


def written_state(module: torch.nn.Module, node: fx.Node, args, kwargs, buffer_ids: set[int],
                  written: dict[int, torch.Tensor] | None = None,
                  submodule: torch.nn.Module | None = None) -> list[torch.Tensor]:
    """The state a call of ``node`` may write, or read before a later node writes it, which a recomputation
    starts from as the forward call found it (NOTE [replaying side effects] in ``harness/execute/side_effects.py``): its
    module's buffers (``submodule``: that module, when the caller has it at hand), for a module call; the
    buffers among its inputs (ids in ``buffer_ids``); and the buffers a node of their own writes (``written``:
    storage id -> buffer) that it reads, through a view too."""
    found = []
    if node.op == "call_module":
        submodule = module.get_submodule(node.target) if submodule is None else submodule
        # A layer with no children (BatchNorm) holds its buffers itself: read where ``buffers()`` reads them, without
        # its generator walk (microseconds a call, for every layer call a plan may recompute, every step).
        found = [b for b in submodule._buffers.values() if b is not None] if not submodule._modules \
            else list(submodule.buffers())
    tensors = tensors_of(args, kwargs)
    found += [t for t in tensors if id(t) in buffer_ids]
    if written:
        found += [written[id(_storage(t))] for t in tensors if id(_storage(t)) in written]
    return list({id(t): t for t in found}.values()) if len(found) > 1 else found


def tensors_of(args, kwargs=None) -> list[torch.Tensor]:
    """The tensors among a call's arguments, at any depth; flat arguments without the pytree walk."""
    if not kwargs and isinstance(args, tuple):  # a loop: a generator's every step is a Python call too
        found = []
        for a in args:
            if isinstance(a, torch.Tensor):
                found.append(a)
            elif not isinstance(a, _FLAT):
                break
        else:
            return found
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


_FLAT = (int, float, bool, type(None))


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()
