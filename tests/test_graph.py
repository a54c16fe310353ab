"""The IR on hand-made graphs."""

import pytest

from strategies import Graph, bits, members


def diamond() -> Graph:
    # a -> b, a -> c, b -> d, c -> d
    return Graph(mem_bytes=[1, 2, 3, 4], cost=[1, 10, 1, 1], edges=[(0, 1), (0, 2), (1, 3), (2, 3)],
                 names=["a", "b", "c", "d"])


def test_neighbours_and_reachability():
    g = diamond()
    assert g.preds[3] == (1, 2) and g.succs[0] == (1, 2)
    assert g.reaches(0, 3) and not g.reaches(1, 2) and g.reaches(2, 2)
    assert members(g.ancestor_mask[3]) == [0, 1, 2, 3]
    assert g.mem(bits([1, 2])) == 5 and g.time(g.all_nodes) == 13


def test_lower_sets_and_boundary():
    g = diamond()
    assert g.is_lower_set([0]) and g.is_lower_set([0, 1]) and g.is_lower_set([])
    assert not g.is_lower_set([1]) and not g.is_lower_set([0, 3])
    assert members(g.boundary(bits([0, 1]))) == [0, 1]  # a feeds c, b feeds d
    assert members(g.boundary(bits([0, 1, 2]))) == [1, 2]
    assert g.boundary(g.all_nodes) == 0
    assert members(g.out_neighbours(bits([0]))) == [1, 2]
    assert members(g.in_neighbours(bits([3]))) == [1, 2]


def test_default_backward_reads_are_the_inputs():
    g = diamond()
    assert g.backward_reads == ((), (0,), (0,), (1, 2))
    assert g.param_bytes == (0, 0, 0, 0) and g.saved_extra_bytes == (0, 0, 0, 0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mem_bytes=[1, 1], cost=[1, 1], edges=[(0, 1), (1, 0)]), "cycle through node"),
    (dict(mem_bytes=[1, 1], cost=[1, 1], edges=[(0, 2)]), "outside 0..1"),
    (dict(mem_bytes=[1, -5], cost=[1, 1], edges=[]), r"node 1 \(v1\) has negative mem_bytes"),
    (dict(mem_bytes=[1, 1], cost=[1, -1], edges=[]), r"node 1 \(v1\) has negative cost"),
    (dict(mem_bytes=[1, 1, 1], cost=[1, 1, 1], edges=[(2, 1)]), "topological order"),
    (dict(mem_bytes=[1, 1], cost=[1], edges=[]), "one per node"),
    (dict(mem_bytes=[1, 1, 1], cost=[1, 1, 1], edges=[(0, 1)], backward_reads=[(), (), (0,)]),
     "backward of node 2"),
])
def test_invalid_graphs_name_the_bad_node(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Graph(**kwargs)
