"""``optimal``: the least recomputation at a budget (``mode=tc``), or the least memory (``mode=mc``), over every plan
the executor runs, proven with constraint programming (OR-Tools' CP-SAT, the ``cp`` extra) and judged by the replay,
as every strategy is.

NOTE [kept sets first]
The cost depends on the kept set alone (a discarded value shares its readers' stage), and so does the first
moment of the relaxation (NOTE [a proven optimum in the replay's accounting] in ``optimal_model.py``). So the
search runs on the model without stages first (n kept flags; a solve takes well under a second on the zoo), as a
logic-based Benders decomposition: the cheapest kept set it holds, cheaper than the best
plan, is tried with its finest stages (``finest``), and where the replay puts those over the budget, the model
with stages is asked for stages that fit with those kept flags (as assumptions; each plan it proposes is
replayed, and cut where it does not fit). A plan that fits costs what its kept set costs, the least any plan the
model without stages still holds costs: proven optimal. Where the model with stages holds none, CP-SAT names a
subset of the flags that no plan has together (its core), and the model without stages excludes them. Where its
bound already reaches the DPs' best plan, that plan is proven with no stage searched (GoogLeNet at three of four
budgets). After half the time the search goes on as above, over the model with stages, its cost held at or above
the bound found so far.

NOTE [the least memory]
``mode=mc`` asks for the least peak any plan the executor runs reaches, in the replay's accounting, and then for the
least recomputation at that peak. The same relaxation serves, with the budget a variable, the peak, that every
moment stays under and the solver minimises: its optimum is a lower bound on the least peak. The search starts from
the lowest-peaked of the DPs' memory-centric plans (searched in the replay: NOTE [the least replay]) and Chen et
al.'s greedy plan (the DPs given an eighth of the time
each), and asks only for plans under the best peak so far, so each bound and cut stays valid as that peak falls:
- kept sets first: the kept set of least relaxed peak is tried with its finest stages; where those do not beat the
  best peak, the lazy cut at the layer where the replay peaked (NOTE [a recomputation's inputs, where the replay
  peaks]) may take the kept set out, and else the model with stages is asked, with the kept flags as assumptions,
  for stages whose replay does; where it holds none, the core of the flags goes from the model without stages.
  With no kept set left under the best peak, that peak is proven least;
- after half the time, the model with stages over every plan, each plan proposed replayed and cut.
Three quarters of the time go to the peak; the search for the least recomputation at it (``mode=tc``'s, from the
best plan) has the rest. A row reports both: ``optimal_status``, ``peak_lower_bound`` and ``gap`` for the peak,
``overhead_status`` and ``overhead_lower_bound`` for the recomputation at it.

The CP-SAT model and its solver are ``optimal_model.py`` (NOTE [a proven optimum in the replay's accounting]).
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass

from strategies import approx_dp, chen_greedy, exact_dp
from strategies.graph import Graph
from strategies.graph import members as members_of
from strategies.optimal_model import _OutOfTime, _Relaxation, _components, _held_at_peak, _lowest
from strategies.plan import InfeasibleBudget, Plan, SolverTimeout
from strategies.simulate import simulate

BUDGET_LIVENESS = True


log = logging.getLogger(__name__)


INSTALL = "pip install ortools (or the project's extra: pip install -e '.[cp]')"


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``optimal``."""

    time_limit_s: float = 600.0  # for the whole search, every solve and replay in it (CP-SAT may pass its own
    # limit by seconds on the largest models: PSPNet's model with stages, 7 s over 18)
    workers: int = 1  # CP-SAT's search workers; one keeps the answer the same from run to run
    # tc: the least recomputation within the budget; mc: the least memory (the replay's peak), then the least
    # recomputation at it (NOTE [the least memory])
    mode: str = "tc"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"optimal: unknown mode {self.mode!r}; valid modes: tc (the least recomputation within "
                             "the budget), mc (the least memory, then the least recomputation at it)")
        if not self.time_limit_s > 0:
            raise ValueError(f"optimal: time_limit_s must be positive, got {self.time_limit_s}")


MODES = ("tc", "mc")


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise ImportError(f"optimal needs OR-Tools' CP-SAT: {INSTALL}") from error
    deadline = time.perf_counter() + options.time_limit_s
    if options.mode == "mc":
        return _least_memory(cp_model, graph, budget_bytes, options, deadline)
    return _least_overhead(cp_model, graph, budget_bytes, options, deadline)


def _least_overhead(cp_model, graph: Graph, budget_bytes: int | None, options: Options, deadline: float,
                    seeds: list[Plan] | None = None) -> Plan:
    """The plan of least recomputation within ``budget_bytes`` (None: the first seed's peak), searched from the
    cheapest of ``seeds`` that fits (default: the DPs' plans at the budget) until ``deadline``."""
    least_known = None
    if seeds is None:
        seeds, least_known = _dp_seeds(graph, budget_bytes, options.time_limit_s / 4)
    best, best_cost, budget_bytes = _best_seed(graph, seeds, budget_bytes)
    try:
        kept_only = _Relaxation(cp_model, graph, budget_bytes, stages=False, deadline=deadline)
    except _OutOfTime:  # not even the model without stages in time: the DPs' plan, unproven
        if best is None:
            raise SolverTimeout(f"optimal: no plan fits {budget_bytes} bytes within {options.time_limit_s:g} s "
                                "(its model was not built in time); raise time_limit_s") from None
        return Plan(strategy="optimal", stages=best.stages, kept=best.kept, budget_bytes=budget_bytes,
                    info={"optimal_status": "timeout", "lower_bound": 0.0, "gap": 1.0 if best_cost > 0 else 0.0,
                          "plans_replayed": 0})
    staged, built = None, False  # the model with stages, built when a kept set needs them (None: not in time)
    status, cuts = "optimal", 0
    # First the kept sets, cheapest first (NOTE [kept sets first]), for half the time left.
    first_until = time.perf_counter() + (deadline - time.perf_counter()) / 2
    while True:
        found = kept_only.cheapest(best_cost, first_until - time.perf_counter(), options.workers)
        if found is None or found == "timeout":
            break
        kept = found[1]
        plan = finest(graph, kept, budget_bytes)
        prediction = simulate(graph, plan)
        cuts += 1
        if prediction.peak_bytes > budget_bytes:
            if _held_at_peak(kept_only, plan):  # the relaxation may refuse this kept set now
                continue
            if not built:
                staged, built = _with_stages(cp_model, graph, budget_bytes, kept_only.holding, deadline), True
            if staged is None:
                found = "timeout"
                break
            plan, replayed = staged.stages_for(kept, first_until, options.workers)
            cuts += replayed
            if plan is None:  # no stages fit these kept flags: the core of them goes
                kept_only.exclude(staged.core)
                continue
            if plan == "timeout":
                found = plan
                break
            prediction = simulate(graph, plan)
        cost = prediction.overhead_cost
        if cost < best_cost:  # the least any plan costs: the next kept set, cheaper still, is not there
            best, best_cost = plan, cost
        else:
            kept_only.exclude([(v, bool(kept >> v & 1)) for v in range(len(graph))])
    model = kept_only
    if found == "timeout":  # then every plan, stages and all, from the kept sets' bound
        if not built:
            staged = _with_stages(cp_model, graph, budget_bytes, kept_only.holding, deadline)
        if staged is None:  # the bound is the kept sets'
            status = "timeout"
        else:
            model = staged
            model.at_least(kept_only.bound)
            if best is not None:
                model.hint(best)
    if model is not kept_only:
        best, best_cost, status, replayed = _cheaper_plans(
            model, graph, best, best_cost, deadline, options, budget_bytes=budget_bytes,
            value=lambda prediction, _: prediction.overhead_cost if prediction.peak_bytes <= budget_bytes else None)
        cuts += replayed
    bound = best_cost if status == "optimal" else min(best_cost, model.bound)
    if best is None:
        if status == "timeout":
            raise SolverTimeout(f"optimal: no plan fits {budget_bytes} bytes within {options.time_limit_s:g} s "
                                f"({cuts} proposed plans replayed over it); raise time_limit_s")
        known = f"optimal (approx_dp's least plan fits {least_known} bytes)" if least_known else "optimal"
        raise InfeasibleBudget(budget_bytes, None, known)  # the least over every plan is not searched for
    gap = 0.0 if status == "optimal" else (best_cost - bound) / best_cost if best_cost > 0 else 0.0
    plan = Plan(strategy="optimal", stages=best.stages, kept=best.kept, budget_bytes=budget_bytes,
                info={"optimal_status": status, "lower_bound": bound, "gap": gap, "plans_replayed": cuts})
    return plan


def _best_seed(graph: Graph, seeds: list[Plan], budget_bytes: int | None) -> tuple[Plan | None, float, int]:
    """The cheapest of ``seeds`` within ``budget_bytes`` (None: the first seed's peak), its cost, and the budget."""
    best, best_cost = None, math.inf
    for seed in seeds:  # the better plan the DPs find is the first best
        prediction = simulate(graph, seed)
        if budget_bytes is None:
            budget_bytes = prediction.peak_bytes
        if prediction.peak_bytes <= budget_bytes and prediction.overhead_cost < best_cost:
            best, best_cost = seed, prediction.overhead_cost
    return best, best_cost, budget_bytes


def _cheaper_plans(model: _Relaxation, graph: Graph, best: Plan | None, best_value: float, deadline: float,
                   options: Options, value, budget_bytes: int | None = None) -> tuple[Plan | None, float, str, int]:
    """Plans the model with stages proposes, best first, each replayed and cut, until none is better than the
    best (proven: status ``optimal``) or the deadline (``timeout``); the best, its value, the status and the count
    of plans replayed. ``value(prediction, best_value)`` is a replayed plan's value, or None where its replay holds
    more than the model was asked to (``_held_at_peak`` then teaches the model why)."""
    cuts = 0
    while True:
        left = deadline - time.perf_counter()
        found = model.cheapest(best_value, left, options.workers) if left > 0 else "timeout"
        if found is None:  # no plan the model holds is better than the best: proven
            return best, best_value, "optimal", cuts
        if found == "timeout":
            return best, best_value, "timeout", cuts
        plan = Plan.from_stages(graph, found[0], kept=found[1], strategy="optimal", budget_bytes=budget_bytes)
        prediction = simulate(graph, plan)
        log.debug("optimal: proposed cost %g, replay %d bytes (relaxed %g), %.1f s left", prediction.overhead_cost,
                  prediction.peak_bytes, model.proposed, left)
        replayed = value(prediction, best_value)
        if replayed is None:
            _held_at_peak(model, plan)
        elif replayed < best_value:
            best, best_value = plan, replayed
        model.cut(plan)
        cuts += 1


def _least_memory(cp_model, graph: Graph, budget_bytes: int | None, options: Options, deadline: float) -> Plan:
    """The plan of least peak (NOTE [the least memory]), then of least recomputation at that peak."""
    memory_until = deadline - options.time_limit_s / 4  # the last quarter for the recomputation at the peak
    seeds = _dp_seeds(graph, None, options.time_limit_s / 8, mode="mc")[0] + [chen_greedy.solve(graph, None)]
    peaks = [simulate(graph, seed).peak_bytes for seed in seeds]
    best_peak = min(peaks)
    best = seeds[peaks.index(best_peak)]
    status, replayed, model = "timeout", 0, None
    try:
        kept_only = model = _Relaxation(cp_model, graph, best_peak, stages=False, deadline=memory_until,
                                        least_memory=True)
    except _OutOfTime:
        kept_only = None
    staged, built, found = None, False, "timeout"
    # Kept sets first: each is tried with its finest stages, then, where those do not beat the best peak, the
    # model with stages is asked for stages that do (as assumptions; a core of flags that none has goes).
    first_until = time.perf_counter() + (memory_until - time.perf_counter()) / 2
    while kept_only is not None:
        found = kept_only.cheapest(best_peak, first_until - time.perf_counter(), options.workers)
        if found is None or found == "timeout":
            break
        kept = found[1]
        plan = finest(graph, kept)
        peak = simulate(graph, plan).peak_bytes
        replayed += 1
        if peak < best_peak:
            best, best_peak = plan, peak
            continue
        if _held_at_peak(kept_only, plan):
            continue
        if not built:
            staged = _with_stages(cp_model, graph, best_peak, kept_only.holding, memory_until, least_memory=True)
            built = True
        if staged is None:
            found = "timeout"
            break
        staged.under(best_peak)
        plan, count = staged.stages_for(kept, first_until, options.workers)
        replayed += count
        if plan is None:
            kept_only.exclude(staged.core)
        elif plan == "timeout":
            found = plan
            break
        else:
            best, best_peak = plan, simulate(graph, plan).peak_bytes
    if found is None:
        status = "optimal"
    elif kept_only is not None:  # then every plan, stages and all, from the kept sets' bound
        if not built:
            staged = _with_stages(cp_model, graph, best_peak, kept_only.holding, memory_until, least_memory=True)
        if staged is not None:
            model = staged
            model.at_least(kept_only.bound)
            model.hint(best)
            best, best_peak, status, count = _cheaper_plans(
                model, graph, best, best_peak, memory_until, options,
                value=lambda prediction, least: prediction.peak_bytes if prediction.peak_bytes < least else None)
            replayed += count
    bound = best_peak if status == "optimal" else min(best_peak, model.bound if model is not None else 0)
    if budget_bytes is not None and best_peak > budget_bytes:
        name = "optimal (mc)" if status == "optimal" else f"optimal (mc, unproven: no plan under {bound:.0f} bytes)"
        raise InfeasibleBudget(budget_bytes, best_peak, name)
    at_peak = _least_overhead(cp_model, graph, best_peak, options, deadline, seeds=[best])
    info = {"optimal_status": status, "peak_lower_bound": bound, "gap": (best_peak - bound) / best_peak,
            "overhead_status": at_peak.info["optimal_status"], "overhead_lower_bound": at_peak.info["lower_bound"],
            "plans_replayed": replayed + at_peak.info["plans_replayed"]}
    return Plan(strategy="optimal", stages=at_peak.stages, kept=at_peak.kept, budget_bytes=budget_bytes, info=info)


def _with_stages(cp_model, graph: Graph, budget_bytes: int, holding, deadline: float, least_memory: bool = False):
    """The model with stages, or None where building it would outlast ``deadline``: its size is the nodes times
    the edges and the nodes (DenseNet-161's, 3.9 million constraints, takes 47 s to build)."""
    try:
        return _Relaxation(cp_model, graph, budget_bytes, holding=holding, deadline=deadline, least_memory=least_memory)
    except _OutOfTime:
        log.info("optimal: the model with stages was not built within the time limit")
        return None


def _dp_seeds(graph: Graph, budget_bytes: int | None, time_limit_s: float,
              mode: str = "tc") -> tuple[list[Plan], int | None]:
    """The DPs' plans at the budget (``exact_dp`` within ``time_limit_s``), and the least budget a DP reported
    where none fits."""
    plans, least_known = [], None
    for dp, options in ((approx_dp, approx_dp.Options(mode=mode)),
                        (exact_dp, exact_dp.Options(mode=mode, time_limit_s=time_limit_s))):
        try:
            plans.append(dp.solve(graph, budget_bytes, options=options))
        except InfeasibleBudget as error:
            least_known = least_known or error.min_feasible_bytes
        except (SolverTimeout, ValueError):  # exact_dp: out of its time, or too many lower sets to enumerate
            continue
    return plans, least_known


def finest(graph: Graph, kept: int, budget_bytes: int | None = None) -> Plan:
    """The plan with the kept set ``kept`` and the most stages: a reader of a discarded value shares its stage and
    stages follow the edges, so each stage is one strongly connected component of the edges and those readers'
    edges back, the components in topological order (the one with the earliest node first)."""
    n = len(graph)
    out, into = [list(graph.succs[u]) for u in range(n)], [list(graph.preds[v]) for v in range(n)]
    for u in members_of(graph.all_nodes & ~kept):
        for v in graph.succs[u]:
            out[v].append(u)
            into[u].append(v)
    component = _components(out, into)
    count = max(component) + 1
    nodes, after, waiting = [0] * count, [set() for _ in range(count)], [set() for _ in range(count)]
    for u in range(n):
        nodes[component[u]] |= 1 << u
        for v in out[u]:
            if component[u] != component[v]:
                after[component[u]].add(component[v])
                waiting[component[v]].add(component[u])
    ready = [(_lowest(nodes[c]), c) for c in range(count) if not waiting[c]]
    heapq.heapify(ready)
    stages = []
    while ready:
        _, c = heapq.heappop(ready)
        stages.append(nodes[c])
        for d in after[c]:
            waiting[d].discard(c)
            if not waiting[d]:
                heapq.heappush(ready, (_lowest(nodes[d]), d))
    return Plan.from_stages(graph, stages, kept=kept, strategy="optimal", budget_bytes=budget_bytes)
