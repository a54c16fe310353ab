"""``liveness_only``: no recomputation; every value and gradient freed right after its last use.

MXNet's memory optimisation notes (Chen et al. 2016) and Caffe's memory-sharing notes: plan memory by simulating reference counts over the
training step. The plan keeps every forward value, like ``vanilla``, and its figures come in ``info``:
- ``naive_bytes``: keep everything, every forward value and every gradient (Kusumoto et al.'s model without
  liveness, equation (2) for one stage);
- ``liveness_peak_bytes``: the peak when each buffer is freed after its last use (``simulate``);
- ``static_plan_bytes``: the size of a static memory plan over the same schedule, by MXNet's ``PlanMemory``
  pass: buffers go into slots; a freed slot is reused by a
  later buffer of size within a factor ``match_range`` (best fit from above, else the largest smaller slot,
  grown); an elementwise computation writes in place into an input that dies there. The plan's size is
  the sum of its slots, which can exceed the liveness peak (a slot keeps its largest size).

In PyTorch eager autograd is already reference counted, so the executor runs this plan exactly like
``vanilla``; what differs is the static plan it reports. O(S log S) for a schedule of S buffers.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Plan
from strategies.replay import Step, peak_of, timeline

# Computations that may write their output over an input that dies there (MXNet's FInplaceOption).
from strategies.simulate import check_budget, simulate
INPLACE_KINDS = frozenset({"act", "add", "mul", "dropout"})


# Budgets are judged by simulate(..., liveness=True): as vanilla.
BUDGET_LIVENESS = True


@dataclass(frozen=True, slots=True)
class Options:
    match_range: int = 16  # MXNet's default; 1 allows only exact-size reuse
    inplace: bool = True


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if options.match_range < 1:
        raise ValueError(f"liveness_only: match_range must be at least 1, got {options.match_range}")
    plan = Plan.from_stages(graph, [graph.all_nodes], strategy="liveness_only", kept=graph.all_nodes,
                            budget_bytes=budget_bytes)
    steps = timeline(graph, plan)
    info = {
        "naive_bytes": simulate(graph, plan, liveness=False).peak_bytes,
        "liveness_peak_bytes": peak_of(steps),
        "static_plan_bytes": static_plan_bytes(graph, steps, options.match_range, options.inplace),
    }
    plan = dataclasses.replace(plan, info=info)
    check_budget(graph, plan, budget_bytes)
    return plan


def static_plan_bytes(graph: Graph, steps: list[Step], match_range: int = 16, inplace: bool = True) -> int:
    """The total size of MXNet-style slots that hold every buffer of ``steps`` (see the module note)."""
    slot_size: list[int] = []
    free: list[tuple[int, int]] = []  # (size, slot), sorted
    slot_of: dict[tuple[str, int], int] = {}

    def release(key):
        slot = slot_of.pop(key)
        bisect.insort(free, (slot_size[slot], slot))

    for step in steps:
        in_place = inplace and step.node >= 0 and graph.kinds[step.node] in INPLACE_KINDS
        made = {key for key, _ in step.allocs}
        credits = {key for key, size in step.allocs if size < 0}  # what a layer's backward freed early: no buffer
        early = [key for key in step.frees if key not in made] if in_place else []  # a buffer made here goes after
        for key in early:
            release(key)
        for key, size in step.allocs:
            if key not in credits:
                slot_of[key] = _request(size, free, slot_size, match_range)
        for key in step.frees:
            if key not in early and key not in credits:
                release(key)
    return sum(slot_size)


def _request(size: int, free: list[tuple[int, int]], slot_size: list[int], match_range: int) -> int:
    i = bisect.bisect_left(free, (size, -1))
    if i < len(free) and free[i][0] <= size * match_range:  # the smallest free slot at least as big
        return free.pop(i)[1]
    if i > 0 and free[i - 1][0] * match_range >= size:  # else the largest smaller one, grown
        slot = free.pop(i - 1)[1]
        slot_size[slot] = size
        return slot
    slot_size.append(size)
    return len(slot_size) - 1
