"""What a step under a plan needs that depends only on the trace and the plan, made once (NOTE [what a call
needs, found once] in ``harness/execute/step.py``): the forward's order, each recomputation's schedule."""

from __future__ import annotations

from types import SimpleNamespace

import torch.fx as fx

from harness.tracing.traced import Traced
from strategies import Plan, members
from strategies.replay import called_for


def _layout(traced: Traced, plan: Plan) -> SimpleNamespace:
    """What a step under ``plan`` needs that depends only on the trace and the plan (NOTE [what a call needs,
    found once]): the order of the forward's calls, each stage's recomputed calls, the kept values a
    recomputation reads and for which stages, and each recomputation's schedule once it has run
    (``recomputations``). Made at the plan's first step and kept with the trace."""
    key = (plan.stages, plan.kept, plan.swapped, plan.prefetch, plan.checkpointed)
    if key in traced.layouts:
        return traced.layouts[key]
    plan.validate(traced.graph)
    graph = traced.graph
    discarded = set(members(plan.recomputed))
    stage_of = plan.stage_of(len(graph))
    order = _stage_order(traced, plan, stage_of)  # the forward's, and each recomputation's within its stage
    stage_nodes: dict[int, list[fx.Node]] = {}  # stage -> its discarded values' fx nodes, in that order
    for node in order:
        g = traced.group_of.get(node.name)
        if g in discarded:
            stage_nodes.setdefault(stage_of[g], []).append(node)
    # A kept value is held only for the stages that will be recomputed, as the replay holds it: a stage
    # whose values no backward reads (a pixel shuffle's) would keep its input through the forward pass.
    # An output's stage is held to the end of the forward pass, where the loss's saves tell (the loss
    # may not be the one traced; the replay's ``to_loss``).
    held_for = called_for(graph, plan) | {stage_of[v] for v in graph.outputs}
    cached_names: dict[int, set[str]] = {}  # kept group -> its fx nodes that recomputation reads
    cache_stages: dict[int, set[int]] = {}  # kept group -> stages that read it
    nodes = {n.name: n for n in traced.module.graph.nodes}
    for name in (n for g in discarded for n in traced.members[g]):
        if stage_of[traced.group_of[name]] not in held_for:
            continue
        for source in nodes[name].all_input_nodes:
            g = traced.group_of.get(source.name)
            if g is not None and g not in discarded:
                cached_names.setdefault(g, set()).add(source.name)
                cache_stages.setdefault(g, set()).add(stage_of[traced.group_of[name]])
    stage_reads: dict[int, list[int]] = {}  # stage -> the kept groups its recomputation reads
    for g, stages in cache_stages.items():
        for stage in stages:
            stage_reads.setdefault(stage, []).append(g)
    remade = discarded - set(members(graph.never_recomputed()))  # its RNG and state are kept for it
    # The calls whose saves the hooks must see (NOTE [executing a plan]): those of a value the plan recomputes
    # or swaps, or that no gradient reaches, and those that read a value it recomputes or swaps.
    watched = discarded | set(members(plan.swapped))
    own_watched = watched | set(graph.profile.unreached)
    hooked = [traced.group_of.get(node.name) in own_watched
              or any(traced.group_of.get(source.name) in watched for source in node.all_input_nodes)
              for node in order]
    layout = SimpleNamespace(
        discarded=discarded, stage_of=stage_of, order=order, stage_nodes=stage_nodes, held_for=held_for,
        cached_names=cached_names, cache_stages=cache_stages, stage_reads=stage_reads, forward_frees=_frees(order),
        arguments=[(node.args, node.kwargs) for node in order],
        stage_discarded={s: members(stage & ~plan.kept) for s, stage in enumerate(plan.stages)},
        hooked=hooked, unreached=set(graph.profile.unreached),
        recomputable={name for g in remade for name in traced.members[g]}, recomputations={})
    traced.layouts[key] = layout
    return layout


def _recomputation(traced: Traced, plan: Plan, stage_nodes: dict[int, list[fx.Node]], stage: int, wanted: int,
                   read: int) -> SimpleNamespace:
    """How stage ``stage`` is recomputed when the tokens still to be unpacked are of the groups ``wanted``, and
    of their values for the groups ``read`` (bitsets): the calls it reruns in order, with each one's IR node and
    the values to let go of once it has run (those tokens read stay to the stage's end), and the calls not
    rerun."""
    discarded = plan.stages[stage] & ~plan.kept
    made = traced.graph.with_inputs_within(wanted, discarded)
    groups = members(made)
    names = {name for g in groups for name in traced.members[g]}
    order = [n for n in stage_nodes[stage] if n.name in names]
    # The values tokens will read stay to the end of the stage; any other goes after its last use there,
    # as the simulator frees it (a value no backward reads: a downsampling branch read by an addition).
    finals = {traced.members[g][-1] for g in members(read)}
    return SimpleNamespace(order=order, names=frozenset(n.name for n in order), groups=groups,
                           arguments=[(n.args, n.kwargs) for n in order],
                           node_groups=[traced.group_of[n.name] for n in order],
                           frees=_frees(order, finals),
                           not_rerun=tuple(name for g in members(discarded & ~made) for name in traced.members[g]))


def _stage_order(traced: Traced, plan: Plan, stage_of: list[int]) -> list[fx.Node]:
    """The fx nodes stage by stage, in the order ``stage_keys`` gives them."""
    keys = stage_keys(traced, plan, stage_of)
    return sorted(keys, key=keys.get)


def stage_keys(traced: Traced, plan: Plan, stage_of: list[int]) -> dict[fx.Node, tuple]:
    """Each fx node's place, ``((stage, index), position)``, in the order the executor runs the forward:
    stage by stage (V_1 first), in program order within a stage: a topological order in
    which autograd's backward, which runs in reverse creation order, visits the stages one at a time
    from the last, as the canonical strategy does. A node never comes before its inputs; nodes outside
    the IR go with their latest input; a node that draws random numbers never before an earlier one
    that draws (it goes with the later stage), so every draw sees plain PyTorch's generator state, and
    one that can reach a buffer never before an earlier one that can reach it: a BatchNorm called on
    two views (a Siamese encoder's) updates its running statistics in the program's order.
    A layer call that an in-place write of its IR node follows runs just before that write
    (``_delayed``), so that an IR node's autograd nodes are made together, as the replay runs them."""
    nodes = list(traced.module.graph.nodes)
    delayed = _delayed(nodes, traced)
    read_before: dict[str, list[str]] = {}  # a write to a buffer -> the nodes that read it before
    for reader, writer in traced.state_order:
        read_before.setdefault(writer, []).append(reader)
    by_name = {node.name: node for node in nodes}
    key, position = {}, {}
    last_use: dict[str, tuple[int, int]] = {}  # Traced.shared_state's names -> the last key to use it
    for index, node in enumerate(nodes):
        position[node] = index
        g = traced.group_of.get(node.name)
        inputs = [key[n] for n in node.all_input_nodes]
        if node.op == "output":
            own = (len(plan.stages), index)
        elif g is not None:
            own = (stage_of[g], delayed.get(node.name, index))
        else:
            own = (max((stage for stage, _ in inputs), default=-1), index)
        # A view can read a shape computed in a later stage (U-Net's crops): then it waits for it; a
        # write to a buffer waits for the nodes that read it before (NOTE [state the forward writes]).
        key[node] = max([own] + inputs + [key[by_name[r]] for r in read_before.get(node.name, ())])
        shared = traced.shared_state.get(node.name, ())  # in program order: the same numbers and
        key[node] = max([key[node]] + [last_use[name] for name in shared if name in last_use])  # statistics
        last_use.update(dict.fromkeys(shared, key[node]))
    return {node: (key[node], position[node]) for node in nodes}


def _delayed(nodes: list[fx.Node], traced: Traced) -> dict[str, int]:
    """For each member of an IR node that an in-place write of the same IR node follows, the position of
    the first such write: the member runs just before it. torchvision's bottleneck computes ``bn3(conv3)``,
    then its downsampling branch, then ``out += identity``; run in that order, autograd would make the
    branch's nodes between the batch norm's and the addition's, and run the branch's backward in the middle
    of the IR node's (NOTE [augmented assignments] in ``harness/tracing/tracer.py``)."""
    delayed, next_write = {}, {}
    for index in reversed(range(len(nodes))):
        name = nodes[index].name
        g = traced.group_of.get(name)
        if g is not None:
            if name in traced.written_in_place:
                next_write[g] = index
            delayed[name] = next_write.get(g, index)
    return delayed


def _frees(order: list[fx.Node], keep=frozenset()) -> list[tuple[str, ...]]:
    """For each node of ``order``, the values to let go of once it has run: those it is the last of ``order`` to
    read, and its own where none reads it; ``keep`` aside."""
    last: dict[str, int] = {}
    for index, node in enumerate(order):
        last[node.name] = index
        for source in node.all_input_nodes:
            last[source.name] = index
    frees: list[list[str]] = [[] for _ in order]
    for name, index in last.items():
        if name not in keep:
            frees[index].append(name)
    return [tuple(names) for names in frees]
