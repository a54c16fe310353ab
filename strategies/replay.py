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

The parts both this replay and a schedule's (``schedule_replay.py``) make a step of are in ``replay_steps.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.graph import Graph, bits, members
from strategies.plan import Plan
from strategies.replay_steps import (Buffer, Phase, Step, _Gradients, _after_members, _attribute_again, _call, _end,
                                     _held_at_unpack, _in_place_first, _key, _to_measured_peak, _transient, _turn,
                                     _working, backward_holds, peak_layer, peak_of)

__all__ = ["Buffer", "Phase", "Step", "backward_holds", "called_for", "forward_order", "peak_layer", "peak_of",
           "timeline"]


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
        for u in graph.profile.backward_reads[v] if graph.profile.reached[v] else ():
            readers[copy(u, v)].append(v)
    for u in graph.profile.loss_reads:
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
    found = {v for v in members(remade) if graph.profile.recompute_state_bytes[v]}
    # The executor holds the kept values an output's stage starts from to the end of the forward pass: only
    # the loss's saves tell whether its backward reads an output (a step may run another loss than the trace).
    ends = {stage_of[v] for v in graph.outputs} - needed
    to_loss = {u for u in members(kept) if not recompute_stages[u]
               and any(stage_of[w] in ends and (discarded & ~in_checkpoint) >> w & 1 for w in graph.succs[u])}
    # What the layers no gradient reaches saved goes at the loss's forward (NOTE [what no gradient reaches]
    # in harness/tracing/backward_profile.py): the kept values they read, and their extras.
    for w in graph.profile.unreached:
        if not in_checkpoint >> w & 1:
            to_loss.update(u for u in graph.profile.backward_reads[w] if (kept & ~plan.swapped) >> u & 1)
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
    read = graph.read_by_backward() | set(graph.profile.loss_reads)
    stage_of = plan.stage_of(len(graph))
    return {stage_of[u] for u in members(plan.recomputed)
            if u in read or graph.profile.reached[u] and graph.saves_more(u)}


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
    profile = graph.profile
    sharing = {u for sharers in profile.param_sharers for u in sharers}
    return [v for v in members(stage)
            if profile.backward_reads[v] or profile.saved_extra_bytes[v] or profile.param_bytes[v] or v in sharing]


def _rerun_end(graph: Graph, stage: int) -> int:
    """Where ``torch.utils.checkpoint`` stops a recomputation of ``stage`` (its early stop): the nodes
    before the index returned run. It stops once the last tensor the block saved is saved again, and a
    layer saves its inputs (and parameters) before it runs, its output and what else it makes after: a
    last saving layer that saves nothing it makes does not run (a DenseNet layer's last convolution;
    counted as run, the replay charged DenseNet-161's blocks 1.67x the FLOPs they recompute)."""
    last = max(_saving(graph, stage), default=-1)
    if last >= 0 and last not in graph.profile.backward_reads[last] and not graph.saves_more(last):
        return last
    return last + 1


def _first_saving(graph: Graph, stage: int) -> int:
    return min(_saving(graph, stage), default=-1)


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
            allocs.append(((Buffer.STATE, v), graph.profile.recompute_state_bytes[v]))
        if graph.profile.saved_extra_bytes[v]:
            allocs.append(((Buffer.EXTRA, v), graph.profile.saved_extra_bytes[v]))
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
    loss = [((Buffer.LOSS_FORWARD, -1), graph.profile.loss_forward_bytes)] if graph.profile.loss_forward_bytes else []
    frees = [(Buffer.VALUE, v) for v in sorted(last) if not held(v)] + [(Buffer.STATE, v) for v in unread]
    frees += [(Buffer.EXTRA, v) for v in graph.profile.unreached
              if graph.profile.saved_extra_bytes[v] and saves >> v & 1]
    steps.append(Step(-1, Phase.FORWARD, tuple(loss), tuple(frees + [key for key, _ in loss])))
    return steps


def _backward(graph: Graph, facts: _Facts, frame_holds: dict[int, list[int]]) -> list[Step]:
    """The backward pass, from the loss's backward (the turn) to the step's end: each node's backward in the
    reverse of the forward's order, a stage's recomputation where a backward first calls for one of its
    discarded values (NOTE [what a recomputation makes]), swapped values fetched at their ``prefetch``
    node, and every value freed as its last reader finishes (``_Residency``). ``frame_holds``: where a
    checkpointed stage's inputs go (``_frame_holds``)."""
    backward = _BackwardPass(graph, facts, frame_holds)
    backward.turn()
    for v in reversed(facts.order):
        if graph.profile.reached[v]:  # else its backward never runs
            backward.layer(v)
    backward.steps.append(_end(graph, backward.gradients))
    return backward.steps


class _BackwardPass:
    """The state of ``_backward`` as it goes: what is live (``_Residency``), the stages recomputed, the layers whose
    backward has run, whose extras are held, and the steps so far."""

    def __init__(self, graph: Graph, facts: _Facts, frame_holds: dict[int, list[int]]):
        self.graph, self.facts, self.frame_holds = graph, facts, frame_holds
        plan = facts.plan
        self.live = _Residency(facts, frame_holds)
        self.fetched_at: dict[int, list[int]] = {}  # backward node (-1: the start) -> the swapped values it fetches
        for u, trigger in plan.prefetch:
            if facts.readers[u]:
                self.fetched_at.setdefault(trigger, []).append(u)
        self.gradients = _Gradients(graph)
        self.steps: list[Step] = []
        self.recomputed: set[int] = set()
        self.backward_done: set[int] = set()
        self.never = graph.never_recomputed()
        self.extras_present = [bool(graph.saves_more(v) and (plan.kept & ~facts.in_checkpoint | plan.selective) >> v & 1
                                    and graph.profile.reached[v])
                               for v in range(facts.n)]

    def fetch(self, trigger: int) -> list:
        for u in self.fetched_at.get(trigger, ()):
            self.live.present[u] = True
        return [((Buffer.VALUE, u), self.graph.mem_bytes[u]) for u in self.fetched_at.get(trigger, ())]

    def recompute(self, stages: set[int]) -> None:
        graph, facts, plan, n = self.graph, self.facts, self.facts.plan, self.facts.n
        discarded, readers_left = facts.discarded, self.live.readers_left
        for s in sorted(stages - self.recomputed):
            self.recomputed.add(s)
            made = plan.stages[s] & discarded
            if not plan.checkpointed >> s & 1:  # NOTE [what a recomputation makes]
                wanted = bits(u for u in members(made) if readers_left[u]
                              or graph.profile.reached[u] and graph.saves_more(u) and u not in self.backward_done)
                made = graph.with_inputs_within(wanted, made)
                unmade = [u for u in members(plan.stages[s] & discarded & ~made & ~self.never)
                          if graph.profile.recompute_state_bytes[u]]
                if unmade:  # the state their forward calls found goes
                    self.steps.append(Step(-1, Phase.RECOMPUTE, (), tuple((Buffer.STATE, u) for u in unmade)))
            nodes = members(made) + [u + n for u in members(plan.stages[s] & facts.rebuilt)]
            if plan.checkpointed >> s & 1:  # early stop: nothing after the last layer that saves
                end = _rerun_end(graph, plan.stages[s])
                nodes = [w for w in nodes if w % n < end]
            nodes.sort(key=lambda w: w % n)
            self.steps.extend(_recompute_stage(graph, facts, s, nodes, self.live))
            for w in nodes:
                self.extras_present[w % n] = bool(graph.saves_more(w % n) and graph.profile.reached[w % n])

    def turn(self) -> None:
        """The loss's backward. It reads the outputs it saved; one the plan discarded comes back with its stage, on
        top of the loss's value and the seed gradient ``backward`` made first."""
        graph, present = self.graph, self.live.present
        fetched = self.fetch(-1)
        read_back = {self.facts.stage_of[u] for u in graph.profile.loss_reads if not present[u]}
        unpacking = graph.profile.loss_unpack_bytes - graph.profile.loss_held_bytes if read_back else 0
        if read_back and (graph.profile.loss_held_bytes or unpacking > 0):
            held = [((Buffer.LOSS_HELD, -1), graph.profile.loss_held_bytes)] if graph.profile.loss_held_bytes else []
            held += [((Buffer.LOSS_UNPACKING, -1), unpacking)] if unpacking > 0 else []
            self.steps.append(Step(-1, Phase.BACKWARD, tuple(held), ()))
        self.recompute(read_back)
        if unpacking > 0:
            self.steps.append(Step(-1, Phase.BACKWARD, (), ((Buffer.LOSS_UNPACKING, -1),)))
        turn = _turn(graph, self.gradients, fetched, loss_held=not (read_back and graph.profile.loss_held_bytes))
        frees = list(turn.frees)
        for u in graph.profile.loss_reads:
            self.live.read(u, frees)
        self.steps.append(dataclasses.replace(turn, frees=tuple(frees)))

    def layer(self, v: int) -> None:
        """The backward of layer ``v``: what it fetches, the recomputation it calls for, its gradients."""
        graph, facts, live, steps = self.graph, self.facts, self.live, self.steps
        present, stage_of, copy, n = live.present, facts.stage_of, facts.copy, facts.n
        fetched = self.fetch(v)
        if fetched:
            steps.append(Step(v, Phase.SWAP_IN, tuple(fetched), ()))
        reads = [copy(u, v) for u in graph.profile.backward_reads[v]]
        own = copy(v, v)  # the value v's in-place members read
        work = _working(graph, v)
        if own in reads and not present[own]:
            self.recompute({stage_of[v]})
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
            # ReLU) make it here too (``Profile.early_grads``), before the rest of the layer reads its inputs.
            reads = [u for u in reads if u != own]
            made, early, held = self.gradients.in_place_members(v, work)
            live.read(own, early)
            steps.append(Step(v, Phase.BACKWARD, tuple(made), tuple(early), call=False))
        missing = {stage_of[u % n] for u in reads if not present[u]}
        assert all(present[u] for u in reads if facts.plan.swapped >> u & 1), \
            f"simulator: the backward of node {v} reads a swapped value before its prefetch"
        extras_missing = bool(graph.saves_more(v) and not self.extras_present[v])
        if extras_missing:
            missing.add(stage_of[v])
        # The layer's backward may run a while before it unpacks what it must wait for (NOTE [a layer's
        # backward peak]): the recomputation runs on top of what it holds by then, less than was live as it began
        # where it has freed more than it made (an LSTM run step by step, its second layer's extras gone).
        own_missing = not in_place_first and own in reads and not present[own]
        unpacking = _held_at_unpack(graph, v, lambda u: own_missing or extras_missing if u == v
                                    else not present[copy(u, v)]) - held if missing else 0
        if unpacking:
            steps.append(Step(v, Phase.BACKWARD, (((Buffer.UNPACKING, v), unpacking),), (), call=False))
        self.recompute(missing)
        if unpacking:
            steps.append(Step(v, Phase.BACKWARD, (), ((Buffer.UNPACKING, v),), call=False))
        self.finish(v, reads, work, held, in_place_first)

    def finish(self, v: int, reads: list[int], work: int, held: int, in_place_first: bool) -> None:
        """Layer ``v``'s gradients made, what it read let go of, its extras and working gradients gone."""
        graph, live = self.graph, self.live
        allocs, frees = self.gradients.backward(v, _after_members(graph, v) if in_place_first else None)
        allocs += self.gradients.params(v, frees)
        if work and not in_place_first:
            allocs.append(((Buffer.WORK, v), work))
        for u in reads + self.frame_holds.get(v, []):
            live.read(u, frees)
        released = {key[1] for key in frees if key[0] == Buffer.VALUE}
        allocs += _to_measured_peak(graph, v, held + sum(size for _, size in allocs), frees, released)
        if work:
            frees.append((Buffer.WORK, v))
        if self.extras_present[v]:
            frees += [(Buffer.EXTRA, v)] if graph.profile.saved_extra_bytes[v] else []
            self.extras_present[v] = False
        self.steps.append(Step(v, Phase.BACKWARD, tuple(allocs), tuple(frees)))
        self.backward_done.add(v)


def forward_order(graph: Graph, stage_of: list[int]) -> list[int]:
    """The nodes in the order the executor's forward pass runs them: stage by stage, in program order within
    a stage, except that a node never runs before an earlier one that uses the same state
    (``Profile.shared_state``): it goes with the later stage, and so does what reads it."""
    key, last_use = [], {}
    for v in range(len(graph)):
        k = max([(stage_of[v], v)] + [key[u] for u in graph.preds[v]])
        k = max([k] + [last_use[name] for name in graph.profile.shared_state[v] if name in last_use])
        last_use.update(dict.fromkeys(graph.profile.shared_state[v], k))
        key.append(k)
    return sorted(range(len(graph)), key=lambda v: (key[v], v))


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
        if graph.profile.saved_extra_bytes[o]:
            allocs.append(((Buffer.EXTRA, o), graph.profile.saved_extra_bytes[o]))
            if not graph.profile.reached[o]:  # it reruns with autograd off, and what it would save goes at once
                frees.append((Buffer.EXTRA, o))
        if graph.profile.recompute_state_bytes[o]:  # the state as its forward found it, put back after the call
            if checkpointed:  # ``batchnorm_once``'s copies, made now
                allocs.append(((Buffer.STATE, o), graph.profile.recompute_state_bytes[o]))
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
