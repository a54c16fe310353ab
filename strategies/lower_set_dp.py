"""The dynamic programme over chains of lower sets (seed 004, sections 4.1-4.4), shared by the DPs.

NOTE [the DP]
A chain ``∅ = L_0 ⊊ L_1 ⊊ ... ⊊ L_k = V`` is built one lower set at a time; the state after ``L`` is
``(L, t, m(U))``: the overhead so far and the cached memory so far. Moving to ``L' ⊋ L`` costs, by seed
004's equation (2) (``simulate(..., liveness=False)``),
    stage peak  = m(U) + 2 m(L' \\ L) + m(δ⁺(L') \\ L') + m(δ⁻(δ⁺(L') \\ L') \\ L')   (must fit the budget)
    t'          = t + t((L' \\ L) \\ ∂(L'))                                    (equation (1))
    m(U')       = m(U) + m(∂(L') \\ L)
Lower sets are visited by memory, then size, so every subset comes before its supersets (the published
DP.cpp visits them in discovery order and misses transitions: ``../shared/spec/kusumoto.md``, pitfall 6).
The supersets that can follow ``L`` within the budget lie in a window of that order (``_successors``).
Per lower set, only Pareto-optimal states are expanded: for the time-centric objective (least overhead)
a state is dropped when another has no more overhead and no more cache; for the memory-centric one (most
overhead, seed 004 section 4.4) when another has no less overhead and no more cache. Both prunings are
exact for their objective, since a state's future depends on ``m(U)`` alone.

The minimal feasible budget (seed 004's Table 1 runs at it) is found by bisection on a cheaper DP that
keeps one number per lower set, the least ``m(U)`` that reaches it within the budget, over transitions
precomputed once; to a relative precision of ``1e-4``, starting from a known feasible upper bound (one
stage, or for the exact DP the approximate DP's minimum).

Sets are bitsets (Python ints) for the chain and rows of a boolean matrix for the vectorised work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strategies.graph import Graph
from strategies.plan import InfeasibleBudget, Plan, canonical_cache
from strategies.simulate import equation_2_peak

MODES = ("tc", "mc")


@dataclass(frozen=True, slots=True)
class Options:
    """Options of both DPs."""

    mode: str = "tc"  # tc: least overhead within the budget; mc: most overhead within it (seed 004, 4.4)


@dataclass(frozen=True)
class Table:
    """A family of lower sets, ordered by (memory, size) so that every subset comes first, with what the
    transitions need, precomputed."""

    family: list[int]
    postings: list[np.ndarray]  # node -> ascending indices of the sets holding it
    maximal_nodes: list[np.ndarray]  # set -> its nodes with no successor inside it
    member: np.ndarray  # (F, n) bool
    boundary_weight: np.ndarray  # (F, n) float 0/1: ∂(L)
    boundary_nodes: list[np.ndarray]  # ∂(L) as node indices
    mem: np.ndarray  # (F,) m(L), ascending
    key: np.ndarray  # (F,) 2 m(L) + m(A(L)) + m(B(L)): stage peak = m(U) + key[L'] - 2 m(L)
    mem_boundary: np.ndarray  # (F,) m(∂(L))
    time_kept: np.ndarray  # (F,) t(L) - t(∂(L))
    time: np.ndarray  # (F,) t(L)
    node_mem: np.ndarray
    node_time: np.ndarray


def prepare(graph: Graph, family: list[int]) -> Table:
    n = len(graph)
    width = (n + 63) // 64
    raw = b"".join(s.to_bytes(8 * width, "little") for s in family)
    words = np.frombuffer(raw, dtype="<u8").reshape(len(family), width)
    member = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
    node_mem = np.array(graph.mem_bytes, dtype=np.float64)
    node_time = np.array(graph.cost, dtype=np.float64)
    mem = member @ node_mem
    order = np.lexsort((member.sum(axis=1), mem))
    member, mem = member[order], mem[order]
    family = [family[i] for i in order]
    assert family[0] == 0 and family[-1] == graph.all_nodes, "bug: a family runs from ∅ to V"
    adjacency = np.zeros((n, n), dtype=np.float32)
    for u, v in graph.edges:
        adjacency[u, v] = 1.0
    inside = member.astype(np.float32)
    boundary = member & ((1 - inside) @ adjacency.T > 0)  # in L, with a successor outside
    later = ~member & (inside @ adjacency > 0)  # A(L) = δ⁺(L) \ L
    others = ~member & (later.astype(np.float32) @ adjacency.T > 0)  # B(L) = δ⁻(A(L)) \ L
    maximal = member & ~(inside @ adjacency.T > 0)  # no successor in L
    return Table(family=family, postings=[np.flatnonzero(column) for column in member.T],
                 maximal_nodes=[np.flatnonzero(row) for row in maximal], member=member, boundary_weight=boundary.astype(np.float64),
                 boundary_nodes=[np.flatnonzero(row) for row in boundary], mem=mem,
                 key=2 * mem + later @ node_mem + others @ node_mem, mem_boundary=boundary @ node_mem,
                 time_kept=member @ node_time - boundary @ node_time, time=member @ node_time,
                 node_mem=node_mem, node_time=node_time)


def _successors(table: Table, i: int, bound: float) -> np.ndarray:
    """Family indices ``j`` with ``L_j ⊋ L_i`` and ``key[j] <= bound``. As ``key[j] >= 2 m(L_j)``, they
    lie in a window of the memory order; a lower set contains ``L_i`` exactly when it holds the maximal
    nodes of ``L_i``, so the candidates are the window's part of the rarest such node's posting list."""
    last = int(np.searchsorted(table.mem, bound / 2, side="right"))
    if last <= i + 1:
        return np.empty(0, dtype=np.int64)
    tops = table.maximal_nodes[i]
    if tops.size == 0:  # ∅: every set is a superset
        js = np.arange(i + 1, last)
    else:
        ranges = [(np.searchsorted(table.postings[v], i + 1), np.searchsorted(table.postings[v], last), v)
                  for v in tops.tolist()]
        low, high, rarest = min(ranges, key=lambda r: r[1] - r[0])
        js = table.postings[rarest][low:high]
        others = tops[tops != rarest]
        if others.size and js.size:
            js = js[table.member[np.ix_(js, others)].all(axis=1)]
    return js[table.key[js] <= bound]


def _steps(table: Table, i: int, js: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ``L_i -> L_j``: the stage peak without ``m(U)``, the overhead added and the cache added."""
    # L_i ⊂ L_j, so ∂(L_j) ∩ L_i = ∂(L_j) ∩ ∂(L_i): only the few columns of ∂(L_i) matter.
    columns = table.boundary_nodes[i]
    shared = table.boundary_weight[np.ix_(js, columns)]
    stage = table.key[js] - 2 * table.mem[i]
    added_time = table.time_kept[js] - (table.time[i] - shared @ table.node_time[columns])
    added_cache = table.mem_boundary[js] - shared @ table.node_mem[columns]
    return stage, added_time, added_cache


PRECISION = 1e-4


@dataclass(frozen=True)
class Transitions:
    """Every ``L_i -> L_j`` whose stage alone fits a bound, grouped by ``i`` (``starts[i]:starts[i+1]``)."""

    starts: np.ndarray
    targets: np.ndarray
    stage: np.ndarray
    added_cache: np.ndarray


def transitions(table: Table, bound: float) -> Transitions:
    chunks = [_successors(table, i, bound + 2 * table.mem[i]) for i in range(len(table.family))]
    steps = [_steps(table, i, js) for i, js in enumerate(chunks)]
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    starts[1:] = np.cumsum([len(js) for js in chunks])
    return Transitions(starts=starts, targets=np.concatenate(chunks),
                       stage=np.concatenate([st for st, _, _ in steps]),
                       added_cache=np.concatenate([dm for _, _, dm in steps]))


def feasible(table: Table, moves: Transitions, budget: float) -> bool:
    """Whether some chain meets ``budget`` (one state per lower set: the least cache reaching it)."""
    least = np.full(len(table.family), np.inf)
    least[0] = 0.0
    for i in range(len(table.family) - 1):
        cache = least[i]
        if cache == np.inf:
            continue
        part = slice(moves.starts[i], moves.starts[i + 1])
        fits = cache + moves.stage[part] <= budget
        js = moves.targets[part][fits]
        least[js] = np.minimum(least[js], cache + moves.added_cache[part][fits])
    return bool(least[-1] < np.inf)


def minimal_budget(table: Table, upper: float | None = None) -> tuple[float, Transitions]:
    """A feasible budget within ``PRECISION`` of the least one, and the transitions that fit under it;
    ``upper``: a budget known feasible."""
    high = float(table.key[-1]) if upper is None else float(upper)  # one stage, 2 m(V), always fits
    moves = transitions(table, high)
    low = 0.0
    if upper is not None:  # a bound from a near solution: the minimum is close below it, so gallop down
        step = PRECISION * high
        while high - step > low and feasible(table, moves, high - step):
            high, step = high - step, 2 * step
        low = max(low, high - step)
    while high - low > PRECISION * high:
        middle = (low + high) / 2
        if feasible(table, moves, middle):
            high = middle
        else:
            low = middle
    return high, moves


def most_cache(table: Table, moves: Transitions, budget: float) -> np.ndarray:
    """For each lower set, the most cache with which a chain can still go on from it to V within
    ``budget`` (-inf where none can): a backward pass that lets the forward one drop dead states."""
    size = len(table.family)
    most = np.full(size, -np.inf)
    most[-1] = np.inf
    for i in range(size - 2, -1, -1):
        part = slice(moves.starts[i], moves.starts[i + 1])
        if part.start < part.stop:
            most[i] = np.max(np.minimum(budget - moves.stage[part], most[moves.targets[part]] - moves.added_cache[part]))
    return most


def best_chain(table: Table, budget: float, mode: str, moves: Transitions | None = None) -> list[int] | None:
    """The chain (family indices, ∅ excluded) of least (tc) or most (mc) overhead within ``budget``.

    Each lower set's states arrive as arrays (parent, parent overhead, overhead, cache) and are cut to
    their Pareto frontier, and to the caches that can still finish, when the lower set's turn comes; the
    frontier is kept for the backtracking."""
    moves = transitions(table, budget) if moves is None else moves
    most = most_cache(table, moves, budget)
    if most[0] < 0:
        return None
    size = len(table.family)
    incoming: list[list[tuple]] = [[] for _ in range(size)]
    incoming[0].append((-1, np.zeros(1), np.zeros(1), np.zeros(1)))
    frontiers: list[tuple | None] = [None] * size
    for i in range(size):
        if not incoming[i]:
            continue
        parents = np.concatenate([np.full(len(chunk[1]), chunk[0]) for chunk in incoming[i]])
        parent_overhead, overhead, cache = (np.concatenate([chunk[k] for chunk in incoming[i]]) for k in (1, 2, 3))
        incoming[i] = []
        keep = _pareto(overhead, cache, mode)
        frontiers[i] = (overhead[keep], cache[keep], parents[keep], parent_overhead[keep])
        part = slice(moves.starts[i], moves.starts[i + 1])
        if part.start == part.stop:
            continue
        overhead, cache = frontiers[i][0], frontiers[i][1]
        js, added_cache = moves.targets[part], moves.added_cache[part]
        fits = (cache[:, None] + moves.stage[part][None, :] <= budget) & \
               (cache[:, None] + added_cache[None, :] <= most[js][None, :])
        useful = np.flatnonzero(fits.any(axis=0))
        if useful.size == 0:
            continue
        added_time = _steps(table, i, js[useful])[1]
        for column, dt in zip(useful.tolist(), added_time.tolist()):
            rows = fits[:, column]
            incoming[js[column]].append((i, overhead[rows], overhead[rows] + dt, cache[rows] + added_cache[column]))
    if frontiers[-1] is None:
        return None
    overhead, _, parents, parent_overhead = frontiers[-1]
    k = int(np.argmin(overhead) if mode == "tc" else np.argmax(overhead))
    chain, i = [size - 1], int(parents[k])
    wanted = parent_overhead[k]
    while i > 0:
        chain.append(i)
        k = int(np.flatnonzero(frontiers[i][0] == wanted)[0])
        i, wanted = int(frontiers[i][2][k]), frontiers[i][3][k]
    return chain[::-1]


def _pareto(overhead: np.ndarray, cache: np.ndarray, mode: str) -> np.ndarray:
    """Indices of the states no other state beats (NOTE [the DP]), one per overhead value."""
    order = np.lexsort((cache, overhead if mode == "tc" else -overhead))
    ordered_cache = cache[order]
    best_before = np.concatenate(([np.inf], np.minimum.accumulate(ordered_cache)[:-1]))
    return order[ordered_cache < best_before]


def solve_family(graph: Graph, family: list[int], budget_bytes: int | None, mode: str, strategy: str,
                 upper_bytes: int | None = None) -> Plan:
    """A plan from the best chain of ``family`` (see the module note); ``None`` means the minimal budget.
    ``upper_bytes``, a budget known to be feasible, speeds up the search for the minimal one."""
    if mode not in MODES:
        raise ValueError(f"{strategy}: unknown mode {mode!r}; valid modes: tc (time-centric, least overhead), "
                         "mc (memory-centric, most overhead)")
    table = prepare(graph, family)
    param_grads = sum(graph.param_bytes)  # simulate(liveness=False) adds these; the DP's budget leaves them out
    upper = None if upper_bytes is None else upper_bytes - param_grads
    if budget_bytes is None:
        budget, moves = minimal_budget(table, upper)
        chain = best_chain(table, budget, mode, moves)
    else:
        budget = budget_bytes - param_grads
        chain = best_chain(table, budget, mode) if budget >= 0 else None
    if chain is None:
        minimum, moves = minimal_budget(table, upper)
        plan = Plan.from_chain(graph, [table.family[i] for i in best_chain(table, minimum, mode, moves)])
        raise InfeasibleBudget(budget_bytes, equation_2_peak(graph, plan) + param_grads, strategy)
    plan = Plan.from_chain(graph, [table.family[i] for i in chain], strategy=strategy, budget_bytes=budget_bytes)
    assert plan.kept == canonical_cache(graph, plan.stages)
    return plan


__all__ = ["MODES", "best_chain", "feasible", "minimal_budget", "most_cache", "prepare", "solve_family"]
