"""``torch_checkpoint_sequential``: PyTorch's ``torch.utils.checkpoint.checkpoint_sequential(functions,
segments, input, use_reentrant=False)`` over the net seen as a chain of modules (a peer to judge the other
strategies against).

The harness runs the real thing (``harness/execute/peers.py``) over the zoo's ``sequence`` of the net, split as
PyTorch splits it: ``len // segments`` steps a segment, every segment but the last under ``checkpoint``, the
last taking the remainder and keeping its values. The plan here is its counterpart in the IR: one stage per
segment (a node goes with the step its ``Graph.scopes`` lies in; a functional step's node, which has no
module, with the latest of its inputs), the canonical cache, plus every value of the last segment; every
segment but the last ``checkpointed``, so that the replay runs them as ``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Inapplicable, Plan, Runner, canonical_cache
from strategies.simulate import check_budget

BUDGET_LIVENESS = True
RUNNER = Runner.TORCH_CHECKPOINT_SEQUENTIAL  # harness/execute/peers.py runs plans that carry it


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``torch_checkpoint_sequential``."""

    sequence: tuple[str, ...] = ()  # module paths (and the zoo's functional steps) in the order they run
    segments: int | None = None  # None: round(sqrt(len(sequence))), as the PyTorch docs suggest


def segment_starts(steps: int, segments: int) -> list[int]:
    """Where ``checkpoint_sequential`` starts each segment; the last one runs to the end."""
    size = steps // segments
    return [k * size for k in range(segments)]


def step_of(scope: str, sequence: tuple[str, ...]) -> int | None:
    """The index of the step whose module holds the module at ``scope``, or None."""
    for index, path in enumerate(sequence):
        if scope == path or scope.startswith(path + "."):
            return index
    return None


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    steps = len(options.sequence)
    if not steps:
        raise Inapplicable("torch_checkpoint_sequential: the net has no sequential view (a chain of modules "
                           "computing its forward); a net with long skip connections, such as U-Net, has none")
    segments = round(math.sqrt(steps)) if options.segments is None else options.segments
    if not 1 <= segments <= steps:
        raise ValueError(f"torch_checkpoint_sequential: segments must be between 1 and the {steps} steps of "
                         f"the sequence, got {segments}")
    starts = segment_starts(steps, segments)
    step = [0] * len(graph)
    for v in range(len(graph)):  # node order is topological: a node's inputs have their steps already
        own = step_of(graph.scopes[v], options.sequence)
        step[v] = own if own is not None else max((step[u] for u in graph.preds[v]), default=0)
    segment = [sum(1 for s in starts[1:] if s <= step[v]) for v in range(len(graph))]
    stages = [0] * segments
    for v in range(len(graph)):
        stages[segment[v]] |= 1 << v
    stages = tuple(s for s in stages if s)
    kept = canonical_cache(graph, stages) | stages[-1]  # the last segment runs outside checkpoint
    plan = Plan.from_stages(graph, stages, strategy="torch_checkpoint_sequential", kept=kept,
                            budget_bytes=budget_bytes, info={"segments": segments}, runner=RUNNER, segments=segments,
                            checkpointed=(1 << (len(stages) - 1)) - 1)  # all but the last
    check_budget(graph, plan, budget_bytes)
    return plan
