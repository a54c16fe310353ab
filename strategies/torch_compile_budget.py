"""``torch_compile_budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` (a
peer to judge the other strategies against). The min-cut partitioner of AOTAutograd, under a budget of
``budget_ratio`` times the activations it would save unconstrained, chooses what the compiled forward
saves and what the compiled backward recomputes (its default solver, FLOP cost model).

The harness runs the real thing (``harness/execute/peers.py``); the choice is made inside ``torch.compile``, out of
the IR's sight, so this plan holds no prediction (``predicted=False``): the row leaves the
predicted fields empty. Its stages are V with everything kept, which no one reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Plan, Runner

BUDGET_LIVENESS = True
RUNNER = Runner.TORCH_COMPILE  # harness/execute/peers.py runs plans that carry it


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``torch_compile_budget``."""

    budget_ratio: float = 0.5  # activation_memory_budget: 1.0 saves what the partitioner saves by default


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if not 0.0 <= options.budget_ratio <= 1.0:
        raise ValueError(f"torch_compile_budget: budget_ratio must lie in [0, 1], got {options.budget_ratio}")
    if budget_bytes is not None:
        raise ValueError("torch_compile_budget takes budget_ratio, a fraction of the activations, not a byte "
                         "budget; leave budget=null")
    return Plan.from_stages(graph, [graph.all_nodes], strategy="torch_compile_budget", kept=graph.all_nodes,
                            info={"budget_ratio": options.budget_ratio}, runner=RUNNER, predicted=False,
                            budget_ratio=options.budget_ratio)
