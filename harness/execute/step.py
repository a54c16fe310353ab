"""One training step (forward, loss, backward) of a traced module under any ``Plan``.

NOTE [executing a plan]
The forward pass runs the fx graph layer by layer with autograd on, stage by stage (``_stage_order``); the
calls that may save what the plan recomputes, swaps or lets go of at the loss (those of such IR nodes, and
those that read one), and the loss, run inside ``saved_tensors_hooks``, every other call as plain PyTorch runs
it (a hook on every save is host work that plain PyTorch does not do). When a layer's backward saves
a tensor whose storage belongs to an IR node the plan recomputes, the hook keeps only a token (the node, which
of its storages: a layer may make several, as ``torch.linalg.qr`` makes Q and R, and the tensor's size, stride
and offset), so the value dies after its last forward use. Values the plan keeps are saved as usual, and the
executor holds on to those that the recomputation of a later stage reads. A parameter, buffer or input is handed
back as it is, with no record: it is never a token, and the packing costs a set lookup.

In the backward pass, the first time the autograd engine unpacks a token of stage ``i``, all the
recomputed nodes of stage ``i`` are run again, under ``no_grad``, from the kept values (Kusumoto et al.'s
canonical strategy, one stage at a time). Each recomputed value is dropped when its last token has been
unpacked. Gradients flow through the graph built in the forward pass, so the loss and every gradient
are those of plain PyTorch, and they land in ``.grad`` as with ``loss.backward()``.
What a recomputed layer saves besides node values (max-pooling indices, batch-norm statistics) is dropped
in the forward pass too: the recomputation runs that layer with autograd on and collects it again, in the
order it was saved.

NOTE [what a call needs, found once]
Taking and comparing every generator's state around every call a plan may recompute, every step, was most
of a recomputing step's host work (ResNet-50, ``chen_sqrt``: 166 ``aten::equal`` a step, with the state
copies and ``detach``es around them, 6,875 ATen calls against plain PyTorch's 3,191). Whether a call draws
is the program's, not the step's: the first step that runs a call under a plan compares the states around
it, and later steps take the state only before the calls that drew (``_static(module).draws``, one table per
setting of the modules' ``training`` flags and devices, so ``eval()`` and back learn again). A call that draws only on
some steps (a dropout whose probability was 0) would then be replayed from the wrong state; instead, a
stage whose recomputation replays no draw checks that it drew nothing, and a step where it did fails,
naming the calls (``_drawing_nothing``; CPU states are compared as bytes, where ``torch.equal`` is two ATen
ops). A stage that replays a draw puts the program's state back after it. A buffer the recomputation swaps
in is read from the call's own ``written_state`` of the forward pass (the same tensors), and the state's
copy is two ops (``empty_strided``, ``copy_``; ``clone`` is three); a recomputed value handed back whole
needs no ``as_strided``. What is left beside the recomputed layers' own ops is the state copies (a
BatchNorm's three buffers take six ops) and the reruns that collect what a layer saves
(``_rerun_saving``): ``python -m harness.bench.overhead`` measures it against the goal of two ops a
recomputed call.
The rest of what a step needs from the trace and the plan (the calls' order and arguments, what each call lets
go of, which calls run inside the hooks, the kept values each stage reads, each recomputation's schedule) is
made at the plan's first step too (``_layout``, kept with the trace), not worked out again every step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from harness.execute.layout import _layout, _recomputation
from harness.execute.side_effects import _Fresh, _SideEffects
from harness.execute.store import _EXTRAS_ONLY, _RECORDERS, _Store, _ranked
from harness.execute.swap import _Swap
from harness.measure import recomputing
from harness.tracing.state import tensors_of
from harness.tracing.traced import Traced
from harness.zoo.nets import sum_loss
from strategies import Plan, bits


def execute(traced: Traced, plan: Plan, *inputs: torch.Tensor, loss_fn=None) -> torch.Tensor:
    """One training step of ``traced`` under ``plan``; returns the (detached) loss (``loss_fn`` defaults to
    the sum of every tensor the model returns)."""
    if plan.schedule is not None:
        raise ValueError(f"execute runs stage plans; {plan.strategy!r} carries a general (R, S) schedule, which "
                         "may recompute a node several times out of the autograd engine's order")
    step = _Step(traced, plan)
    loss_fn = loss_fn or sum_loss
    try:
        output = step.forward(inputs)
        with step.hooks:
            loss = loss_fn(output)
        del output
        step.store.drop_unreached()
        step.end_forward()
        loss.backward()
    except BaseException:
        # A saved output holds its own grad_fn, which holds the hook's _Saved, which holds the output: a
        # cycle through C++ that the collector cannot see, broken only by a backward that completes. A step
        # that fails (a CUDA OOM) would keep its whole graph alive, and the next run would start on a
        # full device; drop what the hooks hold instead.
        step.drop_packed()
        raise
    # The same cycle holds what no backward reached (the layers of an output the loss leaves out, an
    # auxiliary head's): each step kept it.
    step.drop_packed()
    return loss.detach()


@dataclass
class _Step:
    """One training step under a plan: the forward pass and the stages' recomputations. Each part holds its
    own state: what the saved-tensor hooks keep is ``_Store``'s (a token where the plan recomputes or swaps),
    the replay of each recomputed call's randomness and state ``_SideEffects``', the copies to host memory
    and back ``_Swap``'s."""

    traced: Traced
    plan: Plan
    env: dict[str, object] = field(default_factory=dict)  # fx node name -> value, during a pass
    cache: dict[str, object] = field(default_factory=dict)  # fx node of a kept group -> value, for recomputation
    constants: dict[str, object] = field(default_factory=dict)  # inputs and non-tensor values
    needs_grad: dict[str, bool] = field(default_factory=dict)  # fx node -> whether its output required grad

    def __post_init__(self):
        self.layout = layout = _layout(self.traced, self.plan)
        self.discarded, self.stage_of, self.order = layout.discarded, layout.stage_of, layout.order
        self.stage_nodes, self.held_for, self.cached_names = layout.stage_nodes, layout.held_for, layout.cached_names
        # kept group -> the stages still to read it
        self.cache_stages = {g: set(stages) for g, stages in layout.cache_stages.items()}
        self.effects = _SideEffects(self.traced, layout.recomputable)
        self.swap = _Swap(self.traced.graph, self.plan)
        self.store = _Store(self.traced.group_of, self.discarded, layout.unreached, self.swap,
                            lambda g: self._recompute_stage(self.stage_of[g]))
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.store.pack, self.store.unpack)

    # -- forward -------------------------------------------------------------------------------------

    def forward(self, inputs):
        args = iter(inputs)
        parameters = [p for m in (self.traced.module, *self.effects.modules.values()) for p in m._parameters.values()
                      if p is not None]
        held = [*parameters, *self.effects.buffers, *inputs]
        self.store.static = {id(t.untyped_storage()) for t in held}
        # A recomputation may run on autograd's device thread, where a default device set here is not; it
        # enters it only where one was set: the context is a torch-function mode, a Python call for every
        # torch call in the recomputation (6,500 a step for chen_sqrt on ResNet-152).
        default = torch.get_default_device()
        self.default_device_mode = torch.device(default) if default.type != "cpu" else contextlib.nullcontext()
        self.effects.start({t.device for t in held})
        # After each call, the values it read last go (and its own, where nothing reads it: a stray
        # ``zeros_like``). The hooks are entered once for each run of hooked calls, not call by call (four
        # Python calls each time); between the calls nothing runs that saves a tensor.
        hooks_on = False
        try:
            for node, (node_args, node_kwargs), frees, hooked in zip(self.order, self.layout.arguments,
                                                                     self.layout.forward_frees, self.layout.hooked):
                if node.op == "output":
                    return self._load(node_args[0])
                if node.op == "placeholder":  # an argument not given takes its default, as in fx.Interpreter
                    self.constants[node.name] = next(args, node_args[0] if node_args else None)
                    continue
                if hooked != hooks_on:
                    self.hooks.__exit__(None, None, None) if hooks_on else self.hooks.__enter__()
                    hooks_on = hooked
                if hooked:
                    self.store.begin_call()
                value = self.effects.run(node, self._load(node_args), self._load(node_kwargs), recompute=False)
                self._store(node, value)
                if hooked:  # what the call saved, once its value's storages are known (an unhooked call saves none)
                    self.store.resolve(node.name if node.name in self.traced.group_of else None)
                for name in frees:
                    self.env.pop(name, None)
                del value
        finally:
            if hooks_on:
                self.hooks.__exit__(None, None, None)

    def _store(self, node: fx.Node, value):
        g = self.traced.group_of.get(node.name)
        if type(value) is torch.Tensor:  # most values: one tensor
            tensors = [value]
            self.needs_grad[node.name] = value.requires_grad
        else:
            tensors = tensors_of((value,))
            self.needs_grad[node.name] = any([t.requires_grad for t in tensors])
        if g is None:
            self.constants[node.name] = value  # no tensor of its own: kept for the whole step
        else:
            self.env[node.name] = value
            self.store.note_value(g, tensors)
            if node.name in self.cached_names.get(g, ()):
                self.cache[node.name] = value
            self.swap.note_value(g, value)

    def end_forward(self):
        self.store.resolve()
        self.env.clear()
        self.swap.start_backward()
        needed = {self.stage_of[g] for g, count in self.store.tokens_left.items() if count}
        if needed - self.held_for:  # the trace's saved tensors, seen on meta, are not this device's
            names = sorted(self.traced.graph.names[g] for g, count in self.store.tokens_left.items()
                           if count and self.stage_of[g] not in self.held_for)
            raise RuntimeError(f"executor bug: a backward saved what {names} compute, which no backward saved "
                               "when traced on meta; the plan let go of what would recompute them")
        for g in list(self.cache_stages):
            self.cache_stages[g] &= needed
            self._release_cache(g)
        self.effects.forget(name for name in list(self.effects.state_before)  # a stage no backward reads
                            if self.stage_of[self.traced.group_of[name]] not in needed)  # is not recomputed

    def drop_packed(self):
        """Let go of what the hooks' tokens and the kept values' cache hold (``execute`` says when)."""
        self.store.drop_packed()
        self.cache.clear()

    # -- backward: recomputation ---------------------------------------------------------------------

    def _recompute_stage(self, stage: int):
        # Only what a token will read, and what that is made from (NOTE [what a recomputation makes] in
        # strategies/replay.py); a layer not rerun lets go of the state its forward call found.
        discarded = self.layout.stage_discarded[stage]
        wanted = bits([g for g in discarded if self.store.tokens_left.get(g)])
        read = bits([g for g in discarded if self.store.value_tokens.get(g)])
        key = (stage, wanted, read)
        if key not in self.layout.recomputations:
            self.layout.recomputations[key] = _recomputation(self.traced, self.plan, self.stage_nodes, *key)
        run = self.layout.recomputations[key]
        self.effects.forget(run.not_rerun)
        order, groups = run.order, run.groups
        for recorder in _RECORDERS:
            recorder.append([n.name for n in order])
        env = {}
        # Each storage of a value, by its rank among the value's storages in the forward pass: a layer that
        # makes several (``torch.linalg.qr``'s Q and R, ``var_mean``, values and indices) saves any of them.
        storages = {g: {} for g in groups if read >> g & 1}
        ranks = {g: {} for g in storages}
        with torch.no_grad(), self.effects.replaying(run.names), self.default_device_mode, recomputing():
            for node, (node_args, node_kwargs), g, frees in zip(order, run.arguments, run.node_groups, run.frees):
                if node.name in self.store.extra_nodes:
                    env[node.name] = self._rerun_saving(node, env)
                else:
                    env[node.name] = self.effects.run(node, self._load(node_args, env), self._load(node_kwargs, env),
                                                      recompute=True)
                if g in storages:
                    by_rank, rank_of = storages[g], ranks[g]
                    for sid, t in _ranked(tensors_of((env[node.name],)), rank_of).items():
                        by_rank[rank_of[sid]] = t
                for name in frees:
                    env.pop(name, None)
        for g in groups:
            if wanted >> g & 1:  # pending tokens: of its value, or only of what its layer saved
                self.store.recomputed[g] = storages[g] if read >> g & 1 else _EXTRAS_ONLY
        for g in self.layout.stage_reads.get(stage, ()):
            if g in self.cache_stages:
                self.cache_stages[g].discard(stage)
                self._release_cache(g)

    def _rerun_saving(self, node: fx.Node, env: dict):
        """Recompute ``node`` with autograd on, to collect again what its layer saves beside node values;
        the same call on inputs that require grad as they did saves the same tensors in the same order
        (NOTE [replaying side effects]). The result is detached."""
        captured = []

        def keep(t):
            # Detached (``.data``: no op), and nothing left in the rerun's graph: a saved output holding its own
            # grad_fn would be a cycle through C++ that keeps the whole rerun alive (the one ``execute`` breaks
            # on failure). Hooks skip autograd's version check, so ``.data``'s own counter is never read.
            captured.append(t.data)

        fresh = {}  # one alias per fx input: ``q is k`` holds again where it held in the forward pass

        def load(a: fx.Node):
            value = self._value(a, env)
            if isinstance(value, torch.Tensor) and self.needs_grad.get(a.name) and a.op != "get_attr":
                if a.name not in fresh:
                    leaf = value.data.requires_grad_()
                    fresh[a.name] = _Fresh.apply(leaf) if self.effects.writes_inputs.get(node.name, True) else leaf
                return fresh[a.name]
            return value

        with torch.enable_grad():
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), load)
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                value = self.effects.run(node, args, kwargs, recompute=True)
        for rank, t in enumerate(captured):
            if (node.name, rank) in self.store.extra_keys:
                self.store.extras[(node.name, rank)] = t
        # An autograd node the rerun made may outlive it (a pruning or weight-norm pre-hook's weight, which
        # its module keeps), and each of its saved tensors holds ``keep`` and so this list: emptied, it holds
        # no recomputed value past the rerun.
        captured.clear()
        if type(value) is torch.Tensor:
            return value.data
        return fx.node.map_aggregate(value, lambda v: v.data if isinstance(v, torch.Tensor) else v)

    def _release_cache(self, g: int):
        if not self.cache_stages[g]:
            del self.cache_stages[g]
            for name in self.cached_names[g]:
                self.cache.pop(name, None)

    def _load(self, args, local: dict | None = None):
        if not args:  # most calls' keyword arguments: nothing to look up (map_arg is four Python calls)
            return args
        if type(args) is tuple and len(args) == 1 and type(args[0]) is fx.Node:  # most calls' arguments
            return (self._value(args[0], local),)
        return fx.node.map_arg(args, lambda a: self._value(a, local))

    def _value(self, a: fx.Node, local: dict | None = None):
        if local is not None and a.name in local:
            return local[a.name]
        if a.name in self.constants:
            return self.constants[a.name]
        if a.name in self.env:
            return self.env[a.name]
        assert a.name in self.cache, f"executor bug: {a.name} is neither kept nor recomputed"
        return self.cache[a.name]
