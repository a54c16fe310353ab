"""``brute_force``: every plan the executor runs, each replayed: the least recomputation within the budget
(``mode=tc``), or the least memory and then the least recomputation at it (``mode=mc``; with no budget, both modes).

A reference the solvers are checked against on small graphs. The plans are every chain of lower sets, each with
every kept set that holds what a later stage reads; they grow exponentially with the nodes, so a graph of more than
``MAX_NODES`` is refused, naming ``optimal``, which searches the same plans with a proof.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.lower_sets import all_lower_sets
from strategies.plan import InfeasibleBudget, Plan
from strategies.simulate import simulate

BUDGET_LIVENESS = True
MAX_NODES = 8
MODES = ("tc", "mc")


@dataclass(frozen=True, slots=True)
class Options:
    mode: str = "tc"  # tc: the least recomputation within the budget; mc: the least memory, then the least recomputation

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"brute_force: unknown mode {self.mode!r}; valid modes: tc (the least recomputation "
                             "within the budget), mc (the least memory)")


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if len(graph) > MAX_NODES:
        raise ValueError(f"brute_force: a graph of {len(graph)} nodes is too large to replay every plan of (at most "
                         f"{MAX_NODES} nodes); optimal searches the same plans with a proof (strategy optimal, "
                         "mode tc or mc)")
    replayed = [(simulate(graph, plan), plan) for plan in every_plan(graph)]
    least = min(prediction.peak_bytes for prediction, _ in replayed)
    if budget_bytes is not None and budget_bytes < least:
        raise InfeasibleBudget(budget_bytes, least, "brute_force")
    if options.mode == "mc" or budget_bytes is None:
        rank = lambda prediction: (prediction.peak_bytes, prediction.overhead_cost)  # noqa: E731
    else:
        rank = lambda prediction: (prediction.peak_bytes > budget_bytes, prediction.overhead_cost,  # noqa: E731
                                   prediction.peak_bytes)
    _, plan = min(replayed, key=lambda pair: rank(pair[0]))
    return Plan(strategy="brute_force", stages=plan.stages, kept=plan.kept, budget_bytes=budget_bytes,
                info={"plans": len(replayed)})


def every_plan(graph: Graph) -> Iterator[Plan]:
    """Every plan the executor runs: each chain of lower sets, with each kept set that keeps what a later stage
    reads."""
    family = all_lower_sets(graph)

    def chains(lower: int, stages: list[int]):
        if lower == graph.all_nodes:
            yield stages
        for bigger in family:
            if bigger != lower and bigger & lower == lower:
                yield from chains(bigger, stages + [bigger & ~lower])

    for stages in chains(0, []):
        stage_of = Plan.from_stages(graph, stages, kept=graph.all_nodes).stage_of(len(graph))
        must = {u for u, v in graph.edges if stage_of[u] != stage_of[v]}
        free = [v for v in range(len(graph)) if v not in must]
        for r in range(len(free) + 1):
            for extra in itertools.combinations(free, r):
                yield Plan.from_stages(graph, stages, kept=sum(1 << v for v in must | set(extra)))
