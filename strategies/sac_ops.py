"""``sac_ops``: selective activation checkpointing by op, as torchtitan's "op" policy runs it (a peer to judge
the other strategies against). Each natural block of the net runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, context_fn=...)`` with a policy from
``create_selective_checkpoint_contexts``: the outputs of matrix multiplications and of fused attention
kernels are saved (``MUST_SAVE``), every other op is recomputed (``PREFER_RECOMPUTE``). With
``every_second_mm`` a block's second, fourth, ... matrix multiplication is recomputed too.

The harness runs the real thing (``harness/execute/peers.py``), with the zoo's blocks. The plan here is its
counterpart in the IR, for the prediction: the blocks' stages checkpointed, as for
``torch_checkpoint_blocks``, and within them the ``linear`` layers' outputs (a linear layer is one matrix
multiplication, ``mm`` or ``addmm``) saved by the policy (``Plan.selective``). An attention node of the IR
(``F.scaled_dot_product_attention``) is a fused kernel only where the device has one (CUDA's flash and
memory-efficient kernels); on the CPU with dropout and on meta PyTorch runs its math decomposition, whose
batched matmuls the policy does not save, so the plan recomputes it, as the runs it predicts do. A block
that computes attention inside ``nn.MultiheadAttention`` (torchvision's ViT), one node of the trace, has
matmuls the policy saves out of the IR's sight: such a plan holds no prediction (``predicted=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.graph import Graph, members
from strategies.plan import Inapplicable, Plan, Runner, canonical_cache
from strategies.simulate import check_budget
from strategies.torch_checkpoint_blocks import block_stages

BUDGET_LIVENESS = True
RUNNER = Runner.TORCH_CHECKPOINT  # harness/execute/peers.py runs plans that carry it, with the plan's policy


@dataclass(frozen=True, slots=True)
class Options:
    """Options of ``sac_ops``."""

    blocks: tuple[str, ...] = ()  # module paths, or "parent[a:b]" slices of an nn.Sequential's children
    every_second_mm: bool = False  # recompute each block's 2nd, 4th, ... matmul as well


def solve(graph: Graph, budget_bytes: int | None, *, options: Options | None = None) -> Plan:
    options = options or Options()
    if not options.blocks:
        raise Inapplicable("sac_ops: the net has no blocks to checkpoint (module paths); a direct caller gives "
                           "blocks=(...)")
    stages, checkpointed = block_stages(graph, options.blocks)
    selective = 0
    for i in members(checkpointed):
        matmuls = [v for v in members(stages[i]) if graph.kinds[v] == "linear"]
        for count, v in enumerate(matmuls, start=1):
            if not (options.every_second_mm and count % 2 == 0):
                selective |= 1 << v
    if not selective:
        raise Inapplicable("sac_ops: no block of the net holds a matrix multiplication (a linear layer) for the "
                           "policy to save")
    kept = canonical_cache(graph, tuple(stages)) | selective
    policy = "ops_every_second_mm" if options.every_second_mm else "ops"
    info = {"blocks": len(options.blocks), "policy": policy}
    opaque = [v for i in members(checkpointed) for v in members(stages[i]) if graph.kinds[v] == "multihead_attention"]
    if opaque:  # the policy saves matmuls inside one node of the IR: no prediction
        info["prediction"] = (f"none: the policy saves the matmuls inside nn.MultiheadAttention "
                              f"({graph.scopes[opaque[0]]}), one node of the trace")
    plan = Plan.from_stages(graph, stages, strategy="sac_ops", kept=kept, budget_bytes=budget_bytes, info=info,
                            checkpointed=checkpointed, runner=RUNNER, selective=selective, policy=policy,
                            predicted=not opaque)
    if plan.predicted:
        check_budget(graph, plan, budget_bytes)
    elif budget_bytes is not None:
        raise Inapplicable(f"sac_ops: no prediction to judge a budget by ({info['prediction']}); leave budget=null")
    return plan
