"""``torch_checkpoint_blocks``: PyTorch's own checkpointing, ``torch.utils.checkpoint.checkpoint(
use_reentrant=False)`` around each natural block of the net, the way a careful user writes it by hand (a
peer to judge the other strategies against).

The harness runs the real thing (``harness/execute/peers.py``) and fills ``blocks`` from the zoo's definition of
the net. The plan here is its counterpart in the IR, for the prediction: one stage per block (the nodes
whose ``Graph.scopes`` lie in it), every node outside a block a stage of its own; canonical cache; the
blocks' stages ``checkpointed``, so that the replay runs them as ``torch.utils.checkpoint`` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Plan, Runner
from strategies.simulate import check_budget

BUDGET_LIVENESS = True
RUNNER = Runner.TORCH_CHECKPOINT  # harness/execute/peers.py runs plans that carry it


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``torch_checkpoint_blocks``."""

    blocks: tuple[str, ...] = ()  # module paths, or "parent[a:b]" slices of an nn.Sequential's children


def block_of(scope: str, blocks: tuple[str, ...]) -> int | None:
    """The index of the block holding the module at ``scope``, or None."""
    for index, block in enumerate(blocks):
        sliced = re.fullmatch(r"(.*)\[(\d+):(\d+)\]", block)
        if sliced:
            parent, start, stop = sliced.group(1), int(sliced.group(2)), int(sliced.group(3))
            child = scope[len(parent) + 1:].split(".")[0] if scope.startswith(parent + ".") else ""
            if child.isdigit() and start <= int(child) < stop:
                return index
        elif scope == block or scope.startswith(block + "."):
            return index
    return None


def block_stages(graph: Graph, blocks: tuple[str, ...]) -> tuple[list[int], int]:
    """One stage per block (the nodes whose scopes lie in it, consecutive in node order), every node outside
    a block a stage of its own; and the bitset of the blocks' stage indices."""
    stages, previous, checkpointed = [], None, 0
    for v in range(len(graph)):
        block = block_of(graph.scopes[v], tuple(blocks))
        if block is not None and block == previous:
            stages[-1] |= 1 << v
        else:
            stages.append(1 << v)
            checkpointed |= (block is not None) << (len(stages) - 1)
        previous = block
    return stages, checkpointed


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if not options.blocks:
        raise ValueError("torch_checkpoint_blocks needs the net's blocks (module paths); the harness passes the "
                         "zoo's list, a direct caller gives blocks=(...)")
    stages, checkpointed = block_stages(graph, options.blocks)
    plan = Plan.from_stages(graph, stages, strategy="torch_checkpoint_blocks", budget_bytes=budget_bytes,
                            info={"blocks": len(options.blocks)}, checkpointed=checkpointed, runner=RUNNER)
    check_budget(graph, plan, budget_bytes)
    return plan
