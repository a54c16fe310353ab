"""``swap``: offload activations to host memory (Meng et al. 2017, Meng et al. 2017), alone or on a recomputation plan.

A value kept for the backward pass is copied to the host after its last forward use and copied back
before the first backward that reads it, instead of being recomputed. The plan starts from ``base`` (a
strategy's plan at its own default budget; none: ``vanilla``, everything kept) and decides:
- which values go, by Meng et al.'s rule: walking the forward pass from the loss backwards, the short-lived
  values near the loss stay on the device and the long-lived ones are swapped first. So the swapped set
  is the first ``m`` candidates in forward order, with ``m`` the least that meets the budget (bisected;
  ``budget=None`` swaps every candidate: the least memory swap reaches). Candidates are kept values that
  some backward reads, of at least ``min_bytes``; parameters are not values, and a checkpoint that a
  recomputation reads stays on the device, as does an output the loss's backward reads;
- when each comes back: as late as possible while its copy still hides behind computation. Copies come
  back one at a time at ``bandwidth_gbps``, in the order the backward pass needs them; a step's time is
  its FLOPs at ``compute_tflops`` (a backward twice its forward). The copy starts with the backward of
  the latest node that begins before the copy must. When those prefetches raise the peak above the budget,
  every copy starts just in time instead, at the backward that needs it (the copies then stall the step).
``info`` reports host bytes, bytes moved each way, the compute time and the step-time lower bound
max(compute, bytes out / bandwidth, bytes in / bandwidth) (``simulate.swap_step_time``).
O(log |V|) liveness replays.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

from strategies import solve as solve_strategy  # the registry imports strategy modules on first use, after itself
from strategies.graph import Graph, members
from strategies.plan import Inapplicable, InfeasibleBudget, Plan
from strategies.replay import timeline

# Budgets are judged by simulate(..., liveness=True): the executor frees and fetches value by value.
from strategies.simulate import simulate, step_seconds, swap_step_time
BUDGET_LIVENESS = True


@dataclass(frozen=True, slots=True)
class Options:
    base: str | None = None  # the recomputation strategy swap starts from (approx_dp, ...); None: vanilla
    base_options: dict = field(default_factory=dict)  # its options, e.g. {"mode": "mc"}
    bandwidth_gbps: float = 50.0  # host link, each way (PCIe 5.0 x16 reaches about 50 GB/s)
    compute_tflops: float = 100.0  # the device's achieved throughput, for the copies' timing
    min_bytes: int = 1 << 20  # smaller values stay: per-copy overhead beats the bandwidth


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if not options.bandwidth_gbps > 0:
        raise ValueError(f"swap: bandwidth_gbps must be positive (GB/s each way), got {options.bandwidth_gbps}")
    if not options.compute_tflops > 0:
        raise ValueError(f"swap: compute_tflops must be positive, got {options.compute_tflops}")
    base = _base_plan(graph, options)
    candidates = _candidates(graph, base, options.min_bytes)
    bandwidth, flops_per_s = options.bandwidth_gbps * 1e9, options.compute_tflops * 1e12

    def plan_with(count: int) -> tuple[Plan, int]:
        """The base plan with the first ``count`` candidates swapped, and its peak: prefetched hidden where
        that meets the budget (no budget: where that reaches the least peak), else just in time."""
        swapped = candidates[:count]
        steps = _backward_steps(graph, base, swapped)
        need = _first_reader(graph, steps)
        on_time = _with_swaps(base, swapped, {u: steps[need[u]].node for u in swapped}, "just_in_time")
        hidden = _with_swaps(base, swapped, _hidden_triggers(graph, steps, need, swapped, bandwidth, flops_per_s),
                             "hidden")
        on_time_peak, hidden_peak = simulate(graph, on_time).peak_bytes, simulate(graph, hidden).peak_bytes
        target = on_time_peak if budget_bytes is None else budget_bytes
        return (hidden, hidden_peak) if hidden_peak <= target else (on_time, on_time_peak)

    plan, peak = plan_with(len(candidates))
    if budget_bytes is not None:
        if peak > budget_bytes:
            raise InfeasibleBudget(budget_bytes, peak, "swap")
        low, high = -1, len(candidates)  # plan fits with high; the peak falls as more go, so bisect for the least
        while high - low > 1:
            middle = (low + high) // 2
            candidate, peak = plan_with(middle)
            if peak <= budget_bytes:
                plan, high = candidate, middle
            else:
                low = middle
    host_bytes = graph.mem(plan.swapped)
    info = {**{k: v for k, v in base.info.items() if isinstance(v, (int, float, str))},
            "base": options.base or "vanilla", "candidates": len(candidates),
            "swapped_count": bin(plan.swapped).count("1"), "host_bytes": host_bytes, "swap_out_bytes": host_bytes,
            "swap_in_bytes": host_bytes, **swap_step_time(graph, plan, bandwidth, flops_per_s),
            "prefetch": plan.info["prefetch"]}
    return dataclasses.replace(plan, strategy="swap", budget_bytes=budget_bytes, info=info)


def _base_plan(graph: Graph, options: Options) -> Plan:
    if options.base is None:
        return Plan.from_stages(graph, [graph.all_nodes], strategy="vanilla", kept=graph.all_nodes)
    if options.base == "swap":
        raise ValueError("swap: base must be a recomputation strategy (approx_dp, exact_dp, chen_sqrt, ...), "
                         "not swap itself")
    base = solve_strategy(options.base, graph, None, **options.base_options)
    if base.schedule is not None or base.runner is not None:
        raise Inapplicable(f"swap: base {options.base!r} is not a stage plan the executor runs; choose a "
                           "recomputation strategy such as approx_dp, exact_dp, chen_sqrt or chen_greedy")
    return base


def _candidates(graph: Graph, base: Plan, min_bytes: int) -> list[int]:
    """Kept values a backward reads, big enough, read by no recomputation; in forward (execution) order.
    An output the loss's backward reads stays: that backward comes first, just after the forward."""
    read_by_backward = graph.read_by_backward() - set(graph.profile.loss_reads)
    stage_of = base.stage_of(len(graph))
    return sorted((u for u in members(base.kept) if u in read_by_backward and graph.mem_bytes[u] >= min_bytes
                   and not graph.succ_mask[u] & base.recomputed),
                  key=lambda u: (stage_of[u], u))


def _with_swaps(base: Plan, swapped: list[int], triggers: dict[int, int], prefetch: str) -> Plan:
    return dataclasses.replace(base, swapped=sum(1 << u for u in swapped),
                               prefetch=tuple((u, triggers[u]) for u in swapped), info={"prefetch": prefetch})


def _backward_steps(graph: Graph, base: Plan, swapped: list[int]) -> list:
    """The backward pass's steps (after the forward ones) of the base plan with ``swapped`` on the host."""
    plan = _with_swaps(base, swapped, dict.fromkeys(swapped, -1), "")
    steps = timeline(graph, plan)
    first = next(i for i, step in enumerate(steps) if step.phase != "forward")
    return steps[first:]


def _first_reader(graph: Graph, steps: list) -> dict[int, int]:
    """Each value's first backward step (index into ``steps``) that reads it."""
    first = {}
    for i, step in enumerate(steps):
        if step.phase == "backward" and step.node >= 0:
            for u in graph.profile.backward_reads[step.node]:
                first.setdefault(u, i)
    return first


def _hidden_triggers(graph: Graph, steps: list, need: dict[int, int], swapped: list[int], bandwidth: float,
                     flops_per_s: float) -> dict[int, int]:
    """Each swapped value's prefetch trigger: the backward node whose start the copy back must follow so
    that it ends, at the latest, when the first step that reads the value (``need``, into the backward
    ``steps``) starts (-1: the backward pass's start). The copies share one link, in the order they are
    needed, scheduled back to front."""
    starts, now = [], 0.0
    for step in steps:
        starts.append(now)
        now += step_seconds(graph, step, flops_per_s)
    triggers, link_free_from = {}, float("inf")
    for u in sorted(swapped, key=lambda u: need[u], reverse=True):
        end = min(starts[need[u]], link_free_from)
        begin = end - graph.mem_bytes[u] / bandwidth
        link_free_from = begin
        at = max(bisect.bisect_right(starts, begin, 0, need[u] + 1) - 1, 0)  # the last step starting by then
        while steps[at].phase != "backward":  # a recomputation has no grad_fn to hook
            at -= 1
        triggers[u] = steps[at].node  # the first step is the backward pass's start, node -1
    return triggers
