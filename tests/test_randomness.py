"""Randomness under every recomputing strategy: each plan here recomputes dropout, its last recomputation of the
step draws, and after the step the program's generators are where plain PyTorch's are, on the step that learns
which calls draw and on the steps that rely on it (NOTE [what a call needs, found once] in harness/execute/step.py)."""

import copy

import pytest
import torch
from torch import nn

import strategies
from harness.execute import execute, recorded_recomputations
from harness.execute.exact import compare
from harness.tracing.trace import trace
from strategies import members

# Every strategy of this project's own that recomputes, each with a budget that makes it recompute.
RECOMPUTING = [("chen_sqrt", {}, None), ("chen_greedy", {}, "half"), ("approx_dp", {"mode": "tc"}, "half"),
               ("approx_dp", {"mode": "mc"}, "half"), ("exact_dp", {"mode": "tc"}, "half"),
               ("exact_dp", {"mode": "mc"}, "half")]


class DropoutChain(nn.Module):
    """Dropout on the input, then residual blocks with a dropout inside each branch (never a split point: Chen's
    greedy recomputes it whatever its segments). The first stage's recomputation is the last of the step (autograd
    runs the stages backwards); at the budgets here every plan's first stage recomputes the input's dropout (the
    least-memory plans keep the value after it, and their last recomputation draws nothing)."""

    def __init__(self, blocks=8, width=32):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Dropout(0.3),
                                                    nn.Linear(2 * width, width)) for _ in range(blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.drop(x).tanh()
        for branch in self.branches:
            x = x + branch(x)
        return self.head(x)


def loss_fn(out):
    return out.square().sum()


def plan_for(traced, strategy, options, budget):
    graph = traced.graph
    if budget == "half":  # halfway between equation (2)'s least plan's and vanilla's: the plan must recompute
        least = strategies.simulate(graph, strategies.solve("approx_dp", graph, mode="tc")).peak_bytes
        most = strategies.simulate(graph, strategies.solve("vanilla", graph)).peak_bytes
        budget = (least + most) // 2
    return strategies.solve(strategy, graph, budget, **options)


@pytest.mark.parametrize("strategy, options, budget", RECOMPUTING, ids=lambda v: str(v))
def test_the_generators_go_on_as_plain_pytorchs_after_a_step_whose_last_recomputation_draws(strategy, options,
                                                                                         budget):
    torch.manual_seed(0)
    model, x = DropoutChain().train(), torch.randn(16, 32)
    # FLOPs as the cost: a dropout costs none to recompute, so the time-centric plans recompute it too
    traced = trace(model, x, "flops", loss_fn=loss_fn)
    plan = plan_for(traced, strategy, options, budget)
    random_groups = {traced.group_of[name] for name in traced.random_nodes}
    recomputed_random = random_groups & set(members(plan.recomputed))
    assert recomputed_random, f"{strategy} recomputes no dropout here"
    reference = copy.deepcopy(model)
    for step in range(3):  # the first step learns which calls draw; the later ones rely on what it learned
        torch.manual_seed(step)
        loss_fn(reference(x)).backward()
        after_plain = torch.rand(8)
        torch.manual_seed(step)
        with recorded_recomputations() as stages:
            execute(traced, plan, x, loss_fn=loss_fn)
        assert set(stages[-1]) & traced.random_nodes, "the step's last recomputation draws nothing"
        assert torch.equal(torch.rand(8), after_plain), f"step {step}: the next draw differs from plain PyTorch's"
    difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
    assert difference.exact, difference


def test_a_call_that_starts_drawing_after_the_first_step_is_refused_not_replayed_wrong():
    """What the executor learns on a plan's first step (which calls draw) holds while the program and its
    modules' training flags stay as they were; a call that draws only later (a dropout whose probability was
    0, then is not) is caught where its recomputation draws, not silently replayed from the wrong state."""
    torch.manual_seed(0)
    model, x = DropoutChain().train(), torch.randn(16, 32)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # ATen's dropout draws nothing at p = 0
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", traced.graph)
    execute(traced, plan, x, loss_fn=loss_fn)
    for module in traced.module.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.3
    with pytest.raises(RuntimeError, match="drew random numbers that the same calls did not draw"):
        execute(traced, plan, x, loss_fn=loss_fn)


def test_switching_to_eval_and_back_learns_the_draws_again():
    torch.manual_seed(0)
    model, x = DropoutChain().train(), torch.randn(16, 32)
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", traced.graph)
    traced.module.eval()
    execute(traced, plan, x, loss_fn=loss_fn)  # learns: nothing draws
    traced.module.train()
    difference = compare(traced.module, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
    assert difference.exact, difference
