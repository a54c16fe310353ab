"""The dynamic programme over chains of lower sets (Kusumoto et al. 2019, sections 4.1-4.4), shared by the DPs.

NOTE [the DP]
A chain ``∅ = L_0 ⊊ L_1 ⊊ ... ⊊ L_k = V`` is built one lower set at a time; the state after ``L`` is
``(L, t, m(U))``: the overhead so far and the cached memory so far. Moving to ``L' ⊋ L`` costs, by
Kusumoto et al.'s equation (2) (``simulate(..., liveness=False)``),
    stage peak  = m(U) + 2 m(L' \\ L) + m(δ⁺(L') \\ L') + m(δ⁻(δ⁺(L') \\ L') \\ L')   (must fit the budget)
    t'          = t + t((L' \\ L) \\ ∂(L'))                                    (equation (1))
    m(U')       = m(U) + m(∂(L') \\ L)
Lower sets are visited by memory, then size, so every subset comes before its supersets (the published
DP.cpp visits them in discovery order and misses transitions whose target it found before their source).
The supersets that can follow ``L`` from cache ``m(U)`` lie in a window of that order, since the stage
peak is at least ``m(U) + 2 m(L' \\ L)``; within it, the sets holding every maximal node of ``L`` are
found 64 at a time, as the AND of per-node rows of bits over the family.

Per lower set, only Pareto-optimal states are expanded: for the time-centric objective (least overhead)
a state is dropped when another has no more overhead and no more cache; for the memory-centric one (most
overhead, Kusumoto et al. 2019 section 4.4) when another has no less overhead and no more cache. Both prunings are
exact for their objective, since a state's future depends on ``m(U)`` alone. On top of that (``best_chain``):
a forward pass gives the least cache reaching each set, a backward pass the most cache that can still
finish from it and bounds on the overhead still to come, and the Pareto pass drops the states that cannot
finish or cannot beat a cutoff raised IDA*-style until V is reached. None of this drops a state of an
optimal chain, so the result is the DP's optimum.

The minimal feasible budget (Kusumoto et al.'s Table 1 runs at it) is computed exactly, where the paper bisected:
the same forward pass with states (peak so far, cache), below a known feasible budget (one stage, or for
the exact DP the approximate DP's minimum, often the answer itself, which one cheap pass then proves),
once feasibility passes have narrowed the range.

NOTE [judging a DP's budget]
Equation (2) is the DP's objective's memory term, not what the step holds: it counts a stage's values and
gradients whole, with no liveness within the stage. Under ``memory_model=traced`` (default) a budget
means what it means for every other strategy, the liveness replay's peak (``simulate``; parameter
gradients included). Equation (2) is only a proxy for the replay, and the replay is not monotone in it: a
plan of fewer, larger stages, which equation (2) charges more, can peak lower once values die within a
stage. So the minimal plan is the one of least replay among:
- the plan at equation (2)'s minimum, on the traced count and on Kusumoto et al.'s (on ResNet-50 and PSPNet
  the latter gives the lower replay);
- where the family has at most ``SMALL`` lower sets (small graphs, U-Net, VGG-19), the plans at equation
  (2) budgets up to one stage's, found by halving each interval whose ends give different plans, down to
  whole bytes (at most ``SCAN`` passes): every distinct plan on small graphs. On U-Net (mc) a looser plan
  peaks 13% lower. Larger families are not scanned: their passes just above the minimum take seconds
  (5 s each for the exact DP on the paper's PSPNet), and a 17-point scan on the zoo nets found no lower
  plan.
The minimal budget the DP reports is that plan's replay, and any budget at or above it is met. Within a
budget the DP takes, of the scanned plans that fit and those of a search on equation (2)'s budget above
the loosest scanned one that fits, the least overhead (tc) or the loosest equation (2) budget's (mc). The
search (``_within``) narrows the interval to 0.5% by turns: a probe where the line through its ends meets
the budget, one a tolerance beyond it (which closes the interval where the line was right), one halving it
(tc; mc halves only: its plans fill their budget, and its replay follows no line). The replay is a
staircase in equation (2)'s budget, so the line alone can guess short for long. At 1.05x the minimum on
PSPNet, ResNet-152 and DenseNet-161, halving alone took 12 DP passes for tc, the turns 7, with plans as good
(ResNet-152's ``approx_dp``: 1,489 cost units recomputed against 1,499). mc's interval is found up from the
loosest plan that fits, by steps of the room its replay leaves under the budget, doubled while plans fit:
halving down from one stage's budget spent 13 replays on DenseNet-161 at 1.05x its minimum, most of them
gigabytes over, where this takes 7, for the same plan. Nearby budgets often give one plan: each plan is
replayed once.
In ``mode=mc`` the least plan is searched for in the replay itself (NOTE [the least replay]), from the plans above,
and a budget below equation (2)'s least plan's replay gets the first plan that search finds within it. tc takes the
budget as equation (2)'s plans meet it: its minimum is their least replay (``mode=mc`` reaches lower).
Under ``memory_model=paper`` the budget is equation (2)'s, as Kusumoto et al. 2019 ran it (Table 2): the paper's DP,
kept as it was for the reproduction.

NOTE [the least replay]
Equation (2) is a poor proxy for the replay where stages are large: ResNet-152's greedy plan of 13 stages is 2.74 GB
by equation (2) and peaks at 1.47 GB in the replay, while equation (2)'s least plan, of 37 stages, peaks at 1.82 GB
(its kept values, held through every later stage, are what the replay's peak is made of). So ``mode=mc`` searches
for its least plan in the replay itself, from the plans at equation (2)'s minimum (both objectives, both counts,
and every scanned plan), by moves on chains of lower sets, each move judged by replaying its plan: from a chain, the
replay names the stage in whose backward the step peaks; the moves that may lower that peak are dropping a set of
the chain up to that stage's end (merging two stages: a value kept fewer, held through every later stage),
splitting that stage at a principal lower set between its ends, and moving either of its ends to such a set (the
``MOVES`` sets whose boundaries keep the fewest bytes). The first move that lowers (peak, overhead) is taken, until
none does; within a budget, the search stops at the first plan that fits. Stages after the peak's have ended their
backward by then and are left alone. The principal lower sets are in both DPs' families, so the plan is always one
of the DP's own; the exact DP also takes ``approx_dp``'s plan where it is better, so it never needs more than the
approximate one. On the paper's seven nets at their sizes this reaches the least peak ``optimal`` (``mode=mc``)
finds on every net (results/table1.md), and never more than Chen et al.'s plans; a minimal solve replays some
hundreds of plans (seconds on ResNet-152), a budgeted one stops at the first that fits. Graphs of more than
``SEARCHED_NODES`` (the Llamas) are not searched: their replays take tens of milliseconds each and their chains
hundreds of stages, and the plan is the least replay among the starting plans. It is a local search: how far each
plan is from the least any plan reaches is what ``optimal`` in ``mode=mc`` answers. tc is not searched: at a budget
below equation (2)'s plans its moves would trade recomputation for memory plan by plan, a replay each (seconds where
the DP's passes take a tenth of one), and ``mode=mc`` answers that budget already.

The passes are compiled with numba (``dp_kernels.py``): sets are rows of 64-bit words there, and Python
ints (bitsets) everywhere else. The two passes over every transition (least cache, backward) use every
core numba may (``NUMBA_NUM_THREADS``); their results do not depend on how many.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from strategies import dp_kernels as kernels
from strategies.graph import Graph, bitset, members
from strategies.plan import InfeasibleBudget, Plan
from strategies.equation2 import MEMORY_MODELS, dp_view, equation_2_peak
from strategies.replay import peak_layer
from strategies.simulate import simulate, simulated_steps

MODES = ("tc", "mc")


@dataclass(frozen=True, slots=True)
class Options:
    """Options of both DPs."""

    mode: str = "tc"  # tc: least overhead within the budget; mc: most overhead within it (Kusumoto et al. 2019, 4.4)
    # traced: equation (2) counts each value with what its layer saves besides it, and the loss in the last
    # stage; paper: Kusumoto et al.'s, values alone (NOTE [what equation (2) counts] in strategies/equation2.py)
    memory_model: str = "traced"

    def __post_init__(self):
        _check_mode(self.mode)
        if self.memory_model not in MEMORY_MODELS:
            raise ValueError(f"unknown memory_model {self.memory_model!r}; valid: {', '.join(MEMORY_MODELS)}")


@dataclass(frozen=True)
class Table:
    """A family of lower sets sorted by (memory, size), with what the transitions need (``dp_kernels``)."""

    words: np.ndarray
    # What the kernels take: boundary, values, the maximal nodes' CSR pair, holders, bounded, node_mem, node_time.
    sets: tuple

    def __len__(self) -> int:
        return len(self.words)

    @property
    def values(self) -> np.ndarray:
        """Per set, the columns ``dp_kernels.MEM``, ``KEY``, ... (the kernels' ``values``)."""
        return self.sets[1]


def prepare(graph: Graph, words: np.ndarray) -> Table:
    """The family ``words`` on ``graph`` (an ``equation2.dp_view``: its node sizes and loss are what the DP
    counts)."""
    n = len(graph)
    node_mem = np.array(graph.mem_bytes, dtype=np.float64)
    node_time = np.array(graph.cost, dtype=np.float64)
    values, boundary, maximal = kernels.describe_sets(words, graph.pred_words, graph.succ_words, node_mem,
                                                      node_time)
    order = np.lexsort((values[:, kernels.SIZE], values[:, kernels.MEM]))
    words, boundary, maximal = words[order], boundary[order], maximal[order]
    values = np.asfortranarray(values[order])  # the kernels read a column over many sets at a time
    assert not words[0].any() and bitset(words[-1]) == graph.all_nodes, "bug: a family runs from ∅ to V"
    values[-1, kernels.KEY] += graph.profile.loss_bytes  # the stage that ends at V holds the loss's buffers too
    sets = (boundary, values, *kernels.rows(maximal, n), kernels.transpose(words, n),
            kernels.transpose(boundary, n), node_mem, node_time)
    return Table(words=words, sets=sets)


def minimal_budget(table: Table, upper: float | None = None, check=None, deadline: float = math.inf) -> float:
    """The least budget any chain of the family meets, exactly; ``upper``: a budget known to be feasible
    (default: one stage, 2 m(V)).

    Budgets are whole bytes, so when ``upper - 1`` is infeasible, ``upper`` is the answer (a pass that
    fails usually fails within its first sets, so this check is cheap where it succeeds). Otherwise
    feasibility passes (least cache per set) narrow the range to within 1%: below a given ``upper``, which
    is usually close, by steps that double until one fails, and by bisection. Then one forward pass
    keeping the Pareto frontier of (peak so far, cache) per set gives the exact minimum; it slows with
    the slack of its budget, the top of the range, so it drops the states that a backward pass shows
    cannot finish within it. ``check``, called before each pass, may stop the search (a time limit), and
    the last pass stops past ``deadline`` (``time.perf_counter``'s clock), raising ``TimeoutError``."""
    reach = {}  # budget -> least cache per set, kept for the last pass

    def feasible(budget):
        if check is not None:
            check()
        reach[budget] = kernels.least_cache(table.sets, budget, deadline)
        return reach[budget][-1] < np.inf

    given = upper is not None
    high = float(upper) if given else float(table.values[-1, kernels.KEY])
    if not feasible(high - 1):
        return high
    high, low = high - 1, 0.0
    if given:
        step = max(1.0, (0.01 * high) // 1)
        while step < high and feasible(high - step):
            high, step = high - step, 2 * step
        low = max(0.0, high - step)
    while high - low > max(1.0, 0.01 * high):
        middle = float((low + high) // 2)
        low, high = (low, middle) if feasible(middle) else (middle, high)
    most = kernels.backward(table.sets, high, reach[high], deadline)[0]
    frontier, _, sizes, _ = kernels.pareto_chains(table.sets, high, 0, most, np.zeros(len(table)), np.inf, deadline)
    return float(frontier[-1, :sizes[-1], 0].min())


def best_chain(table: Table, budget: float, mode: str, deadline: float = math.inf) -> list[int] | None:
    """The chain (family indices, ∅ excluded) of least (tc) or most (mc) overhead within ``budget``, or
    None; past ``deadline`` a pass raises ``TimeoutError``.

    A forward pass finds the least cache reaching each set, a backward pass the most cache that can still
    finish from it and bounds on the overhead still to come; the last pass keeps the Pareto frontier of
    (overhead, cache) per set, dropping states whose overhead plus bound exceeds a cutoff. The cutoff
    starts at the bound and rises, at least to the least value a pass dropped (IDA*), until V is reached:
    the optimum, since no state of an optimal chain exceeds it."""
    least = kernels.least_cache(table.sets, budget, deadline)
    if least[-1] == np.inf:
        return None
    most, low, high = kernels.backward(table.sets, budget, least, deadline)
    objective, to_go = (1, low) if mode == "tc" else (2, -high)
    cutoff = to_go[0]
    # The optimum lies between the bounds. The states a pass keeps grow about exponentially with the
    # cutoff, and a pass past the optimum costs far more than one short of it (the paper's GoogLeNet, tc:
    # 0.6 s at the optimum, 44, 1.2 s at 47.6, 2.6 s at 51.4), so each step aims at twice the states of the
    # last pass, by their growth over the last step, and at most doubles.
    step, kept = 0.005 * (high[0] - low[0]), 0
    last = len(table) - 1
    while True:
        slack = 1e-9 * max(1.0, abs(cutoff))  # overheads summed in another order may differ in the last bits
        frontier, parents, sizes, over = kernels.pareto_chains(table.sets, budget, objective, most, to_go,
                                                               cutoff + slack, deadline)
        if sizes[last]:
            break
        assert over < np.inf, "bug: V is reachable within the budget, yet no state was dropped"
        states = int(sizes.sum())
        if kept and states > kept:
            step *= min(2.0, math.log(2) / math.log(states / kept))
        else:
            step *= 2
        kept = states
        cutoff = max(over, cutoff + step)
    chain, s, slot = [], last, int(np.argmin(frontier[last, :sizes[last], 0]))
    while s > 0:
        chain.append(s)
        s, slot = (int(x) for x in parents[s, slot])
    return chain[::-1]


def _check_mode(mode: str, strategy: str = "") -> None:
    if mode not in MODES:
        raise ValueError(f"{strategy + ': ' if strategy else ''}unknown mode {mode!r}; valid modes: tc (time-centric, "
                         "least overhead), mc (memory-centric, most overhead)")


def solve_family(graph: Graph, words: np.ndarray, budget_bytes: int | None, mode: str, strategy: str,
                 upper_bytes: int | None = None, memory_model: str = "traced", check=None,
                 deadline: float = math.inf, starts=lambda: ()) -> Plan:
    """A plan from the best chain of the family ``words`` (see the module note and NOTE [judging a DP's
    budget]); ``None`` means the minimal budget. ``upper_bytes``, a budget known to be feasible (equation
    (2)), prunes the search for the minimal one. ``check``, called before each pass over the family, may
    stop the search (``exact_dp``'s time limit), and a pass stops past ``deadline``, raising ``TimeoutError``.
    In mode mc the least plan is searched for in the replay (NOTE [the least replay]); ``starts``, called only then:
    plans of chains of the family (``exact_dp``: ``approx_dp``'s) that it is chosen among too."""
    _check_mode(mode, strategy)
    counted = dp_view(graph, memory_model)
    table = prepare(counted, words)
    param_grads = sum(graph.profile.param_bytes)  # simulate adds these; the DP's budget leaves them out
    upper = None if upper_bytes is None else upper_bytes - param_grads

    def plan_within(budget: float) -> Plan | None:
        if check is not None:
            check()
        chain = best_chain(table, budget, mode, deadline) if budget >= 0 else None
        if chain is None:
            return None
        plan = Plan.from_chain(graph, [bitset(table.words[i]) for i in chain], strategy=strategy,
                               budget_bytes=budget_bytes, info={"memory_model": memory_model})
        assert equation_2_peak(counted, plan) <= budget, "bug: the DP's chain exceeds its budget"
        return plan

    if memory_model == "paper":  # Kusumoto et al.'s: the budget is equation (2)'s
        return _by_equation_2(plan_within, lambda: minimal_budget(table, upper, check, deadline), budget_bytes,
                              param_grads, strategy)
    # (stages, kept) -> its replay, and the layer in whose backward it peaks: nearby budgets often give one plan
    replayed: dict[tuple, tuple] = {}

    def replayed_of(plan: Plan) -> tuple:
        key = (plan.stages, plan.kept)
        if key not in replayed:
            prediction, steps = simulated_steps(graph, plan)
            replayed[key] = prediction, peak_layer(steps) if mode == "mc" else None
        return replayed[key]

    def replay(plan: Plan):
        return replayed_of(plan)[0]

    least, top = minimal_budget(table, upper, check, deadline), float(table.values[-1, kernels.KEY])
    if len(table) <= SMALL:  # equation (2) budget -> its plan
        scanned = _distinct_plans(plan_within, least, top)
    else:
        scanned = {least: plan_within(least)}
    replays = {b: replay(plan) for b, plan in scanned.items()}
    # The least replay; at equal peaks, tc's least overhead, mc's tightest equation (2) budget.
    minimal = min(scanned, key=lambda b: (replays[b].peak_bytes, replays[b].overhead_cost if mode == "tc" else b))
    plan, peak = scanned[minimal], replays[minimal].peak_bytes
    # Kusumoto et al.'s count is another proxy, for the minimal plan; a budget the minimal plan so far meets is
    # searched from that plan, which fits, and needs no other
    paper = None
    if (counted is not graph or graph.profile.loss_bytes) and (budget_bytes is None or peak > budget_bytes):
        paper = solve_family(graph, words, None, mode, strategy, memory_model="paper", check=check, deadline=deadline)
    if mode == "mc" and memory_model == "traced" and (budget_bytes is None or peak > budget_bytes):
        # NOTE [the least replay]
        other = best_chain(table, least, "tc", deadline)
        plans = [plan, *scanned.values(), Plan.from_chain(graph, [bitset(table.words[i]) for i in other],
                                                         strategy=strategy, budget_bytes=budget_bytes,
                                                         info={"memory_model": memory_model})]
        if paper is not None:
            plans.append(dataclasses.replace(paper, budget_bytes=budget_bytes, info={"memory_model": memory_model}))
        plan, peak = _least_replay(graph, plans, replayed_of, budget_bytes, deadline, starts)
        if budget_bytes is not None and peak > budget_bytes:  # the minimum reported: a budget at or above it is met
            raise InfeasibleBudget(budget_bytes, peak, strategy)
        return plan
    if paper is not None:
        paper_peak = simulate(graph, paper).peak_bytes
        if paper_peak < peak:
            plan = dataclasses.replace(paper, budget_bytes=budget_bytes,
                                       info={**paper.info, "memory_model": "traced", "minimal_plan_from": "paper"})
            peak = paper_peak
    if budget_bytes is None:
        return plan
    if peak > budget_bytes:  # the minimum reported: any budget at or above it is met
        raise InfeasibleBudget(budget_bytes, peak, strategy)
    return _within(plan_within, replay, scanned, replays, budget_bytes, mode, top) or plan


def _by_equation_2(plan_within, least, budget_bytes: int | None, param_grads: int, strategy: str) -> Plan:
    """The plan within ``budget_bytes`` by equation (2) (None: at its minimal budget, ``least()``), as Kusumoto et al.
    2019 has it; ``InfeasibleBudget`` carries that minimum where none fits."""
    if budget_bytes is None:
        return plan_within(least())
    plan = plan_within(budget_bytes - param_grads)
    if plan is None:
        raise InfeasibleBudget(budget_bytes, int(least()) + param_grads, strategy)
    return plan


def _least_replay(graph: Graph, plans: list[Plan], replayed_of, budget_bytes: int | None, deadline: float,
                  starts) -> tuple[Plan, int]:
    """The best plan a search of moves (``_moves``) finds from each of ``plans``, or among ``starts()``, and its peak
    (NOTE [the least replay]): with no budget, the least replay, then the least overhead; within ``budget_bytes``,
    the first plan found that fits, or the least replay over it. ``replayed_of(plan)``: its replay, and the layer
    in whose backward it peaks. Past ``deadline`` it raises ``TimeoutError``."""
    principal = sorted(set(graph.ancestor_mask))
    cut_bytes = {lower: sum(graph.mem_bytes[v] for v in members(graph.boundary(lower))) for lower in principal}

    def score(plan: Plan) -> tuple:
        prediction = replayed_of(plan)[0]
        if budget_bytes is None:
            return prediction.peak_bytes, prediction.overhead_cost
        return max(0, prediction.peak_bytes - budget_bytes), prediction.peak_bytes

    best, searched = None, set()
    for plan in sorted(plans, key=score):
        if (plan.stages, plan.kept) in searched or best is not None and best[0][0] == 0 and budget_bytes is not None:
            continue
        searched.add((plan.stages, plan.kept))
        chain, here = plan.lower_sets(), score(plan)
        while len(graph) <= SEARCHED_NODES and (budget_bytes is None or here[0] > 0):
            if time.perf_counter() > deadline:
                raise TimeoutError("the search for the least replay ran past its deadline")
            v = replayed_of(plan)[1]
            at = next(i for i, lower in enumerate(chain) if lower >> v & 1) if v is not None else len(chain) - 1
            for candidate in _moves(chain, at, principal, cut_bytes):
                moved = Plan.from_chain(graph, candidate, strategy=plan.strategy, budget_bytes=plan.budget_bytes,
                                        info=dict(plan.info))
                if (moved_score := score(moved)) < here:
                    plan, chain, here = moved, candidate, moved_score
                    break
            else:
                break
        if best is None or here < best[0]:
            best = here, plan
    for plan in starts():
        if score(plan) < best[0]:
            best = score(plan), plan
    return best[1], replayed_of(best[1])[0].peak_bytes


def _moves(chain: list[int], at: int, sets: list[int], cut_bytes: dict[int, int]):
    """The chains one move from ``chain`` (lower sets, V last) that may lower the peak in stage ``at``'s backward:
    each set of the chain up to that stage's end dropped (two stages merged, a kept value fewer), the first first;
    then the stage split at a set of ``sets`` between its ends; then each of its ends moved to such a set. Stages
    after it have ended their backward by then: merging them lowers neither the peak nor the recomputation. The sets
    a stage may be split or ended at are the ``MOVES`` whose boundaries keep the fewest bytes (``cut_bytes``)."""

    def between(low: int, high: int, *besides: int) -> list[int]:
        inside = [lower for lower in sets if lower & low == low and not lower & ~high and lower not in besides]
        return sorted(inside, key=lambda lower: (cut_bytes[lower], lower))[:MOVES]

    for j in range(min(at + 1, len(chain) - 1)):
        yield chain[:j] + chain[j + 1:]
    low, high = chain[at - 1] if at else 0, chain[at]
    for lower in between(low, high, low, high):
        yield chain[:at] + [lower] + chain[at:]
    for j in (at - 1, at):
        if 0 <= j < len(chain) - 1:
            low, high = chain[j - 1] if j else 0, chain[j + 1]
            for lower in between(low, high, low, high, chain[j]):
                yield chain[:j] + [lower] + chain[j + 1:]


# The largest graph the moves search: a replay of the 1B Llama's 696 nodes takes tens of milliseconds, and its
# equation (2) plan's 280 stages make hundreds of moves a step (210 s for one minimal solve); above it, the plan of
# least replay among the starting plans.
SEARCHED_NODES = 500
MOVES = 8  # the sets a move may split a stage or end it at, those whose boundaries keep the fewest bytes first
SCAN = 32  # the most DP passes spent looking for a plan of lower replay than equation (2)'s minimal one
SMALL = 64  # the most lower sets in a family for that search: its passes then take milliseconds


def _distinct_plans(plan_within, least: float, top: float) -> dict[float, Plan]:
    """Plans at equation (2) budgets from ``least`` to ``top`` (one stage's), found by halving, widest
    interval first, each interval whose ends give different plans, down to whole bytes: every distinct
    plan on small graphs, at most ``SCAN`` passes (NOTE [judging a DP's budget])."""
    plans = {least: plan_within(least), top: plan_within(top)}
    intervals = [(least, top)]
    while intervals and len(plans) < SCAN:
        low, high = intervals.pop(0)
        if high - low <= 1 or plans[low].stages == plans[high].stages and plans[low].kept == plans[high].kept:
            continue
        middle = float((low + high) // 2)
        plans[middle] = plan_within(middle)
        intervals += [(low, middle), (middle, high)]
    return dict(sorted(plans.items()))


def _within(plan_within, replay, scanned: dict, replays: dict, budget_bytes: int, mode: str,
            top: float) -> Plan | None:
    """Of the plans whose replay fits ``budget_bytes``, scanned or found by a search on equation (2)'s budget (to
    0.5%) above the loosest scanned one that fits (or the least), up to ``top``: tc's least overhead, mc's the
    loosest equation (2) budget's. None when no such plan fits. The search probes where the line through the
    interval's ends (equation (2)'s budget against the replay's peak) meets ``budget_bytes``, then a tolerance
    beyond that probe, which closes the interval where the line was right, then halves the interval (the replay
    is a staircase in equation (2)'s budget, flat for a while, where the line guesses short), and again. For mc
    it halves, in an interval found up from a plan that fits by steps of the replay's room under
    ``budget_bytes``, doubled while plans fit (the two counts differ by bytes that change slowly with the
    budget, and mc's budgets sit near the minimum, where halving down from ``top`` spent most of its replays)."""
    fits = {b: replays[b].overhead_cost for b in scanned if replays[b].peak_bytes <= budget_bytes}
    plans, peaks = dict(scanned), {b: replays[b].peak_bytes for b in scanned}

    def probe(budget: float) -> None:
        plans[budget] = plan_within(budget)
        replayed = replay(plans[budget])
        peaks[budget] = replayed.peak_bytes
        if replayed.peak_bytes <= budget_bytes:
            fits[budget] = replayed.overhead_cost

    low = max(fits, default=min(scanned))
    if mode == "mc" and low in fits and low == max(plans):
        stride = max(1.0, float(budget_bytes - peaks[low]))
        while low < top:
            probe(middle := float(min(low + stride, top) // 1))
            if middle not in fits:
                break
            low, stride = middle, 2 * stride
    if top not in plans and low == max(plans):
        probe(top)
    low = max(fits, default=min(plans))
    if low < max(plans):
        high = min(b for b in plans if b > low)
        step, closing = "secant" if mode == "tc" else "halving", 0.0
        while high - low > (tolerance := max(1.0, 0.005 * high)):
            if step == "secant" and low in fits and peaks[high] > peaks[low]:
                guess = low + (budget_bytes - peaks[low]) * (high - low) / (peaks[high] - peaks[low])
                middle = min(max(guess, low + tolerance), high - tolerance)
            elif step == "closing":
                middle = closing
            else:
                step, middle = "halving", (low + high) / 2
            middle = float(middle // 1)
            if not low < middle < high:
                middle = float((low + high) // 2)
            probe(middle)
            if middle in fits:
                low = middle
            else:
                high = middle
            closing = middle + tolerance if middle == low else middle - tolerance
            if mode == "tc":  # mc's plans fill their budget: its replay is no line at all, and it halves
                step = {"secant": "closing", "closing": "halving", "halving": "secant"}[step]
    if not fits:
        return None
    best = min(fits, key=lambda b: (fits[b], -b)) if mode == "tc" else max(fits)
    return plans[best]


__all__ = ["MODES", "Options", "best_chain", "minimal_budget", "prepare", "solve_family"]
