"""The training step a general schedule (R, S; ``strategies/schedule.py``) describes, counted as the stage
replay counts a plan's (``replay.timeline``).

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
gradient reaches] in ``harness/tracing/backward_profile.py``). A schedule cannot tell a value a stage plan discards
but never recomputes (its stage is not recomputed, or what is is made without it: NOTE [what a recomputation makes])
from a kept one, and holds what such a layer saved of it: above the stage replay, never below, unless it is
told which values the plan discards (``discarded``).
"""

from __future__ import annotations

import dataclasses

from strategies import schedule
from strategies.graph import Graph, bits, members
from strategies.replay_steps import (Buffer, Phase, Step, _Gradients, _after_members, _attribute_again, _call, _end,
                                     _in_place_first, _to_measured_peak, _transient, _turn, _working)


def schedule_timeline(graph: Graph, computed: tuple[int, ...], held: tuple[int, ...],
                      discarded: int | None = None) -> list[Step]:
    """The training step a general schedule (R, S; ``strategies/schedule.py``) describes, counted as
    ``timeline`` counts a stage plan's (NOTE [a schedule's replay]). ``discarded``: for a stage plan written
    as a schedule, the values it discards (by default, those the schedule computes again)."""
    replay = _ScheduleReplay(graph, computed, held, discarded)
    for t in range(2 * len(graph)):
        replay.stage(t)
    replay.steps.append(_end(graph, replay.gradients))
    return replay.steps


class _ScheduleReplay:
    """The state of ``schedule_timeline`` as it goes: the forward values on the device (``present``), the
    gradients, the steps so far."""

    def __init__(self, graph: Graph, computed: tuple[int, ...], held: tuple[int, ...], discarded: int | None):
        n = self.n = len(graph)
        self.graph, self.computed, self.held = graph, computed, held
        self.tg = schedule.training_graph(graph, loss_reads_outputs=False)
        # The computation of each value whose autograd record its backward uses: the last one before it.
        self.recorded = [max(t for t in range(schedule.backward_node(n, v) + 1) if computed[t] >> v & 1)
                         for v in range(n)]
        if discarded is None:
            discarded = sum(1 << v for v in range(n) if self.recorded[v] != v)
        self.discarded = discarded
        self.last = [max(t for t in range(2 * n) if computed[t] >> v & 1) for v in range(n)]  # its last computation
        self.gradients = _Gradients(graph)
        self.present = 0  # the forward values on the device
        self.steps: list[Step] = []
        # here until the loss's forward: the model returns them, as is what the layers no gradient reaches saved
        # (NOTE [what no gradient reaches] in harness/tracing/backward_profile.py)
        self.unreached_reads = sum(1 << u for w in graph.profile.unreached for u in graph.profile.backward_reads[w]
                                   if not discarded >> u & 1)
        self.outputs = sum(1 << v for v in graph.outputs) | self.unreached_reads

    def read_later(self, row: int, u: int, after: int, but: int = -1) -> bool:
        return any(row >> j & 1 for j in self.tg.users[u] if j > after and j != but)

    def stage(self, t: int) -> None:
        graph, n = self.graph, self.n
        held_next = self.held[t + 1] if t + 1 < 2 * n else 0
        row = self.computed[t]
        if t == n:
            self.loss(row)
        v = schedule.backward_node(n, t) if t >= n else -1
        work = _working(graph, v) if v >= 0 else 0
        in_place_first = v >= 0 and graph.profile.reached[v] and _in_place_first(graph, v, work)
        in_place_done = not in_place_first
        self.held_by_members = 0  # what the in-place members hold when the rest of the layer's backward starts
        if not in_place_done and self.present >> v & 1:
            self.present &= ~self.in_place_members(t, v, work, row, held_next, -1)
            in_place_done = True
        for k in members(row):
            gone = [i for i in schedule.frees(self.tg, row, held_next, k) if i < n and self.present >> i & 1
                    and not (t < n and self.unreached_reads >> i & 1)]
            if k >= n and not graph.profile.reached[v]:  # a backward that never runs
                self.present &= ~sum(1 << i for i in gone)
                self.steps.append(Step(v, Phase.BACKWARD, (), tuple((Buffer.VALUE, i) for i in gone), call=False))
                continue
            if k >= n:  # the backward of v
                if k != t:
                    raise ValueError(f"schedule_timeline: stage {t} computes backward node {k} again; autograd "
                                     "computes each gradient once (ilp_optimal's MILP is built so)")
                assert in_place_done, f"schedule: the backward of node {v} without its value"
                self.backward(v, work, in_place_first, gone)
                continue
            self.value(t, k, row, held_next, gone)
            if k == v and not in_place_done:
                self.present &= ~self.in_place_members(t, v, work, row, held_next, k)
                in_place_done = True
        leaving = self.present & ~held_next & ~(self.outputs if t < n else 0)
        if leaving:  # held for a reader the loss stood in for (Checkmate's outputs): gone now
            self.steps.append(Step(-1, Phase.FORWARD if t < n else Phase.BACKWARD, (),
                                   tuple((Buffer.VALUE, u) for u in members(leaving))))
            self.present &= ~leaving

    def loss(self, row: int) -> None:
        """The loss: its forward, then its backward; an output it reads stays to the turn's end."""
        graph, held = self.graph, self.held
        reads = bits(graph.profile.loss_reads)
        forward = graph.profile.loss_forward_bytes
        loss = [((Buffer.LOSS_FORWARD, -1), forward)] if forward else []
        gone = self.present & ~held[self.n] & ~reads
        unreached = [(Buffer.EXTRA, w) for w in graph.profile.unreached
                     if graph.profile.saved_extra_bytes[w] and not self.discarded >> w & 1]
        self.steps.append(Step(-1, Phase.FORWARD, tuple(loss), (*[(Buffer.VALUE, u) for u in members(gone)],
                                                                *[key for key, _ in loss], *unreached)))
        self.present &= ~gone
        turn = _turn(graph, self.gradients)
        # A Checkmate schedule lets the loss read nothing: an output it reads that is gone by now is
        # counted back for the turn alone, where the stage replay recomputes the output's stage.
        back = reads & ~self.present
        later = sum(1 << u for u in graph.profile.loss_reads if self.read_later(row, u, -1))
        gone = back | self.present & reads & ~held[self.n] & ~later
        self.steps.append(dataclasses.replace(turn, allocs=(*turn.allocs, *(((Buffer.VALUE, u), graph.mem_bytes[u])
                                                                             for u in members(back))),
                                              frees=(*turn.frees, *((Buffer.VALUE, u) for u in members(gone)))))
        self.present &= ~gone

    def in_place_members(self, t: int, v: int, work: int, row: int, held_next: int, after: int) -> int:
        """A layer's in-place members run their backward first, as in ``_backward``: as soon as the value they
        read is here, before the recomputations its other reads call for. Returns the values they let go of."""
        made, early, self.held_by_members = self.gradients.in_place_members(v, work)
        if self.present >> v & 1 and not held_next >> v & 1 and not self.read_later(row, v, after, but=t):
            early.append((Buffer.VALUE, v))
        self.steps.append(Step(v, Phase.BACKWARD, tuple(made), tuple(early), call=False))
        return sum(1 << key[1] for key in early if key[0] == Buffer.VALUE)

    def backward(self, v: int, work: int, in_place_first: bool, gone: list[int]) -> None:
        graph, gradients = self.graph, self.gradients
        self.present &= ~sum(1 << i for i in gone)
        allocs, frees = gradients.backward(v, _after_members(graph, v) if in_place_first else None)
        allocs += gradients.params(v, frees)
        if work and v not in graph.profile.backward_reads[v]:  # made after what it saved is read
            allocs.append(((Buffer.WORK, v), work))
        allocs += _to_measured_peak(graph, v, self.held_by_members + sum(size for _, size in allocs), frees,
                                    set(gone))
        frees += [(Buffer.VALUE, i) for i in gone] + ([(Buffer.WORK, v)] if work else [])
        frees += [(Buffer.EXTRA, v)] if graph.profile.saved_extra_bytes[v] else []
        self.steps.append(Step(v, Phase.BACKWARD, tuple(allocs), tuple(frees)))

    def value(self, t: int, k: int, row: int, held_next: int, gone: list[int]) -> None:
        """A value: its first computation, or a recomputation."""
        graph, n = self.graph, self.n
        assert not self.present >> k & 1, f"schedule: stage {t} computes node {k} while holding it"
        allocs = [((Buffer.VALUE, k), graph.mem_bytes[k])]
        frees = [(Buffer.VALUE, i) for i in gone]
        if graph.profile.saved_extra_bytes[k] and (self.recorded[k] == t or not graph.profile.reached[k]):
            allocs.append(((Buffer.EXTRA, k), graph.profile.saved_extra_bytes[k]))
            # nothing reads it: it goes now
            if not graph.profile.reached[k] and not (t == k and not self.discarded >> k & 1):
                frees.append((Buffer.EXTRA, k))
        if graph.profile.recompute_state_bytes[k]:  # the state as the first call found it, to the last one
            if t == k and self.last[k] != k:
                allocs.append(((Buffer.STATE, k), graph.profile.recompute_state_bytes[k]))
            elif t != k and t != self.last[k]:  # the state this call leaves, put back after it
                allocs.append(((Buffer.STATE_AFTER, k), graph.profile.recompute_state_bytes[k]))
                frees.append((Buffer.STATE_AFTER, k))
            elif t != k:
                frees.append((Buffer.STATE, k))
        _transient(graph, k, allocs, frees, first=t == k)
        self.steps += [] if t == k else _attribute_again(graph, k)
        self.present |= 1 << k
        # nothing reads it before its next computation (an output: the loss, at the turn)
        if not held_next >> k & 1 and not self.read_later(row, k, k) and not (t < n and self.outputs >> k & 1):
            frees.append((Buffer.VALUE, k))
        self.present &= ~sum(1 << i for kind, i in frees if kind == Buffer.VALUE)
        self.steps += _call(graph, k, Phase.FORWARD if t == k else Phase.RECOMPUTE, allocs, frees)
