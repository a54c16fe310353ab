"""``exact_dp``: Kusumoto et al.'s exact dynamic programme over all lower sets (section 4.2, Algorithm 1).

Finds, among all canonical strategies (chains of lower sets), the one of least overhead (``mode=tc``) or
most overhead (``mode=mc``, section 4.4) whose equation (2) peak fits the budget; ``budget_bytes=None``
takes the minimal feasible budget (computed exactly; Kusumoto et al.'s Table 1 bisected). The budget counts what
``simulate(graph, plan, liveness=False)`` counts. NOTE [the DP] in ``lower_set_dp.py`` has the details.
Complexity O(|L_G|² · t(V)) in the worst case; the transitions that fit the budget are what costs (about
80 million for the paper's GoogLeNet, 27,358 lower sets, at its minimal budget). |L_G| can grow
exponentially with the graph's width.
Deviation from the paper's code: lower sets are visited by memory, then size, so every subset comes
before its supersets and no transition is missed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from strategies import lower_set_dp
from strategies.graph import Graph, words_of
from strategies.lower_set_dp import minimal_budget, prepare, solve_family
from strategies.lower_sets import all_lower_set_words, principal_lower_sets
from strategies.plan import InfeasibleBudget, Plan, SolverTimeout
from strategies.equation2 import dp_view

# Budgets are judged by the liveness replay (memory_model=paper: equation (2), Kusumoto et al.'s; NOTE [judging a
# DP's budget] in lower_set_dp.py).
BUDGET_LIVENESS = True
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Options(lower_set_dp.Options):
    # Checked as the lower sets are listed and as the passes over them go (a pass on millions of lower sets
    # can take minutes); None: no limit.
    time_limit_s: float | None = 600.0

    def __post_init__(self):
        lower_set_dp.Options.__post_init__(self)
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"exact_dp: time_limit_s must be positive (or None: no limit), got {self.time_limit_s}")


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    start = time.perf_counter()
    deadline = math.inf if options.time_limit_s is None else start + options.time_limit_s
    principal = principal_lower_sets(graph)

    def out_of_time(searched: str) -> SolverTimeout:
        return SolverTimeout(f"exact_dp: no plan within {options.time_limit_s:g} s over {searched} lower sets of "
                             f"{len(graph)} nodes; approx_dp solves the same problem over the {len(principal)} "
                             "principal lower sets (or raise time_limit_s)")

    try:
        family = all_lower_set_words(graph, deadline=deadline)
    except TimeoutError:
        raise out_of_time("more") from None  # than it could list in that time
    log.info("exact_dp: searching %s lower sets of %d nodes%s", f"{len(family):,}", len(graph),
             f", for at most {options.time_limit_s:g} s" if options.time_limit_s is not None else "")

    def check():
        if time.perf_counter() > deadline:
            raise out_of_time(f"{len(family):,}")

    # The approximate DP's chains are chains of the exact family: its minimal budget bounds the search.
    principal_words = words_of(principal, len(graph))
    approx = prepare(dp_view(graph, options.memory_model), principal_words)
    upper = minimal_budget(approx) + sum(graph.profile.param_bytes)

    def approx_plan():  # its chains are the exact DP's too: the exact DP's plan is never worse than approx_dp's
        try:
            return [solve_family(graph, principal_words, budget_bytes, options.mode, "exact_dp",
                                 memory_model=options.memory_model, deadline=deadline)]
        except InfeasibleBudget:  # its least plan then, so that the least reported is never above approx_dp's
            return [solve_family(graph, principal_words, None, options.mode, "exact_dp",
                                 memory_model=options.memory_model, deadline=deadline)]

    try:  # a pass over the family looks at the clock as it goes, too
        plan = solve_family(graph, family, budget_bytes, options.mode, "exact_dp", upper_bytes=int(upper),
                            memory_model=options.memory_model, check=check, deadline=deadline, starts=approx_plan)
    except TimeoutError:
        raise out_of_time(f"{len(family):,}") from None
    return dataclasses.replace(plan, info={**plan.info, "lower_sets": len(family)})
