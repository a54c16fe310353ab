"""The paper's own graphs (a folder of them named by HARNESS_PAPER_GRAPHS): sizes and lower sets as Kusumoto et
al. 2019 reports."""

import pytest

from harness.zoo import paper_graphs
from strategies import simulate, solve
from strategies.lower_sets import all_lower_sets, split_points

GRAPHS = paper_graphs.available()
pytestmark = pytest.mark.skipif(not GRAPHS, reason=f"no paper graphs: set {paper_graphs.ENVIRONMENT} to a folder of them")

# #V of Kusumoto et al.'s Table 1; lower sets and Chen's candidates (with ∅ and V) as the authors' code counts them.
EXPECTED = {"vgg19": (46, 47, 47), "resnet50": (176, 241, 41), "unet": (60, 331, 12),
            "densenet": (568, 569, 101), "resnet152": (516, 581, 109), "pspnet": (385, 12533, 72),
            "googlenet": (134, 27358, 19)}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_sizes_match_the_paper(name):
    graph = paper_graphs.load(GRAPHS[name])
    nodes, lower_sets, candidates = EXPECTED[name]
    assert len(graph) == nodes
    assert len(split_points(graph)) + 2 == candidates
    if lower_sets < 1000:
        assert len(all_lower_sets(graph)) == lower_sets


@pytest.mark.parametrize("name", sorted(n for n in GRAPHS if EXPECTED[n][1] < 1000))
def test_exact_is_never_worse_than_approx(name):
    graph = paper_graphs.load(GRAPHS[name])
    exact = simulate(graph, solve("exact_dp", graph), liveness=False).peak_bytes
    approx = simulate(graph, solve("approx_dp", graph), liveness=False).peak_bytes
    assert exact <= approx
