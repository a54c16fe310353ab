"""``megatron_selective``: Megatron-LM's selective activation recomputation (Korthikanti et al. 2022), a peer
to judge the other strategies against. Only each attention layer's core is recomputed: the product of
queries and keys, the softmax, its dropout and the product with the values, which hold ``5·a·s²·b`` bytes
of a transformer layer's ``34·s·b·h + 5·a·s²·b`` in 16-bit precision (``s`` sequence, ``b`` batch, ``h``
hidden, ``a`` heads); everything else is saved as in the plain step.

The harness runs it as Megatron-LM does (``harness/execute/peers.py``): every call of
``F.scaled_dot_product_attention`` in the model runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which keeps its inputs (the queries, keys and
values) and its output, and drops what the core saves. The plan here is its counterpart in the IR: every
node kept, and each attention node a checkpointed stage of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.graph import Graph
from strategies.plan import Inapplicable, Plan, Runner
from strategies.simulate import check_budget

BUDGET_LIVENESS = True
RUNNER = Runner.TORCH_CHECKPOINT_ATTENTION  # harness/execute/peers.py runs plans that carry it


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``megatron_selective`` (none: the attention cores are found in the graph)."""


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    cores = [v for v in range(len(graph)) if graph.kinds[v] == "attention"]
    modules = [v for v in range(len(graph)) if graph.kinds[v] == "multihead_attention"]
    if modules:
        raise Inapplicable(f"megatron_selective: the net computes attention inside nn.MultiheadAttention "
                           f"({graph.scopes[modules[0]]}), one layer of the trace, so its core cannot be "
                           "recomputed apart from its projections")
    if not cores:
        raise Inapplicable("megatron_selective: the net has no attention core (F.scaled_dot_product_attention) "
                           "to recompute")
    stages = [1 << v for v in range(len(graph))]
    checkpointed = sum(1 << v for v in cores)  # one node a stage: stage v holds node v
    plan = Plan.from_stages(graph, stages, strategy="megatron_selective", kept=graph.all_nodes,
                            budget_bytes=budget_bytes, info={"attention_cores": len(cores)},
                            checkpointed=checkpointed, runner=RUNNER)
    check_budget(graph, plan, budget_bytes)
    return plan
