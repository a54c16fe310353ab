"""``vanilla``: the plain training step, no recomputation.

One stage holding all of V, every forward value kept for the backward pass: what ``loss.backward()`` does.
The budget is only checked: the plan's predicted peak (``simulate`` with liveness, which is how PyTorch's
reference-counted autograd frees) is its minimal feasible budget. O(|V| + |E|).
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Plan
from strategies.simulate import check_budget


# Budgets are judged by simulate(..., liveness=True): it has no choice to make, and the real step frees by liveness.
BUDGET_LIVENESS = True


@dataclass(frozen=True, slots=True)
class Options:
    pass


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    plan = Plan.from_stages(graph, [graph.all_nodes], strategy="vanilla", kept=graph.all_nodes,
                            budget_bytes=budget_bytes)
    check_budget(graph, plan, budget_bytes)
    return plan
