"""``approx_dp``: Kusumoto et al.'s approximate DP (section 4.3): the exact DP restricted to the lower sets
``L_v`` (``v`` with all its ancestors), plus ∅ and V.

Same objective, modes (``tc``/``mc``) and budget meaning as ``exact_dp``; never better than it, since
its chains are a subset. At most |V| + 2 lower sets, so O(|V|² · t(V)) at worst.
"""

from __future__ import annotations

import dataclasses

from strategies.graph import Graph, words_of
from strategies.lower_set_dp import Options, solve_family
from strategies.lower_sets import principal_lower_sets
from strategies.plan import Plan

# Budgets are judged by the liveness replay (memory_model=paper: equation (2), Kusumoto et al.'s; NOTE [judging a
# DP's budget] in lower_set_dp.py).
BUDGET_LIVENESS = True


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    family = words_of(principal_lower_sets(graph), len(graph))
    plan = solve_family(graph, family, budget_bytes, options.mode, "approx_dp", memory_model=options.memory_model)
    return dataclasses.replace(plan, info={**plan.info, "lower_sets": len(family)})
