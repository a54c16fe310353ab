"""The backward on meta: what each layer's backward holds and hands on, and the loss's part of the step.

NOTE [the loss]
The loss is not in the IR, but what it holds is part of the step, and it depends on the loss, not on the
model. So the trace runs the loss (and its backward) on meta, on the model's outputs, and records:
- which IR nodes the outputs are (``Graph.outputs``): the model returns them, so they stay until the
  loss's forward has read them, wherever they were made;
- what the loss's forward holds at its peak besides them (``loss_forward_bytes``);
- which outputs its backward reads (``loss_reads``), seen by a ``saved_tensors_hooks`` on the loss's
  forward: a squared error saves its input, so the output stays until the loss's backward is done, and
  if a plan discards it, the executor's token makes that backward recompute the output's stage;
- what each output's gradient adds (``loss_grad_bytes``): a sum hands the output an expanded view of
  the backward's seed, which adds nothing, where Kusumoto et al. 2019 counts a gradient the output's size; a view
  of another output's gradient adds nothing either; an output that is part of a value (a class token's
  row, ``x[:, 0]``) hands the value a new gradient of its whole, which the view's backward makes (left
  out, a class-token model's step was predicted 5% low);
- what the backward holds at its peak besides those gradients (``loss_bytes``: a cross entropy's
  log-softmax and its gradient), and what stays to the step's end (``loss_held_bytes``: the loss's value
  and the seed, which ``loss.backward()`` holds until it returns), and what it holds when it first unpacks
  an output (``loss_unpack_bytes``: a mean's backward has made its gradient before a square's unpacks
  its input), on top of which a recomputation of that output's stage runs (left out, 4% low).
Kusumoto et al.'s model, every sink an output handed a gradient its own size and nothing read, missed a small
head's vanilla step by +14% under a sum and by -19% and -31% under squared errors
(``tests/test_accounting.py``).

NOTE [what no gradient reaches]
Not every layer's backward runs. An output the loss leaves out (an auxiliary classifier, torchvision's
``aux`` segmentation head, a pooler beside a language model's logits) gets no gradient, nor does any
layer only it reads; a value made from the input alone (a mask, positions from ``torch.arange``) takes
none either. The trace's backward on meta notes which IR nodes' autograd nodes ran (``gradients``); the
others are ``Profile.unreached``. Their layers make no gradients, and what they saved is let go with the
outputs at the loss's forward, as in plain PyTorch, where their autograd graph dies with the output: the
executor drops their saved tensors there (the hooks' tokens would hold them to the step's end, each
output's own grad_fn in a cycle with it), and the replay frees them there. A value nothing reads (dead
code, a stray ``zeros_like``) goes as soon as it is made. Replayed as if their backward ran (gradients of
an auxiliary head's parameters and of its input, what it saved held into the backward pass), and run with
what it saved held to the step's end, an auxiliary head's step was predicted from 10% low (vanilla) to
15% high (``chen_greedy``; ``tests/test_accounting.py``).
"""

from __future__ import annotations

import gc

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

from harness.measure import DEVICE_PARTS, MemoryTracker
from harness.tracing.probe import Probe, new_autograd_nodes, storage_of
from harness.tracing.state import grad_mode
from harness.tracing.traced import TraceFailure, describe


def gradients(probe: "Probe", output, loss_fn) -> tuple[dict, dict, dict, set[int] | None, set[tuple[int, int]]]:
    """What each IR node's backward hands its predecessors (``Profile.grad_shares``), the gradients it
    works with on the way (``Profile.backward_work_bytes``), the predecessors its in-place members hand a
    gradient (``Profile.early_grads``), the IR nodes whose backward ran at all (NOTE [what no gradient
    reaches]; None: the outputs take no gradient) and the pairs (node, predecessor) it handed one, seen in
    a backward pass on meta: per autograd node of the node's layer, the gradients it reads and makes,
    compared by storage with the gradient the layer received and with those it passes to another IR node's
    autograd nodes."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not leaves:
        return {}, {}, {}, None, set()
    ran: set[int] = set()
    received: dict[int, set[int]] = {}  # probe group -> storages of the gradient its backward started from
    handed: list[tuple[int, int, object, int]] = []  # (group, predecessor group, its autograd node, storage)
    early: dict[int, set[int]] = {}  # group -> predecessor groups its in-place members hand a gradient
    through: dict[tuple[object, int], int] = {}  # (view's autograd node, storage in) -> storage out
    working: list[tuple[int, set[int]]] = []  # per autograd node run: its group, the gradients it reads and makes
    sizes: dict[int, int] = {}
    held = []  # the gradients stay alive, so that no storage address is reused while we compare

    def post_hook(fn, g):
        def hook(grad_inputs, grad_outputs):
            ran.add(g)
            held.extend(t for t in (*grad_inputs, *grad_outputs) if t is not None)
            for t in (*grad_inputs, *grad_outputs):
                if t is not None and t.layout != torch.strided:
                    raise TraceFailure(
                        f"the backward of {describe(probe.groups[g]['members'][0], probe.module)} makes a "
                        f"{str(t.layout).removeprefix('torch.')} gradient (an nn.Embedding or EmbeddingBag with "
                        "sparse=True): the plans and the measurements count dense gradients; set sparse=False")
                if t is not None:
                    sizes[storage_of(t)._cdata] = storage_of(t).nbytes()
            if fn in probe.view_nodes:  # what a view's backward makes is the storage's gradient, received
                if grad_inputs and grad_inputs[0] is not None and grad_outputs[0] is not None:
                    through[(fn, storage_of(grad_outputs[0])._cdata)] = storage_of(grad_inputs[0])._cdata
                return
            if _to_parameters(fn, probe.autograd_group):  # a parameter's gradient on its way
                return
            inner = {storage_of(t)._cdata for t in grad_outputs if t is not None}
            received.setdefault(g, set(inner))
            for (target, _), grad in zip(fn.next_functions, grad_inputs):
                h = probe.autograd_group.get(target)
                if grad is not None and h is not None and h != g:
                    handed.append((g, h, target, storage_of(grad)._cdata))
                    if fn in probe.in_place_nodes:
                        early.setdefault(g, set()).add(h)
                elif grad is not None and h == g and not _to_parameters(target, probe.autograd_group):
                    inner.add(storage_of(grad)._cdata)
            working.append((g, inner))
        return hook

    handles = [fn.register_hook(post_hook(fn, g)) for fn, g in probe.autograd_group.items()]
    try:
        with torch.enable_grad():
            loss = loss_fn(output)
        torch.autograd.backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    shares, work = _shares_and_work(probe, handed, through, received, working, sizes)
    return shares, work, early, ran, {(g, h) for g, h, _, _ in handed}


def _shares_and_work(probe: "Probe", handed: list, through: dict, received: dict, working: list,
                     sizes: dict) -> tuple[dict, dict]:
    """From what ``gradients`` saw in the backward: per group, the gradients it hands its predecessors that share
    a buffer (``Profile.grad_shares``), and its working gradients (``Profile.backward_work_bytes``)."""
    passed: dict[int, dict[int, set[int]]] = {}  # group -> predecessor group -> storages its gradient is in
    outside: dict[int, set[int]] = {}  # group -> storages it handed on, as handed
    for g, h, target, key in handed:
        outside.setdefault(g, set()).add(key)
        while target in probe.view_nodes:  # through the views' backward to the storage's own gradient
            key = through.get((target, key), key)
            target = target.next_functions[0][0] if target.next_functions else None
        passed.setdefault(g, {}).setdefault(h, set()).add(key)
    # A layer's working gradients: those its autograd nodes pass among themselves (an in-place ReLU's, on
    # its way to the convolution before it), beside the one it received and those it hands on.
    work: dict[int, int] = {}
    for g, inner in working:
        own = inner - received.get(g, set()) - outside.get(g, set())
        work[g] = max(work.get(g, 0), sum(sizes[k] for k in own))
    shares: dict[int, list[tuple[list[int], int]]] = {}
    for g, by_pred in passed.items():
        by_storage: dict[int, list[int]] = {}
        for h, storages in by_pred.items():
            if len(storages) == 1:
                by_storage.setdefault(next(iter(storages)), []).append(h)
        shares[g] = [(preds, -1 if key in received.get(g, ()) else sizes[key])
                     for key, preds in by_storage.items() if key in received.get(g, ()) or len(preds) > 1]
    return shares, work


class _LayerPeaks(MemoryTracker):
    """The tracker of ``backward_peaks``: live bytes, and beside them what each layer's backward made and freed.
    ``values``: storages of IR nodes' values -> their probe group (a freed one leaves it); ``layers``: autograd
    node -> the probe group whose layer call made it."""

    def __init__(self, values: dict[int, int], layers: dict, *args):
        self.values, self.layers = values, layers
        self.level = 0  # live bytes, forward values counted as never freed
        self.freeing = 0  # live bytes
        self.call_peak = 0  # the most live during the forward's current call
        self.layer, self.start, self.freeing_start = None, 0, 0
        self.peaks: dict[int, int] = {}
        self.frees: dict[int, tuple[set[int], int]] = {}  # layer -> (values it freed, peak as they went)
        super().__init__(*args)

    def _add(self, storage, part):
        known = id(storage) in self.live
        super()._add(storage, part)
        if not known:
            self.values.pop(id(storage), None)  # a new storage, wherever an old value's id is reused
            self.level += storage.nbytes()
            self.freeing += storage.nbytes()
            self.call_peak = max(self.call_peak, self.freeing)
            if self.layer is not None:
                self.peaks[self.layer] = max(self.peaks.get(self.layer, 0), self.level - self.start)
                freed, peak = self.frees.setdefault(self.layer, (set(), 0))
                self.frees[self.layer] = (freed, max(peak, self.freeing - self.freeing_start))

    def _free(self, key):
        size = self.live[key][0]
        super()._free(key)
        self.freeing -= size
        if key in self.values:
            g = self.values.pop(key)
            if self.layer is not None:
                self.frees.setdefault(self.layer, (set(), 0))[0].add(g)
        else:
            self.level -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count_sum()  # a sum the engine made after the last layer's node is that layer's
        g = self.layers.get(torch._C._current_autograd_node())
        if g is not None and g != self.layer:
            self.layer, self.start, self.freeing_start = g, self.level, self.freeing
        return super().__torch_dispatch__(func, types, args, kwargs)


def _gradient_bytes(module: fx.GraphModule) -> dict[int, int]:
    """What each parameter's gradient holds, by parameter storage: a gradient autograd hands a parameter as a view of
    a larger one it keeps as it is (a ``torch.cat`` of biases), which then lives to the step's end whole."""
    grad_bytes, counted = {}, set()
    for p in module.parameters():
        if p.grad is not None:
            grad_bytes[id(storage_of(p))] = 0 if id(storage_of(p.grad)) in counted else storage_of(p.grad).nbytes()
            counted.add(id(storage_of(p.grad)))
    return grad_bytes


def backward_peaks(module: fx.GraphModule, group_of: dict[str, int], views: set[str], example_input: torch.Tensor,
                    loss_fn) -> tuple[dict[int, int], dict[int, tuple[set[int], int]], dict[int, int], dict, set[int]]:
    """The most each layer's backward holds above what was live as it began (``Profile.backward_peak_bytes``),
    seen in a plain training step on meta: the gradients it makes (working ones, its inputs', its
    parameters') less what it frees on the way (its saved extras as each of its autograd nodes finishes,
    the gradient it received). Forward values are held as if never freed: the replay decides when they go.
    Beside it, for each layer, the forward values its backward freed and the peak with them going as they
    went (``Profile.backward_frees``), the most its forward call held above what it left
    (``Profile.forward_transient_bytes``), and what its backward held above what was live as it began the
    first time it unpacked each IR node's value or, its own, what it saved besides
    (``Profile.unpack_held_bytes``); the layers whose value outlives the step (NOTE [values held outside
    the program] in ``harness/tracing/trace.py``); last, the bytes each parameter's gradient holds, by parameter
    storage (NOTE [parameter gradients])."""

    layers: dict[object, int] = {}  # autograd node -> the probe group whose layer call made it
    values: dict[int, int] = {}  # storages of IR nodes' values -> their probe group
    transients: dict[int, int] = {}  # probe group -> the most one of its calls held above what it left
    unpacks: dict[int, dict[int, int]] = {}  # probe group -> {group unpacked: held at its first unpack}

    class Claiming(fx.Interpreter):
        def run_node(self, node: fx.Node):
            tracker.call_peak = tracker.freeing
            with grad_mode(node):
                result = super().run_node(node)
            g = group_of.get(node.name)
            if g is not None:
                transients[g] = max(transients.get(g, 0), tracker.call_peak - tracker.freeing)
                outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
                values.update((id(storage_of(t)), g) for t in outputs)
                # A view's backward (U-Net's crop, padding the gradient to the whole storage) runs as
                # part of its reader's, where the replay makes the gradient it hands on.
                if node.name not in views:
                    layers.update((fn, g) for fn in new_autograd_nodes(outputs, layers))
            return result

    def unpack(t):
        g = layers.get(torch._C._current_autograd_node())
        key = id(storage_of(t))
        if g is not None and key not in static:  # an IR node's value, or (g's own) what g's layer saved besides
            # Before the layer's first op, it holds nothing yet.
            held = tracker.level - tracker.start if g == tracker.layer else 0
            unpacks.setdefault(g, {}).setdefault(values.get(key, g), held)
        return t

    x = example_input.to("meta")
    static = {id(storage_of(t)) for t in [*module.parameters(), *module.buffers(), x]}
    module.zero_grad(set_to_none=True)  # as every step starts (a gradient already there is summed into)
    with torch.enable_grad(), _LayerPeaks(values, layers, module, (x,)) as tracker:
        # Packed detached: a saved output packed as itself would hold its own grad_fn, a cycle through C++
        # that kept what an unreached branch saved alive after the step (NOTE [values held outside the program]
        # in ``harness/tracing/trace.py``).
        with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, unpack):
            loss_fn(Claiming(module).run(x)).backward()
    grad_bytes = _gradient_bytes(module)
    module.zero_grad(set_to_none=True)
    layers.clear()  # the autograd nodes no backward ran (an unused branch's) hold what they saved
    if values:  # what a reference cycle holds (a Function's ctx) goes at the next collection
        gc.collect()
    held = {g for key, g in values.items() if key not in static}  # still alive (NOTE [values held outside
    return tracker.peaks, tracker.frees, transients, unpacks, held, grad_bytes  # the program])


def loss_fields(output, loss_fn, node_of, n: int) -> dict:
    """The loss's part of the graph (``Profile.loss_bytes`` and the other ``loss_*`` fields), measured on
    meta (NOTE [the loss]): the outputs are counted from the start and taken off every figure, since the
    replay holds them as the IR nodes' values."""

    leaves, bases = [], []  # bases: what a view's backward pads its gradient to (None: not part of a value)

    def leaf(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaves.append(t.detach().requires_grad_())
            bases.append(t._base if t._base is not None and t.numel() < t._base.numel() else None)
            return leaves[-1]
        return t

    saved = set()
    unpacked = []  # what is live when the backward first unpacks an output

    def pack(t):
        saved.add(id(storage_of(t)))
        return t

    def unpack(t):
        if not unpacked and id(storage_of(t)) in output_storages:
            unpacked.append(sum(tracker.current[part] for part in DEVICE_PARTS))
        return t

    output = tree_map(leaf, output)
    output_storages = {id(storage_of(t)) for t in leaves}
    output_bytes = sum(t.untyped_storage().nbytes() for t in {id(storage_of(t)): t for t in leaves}.values())
    with torch.enable_grad(), MemoryTracker(torch.nn.Module(), tuple(leaves)) as tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = loss_fn(output)
        del output
        forward = tracker.peak_bytes
        tracker.peak_bytes = sum(tracker.current[part] for part in DEVICE_PARTS)  # the backward's own peak
        seed = torch.ones_like(loss)  # ``loss.backward()`` holds it until the step's backward is done
        grads = torch.autograd.grad(loss, leaves, seed, allow_unused=True)
        ends = sum(tracker.current[part] for part in DEVICE_PARTS)
    grad_bytes, reads, counted = [0] * n, set(), {id(storage_of(seed))}
    made = 0  # of those gradients, what the loss's backward made (the tracker counted it)
    for t, base, grad in zip(leaves, bases, grads):
        v = node_of(t)
        if v is None or grad is None:
            continue
        if id(storage_of(grad)) not in counted:  # a view of the seed, or of another output's gradient, is free
            counted.add(id(storage_of(grad)))
            made += grad.untyped_storage().nbytes()
            grad_bytes[v] += 0 if base is not None else grad.untyped_storage().nbytes()
        if base is not None and ("whole", v) not in counted:
            # Part of a value (``x[:, 0]``): its view's backward hands the node a new gradient of the whole.
            counted.add(("whole", v))
            grad_bytes[v] += base.numel() * base.element_size()
        if id(storage_of(t)) in saved:
            reads.add(v)
    held = max(0, ends - output_bytes - made)  # the loss's value and the seed, to the step's end
    if id(storage_of(loss)) in output_storages:  # the model returns its loss, which the step holds to its end
        held += loss.untyped_storage().nbytes()
    fields = dict(loss_forward_bytes=max(0, forward - output_bytes), loss_held_bytes=held,
                  loss_bytes=max(0, tracker.peak_bytes - output_bytes - made - held),
                  loss_unpack_bytes=max(0, unpacked[0] - output_bytes) if unpacked else 0)
    outputs = sorted({v for t in leaves if (v := node_of(t)) is not None})
    if not outputs:  # the model returns no IR node's value: Kusumoto et al.'s sinks stand in, at full size
        return fields
    return dict(fields, outputs=outputs, loss_grad_bytes=grad_bytes, loss_reads=sorted(reads))


def _to_parameters(fn, group_of: dict, depth: int = 4) -> bool:
    """Whether an autograd node only passes gradients on to parameters (``weight.t()``'s, in a linear
    layer), within its own layer and a few steps: what it is handed is a parameter's gradient, not a
    working one."""
    nexts = [f for f, _ in fn.next_functions if f is not None]
    return depth > 0 and bool(nexts) and all(
        f.name() == "torch::autograd::AccumulateGrad"
        or (group_of.get(f) == group_of.get(fn) and _to_parameters(f, group_of, depth - 1)) for f in nexts)
