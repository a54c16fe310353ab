"""``ilp_optimal``: the optimal rematerialization schedule under a budget, Checkmate's MILP (Jain et al.
2020, section 4), solved with HiGHS (``highspy``, the ``ilp`` extra).

Variables over the training graph of ``strategies/schedule.py`` (T = 2n nodes, T frontier-advancing
stages): binaries R[t,i] (stage t computes i), S[t,i] (i is held on entry to t), FREE[t,i,k] (i is freed
after k in stage t); continuous U[t,k] (memory after computing k in stage t), at most the budget.
Minimise the cost of every computation. Constraints: R[t,t] = 1; S[t+1,i] <= S[t,i] + R[t,i]; an input
of k computed in t is computed before it in t or held; the U recurrence; FREE linearised as Checkmate does.

Its space holds every stage plan whose stages follow node order (``schedule.from_plan``). Schedules may
recompute a value several times (a gradient never: autograd computes each once): the simulator predicts
them, the executor does not run them.

NOTE [judging the ILP's budget]
Checkmate's accounting (``schedule.peak``) counts a backward's gradients as one block held until the last
of them is read, leaves out what layers save besides node values, the loss's buffers and autograd's
in-place sums, and so misses the step's peak by -22% to +75% on the zoo. Under ``memory_model=traced``
(default) a budget is what it is for every strategy: the replay's peak (``simulate``, here
``schedule_timeline``, which equals the stage replay, and so the tracker, on every stage plan). The MILP
keeps Checkmate's accounting as its proxy (values sized with what their layers save): the search probes
proxy budgets by bisection (at most ``probes`` MILPs sharing ``time_limit_s``), from the one at which
nothing need be recomputed down, and keeps the least-overhead schedule whose replay fits; ``approx_dp``'s
plan within the budget is a candidate from the start, so the ILP is never worse than it. The least budget
it reports is the lower replay of ``approx_dp``'s minimal plan and of the schedule of least proxy peak,
and any budget at or above it is met. ``budget_bytes=None`` is the replay of ``approx_dp``'s minimal plan.
``ilp_status`` is the chosen MILP's: ``optimal`` proves the schedule best within its proxy budget, not
among every schedule whose replay fits; ``warm_start`` says that none of the MILP's schedules beat
``approx_dp``'s plan, which is then the answer. Under ``memory_model=paper`` the budget is Checkmate's own count, as published: the
least budget any schedule fits is proved by a second MILP that minimises the peak; a time limit returns
the best schedule found with status ``timeout`` and the gap; no schedule at all raises
``SolverTimeout``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from strategies import approx_dp, schedule
from strategies.graph import Graph
from strategies.plan import Inapplicable, InfeasibleBudget, Plan, SolverTimeout
from strategies.equation2 import MEMORY_MODELS, dp_view
from strategies.replay import peak_of
from strategies.schedule_replay import schedule_timeline
from strategies.simulate import simulate

BUDGET_LIVENESS = True  # memory_model=traced (NOTE [judging the ILP's budget])


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``ilp_optimal``."""

    time_limit_s: float = 60.0
    warm_start: bool = True  # start from approx_dp's schedule where it fits the budget
    max_stages: int = 400  # T = 2n above which the model (about T^2 binaries) is not built; say so instead
    # traced: a budget is the replay's peak, as for every strategy; paper: Checkmate's own accounting
    memory_model: str = "traced"
    probes: int = 8  # traced: the most MILPs the search for the loosest proxy budget solves


class _Model:
    """Column and row builder for HiGHS's sparse interface."""

    def __init__(self):
        self.lower, self.upper, self.cost, self.integer = [], [], [], []
        self.row_lower, self.row_upper, self.starts, self.indices, self.values = [], [], [], [], []

    def column(self, lower, upper, cost=0.0, integer=True) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, lower, upper, terms) -> None:
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.starts.append(len(self.indices))
        for col, value in terms:
            self.indices.append(col)
            self.values.append(value)


def build(tg: schedule.TrainingGraph, budget_bytes: int | None, unit: float):
    """The MILP, memory counted in ``unit`` bytes; returns (model, R, S, U, FREE): their columns. With
    ``budget_bytes=None`` it minimises the peak instead (one more column, above every U). A backward node
    is computed in its own stage only: autograd computes each gradient once (Checkmate would allow more)."""
    size = len(tg.mem)
    mem = [b / unit for b in tg.mem]
    least_peak = budget_bytes is None
    m = _Model()
    again = lambda t, i: 0.0 if 2 * i >= size and i < t else 1.0  # noqa: E731
    R = {(t, i): m.column(1.0 if i == t else 0.0, again(t, i), 0.0 if least_peak else tg.cost[i])
         for t in range(size) for i in range(t + 1)}
    S = {(t, i): m.column(0.0, 1.0) for t in range(1, size) for i in range(t)}
    U = {(t, k): m.column(0.0, np.inf if least_peak else budget_bytes / unit, integer=False)
         for t in range(size) for k in range(t + 1)}
    if least_peak:
        peak = m.column(0.0, np.inf, 1.0, integer=False)
        for column in U.values():
            m.row(-np.inf, 0.0, [(column, 1.0), (peak, -1.0)])
    FREE = {(t, i, k): m.column(0.0, 1.0) for t in range(size) for k in range(t + 1) for i in tg.deps[k]}
    for t in range(size - 1):
        for i in range(t + 1):  # keep only what was held or computed
            m.row(-np.inf, 0.0, [(S[t + 1, i], 1.0), (R[t, i], -1.0)] + ([(S[t, i], -1.0)] if i < t else []))
    for t in range(size):
        for k in range(t + 1):
            for i in tg.deps[k]:  # an input is computed earlier in the stage or held
                m.row(-np.inf, 0.0, [(R[t, k], 1.0), (R[t, i], -1.0), (S[t, i], -1.0)])
        m.row(0.0, 0.0, [(U[t, 0], 1.0), (R[t, 0], -mem[0])] + [(S[t, i], -mem[i]) for i in range(t)])
        for k in range(1, t + 1):
            m.row(0.0, 0.0, [(U[t, k], 1.0), (U[t, k - 1], -1.0), (R[t, k], -mem[k])]
                  + [(FREE[t, i, k - 1], mem[i]) for i in tg.deps[k - 1]])
        for k in range(t + 1):
            for i in tg.deps[k]:
                # FREE = R[t,k] (1 - S[t+1,i]) prod_j (1 - R[t,j]) over later readers j of i in stage t
                hazards = [(R[t, j], 1.0) for j in tg.users[i] if k < j <= t]
                hazards += [(S[t + 1, i], 1.0)] if t + 1 < size else []
                kappa = 1 + len(hazards)
                m.row(0.0, np.inf, [(FREE[t, i, k], 1.0), (R[t, k], -1.0)] + hazards)  # no hazard: free
                m.row(-np.inf, kappa - 1, [(FREE[t, i, k], kappa), (R[t, k], -1.0)] + hazards)  # hazard: keep
    return m, R, S, U, FREE


def warm_values(tg, computed, held, R, S, U, FREE, unit) -> dict[int, float]:
    """The MILP's columns for schedule (R, S)."""
    size = len(tg.mem)
    values = {}
    for t in range(size):
        held_next = held[t + 1] if t + 1 < size else 0
        for i in range(t + 1):
            values[R[t, i]] = float(computed[t] >> i & 1)
            if i < t:
                values[S[t, i]] = float(held[t] >> i & 1)
        live = sum(tg.mem[i] for i in range(t) if held[t] >> i & 1)
        for k in range(t + 1):
            if computed[t] >> k & 1:
                live += tg.mem[k]
            values[U[t, k]] = live / unit
            freed = schedule.frees(tg, computed[t], held_next, k) if computed[t] >> k & 1 else []
            for i in tg.deps[k]:
                values[FREE[t, i, k]] = float(i in freed)
            live -= sum(tg.mem[i] for i in freed)
    return values


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:

    options = options or Options()
    if options.time_limit_s <= 0:
        raise ValueError(f"ilp_optimal: time_limit_s must be positive, got {options.time_limit_s}")
    size = 2 * len(graph)
    if size > options.max_stages:
        raise Inapplicable(f"ilp_optimal: the training graph has {size} stages, more than max_stages="
                           f"{options.max_stages} (about {size * size} binaries); raise max_stages to build it")
    if options.memory_model not in MEMORY_MODELS:
        raise ValueError(f"ilp_optimal: unknown memory_model {options.memory_model!r}; valid: traced (the replay's "
                         "peak, as every strategy), paper (Checkmate's own accounting)")
    if options.memory_model == "traced":
        return _by_replay(graph, budget_bytes, options)
    try:
        start = schedule.from_plan(graph, approx_dp.solve(graph, budget_bytes and max(budget_bytes, 1),
                                                          options=approx_dp.Options(memory_model="paper")))
    except InfeasibleBudget:
        start = None
    if budget_bytes is None:
        start = start or schedule.from_plan(graph, approx_dp.solve(graph, None,
                                                                   options=approx_dp.Options(memory_model="paper")))
        budget_bytes = schedule.peak(schedule.training_graph(graph), *start) + sum(graph.profile.param_bytes)
    return optimise(graph, budget_bytes, start if options.warm_start else None, options.time_limit_s)


def _by_replay(graph: Graph, budget_bytes: int | None, options: Options) -> Plan:
    """The least-overhead plan found whose replay fits ``budget_bytes`` (NOTE [judging the ILP's budget])."""

    if budget_bytes is None:
        start = approx_dp.solve(graph, None)
        budget_bytes = simulate(graph, start).peak_bytes
    else:
        try:
            start = approx_dp.solve(graph, max(budget_bytes, 1))
        except InfeasibleBudget:
            start = None
    plan = within_replay(graph, budget_bytes, start, options.time_limit_s, options.probes, options.warm_start)
    if plan is None:
        raise InfeasibleBudget(budget_bytes, least_replay(graph, options.time_limit_s), "ilp_optimal")
    return plan


def within_replay(graph: Graph, budget_bytes: int, start: Plan | None, time_limit_s: float, probes: int = 8,
                  warm_start: bool = True) -> Plan | None:
    """The least-overhead plan whose replay fits ``budget_bytes``: stage plan ``start`` (a candidate when it
    fits; its schedule warm-starts the MILP) or the MILP's optimum at a proxy budget probed by bisection.
    None when none fits, nor the schedule of least proxy peak."""
    tg = schedule.training_graph(dp_view(graph, "traced"), loss_reads_outputs=False)  # the proxy
    deadline = time.perf_counter() + time_limit_s
    overhead = lambda plan: simulate(graph, plan).overhead_cost  # noqa: E731
    fits = lambda plan: simulate(graph, plan).peak_bytes <= budget_bytes  # noqa: E731
    best = start if start is not None and fits(start) else None
    # A peer's checkpointed plan warm-starts as the executor's run of its stages, the nearest schedule.
    warm = (schedule.from_plan(graph, dataclasses.replace(start, checkpointed=0), loss_reads_outputs=False)
            if start is not None and warm_start else None)
    status = {"ilp_status": "warm_start"}  # none of the MILP's schedules beat ``start``
    everything = tuple(1 << t for t in range(len(tg.mem)))  # each node computed once, held to its last reader
    low, high = 0.0, float(schedule.peak(tg, everything, schedule.hold_until_last_use(tg, everything)))
    proxy, solved = high, 0
    built = build(tg, int(high), max(tg.mem))  # once: a probe changes only U's bound
    while solved < probes and time.perf_counter() < deadline:
        fitting_warm = warm if warm is not None and schedule.peak(tg, *warm) <= proxy else None
        outcome = _solve_proxy(tg, built, proxy, fitting_warm,
                               max(1e-3, (deadline - time.perf_counter()) / (probes - solved)))
        solved += 1
        if outcome is None:
            low = proxy
        else:
            plan = _as_plan(graph, outcome[0], budget_bytes)
            if fits(plan):
                low = proxy
                if best is None or overhead(plan) < overhead(best):
                    best, status = plan, outcome[1]
                    warm = outcome[0]
                if proxy == high:
                    break  # the proxy budget that needs no recomputation: none does better
            else:
                high = proxy
        if high - low <= 0.005 * high:
            break
        proxy = (low + high) / 2
    if best is None:
        least = _least_peak(tg, max(1e-3, deadline - time.perf_counter()))[0]
        if least is None or not fits(plan := _as_plan(graph, least, budget_bytes)):
            return None
        best, status = plan, {"ilp_status": "least_peak"}
    return dataclasses.replace(best, strategy="ilp_optimal", budget_bytes=budget_bytes, info={
        **best.info, **status, "ilp_probes": solved, "memory_model": "traced",
        "approx_dp_overhead": overhead(start) if start is not None else float("nan")})


def _as_plan(graph: Graph, computed_held, budget_bytes: int) -> Plan:
    return schedule.to_plan(graph, *computed_held, loss_reads_outputs=False, strategy="ilp_optimal",
                            budget_bytes=budget_bytes)


def _solve_proxy(tg: schedule.TrainingGraph, built, proxy: float, warm, time_limit_s: float):
    """The MILP ``built`` at proxy budget ``proxy``: ((R, S), its status and figures), or None without a
    schedule."""
    unit = max(tg.mem)
    model, R, S, U, FREE = built
    for column in U.values():
        model.upper[column] = int(proxy) / unit
    outcome = _run(model, time_limit_s, warm_values(tg, *warm, R, S, U, FREE, unit) if warm is not None else None)
    if outcome.solution is None:
        return None
    computed = _computed(outcome.solution, R, len(tg.mem))
    return (computed, schedule.hold_until_last_use(tg, computed)), _figures(outcome, model, tg)


def _figures(outcome: "_Outcome", model: _Model, tg: schedule.TrainingGraph) -> dict:
    """What a plan's ``info`` says of the MILP that found it."""
    return {"ilp_status": outcome.status, "ilp_gap": outcome.gap, "ilp_seconds": outcome.seconds,
            "ilp_columns": len(model.lower), "ilp_rows": len(model.row_lower),
            "ilp_bound": outcome.bound - sum(tg.cost)}


def _least_peak(tg: schedule.TrainingGraph, time_limit_s: float):
    """The schedule (R, S) of least peak by Checkmate's count that HiGHS found, or None; and its status."""
    model, R, _, _, _ = build(tg, None, max(tg.mem))
    outcome = _run(model, time_limit_s, None)
    if outcome.solution is None:
        return None, outcome.status
    computed = _computed(outcome.solution, R, len(tg.mem))
    return (computed, schedule.hold_until_last_use(tg, computed)), outcome.status


def least_replay(graph: Graph, time_limit_s: float) -> int:
    """The least budget ``ilp_optimal`` reports (``memory_model=traced``): the lower replay of
    ``approx_dp``'s minimal plan and of the schedule of least proxy peak."""

    peak = simulate(graph, approx_dp.solve(graph, None)).peak_bytes
    least, _ = _least_peak(schedule.training_graph(dp_view(graph, "traced"), loss_reads_outputs=False),
                           time_limit_s)
    if least is None:
        return peak
    return min(peak, peak_of(schedule_timeline(graph, *least)))


def optimise(graph: Graph, budget_bytes: int, start, time_limit_s: float) -> Plan:
    """The least-overhead schedule within ``budget_bytes`` (parameter gradients included), HiGHS starting
    from schedule ``start`` (R, S) where it fits."""
    tg = schedule.training_graph(graph)
    budget = budget_bytes - sum(graph.profile.param_bytes)
    if budget <= 0:
        raise InfeasibleBudget(budget_bytes, least_budget(graph, time_limit_s), "ilp_optimal")
    if start is not None and schedule.peak(tg, *start) > budget:
        start = None
    unit = max(tg.mem)  # memory in units of the largest value: coefficients near 1 for the solver
    model, R, S, U, FREE = build(tg, budget, unit)
    warm = warm_values(tg, *start, R, S, U, FREE, unit) if start is not None else None
    outcome = _run(model, time_limit_s, warm)
    if outcome.status == "infeasible":
        raise InfeasibleBudget(budget_bytes, least_budget(graph, time_limit_s), "ilp_optimal")
    if outcome.solution is None:
        raise SolverTimeout(f"ilp_optimal: HiGHS found no schedule within {time_limit_s} s")
    computed = _computed(outcome.solution, R, len(tg.mem))
    held = schedule.hold_until_last_use(tg, computed)  # the least S for this R: never more memory
    info = {**_figures(outcome, model, tg),
            "warm_start_overhead": schedule.cost(tg, start[0]) if start is not None else float("nan")}
    return schedule.to_plan(graph, computed, held, strategy="ilp_optimal", budget_bytes=budget_bytes, info=info)


def least_budget(graph: Graph, time_limit_s: float) -> int | None:
    """The least budget any schedule fits (parameter gradients included), or None if HiGHS does not prove
    it within the time limit."""
    tg = schedule.training_graph(graph)
    least, status = _least_peak(tg, time_limit_s)
    if status != "optimal":
        return None
    return schedule.peak(tg, *least) + sum(graph.profile.param_bytes)


@dataclass(frozen=True, slots=True)
class _Outcome:
    status: str  # optimal, timeout or infeasible
    solution: np.ndarray | None
    gap: float
    bound: float
    seconds: float


def _run(model: _Model, time_limit_s: float, warm: dict[int, float] | None) -> _Outcome:
    import highspy  # the optional "ilp" extra

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("threads", 1)
    count = len(model.lower)
    h.addCols(count, np.array(model.cost), np.array(model.lower, dtype=float), np.array(model.upper, dtype=float),
              0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    h.addRows(len(model.row_lower), np.array(model.row_lower, dtype=float), np.array(model.row_upper, dtype=float),
              len(model.indices), np.array(model.starts, np.int32), np.array(model.indices, np.int32),
              np.array(model.values))
    integer = [c for c in range(count) if model.integer[c]]
    h.changeColsIntegrality(len(integer), np.array(integer, np.int32),
                            np.full(len(integer), highspy.HighsVarType.kInteger, np.uint8))
    if warm is not None:
        h.setSolution(len(warm), np.array(list(warm), np.int32), np.array(list(warm.values())))
    began = time.perf_counter()
    h.run()
    seconds = time.perf_counter() - began
    status, info = h.getModelStatus(), h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return _Outcome("infeasible", None, float("nan"), float("nan"), seconds)
    found = info.primal_solution_status != 0
    solution = np.array(h.getSolution().col_value) if found else None
    if found and warm is not None and abs(float(np.dot(model.cost, solution)) - info.objective_function_value) > 1e-6 * max(
            1.0, abs(info.objective_function_value)):
        # HiGHS 1.16 hands back the warm start from getSolution, not the incumbent it reports: solve again cold.
        return _run(model, max(1e-3, time_limit_s - seconds), None)
    return _Outcome("optimal" if status == highspy.HighsModelStatus.kOptimal else "timeout", solution,
                    float(info.mip_gap), float(info.mip_dual_bound), seconds)


def _computed(solution: np.ndarray, R: dict, size: int) -> tuple[int, ...]:
    return tuple(sum(1 << i for i in range(t + 1) if solution[R[t, i]] > 0.5) for t in range(size))
