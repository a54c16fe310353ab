"""Families of lower sets (Kusumoto et al. 2019, sections 3 and 4.3), as bitsets sorted by size."""

from __future__ import annotations

import math

import numpy as np

from strategies import dp_kernels as kernels
from strategies.graph import Graph, bitset

LIMIT = 5_000_000


def all_lower_set_words(graph: Graph, limit: int = LIMIT, deadline: float = math.inf) -> np.ndarray:
    """Every lower set of ``graph`` as rows of words (``dp_kernels.enumerate_lower_sets``); raises
    ``ValueError`` past ``limit`` rather than truncate, ``TimeoutError`` past ``deadline``
    (``time.perf_counter``'s clock)."""
    words, complete = kernels.enumerate_lower_sets(graph.pred_words, limit, deadline)
    if not complete:
        raise ValueError(f"the graph has more than {limit} lower sets; the exact DP cannot enumerate them "
                         "(use approx_dp, or raise the limit)")
    return words


def all_lower_sets(graph: Graph, limit: int = LIMIT) -> list[int]:
    """Every lower set of ``graph`` as bitsets, by size."""
    return sorted((bitset(row) for row in all_lower_set_words(graph, limit)), key=lambda s: (s.bit_count(), s))


def principal_lower_sets(graph: Graph) -> list[int]:
    """``{L_v : v ∈ V} ∪ {∅, V}``, ``L_v`` being ``v`` with all its ancestors (Kusumoto et al. 2019, section 4.3)."""
    family = {0, graph.all_nodes, *graph.ancestor_mask}
    return sorted(family, key=lambda s: (s.bit_count(), s))


def split_points(graph: Graph) -> list[int]:
    """Nodes ``v`` that alone separate what comes before from what comes after: ``∂(L_v) = {v}``, the
    lower-set form of an articulation point (Kusumoto et al. 2019, Appendix B). In node order; their ``L_v`` are nested."""
    points, previous = [], 0
    for v in range(len(graph)):
        lower = graph.ancestor_mask[v]
        if lower != graph.all_nodes and graph.boundary(lower) == 1 << v and lower & previous == previous:
            points.append(v)
            previous = lower
    return points
