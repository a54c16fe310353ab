"""A recomputed call's randomness and state writes, replayed as its forward call found them.

NOTE [replaying side effects]
A recomputed layer must compute what it computed in the forward pass, and do nothing else, whatever the
layer is. Both are done by mechanism, with no list of layer types:
- Randomness. Before an fx node of a recomputed value that draws runs in the forward pass, the RNG state
  of the CPU, of every CUDA device the step uses and of every ``torch.Generator`` the program holds (in a
  call's arguments or as a module's attribute) is kept (a dropout module, ``F.dropout``, MHA's or SDPA's
  ``dropout_p``, stochastic depth's ``bernoulli_``, a user's ``torch.rand`` or ``torch.randperm(n,
  generator=self.generator)``), and the recomputation sets it again before that node, as
  ``torch.utils.checkpoint``'s ``preserve_rng_state`` does per region. Which nodes draw is found by
  comparing the states around each call the first time it runs (NOTE [what a call needs, found once]).
  The program's own RNG streams go on afterwards as if nothing had been recomputed.
- State. The buffers an fx node of a recomputed value can reach (its module's, for a module call; the
  buffers among its inputs, for a function or method) are copied before its forward call; for the
  recomputed call the copy takes each buffer's place (in every module that registers it, and among the
  call's arguments; through ``t.data`` where a module also holds the buffer as a plain attribute, which a
  registry swap would miss), so the call reads the state as its forward found it and writes into the copy,
  and then the buffer takes its place back; a buffer the call reads through a view made before it (which
  would not see the swap) is copied in and back. None of it runs a kernel but the copy. So a layer whose
  output reads the state it writes (spectral normalisation's power iteration, a running statistic it
  divides by) recomputes what its forward computed (started from the state the forward left, it
  normalised by another estimate: gradients off by up to 95%), and BatchNorm's running statistics and
  batch count, through a module or ``F.batch_norm``, or any module that counts or averages, are updated
  once per step. (Neither version counters nor op schemas tell which buffers a call writes:
  ``native_batch_norm`` writes its running statistics without declaring it.) The copies live from the
  forward call to the recomputation, or to the end of the forward pass where no backward calls for the
  stage; the replay counts them (``Profile.recompute_state_bytes``). A write to state by a node of its own
  (``self.steps.add_(1)``) is outside the IR and runs once, in the forward pass (NOTE [state the forward
  writes] in ``harness/tracing/tracer.py``).
- Grad mode. A node the model ran under ``no_grad`` runs under it here too (NOTE [grad mode] there).
- In-place ops. A recomputation under ``no_grad`` runs any in-place op as it is. A layer rerun with
  autograd on, to collect what it saves besides node values, gets inputs that are aliases of the recomputed
  values, one per fx input, so that ops that test ``q is k`` (MHA's self-attention path) see the same
  aliasing as in the forward pass: leaves (``.data``, no op) where its forward call wrote no input in place,
  and fresh non-leaves (``_Fresh``) where it did (its input's version counter moved, found once), so
  ``inplace=True`` modules, ``F.*(..., inplace=True)``, ``x.add_()`` and writes to views work on them.
"""

from __future__ import annotations

import contextlib
import weakref
from types import SimpleNamespace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only

from harness.tracing.state import generators_of, rng_state, same_rng_state, set_rng_state, tensors_of, written_state
from harness.tracing.traced import Traced


class _SideEffects:
    """The replay of a recomputed call's randomness and state writes (NOTE [replaying side effects]): the RNG
    state each drawing call found, the state each writing call found, and which calls draw, learned once
    (NOTE [what a call needs, found once])."""

    def __init__(self, traced: Traced, recomputable: set[str]):
        self.module = traced.module
        self.recomputable = recomputable  # the fx nodes whose RNG and state are kept for a recomputation
        static = _static(traced.module)
        # the buffers as the step finds them (a model may have been moved or given new ones since the last)
        named_buffers = [(f"{prefix}.{name}" if prefix else name, b)
                         for prefix, m in (("", traced.module), *static.modules.items())
                         for name, b in m._buffers.items() if b is not None]
        self.buffers = [b for _, b in named_buffers]
        self.buffer_ids = {id(b) for b in self.buffers}
        self.written = {id(b.untyped_storage()): b for name, b in named_buffers if name in traced.written_buffers}
        self.static = static
        self.modules = static.modules
        self.rng_states: dict[str, object] = {}  # fx node that drew numbers -> RNG state before it
        self.state_before: dict[str, tuple] = {}  # recomputed fx node -> (its buffers, as found)

    def start(self, devices: set[torch.device]) -> None:
        """At the forward's start: the generators of the step's devices and the model's own, and what is
        known of which calls draw under the model's training flags on these devices."""
        static = _static(self.module)
        self.rng = (devices, static.generators)
        # meta's kernels draw nothing: what is learned there does not hold on a device that runs them
        key = (tuple(m.training for m in static.modules.values()), frozenset(str(d) for d in devices))
        self.draws = static.draws.setdefault(key, {})
        self.writes_inputs = static.writes_inputs.setdefault(key, {})  # fx node -> whether it wrote an input

    def forget(self, names) -> None:
        """Let go of the state the forward calls ``names`` found: nothing will recompute them."""
        for name in names:
            self.state_before.pop(name, None)

    def replaying(self, names: frozenset[str]):
        """Around a recomputation of the fx nodes ``names``: one that replays a draw puts the program's RNG
        state back after it; one that replays none checks it drew nothing."""
        if not self.rng_states.keys().isdisjoint(names):
            return _preserved_rng(self.rng)
        return _drawing_nothing(self.rng, names)

    def run(self, node: fx.Node, args, kwargs, recompute: bool):
        """Run one fx node; a node of a recomputed value replays its randomness and state writes (NOTE
        [replaying side effects])."""
        if not recompute and node.name in self.recomputable:
            draws = self.draws.get(node.name)  # NOTE [what a call needs, found once]
            before = rng_state(self.rng) if draws is not False else None
            written = self.written_by(node, args, kwargs)
            if written:  # the state as this call finds it, for the recomputation to start from
                self.state_before[node.name] = (written, _copies(written))
            learning = node.name not in self.writes_inputs
            if learning:  # an in-place write moves the input's version counter (a view's moves its base's)
                inputs = tensors_of(args, kwargs)
                versions = [t._version for t in inputs]
            value = call_node(self.module, self.modules, node, args, kwargs)
            if learning:
                self.writes_inputs[node.name] = any(t._version != v for t, v in zip(inputs, versions))
            if draws is None:
                draws = self.draws[node.name] = not same_rng_state(before, rng_state(self.rng))
            if draws:
                self.rng_states[node.name] = before
            return value
        if not recompute:
            return call_node(self.module, self.modules, node, args, kwargs)
        if node.name in self.rng_states:
            set_rng_state(self.rng_states[node.name])
        # the buffers the forward call found: its inputs' are the same tensors (buffers are never IR values)
        written, found = self.state_before.pop(node.name, ((), ()))
        if not written:
            return call_node(self.module, self.modules, node, args, kwargs)
        # The state as found, in the buffer's place (NOTE [replaying side effects]): in the modules that hold it
        # and among the call's arguments; through ``.data`` where a module also holds it as a plain attribute;
        # copied in where a view made before the call reads it. Only those copies in and back run ops, and only
        # they need grad mode off (a buffer that requires grad refuses an in-place write under it).
        inputs = tensors_of(args, kwargs)
        written_ids = {id(t) for t in written}
        views = {id(a.untyped_storage()) for a in inputs if id(a) not in written_ids}
        placed, swapped, copied, given = [], [], [], {}
        for i, t in enumerate(written):  # one buffer at a time: the copy of the state as found goes
            if views and id(t.untyped_storage()) in views:
                with torch.no_grad():
                    copied.append((t, t.detach().clone()))
                    t.copy_(found[i])
            elif (held := _holders(self.module, self.static, t)) is None:
                swapped.append((t, t.data))
                t.data = found[i]
            else:
                for m, name in held:
                    (m or self.module)._buffers[name] = found[i]
                placed.append((held, t))
                given[id(t)] = found[i]
            found[i] = None
        if given and not given.keys().isdisjoint(map(id, inputs)):
            args, kwargs = tree_map_only(torch.Tensor, lambda a: given.get(id(a), a), (args, kwargs))
        try:
            return call_node(self.module, self.modules, node, args, kwargs)
        finally:
            for held, t in placed:
                for m, name in held:
                    (m or self.module)._buffers[name] = t
            for t, old in swapped:
                t.data = old
            if copied:
                with torch.no_grad():
                    for t, old in copied:
                        t.copy_(old)

    def written_by(self, node: fx.Node, args, kwargs) -> list[torch.Tensor]:
        module = self.modules[node.target] if node.op == "call_module" else None
        return written_state(self.module, node, args, kwargs, self.buffer_ids, self.written, module)


def call_node(module: fx.GraphModule, modules: dict[str, torch.nn.Module], node: fx.Node, args, kwargs):
    """Run one fx node of ``module`` on ``args`` and ``kwargs`` in the grad mode the model ran it in;
    ``modules``: its submodules by name (``_static(module).modules``)."""
    if node.op == "get_attr":
        return _fetch_attr(module, node.target)
    if node.meta.get("no_grad") and torch.is_grad_enabled():  # as ``grad_mode(node)``, entered only where it acts
        with torch.no_grad():
            return call_node(module, modules, node, args, kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return modules[node.target](*args, **kwargs)


class _Fresh(torch.autograd.Function):
    """The identity, as a non-leaf that shares its input's storage and is no view: in-place ops may write
    to it (NOTE [replaying side effects])."""

    @staticmethod
    def forward(ctx, x):
        return x.data  # a new tensor on the same storage, as ``detach`` makes, without an op

    @staticmethod
    def backward(ctx, grad):
        return grad


def _fetch_attr(module: torch.nn.Module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _static(module: fx.GraphModule) -> SimpleNamespace:
    """What a traced module's steps share, found at its first: its modules by name, and ``generators_of(it)``
    (each a walk over every module, or every call's arguments: milliseconds of host time a step)."""
    if module not in _STATIC:
        # the root is left out: a value that held its key would keep the module, and its weights, forever
        modules = {name: m for name, m in module.named_modules() if name}
        _STATIC[module] = SimpleNamespace(modules=modules, generators=generators_of(module), draws={},
                                          writes_inputs={}, holders={})
    return _STATIC[module]


def _holders(root: torch.nn.Module, static: SimpleNamespace, buffer: torch.Tensor) -> list | None:
    """The (module, name) pairs that register ``buffer`` (module None: the root, which ``_STATIC`` may not
    hold), where a recomputation puts the state as found in its place; None where a module also holds it as a
    plain attribute (or in a list, tuple or dict attribute), which sees the state only through ``.data``.
    Found once, and again when a buffer has moved."""
    held = static.holders.get(id(buffer))
    if held is False or held and (held[0][0] or root)._buffers.get(held[0][1]) is buffer:
        return held or None
    static.holders.clear()
    aliased = set()
    for m in (root, *static.modules.values()):
        for name, b in m._buffers.items():
            if b is not None:
                static.holders.setdefault(id(b), []).append((None if m is root else m, name))
        for key, value in vars(m).items():
            if key not in ("_parameters", "_buffers", "_modules"):
                items = value.values() if isinstance(value, dict) \
                    else value if isinstance(value, (list, tuple)) else (value,)
                aliased |= {id(t) for t in items if isinstance(t, torch.Tensor)}
    for key in aliased & static.holders.keys():
        static.holders[key] = False  # registered, and held as an attribute too
    return static.holders.get(id(buffer)) or None


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (a call's state as found), made out of autograd's sight: under ``no_grad`` only
    where one requires grad (a buffer seldom does, and entering the mode is ten Python calls)."""
    for t in tensors:
        if t.requires_grad:
            with torch.no_grad():
                return [_copy(t) for t in tensors]
    return [_copy(t) for t in tensors]


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``: of a contiguous one in two ATen ops, where ``clone`` is three (it allocates through a
    nested op); any other (a buffer expanded from one value) as ``clone`` lays it out."""
    if not t.is_contiguous():
        return t.clone()
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


@contextlib.contextmanager
def _drawing_nothing(rng: tuple, names: frozenset[str]):
    """A recomputation that replays no draw must draw nothing (NOTE [what a call needs, found once])."""
    state = rng_state(rng)
    yield
    if not same_rng_state(state, rng_state(rng)):
        names = ", ".join(sorted(names))
        raise RuntimeError(f"a recomputation of [{names}] drew random numbers that the same calls did not draw in "
                           "the step that first ran them; a call that draws only on some steps cannot be replayed "
                           "from what the executor learns once (trace the model again after changing it)")


@contextlib.contextmanager
def _preserved_rng(rng: tuple):
    """Recomputation replays RNG states; the program's own RNG stream continues as if it had not."""
    state = rng_state(rng)
    try:
        yield
    finally:
        set_rng_state(state)
