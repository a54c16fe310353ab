"""The probe: the traced program run on meta tensors, its fx nodes grouped into IR nodes by the storage they make.

NOTE [nodes are storages]
fx gives one node per layer call (torch.nn modules stay leaves: convolution, normalisation, activation,
pooling, linear; functions such as add, cat, interpolate and flatten are nodes of their own). An IR node
is a *value*, and in PyTorch a value is a storage: an in-place layer (``ReLU(inplace=True)``, ``out +=
identity``) or a view (``flatten``, slicing) writes or reads its input's storage and allocates nothing. So
fx nodes are grouped by the storage they produce: a node that allocates a new storage starts an IR node;
one that only aliases an existing storage joins that storage's IR node. IR nodes are ordered by their
last member (the moment the value is final), which keeps the order topological when a later in-place
member writes in place reading another value (``out += identity``); a view does not move it. Nodes that produce no
tensor (``x.size(0)``) and views of inputs or parameters stay out of the IR: they cost nothing to keep.

While the meta run goes, ``saved_tensors_hooks`` record what autograd saves for each layer: saved
storages that belong to an IR node become ``backward_reads``; any other saved storage (max-pooling
indices, batch-norm statistics, the input an in-place op saves before it writes) counts as
``saved_extra_bytes``, once however many views of it are saved (an LSTM saves each step's gates as views
of one storage).

The probe also notes the state each fx node uses (``shared_state``): the generators, if it draws random
numbers (from ATen's op tags), and the buffers it can reach. The executor may run the forward pass in
another topological order than the program's, but never uses the same state in another order.

An in-place write to a value that a node of *another* IR node has already read (``y = x + 1;
x.relu_()``) is refused: a recomputation of ``y`` would read the written ``x``, and one IR node per
storage cannot hold both versions. The error names the module and the two calls.

NOTE [tensors a module keeps]
The pre-hook forms of ``spectral_norm`` and ``weight_norm`` compute the layer's weight before each call
and keep it as a plain attribute of the module (``module.weight``) until the next call replaces it.
The layer saves that weight for its backward, but dropping the saved tensor frees nothing: the module
holds it to the step's end whatever the plan, and a recomputation makes another while the first is
still there. So what a layer saves that a module keeps as an attribute after the forward is not a
saved extra but ``Profile.attribute_bytes``, made by the layer's first call and held to the end; each
recomputation's pre-hook makes a second one, which replaces the first before the layer runs. Counted as
a saved extra, which a plan that recomputes the layer drops, such a discriminator's plans were predicted
2-3% low. A layer that does not save it (a product whose input takes no gradient saves no weight) leaves
it on the module all the same: the probe notes every tensor a module call leaves as an attribute, saved
or not, and only what the layer saves (``Profile.attribute_saved``) calls for its recomputation.

NOTE [parameter gradients]
A parameter's gradient is made once, by the first backward in the step that reaches it, and stays to the
step's end; the autograd engine sums what later readers' backwards hand it into that buffer. So the probe
notes, by storage, which IR nodes read each parameter that takes a gradient: through its module's call,
or as an input, directly or through a view (a bare ``nn.Parameter`` such as a class token, a layer
scale, a LoRA factor; a tied embedding's ``weight.t()``). Its bytes count once (``Profile.param_bytes``),
at its last reader in the forward order, and its other readers are that node's ``param_sharers``: the
replay makes the gradient at whichever of them its backward reaches first. Counted per module call, a
block applied four times had its gradients counted four times (+48% on its step's peak, a Siamese
encoder's twice, +21%); counted for modules only, a bare parameter's gradient was left out (-1% on a
LoRA model under ``chen_sqrt``, whose low-rank factors are bare parameters).
Only a backward that runs makes gradients: a parameter that only unreached layers read (NOTE [what no
gradient reaches] in ``harness/tracing/backward_profile.py``) gets none and is not counted. A gradient holds what its
storage holds, seen after the plain step on meta: autograd keeps the gradient it is handed where it can, and a slice
of a larger one (a ``torch.cat`` of a query bias, a zero key bias and a value bias, as EVA's attention builds its bias)
keeps that whole gradient alive to the step's end, shared by the parameters it was cut for. Counted at
their sizes, an EVA-02's plans were predicted 768 bytes per block low.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from harness.tracing.state import grad_mode, written_state
from strategies import Graph
from harness.tracing.cost_models import layer_cost
from harness.tracing.traced import TraceFailure, Traced, describe, scope_of, target_of
from harness.tracing.tracer import AUGMENTED, Draws


class CopyFirst(Exception):
    """The probe's word that in-place write ``write`` is to write a copy of the value ``holders`` hold
    (NOTE [a write after a read] in ``harness/tracing/trace.py``); ``via_write``: the write returns the tensor it
    wrote."""

    def __init__(self, write: str, holders: list[str], via_write: bool):
        super().__init__(f"write {write} is to write a copy")
        self.write, self.holders, self.via_write = write, holders, via_write


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def nodes_after(node: fx.Node):
    """The nodes of ``node``'s graph that come after it, in order."""
    while (node := node.next).op != "root":
        yield node


def non_leaf_attributes(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors autograd made that a module keeps as plain attributes (the pre-hook forms of
    ``spectral_norm`` and ``weight_norm`` keep the weight of their last forward): ``copy.deepcopy`` refuses
    them, so a copy takes them detached (the next forward makes them again)."""
    return [value for m in module.modules() for value in vars(m).values()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]


def new_autograd_nodes(outputs, known: dict) -> list:
    """The autograd nodes a layer call made: those its outputs reach that are not ``known`` (an earlier
    call's), parameters' accumulators aside."""
    found, stack = [], [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in known or fn in found or fn.name() == "torch::autograd::AccumulateGrad":
            continue
        found.append(fn)
        stack += [f for f, _ in fn.next_functions if f is not None]
    return found


class Probe(fx.Interpreter):
    """Runs the fx module on meta tensors and groups its nodes into IR nodes."""

    def __init__(self, gm: fx.GraphModule, cost_model: str):
        super().__init__(gm)
        self.cost_model = cost_model
        self.static = {id(storage_of(t)) for t in list(gm.parameters()) + list(gm.buffers())}
        self.trainable: dict[int, int] = {}  # storage of parameters that take gradients -> their gradients' bytes
        for p in gm.parameters():
            if p.requires_grad:
                key = id(storage_of(p))
                self.trainable[key] = self.trainable.get(key, 0) + p.numel() * p.element_size()
        self.buffer_ids = {id(b) for b in gm.buffers()}
        self.buffer_names = {id(b): name for name, b in gm.named_buffers()}
        self.shared_state: dict[str, frozenset[str]] = {}  # Traced.shared_state
        self.buffer_of_storage = {id(storage_of(b)): (name, b) for name, b in gm.named_buffers()}
        self.static_names = {id(storage_of(t)): f"{kind} {name!r}" for kind, named in
                             (("parameter", gm.named_parameters()), ("buffer", gm.named_buffers()))
                             for name, t in named}
        self.group_of_storage: dict[int, tuple[weakref.ref, int]] = {}
        self.groups: list[dict] = []  # each: members, bytes, cost, reads, extra, params, kind
        self.group_of: dict[str, int] = {}
        self.fx_count = 0
        self.readers: dict[int, dict[int, fx.Node]] = {}  # IR node -> {IR node reading it: first reading fx node}
        self._keep_alive = []  # meta tensors are free; holding them keeps storage ids unique
        self.autograd_group: dict[object, int] = {}  # autograd node -> the IR node whose layer made it
        self.view_nodes: set[object] = set()  # autograd nodes of views of an IR node's storage
        self.view_names: set[str] = set()  # the fx nodes that are such views
        self.in_place_nodes: set[object] = set()  # autograd nodes of in-place writes (a ReLU's, ``+=``'s)
        self.in_place_names: set[str] = set()  # the fx nodes that make those writes
        self.out_of_place: set[str] = set()  # augmented assignments that cannot write in place
        self.returned: dict[str, int] = {}  # fx node -> id of the tensor it returned (alive: ``_keep_alive``)
        self.state_readers: dict[int, list[fx.Node]] = {}  # static storage -> the IR node members that read it
        self.state_after: dict[int, set[int]] = {}  # static storage -> the IR nodes its last write follows
        self.state_writers: set[str] = set()
        self.state_order: set[tuple[str, str]] = set()  # (reader, writer) of a buffer
        self.written_buffers: dict[int, str] = {}  # storage -> name of a buffer a node of its own writes
        self.node_inputs: dict[str, list[torch.Tensor]] = {}  # fx node -> its input tensors, for ``_state_bytes``
        self.kept_by_modules: set[int] = set()  # storages of what modules keep as attributes after the run

    def _group(self, storage) -> int | None:
        entry = self.group_of_storage.get(id(storage))
        return entry[1] if entry and entry[0]() is storage else None

    def run_node(self, node: fx.Node):
        if node.op in ("placeholder", "get_attr", "output"):
            result = super().run_node(node)
            if node.op == "placeholder":
                self.static.update(id(storage_of(t)) for t in tree_leaves(result) if isinstance(t, torch.Tensor))
            return result
        self.fx_count += 1
        if node.target in AUGMENTED and not self._may_write(node.args[0]):
            node.target = AUGMENTED[node.target]
            self.out_of_place.add(node.name)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        inputs = [t for t in tree_leaves(self._inputs(node)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        draws = Draws()  # its FLOPs: for cost_model=flops, and every graph's ``flops``
        self.node_inputs[node.name] = inputs  # which buffers a later node writes is known at the end
        called = self.module.get_submodule(node.target) if node.op == "call_module" else None
        attributes_before = {id(storage_of(t)) for t in non_leaf_attributes(called)} if called is not None else set()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), draws, grad_mode(node):
            try:
                result = super().run_node(node)
            except (RuntimeError, NotImplementedError) as error:
                if "meta tensor" not in str(error):
                    raise
                raise TraceFailure(
                    f"{describe(node, self.module)} reads a tensor's value in Python (.item(), float(), int(), "
                    ".tolist()); the trace sizes every value on meta, which holds none (a BatchNorm with "
                    "momentum=None divides by its num_batches_tracked: give it a momentum); keep such a value a "
                    "tensor") from error
        reached = [*inputs, *(called.buffers() if called is not None else ())]
        state = {self.buffer_names[id(t)] for t in reached if id(t) in self.buffer_names} | (
            {"generators"} if draws.seen else set())
        if state:
            self.shared_state[node.name] = frozenset(state)
        written = [t for t, v in zip(inputs, versions) if t._version != v and id(storage_of(t)) not in self.static]
        self._record(node, result, saved, draws.flops, written)
        if called is not None and (g := self.group_of.get(node.name)) is not None:  # NOTE [tensors a module keeps]
            made = [t for t in non_leaf_attributes(called)
                    if id(storage_of(t)) not in attributes_before and self._group(storage_of(t)) is None]
            self.groups[g]["made_attributes"].update((id(storage_of(t)), storage_of(t).nbytes()) for t in made)
            self._keep_alive += made
        self._note_params(node, inputs)
        self._note_state(node, inputs, versions)
        return result

    def _note_state(self, node: fx.Node, inputs: list[torch.Tensor], versions: list[int]):
        """Note which IR nodes read an input, parameter or buffer, and refuse a write to an input or a
        parameter after another IR node read it; a write to a buffer follows the IR nodes that read it
        before, and those that read it after a write follow the write's inputs and those readers (NOTE
        [state the forward writes])."""
        g = self.group_of.get(node.name)
        for t, version in zip(inputs, versions):
            key = id(storage_of(t))
            if key not in self.static:
                continue
            if t._version != version:
                readers = [r for r in self.state_readers.get(key, []) if r is not node]
                if readers and key not in self.buffer_of_storage:
                    raise TraceFailure(
                        f"in-place write {describe(node, self.module)} changes "
                        f"{self.static_names.get(key, 'an input')} "
                        f"after {describe(readers[0], self.module)} read it; a recomputation of that reader would see "
                        "the new value. Write out of place, or before any layer reads it")
                before = {self.group_of[r.name] for r in readers}
                self.state_order.update((r.name, node.name) for r in readers)
                if g is not None:
                    self.groups[g]["after"] |= before - {g}
                inputs_of_write = {h for n in node.all_input_nodes if (h := self.group_of.get(n.name)) is not None}
                self.state_after[key] = inputs_of_write | before
                self.state_writers.add(node.name)
                if key in self.buffer_of_storage:
                    self.written_buffers[key] = self.buffer_of_storage[key][0]
            elif g is not None:
                self.state_readers.setdefault(key, []).append(node)
                self.groups[g]["after"] |= self.state_after.get(key, set())

    def _note_params(self, node: fx.Node, inputs: list[torch.Tensor]):
        """Note the trainable parameters an IR node's member reads: its module's, for a module call, and any
        among its inputs, directly or through a view (a bare ``nn.Parameter``, ``self.cls_token.expand(...)``,
        a tied embedding's ``weight.t()``) (NOTE [parameter gradients])."""
        g = self.group_of.get(node.name)
        if g is None:
            return
        read = [*inputs, *(self.module.get_submodule(node.target).parameters() if node.op == "call_module" else ())]
        self.groups[g]["params"].update(key for t in read if (key := id(storage_of(t))) in self.trainable)

    def _may_write(self, target) -> bool:
        """Whether an augmented assignment may write ``target`` in place (NOTE [augmented assignments] in
        ``harness/tracing/tracer.py``): it is an IR node's value that no other IR node has read yet."""
        value = self.env.get(target) if isinstance(target, fx.Node) else target
        if not isinstance(value, torch.Tensor):
            return True  # a Python number: the operator is out of place anyway
        g = self._group(storage_of(value))
        return g is not None and all(h == g for h in self.readers.get(g, {}))

    def _copy_first(self, node: fx.Node, written: list[torch.Tensor], result, g: int, reader: fx.Node):
        """``node`` wrote the value of IR node ``g`` in place after ``reader`` read it: raise ``CopyFirst``
        for the trace to make it write a copy (NOTE [a write after a read] in ``harness/tracing/trace.py``), or
        refuse where a later call would read the value as a tensor the copy does not replace."""
        def refuse(why: str):
            raise TraceFailure(
                f"in-place write {describe(node, self.module)} changes the value of "
                f"{describe(self.groups[g]['members'][0], self.module)} after {describe(reader, self.module)} "
                f"read it, and {why}, so it cannot write a copy instead. Write out of place (e.g. relu instead "
                "of relu_, inplace=False; for x[i] = y, torch.where or x.index_put)")

        target = written[0]
        if any(t is not target for t in written):
            refuse("it writes several tensors")
        holders = {n for n, value in self.env.items() if value is target}  # the value as the tensor written
        if not holders & set(node.all_input_nodes):
            refuse("it writes a tensor no call returned as such (a part of a tuple or list)")
        aliases = {n for n, value in self.env.items() if n not in holders and any(
            isinstance(t, torch.Tensor) and self._group(storage_of(t)) == g for t in tree_leaves(value))}
        for later in nodes_after(node):
            if seen := next((n for n in later.all_input_nodes if n in aliases), None):
                refuse(f"{describe(later, self.module)} reads it after the write through {seen.name}, a view "
                       "of it (or a tuple holding one) made before")
        raise CopyFirst(node.name, sorted(n.name for n in holders), result is target)

    def _inputs(self, node: fx.Node):
        return [self.env[n] for n in node.all_input_nodes if n in self.env]

    def _record(self, node: fx.Node, result, saved, flop_count, written: list[torch.Tensor]):
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        self._keep_alive += outputs
        if isinstance(result, torch.Tensor):
            self.returned[node.name] = id(result)
        new = {}
        for t in outputs:
            s = storage_of(t)
            if id(s) not in self.static and self._group(s) is None:
                new[id(s)] = s
        aliased = [self._group(storage_of(t)) for t in outputs if self._group(storage_of(t)) is not None]
        # The model's output may gather several values (a dataclass of them is a node of its own); a call a
        # later layer reads may not.
        if len(set(aliased)) + bool(new) > 1 and any(user.op != "output" for user in node.users):
            raise TraceFailure(
                f"{describe(node, self.module)} returns (views of) the values of "
                f"{' and '.join(describe(self.groups[h]['members'][0], self.module) for h in dict.fromkeys(aliased))}"
                f"{' beside a new one' if new else ''}; an IR node is one value (NOTE [nodes are storages]), and "
                "a plan that recomputes one of them could not tell which. Take each view in a call of its own "
                "(a.expand(shape) and b.expand(shape) for torch.broadcast_tensors or torch.meshgrid)")
        if new:
            g = len(self.groups)
            self.groups.append(dict(members=[], final=node, bytes=sum(s.nbytes() for s in new.values()), cost=0.0,
                                    flops=0, reads=set(), extra={}, made_attributes={}, params=set(), after=set(),
                                    kind=layer_kind(node, self.module), saved_since_read=set()))
            for s in new.values():
                self.group_of_storage[id(s)] = (weakref.ref(s), g)
        elif aliased:
            g = aliased[0]
        else:
            return  # no tensor, or a view of an input or parameter: not an IR node
        group = self.groups[g]
        group["members"].append(node)
        view = not new and not written
        if view:
            self.view_names.add(node.name)
        self._claim(outputs, g, view, bool(written))
        if written:
            group["final"] = node
            self.in_place_names.add(node.name)
            others = [reader for h, reader in self.readers.get(g, {}).items() if h != g]
            if others:
                self._copy_first(node, written, result, g, others[0])
        read = {h for source in node.all_input_nodes if (h := self.group_of.get(source.name)) is not None}
        for h in read:
            self.readers.setdefault(h, {}).setdefault(g, node)
        group["cost"] += layer_cost(node, self.module, self.cost_model, flop_count)
        group["flops"] += flop_count
        self.group_of[node.name] = g
        extras = {}  # a storage saved as several views (an LSTM's gates, step by step) is held once
        for t in saved:
            owner = self._group(storage_of(t))
            if owner is not None:
                group["reads"].add(owner)
            elif id(storage_of(t)) not in self.static:
                extras[id(storage_of(t))] = storage_of(t).nbytes()
        group["extra"].update(extras)
        if read - {g}:
            group["saved_since_read"] = set()  # for Profile.extras_after_reads: saved while it reads, not after
        else:
            group["saved_since_read"].update(extras)
        self._keep_alive += saved

    def _claim(self, outputs, g: int, view: bool, in_place: bool):
        """Note the autograd nodes this layer call made, those of a view of the IR node's storage (U-Net's
        crop), whose backward may build a gradient of the whole storage out of the one it is handed, and
        those of an in-place write, whose backward runs before the rest of the layer's."""
        for fn in new_autograd_nodes(outputs, self.autograd_group):
            self.autograd_group[fn] = g
            if view:
                self.view_nodes.add(fn)
            if in_place:
                self.in_place_nodes.add(fn)

    def result(self, gm: fx.GraphModule, shares: dict | None = None, work: dict | None = None,
               peaks: dict | None = None, early: dict | None = None, frees: dict | None = None,
               transients: dict | None = None, unpacks: dict | None = None, ran: set[int] | None = None,
               handed: set[tuple[int, int]] | None = None) -> Traced:
        # The probe may run a meta copy of gm: match nodes by name.
        position = {node.name: i for i, node in enumerate(gm.graph.nodes)}
        order = sorted(range(len(self.groups)), key=lambda g: position[self.groups[g]["final"].name])
        rank = {g: i for i, g in enumerate(order)}
        edges = set()
        for g, group in enumerate(self.groups):
            for node in group["members"]:
                for source in node.all_input_nodes:
                    h = self.group_of.get(source.name)
                    if h is not None and h != g:
                        edges.add((rank[h], rank[g]))
            edges.update((rank[h], rank[g]) for h in group["after"] if h != g)  # NOTE [state the forward writes]
        groups = [self.groups[g] for g in order]
        param_bytes, sharers = [0] * len(groups), [set() for _ in groups]  # NOTE [parameter gradients]
        readers_of: dict[int, set[int]] = {}
        reached = set(range(len(self.groups))) if ran is None else ran  # NOTE [what no gradient reaches]
        for g, group in enumerate(self.groups):
            for key in group["params"] if g in reached else ():
                readers_of.setdefault(key, set()).add(rank[g])
        for key, readers in readers_of.items():
            owner = max(readers)
            param_bytes[owner] += self.trainable[key]
            sharers[owner] |= readers - {owner}
        written = {key: self.buffer_of_storage[key][1] for key in self.written_buffers}
        without_grad = [[] for _ in groups]  # what a backward that ran handed no gradient (Profile.preds_without_grad)
        for u, v in edges if ran is not None and handed is not None else ():
            if order[v] in reached and (order[v], order[u]) not in handed:
                without_grad[v].append(u)
        graph = Graph(
            mem_bytes=[g["bytes"] for g in groups],
            cost=[g["cost"] for g in groups],
            edges=sorted(edges),
            names=[g["final"].name for g in groups],
            kinds=[g["kind"] for g in groups],
            backward_reads=[sorted(rank[h] for h in g["reads"]) for g in groups],
            saved_extra_bytes=[sum(b for key, b in g["extra"].items() if key not in self.kept_by_modules)
                               for g in groups],
            attribute_bytes=[sum(b for key, b in {**g["made_attributes"], **g["extra"]}.items()
                                 if key in self.kept_by_modules) for g in groups],
            attribute_saved=[any(key in self.kept_by_modules for key in g["extra"]) for g in groups],
            extras_after_reads=[bool(saved := set(g["extra"]) - self.kept_by_modules) and saved <= g["saved_since_read"]
                                for g in groups],
            param_bytes=param_bytes, param_sharers=[sorted(s) for s in sharers],
            scopes=[scope_of(g["final"]) for g in groups],
            flops=[g["flops"] for g in groups],
            grad_shares=[[(kept, size) for preds, size in (shares or {}).get(g, [])
                          if (kept := sorted(rank[h] for h in preds if (rank[h], rank[g]) in edges))] for g in order],
            backward_work_bytes=[(work or {}).get(g, 0) for g in order],
            recompute_state_bytes=[self._state_bytes(g, written) for g in groups],
            backward_peak_bytes=None if peaks is None else [peaks.get(g, 0) for g in order],
            backward_frees=None if frees is None else [
                (sorted(rank[h] for h in freed if h in rank), peak)
                for freed, peak in (frees.get(g, (set(), peaks.get(g, 0))) for g in order)],
            forward_transient_bytes=None if transients is None else [transients.get(g, 0) for g in order],
            unpack_held_bytes=None if unpacks is None else [
                [(rank[h], held) for h, held in unpacks.get(g, {}).items() if h in rank] for g in order],
            early_grads=[sorted(rank[h] for h in (early or {}).get(g, ()) if (rank[h], rank[g]) in edges) for g in
            order], unreached=[rank[g] for g in order if g not in reached],
            preds_without_grad=without_grad,
            shared_state=[set().union(*(self.shared_state.get(node.name, ()) for node in g["members"]))
                          for g in groups],
        )
        members = tuple(tuple(node.name for node in g["members"]) for g in groups)
        group_of = {name: i for i, names in enumerate(members) for name in names}
        same_tensor = {node.name: rank[g] for g, group in enumerate(self.groups)
                       for node in group["members"][:group["members"].index(group["final"])]
                       if self.returned.get(node.name, -1) == self.returned.get(group["final"].name)}
        return Traced(module=gm, graph=graph, members=members, group_of=group_of, fx_node_count=self.fx_count,
                      written_in_place=frozenset(self.in_place_names), same_tensor=same_tensor,
                      writes_state=frozenset(self.state_writers), state_order=frozenset(self.state_order),
                      written_buffers=frozenset(self.written_buffers.values()), shared_state=dict(self.shared_state))

    def _state_bytes(self, group: dict, written: dict[int, torch.Tensor]) -> int:
        """The copies of the state a recomputation of ``group`` starts from, one per call, held from the
        forward call to the recomputation (``Profile.recompute_state_bytes``); the buffers among a call's inputs
        are those among its arguments."""
        return sum(t.numel() * t.element_size() for node in group["members"]
                   for t in written_state(self.module, node, self.node_inputs[node.name], {}, self.buffer_ids, written))


_KINDS = [
    ("conv", (torch.nn.modules.conv._ConvNd,), {"conv1d", "conv2d", "conv3d", "conv_transpose2d"}),
    ("norm", (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm),
     {"batch_norm", "layer_norm", "group_norm"}),
    ("act", (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Tanh,
             torch.nn.LeakyReLU, torch.nn.Identity), {"relu", "relu_", "gelu", "silu", "sigmoid", "tanh"}),
    ("pool", (torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
              torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.modules.pooling._AdaptiveMaxPoolNd),
     {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"}),
    ("linear", (torch.nn.Linear,), {"linear"}),
    ("matmul", (), {"matmul"}),
    ("attention", (), {"scaled_dot_product_attention", "attention_on_cpu"}),
    ("multihead_attention", (torch.nn.MultiheadAttention,), set()),
    ("dropout", (torch.nn.modules.dropout._DropoutNd,), {"dropout", "dropout2d"}),
    ("upsample", (torch.nn.Upsample, torch.nn.UpsamplingBilinear2d), {"interpolate", "upsample"}),
    ("add", (), {"add", "iadd", "add_", "sub"}),
    ("mul", (), {"mul", "imul", "mul_"}),
    ("cat", (), {"cat", "concat", "stack"}),
]


def layer_kind(node: fx.Node, module: torch.nn.Module) -> str:
    target = target_of(node, module)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    for kind, types, names in _KINDS:
        if (node.op == "call_module" and isinstance(target, types)) or (node.op != "call_module" and name in names):
            return kind
    return "other"
