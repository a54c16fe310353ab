"""The parts of a replayed step both replays share (the stage plan's, ``replay.timeline``, and a schedule's,
``schedule_replay.schedule_timeline``): the buffers, a layer's call, its backward and its gradients.

NOTE [a layer's backward peak]
The replay runs a layer's backward as one step: it makes the layer's gradients while it still holds
everything the layer saved and its working gradients. A layer of one autograd node (a convolution) does
just that. A layer of many (an attention: projections, two matmuls, a softmax, in one module) does not:
each node frees what it saved as it finishes, and the last gradients come when most of the saved tensors
are gone (ViT-B/16's attention holds 629 MB of saved tensors at batch 64; held to the end, the replay
over-predicted the DPs' plans by 7%). ``Profile.backward_peak_bytes[v]``, measured per layer in a plain
step on meta when the graph is traced, is the most the layer's backward holds above what was live as it
began, forward values aside. The replay's step carries an entry, ``measured``, that brings it to the
measured peak and goes with the step: negative where the step holds more than that, positive where the
layer holds what the replay does not see, a temporary inside one autograd node (a product with a broadcast
scalar makes the whole product before it sums it down to the scalar's gradient: without it the replay
missed such a layer's vanilla step by 24%, ``tests/test_accounting.py``). Forward values count as held
to the step's end; but a layer's backward may free one on the way, before its peak: a spectrally
normalised convolution frees its saved input when its own backward is done, and the backward of the
weight's normalisation comes after (held, the input put an SN-GAN discriminator's replay 1.4% above the
tracker). So the trace also notes the values each layer's backward freed and its peak with them going as
they went (``Profile.backward_frees``), and a step that releases all of them takes that peak. The layer's
working gradients never count for more than that peak either (``_working``), and they come before the
layer's recomputation only when in-place members make them, reading the layer's own value (a ReLU after a
convolution); an attention makes them after it reads what it saved, that is after its recomputation. On
the seven CNNs no step changes; on the transformers the replay now gives the tracker's peak to the byte.
A layer's backward may also run a while before it unpacks the tensor that calls for its recomputation: a
weight-normalised linear layer's product makes its weight's gradient, then the normalisation's backward
unpacks its norms. The recomputation runs on top of what the layer holds by then, which the trace notes at
the first unpack of each value (``Profile.unpack_held_bytes``; an ``unpacking`` entry held over the
recomputation). Replayed at the start of the layer's backward, such a net was predicted 2% low.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from strategies.graph import Graph


class Phase(str, Enum):
    """What part of the step a replayed step belongs to."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    SWAP_IN = "swap_in"
    BACKWARD = "backward"


class Buffer(str, Enum):
    """What a replayed buffer holds; its key is ``(kind, node, ...)``, node -1 for the loss's."""

    VALUE = "value"  # a node's value
    COPY = "copy"  # the rebuilt copy of a kept value, inside its checkpointed stage
    GRAD = "grad"  # a value's gradient, made by its reader's backward (key: u, the reader)
    SHARED = "shared"  # a gradient a backward hands several inputs at once (Profile.grad_shares)
    SUM = "sum"  # a new buffer a second gradient is summed into
    EXTRA = "extra"  # what a layer saves besides node values
    STATE = "state"  # the state a recomputed layer's forward found, copied for its recomputation
    STATE_AFTER = "state_after"  # the state a recomputation leaves, put back after it
    TRANSIENT = "transient"  # what a call holds only while it runs
    ATTRIBUTE = "attribute"  # what a module keeps as an attribute
    ATTRIBUTE_AGAIN = "attribute_again"  # the attribute a later call makes before it frees the old one
    WORK = "work"  # the working gradients of a layer's in-place members
    MEASURED = "measured"  # the entry that brings a layer's backward to its measured peak
    PARAM_GRAD = "param_grad"  # parameter gradients, to the step's end
    LOSS_FORWARD = "loss_forward"  # what the loss's forward holds
    LOSS = "loss"  # the loss backward's working buffers
    LOSS_HELD = "loss_held"  # the loss's value and seed, to the step's end
    LOSS_UNPACKING = "loss_unpacking"  # what the loss's backward holds as it unpacks a discarded output
    UNPACKING = "unpacking"  # what a layer's backward holds as it unpacks a value to recompute (may be negative)


@dataclass(frozen=True, slots=True)
class Step:
    """One computation of the replayed training step: what it allocates, then what it frees."""

    node: int
    phase: Phase
    allocs: tuple[tuple[tuple, int], ...]  # ((Buffer, node, ...), bytes)
    frees: tuple[tuple, ...]
    call: bool = True  # the step runs the node's layer (its forward, or its whole backward): its FLOPs


def _live_bytes(steps: list[Step]):
    """The bytes live at each step, once its allocations are made and before its frees."""
    live = 0
    sizes: dict[tuple[str, int], int] = {}
    for step in steps:
        for key, size in step.allocs:
            sizes[key] = size
            live += size
        yield live
        for key in step.frees:
            live -= sizes.pop(key)
    assert not sizes, f"simulator bug: {len(sizes)} buffers never freed"


def peak_of(steps: list[Step]) -> int:
    return max(_live_bytes(steps), default=0)


def peak_layer(steps: list[Step]) -> int | None:
    """The layer whose backward is running when ``peak_of(steps)`` is first reached (its own steps, or a
    recomputation it calls for, which comes before them); None where the peak is in the forward pass."""
    live = list(_live_bytes(steps))
    at = live.index(max(live))
    if steps[at].phase == Phase.FORWARD:
        return None
    return next((s.node for s in steps[at:] if s.phase == Phase.BACKWARD and s.node >= 0), None)


class _Gradients:
    """Which buffer holds each node's gradient in the backward pass, as the autograd engine hands them on
    (``Profile.grad_shares``) and sums them (``InputBuffer``'s ``accumulate``): a node's first gradient is
    the buffer it was handed; a later one is summed in place into the buffer it has when no other node's
    gradient shares that buffer and it is the gradient's size (the contribution, if new, lives only for the
    sum), else into the new contribution (after a view of the loss's seed, too), else into a new buffer. A
    buffer goes when no node's gradient is in it any more."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.buffer_of: dict[int, tuple] = {}  # node -> key of the buffer holding its gradient
        self.holders: dict[tuple, int] = {}  # buffer key -> how many nodes' gradients it holds
        self.size: dict[tuple, int] = {}  # buffer key -> bytes
        # node -> the nodes whose parameters' gradients its backward makes, if it is the first of their readers
        self.param_owners = [[v] if graph.profile.param_bytes[v] else [] for v in range(len(graph))]
        for v, sharers in enumerate(graph.profile.param_sharers):
            for u in sharers:
                self.param_owners[u].append(v)
        self.params_made: set[int] = set()
        self.readers_left = {u: 0 for owners in self.param_owners for u in owners}  # backwards yet to make each
        for owners in self.param_owners:
            for u in owners:
                self.readers_left[u] += 1

    def params(self, v: int, frees: list) -> list:
        """The parameter gradients the backward of ``v`` makes: those of the parameters no backward has
        reached yet (``Profile.param_sharers``); they stay to the step's end, or go as that backward ends
        (``Profile.param_grads_released``: into ``frees``; a shared parameter's once the backward of its last
        reader is done, since autograd sums the contributions before it accumulates the gradient)."""
        owners = [u for u in self.param_owners[v] if u not in self.params_made]
        self.params_made.update(owners)
        if self.graph.profile.param_grads_released:
            for u in self.param_owners[v]:
                self.readers_left[u] -= 1
                if not self.readers_left[u]:
                    frees.append((Buffer.PARAM_GRAD, u))
        return [((Buffer.PARAM_GRAD, u), self.graph.profile.param_bytes[u]) for u in owners]

    def hold(self, u: int, key: tuple, size: int | None = None):
        if size is not None:
            self.size[key] = size
        self.buffer_of[u] = key
        self.holders[key] = self.holders.get(key, 0) + 1

    def drop(self, u: int, frees: list):
        key = self.buffer_of.pop(u, None)
        if key is not None:
            self.holders[key] -= 1
            if not self.holders[key]:
                del self.holders[key]
                frees.append(key)

    def in_place_members(self, v: int, work: int) -> tuple[list, list, int]:
        """The first backward step of ``v``'s in-place members (``_in_place_first``): the gradients they
        hand on (``Profile.early_grads``) and their working ones, then what they free (the gradient received);
        and what they hold as the rest of the layer's backward starts, above what was live as it began."""
        handed, frees = self.backward(v, self.graph.profile.early_grads[v])
        held = work + sum(size for _, size in handed) - sum(self.size[key] for key in frees)
        return handed + ([((Buffer.WORK, v), work)] if work else []), frees, held

    def backward(self, v: int, only=None) -> tuple[list, list]:
        """The backward of ``v``, or of the part of its layer that makes the gradients of the predecessors
        ``only``: the buffers it allocates, then those it frees (its own gradient's, unless handed on, and
        every contribution summed away)."""
        graph = self.graph
        handed = {}  # predecessor -> (buffer key, bytes; -1: v's own gradient's buffer)
        for i, (preds, size) in enumerate(graph.profile.grad_shares[v]):
            if size < 0 and v not in self.buffer_of:  # the received gradient went to work already
                continue
            key = self.buffer_of[v] if size < 0 else (Buffer.SHARED, v, i)
            handed.update((u, (key, size)) for u in preds)
        allocs, made = [], set()

        def make(key, size):
            if key not in made and key not in self.holders:
                made.add(key)
                allocs.append((key, size))
                self.size[key] = size

        frees = []
        for u in graph.preds[v] if only is None else only:
            # it takes no gradient (from v)
            if not graph.profile.reached[u] or u in graph.profile.preds_without_grad[v]:
                continue
            key, size = handed.get(u, ((Buffer.GRAD, u, v), graph.mem_bytes[u]))
            old = self.buffer_of.get(u)
            if old is None:
                make(key, size)
                self.hold(u, key)
            elif self.holders[old] == 1 and self.size[old] >= graph.mem_bytes[u]:
                make(key, size)  # summed in place into u's buffer; a new contribution lives for the sum
            else:
                # u's buffer may not be written: shared, or a view smaller than the gradient (the loss
                # hands a sum's output a view of its seed). The sum goes into the contribution if it is
                # new, else into a new buffer.
                if key in self.holders:
                    key = (Buffer.SUM, u, v)
                make(key, graph.mem_bytes[u] if key[0] == Buffer.SUM else size)
                self.drop(u, frees)
                self.hold(u, key)
        self.drop(v, frees)
        frees += [key for key in made if key not in self.holders]
        return allocs, frees


def _in_place_first(graph: Graph, v: int, work: int) -> bool:
    """Whether ``v``'s in-place members run their backward as a step of its own, before the rest of the
    layer's: they read ``v``'s value and make working gradients or hand gradients on."""
    return bool(work or graph.profile.early_grads[v]) and v in graph.profile.backward_reads[v]


def _after_members(graph: Graph, v: int) -> list[int]:
    """The predecessors whose gradients the rest of ``v``'s layer makes, after its in-place members."""
    return [u for u in graph.preds[v] if u not in graph.profile.early_grads[v]]


def backward_holds(graph: Graph, v: int) -> tuple[int, int | None]:
    """What the backward of ``v``'s layer holds, whatever the plan, above what was live as it began: at the step
    that makes its gradients, the lesser of the two peaks that step may be brought to (NOTE [a layer's backward
    peak]; 0 where not measured); and where its in-place members run their backward first, at their step (which
    may read ``v``'s value last), their working gradients, else None."""
    work = _working(graph, v)
    first = work if _in_place_first(graph, v, work) else None
    if graph.profile.backward_peak_bytes is None:
        return 0, first
    peak = graph.profile.backward_peak_bytes[v]
    if graph.profile.backward_frees is not None and graph.profile.backward_frees[v][0]:
        peak = min(peak, graph.profile.backward_frees[v][1])
    return max(peak, 0), first


def _working(graph: Graph, v: int) -> int:
    """The working gradients of ``v``'s in-place members (NOTE [a layer's backward peak])."""
    peaks = graph.profile.backward_peak_bytes
    work = graph.profile.backward_work_bytes[v]
    return work if peaks is None else min(work, peaks[v])


def _to_measured_peak(graph: Graph, v: int, held: int, frees: list, released: set[int]) -> list:
    """The entry that brings the replay's backward of ``v`` to the peak its layer's backward measured (NOTE
    [a layer's backward peak]), going with the step: negative where the layer has freed by then what the
    replay still holds, positive where it holds what the replay does not see (a product's backward makes
    the whole product before it sums it down to a broadcast scalar's gradient); ``held`` is what the
    replay's backward of ``v`` holds then above what was live as it began, values aside. Where the step
    releases every value the layer's backward freed as it ran (``released``), the peak is the one with
    them going as they went (``Profile.backward_frees``)."""
    if graph.profile.backward_peak_bytes is None:
        return []
    peak = graph.profile.backward_peak_bytes[v]
    if graph.profile.backward_frees is not None:
        freed, freeing_peak = graph.profile.backward_frees[v]
        if freed and released.issuperset(freed):
            peak = freeing_peak
    if held == peak:
        return []
    frees.append((Buffer.MEASURED, v))
    return [((Buffer.MEASURED, v), peak - held)]


def _held_at_unpack(graph: Graph, v: int, missing) -> int:
    """What the backward of ``v``'s layer holds, above what was live as it began, when it first unpacks
    a value for which ``missing`` is true (``Profile.unpack_held_bytes``; 0 where not measured)."""
    for u, held in graph.profile.unpack_held_bytes[v] if graph.profile.unpack_held_bytes is not None else ():
        if missing(u):
            return held
    return 0


def _call(graph: Graph, v: int, phase: str, allocs: list, frees: list) -> list[Step]:
    """A call of ``v``'s layer: its allocations, then its frees; in two steps where its extras come after
    the values that go at it have gone (``Profile.extras_after_reads``)."""
    if not (graph.profile.extras_after_reads and graph.profile.extras_after_reads[v]):
        return [Step(v, phase, tuple(allocs), tuple(frees))]
    extra = [alloc for alloc in allocs if alloc[0] == (Buffer.EXTRA, v)]
    inputs_gone = [key for key in frees if key[0] in (Buffer.VALUE, Buffer.COPY) and key[1] != v]
    return [Step(v, phase, tuple(alloc for alloc in allocs if alloc not in extra), tuple(inputs_gone)),
            Step(v, phase, tuple(extra), tuple(key for key in frees if key not in inputs_gone), call=False)]


def _transient(graph: Graph, v: int, allocs: list, frees: list, first: bool):
    """What a call of ``v``'s layer holds while it runs above what it leaves (``Profile.forward_transient_bytes``):
    gone by the step's end; and what it leaves on a module (``Profile.attribute_bytes``), from its ``first``
    call to the step's end (a later call's is ``_attribute_again``)."""
    if graph.profile.forward_transient_bytes is not None and graph.profile.forward_transient_bytes[v]:
        allocs.append(((Buffer.TRANSIENT, v), graph.profile.forward_transient_bytes[v]))
        frees.append((Buffer.TRANSIENT, v))
    if graph.profile.attribute_bytes[v] and first:
        allocs.append(((Buffer.ATTRIBUTE, v), graph.profile.attribute_bytes[v]))


def _attribute_again(graph: Graph, v: int) -> list[Step]:
    """Before a later call of ``v``'s layer runs, its pre-hook makes the module's attribute again, and
    setting it frees the one before (NOTE [tensors a module keeps] in ``harness/tracing/probe.py``): both are
    there for that moment alone, before the layer allocates anything."""
    if not graph.profile.attribute_bytes[v]:
        return []
    key = (Buffer.ATTRIBUTE_AGAIN, v)
    return [Step(v, Phase.RECOMPUTE, ((key, graph.profile.attribute_bytes[v]),), (key,), call=False)]


def _turn(graph: Graph, gradients: "_Gradients", fetched=(), loss_held: bool = True) -> Step:
    """From forward to backward: the swapped values fetched at once, the loss's buffers and the loss's
    gradients with respect to the outputs come; the loss's working buffers go, its value stays
    (``loss_held``: it comes here, not before)."""
    profile = graph.profile
    outputs = [v for v in graph.outputs if profile.reached[v]]  # the others take no gradient
    for v in outputs:
        gradients.hold(v, (Buffer.GRAD, v), profile.loss_grad_bytes[v])
    allocs = [*fetched, *(((Buffer.GRAD, v), profile.loss_grad_bytes[v]) for v in outputs)]
    allocs += [((Buffer.LOSS, -1), profile.loss_bytes)] if profile.loss_bytes else []
    allocs += [((Buffer.LOSS_HELD, -1), profile.loss_held_bytes)] if profile.loss_held_bytes and loss_held else []
    return Step(-1, Phase.BACKWARD, tuple(allocs), ((Buffer.LOSS, -1),) if profile.loss_bytes else ())


def _end(graph: Graph, gradients: "_Gradients") -> Step:
    """Parameter gradients outlive the step (the optimizer reads them), as do the loss's value and what
    modules keep (``Profile.attribute_bytes``): freed at the end for the tally."""
    released = graph.profile.param_grads_released
    kept = sorted(u for u in gradients.params_made if not released or gradients.readers_left[u])
    return Step(-1, Phase.BACKWARD, (), tuple([*((Buffer.PARAM_GRAD, u) for u in kept),
                                          *((Buffer.ATTRIBUTE, v) for v in range(len(graph))
                                            if graph.profile.attribute_bytes[v]),
                                          *([(Buffer.LOSS_HELD, -1)] if graph.profile.loss_held_bytes else [])]))


def _key(u: int, n: int) -> tuple:
    return (Buffer.VALUE, u) if u < n else (Buffer.COPY, u - n)
