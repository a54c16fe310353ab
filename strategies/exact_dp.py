"""``exact_dp``: seed 004's exact dynamic programme over all lower sets (section 4.2, Algorithm 1).

Finds, among all canonical strategies (chains of lower sets), the one of least overhead (``mode=tc``) or
most overhead (``mode=mc``, section 4.4) whose equation (2) peak fits the budget; ``budget_bytes=None``
takes the minimal feasible budget (bisection to 0.01%, as in seed 004's Table 1). The budget counts what
``simulate(graph, plan, liveness=False)`` counts. NOTE [the DP] in ``lower_set_dp.py`` has the details.
Complexity O(|L_G|² · t(V)) in the worst case, far less near the minimal budget, where few transitions fit;
|L_G| can grow exponentially with the graph's width (27,358 lower sets for the paper's GoogLeNet).
Deviation from the paper's code: lower sets are visited by memory, then size, so every subset comes
before its supersets and no transition is missed.
"""

from __future__ import annotations

from strategies.graph import Graph
from strategies.lower_set_dp import Options, minimal_budget, prepare, solve_family
from strategies.lower_sets import all_lower_sets, principal_lower_sets
from strategies.plan import Plan

# Budgets are judged by simulate(..., liveness=False): seed 004's model, the one the DP optimises.
BUDGET_LIVENESS = False


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    family = all_lower_sets(graph)
    # The approximate DP's chains are chains of the exact family: its minimal budget bounds the search.
    upper = minimal_budget(prepare(graph, principal_lower_sets(graph)))[0] + sum(graph.param_bytes)
    plan = solve_family(graph, family, budget_bytes, options.mode, "exact_dp", upper_bytes=int(upper))
    plan.info["lower_sets"] = len(family)
    return plan
