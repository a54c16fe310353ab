"""Checkmate's schedules (Jain et al. 2020): the training step as an explicit
graph of 2n nodes, a schedule as the matrices R and S over it, and its memory by Checkmate's accounting.

The training graph of an IR ``Graph`` with n nodes: node ``v < n`` is the forward of IR node ``v``; node
``backward_node(n, v) = 2n - 1 - v`` is the backward of IR node ``v``, which reads the gradients its
successors' backwards produced, the forward values ``graph.profile.backward_reads[v]`` (and, for an output, its
value, which the loss reads), and produces the gradients of its inputs: ``sum(mem_bytes[u] for u in
preds[v])`` bytes. Index order is a topological order: the forward in node order, then the backward in
reverse.

A schedule has T = 2n stages; stage t computes node t for the first time (frontier-advancing) and may
recompute earlier ones. ``computed[t]`` (a bitset: R's row) is what stage t computes, in index order;
``held[t]`` (S's row) is what is in memory on entry to stage t. Memory (``peak``) is Checkmate's ILP
accounting: on entry, the held values; computing node k adds its output; after it, an input i of k is freed
when no later node of the stage reads i and stage t+1 does not hold it. Parameter gradients are a constant
the caller adds, as for Kusumoto et al.'s model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strategies.graph import Graph, members
from strategies.plan import Plan


@dataclass(frozen=True, slots=True)
class TrainingGraph:
    deps: tuple[tuple[int, ...], ...]  # the nodes each node reads, in index order
    users: tuple[tuple[int, ...], ...]
    mem: tuple[int, ...]
    cost: tuple[float, ...]  # a backward costs twice its forward (Checkmate's cost model)


def backward_node(n: int, v: int) -> int:
    return 2 * n - 1 - v


def training_graph(graph: Graph, loss_reads_outputs: bool = True) -> TrainingGraph:
    """``loss_reads_outputs``: Checkmate's model, where an output's backward reads it (the loss's
    gradient); without it, as the executor runs, the loss reads the outputs at once and an output stays
    only if its own layer's backward reads it (``replay.schedule_timeline``)."""
    n = len(graph)
    deps: list[set[int]] = [set(graph.preds[v]) for v in range(n)] + [set() for _ in range(n)]
    mem = list(graph.mem_bytes) + [0] * n
    cost = list(graph.cost) + [0.0] * n
    for v in range(n):
        b = backward_node(n, v)
        # an unreached backward reads nothing
        reads = graph.profile.backward_reads[v] if graph.profile.reached[v] else ()
        deps[b] |= {backward_node(n, w) for w in graph.succs[v]} | set(reads)
        if not graph.succs[v] and loss_reads_outputs:
            deps[b].add(v)  # the loss reads the output
        mem[b] = sum(graph.mem_bytes[u] for u in graph.preds[v])
        cost[b] = 2 * graph.cost[v]
    users: list[list[int]] = [[] for _ in range(2 * n)]
    for k, ds in enumerate(deps):
        for i in ds:
            users[i].append(k)
    return TrainingGraph(deps=tuple(tuple(sorted(d)) for d in deps), users=tuple(tuple(sorted(u)) for u in users),
                         mem=tuple(mem), cost=tuple(cost))


def frees(tg: TrainingGraph, computed: int, held_next: int, k: int) -> list[int]:
    """The inputs of node k (computed in a stage that computes ``computed``) freed right after it."""
    return [i for i in tg.deps[k] if not held_next >> i & 1
            and not any(computed >> j & 1 for j in tg.users[i] if j > k)]


def validate(tg: TrainingGraph, computed: tuple[int, ...], held: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless (R, S) is a frontier-advancing schedule whose reads are all present."""
    size = len(tg.mem)
    if len(computed) != size or len(held) != size:
        raise ValueError(f"schedule: {size} stages expected, got {len(computed)} and {len(held)}")
    for t in range(size):
        if not computed[t] >> t & 1 or computed[t] >> (t + 1) or held[t] >> t:
            raise ValueError(f"schedule: stage {t} must compute node {t} and nothing after it, nor hold it")
        if t + 1 < size and held[t + 1] & ~(held[t] | computed[t]):
            raise ValueError(f"schedule: stage {t + 1} holds a value stage {t} neither held nor computed")
        present = held[t]
        for k in members(computed[t]):
            missing = [i for i in tg.deps[k] if not present >> i & 1]
            if missing:
                raise ValueError(f"schedule: stage {t} computes node {k} without its input {missing[0]}")
            present |= 1 << k


def peak(tg: TrainingGraph, computed: tuple[int, ...], held: tuple[int, ...]) -> int:
    """The schedule's peak bytes by the ILP's accounting (U in ``chen_checkmate.md`` section 2.8)."""
    top = 0
    for t in range(len(computed)):
        held_next = held[t + 1] if t + 1 < len(held) else 0
        live = sum(tg.mem[i] for i in members(held[t]))
        for k in members(computed[t]):
            live += tg.mem[k]
            top = max(top, live)
            live -= sum(tg.mem[i] for i in frees(tg, computed[t], held_next, k))
    return top


def cost(tg: TrainingGraph, computed: tuple[int, ...]) -> float:
    """Recomputation overhead: the cost of every computation beyond the first of each node."""
    return sum(tg.cost[k] for row in computed for k in members(row)) - sum(tg.cost)


def from_plan(graph: Graph, plan: Plan, loss_reads_outputs: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(R, S) of a stage plan: the forward in node order; in the backward, the first backward that reads a
    discarded value of plan stage s (or needs what a discarded layer saves besides it) recomputes stage s's
    discarded nodes that it or a later backward needs, and those they are made from (Kusumoto et al.'s canonical
    strategy as the executor runs it, NOTE [what a recomputation makes]); every value is held
    from its computation to its last reader. A plan with ``checkpointed`` stages is refused: a schedule holds
    one copy of a value, while ``torch.utils.checkpoint`` rebuilds a block's kept output beside the original
    (NOTE [a checkpointed stage] in ``strategies/replay.py``)."""
    if plan.checkpointed:
        raise ValueError("from_plan: the plan has checkpointed stages, which a schedule cannot express (a rebuilt "
                         "copy beside its original); write dataclasses.replace(plan, checkpointed=0) for the "
                         "executor's run of the same stages")
    tg = training_graph(graph, loss_reads_outputs)
    n, size = len(graph), len(tg.mem)
    stage_of = plan.stage_of(n)
    discarded = graph.all_nodes & ~plan.kept
    computed = [1 << t for t in range(size)]
    recomputed_stages: set[int] = set()
    for t in range(n, size):
        v = backward_node(n, t)  # its backward needs the record of a computation: a recomputed one's extras
        needs = [*tg.deps[t], *([v] if graph.saves_more(v) and graph.profile.reached[v] else [])]
        for u in needs:
            if u < n and discarded >> u & 1 and stage_of[u] not in recomputed_stages:
                recomputed_stages.add(stage_of[u])
                # what the rest of the backward reads (NOTE [what a recomputation makes] in strategies/replay.py)
                stage = plan.stages[stage_of[u]] & discarded
                wanted = sum(1 << w for w in members(stage) if any(k >= t for k in tg.users[w])
                             or graph.saves_more(w) and graph.profile.reached[w] and backward_node(n, w) >= t)
                computed[t] |= graph.with_inputs_within(wanted, stage)
    return tuple(computed), hold_until_last_use(tg, computed)


def hold_until_last_use(tg: TrainingGraph, computed: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """S for a given R: each computation of a value is held until the last stage that reads it before the
    value is computed again."""
    size = len(computed)
    held = [0] * size
    for x in range(size):
        computes = [t for t in range(size) if computed[t] >> x & 1]
        uses = [t for t in range(size) if any(computed[t] >> k & 1 for k in tg.users[x])]
        for c, following in zip(computes, computes[1:] + [size]):
            last = max((u for u in uses if c <= u < following), default=c)
            for t in range(c + 1, last + 1):
                held[t] |= 1 << x
    return tuple(held)


def to_plan(graph: Graph, computed: tuple[int, ...], held: tuple[int, ...], loss_reads_outputs: bool = True,
            **kwargs) -> Plan:
    """The ``Plan`` that carries schedule (R, S); keyword arguments as for ``Plan.from_stages``."""
    validate(training_graph(graph, loss_reads_outputs), computed, held)
    n = len(graph)
    once = sum(1 << v for v in range(n) if sum(row >> v & 1 for row in computed) == 1)
    plan = Plan.from_stages(graph, [graph.all_nodes], kept=once, **kwargs)
    return dataclasses.replace(plan, schedule=(tuple(computed), tuple(held)))
