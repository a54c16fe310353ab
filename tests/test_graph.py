"""The IR on hand-made graphs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 150), st.data())
def test_set_helpers_agree_with_their_definitions_on_small_and_large_sets(n, data):
    # Sets of up to a few dozen nodes take a loop over their bits, larger ones numpy: both must agree.
    edges = data.draw(st.sets(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                              .filter(lambda e: e[0] < e[1]), max_size=3 * n))
    g = Graph(mem_bytes=[1] * n, cost=[1] * n, edges=edges)
    mask = data.draw(st.one_of(st.integers(0, (1 << n) - 1), st.sets(st.integers(0, n - 1)).map(bits)))
    nodes = [v for v in range(n) if mask >> v & 1]
    assert members(mask) == nodes
    assert g.out_neighbours(mask) == bits(v for u, v in g.edges if u in nodes)
    assert g.in_neighbours(mask) == bits(u for u, v in g.edges if v in nodes)
    lower = g.ancestor_mask[nodes[-1]] if nodes else 0
    assert g.boundary(lower) == bits(u for u, v in g.edges if lower >> u & 1 and not lower >> v & 1)
    # Prefixes of the node order are lower sets: a chain of them, and its stages.
    chain = [(1 << k) - 1 for k in sorted(data.draw(st.sets(st.integers(1, n - 1))) | {n})]
    stages = [s & ~t for s, t in zip(chain, [0] + chain[:-1])]
    assert list(g.frontiers(stages)) == [(s, bits(v for u, v in g.edges if s >> u & 1 and not s >> v & 1))
                                         for s in chain]


def test_default_backward_reads_are_the_inputs():
    g = diamond()
    assert g.profile.backward_reads == ((), (0,), (0,), (1, 2))
    assert g.profile.param_bytes == (0, 0, 0, 0) and g.profile.saved_extra_bytes == (0, 0, 0, 0)


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


def test_a_copy_keeps_every_field_it_is_not_given():
    """``Graph.replace`` (how the DPs' equation (2) view and a sharded cell's graph are made) changes what it is
    given and keeps the rest, the profile's fields all included."""
    g = diamond().replace(param_bytes=[0, 0, 100, 0], loss_reads=[3], param_grads_released=True, scopes=list("abcd"))
    copy = g.replace(loss_bytes=8)
    assert copy.profile.loss_bytes == 8 and copy.replace(loss_bytes=0) == g
    assert copy.profile.param_grads_released and copy.profile.param_bytes == (0, 0, 100, 0)
    assert copy.profile.loss_reads == (3,) and copy.scopes == tuple("abcd") and copy.outputs == g.outputs


def test_a_profile_field_the_graph_does_not_know_is_refused():
    with pytest.raises(TypeError, match="backward_read"):
        Graph(mem_bytes=[1], cost=[1], edges=[], backward_read=[()])
