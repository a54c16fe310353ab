"""``chen_greedy``: Chen et al. 2016's memory planning with a budget, Algorithm 3.

Walking the nodes in topological order, the running size of the current segment grows by each output;
at a split point (``lower_sets.split_points``, Kusumoto et al.'s Appendix B) where it exceeds the per-segment
threshold, the segment ends there. The threshold is searched as memonger (Chen et al.'s
code) does: three rounds from 0, each next threshold
``sqrt(x·y/2)`` with ``x`` the bytes kept between segments and ``y`` the largest segment, then six points up
to ``sqrt(2)`` times the last; the plan of least predicted peak (liveness replay, as memonger measured real
memory) that fits ``budget_bytes`` wins. No split point: one segment. O(|V|) per threshold.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.lower_sets import split_points
from strategies.plan import InfeasibleBudget, Plan
from strategies.simulate import simulate

BUDGET_LIVENESS = True


@dataclass(frozen=True, slots=True)
class Options:
    grid_points: int = 6  # memonger's ntrial


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    points = set(split_points(graph))
    tried = {}
    threshold, low = 0, math.inf
    for _ in range(3):
        kept, largest, plan = _greedy(graph, points, threshold, budget_bytes)
        tried[threshold] = plan
        low = min(low, largest)
        threshold = math.isqrt(kept * largest // 2)
    high = threshold * math.sqrt(2)
    step = (high - low) / options.grid_points
    for j in range(1, options.grid_points + 1):
        t = int(low + j * step)
        if step > 0 and t not in tried:
            tried[t] = _greedy(graph, points, t, budget_bytes)[2]
    peaks = {t: simulate(graph, plan).peak_bytes for t, plan in tried.items()}
    best = min(tried, key=lambda t: (peaks[t], t))
    if budget_bytes is not None and peaks[best] > budget_bytes:
        raise InfeasibleBudget(budget_bytes, peaks[best], "chen_greedy")
    return dataclasses.replace(tried[best], info={**tried[best].info, "threshold_bytes": best})


def _greedy(graph: Graph, points: set[int], threshold: int, budget_bytes: int | None):
    """Algorithm 3 at one threshold: (bytes kept at splits, largest segment, plan)."""
    running, kept, largest, chain = 0, 0, 0, []
    for v in range(len(graph)):
        running += graph.mem_bytes[v]
        if v in points and running > threshold:
            kept += graph.mem_bytes[v]
            largest = max(largest, running)
            chain.append(graph.ancestor_mask[v])
            running = 0
    largest = max(largest, running)
    chain.append(graph.all_nodes)
    return kept, largest, Plan.from_chain(graph, chain, strategy="chen_greedy", budget_bytes=budget_bytes)
