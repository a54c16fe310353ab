"""Kusumoto et al. 2019's equation (2): the peak a DP plans by, on the sizes of its memory model.

NOTE [what equation (2) counts]
Kusumoto et al. 2019 sizes a node by its value alone. A traced layer holds more: what its backward saves besides node
values (``saved_extra_bytes``: an attention's weights and dropout mask, pooling indices, the input an
in-place op saves), from its forward (or recomputation) to its backward, exactly as long as the value a
recomputation would rebuild; and the loss holds its own buffers (a language model's log-softmax over the
vocabulary, ``loss_bytes``) while the last stage's values are live. The DPs' ``memory_model=traced``
(default) runs equation (2) on ``dp_view(graph, "traced")``: each node sized by its value plus what its
layer saves, and the loss's buffers in the last stage's peak; ``memory_model=paper`` is Kusumoto et al.'s, values
alone (Table 2 and the paper's own graphs, which record neither, are the same under both). Counted this
way, the DP sees that recomputing an attention layer's stage brings back its weights, and that what it
keeps until the loss runs is held beside the loss's buffers (on ViT-B/16 and GPT-2 its plans were worse
than one checkpoint per block without it).
"""

from __future__ import annotations

from strategies.graph import Graph
from strategies.plan import Plan


def equation_2_peak(graph: Graph, plan: Plan) -> int:
    """Equation (2) on ``graph``'s node sizes; the last stage, which holds the output while the loss runs,
    also holds ``graph.profile.loss_bytes`` (zero in Kusumoto et al.'s model: ``dp_view``)."""
    peak, cached_before = 0, 0  # term (i): the kept values of the stages before; swapped ones are on the host
    last = len(plan.stages) - 1
    for i, (stage, (lower, later)) in enumerate(zip(plan.stages, graph.frontiers(plan.stages))):  # later: δ⁺(L_i) \ L_i
        others = graph.in_neighbours(later) & ~lower  # δ⁻(δ⁺(L_i) \ L_i) \ L_i
        loss = graph.profile.loss_bytes if i == last else 0
        peak = max(peak, cached_before + 2 * graph.mem(stage) + graph.mem(later) + graph.mem(others) + loss)
        cached_before += graph.mem(plan.kept & ~plan.swapped & stage)
    return peak


MEMORY_MODELS = ("traced", "paper")


def dp_peak(graph: Graph, plan: Plan) -> int:
    """The peak a DP's plan was judged by: equation (2) on its ``memory_model``'s sizes, parameter
    gradients added as ``simulate`` adds them."""
    return equation_2_peak(dp_view(graph, plan.info["memory_model"]), plan) + sum(graph.profile.param_bytes)


def dp_view(graph: Graph, memory_model: str) -> Graph:
    """The graph whose node sizes equation (2) counts (NOTE [what equation (2) counts]): ``paper``,
    Kusumoto et al.'s, each node's value alone and no loss; ``traced``, each node's value with what its layer saves
    besides node values, and the loss's working set in the last stage."""
    if memory_model == "paper":
        return graph.replace(loss_bytes=0) if graph.profile.loss_bytes else graph
    if memory_model == "traced":
        if not any(graph.profile.saved_extra_bytes):
            return graph
        return graph.replace(mem_bytes=[m + e for m, e in zip(graph.mem_bytes, graph.profile.saved_extra_bytes)])
    raise ValueError(f"unknown memory_model {memory_model!r}; valid: {', '.join(MEMORY_MODELS)}")
