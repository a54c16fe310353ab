"""torch.fx at layer granularity: the tracers that record a model's program as the model runs it.

NOTE [augmented assignments]
fx's own Proxy has no ``__iadd__``, so Python runs ``out += identity`` as ``out = out + identity``: a new
buffer that the model never allocates (torchvision's bottleneck would hold one more feature map in every
recomputation than the model does under ``torch.utils.checkpoint``). Our tracer records the augmented
assignment itself (``operator.iadd``), and the program writes in place as the model does. Where the write
cannot stay in place, the probe turns it back into fx's out-of-place operator before it runs, which is
exactly what plain fx traces: when the target is not an IR node's value (an input, a parameter, a
buffer, whose earlier readers a recomputation would rerun on the written tensor), or when another IR node
has already read it (NOTE [a write after a read] in ``harness/tracing/trace.py``). So tracing in place never refuses
a model that fx traces. An item assignment (``x[:, 0] = 0``, ``inv_perm[perm] = torch.arange(n)`` in transformers'
experts), which fx's Proxy refuses, is recorded as ``assign_item``: a write in place that returns the tensor it
wrote, joining that value's IR node as ``relu_`` would (after another layer read it, as the next note says).

Written in place, ``bn3``'s output, ``+= identity`` and the ReLU are one IR node, and the downsampling
branch the block computes between ``bn3`` and the addition sits between its members. Two things follow:
- the executor runs ``bn3`` just before the addition (``_delayed`` in ``harness/execute/layout.py``), so that
  the IR node's autograd nodes are made together and its backward is not split by the branch's;
- its backward starts with the in-place members, which hand the branch its gradient (the ReLU's, passed
  on by the addition) before the batch norm's backward reads its input: ``Profile.early_grads``, which the
  replay makes in the node's first backward step.

NOTE [one input]
The harness feeds a model one tensor, the forward's first argument. Hugging Face-style forwards take more
(``attention_mask=None``, ``return_dict=True``) and branch on them; traced as proxies, ``if attention_mask
is not None`` takes the branch (the program multiplied by None) and ``if return_dict`` is control flow fx
refuses. So each argument after the first is traced fixed at its default (fx's ``concrete_args``, the
program the model runs when called with the input alone), and fx's checks that it is given so are taken
out; an argument with no default is refused, naming it.

NOTE [sizes fixed at the example's]
fx traces every value as a proxy, sizes too, so Python that computes with a size is control flow or an
argument it cannot record: ``if height % 2: x = F.pad(...)``, ``torch.zeros(x.shape[0], n)``, a loop over
``x.chunk(2)``, the causal mask a Hugging Face model makes for its sequence length. A plan is made for one
input size (the harness traces again for each batch and side), so where the plain trace stops, the model
is traced again by ``_SizedTracer``, which also runs each call on meta: a proxy answers ``shape``,
``size()``, ``dim()``, ``numel()``, ``dtype`` and ``len()`` with its value's, iterates as its parts and
is true or false as its value, and the program takes the branch the example's sizes take. The device is
the example's, not meta: ``x.device.type == "cpu"`` takes the branch of the device the model runs on
(transformers counts a mixture of experts' tokens one way on the CPU, another on CUDA), and its name is a
string (timm's EfficientViT hands ``v.device.type`` to ``torch.autocast``; a proxy's attributes are sized
proxies in their turn, ``_SizedAttribute``, and a device's ``type`` and ``index`` its own). With sizes
numbers, a torch call on no traced value would run once in the trace and its tensor be held as a
constant: a buffer cut to the sequence and expanded to the batch (BERT's position and token type ids), a
mask made for the sequence. Such a call that makes a tensor is a node instead, made every step as the
model makes it. A module the forward makes and holds no state (transformers' ``ACT2FN["silu"]``) is traced
through, as a function. Control flow on a tensor's values is still refused, naming the module. Where a
call cannot run on meta (``nonzero``, whose size lies in the values; ``torch._grouped_mm`` in float32,
whose meta kernel takes half precision only), its sizes and those after it stay proxies, and if the trace
then stops, the refusal names that call. A model the plain trace takes keeps the plain trace.

NOTE [grad mode]
torch.fx records calls, not the grad mode they ran in: a ``with torch.no_grad():`` block in a forward (an
EMA update, a codebook assignment, a statistic used as a constant) would run with autograd on, and
gradients would flow where the model sends none. The tracer notes each node made while grad mode is off
(``node.meta["no_grad"]``), and every runner runs it so: the probe (``grad_mode``), the executor (``call_node``), the
compiled path, whose fx module turns the mode off around it (``marked_module`` in ``harness/execute/compiled.py``;
its marks, the values themselves, run with the mode on, so a write under ``no_grad`` cuts no gradient).

NOTE [autocast in the forward]
fx records calls, not the autocast they ran in, and the probe runs on meta, where ``torch.autocast``
casts nothing: a ``with torch.autocast(...)`` block in a forward would be traced as float32 code, its
values sized as float32, and run so by every plan, vanilla included (a bfloat16 block's gradients came
out 0.6% off plain PyTorch's). Running the recorded nodes under their autocast again is not enough: a
cast autocast makes (``h.float()`` after a bfloat16 block) is a new storage on the device and an alias on
meta, so the IR's storages would not be the program's. The tracer notes each node made under autocast,
and a model with one is refused, naming the call and its module. A block that turns autocast off
(``torch.autocast(..., enabled=False)``, to keep a part in float32 where the caller casts) makes no node
under autocast, and traces: the harness runs no autocast around the model.

NOTE [custom autograd functions]
fx traces through a custom ``torch.autograd.Function``: ``apply`` runs its forward on the proxies, which
records the forward's ops and drops the Function's own backward (pytorch/pytorch#84515). The program
would then train with the forward's plain derivative (a gradient reversal would not reverse), and since
``apply`` runs the forward with grad mode off, NOTE [grad mode] would cut the gradient there altogether.
So while fx traces, ``apply`` on a traced value records one ``call_function`` node that calls the
Function's ``apply``: the executor runs the real Function, its backward included, and what it saves
(``ctx.save_for_backward``) goes through the same ``saved_tensors_hooks`` as any layer's. A tensor kept
on ``ctx`` itself is out of the hooks' sight: it lives to the Function's backward whatever the plan, and
the replay does not count it.

NOTE [random draws on constants]
fx records a call only when a traced value is among its arguments; any other call runs once, while fx
traces, and its result is kept as a constant. For a draw (``torch.randperm(8)``, ``torch.randn(8)``,
``torch.empty(8).uniform_()``, ``torch.rand(8, generator=self.generator)``) that meant one permutation or
one noise for every step, under every plan, vanilla included. So while fx traces, a call on no traced
value that draws random numbers (ATen's ``nondeterministic_seeded`` tag, as ``random_nodes`` uses) is
recorded as a node, and the generators it drew from are put back: the trace draws nothing. The executor
replays such a node like any draw, from the default generators or from the model's own (NOTE [replaying
side effects] in ``harness/execute/side_effects.py``). A tensor the program makes without naming a device is made on
the default device, which the meta runs (the trace's, ``measure``'s, the compiled replay's, and a
recomputation on autograd's thread) set to meta: a cpu model's noise would otherwise meet meta values. A
draw whose value steers Python control flow (``if torch.rand(1) < p``) now fails to trace as data-dependent
control flow, where fx kept one branch. A draw from Python's ``random`` or NumPy's global generator (an
older LayerDrop's ``if random.random() < p: continue``) is no torch op, and its branch too was kept for
every step: a module call that moves either generator while fx traces is refused, naming the module
(``host_rng_state``).

NOTE [state the forward writes]
fx proxies parameters but not buffers: ``self.steps.add_(1)`` runs on the real buffer while fx traces and
leaves no node, so the program would never write it (and the trace would have written the model's
buffer). Where a trace wrote a buffer, the buffer is put back and the model traced again with buffers as
proxies (only then: a buffer used in Python control flow traces as before). The write is then a node
outside the IR, which the executor runs with its latest input. Three orders matter:
- a node that reads an input, parameter or buffer after a write reads the written value, in the forward
  and in a recomputation alike; its IR node gets edges from the IR nodes the write read and from those
  that read the state before it, so that no stage plan runs it before the write;
- a write to a buffer that IR nodes read before it (MoCo's queue: the logits read a copy of it, then the
  batch's keys are written in) runs after them in every stage order (``Traced.state_order``), and their
  recomputations start from the buffer as their forward calls found it, through a view too
  (``Traced.written_buffers``; NOTE [replaying side effects] in ``harness/execute/side_effects.py``);
- a write to an input or a parameter after another IR node has read it is refused, naming both: the
  copies a recomputation starts from are the buffers'.
A layer that reads and writes its own state in one call (BatchNorm's running statistics) is replayed as
NOTE [replaying side effects] in ``harness/execute/side_effects.py`` says.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import random
import re
import sys
import traceback
from typing import Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from harness.measure import meta_call, op_flops
from harness.tracing.state import rng_state, set_rng_state
from harness.tracing.traced import TraceFailure, describe


# Each augmented assignment on a tensor, and the operator fx would have traced instead.
AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.ipow: operator.pow}


class _AugmentedProxy(fx.Proxy):
    """A Proxy that records ``x += y`` as ``operator.iadd`` (NOTE [augmented assignments]), and ``x[i] = y``
    as a call of ``assign_item``, a write in place that returns what it wrote."""

    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", assign_item, (self, key, value), {})


def assign_item(tensor: torch.Tensor, key, value) -> torch.Tensor:
    """``tensor[key] = value``, returning ``tensor`` as an in-place op does."""
    tensor[key] = value
    return tensor


for _op in AUGMENTED:
    setattr(_AugmentedProxy, f"__{_op.__name__}__",
            lambda self, other, op=_op: self.tracer.create_proxy("call_function", op, (self, other), {}))


class _Tracer(fx.Tracer):
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _AugmentedProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        try:
            self.path_of_module(m)
        except NameError:  # made in the forward, holding no state (NOTE [sizes fixed at the example's])
            if next(itertools.chain(m.parameters(), m.buffers()), None) is None:
                return forward(*args, **kwargs)
        before = host_rng_state()
        result = super().call_module(m, forward, args, kwargs)
        if host_rng_state() != before:  # the innermost module that drew raises first
            raise TraceFailure(_host_draw(f"module {self.path_of_module(m)!r} ({type(m).__name__})"))
        return result

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():  # NOTE [grad mode]
            node.meta["no_grad"] = True
        autocast = [f"{device}, {torch.get_autocast_dtype(device)}" for device in ("cpu", "cuda")
                    if torch.is_autocast_enabled(device)]
        if autocast:  # NOTE [autocast in the forward]
            node.meta["autocast"] = "; ".join(autocast)
        return node


class _SizedProxy(_AugmentedProxy):
    """A Proxy that answers with its value's sizes, dimensions and dtype where the trace knows its value
    (NOTE [sizes fixed at the example's])."""

    def _value(self):
        """The proxy's value on meta, where the trace knows it."""
        tracer = self.__dict__.get("tracer")  # absent on a proxy copy or pickle makes without __init__
        return tracer.values.get(self.node) if isinstance(tracer, _SizedTracer) else None

    def __getattr__(self, name: str):
        value = self._value()
        if isinstance(value, torch.Tensor) and name in _SIZES:
            return getattr(value, name)
        if isinstance(value, torch.device) and name in ("type", "index"):  # a name, not a device to make on
            return getattr(value, name)  # (timm: ``torch.autocast(device_type=v.device.type, enabled=False)``)
        return _SizedAttribute(self, name)

    def __len__(self):
        if isinstance(value := self._value(), (torch.Tensor, tuple, list)):
            return len(value)
        return super().__len__()


class _SizedAttribute(fx.proxy.Attribute, _SizedProxy):
    """An attribute of a sized proxy (``x.device``), sized in its turn; fx makes its node when it is used."""


# What a sized proxy answers from its value; the device is the example's, not meta (NOTE [sizes fixed at
# the example's]).
_SIZES = frozenset({"shape", "ndim", "dtype", "size", "dim", "numel", "nelement", "is_floating_point"})


_DEVICE = frozenset({"device", "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "get_device"})


class _SizedTracer(_Tracer):
    """fx's tracer that also runs each call on meta, so that the program's sizes are numbers, not proxies
    (NOTE [sizes fixed at the example's])."""

    def __init__(self, example_input: torch.Tensor):
        super().__init__()
        self.example_input = example_input.to("meta")
        self.on_the_device = torch.empty(0, dtype=example_input.dtype, device=example_input.device)
        self.values: dict[fx.Node, object] = {}  # each node's value on meta, where it could be run there
        self.unsized: tuple[str, str] | None = None  # the first call that could not run on meta, and why
        self.computing = False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _SizedProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        if self.computing:  # a leaf module's own submodules, run on meta
            return forward(*args, **kwargs)
        self.leaf_forward = m.forward  # for create_proxy, where a leaf's call becomes a node (its hooks not run)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        return attr_val if self.computing else super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: fx.Proxy) -> bool:
        if isinstance(value := self.values.get(obj.node), (bool, int, float)):
            return bool(value)
        return super().to_bool(obj)

    def iter(self, obj: fx.Proxy):
        if isinstance(value := self.values.get(obj.node), (torch.Tensor, tuple, list)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if any(isinstance(a, fx.Proxy) and a.node not in self.values for a in tree_leaves((args, kwargs))):
            return proxy  # sized after an input that could not be
        self.computing = True
        try:
            with torch.device("meta"):  # what the program makes without naming a device too
                self.values[proxy.node] = self._value(kind, target, args, kwargs)
        except Exception as error:  # its sizes stay proxies, as fx traces them
            if self.unsized is None and kind != "output":
                self.unsized = (describe(proxy.node, self.root), f"{type(error).__name__}: {error}".splitlines()[0])
        finally:
            self.computing = False
        return proxy

    def _value(self, kind, target, args, kwargs):
        if kind == "placeholder":  # the input, then the forward's tensor defaults (NOTE [one input])
            first = not any(node.op == "placeholder" for node in self.values)
            return self.example_input if first else on_meta_like(args[0])
        if kind == "get_attr":
            return on_meta_like(functools.reduce(getattr, target.split("."), self.root))
        if kind == "call_function" and target is getattr and args[1] in _DEVICE:
            return getattr(self.on_the_device, args[1])
        if kind == "call_method" and target in _DEVICE:
            return getattr(self.on_the_device, target)()
        # The value of x.device is the example's device, for the program's branches (x.device.type ==
        # "cpu"); a call that is given it (torch.arange(n, device=x.device)) runs on meta.
        python = kind == "call_function" and (target is getattr or getattr(target, "__module__", "") == "_operator")

        def on_meta(a):
            a = self.values[a.node] if isinstance(a, fx.Proxy) else on_meta_like(a)
            return torch.device("meta") if isinstance(a, torch.device) and not python else a

        args, kwargs = tree_map(on_meta, (args, kwargs))
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            with _state_on_meta(self.root.get_submodule(target)):
                return self.leaf_forward(*args, **kwargs)
        return None  # the output


def on_meta_like(t, device="meta"):
    """An empty tensor on ``device`` with ``t``'s sizes, strides, dtype and requires_grad; anything else,
    itself."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(t.requires_grad)


@contextlib.contextmanager
def _state_on_meta(module: torch.nn.Module):
    """``module``'s parameters and buffers swapped for empty meta tensors of their sizes while a call runs
    on meta values."""
    swapped = []
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    swapped.append((table, key, t))
                    table[key] = on_meta_like(t)
    try:
        yield
    finally:
        for table, key, t in swapped:
            table[key] = t


@contextlib.contextmanager
def _functions_as_calls():
    """While fx traces, a custom ``torch.autograd.Function`` applied to a traced value is recorded as one
    call of its ``apply`` (NOTE [custom autograd functions])."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        proxies = [a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)]
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", _applying(cls), args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


@functools.cache
def _applying(cls: type) -> Callable:
    """The call of ``cls.apply`` the fx module makes, under the Function's own name."""
    def call(*args, **kwargs):
        return cls.apply(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
    return call


class Draws(TorchDispatchMode):
    """Whether an op drew random numbers (``seen``): ATen tags every op that consumes the generator
    ``nondeterministic_seeded`` (dropout's bernoulli_, rand, randn, randperm, SDPA's dropout); and the ops'
    FLOPs (``flops``, counted as the tracker counts them, ``measure.op_flops``). On meta, with no mode outside
    it, an op's kernel runs once per layout (NOTE [meta kernels remembered])."""

    seen = False
    flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or torch.Tag.nondeterministic_seeded in func.tags
        kwargs = kwargs or {}
        out = meta_call(func, args, kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        return out


class _DrawsAsCalls(TorchFunctionMode):
    """While fx traces, a torch call on no traced value that draws random numbers is recorded as a node
    (NOTE [random draws on constants])."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, fx.Proxy) for a in leaves):
            return func(*args, **kwargs)
        if isinstance(self.tracer, _SizedTracer):
            if self.tracer.computing:
                return func(*args, **kwargs)
            if _makes_tensor(func, args, kwargs):  # NOTE [sizes fixed at the example's]
                return self.tracer.create_proxy("call_function", func, args, kwargs)
        cuda = [torch.device("cuda", i) for i in range(torch.cuda.device_count() if torch.cuda.is_initialized() else 0)]
        before = rng_state((cuda, [g for g in leaves if isinstance(g, torch.Generator)]))
        with Draws() as draws:
            value = func(*args, **kwargs)
        if not draws.seen:
            return value
        set_rng_state(before)  # the trace draws nothing
        return self.tracer.create_proxy("call_function", func, args, kwargs)


def _makes_tensor(func, args, kwargs) -> bool:
    """Whether ``func`` makes a tensor, asked of meta stand-ins for its tensor arguments."""
    try:
        with torch.device("meta"):
            made = func(*tree_map(on_meta_like, args), **tree_map(on_meta_like, kwargs))
    except Exception:
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(made))


def symbolic_trace(model: torch.nn.Module, example_input: torch.Tensor) -> fx.GraphModule:
    """The model's fx module; where fx stops at a construct it cannot record, traced again with the
    example's sizes fixed (NOTE [sizes fixed at the example's])."""
    try:
        return _buffer_writes_traced(model, None)
    except TraceFailure as plain:
        if plain.__cause__ is None:  # the harness's own refusal, which the example's sizes do not change
            raise
        try:
            return _buffer_writes_traced(model, example_input)
        except TraceFailure as fixed:
            raise fixed from plain


def _buffer_writes_traced(model: torch.nn.Module, example_input: torch.Tensor | None) -> fx.GraphModule:
    """The model's fx module; where its code writes a buffer in place, traced again with buffers as
    proxies, so that the write is a node (NOTE [state the forward writes])."""
    buffers = dict(model.named_buffers())
    saved = {name: (b._version, b.detach().clone()) for name, b in buffers.items()}
    gm = _fx_trace(model, proxy_buffers=False, example_input=example_input)
    if _undo_writes(buffers, saved):
        gm = _fx_trace(model, proxy_buffers=True, example_input=example_input)
        if written := _undo_writes(buffers, saved):
            raise TraceFailure(f"{type(model).__name__} writes buffer {written[0]!r} in its forward in a way "
                               "torch.fx does not record; write it through the module attribute (self.name.add_(...))")
    return gm


def _undo_writes(buffers: dict[str, torch.Tensor], saved: dict[str, tuple]) -> list[str]:
    """The buffers a trace wrote in place (the write ran on the real tensor and left no node), each put
    back as it was."""
    written = [name for name, b in buffers.items() if b._version != saved[name][0]]
    with torch.no_grad():
        for name in written:
            buffers[name].copy_(saved[name][1])
            saved[name] = (buffers[name]._version, saved[name][1])
    return written


def _fx_trace(model: torch.nn.Module, proxy_buffers: bool, example_input: torch.Tensor | None = None
              ) -> fx.GraphModule:
    before = host_rng_state()
    try:
        tracer = _Tracer() if example_input is None else _SizedTracer(example_input)
        tracer.proxy_buffer_attributes = proxy_buffers
        attributes = {id(m): dict(vars(m)) for m in model.modules()}
        concrete = _one_input(model)
        with torch.enable_grad(), _functions_as_calls(), _DrawsAsCalls(tracer):
            graph = tracer.trace(model, concrete_args=concrete or None)
        _drop_specialisation_checks(graph)
        kept = _proxies_kept(model, attributes)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        gm.meta["kept_as_attributes"] = kept  # NOTE [values held outside the program]
    except TraceFailure:
        raise
    except Exception as error:  # fx raises TraceError, but also TypeError/AttributeError from user code
        unsized = getattr(tracer, "unsized", None)
        why = f" (the trace could not size {unsized[0]} on meta: {unsized[1]})" if unsized else ""
        raise TraceFailure(_why_untraceable(model, error) + why) from error
    if host_rng_state() != before:
        raise TraceFailure(_host_draw(type(model).__name__))
    if autocast := next((node for node in graph.nodes if "autocast" in node.meta), None):
        raise TraceFailure(
            f"{type(model).__name__} runs {describe(autocast, gm)} under torch.autocast({autocast.meta['autocast']}) "
            "in its forward: the trace sizes every value on meta, where autocast casts nothing, so the plans and "
            "the executor would run another program than the model's (NOTE [autocast in the forward]). Take the "
            "autocast out of the forward; the harness trains in the parameters' dtype")
    return gm


def _one_input(model: torch.nn.Module) -> dict:
    """The forward's arguments after the first, fixed at their defaults (NOTE [one input]); a tensor default
    stays an argument, which the probe and the executor give its default."""
    plain = [p for p in inspect.signature(model.forward).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required := [p.name for p in plain[1:] if p.default is p.empty]:
        raise TraceFailure(
            f"{type(model).__name__}.forward takes {', '.join(p.name for p in plain)}, and the harness feeds a model "
            f"one input: {', '.join(map(repr, required))} {'has' if len(required) == 1 else 'have'} no default. Give "
            f"{'it' if len(required) == 1 else 'them'} a default, or wrap the model in a module whose forward takes "
            f"{plain[0].name!r} alone and makes the rest from it (an attention mask from the token ids)")
    return {p.name: p.default for p in plain[1:] if p.default is None or isinstance(p.default, (bool, int, float, str))}


def _drop_specialisation_checks(graph: fx.Graph):
    """Takes out the checks fx adds for each fixed argument (that it is given its default): the harness
    never passes one, and they are no layers."""
    checks = [n for n in graph.nodes if n.op == "call_function" and len(n.args) == 2
              and n.target in (torch._assert, fx._symbolic_trace._assert_is_none)
              and "has been specialized to have value" in str(n.args[1])]
    for check in reversed(checks):
        tested = check.args[0]
        graph.erase_node(check)
        if tested.op == "call_function" and not tested.users:
            graph.erase_node(tested)


def _proxies_kept(model: torch.nn.Module, before: dict[int, dict]) -> dict[str, tuple[str, str]]:
    """The fx nodes whose Proxy a trace left in a module's attribute, directly or in a list, tuple or dict:
    node name -> (module, attribute). Each attribute that holds one gets its value from before the trace
    back. A shape kept so (``self.H = x.shape[2]``) is harmless; a tensor is not (NOTE [values held outside
    the program] in ``harness/tracing/trace.py``)."""
    found = {}
    for name, m in model.named_modules():
        for key, value in list(vars(m).items()):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            for item in items:
                if isinstance(item, fx.Proxy):
                    found.setdefault(item.node.name, (name or type(model).__name__, key))
            if isinstance(value, fx.Proxy):
                if key in before.get(id(m), {}):
                    setattr(m, key, before[id(m)][key])
                else:
                    delattr(m, key)
    return found


# What fx's errors mean in the model's own terms (a pattern of the error's text; the construct, and the way
# out where there is a usual one).
_CONSTRUCTS = [
    ("cannot be used as inputs to control flow", "data-dependent control flow (if, while, assert or bool() on a "
                                                 "tensor's value)"),
    ("cannot be iterated", "iteration over a traced value (unpacking, a for loop, *args)"),
    ("'len' is not supported", "len() of a traced value"),
    (r"^(zeros|ones|empty|full|rand|randn|randint|arange)\(\) (takes|received)",
     "a tensor made from a traced shape (torch.zeros(x.shape[0], n); make it from the traced value instead: "
     "x.new_zeros((x.shape[0], n)), torch.zeros_like)"),
]


def host_rng_state() -> tuple:
    """Python's ``random`` state and NumPy's global one, where NumPy is loaded (NOTE [random draws on
    constants])."""
    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    return random.getstate(), None if state is None else (state[1].tobytes(), state[2:])


def _host_draw(where: str) -> str:
    return (f"{where} draws from Python's random module or NumPy's global generator in its forward (LayerDrop's "
            "`if random.random() < p`, say): torch.fx runs that draw once, while it traces, so every step of the "
            "traced program would take the branch this one took. Switch it off (a layer-drop probability of 0), "
            "or draw with torch and mask instead of branching (x + mask * f(x), as torchvision's StochasticDepth "
            "does)")


def _why_untraceable(model: torch.nn.Module, error: Exception) -> str:
    """The module (its path in ``model``) and the construct torch.fx stopped at, and where in the code."""
    paths = {id(m): path for path, m in model.named_modules()}
    module, where = None, ""
    frames = zip(traceback.walk_tb(error.__traceback__), traceback.extract_tb(error.__traceback__))
    for (frame, _), summary in frames:
        if "/torch/" in summary.filename or summary.filename == __file__:
            continue
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in paths:
            module = f"module {paths[id(owner)] or '(the model itself)'!r} ({type(owner).__name__})"
        where = f" at {summary.filename}:{summary.lineno}" + (f" ({summary.line})" if summary.line else "")
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    construct = next((what for key, what in _CONSTRUCTS if re.search(key, text)), f"{type(error).__name__}: {text}")
    return (f"torch.fx cannot trace {type(model).__name__}: {construct}, in {module or 'the model'}{where}. Make "
            "that code traceable, or wrap the module in a traceable one that leaves that call out")
