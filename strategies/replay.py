"""The liveness replay: the training step the executor runs, as a list of allocations and frees.

NOTE [what a recomputation makes]
Kusumoto et al.'s canonical strategy recomputes a stage's discarded values all at once, when the first backward
that needs one of them runs. By then the backwards of some of them may have run already (a stage's last
layers read only kept values: a classifier reading the kept pooled features, a language model's head
reading the last block's output): no later backward reads those values, and their layers'
records are no longer wanted. The executor makes only what is wanted, the discarded values of the stage
that a later backward (the loss's too) reads, or whose layer's backward is still to come and reads what it
saved besides node values, and the discarded values of the stage those are made from
(``Graph.with_inputs_within``); a layer not rerun drops the copy of the state its forward found. It is the
same step, minus computations nothing reads: the same loss and gradients, less time and never more memory.
Rerun, GPT-2's ``lm_head`` took ``chen_sqrt``'s step from 8.70 to 9.33 TFLOP (batch 8, sequence 1024, on
meta), U-Net's head and last upsampling were 11 of ``chen_sqrt``'s 223 cost units recomputed, and
DenseNet-161's last layers 40 of ``chen_greedy``'s 1951. The replay here, ``schedule.from_plan`` and the
overhead in cost units count the same computations. A checkpointed stage is ``torch.utils.checkpoint``'s,
which reruns the block up to where its early stop stops it (NOTE [a checkpointed stage]).

NOTE [a layer's backward peak]
The replay runs a layer's backward as one step: it makes the layer's gradients while it still holds
everything the layer saved and its working gradients. A layer of one autograd node (a convolution) does
just that. A layer of many (an attention: projections, two matmuls, a softmax, in one module) does not:
each node frees what it saved as it finishes, and the last gradients come when most of the saved tensors
are gone (ViT-B/16's attention holds 629 MB of saved tensors at batch 64; held to the end, the replay
over-predicted the DPs' plans by 7%). ``Graph.backward_peak_bytes[v]``, measured per layer in a plain
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
they went (``Graph.backward_frees``), and a step that releases all of them takes that peak. The layer's
working gradients never count for more than that peak either (``_working``), and they come before the
layer's recomputation only when in-place members make them, reading the layer's own value (a ReLU after a
convolution); an attention makes them after it reads what it saved, that is after its recomputation. On
the seven CNNs no step changes; on the transformers the replay now gives the tracker's peak to the byte.
A layer's backward may also run a while before it unpacks the tensor that calls for its recomputation: a
weight-normalised linear layer's product makes its weight's gradient, then the normalisation's backward
unpacks its norms. The recomputation runs on top of what the layer holds by then, which the trace notes at
the first unpack of each value (``Graph.unpack_held_bytes``; an ``unpacking`` entry held over the
recomputation). Replayed at the start of the layer's backward, such a net was predicted 2% low.

NOTE [a checkpointed stage]
The PyTorch peers run ``torch.utils.checkpoint(use_reentrant=False)`` around blocks, and their plans mark
those stages ``Plan.checkpointed``. Such a stage differs from the executor's in three ways, each seen in
``torch/utils/checkpoint.py``: nothing its layers save outlives its forward (their extras too come back
with the recomputation); its kept values serve the later stages only, and the first backward read inside
the block rebuilds everything the block's layers save, its kept output included (a block's last ReLU reads
a rebuilt copy of the output, the key ``("copy", u)``, beside the original the next block held); the
rebuilding stops once the last tensor the block saved is saved again (early stop: ``_rerun_end``; a layer
saves its inputs before it runs, so a last saving layer that saves only those does not run); and the
block's inputs stay until its backward is done, not just until its recomputation has read them:
``checkpoint`` holds its arguments in its frame, which lives as long as any tensor the block saved, that
is until the backward of the block's first layer that saves one (``_frame_holds``; a DenseNet layer is
handed the list of every feature before it, and its first saving layer, the batch norm, saves their
concatenation, not them). On U-Net's blocks the IR plan without these missed the peak by 6%, on
DenseNet-161's by 1.5%.

NOTE [selective checkpointing]
A selective policy (``create_selective_checkpoint_contexts``) runs inside a checkpointed stage: the ops it
saves cache their outputs in the forward, and the stage's recomputation takes them from the cache instead
of running them again (``Plan.selective``). Such a value is kept, and not rebuilt: the recomputation's
layers read the very tensor the forward made. What its layer saved is kept with it (an op the policy saves
keeps all it made), and the cache holds it until the stage's recomputation takes it out. The rest of the
stage runs as NOTE [a checkpointed stage] says: its inputs are held by ``checkpoint``'s frame, and the
early stop comes after the last layer that saves. A saved value past the early stop is never taken out:
the cache, and so the value, lives as long as the frame (a Llama layer's last projection, whose output
the residual addition reads and no backward does: 32 MiB held through the layer's backward at sequence
4096, batch 1).

NOTE [a schedule's replay]
``schedule_timeline`` counts a Checkmate schedule with the figures the stage replay counts: stage t
computes its row in node order; a value goes after the last reader of its stage unless the next stage
holds it; what a layer saves besides its value comes with the computation of the value last before its
backward (the one autograd records; the others run as the executor's discarded forward does), and a
value computed again holds the state its first computation found, from then to its last computation (a
computation between takes a copy of its own); the turn to the backward pass brings the loss's
buffers and the outputs' gradients (the loss reads the outputs at once: ``loss_reads_outputs=False``);
a backward node runs as ``_backward`` runs it (``_Gradients``; in-place members first, as soon as the
value they read is here, before the stage's other recomputations). A gradient is computed once. On a
stage plan written as a schedule (``schedule.from_plan``) whose stages follow node order, it gives the
stage replay's peak to the byte (tests/test_accounting.py); Checkmate's own count misses it by -22% to
+75% on the zoo. A layer no gradient reaches runs no backward; what it saved stays to the loss's forward
where its record is its first computation, and its extras come and go with any other (NOTE [what no
gradient reaches] in ``harness/backward_profile.py``). A schedule cannot tell a value a stage plan discards but never
recomputes (its stage is not recomputed, or what is is made without it: NOTE [what a recomputation makes])
from a kept one, and holds what such a layer saved of it: above the stage replay, never below, unless it is
told which values the plan discards (``discarded``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from strategies import schedule
from strategies.graph import Graph, bits, members
from strategies.plan import Plan


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
    SHARED = "shared"  # a gradient a backward hands several inputs at once (Graph.grad_shares)
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
    UNPACKING = "unpacking"  # what a layer's backward holds as it unpacks a value to recompute



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


def timeline(graph: Graph, plan: Plan) -> list[Step]:
    """The executor's training step as a list of allocations and frees (NOTE [two memory models]); a plan
    with ``checkpointed`` stages, the step ``torch.utils.checkpoint`` runs (NOTE [a checkpointed stage])."""
    n = len(graph)
    kept = plan.kept
    discarded = graph.all_nodes & ~kept
    stage_of = plan.stage_of(n)
    rebuilt, in_checkpoint = _rebuilt(graph, plan)
    facts = _Facts(plan, n, stage_of, forward_order(graph, stage_of), discarded, rebuilt, in_checkpoint,
                   readers=[[] for _ in range(2 * n)], recompute_stages=[])  # both filled here, below
    copy, readers, recompute_stages = facts.copy, facts.readers, facts.recompute_stages
    for v in range(n):
        for u in graph.backward_reads[v] if graph.reached[v] else ():
            readers[copy(u, v)].append(v)
    for u in graph.loss_reads:
        readers[u].append(-1)  # the loss's backward, at the turn
    needed = called_for(graph, plan) | {stage_of[u] for u in members(rebuilt)
                                        if readers[u] or readers[u + n] or graph.saves_more(u)}
    # The recomputed stages that read each kept value (not those that rebuild it).
    recompute_stages += [{stage_of[w] for w in graph.succs[u] if (discarded | rebuilt) >> w & 1 and copy(u, w) == u}
                         & needed if kept >> u & 1 else set() for u in range(n)] + [set() for _ in range(n)]
    for u in members(plan.selective):  # the policy's cache hands it to the recomputation
        recompute_stages[u] |= {stage_of[u]} & needed  # (NOTE [selective checkpointing])
    for u in members(plan.swapped):
        assert not recompute_stages[u], f"simulator: swapped node {u} is read by a recomputation; it must stay"
    # A recomputed layer that may write state keeps a copy of the state as its forward found it, to its
    # recomputation or, where its stage is not recomputed, to the end of the forward pass; none where no
    # recomputation will make it.
    remade = discarded & ~in_checkpoint & ~graph.never_recomputed()
    found = {v for v in members(remade) if graph.recompute_state_bytes[v]}
    # The executor holds the kept values an output's stage starts from to the end of the forward pass: only
    # the loss's saves tell whether its backward reads an output (a step may run another loss than the trace).
    ends = {stage_of[v] for v in graph.outputs} - needed
    to_loss = {u for u in members(kept) if not recompute_stages[u]
               and any(stage_of[w] in ends and (discarded & ~in_checkpoint) >> w & 1 for w in graph.succs[u])}
    # What the layers no gradient reaches saved goes at the loss's forward (NOTE [what no gradient reaches]
    # in harness/backward_profile.py): the kept values they read, and their extras.
    for w in graph.unreached:
        if not in_checkpoint >> w & 1:
            to_loss.update(u for u in graph.backward_reads[w] if (kept & ~plan.swapped) >> u & 1)
    steps = _forward(graph, facts, found, sorted(v for v in found if stage_of[v] not in needed), to_loss)
    steps += _backward(graph, facts, _frame_holds(graph, plan, stage_of))
    return steps


@dataclass(frozen=True, slots=True)
class _Facts:
    """What ``timeline`` finds out about a plan once, for the forward and backward replays. A value is its
    node ``u``; inside a checkpointed stage, a kept value's rebuilt copy is ``n + u`` (NOTE [a checkpointed
    stage]): ``copy`` says which of the two a reader reads, ``_key`` names the buffer of either."""

    plan: Plan
    n: int
    stage_of: list[int]
    order: list[int]  # the forward pass's order (``forward_order``)
    discarded: int  # the nodes the plan does not keep
    rebuilt: int  # the kept values their checkpointed stage's recomputation rebuilds
    in_checkpoint: int  # the nodes of checkpointed stages
    readers: list[list[int]]  # per value and rebuilt copy: the nodes whose backward reads it (-1: the loss's)
    recompute_stages: list[set[int]]  # per kept value: the recomputed stages that read it

    def copy(self, u: int, v: int) -> int:
        """What node ``v`` reads of ``u``: ``n + u``, the rebuilt copy, inside u's checkpointed stage."""
        return u + self.n if self.rebuilt >> u & 1 and self.stage_of[u] == self.stage_of[v] else u


class _Residency:
    """Which values (and rebuilt copies) are on the device in the backward pass, and what still reads each:
    the backwards left (``readers_left``) and the recomputed stages left (``stages_left``)."""

    def __init__(self, facts: _Facts, frame_holds: dict[int, list[int]]):
        plan, n = facts.plan, facts.n
        resident = plan.kept & ~plan.swapped
        self.n = n
        self.present = [bool(resident >> u & 1 and (facts.readers[u] or facts.recompute_stages[u]))
                        for u in range(n)] + [False] * n
        self.readers_left = [len(r) for r in facts.readers]
        for u in (u for held in frame_holds.values() for u in held):
            self.readers_left[u] += 1  # ``checkpoint``'s frame holds the stage's inputs (``_frame_holds``)
        self.stages_left = [set(s) for s in facts.recompute_stages]

    def release_if_done(self, u: int, frees: list) -> None:
        """Free ``u`` (into ``frees``) if it is here and nothing reads it any more."""
        if self.present[u] and self.readers_left[u] == 0 and not self.stages_left[u]:
            self.present[u] = False
            frees.append(_key(u, self.n))

    def read(self, u: int, frees: list) -> None:
        """A backward has read ``u``: one reader fewer."""
        self.readers_left[u] -= 1
        self.release_if_done(u, frees)


def called_for(graph: Graph, plan: Plan) -> set[int]:
    """The stages whose recomputation some backward calls for: a backward (the loss's too) reads one of
    their discarded values, or a discarded layer saved a tensor that is not one (an extra, or what its
    module keeps). The executor recomputes no other stage, and holds no kept value for one (``timeline``
    adds the checkpointed stages' rebuilt values). A layer's empty extras (an eval-mode batch norm's saved
    statistics on the CPU) call for nothing: the executor leaves them saved."""
    read = graph.read_by_backward() | set(graph.loss_reads)
    stage_of = plan.stage_of(len(graph))
    return {stage_of[u] for u in members(plan.recomputed)
            if u in read or graph.reached[u] and graph.saves_more(u)}


def _frame_holds(graph: Graph, plan: Plan, stage_of: list[int]) -> dict[int, list[int]]:
    """For each checkpointed stage, the backward node at whose end ``checkpoint``'s frame lets go of the
    stage's inputs, and those inputs (NOTE [a checkpointed stage]): the stage's first node whose layer
    saves a tensor."""
    holds: dict[int, list[int]] = {}
    for i in members(plan.checkpointed):
        stage = plan.stages[i]
        first = _first_saving(graph, stage)
        if first >= 0:
            # and what the selective policy saved past the early stop (NOTE [selective checkpointing])
            unpopped = stage & plan.selective & ~((1 << _rerun_end(graph, stage)) - 1)
            holds[first] = sorted({u for w in members(stage) for u in graph.preds[w] if stage_of[u] != i}
                                  | set(members(unpopped)))
    return holds


def _rebuilt(graph: Graph, plan: Plan) -> tuple[int, int]:
    """The kept values that the recomputation of their checkpointed stage rebuilds, and the nodes of the
    checkpointed stages (NOTE [a checkpointed stage])."""
    rebuilt, inside = 0, 0
    for i in members(plan.checkpointed):
        stage = plan.stages[i]
        inside |= stage
        rebuilt |= stage & plan.kept & ~plan.selective & ((1 << _rerun_end(graph, stage)) - 1)
    return rebuilt, inside


def _saving(graph: Graph, stage: int) -> list[int]:
    """The nodes of ``stage`` whose layers save a tensor for their backward."""
    sharing = {u for sharers in graph.param_sharers for u in sharers}
    return [v for v in members(stage)
            if graph.backward_reads[v] or graph.saved_extra_bytes[v] or graph.param_bytes[v] or v in sharing]


def _rerun_end(graph: Graph, stage: int) -> int:
    """Where ``torch.utils.checkpoint`` stops a recomputation of ``stage`` (its early stop): the nodes
    before the index returned run. It stops once the last tensor the block saved is saved again, and a
    layer saves its inputs (and parameters) before it runs, its output and what else it makes after: a
    last saving layer that saves nothing it makes does not run (a DenseNet layer's last convolution;
    counted as run, the replay charged DenseNet-161's blocks 1.67x the FLOPs they recompute)."""
    last = max(_saving(graph, stage), default=-1)
    if last >= 0 and last not in graph.backward_reads[last] and not graph.saves_more(last):
        return last
    return last + 1


def _first_saving(graph: Graph, stage: int) -> int:
    return min(_saving(graph, stage), default=-1)


def _key(u: int, n: int) -> tuple:
    return (Buffer.VALUE, u) if u < n else (Buffer.COPY, u - n)


def _forward(graph: Graph, facts: _Facts, found: set[int], unread: list[int], to_loss: set[int]) -> list[Step]:
    """The forward pass and the loss's forward. ``found``: the nodes that keep a copy of the state their call
    found, ``unread`` those of them whose stage is not recomputed; ``to_loss``: kept values held through the
    loss's forward."""
    kept, swapped = facts.plan.kept, facts.plan.swapped
    readers, recompute_stages = facts.readers, facts.recompute_stages
    # The kept layers keep what they save (not a checkpointed stage's, unless a selective policy saves them).
    saves = kept & ~facts.in_checkpoint | facts.plan.selective

    def held(u):  # on the device into the backward pass
        return kept >> u & 1 and not swapped >> u & 1 and (readers[u] or recompute_stages[u])

    outputs = set(graph.outputs)
    last = outputs | to_loss  # go at the loss's forward
    uses_left = [len(s) for s in graph.succs]
    steps = []
    for v in facts.order:
        allocs = [((Buffer.VALUE, v), graph.mem_bytes[v])]
        frees = []
        if v in found:
            allocs.append(((Buffer.STATE, v), graph.recompute_state_bytes[v]))
        if graph.saved_extra_bytes[v]:
            allocs.append(((Buffer.EXTRA, v), graph.saved_extra_bytes[v]))
            if not saves >> v & 1:  # a recomputed layer's extras go now and come back with it
                frees.append((Buffer.EXTRA, v))
        _transient(graph, v, allocs, frees, first=True)
        for u in graph.preds[v]:
            uses_left[u] -= 1
            if uses_left[u] == 0 and not held(u) and u not in last:
                frees.append((Buffer.VALUE, u))
        if not graph.succs[v] and not held(v) and v not in outputs:  # read by nothing at all
            frees.append((Buffer.VALUE, v))
        steps += _call(graph, v, Phase.FORWARD, allocs, frees)
    # The loss's forward: the model returned its outputs, so all of them are here. Then they go, unless a
    # backward reads them (the loss's own among them: ``readers``).
    loss = [((Buffer.LOSS_FORWARD, -1), graph.loss_forward_bytes)] if graph.loss_forward_bytes else []
    frees = [(Buffer.VALUE, v) for v in sorted(last) if not held(v)] + [(Buffer.STATE, v) for v in unread]
    frees += [(Buffer.EXTRA, v) for v in graph.unreached if graph.saved_extra_bytes[v] and saves >> v & 1]
    steps.append(Step(-1, Phase.FORWARD, tuple(loss), tuple(frees + [key for key, _ in loss])))
    return steps


def _backward(graph: Graph, facts: _Facts, frame_holds: dict[int, list[int]]) -> list[Step]:
    """The backward pass, from the loss's backward (the turn) to the step's end: each node's backward in the
    reverse of the forward's order, a stage's recomputation where a backward first calls for one of its
    discarded values (NOTE [what a recomputation makes]), swapped values fetched at their ``prefetch``
    node, and every value freed as its last reader finishes (``_Residency``). ``frame_holds``: where a
    checkpointed stage's inputs go (``_frame_holds``)."""
    plan, n, stage_of, copy = facts.plan, facts.n, facts.stage_of, facts.copy
    discarded, rebuilt, in_checkpoint = facts.discarded, facts.rebuilt, facts.in_checkpoint
    live = _Residency(facts, frame_holds)
    present, readers_left = live.present, live.readers_left
    fetched_at: dict[int, list[int]] = {}  # backward node (-1: the start) -> the swapped values it fetches
    for u, trigger in plan.prefetch:
        if facts.readers[u]:
            fetched_at.setdefault(trigger, []).append(u)
    gradients = _Gradients(graph)
    steps = []

    def fetch(trigger):
        for u in fetched_at.get(trigger, ()):
            present[u] = True
        return [((Buffer.VALUE, u), graph.mem_bytes[u]) for u in fetched_at.get(trigger, ())]

    fetched = fetch(-1)
    recomputed = set()
    backward_done = set()
    never = graph.never_recomputed()
    extras_present = [bool(graph.saves_more(v) and (plan.kept & ~in_checkpoint | plan.selective) >> v & 1
                           and graph.reached[v])
                      for v in range(n)]

    def recompute(stages):
        for s in sorted(stages - recomputed):
            recomputed.add(s)
            made = plan.stages[s] & discarded
            if not plan.checkpointed >> s & 1:  # NOTE [what a recomputation makes]
                wanted = bits(u for u in members(made) if readers_left[u]
                              or graph.reached[u] and graph.saves_more(u) and u not in backward_done)
                made = graph.with_inputs_within(wanted, made)
                unmade = [u for u in members(plan.stages[s] & discarded & ~made & ~never)
                          if graph.recompute_state_bytes[u]]
                if unmade:  # the state their forward calls found goes
                    steps.append(Step(-1, Phase.RECOMPUTE, (), tuple((Buffer.STATE, u) for u in unmade)))
            nodes = members(made) + [u + n for u in members(plan.stages[s] & rebuilt)]
            if plan.checkpointed >> s & 1:  # early stop: nothing after the last layer that saves
                end = _rerun_end(graph, plan.stages[s])
                nodes = [w for w in nodes if w % n < end]
            nodes.sort(key=lambda w: w % n)
            steps.extend(_recompute_stage(graph, facts, s, nodes, live))
            for w in nodes:
                extras_present[w % n] = bool(graph.saves_more(w % n) and graph.reached[w % n])

    # The loss's backward reads the outputs it saved; one the plan discarded comes back with its stage, on
    # top of the loss's value and the seed gradient ``backward`` made first.
    read_back = {stage_of[u] for u in graph.loss_reads if not present[u]}
    unpacking = graph.loss_unpack_bytes - graph.loss_held_bytes if read_back else 0
    if read_back and (graph.loss_held_bytes or unpacking > 0):
        held = [((Buffer.LOSS_HELD, -1), graph.loss_held_bytes)] if graph.loss_held_bytes else []
        held += [((Buffer.LOSS_UNPACKING, -1), unpacking)] if unpacking > 0 else []
        steps.append(Step(-1, Phase.BACKWARD, tuple(held), ()))
    recompute(read_back)
    if unpacking > 0:
        steps.append(Step(-1, Phase.BACKWARD, (), ((Buffer.LOSS_UNPACKING, -1),)))
    turn = _turn(graph, gradients, fetched, loss_held=not (read_back and graph.loss_held_bytes))
    frees = list(turn.frees)
    for u in graph.loss_reads:
        live.read(u, frees)
    steps.append(dataclasses.replace(turn, frees=tuple(frees)))

    for v in reversed(facts.order):
        if not graph.reached[v]:  # its backward never runs
            continue
        fetched = fetch(v)
        if fetched:
            steps.append(Step(v, Phase.SWAP_IN, tuple(fetched), ()))
        reads = [copy(u, v) for u in graph.backward_reads[v]]
        own = copy(v, v)  # the value v's in-place members read
        work = _working(graph, v)
        if own in reads and not present[own]:
            recompute({stage_of[v]})
        in_place_first = _in_place_first(graph, v, work)
        held = 0
        if in_place_first:
            # A layer's in-place members (a ReLU after its convolution) run their backward first: they
            # read the value they wrote, and turn the gradient received into a working one. The value's
            # last reading frees it, and the received gradient goes, before the first member's backward
            # reads the inputs, which may call for a recomputation. A member that hands its gradient
            # straight on (a ReLU after an addition) makes no working one: it reads its value while it
            # makes what it hands on, below, like any other read. A layer whose working gradients pass
            # between other autograd nodes (an attention) makes them after it reads what it saved, and so
            # after its recomputation: below, beside its other gradients.
            # In-place members that hand a gradient on (``out += identity`` after a batch norm, then a
            # ReLU) make it here too (``Graph.early_grads``), before the rest of the layer reads its inputs.
            reads = [u for u in reads if u != own]
            made, early, held = gradients.in_place_members(v, work)
            live.read(own, early)
            steps.append(Step(v, Phase.BACKWARD, tuple(made), tuple(early), call=False))
        missing = {stage_of[u % n] for u in reads if not present[u]}
        assert all(present[u] for u in reads if plan.swapped >> u & 1), \
            f"simulator: the backward of node {v} reads a swapped value before its prefetch"
        extras_missing = bool(graph.saves_more(v) and not extras_present[v])
        if extras_missing:
            missing.add(stage_of[v])
        # The layer's backward may run a while before it unpacks what it must wait for (NOTE [a layer's
        # backward peak]): the recomputation runs on top of what it holds by then.
        own_missing = not in_place_first and own in reads and not present[own]
        unpacking = _held_at_unpack(graph, v, lambda u: own_missing or extras_missing if u == v
                                    else not present[copy(u, v)]) - held if missing else 0
        if unpacking > 0:
            steps.append(Step(v, Phase.BACKWARD, (((Buffer.UNPACKING, v), unpacking),), (), call=False))
        recompute(missing)
        if unpacking > 0:
            steps.append(Step(v, Phase.BACKWARD, (), ((Buffer.UNPACKING, v),), call=False))
        allocs, frees = gradients.backward(v, _after_members(graph, v) if in_place_first else None)
        allocs += gradients.params(v, frees)
        if work and not in_place_first:
            allocs.append(((Buffer.WORK, v), work))
        for u in reads + frame_holds.get(v, []):
            live.read(u, frees)
        released = {key[1] for key in frees if key[0] == Buffer.VALUE}
        allocs += _to_measured_peak(graph, v, held + sum(size for _, size in allocs), frees, released)
        if work:
            frees.append((Buffer.WORK, v))
        if extras_present[v]:
            frees += [(Buffer.EXTRA, v)] if graph.saved_extra_bytes[v] else []
            extras_present[v] = False
        steps.append(Step(v, Phase.BACKWARD, tuple(allocs), tuple(frees)))
        backward_done.add(v)
    steps.append(_end(graph, gradients))
    return steps


class _Gradients:
    """Which buffer holds each node's gradient in the backward pass, as the autograd engine hands them on
    (``Graph.grad_shares``) and sums them (``InputBuffer``'s ``accumulate``): a node's first gradient is
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
        self.param_owners = [[v] if graph.param_bytes[v] else [] for v in range(len(graph))]
        for v, sharers in enumerate(graph.param_sharers):
            for u in sharers:
                self.param_owners[u].append(v)
        self.params_made: set[int] = set()
        self.readers_left = {u: 0 for owners in self.param_owners for u in owners}  # backwards yet to make each
        for owners in self.param_owners:
            for u in owners:
                self.readers_left[u] += 1

    def params(self, v: int, frees: list) -> list:
        """The parameter gradients the backward of ``v`` makes: those of the parameters no backward has
        reached yet (``Graph.param_sharers``); they stay to the step's end, or go as that backward ends
        (``Graph.param_grads_released``: into ``frees``; a shared parameter's once the backward of its last
        reader is done, since autograd sums the contributions before it accumulates the gradient)."""
        owners = [u for u in self.param_owners[v] if u not in self.params_made]
        self.params_made.update(owners)
        if self.graph.param_grads_released:
            for u in self.param_owners[v]:
                self.readers_left[u] -= 1
                if not self.readers_left[u]:
                    frees.append((Buffer.PARAM_GRAD, u))
        return [((Buffer.PARAM_GRAD, u), self.graph.param_bytes[u]) for u in owners]

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
        hand on (``Graph.early_grads``) and their working ones, then what they free (the gradient received);
        and what they hold as the rest of the layer's backward starts, above what was live as it began."""
        handed, frees = self.backward(v, self.graph.early_grads[v])
        held = work + sum(size for _, size in handed) - sum(self.size[key] for key in frees)
        return handed + ([((Buffer.WORK, v), work)] if work else []), frees, held

    def backward(self, v: int, only=None) -> tuple[list, list]:
        """The backward of ``v``, or of the part of its layer that makes the gradients of the predecessors
        ``only``: the buffers it allocates, then those it frees (its own gradient's, unless handed on, and
        every contribution summed away)."""
        graph = self.graph
        handed = {}  # predecessor -> (buffer key, bytes; -1: v's own gradient's buffer)
        for i, (preds, size) in enumerate(graph.grad_shares[v]):
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
            if not graph.reached[u] or u in graph.preds_without_grad[v]:  # it takes no gradient (from v)
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


def forward_order(graph: Graph, stage_of: list[int]) -> list[int]:
    """The nodes in the order the executor's forward pass runs them: stage by stage, in program order within
    a stage, except that a node never runs before an earlier one that uses the same state
    (``Graph.shared_state``): it goes with the later stage, and so does what reads it."""
    key, last_use = [], {}
    for v in range(len(graph)):
        k = max([(stage_of[v], v)] + [key[u] for u in graph.preds[v]])
        k = max([k] + [last_use[name] for name in graph.shared_state[v] if name in last_use])
        last_use.update(dict.fromkeys(graph.shared_state[v], k))
        key.append(k)
    return sorted(range(len(graph)), key=lambda v: (key[v], v))


def schedule_timeline(graph: Graph, computed: tuple[int, ...], held: tuple[int, ...],
                      discarded: int | None = None) -> list[Step]:
    """The training step a general schedule (R, S; ``strategies/schedule.py``) describes, counted as
    ``timeline`` counts a stage plan's (NOTE [a schedule's replay]). ``discarded``: for a stage plan written
    as a schedule, the values it discards (by default, those the schedule computes again)."""
    n = len(graph)
    tg = schedule.training_graph(graph, loss_reads_outputs=False)
    size = 2 * n
    # The computation of each value whose autograd record its backward uses: the last one before it.
    recorded = [max(t for t in range(schedule.backward_node(n, v) + 1) if computed[t] >> v & 1) for v in range(n)]
    if discarded is None:
        discarded = sum(1 << v for v in range(n) if recorded[v] != v)
    last = [max(t for t in range(size) if computed[t] >> v & 1) for v in range(n)]  # its last computation
    gradients = _Gradients(graph)
    present = 0  # the forward values on the device
    steps = []

    def read_later(row: int, u: int, after: int, but: int = -1) -> bool:
        return any(row >> j & 1 for j in tg.users[u] if j > after and j != but)

    outputs = sum(1 << v for v in graph.outputs)  # here until the loss's forward: the model returns them
    # as is what the layers no gradient reaches saved (NOTE [what no gradient reaches] in harness/backward_profile.py)
    unreached_reads = sum(1 << u for w in graph.unreached for u in graph.backward_reads[w] if not discarded >> u & 1)
    outputs |= unreached_reads
    for t in range(size):
        held_next = held[t + 1] if t + 1 < size else 0
        row = computed[t]
        if t == n:  # the loss: its forward, then its backward; an output it reads stays to the turn's end
            reads = bits(graph.loss_reads)
            loss = [((Buffer.LOSS_FORWARD, -1), graph.loss_forward_bytes)] if graph.loss_forward_bytes else []
            gone = present & ~held[n] & ~reads
            unreached = [(Buffer.EXTRA, w) for w in graph.unreached
                         if graph.saved_extra_bytes[w] and not discarded >> w & 1]
            steps.append(Step(-1, Phase.FORWARD, tuple(loss), (*[(Buffer.VALUE, u) for u in members(gone)],
                                                            *[key for key, _ in loss], *unreached)))
            present &= ~gone
            turn = _turn(graph, gradients)
            # A Checkmate schedule lets the loss read nothing: an output it reads that is gone by now is
            # counted back for the turn alone, where the stage replay recomputes the output's stage.
            back = reads & ~present
            later = sum(1 << u for u in graph.loss_reads if read_later(row, u, -1))
            gone = back | present & reads & ~held[n] & ~later
            steps.append(dataclasses.replace(turn, allocs=(*turn.allocs, *(((Buffer.VALUE, u), graph.mem_bytes[u])
                                                                            for u in members(back))),
                                             frees=(*turn.frees, *((Buffer.VALUE, u) for u in members(gone)))))
            present &= ~gone
        v = schedule.backward_node(n, t) if t >= n else -1
        work = _working(graph, v) if v >= 0 else 0
        in_place_first = v >= 0 and graph.reached[v] and _in_place_first(graph, v, work)
        in_place_done = not in_place_first
        held_by_members = 0  # what the in-place members hold when the rest of the layer's backward starts

        def in_place_members(after: int):
            """A layer's in-place members run their backward first, as in ``_backward``: as soon as the
            value they read is here, before the recomputations its other reads call for."""
            nonlocal held_by_members
            made, early, held_by_members = gradients.in_place_members(v, work)
            if present >> v & 1 and not held_next >> v & 1 and not read_later(row, v, after, but=t):
                early.append((Buffer.VALUE, v))
            steps.append(Step(v, Phase.BACKWARD, tuple(made), tuple(early), call=False))
            return sum(1 << key[1] for key in early if key[0] == Buffer.VALUE)

        if not in_place_done and present >> v & 1:
            present &= ~in_place_members(-1)
            in_place_done = True
        for k in members(row):
            gone = [i for i in schedule.frees(tg, row, held_next, k) if i < n and present >> i & 1
                    and not (t < n and unreached_reads >> i & 1)]
            if k >= n and not graph.reached[v]:  # a backward that never runs
                present &= ~sum(1 << i for i in gone)
                steps.append(Step(v, Phase.BACKWARD, (), tuple((Buffer.VALUE, i) for i in gone), call=False))
                continue
            if k >= n:  # the backward of v
                if k != t:
                    raise ValueError(f"schedule_timeline: stage {t} computes backward node {k} again; autograd "
                                     "computes each gradient once (ilp_optimal's MILP is built so)")
                assert in_place_done, f"schedule: the backward of node {v} without its value"
                present &= ~sum(1 << i for i in gone)
                allocs, frees = gradients.backward(v, _after_members(graph, v) if in_place_first else None)
                allocs += gradients.params(v, frees)
                if work and v not in graph.backward_reads[v]:  # made after what it saved is read
                    allocs.append(((Buffer.WORK, v), work))
                allocs += _to_measured_peak(graph, v, held_by_members + sum(size for _, size in allocs), frees,
                                            set(gone))
                frees += [(Buffer.VALUE, i) for i in gone] + ([(Buffer.WORK, v)] if work else [])
                frees += [(Buffer.EXTRA, v)] if graph.saved_extra_bytes[v] else []
                steps.append(Step(v, Phase.BACKWARD, tuple(allocs), tuple(frees)))
                continue
            # A value: its first computation, or a recomputation.
            assert not present >> k & 1, f"schedule: stage {t} computes node {k} while holding it"
            allocs = [((Buffer.VALUE, k), graph.mem_bytes[k])]
            frees = [(Buffer.VALUE, i) for i in gone]
            if graph.saved_extra_bytes[k] and (recorded[k] == t or not graph.reached[k]):
                allocs.append(((Buffer.EXTRA, k), graph.saved_extra_bytes[k]))
                if not graph.reached[k] and not (t == k and not discarded >> k & 1):  # nothing reads it: it goes now
                    frees.append((Buffer.EXTRA, k))
            if graph.recompute_state_bytes[k]:  # the state as the first call found it, to the last one
                if t == k and last[k] != k:
                    allocs.append(((Buffer.STATE, k), graph.recompute_state_bytes[k]))
                elif t != k and t != last[k]:  # the state this call leaves, put back after it
                    allocs.append(((Buffer.STATE_AFTER, k), graph.recompute_state_bytes[k]))
                    frees.append((Buffer.STATE_AFTER, k))
                elif t != k:
                    frees.append((Buffer.STATE, k))
            _transient(graph, k, allocs, frees, first=t == k)
            steps += [] if t == k else _attribute_again(graph, k)
            present |= 1 << k
            # nothing reads it before its next computation (an output: the loss, at the turn)
            if not held_next >> k & 1 and not read_later(row, k, k) and not (t < n and outputs >> k & 1):
                frees.append((Buffer.VALUE, k))
            present &= ~sum(1 << i for kind, i in frees if kind == Buffer.VALUE)
            steps += _call(graph, k, Phase.FORWARD if t == k else Phase.RECOMPUTE, allocs, frees)
            if k == v and not in_place_done:
                present &= ~in_place_members(k)
                in_place_done = True
        leaving = present & ~held_next & ~(outputs if t < n else 0)
        if leaving:  # held for a reader the loss stood in for (Checkmate's outputs): gone now
            steps.append(Step(-1, Phase.FORWARD if t < n else Phase.BACKWARD, (),
                              tuple((Buffer.VALUE, u) for u in members(leaving))))
            present &= ~leaving
    steps.append(_end(graph, gradients))
    return steps


def _in_place_first(graph: Graph, v: int, work: int) -> bool:
    """Whether ``v``'s in-place members run their backward as a step of its own, before the rest of the
    layer's: they read ``v``'s value and make working gradients or hand gradients on."""
    return bool(work or graph.early_grads[v]) and v in graph.backward_reads[v]


def _after_members(graph: Graph, v: int) -> list[int]:
    """The predecessors whose gradients the rest of ``v``'s layer makes, after its in-place members."""
    return [u for u in graph.preds[v] if u not in graph.early_grads[v]]


def backward_holds(graph: Graph, v: int) -> tuple[int, int | None]:
    """What the backward of ``v``'s layer holds, whatever the plan, above what was live as it began: at the step
    that makes its gradients, the lesser of the two peaks that step may be brought to (NOTE [a layer's backward
    peak]; 0 where not measured); and where its in-place members run their backward first, at their step (which
    may read ``v``'s value last), their working gradients, else None."""
    work = _working(graph, v)
    first = work if _in_place_first(graph, v, work) else None
    if graph.backward_peak_bytes is None:
        return 0, first
    peak = graph.backward_peak_bytes[v]
    if graph.backward_frees is not None and graph.backward_frees[v][0]:
        peak = min(peak, graph.backward_frees[v][1])
    return max(peak, 0), first


def _working(graph: Graph, v: int) -> int:
    """The working gradients of ``v``'s in-place members (NOTE [a layer's backward peak])."""
    peaks = graph.backward_peak_bytes
    return graph.backward_work_bytes[v] if peaks is None else min(graph.backward_work_bytes[v], peaks[v])


def _to_measured_peak(graph: Graph, v: int, held: int, frees: list, released: set[int]) -> list:
    """The entry that brings the replay's backward of ``v`` to the peak its layer's backward measured (NOTE
    [a layer's backward peak]), going with the step: negative where the layer has freed by then what the
    replay still holds, positive where it holds what the replay does not see (a product's backward makes
    the whole product before it sums it down to a broadcast scalar's gradient); ``held`` is what the
    replay's backward of ``v`` holds then above what was live as it began, values aside. Where the step
    releases every value the layer's backward freed as it ran (``released``), the peak is the one with
    them going as they went (``Graph.backward_frees``)."""
    if graph.backward_peak_bytes is None:
        return []
    peak = graph.backward_peak_bytes[v]
    if graph.backward_frees is not None:
        freed, freeing_peak = graph.backward_frees[v]
        if freed and released.issuperset(freed):
            peak = freeing_peak
    if held == peak:
        return []
    frees.append((Buffer.MEASURED, v))
    return [((Buffer.MEASURED, v), peak - held)]


def _held_at_unpack(graph: Graph, v: int, missing) -> int:
    """What the backward of ``v``'s layer holds, above what was live as it began, when it first unpacks
    a value for which ``missing`` is true (``Graph.unpack_held_bytes``; 0 where not measured)."""
    for u, held in graph.unpack_held_bytes[v] if graph.unpack_held_bytes is not None else ():
        if missing(u):
            return held
    return 0


def _call(graph: Graph, v: int, phase: str, allocs: list, frees: list) -> list[Step]:
    """A call of ``v``'s layer: its allocations, then its frees; in two steps where its extras come after
    the values that go at it have gone (``Graph.extras_after_reads``)."""
    if not (graph.extras_after_reads and graph.extras_after_reads[v]):
        return [Step(v, phase, tuple(allocs), tuple(frees))]
    extra = [alloc for alloc in allocs if alloc[0] == (Buffer.EXTRA, v)]
    inputs_gone = [key for key in frees if key[0] in (Buffer.VALUE, Buffer.COPY) and key[1] != v]
    return [Step(v, phase, tuple(alloc for alloc in allocs if alloc not in extra), tuple(inputs_gone)),
            Step(v, phase, tuple(extra), tuple(key for key in frees if key not in inputs_gone), call=False)]


def _transient(graph: Graph, v: int, allocs: list, frees: list, first: bool):
    """What a call of ``v``'s layer holds while it runs above what it leaves (``Graph.forward_transient_bytes``):
    gone by the step's end; and what it leaves on a module (``Graph.attribute_bytes``), from its ``first``
    call to the step's end (a later call's is ``_attribute_again``)."""
    if graph.forward_transient_bytes is not None and graph.forward_transient_bytes[v]:
        allocs.append(((Buffer.TRANSIENT, v), graph.forward_transient_bytes[v]))
        frees.append((Buffer.TRANSIENT, v))
    if graph.attribute_bytes[v] and first:
        allocs.append(((Buffer.ATTRIBUTE, v), graph.attribute_bytes[v]))


def _attribute_again(graph: Graph, v: int) -> list[Step]:
    """Before a later call of ``v``'s layer runs, its pre-hook makes the module's attribute again, and
    setting it frees the one before (NOTE [tensors a module keeps] in ``harness/probe.py``): both are
    there for that moment alone, before the layer allocates anything."""
    if not graph.attribute_bytes[v]:
        return []
    key = (Buffer.ATTRIBUTE_AGAIN, v)
    return [Step(v, Phase.RECOMPUTE, ((key, graph.attribute_bytes[v]),), (key,), call=False)]


def _turn(graph: Graph, gradients: "_Gradients", fetched=(), loss_held: bool = True) -> Step:
    """From forward to backward: the swapped values fetched at once, the loss's buffers and the loss's
    gradients with respect to the outputs come; the loss's working buffers go, its value stays
    (``loss_held``: it comes here, not before)."""
    outputs = [v for v in graph.outputs if graph.reached[v]]  # the others take no gradient
    for v in outputs:
        gradients.hold(v, (Buffer.GRAD, v), graph.loss_grad_bytes[v])
    allocs = [*fetched, *(((Buffer.GRAD, v), graph.loss_grad_bytes[v]) for v in outputs)]
    allocs += [((Buffer.LOSS, -1), graph.loss_bytes)] if graph.loss_bytes else []
    allocs += [((Buffer.LOSS_HELD, -1), graph.loss_held_bytes)] if graph.loss_held_bytes and loss_held else []
    return Step(-1, Phase.BACKWARD, tuple(allocs), ((Buffer.LOSS, -1),) if graph.loss_bytes else ())


def _end(graph: Graph, gradients: "_Gradients") -> Step:
    """Parameter gradients outlive the step (the optimizer reads them), as do the loss's value and what
    modules keep (``Graph.attribute_bytes``): freed at the end for the tally."""
    kept = sorted(u for u in gradients.params_made if not graph.param_grads_released or gradients.readers_left[u])
    return Step(-1, Phase.BACKWARD, (), tuple([*((Buffer.PARAM_GRAD, u) for u in kept),
                                          *((Buffer.ATTRIBUTE, v) for v in range(len(graph))
                                            if graph.attribute_bytes[v]),
                                          *([(Buffer.LOSS_HELD, -1)] if graph.loss_held_bytes else [])]))


def _recompute_stage(graph: Graph, facts: _Facts, s: int, nodes: list[int], live: _Residency) -> list[Step]:
    """Stage ``s``'s recomputation of ``nodes`` (in order; ``n + u``: the rebuilt copy of kept ``u``): each
    call's value, extras and transients, every input freed after its last reader in the stage if nothing
    else reads it, and then the kept values whose last reader this stage was."""
    n, copy, checkpointed = facts.n, facts.copy, bool(facts.plan.checkpointed >> s & 1)
    present, stages_left, release_if_done = live.present, live.stages_left, live.release_if_done
    reads = {w: [copy(u, w % n) for u in graph.preds[w % n]] for w in nodes}
    in_stage_uses = {w: 0 for w in nodes}
    for w in nodes:
        for u in reads[w]:
            if u in in_stage_uses:
                in_stage_uses[u] += 1
    steps = []
    for w in nodes:
        o = w % n
        present[w] = True
        frees = []
        for u in reads[w]:
            if u in in_stage_uses:
                in_stage_uses[u] -= 1
        for u in reads[w]:
            if u in in_stage_uses and in_stage_uses[u] == 0:
                release_if_done(u, frees)
        if in_stage_uses[w] == 0:
            release_if_done(w, frees)
        allocs = [(_key(w, n), graph.mem_bytes[o])]
        if graph.saved_extra_bytes[o]:
            allocs.append(((Buffer.EXTRA, o), graph.saved_extra_bytes[o]))
            if not graph.reached[o]:  # it reruns with autograd off, and what it would save goes at once
                frees.append((Buffer.EXTRA, o))
        if graph.recompute_state_bytes[o]:  # the state as its forward found it, put back after the call
            if checkpointed:  # ``batchnorm_once``'s copies, made now
                allocs.append(((Buffer.STATE, o), graph.recompute_state_bytes[o]))
            frees.append((Buffer.STATE, o))
        _transient(graph, o, allocs, frees, first=False)
        steps += _attribute_again(graph, o)
        steps += _call(graph, o, Phase.RECOMPUTE, allocs, frees)
    for u in range(n):
        if s in stages_left[u]:  # this stage's recomputation was the last reader of a kept value
            stages_left[u].discard(s)
            frees = []
            release_if_done(u, frees)
            if frees:
                steps.append(Step(u, Phase.RECOMPUTE, (), tuple(frees), call=False))
    return steps
