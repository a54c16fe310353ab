"""``optimal``: the least recomputation at a budget over the executor's plans, proven against brute force, its
relaxation never above the replay, and its plans exact and within budget when run."""

import dataclasses
import math
import random
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import strategies
from strategies import Graph, InfeasibleBudget, Plan, simulate, solve
from strategies.brute_force import every_plan
from test_dp import small_dags

cp_model = pytest.importorskip("ortools.sat.python.cp_model")
from strategies.optimal import finest  # noqa: E402
from strategies.optimal_model import _Relaxation, nothing_reads, solver_of  # noqa: E402
from strategies.replay import peak_layer, timeline  # noqa: E402


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5), st.data())
def test_the_optimum_is_brute_force_over_every_plan_and_never_above_exact_dp(graph, data):
    predictions = [simulate(graph, plan) for plan in every_plan(graph)]
    budget = data.draw(st.sampled_from(sorted({p.peak_bytes for p in predictions})))
    least = min(p.overhead_cost for p in predictions if p.peak_bytes <= budget)
    plan = solve("optimal", graph, budget, time_limit_s=60)
    prediction = simulate(graph, plan)
    assert plan.info["optimal_status"] == "optimal" and plan.info["gap"] == 0
    assert prediction.peak_bytes <= budget
    assert prediction.overhead_cost == least == plan.info["lower_bound"]
    try:
        exact = solve("exact_dp", graph, budget)
    except InfeasibleBudget:
        return
    assert prediction.overhead_cost <= simulate(graph, exact).overhead_cost


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5), st.data())
def test_the_model_with_stages_alone_reaches_the_optimum_where_the_kept_sets_run_out(graph, data):
    """Where the kept sets' search runs out of time at once, both searches go on in the model with stages alone,
    every plan it proposes replayed and cut (``_cheaper_plans``), and still prove brute force's optimum: the least
    recomputation at a budget, and the least peak."""
    predictions = [simulate(graph, plan) for plan in every_plan(graph)]
    budget = data.draw(st.sampled_from(sorted({p.peak_bytes for p in predictions})))
    cheapest = _Relaxation.cheapest

    def kept_sets_out_of_time(model, *args):
        return "timeout" if model.K == 1 else cheapest(model, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Relaxation, "cheapest", kept_sets_out_of_time)
        at_budget = solve("optimal", graph, budget, time_limit_s=60)
        least = solve("optimal", graph, mode="mc", time_limit_s=60)
    assert at_budget.info["optimal_status"] == "optimal" and simulate(graph, at_budget).peak_bytes <= budget
    assert simulate(graph, at_budget).overhead_cost == min(p.overhead_cost for p in predictions if p.peak_bytes <= budget)
    assert least.info["optimal_status"] == "optimal"
    assert simulate(graph, least).peak_bytes == min(p.peak_bytes for p in predictions)

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5))
def test_the_least_memory_is_brute_force_over_every_plan_and_never_above_a_dp(graph):
    """``mode=mc``: the least peak over every plan, proven, and the least recomputation at it."""
    reference = simulate(graph, solve("brute_force", graph, mode="mc"))
    plan = solve("optimal", graph, mode="mc", time_limit_s=60)
    prediction = simulate(graph, plan)
    assert plan.info["optimal_status"] == "optimal" and plan.info["gap"] == 0
    assert prediction.peak_bytes == reference.peak_bytes == plan.info["peak_lower_bound"]
    assert prediction.overhead_cost == reference.overhead_cost and plan.info["overhead_status"] == "optimal"
    for name in ("approx_dp", "exact_dp", "chen_greedy"):
        assert prediction.peak_bytes <= simulate(graph, solve(name, graph)).peak_bytes, name
    assert simulate(graph, solve("optimal", graph, reference.peak_bytes, mode="mc")).peak_bytes == reference.peak_bytes
    with pytest.raises(InfeasibleBudget, match=rf"optimal \(mc\): .* is {reference.peak_bytes} bytes"):
        solve("optimal", graph, reference.peak_bytes - 1, mode="mc")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5))
def test_every_plan_fits_the_relaxation_at_the_peak_its_replay_measures(graph):
    """The relaxation never counts more than the replay: with what recomputations read counted at every layer,
    each plan of a small DAG fits the models with and without stages at its replayed peak, at its cost."""
    unread, layers = nothing_reads(graph), [v for v in range(len(graph)) if graph.profile.reached[v]]
    plans = {(plan.stages, plan.kept | unread) for plan in every_plan(graph)}
    for plan in (Plan.from_stages(graph, list(stages), kept=kept) for stages, kept in plans):
        prediction = simulate(graph, plan)
        assert fixed(graph, plan, prediction.peak_bytes, layers) == (True, prediction.overhead_cost), plan
        assert kept_fits(graph, plan.kept, prediction.peak_bytes), plan


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5))
def test_finest_splits_a_kept_set_into_the_most_stages_any_plan_with_it_has(graph):
    most = {}
    for plan in every_plan(graph):
        most[plan.kept] = max(most.get(plan.kept, 0), len(plan.stages))
    for kept, count in most.items():
        plan = finest(graph, kept)
        assert plan.kept == kept and len(plan.stages) == count
        assert all(graph.is_lower_set(sum(plan.stages[:i + 1])) for i in range(len(plan.stages)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_dags(max_nodes=5), st.data())
def test_no_plan_that_fits_has_the_kept_flags_the_search_excludes(graph, data):
    """The kept sets first (NOTE [kept sets first]): each core of flags the search takes out of the model without
    stages is one that no plan fitting the budget has."""
    excluded, exclude = [], _Relaxation.exclude
    plans = list(every_plan(graph))
    budget = data.draw(st.sampled_from(sorted({simulate(graph, plan).peak_bytes for plan in plans})))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_Relaxation, "exclude", lambda self, flags: (excluded.append(flags), exclude(self, flags)))
        solve("optimal", graph, budget, time_limit_s=60)
    fitting = [plan.kept for plan in plans if simulate(graph, plan).peak_bytes <= budget]
    for flags in excluded:
        assert not any(all(bool(kept >> v & 1) == value for v, value in flags) for kept in fitting), flags
        model = _Relaxation(cp_model, graph, budget, stages=False)  # and the model no longer holds them
        model.exclude(flags)
        for v, value in flags:
            model.model.Add(model.kept[v] == int(value))
        assert solver_of(cp_model).Solve(model.model) == cp_model.INFEASIBLE


def fixed(graph, plan, budget, holding=()):
    """The relaxation with ``plan``'s stages and kept set: (whether it fits ``budget``, its least cost), with
    what recomputations read counted at the layers ``holding``."""
    model = _Relaxation(cp_model, graph, budget, holding=holding)
    for var, value in model._assignment(plan):
        model.model.Add(var == int(value))
    solver = solver_of(cp_model)
    status = solver.Solve(model.model)
    fits = status == cp_model.OPTIMAL
    return fits, solver.ObjectiveValue() / model.scale if fits else None


@pytest.mark.parametrize("net", ["vgg19", "unet", "resnet50", "gpt2"])
def test_the_relaxation_is_never_above_the_replay_on_the_zoo(net):
    from harness.run import traced_net
    graph = traced_net(net).traced.graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    plans = [solve("chen_sqrt", graph), solve("approx_dp", graph, mode="mc")]
    plans += [solve("approx_dp", graph, least + (vanilla - least) * k // 4) for k in (0, 2)]
    unread = nothing_reads(graph)
    reached = [v for v in range(len(graph)) if graph.profile.reached[v]]
    layers = reached[::max(1, len(reached) // 12)]  # a dozen: counted at every layer, 20 s a plan on ResNet-50
    for plan in plans:
        plan = dataclasses.replace(plan, kept=plan.kept | unread)  # the model keeps what nothing reads
        prediction = simulate(graph, plan)
        peak = peak_layer(timeline(graph, plan))
        fits, cost = fixed(graph, plan, prediction.peak_bytes, layers + ([peak] if peak is not None else []))
        assert fits, f"{plan.strategy}: the relaxation counts more than the replay's peak"
        assert cost == prediction.overhead_cost, plan.strategy
        assert kept_fits(graph, plan.kept, prediction.peak_bytes), plan.strategy
    # And kept sets of every density, each with its finest stages.
    rng = random.Random(0)
    for density in [0.0, 0.5, 0.9, 1.0] + [rng.random() for _ in range(12)]:
        kept = sum(1 << v for v in range(len(graph)) if rng.random() < density) | unread
        prediction = simulate(graph, finest(graph, kept))
        assert kept_fits(graph, kept, prediction.peak_bytes), f"kept at density {density:.2f}"


def kept_fits(graph, kept, budget):
    """Whether the model without stages holds the kept set ``kept`` within ``budget``, with what recomputations
    read counted at every layer's backward (the search counts it only where a plan's replay peaks): the moments
    there hold whatever the stages."""
    model = _Relaxation(cp_model, graph, budget, stages=False,
                        holding=[v for v in range(len(graph)) if graph.profile.reached[v]])
    for v, k in enumerate(model.kept):
        model.model.Add(k == (kept >> v & 1))
    return solver_of(cp_model).Solve(model.model) == cp_model.OPTIMAL


def test_vgg19_s_least_budget_is_proven_optimal_at_approx_dp_s_plan():
    from harness.run import traced_net
    graph = traced_net("vgg19").traced.graph
    approx = solve("approx_dp", graph)
    plan = solve("optimal", graph, time_limit_s=60)
    assert plan.budget_bytes == simulate(graph, approx).peak_bytes
    assert plan.info["optimal_status"] == "optimal" and plan.info["gap"] == 0
    assert simulate(graph, plan).overhead_cost == simulate(graph, approx).overhead_cost


def test_the_model_without_stages_proves_googlenet_s_plan_optimal_with_no_stage_searched():
    """At a quarter of the way from tc's least budget to vanilla's peak, the least cost of any kept set whose
    stage-free memory fits reaches the DPs' plan: proven with no plan proposed and replayed."""
    from harness.run import traced_net
    graph = traced_net("googlenet").traced.graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    budget = least + (vanilla - least) // 4
    # The model with stages alone takes 40 s. The limit is generous for the seeds: exact_dp, given a quarter of it,
    # must finish (it takes 0.5 s, several on a loaded machine compiling its kernels) for no plan to be replayed.
    plan = solve("optimal", graph, budget, time_limit_s=40)
    assert plan.info["optimal_status"] == "optimal" and plan.info["plans_replayed"] == 0
    approx, prediction = simulate(graph, solve("approx_dp", graph, budget)), simulate(graph, plan)
    assert prediction.peak_bytes <= budget and prediction.overhead_cost == plan.info["lower_bound"]
    kept_only = _Relaxation(cp_model, graph, budget, stages=False)
    assert kept_only.cheapest(math.inf, 10, 1) != "timeout" and kept_only.proposed == prediction.overhead_cost
    assert prediction.overhead_cost < approx.overhead_cost  # exact_dp's plan, cheaper than approx_dp's


def test_kept_values_held_for_a_recomputation_count_as_the_backward_begins():
    """GPT-2's cheapest kept sets discard attention's q, k and v and keep the projection they are split from,
    which no backward reads: held for the recomputation, it is live with the loss's gradients. Counted, the
    model without stages proves the DPs' plan optimal at once (without it, 40 s ended at a bound of 8 against 9)."""
    from harness.run import traced_net
    graph = traced_net("gpt2").traced.graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    budget = least + (vanilla - least) * 3 // 4
    kept_only = _Relaxation(cp_model, graph, budget, stages=False)
    assert kept_only.cheapest(math.inf, 10, 1) != "timeout"
    approx = simulate(graph, solve("approx_dp", graph, budget))
    assert kept_only.proposed == approx.overhead_cost
    plan = solve("optimal", graph, budget, time_limit_s=20)
    assert plan.info["optimal_status"] == "optimal" and plan.info["lower_bound"] == approx.overhead_cost


@pytest.mark.parametrize("net, quarters, below", [("unet", 1, "approx_dp"), ("resnet50", 3, "exact_dp")])
def test_kept_sets_prove_plans_cheaper_than_the_dps_in_seconds(net, quarters, below):
    """Where the replay of a kept set's finest stages peaks, the relaxation learns what recomputations read there
    (U-Net's discarded concatenations, their upsamplings held for them), and refuses the cheaper kept sets: a plan
    cheaper than the DPs', proven in seconds (without it, 40 s ended with neither proven)."""
    from harness.run import traced_net
    graph = traced_net(net).traced.graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    budget = least + (vanilla - least) * quarters // 4
    plan = solve("optimal", graph, budget, time_limit_s=10)
    assert plan.info["optimal_status"] == "optimal" and plan.info["plans_replayed"] <= 3
    prediction = simulate(graph, plan)
    assert prediction.peak_bytes <= budget and prediction.overhead_cost == plan.info["lower_bound"]
    assert prediction.overhead_cost < simulate(graph, solve(below, graph, budget)).overhead_cost


def test_the_optimal_plan_runs_exactly_and_within_its_budget(tmp_path):
    from harness.run import fixed_bytes, run_cell
    from harness.tracing.trace import trace
    from test_executor import SkipToOutput, assert_step_matches, reference_step

    torch.manual_seed(0)
    model = SkipToOutput().double()  # BatchNorm and dropout: state and randomness replayed
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    loss_fn = torch.sum
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    plan = solve("optimal", graph, (least + vanilla) // 2, time_limit_s=4)
    assert plan.recomputed and simulate(graph, plan).peak_bytes <= plan.budget_bytes
    reference, reference_loss = reference_step(model, x, loss_fn)
    assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, {})

    from harness.zoo import nets
    meta_model, meta_x, meta_loss = nets.build("vgg19", 2, 32, device="meta")
    graph = trace(meta_model, meta_x, loss_fn=meta_loss).graph
    least, vanilla = (simulate(graph, solve(name, graph)).peak_bytes for name in ("approx_dp", "vanilla"))
    budget = fixed_bytes(meta_model, meta_x) + (least + vanilla) // 2
    row = run_cell("vgg19", "optimal", batch_size=2, image_size=32, budget=budget, results_dir=tmp_path,
                   options={"time_limit_s": 4})
    assert row["status"] == "ok", row.get("error")
    assert row["plan_optimal_status"] in ("optimal", "timeout")
    assert row["measured_peak_bytes"] == row["predicted_peak_bytes"] <= budget


def test_the_time_limit_holds_where_the_model_with_stages_takes_longer_to_build():
    # a dense DAG of 200 nodes, each reading the four before it: the model with stages (200 stages of 200 nodes
    # and 790 edges) takes 14 s to build; the search asks for it at the least budget, and returns in its time
    rng = random.Random(0)
    n = 200
    graph = Graph(mem_bytes=[rng.randint(1, 9) for _ in range(n)], cost=[rng.randint(1, 3) for _ in range(n)],
                  edges=[(u, v) for v in range(1, n) for u in range(max(0, v - 4), v)])
    least = simulate(graph, solve("approx_dp", graph)).peak_bytes
    start = time.perf_counter()
    plan = solve("optimal", graph, least, time_limit_s=2)
    assert time.perf_counter() - start < 8
    cost = simulate(graph, plan).overhead_cost
    assert plan.info["optimal_status"] == "timeout" and 0 < plan.info["lower_bound"] < cost
    assert simulate(graph, plan).peak_bytes <= least


def test_bad_input(monkeypatch):
    graph = Graph(mem_bytes=[4, 4, 4], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
    for limit in (0, -1):
        with pytest.raises(ValueError, match="time_limit_s must be positive"):
            solve("optimal", graph, time_limit_s=limit)
        with pytest.raises(ValueError, match="time_limit_s must be positive"):
            solve("exact_dp", graph, time_limit_s=limit)
    with pytest.raises(ValueError, match=r"unknown mode 'least'; valid modes: tc .*, mc"):
        solve("optimal", graph, mode="least")
    with pytest.raises(TypeError, match=r"chen_sqrt has no memory-centric mode; strategies with one: approx_dp, "
                                        r"brute_force, exact_dp, optimal"):
        solve("chen_sqrt", graph, mode="mc")
    large = Graph(mem_bytes=[4] * 9, cost=[1] * 9, edges=[(v, v + 1) for v in range(8)])
    with pytest.raises(ValueError, match=r"9 nodes is too large .* \(at most 8 nodes\); optimal searches"):
        solve("brute_force", large)
    least = min(simulate(graph, plan).peak_bytes for plan in every_plan(graph))  # below approx_dp's least
    assert simulate(graph, solve("optimal", graph, least)).peak_bytes == least
    with pytest.raises(InfeasibleBudget, match=r"optimal \(approx_dp.s least plan fits \d+ bytes\): no plan"):
        solve("optimal", graph, least - 1)
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    with pytest.raises(ImportError, match=r"pip install ortools"):
        solve("optimal", graph)
    assert "optimal" in strategies.available()


def test_the_optimality_table_gives_each_strategy_as_a_ratio_to_the_best_plan_or_why_it_has_none():
    """A strategy with no plan in the budget (None in a row, NaN once rows are a DataFrame) shows its note; one
    with a plan, its overhead over the best plan's, and at a best plan of no overhead, 1.00 or inf."""
    import pandas as pd

    from harness.bench.optimality import STRATEGIES, ratios
    from harness.results import label

    cell = {"net": "net", "batch": 1, "nodes": 3, "of the way": 0.0, "budget GB": 1.0, "optimum": 2.0,
            "lower bound": 2.0, "gap": 0.0, "status": "optimal", "solve s": 0.1}
    rows = []
    for best, overhead in ((2.0, None), (2.0, math.nan), (2.0, 3.0), (0.0, 0.0), (0.0, 1.0)):
        row = {**cell, "best": best}
        for name, options in STRATEGIES:
            row[label(name, options)], row[label(name, options) + " note"] = overhead, "over"
        rows.append(row)
    column = label(*STRATEGIES[0])
    assert ratios(pd.DataFrame(rows))[column].tolist() == ["over", "over", "1.50", "1.00", "inf"]
