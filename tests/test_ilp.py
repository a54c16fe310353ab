"""Checkmate's MILP (``ilp_optimal``) against the stage plans it contains, and its solver statuses: on its
own accounting (``memory_model=paper``) and judged by the replay every strategy is (the default)."""

import pytest
from hypothesis import HealthCheck, given, settings

import strategies
from strategies import Graph, InfeasibleBudget, SolverTimeout, schedule, simulate, solve
from test_dp import every_chain, small_dags

pytest.importorskip("highspy")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=6))
def test_ilp_is_never_worse_than_exact_dp_at_the_same_budget(graph):
    training = schedule.training_graph(graph)
    for budget in sorted({peak for peak, _ in every_chain(graph)}):
        exact = solve("exact_dp", graph, budget, memory_model="paper")  # budgets of equation (2)
        computed, held = schedule.from_plan(graph, exact)
        schedule.validate(training, computed, held)
        assert schedule.cost(training, computed) <= simulate(graph, exact, liveness=False).overhead_cost  # Eq. (1)
        # The same budget, counted for both by the schedule accounting: exact_dp's schedule fits it.
        same = schedule.peak(training, computed, held) + sum(graph.profile.param_bytes)
        ilp = solve("ilp_optimal", graph, same, time_limit_s=30, memory_model="paper")
        assert ilp.info["ilp_status"] == "optimal"
        predicted = simulate(graph, ilp, liveness=False)  # a schedule without liveness: Checkmate's count
        assert predicted.peak_bytes <= same
        assert 0 <= predicted.overhead_cost <= schedule.cost(training, computed)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=6))
def test_judged_by_the_replay_the_ilp_fits_its_budget_and_is_never_worse_than_approx_dp(graph):
    least = solve("ilp_optimal", graph, time_limit_s=10)
    budgets = {simulate(graph, least).peak_bytes, least.budget_bytes}
    # The peaks approx_dp's plans reach, each a budget approx_dp accepts (test_dp)
    paper_least = simulate(graph, solve("approx_dp", graph, memory_model="paper"), liveness=False).peak_bytes
    budgets |= {simulate(graph, solve("approx_dp", graph, peak, memory_model="paper")).peak_bytes
                for peak, _ in every_chain(graph) if peak >= paper_least}
    for budget in sorted(budgets):
        ilp = solve("ilp_optimal", graph, budget, time_limit_s=10)
        assert simulate(graph, ilp).peak_bytes <= budget
        try:
            approx = solve("approx_dp", graph, budget)
        except InfeasibleBudget:
            continue  # the ILP found a schedule below approx_dp's least
        assert simulate(graph, ilp).overhead_cost <= simulate(graph, approx).overhead_cost


def wide_graph(n=14):
    """A chain with skips: large enough that HiGHS cannot finish in a millisecond."""
    edges = [(v - 1, v) for v in range(1, n)] + [(v - 3, v) for v in range(3, n, 2)]
    return Graph(mem_bytes=[10 + (7 * v) % 13 for v in range(n)], cost=[1 + v % 3 for v in range(n)], edges=edges)


def test_a_time_limit_returns_the_warm_start_with_status_timeout():
    graph = wide_graph()
    plan = solve("ilp_optimal", graph, time_limit_s=1e-3, memory_model="paper")
    assert plan.info["ilp_status"] == "timeout"
    assert plan.info["ilp_gap"] > 0
    assert simulate(graph, plan).overhead_cost <= plan.info["warm_start_overhead"]
    with pytest.raises(SolverTimeout, match="found no schedule"):
        solve("ilp_optimal", graph, time_limit_s=1e-3, warm_start=False, memory_model="paper")
    # Judged by the replay, approx_dp's plan is the answer until a MILP beats it.
    plan = solve("ilp_optimal", graph, time_limit_s=1e-3)
    assert simulate(graph, plan).overhead_cost <= plan.info["approx_dp_overhead"]


def test_budget_none_is_approx_dp_s_minimal_schedule_and_the_ilp_beats_or_ties_it():
    graph = wide_graph(8)
    training = schedule.training_graph(graph)
    plan = solve("ilp_optimal", graph, memory_model="paper")
    start = schedule.from_plan(graph, solve("approx_dp", graph, memory_model="paper"))
    assert plan.budget_bytes == schedule.peak(training, *start) + sum(graph.profile.param_bytes)
    assert plan.info["ilp_status"] == "optimal"
    assert simulate(graph, plan).overhead_cost <= schedule.cost(training, start[0])
    plan = solve("ilp_optimal", graph)  # judged by the replay
    least = solve("approx_dp", graph)
    assert plan.budget_bytes == simulate(graph, least).peak_bytes >= simulate(graph, plan).peak_bytes
    assert simulate(graph, plan).overhead_cost <= simulate(graph, least).overhead_cost


def test_a_schedule_may_compute_a_node_three_times():
    # A stage plan computes a node at most twice (forward, one recomputation); at this budget the optimum
    # recomputes the first, cheap-to-hold but costly node for two separate backwards (found by search).
    graph = Graph(mem_bytes=[2, 50, 2, 1, 50], cost=[10, 1, 1, 10, 1],
                  edges=[(0, 1), (1, 2), (2, 3), (3, 4), (0, 3), (1, 4), (2, 4)])
    plan = solve("ilp_optimal", graph, 157, memory_model="paper")
    computed, _ = plan.schedule
    assert max(sum(row >> v & 1 for row in computed) for v in range(len(graph))) >= 3
    assert simulate(graph, plan, liveness=False).peak_bytes <= 157


def test_bad_input():
    graph = wide_graph(6)
    with pytest.raises(ValueError, match="time_limit_s must be positive"):
        solve("ilp_optimal", graph, time_limit_s=0)
    with pytest.raises(strategies.Inapplicable, match="raise max_stages"):
        solve("ilp_optimal", graph, max_stages=4)
    with pytest.raises(ValueError, match="unknown memory_model 'x'; valid: traced"):
        solve("ilp_optimal", graph, memory_model="x")
    for model in ("paper", "traced"):
        with pytest.raises(InfeasibleBudget) as error:
            solve("ilp_optimal", graph, 5, memory_model=model)
        least = error.value.min_feasible_bytes  # paper: proved by a second MILP that minimises the peak
        assert least is not None and f"minimal feasible budget is {least} bytes" in str(error.value)
        plan = solve("ilp_optimal", graph, least, memory_model=model)
        assert simulate(graph, plan, liveness=model == "traced").peak_bytes == least
        with pytest.raises(InfeasibleBudget):
            solve("ilp_optimal", graph, least - 1, memory_model=model)


def test_the_row_says_the_schedule_was_predicted_not_run_and_runs_a_stage_plan(tmp_path):
    from harness.zoo import nets
    from harness.run import fixed_bytes, run_cell
    from harness.tracing.trace import trace

    # U-Net, 40% of the way from approx_dp's least replay to vanilla's: a schedule recomputes one layer
    # (cost 1) where approx_dp's plans recompute a convolution (11). At VGG-19's least, the MILP finds
    # nothing cheaper than approx_dp's plan, which is the answer and runs like any stage plan.
    model, x, loss_fn = nets.build("unet", 1, 188, device="meta")
    graph = trace(model, x, loss_fn=loss_fn).graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    budget = fixed_bytes(model, x) + least + (vanilla - least) * 2 // 5
    row = run_cell("unet", "ilp_optimal", batch_size=1, image_size=188, budget=budget, results_dir=tmp_path,
                   options={"time_limit_s": 30})
    assert row["status"] == "ok", row.get("error")
    assert row["measured_peak_bytes"] is None and row["method"].startswith("not run")
    assert row["plan_ilp_status"] in ("optimal", "timeout")
    assert row["predicted_peak_bytes"] <= budget and 0 < row["predicted_overhead_cost"] < 11
    row = run_cell("vgg19", "ilp_optimal", batch_size=1, image_size=32, results_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["plan_ilp_status"] == "warm_start"
    assert row["measured_peak_bytes"] == row["predicted_peak_bytes"] > row["static_bytes"]


def test_a_checkpointed_plan_is_no_schedule_but_warm_starts_the_ilp_as_its_stages_run():
    from strategies.ilp_optimal import within_replay
    from strategies.plan import Plan, canonical_cache

    graph = wide_graph(10)
    stages = (0b111, 0b111000, 0b1111000000)
    peer = Plan.from_stages(graph, stages, strategy="torch_checkpoint_sequential",
                            kept=canonical_cache(graph, stages) | stages[-1], checkpointed=0b11)
    with pytest.raises(ValueError, match="checkpointed stages"):
        schedule.from_plan(graph, peer)
    peak = simulate(graph, peer).peak_bytes
    ilp = within_replay(graph, peak, peer, time_limit_s=10)
    assert simulate(graph, ilp).peak_bytes <= peak
    assert simulate(graph, ilp).overhead_cost <= simulate(graph, peer).overhead_cost
