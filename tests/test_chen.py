"""Chen et al. 2016's strategies on graphs worked out by hand."""

import math

import pytest

from strategies import Graph, members, simulate, solve
from strategies.lower_sets import split_points
from test_simulate import chain


def test_sqrt_segments_on_a_chain():
    # 16 equal nodes: split points after every node, so sqrt(16) = 4 segments of about 4 nodes, whose last
    # nodes are the checkpoints.
    g = chain(16)
    plan = solve("chen_sqrt", g)
    assert len(plan.stages) == math.isqrt(16)
    assert [len(members(s)) for s in plan.stages] == [5, 4, 4, 3]
    assert members(plan.kept) == [4, 8, 12]


def test_greedy_saves_memory_on_a_chain_and_meets_its_budget():
    g = chain(16)
    vanilla = simulate(g, solve("vanilla", g)).peak_bytes
    plan = solve("chen_greedy", g)
    peak = simulate(g, plan).peak_bytes
    assert peak < vanilla and len(plan.stages) > 1
    assert solve("chen_greedy", g, peak).stages == plan.stages


@pytest.mark.parametrize("name", ["chen_sqrt", "chen_greedy"])
def test_no_split_point_falls_back_to_one_segment(name):
    # A skip connection from every node to the output: no node but the first separates the graph.
    n = 12
    edges = [(v, v + 1) for v in range(n - 1)] + [(v, n - 1) for v in range(n - 2)]
    g = Graph(mem_bytes=[1] * n, cost=[1] * n, edges=edges)
    assert split_points(g) == [0]
    plan = solve(name, g)
    assert len(plan.stages) <= 2 and plan.stages[-1] & ~1 == g.all_nodes & ~1
