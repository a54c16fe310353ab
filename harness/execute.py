"""Run one training step (forward, loss, backward) of a traced module under any ``Plan``.

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
  stage; the replay counts them (``Graph.recompute_state_bytes``). A write to state by a node of its own
  (``self.steps.add_(1)``) is outside the IR and runs once, in the forward pass (NOTE [state the forward
  writes] in ``harness/tracer.py``).
- Grad mode. A node the model ran under ``no_grad`` runs under it here too (NOTE [grad mode] there).
- In-place ops. A recomputation under ``no_grad`` runs any in-place op as it is. A layer rerun with
  autograd on, to collect what it saves besides node values, gets inputs that are aliases of the recomputed
  values, one per fx input, so that ops that test ``q is k`` (MHA's self-attention path) see the same
  aliasing as in the forward pass: leaves (``.data``, no op) where its forward call wrote no input in place,
  and fresh non-leaves (``_Fresh``) where it did (its input's version counter moved, found once), so
  ``inplace=True`` modules, ``F.*(..., inplace=True)``, ``x.add_()`` and writes to views work on them.

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

NOTE [swapping]
A saved tensor whose storage belongs to a swapped node (``plan.swapped``) is copied to host memory when
it is first packed, once per storage however often it is saved; the token keeps the host copy and the
tensor's geometry, so the device storage dies at its last forward use. The copy back starts when the
backward of the node's ``prefetch`` trigger starts (a pre-hook on that node's ``grad_fn``; -1: when the
forward pass ends), and the device copy is dropped when its last token is unpacked. A token unpacked
before its copy back started fetches it then (a stall). On CUDA the copies run on two side streams into
one pinned host pool: the copy out waits for the compute stream and ``record_stream`` keeps the device
block from reuse until it is done; the copy back waits for the copy out, and the compute stream waits
for the copy back before the tensor is used. On ``meta`` and ``cpu`` the copies are made at once, in
``measure.on_host()``, so the tracker moves them out of the device's tally.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map_only

from harness.measure import on_host, recomputing
from harness.nets import sum_loss
from harness.state import generators_of, rng_state, same_rng_state, set_rng_state, tensors_of, written_state
from harness.traced import Traced
from strategies import Plan, bits, members
from strategies.replay import called_for



RECOMPUTE_EVENT = "harness::recompute"  # what a profile calls a stage's recomputation (bench.profile_step)
_RECORDERS: list[list[list[str]]] = []  # recorded_recomputations()'s lists


@contextlib.contextmanager
def recorded_recomputations():
    """A list that gets, for each recomputation the steps run inside make, the fx nodes it reruns in the
    order it runs them (the overhead benchmark runs the same calls plainly, as the cost a recomputation
    cannot avoid; tests ask what the last recomputation of a step ran)."""
    stages: list[list[str]] = []
    _RECORDERS.append(stages)
    try:
        yield stages
    finally:
        _RECORDERS.remove(stages)


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


@dataclass(eq=False)
class _HostCopy:
    """A swapped storage: its bytes in host memory, and on the device again once fetched."""

    host: torch.Tensor  # uint8, the whole storage
    device: torch.device
    tokens: int = 0  # saved tensors of this storage not yet unpacked
    fetched: torch.Tensor | None = None
    copied_out: object = None  # CUDA events
    copied_in: object = None


@dataclass(eq=False)
class _Saved:
    """What a saved-tensor hook keeps: the tensor, or for a recomputed or swapped value only its place."""

    tensor: torch.Tensor | None
    rank: int  # among what its call saved, parameters too: a rerun's saves are ranked alike
    group: int = -1
    geometry: tuple = ()  # (rank of the storage in its IR node, size, stride, offset, dtype)
    extra: tuple[str, int] | None = None  # (fx node, rank among what it saved): not a node's value
    swapped: _HostCopy | None = None


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


class _Store:
    """What the saved-tensor hooks keep (``pack``, ``unpack``): the tensor itself, or a token where the plan
    recomputes the value (or what its layer saved besides, NOTE [executing a plan]) or swaps it; the counts of
    tokens still to be unpacked, and the recomputed tensors they will read."""

    def __init__(self, group_of: dict[str, int], discarded: set[int], unreached: set[int], swap: "_Swap",
                 recompute):
        self.group_of, self.discarded, self.unreached, self.swap = group_of, discarded, unreached, swap
        self.recompute = recompute  # group -> None: recompute the stage of that group
        self.static: set[int] = set()  # storages of parameters, buffers and inputs (set as the forward starts)
        self.storage_group: dict[int, tuple[weakref.ref, int, int]] = {}  # storage id -> (it, group, rank)
        self.storage_ranks: dict[int, dict[int, int]] = {}  # group -> storage id -> rank
        self.pending: list[_Saved] = []  # packed since the last resolve
        self.saves = 0  # tensors the call running saved so far
        self.packed: list[weakref.ref] = []  # to what the graph may still hold, to drop on failure
        self.unreached_saves: list[_Saved] = []  # what the layers no gradient reaches saved, until the loss
        self.tokens_left: dict[int, int] = {}  # group -> tokens not yet unpacked
        self.value_tokens: dict[int, int] = {}  # group -> those of them that read its value
        self.recomputed: dict[int, dict[int, torch.Tensor]] = {}  # group -> rank -> a tensor
        self.extra_nodes: set[str] = set()  # recomputed fx nodes that saved extras
        self.extras: dict[tuple[str, int], torch.Tensor] = {}  # recomputed extras, until unpacked
        self.extra_keys: set[tuple[str, int]] = set()  # (fx node, rank) of every extra token

    def drop_packed(self):
        for ref in self.packed:
            if (saved := ref()) is not None:
                saved.tensor = saved.swapped = None
        self.packed.clear()

    def drop_unreached(self):
        """Let go of what the layers no gradient reaches saved, at the loss, where plain PyTorch lets go of
        their autograd graph with the outputs (NOTE [what no gradient reaches] in ``harness/backward_profile.py``): a
        tensor held here would live to the step's end, and a token would hold a stage's kept values."""
        for saved in self.unreached_saves:
            if saved.swapped is not None:
                saved.swapped.tokens -= 1
            elif saved.group >= 0:
                self.tokens_left[saved.group] -= 1
                if saved.extra is None:
                    self.value_tokens[saved.group] -= 1
                else:
                    self.extra_keys.discard(saved.extra)
                    self.extra_nodes.discard(saved.extra[0])
            saved.tensor, saved.swapped, saved.group = None, None, -1
        self.unreached_saves.clear()

    def note_value(self, g: int, tensors: list[torch.Tensor]) -> None:
        """The tensors of a value the forward made for group ``g``: each of their storages not seen yet, with its
        rank among the group's, so that what a layer saves of it is known as ``g``'s."""
        ranks = self.storage_ranks.setdefault(g, {})
        for sid, t in _ranked(tensors, ranks).items():
            self.storage_group[sid] = (weakref.ref(t.untyped_storage()), g, ranks[sid])

    def begin_call(self):
        """Before a call inside the hooks: what is pending was saved by an earlier node and is left as it is."""
        self.pending.clear()
        self.saves = 0

    def pack(self, tensor: torch.Tensor) -> _Saved | torch.Tensor:
        rank, self.saves = self.saves, self.saves + 1
        if id(tensor.untyped_storage()) in self.static:
            return tensor  # a parameter, buffer or input: never a token, and it holds no grad_fn to make a cycle
        saved = _Saved(tensor, rank)
        self.pending.append(saved)
        self.packed.append(weakref.ref(saved))
        return saved

    def resolve(self, node_name: str | None = None):
        """Turn what ``node_name`` saved into tokens where the plan recomputes it: a recomputed node's
        value, or anything else a recomputed node's layer saved (pooling indices), which the
        recomputation saves again (NOTE [executing a plan])."""
        group = self.group_of.get(node_name) if node_name else None
        if group in self.unreached:
            self.unreached_saves += self.pending
        for saved in self.pending:
            storage = saved.tensor.untyped_storage()
            entry = self.storage_group.get(id(storage))
            g, storage_rank = entry[1:] if entry and entry[0]() is storage else (-1, -1)
            t = saved.tensor
            if g in self.discarded or g in self.swap.groups:
                saved.group, saved.geometry = g, (storage_rank, t.size(), t.stride(), t.storage_offset(), t.dtype)
                if g in self.swap.groups:
                    saved.swapped = self.swap.copy_out(g, storage)
                    saved.swapped.tokens += 1
                    saved.tensor = None
                    continue
            elif g == -1 and group in self.discarded and id(storage) not in self.static and storage.nbytes():
                saved.group, saved.extra = group, (node_name, saved.rank)
                self.extra_nodes.add(node_name)
                self.extra_keys.add(saved.extra)
            else:
                continue
            saved.tensor = None
            self.tokens_left[saved.group] = self.tokens_left.get(saved.group, 0) + 1
            if saved.extra is None:
                self.value_tokens[saved.group] = self.value_tokens.get(saved.group, 0) + 1
        self.pending.clear()

    def unpack(self, saved: _Saved | torch.Tensor) -> torch.Tensor:
        if type(saved) is not _Saved:
            return saved
        if saved.tensor is not None:
            return saved.tensor
        if saved.swapped is None and saved.group < 0:
            raise RuntimeError("a backward reads what a layer saved that no gradient reached when the model was "
                               "traced: the step's loss uses an output the traced loss left out; trace with the "
                               "loss the step runs (trace(..., loss_fn=...))")
        if saved.swapped is not None:
            return self.swap.swapped_in(saved)
        g = saved.group
        if g not in self.recomputed:
            # marked only under a profiler: the mark costs tens of microseconds even with none running
            with torch.profiler.record_function(RECOMPUTE_EVENT) if torch.autograd._profiler_enabled() \
                    else contextlib.nullcontext():
                self.recompute(g)
        if saved.extra is not None:
            value = self.extras.pop(saved.extra)
        else:
            storage_rank, size, stride, offset, dtype = saved.geometry
            base = self.recomputed[g][storage_rank]
            assert base.dtype == dtype, "executor bug: a token's dtype differs from its recomputed storage's"
            whole = base.size() == size and base.stride() == stride and base.storage_offset() == offset
            value = base if whole else base.as_strided(size, stride, offset)
            self.value_tokens[g] -= 1
            if self.value_tokens[g] == 0:
                self.recomputed[g] = _EXTRAS_ONLY  # the value goes; what its layer saved may still be read
        self.tokens_left[g] -= 1
        if self.tokens_left[g] == 0:
            del self.recomputed[g]
        return value


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


class _Swap:
    """The copies of swapped values to host memory and back (NOTE [swapping])."""

    def __init__(self, graph, plan: Plan):
        self.groups = set(members(plan.swapped))
        self.fetch_at: dict[int, list[int]] = {}  # trigger node (-1: end of forward) -> swapped groups
        for g, trigger in plan.prefetch:
            self.fetch_at.setdefault(trigger, []).append(g)
        self.streams = _SwapStreams(sum(graph.mem_bytes[g] + _ALIGN for g in self.groups))
        self.host_copies: dict[int, tuple[weakref.ref, _HostCopy]] = {}  # storage id -> copy
        self.swapped_groups: dict[int, list[_HostCopy]] = {}  # swapped group -> its copies
        self.fetch_triggers: dict[int, object] = {}  # prefetch trigger group -> its grad_fn

    def note_value(self, g: int, value) -> None:
        """A value the forward made: where it triggers a prefetch, the ``grad_fn`` that starts it. The
        backward of a value starts at its last writer's grad_fn, not at a view's: a view taken last (U-Net's
        crop) runs its backward as soon as its reader's has, long before the value's."""
        if g in self.fetch_at and (first := _first_tensor(value))._base is None:
            self.fetch_triggers[g] = first.grad_fn

    def start_backward(self) -> None:
        """At the forward's end: each trigger's pre-hook, and the copies back that start at once."""
        for g, grad_fn in self.fetch_triggers.items():
            if grad_fn is not None:  # else the tokens fetch when unpacked
                grad_fn.register_prehook(lambda grad_outputs, g=g: self.fetch(self.fetch_at[g]))
        self.fetch(self.fetch_at.get(-1, ()))

    def copy_out(self, g: int, storage: torch.UntypedStorage) -> _HostCopy:
        entry = self.host_copies.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return entry[1]
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        with on_host():
            host = self.streams.host_buffer(whole)
        copy = _HostCopy(host=host, device=storage.device)
        copy.copied_out = self.streams.copy(host, whole, outwards=True)
        self.host_copies[id(storage)] = (weakref.ref(storage), copy)
        self.swapped_groups.setdefault(g, []).append(copy)
        return copy

    def fetch(self, groups):
        for g in groups:
            for copy in self.swapped_groups.get(g, ()):
                if copy.fetched is None and copy.tokens:
                    copy.fetched = torch.empty_like(copy.host, device=copy.device)
                    copy.copied_in = self.streams.copy(copy.fetched, copy.host, outwards=False,
                                                       after=copy.copied_out)

    def swapped_in(self, saved: _Saved) -> torch.Tensor:
        copy = saved.swapped
        if copy.fetched is None:  # before its prefetch (or its trigger has no grad_fn): a stall
            self.fetch([saved.group])
        self.streams.wait(copy.copied_in)
        _, size, stride, offset, dtype = saved.geometry
        value = copy.fetched.view(dtype).as_strided(size, stride, offset)
        copy.tokens -= 1
        if copy.tokens == 0:
            copy.fetched = None
        return value


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


_EXTRAS_ONLY = object()  # a recomputed group whose value no token reads any more (its extras may be)


class _Fresh(torch.autograd.Function):
    """The identity, as a non-leaf that shares its input's storage and is no view: in-place ops may write
    to it (NOTE [replaying side effects])."""

    @staticmethod
    def forward(ctx, x):
        return x.data  # a new tensor on the same storage, as ``detach`` makes, without an op

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SwapStreams:
    """Where swap's copies run: on CUDA two side streams and one pinned pool; elsewhere at once."""

    def __init__(self, host_bytes: int):
        self.host_bytes = host_bytes
        self.cuda = False
        self.used = 0

    def host_buffer(self, whole: torch.Tensor) -> torch.Tensor:
        if whole.device.type != "cuda":
            return torch.empty(whole.numel(), dtype=torch.uint8, device=whole.device)
        if not self.cuda:
            self.cuda = True
            self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()
            self.pool = _pinned_pool(self.host_bytes)
        size = -(-whole.numel() // _ALIGN) * _ALIGN
        if self.used + size > self.pool.numel():  # more than the plan counted: a buffer of its own
            return torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True)
        self.used += size
        return self.pool[self.used - size:self.used - size + whole.numel()]

    def copy(self, destination: torch.Tensor, source: torch.Tensor, outwards: bool, after=None):
        """``destination.copy_(source)``; on CUDA on a side stream, returning its event."""
        if not self.cuda:
            destination.copy_(source)
            return None
        stream = self.out_stream if outwards else self.in_stream
        stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            destination.copy_(source, non_blocking=True)
        (source if outwards else destination).record_stream(stream)
        return stream.record_event()

    def wait(self, event):
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


_ALIGN = 512  # pool slices start where the CUDA allocator would start blocks
_PINNED: dict[str, torch.Tensor] = {}  # the pool outlives a step: pinning host memory is slow and synchronizes


def _pinned_pool(size: int) -> torch.Tensor:
    """A pinned host buffer of at least ``size`` bytes, made once and grown when a plan needs more."""
    pool = _PINNED.get("pool")
    if pool is None or pool.numel() < size:
        _PINNED["pool"] = pool = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return pool


def _layout(traced: Traced, plan: Plan) -> SimpleNamespace:
    """What a step under ``plan`` needs that depends only on the trace and the plan (NOTE [what a call needs,
    found once]): the order of the forward's calls, each stage's recomputed calls, the kept values a
    recomputation reads and for which stages, and each recomputation's schedule once it has run
    (``recomputations``). Made at the plan's first step and kept with the trace."""
    key = (plan.stages, plan.kept, plan.swapped, plan.prefetch, plan.checkpointed)
    if key in traced.layouts:
        return traced.layouts[key]
    plan.validate(traced.graph)
    graph = traced.graph
    discarded = set(members(plan.recomputed))
    stage_of = plan.stage_of(len(graph))
    order = _stage_order(traced, plan, stage_of)  # the forward's, and each recomputation's within its stage
    stage_nodes: dict[int, list[fx.Node]] = {}  # stage -> its discarded values' fx nodes, in that order
    for node in order:
        g = traced.group_of.get(node.name)
        if g in discarded:
            stage_nodes.setdefault(stage_of[g], []).append(node)
    # A kept value is held only for the stages that will be recomputed, as the replay holds it: a stage
    # whose values no backward reads (a pixel shuffle's) would keep its input through the forward pass.
    # An output's stage is held to the end of the forward pass, where the loss's saves tell (the loss
    # may not be the one traced; the replay's ``to_loss``).
    held_for = called_for(graph, plan) | {stage_of[v] for v in graph.outputs}
    cached_names: dict[int, set[str]] = {}  # kept group -> its fx nodes that recomputation reads
    cache_stages: dict[int, set[int]] = {}  # kept group -> stages that read it
    nodes = {n.name: n for n in traced.module.graph.nodes}
    for name in (n for g in discarded for n in traced.members[g]):
        if stage_of[traced.group_of[name]] not in held_for:
            continue
        for source in nodes[name].all_input_nodes:
            g = traced.group_of.get(source.name)
            if g is not None and g not in discarded:
                cached_names.setdefault(g, set()).add(source.name)
                cache_stages.setdefault(g, set()).add(stage_of[traced.group_of[name]])
    stage_reads: dict[int, list[int]] = {}  # stage -> the kept groups its recomputation reads
    for g, stages in cache_stages.items():
        for stage in stages:
            stage_reads.setdefault(stage, []).append(g)
    remade = discarded - set(members(graph.never_recomputed()))  # its RNG and state are kept for it
    # The calls whose saves the hooks must see (NOTE [executing a plan]): those of a value the plan recomputes
    # or swaps, or that no gradient reaches, and those that read a value it recomputes or swaps.
    watched = discarded | set(members(plan.swapped))
    own_watched = watched | set(graph.unreached)
    hooked = [traced.group_of.get(node.name) in own_watched
              or any(traced.group_of.get(source.name) in watched for source in node.all_input_nodes)
              for node in order]
    layout = SimpleNamespace(
        discarded=discarded, stage_of=stage_of, order=order, stage_nodes=stage_nodes, held_for=held_for,
        cached_names=cached_names, cache_stages=cache_stages, stage_reads=stage_reads, forward_frees=_frees(order),
        arguments=[(node.args, node.kwargs) for node in order],
        stage_discarded={s: members(stage & ~plan.kept) for s, stage in enumerate(plan.stages)},
        hooked=hooked, unreached=set(graph.unreached),
        recomputable={name for g in remade for name in traced.members[g]}, recomputations={})
    traced.layouts[key] = layout
    return layout


def _recomputation(traced: Traced, plan: Plan, stage_nodes: dict[int, list[fx.Node]], stage: int, wanted: int,
                   read: int) -> SimpleNamespace:
    """How stage ``stage`` is recomputed when the tokens still to be unpacked are of the groups ``wanted``, and
    of their values for the groups ``read`` (bitsets): the calls it reruns in order, with each one's IR node and
    the values to let go of once it has run (those tokens read stay to the stage's end), and the calls not
    rerun."""
    discarded = plan.stages[stage] & ~plan.kept
    made = traced.graph.with_inputs_within(wanted, discarded)
    groups = members(made)
    names = {name for g in groups for name in traced.members[g]}
    order = [n for n in stage_nodes[stage] if n.name in names]
    # The values tokens will read stay to the end of the stage; any other goes after its last use there,
    # as the simulator frees it (a value no backward reads: a downsampling branch read by an addition).
    finals = {traced.members[g][-1] for g in members(read)}
    return SimpleNamespace(order=order, names=frozenset(n.name for n in order), groups=groups,
                           arguments=[(n.args, n.kwargs) for n in order],
                           node_groups=[traced.group_of[n.name] for n in order],
                           frees=_frees(order, finals),
                           not_rerun=tuple(name for g in members(discarded & ~made) for name in traced.members[g]))


def _stage_order(traced: Traced, plan: Plan, stage_of: list[int]) -> list[fx.Node]:
    """The fx nodes stage by stage, in the order ``stage_keys`` gives them."""
    keys = stage_keys(traced, plan, stage_of)
    return sorted(keys, key=keys.get)


def stage_keys(traced: Traced, plan: Plan, stage_of: list[int]) -> dict[fx.Node, tuple]:
    """Each fx node's place, ``((stage, index), position)``, in the order the executor runs the forward:
    stage by stage (V_1 first), in program order within a stage: a topological order in
    which autograd's backward, which runs in reverse creation order, visits the stages one at a time
    from the last, as the canonical strategy does. A node never comes before its inputs; nodes outside
    the IR go with their latest input; a node that draws random numbers never before an earlier one
    that draws (it goes with the later stage), so every draw sees plain PyTorch's generator state, and
    one that can reach a buffer never before an earlier one that can reach it: a BatchNorm called on
    two views (a Siamese encoder's) updates its running statistics in the program's order.
    A layer call that an in-place write of its IR node follows runs just before that write
    (``_delayed``), so that an IR node's autograd nodes are made together, as the replay runs them."""
    nodes = list(traced.module.graph.nodes)
    delayed = _delayed(nodes, traced)
    read_before: dict[str, list[str]] = {}  # a write to a buffer -> the nodes that read it before
    for reader, writer in traced.state_order:
        read_before.setdefault(writer, []).append(reader)
    by_name = {node.name: node for node in nodes}
    key, position = {}, {}
    last_use: dict[str, tuple[int, int]] = {}  # Traced.shared_state's names -> the last key to use it
    for index, node in enumerate(nodes):
        position[node] = index
        g = traced.group_of.get(node.name)
        inputs = [key[n] for n in node.all_input_nodes]
        if node.op == "output":
            own = (len(plan.stages), index)
        elif g is not None:
            own = (stage_of[g], delayed.get(node.name, index))
        else:
            own = (max((stage for stage, _ in inputs), default=-1), index)
        # A view can read a shape computed in a later stage (U-Net's crops): then it waits for it; a
        # write to a buffer waits for the nodes that read it before (NOTE [state the forward writes]).
        key[node] = max([own] + inputs + [key[by_name[r]] for r in read_before.get(node.name, ())])
        shared = traced.shared_state.get(node.name, ())  # in program order: the same numbers and
        key[node] = max([key[node]] + [last_use[name] for name in shared if name in last_use])  # statistics
        last_use.update(dict.fromkeys(shared, key[node]))
    return {node: (key[node], position[node]) for node in nodes}


def _delayed(nodes: list[fx.Node], traced: Traced) -> dict[str, int]:
    """For each member of an IR node that an in-place write of the same IR node follows, the position of
    the first such write: the member runs just before it. torchvision's bottleneck computes ``bn3(conv3)``,
    then its downsampling branch, then ``out += identity``; run in that order, autograd would make the
    branch's nodes between the batch norm's and the addition's, and run the branch's backward in the middle
    of the IR node's (NOTE [augmented assignments] in ``harness/tracer.py``)."""
    delayed, next_write = {}, {}
    for index in reversed(range(len(nodes))):
        name = nodes[index].name
        g = traced.group_of.get(name)
        if g is not None:
            if name in traced.written_in_place:
                next_write[g] = index
            delayed[name] = next_write.get(g, index)
    return delayed


def _frees(order: list[fx.Node], keep=frozenset()) -> list[tuple[str, ...]]:
    """For each node of ``order``, the values to let go of once it has run: those it is the last of ``order`` to
    read, and its own where none reads it; ``keep`` aside."""
    last: dict[str, int] = {}
    for index, node in enumerate(order):
        last[node.name] = index
        for source in node.all_input_nodes:
            last[source.name] = index
    frees: list[list[str]] = [[] for _ in order]
    for name, index in last.items():
        if name not in keep:
            frees[index].append(name)
    return [tuple(names) for names in frees]


def _ranked(tensors: list[torch.Tensor], ranks: dict[int, int]) -> dict[int, torch.Tensor]:
    """The storages of a value's ``tensors`` that ``ranks`` had not seen, by id, each with a tensor on it; each
    is given the next rank, so a value's storages are ranked alike in its forward call and its recomputation."""
    new = {}
    for t in tensors:
        sid = id(t.untyped_storage())
        if sid not in ranks:
            ranks[sid] = len(ranks)
            new[sid] = t
    return new


def _first_tensor(value) -> torch.Tensor:
    return tensors_of((value,))[0]


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
