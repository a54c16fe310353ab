"""swap (Meng et al. 2017): the plan meets its budget by swapping, the executor moves exactly what the plan says and
the measured peak follows the prediction; gradients equal vanilla's (tests/test_executor.py, every zoo net)."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

import strategies
from harness.execute import execute
from harness.measure import measure
from harness.run import fixed_bytes, run_cell
from harness.tracing.trace import trace
from strategies import Graph, InfeasibleBudget, members, simulate

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MIB = 1 << 20


def chain(n=8, size=4 * MIB):
    return Graph(mem_bytes=[size] * n, cost=[1] * n, edges=[(i, i + 1) for i in range(n - 1)])


def test_the_device_peak_falls_with_the_budget_and_the_long_lived_values_go_first():
    g = chain()
    vanilla = simulate(g, strategies.solve("vanilla", g)).peak_bytes
    least = simulate(g, strategies.solve("swap", g)).peak_bytes
    assert least < vanilla
    previous_peak, previous_swapped = vanilla, 0
    for budget in range(vanilla, least - 1, -MIB):
        plan = strategies.solve("swap", g, budget)
        peak = simulate(g, plan).peak_bytes
        assert peak <= budget and peak <= previous_peak
        assert plan.swapped & previous_swapped == previous_swapped  # a tighter budget swaps a superset
        swapped = members(plan.swapped)
        assert swapped == sorted(swapped)[:len(swapped)] and (not swapped or swapped[0] == 0)  # far from the loss
        previous_peak, previous_swapped = peak, plan.swapped
    with pytest.raises(InfeasibleBudget, match=f"minimal feasible budget is {least} bytes"):
        strategies.solve("swap", g, least - 1)


def test_bytes_moved_add_up_and_small_values_stay():
    g = Graph(mem_bytes=[4 * MIB, MIB - 1, 4 * MIB, 2 * MIB, 4 * MIB], cost=[1] * 5,
              edges=[(0, 1), (1, 2), (2, 3), (3, 4)])
    plan = strategies.solve("swap", g)
    assert 1 not in members(plan.swapped)  # below min_bytes
    prediction = simulate(g, plan)
    assert prediction.host_bytes == plan.info["host_bytes"] == g.mem(plan.swapped)
    assert plan.info["swap_out_bytes"] == plan.info["swap_in_bytes"] == g.mem(plan.swapped)
    moved_s = g.mem(plan.swapped) / 50e9
    assert plan.info["swap_out_s"] == pytest.approx(moved_s)
    assert plan.info["step_time_bound_s"] == pytest.approx(max(plan.info["compute_s"], moved_s))
    assert plan.info["compute_s"] == pytest.approx(3 * sum(g.flops) / 100e12)  # forward once, backward twice


def test_copies_hide_behind_slow_compute_and_come_back_just_in_time_otherwise():
    g = chain()
    roomy = simulate(g, strategies.solve("vanilla", g)).peak_bytes - 1
    slow = strategies.solve("swap", g, roomy, compute_tflops=1e-9)  # a node takes 1 ms, a copy 84 us
    assert slow.info["prefetch"] == "hidden" and slow.info["compute_s"] > slow.info["swap_in_s"]
    for u, trigger in slow.prefetch:  # started before the backward that reads it (node u + 1)
        assert trigger > u + 1
    fast = strategies.solve("swap", g, compute_tflops=1e6)  # nothing to hide behind: the least peak
    assert fast.info["prefetch"] == "just_in_time"
    assert all(trigger == u + 1 for u, trigger in fast.prefetch)
    assert fast.info["step_time_bound_s"] == fast.info["swap_in_s"]


def test_bad_options_are_refused():
    g = chain()
    with pytest.raises(ValueError, match="bandwidth_gbps must be positive"):
        strategies.solve("swap", g, bandwidth_gbps=0)
    with pytest.raises(ValueError, match="not swap itself"):
        strategies.solve("swap", g, base="swap")
    with pytest.raises(KeyError, match="valid strategies"):
        strategies.solve("swap", g, base="no_such_strategy")
    with pytest.raises(strategies.Inapplicable, match="not a stage plan"):  # Checkmate's own count: a schedule
        strategies.solve("swap", g, base="ilp_optimal", base_options={"memory_model": "paper"})


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(6)])

    def forward(self, x):
        return self.layers(x)


@pytest.mark.parametrize("base", [None, "approx_dp"])
def test_the_executor_moves_what_the_plan_says_and_the_peak_follows(base):
    model = Mlp().to("meta")
    x = torch.empty(1024, 512, device="meta")
    traced = trace(model, x)
    static = fixed_bytes(model, x)
    start = strategies.solve(base or "vanilla", traced.graph)
    least = strategies.solve("swap", traced.graph, base=base)
    assert least.swapped
    measured, predicted = [], []
    for plan in (start, least):
        measured.append(measure(lambda: execute(traced, plan, x), model, (x,), "meta"))
        predicted.append(simulate(traced.graph, plan))
        assert measured[-1].host_peak_bytes == predicted[-1].host_bytes
        assert measured[-1].peak_bytes == predicted[-1].peak_bytes + static
    assert measured[1].peak_bytes <= measured[0].peak_bytes and predicted[1].peak_bytes <= predicted[0].peak_bytes
    if base is None:  # a recomputation plan may peak where no swap helps; vanilla peaks on kept values
        assert measured[1].peak_bytes < 0.9 * measured[0].peak_bytes


def test_a_budgeted_row_on_meta(tmp_path):
    vanilla = run_cell("resnet50", "vanilla", batch_size=8, image_size=112)
    budget = int(0.8 * vanilla["measured_peak_bytes"])
    row = run_cell("resnet50", "swap", batch_size=8, image_size=112, budget=budget, results_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["measured_peak_bytes"] <= budget
    assert row["measured_host_peak_bytes"] == row["plan_host_bytes"] > 0
    assert row["measured_peak_bytes"] == row["predicted_peak_bytes"]
    low = run_cell("resnet50", "swap", batch_size=8, image_size=112, budget=10 * 2**20)
    assert low["status"] == "infeasible" and low["min_feasible_bytes"] > 10 * 2**20


def test_strategy_base_on_the_command_line_reaches_the_options():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["+net=vgg19", "+strategy=swap", "strategy.base=approx_dp"])
    options = OmegaConf.to_container(cfg.strategy.options, resolve=True)
    assert options["base"] == "approx_dp"
    plan = strategies.solve("swap", chain(), **options)
    assert plan.info["base"] == "approx_dp"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_side_streams_and_pinned_pool_on_cuda():
    torch.manual_seed(0)
    model = Mlp().cuda()
    x = torch.randn(4096, 512, device="cuda")
    traced = trace(model, x)
    loss = model(x).sum()
    loss.backward()
    reference = [p.grad.clone() for p in model.parameters()]
    plan = strategies.solve("swap", traced.graph, min_bytes=0)
    for p in model.parameters():
        p.grad = None
    swapped_loss = execute(traced, plan, x)
    torch.testing.assert_close(swapped_loss, loss.detach())  # a missing stream wait would read garbage
    for p, q in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, q)
    vanilla = strategies.solve("vanilla", traced.graph)
    peaks = [measure(lambda: execute(traced, p, x), model, (x,), "cuda", 1, 3).peak_bytes for p in (vanilla, plan)]
    assert peaks[1] < peaks[0]
