"""``chen_sqrt``: Chen et al. 2016's sqrt(n) segmentation, as Kusumoto et al. 2019 ran it.

Candidate splits are the lower sets with a single boundary node (``lower_sets.split_points``), plus ∅ and
V, ordered by memory; with ``k = max(floor(sqrt(#candidates)), 1)`` segments of about ``m(V) / k`` bytes
each, a candidate is kept when its memory passes the next multiple of ``m(V) / k``
(as the authors' ``Chen.cpp`` does). The kept sets are the chain of a canonical
strategy. No split point: one segment. The budget is only checked, by the liveness replay (as memonger
measured real memory). O(|V| + |E|) after the ancestor sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.lower_sets import split_points
from strategies.plan import Plan
from strategies.simulate import check_budget

BUDGET_LIVENESS = True


@dataclass(frozen=True, slots=True)
class Options:
    pass


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    candidates = [0] + [graph.ancestor_mask[v] for v in split_points(graph)] + [graph.all_nodes]
    candidates.sort(key=graph.mem)
    step = graph.mem(graph.all_nodes) // max(math.isqrt(len(candidates)), 1)
    threshold, chain = step, []
    for i, lower in enumerate(candidates[1:], start=1):
        size = graph.mem(lower)
        if i == len(candidates) - 1 or size > threshold:
            chain.append(lower)
            while threshold < size:
                threshold += max(step, 1)
    plan = Plan.from_chain(graph, chain, strategy="chen_sqrt", budget_bytes=budget_bytes)
    check_budget(graph, plan, budget_bytes)
    return plan
