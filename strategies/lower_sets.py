"""Families of lower sets (seed 004, sections 3 and 4.3), as bitsets sorted by size."""

from __future__ import annotations

from strategies.graph import Graph


def all_lower_sets(graph: Graph, limit: int = 2_000_000) -> list[int]:
    """Every lower set of ``graph``, by size; raises ``ValueError`` past ``limit`` rather than truncate."""
    n = len(graph)
    pred = graph.pred_mask
    seen = {0}
    frontier = [0]
    while frontier:
        grown = []
        for lower in frontier:
            rest = ~lower
            for v in range(n):
                if rest >> v & 1 and pred[v] & rest == 0:
                    bigger = lower | 1 << v
                    if bigger not in seen:
                        seen.add(bigger)
                        grown.append(bigger)
        if len(seen) > limit:
            raise ValueError(f"the graph has more than {limit} lower sets; the exact DP cannot enumerate them "
                             "(use approx_dp, or raise the limit)")
        frontier = grown
    return sorted(seen, key=lambda s: (s.bit_count(), s))


def principal_lower_sets(graph: Graph) -> list[int]:
    """``{L_v : v ∈ V} ∪ {∅, V}``, ``L_v`` being ``v`` with all its ancestors (seed 004, section 4.3)."""
    family = {0, graph.all_nodes, *graph.ancestor_mask}
    return sorted(family, key=lambda s: (s.bit_count(), s))


def split_points(graph: Graph) -> list[int]:
    """Nodes ``v`` that alone separate what comes before from what comes after: ``∂(L_v) = {v}``, the
    lower-set form of an articulation point (seed 004, Appendix B). In node order; their ``L_v`` are nested."""
    points, previous = [], 0
    for v in range(len(graph)):
        lower = graph.ancestor_mask[v]
        if lower != graph.all_nodes and graph.boundary(lower) == 1 << v and lower & previous == previous:
            points.append(v)
            previous = lower
    return points
