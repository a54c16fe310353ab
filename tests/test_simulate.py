"""Plans, the simulator and the registry, on graphs whose answers are worked out by hand."""

import dataclasses
import inspect
from pathlib import Path

import pytest

import strategies
from harness.execute import peers
from strategies import Graph, InfeasibleBudget, Plan, members, simulate, solve
from strategies.liveness_only import static_plan_bytes
from strategies.replay import timeline
from test_graph import diamond

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def chain(n=3) -> Graph:
    return Graph(mem_bytes=[1] * n, cost=[1] * n, edges=[(i, i + 1) for i in range(n - 1)])


def test_kusumoto_worked_chain():
    # Kusumoto et al. 2019's worked chain: a -> b -> c, all m = t = 1.
    g = chain()
    plan = Plan.from_stages(g, [[0], [1], [2]])
    assert members(plan.kept) == [0, 1] and members(plan.recomputed) == [2]
    # M_1 = 0 + 2 + 1 + 0, M_2 = 1 + 2 + 1 + 0, M_3 = 2 + 2 + 0 + 0; T = t(c).
    assert simulate(g, plan, liveness=False) == strategies.Prediction(4, 1.0, False)
    one_stage = Plan.from_stages(g, [[0, 1, 2]])
    assert simulate(g, one_stage, liveness=False) == strategies.Prediction(6, 3.0, False)


def test_equation_2_on_a_diamond():
    g = diamond()  # m = a 1, b 2, c 3, d 4
    plan = Plan.from_stages(g, [[0], [1, 2], [3]])
    # M_1 = 0 + 2*1 + m(b,c) + 0 = 7; M_2 = m(a) + 2*(2+3) + m(d) + 0 = 15; M_3 = m(a,b,c) + 2*4 = 14.
    assert simulate(g, plan, liveness=False).peak_bytes == 15
    assert simulate(g, plan, liveness=False).overhead_cost == 1.0  # equation (1): only d is discarded
    assert simulate(g, plan).overhead_cost == 0  # and no backward reads it: nothing is recomputed


def test_liveness_replays_the_step():
    g = chain()
    vanilla = solve("vanilla", g)
    # forward: a, b live (read by the backwards of b and c), c freed after the loss -> 3;
    # backward: grad c (1) + a + b + grad b (1) = 4 at c's backward; then b, grad c go.
    assert simulate(g, vanilla).peak_bytes == 4
    assert simulate(g, vanilla, liveness=False).peak_bytes == 6  # 2 m(V): everything kept
    steps = timeline(g, vanilla)
    assert [s.phase for s in steps].count("recompute") == 0


def test_recomputation_in_the_timeline():
    g = chain(4)
    plan = Plan.from_stages(g, [[0, 1], [2, 3]])  # keeps b, discards a (stage 1) and c, d (stage 2)
    steps = timeline(g, plan)
    recomputed = [s.node for s in steps if s.phase == "recompute" and s.allocs]
    # stage 2 first (the backward runs backwards), then stage 1; no backward reads d, which is not made again
    assert recomputed == [2, 0]
    assert simulate(g, plan).overhead_cost == 2.0
    assert simulate(g, plan, liveness=False).overhead_cost == 3.0  # equation (1) charges every discarded value


def test_a_shared_parameters_gradient_is_made_once_by_the_first_backward_that_reaches_it():
    # b and c read one parameter (a module applied on two branches); its bytes count at c, the later
    # reader, and b shares them (NOTE [parameter gradients] in harness/tracing/probe.py).
    g = diamond().replace(param_bytes=[0, 0, 100, 0], param_sharers=[(), (), (1,), ()])
    for stages, first in (([[0, 1], [2], [3]], 2), ([[0, 2], [1, 3]], 1)):  # the backward reaches c first, then b
        steps = timeline(g, Plan.from_stages(g, stages))
        made = [s.node for s in steps if (("param_grad", 2), 100) in s.allocs]
        assert made == [first], stages
    with pytest.raises(ValueError, match="param_sharers of node 2"):
        g.replace(param_sharers=[(), (), (2,), ()])


def test_plan_validation_names_the_node():
    g = diamond()
    with pytest.raises(ValueError, match="its input 0"):
        Plan.from_stages(g, [[1], [0, 2, 3]])
    with pytest.raises(ValueError, match="node 3 .* is in no stage"):
        Plan.from_stages(g, [[0], [1, 2]])
    with pytest.raises(ValueError, match="node 0 .* is recomputed in stage 0 but node 1"):
        Plan.from_stages(g, [[0], [1, 2, 3]], kept=[])


def test_registry_errors_list_the_choices():
    with pytest.raises(KeyError, match=f"valid strategies: {', '.join(strategies.available())}.*Did you mean 'vanilla'"):
        solve("vanila", chain())
    with pytest.raises(TypeError, match="its options: match_range, inplace"):
        solve("liveness_only", chain(), bogus=1)


def test_vanilla_budget():
    g = chain()
    assert solve("vanilla", g, 4).budget_bytes == 4
    with pytest.raises(InfeasibleBudget) as error:
        solve("vanilla", g, 3)
    assert error.value.min_feasible_bytes == 4 and "minimal feasible budget is 4 bytes" in str(error.value)


def test_liveness_only_reports_its_static_plan():
    g = chain()
    plan = solve("liveness_only", g, match_range=1)
    assert plan.info["naive_bytes"] == 6 and plan.info["liveness_peak_bytes"] == 4
    # Slots by hand (allocate, then free): a->s0, b->s1, c->s2 (freed), grad c->s2, grad b->s3
    # (s2 is busy), then grad a reuses the freed s1: four slots of one byte.
    assert plan.info["static_plan_bytes"] == 4


def test_static_plan_reuses_in_place():
    # a -> act, whose backward reads a: a's gradient can go where a and act's gradient were. (A ReLU that
    # reads its own output frees it before its input's gradient is made, so it reuses it without help.)
    g = Graph(mem_bytes=[8, 8], cost=[1, 1], edges=[(0, 1)], kinds=["conv", "act"], backward_reads=[(), (0,)])
    steps = timeline(g, Plan.from_stages(g, [g.all_nodes], kept=g.all_nodes))
    assert static_plan_bytes(g, steps, inplace=True) < static_plan_bytes(g, steps, inplace=False)


def test_every_strategy_has_its_config_and_the_contract():
    stems = {p.stem for p in (CONFIGS / "strategy").glob("*.yaml")}
    assert set(strategies.available()) <= stems
    # The others are variants of one strategy (approx_dp_mc: approx_dp, mode mc).
    assert all(any(stem.startswith(name + "_") for name in strategies.available())
               for stem in stems - set(strategies.available()))
    for name in strategies.available():
        module = strategies.module(name)
        assert isinstance(module.BUDGET_LIVENESS, bool)
        params = list(inspect.signature(module.solve).parameters.values())
        assert [p.name for p in params] == ["graph", "budget_bytes", "options"]
        assert params[2].kind is inspect.Parameter.KEYWORD_ONLY
    with_mode = [name for name in strategies.available()
                 if "mode" in {field.name for field in dataclasses.fields(strategies.module(name).Options)}]
    assert with_mode == list(strategies.WITH_MEMORY_MODE)


@pytest.mark.parametrize("name", strategies.available())
def test_every_strategy_is_deterministic_and_within_budget(name):
    g = diamond()
    peer = peers.zoo_options(name, {"blocks": ["no-such-block"], "sequence": ["no-such-step"]})  # no modules
    if name in ("sac_ops", "megatron_selective"):  # they look for linear layers in blocks and attention nodes
        g = Graph(mem_bytes=g.mem_bytes, cost=g.cost, edges=g.edges, names=g.names,
                  kinds=["op", "linear", "attention", "linear"], scopes=["", "block.q", "block.attention", "block.o"])
        peer = peers.zoo_options(name, {"blocks": ["block"], "sequence": []})
    first, second = solve(name, g, **peer), solve(name, g, **peer)
    assert (first.stages, first.kept) == (second.stages, second.kept)
    if name == "torch_compile_budget":  # takes a ratio of the activations, not bytes (tests/test_peers.py)
        return
    peak = simulate(g, first, liveness=strategies.module(name).BUDGET_LIVENESS).peak_bytes
    assert solve(name, g, peak, **peer).budget_bytes == peak
    # Their default budget is approx_dp's plan's, not their own least (test_ilp, test_optimal).
    if name not in ("ilp_optimal", "optimal"):
        with pytest.raises(InfeasibleBudget):
            solve(name, g, peak - 1, **peer)


def test_a_plan_names_only_its_own_stages_as_checkpointed():
    graph = Graph(mem_bytes=[1, 1, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
    assert Plan.from_stages(graph, [[0], [1, 2]], checkpointed=0b01).checkpointed == 1
    with pytest.raises(ValueError, match="checkpointed names stage 2, but the plan has 2 stages"):
        Plan.from_stages(graph, [[0], [1, 2]], checkpointed=0b100)
