"""Trace a module into the IR: torch.fx at layer granularity, sizes from a run on the meta device.

The jobs, one module each: ``harness.tracing.tracer`` records the program (fx; ``harness.tracing.attention``, the
attention kernel the device will run), ``harness.tracing.probe`` runs it on meta and groups its calls into IR nodes,
``harness.tracing.backward_profile`` measures the backward and the loss, ``harness.tracing.cost_models`` weighs each
layer, and ``harness.tracing.traced`` holds the record they make. The RNG and state helpers the executors share are in
``harness.tracing.state``.

NOTE [values held outside the program]
A plan decides when each value goes; that promise breaks if something outside the traced program holds
a value: a forward hook that appends a layer's output to a list (feature extraction for a perceptual
loss), a module attribute or a global it is stored in. Such a value lives to the step's end whatever the
plan, and a plan that recomputes it makes a second copy (a hooked activation measured 9% above its
plan's replay). The step on meta that ``backward_peaks`` runs shows them: an IR node's storage still
alive after its backward, its output and its loss gone (that step packs saved tensors detached and lets
go of the autograd nodes it noted, so what an unused branch saved goes as it does in plain PyTorch).
Likewise ``self.feat = x`` in a forward: fx records no attribute assignment, so the traced program would
never make it (fx leaves the attribute holding its Proxy; the trace puts the old value back). Both are
refused, naming the layer or the attribute; the way out is to return the value from the forward, where
a loss can read it like any output. A shape kept so (``self.H = x.shape[2]``) is no value, and traces.

NOTE [a write after a read]
Any other write in place (``relu_``, ``nn.ReLU(inplace=True)``, ``x[mask] = 0``, a ``clamp_`` under
``no_grad``, an in-place dropout) cannot stay in place once another IR node has read the value
(``y = h + 1; h.relu_()``): a recomputation of that reader, run after the write, would read the new value.
So the program writes a copy, the way a functional program would: the probe stops at the write
(``CopyFirst``), the trace puts ``clone`` of the value just before it, hands the write the copy, and
hands every later call that read the value the copy instead (``_copy_before_write``); then the probe runs
the new program. Every call reads the values it reads in the model, so loss and gradients are the model's
(the clone runs with autograd on, also where the write runs under ``no_grad``, whose gradient passes the
write by as the model's does). The copy and its write are one IR node, which the trace measures like any
other: the step holds the copy beside the value while the clone runs, where plain PyTorch writes the value
itself (where the earlier reader saved the value for its backward, plain PyTorch's step fails, "modified by
an inplace operation", and the traced program computes what the model's code says). A later call that
reads the value through a view taken before the write (``v = h[:, :2]`` ... ``h.relu_()`` ... ``v.sum()``)
sees the write in the model but would not see it in the copy, so such a write is refused, naming that call;
so is a write of several tensors, or of one that no call returned whole (a part of a tuple). Where the
clone is the value's last reader, the value goes before the write saves anything (a ``clamp_``'s copy of
its input, a dropout's mask): the probe notes an IR node whose calls save all its extras after their last
read of another node's value (``Profile.extras_after_reads``), and the replay makes those extras after the
values that go at the node have gone (``_call`` in ``strategies/replay_steps.py``; made beside the value, they
put two plans of 32 tried 7% and 9% above their measured peak; no zoo net has such a node).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from harness.tracing.attention import attention_as_on
from harness.tracing.backward_profile import backward_peaks, gradients, loss_fields
from harness.tracing.cost_models import CostModel, check_cost_model, measured_costs
from harness.tracing.probe import CopyFirst, Probe, nodes_after, non_leaf_attributes, storage_of
from harness.tracing.traced import TraceFailure, Traced, describe
from harness.tracing.tracer import AUGMENTED, symbolic_trace
from harness.zoo.nets import sum_loss


def _copy_before_write(gm: fx.GraphModule, copy_first: CopyFirst):
    """Make the write of ``copy_first`` write a copy (NOTE [a write after a read]): a ``clone`` of the value
    just before the write, which the write writes instead, and which every later call reads."""
    nodes = {node.name: node for node in gm.graph.nodes}
    write, holders = nodes[copy_first.write], [nodes[name] for name in copy_first.holders]
    with gm.graph.inserting_before(write):
        copied = gm.graph.call_method("clone", (next(h for h in holders if h in write.all_input_nodes),))
    for holder in holders:
        write.replace_input_with(holder, copied)
    written = write if copy_first.via_write else copied
    for later in nodes_after(write):
        for holder in holders:
            later.replace_input_with(holder, written)
    gm.recompile()


def trace(model: torch.nn.Module, example_input: torch.Tensor, cost_model: CostModel = "paper", loss_fn=None
          ) -> Traced:
    """Trace ``model`` on ``example_input`` into a ``Traced`` (see NOTE [nodes are storages] in
    ``harness/tracing/probe.py``); the graph's ``loss_bytes`` and ``loss_held_bytes`` are what ``loss_fn`` (default:
    the executor's, the sum of the outputs) holds beside the outputs and their gradients, measured on meta."""
    check_cost_model(cost_model, example_input.device.type)
    gm = symbolic_trace(model, example_input)
    # On meta, a tensor the program makes without naming a device (``torch.randn(8)``) is made on meta too.
    with torch.device("meta"), attention_as_on(example_input.device, gm):
        while True:
            meta_module = gm if on_meta(gm) else meta_copy(gm)
            probe = Probe(meta_module, cost_model)
            try:
                with torch.enable_grad():
                    output = probe.run(example_input.to("meta").requires_grad_(False))
                break
            except CopyFirst as copy_first:  # NOTE [a write after a read]; then probe the new program
                _copy_before_write(gm, copy_first)
        kept = next(((node, where) for node, where in gm.meta.get("kept_as_attributes", {}).items()
                     if node in probe.group_of), None)
        if kept:  # NOTE [values held outside the program]
            raise TraceFailure(
                f"module {kept[1][0]!r} keeps a value its forward or a hook computes ({kept[0]}) in attribute "
                f"{kept[1][1]!r}: torch.fx records no such assignment, so the traced program would never make it; "
                "return the value from the forward instead (a loss can read several outputs)")
        if opaque := _opaque_output(output):
            raise TraceFailure(
                f"{type(model).__name__} returns a {opaque}, whose tensors torch's pytree cannot see, so neither "
                "the plans nor the loss's accounting would find its outputs; return a tuple, dict or namedtuple, "
                f"or register the type (torch.utils._pytree.register_dataclass({opaque}))")
        # What layers saved that a module keeps as an attribute (NOTE [tensors a module keeps] in
        # ``harness/tracing/probe.py``).
        probe.kept_by_modules = {id(storage_of(t)) for t in non_leaf_attributes(meta_module)}
        if probe.out_of_place:  # where the probe ran a copy, the same out-of-place turns here
            for node in gm.graph.nodes:
                if node.name in probe.out_of_place:
                    node.target = AUGMENTED.get(node.target, node.target)
            gm.recompile()
        loss_fn = loss_fn or sum_loss  # the executor's default
        shares, work, early, ran, handed = gradients(probe, output, loss_fn)
        peaks, frees, transients, unpacks, held, grad_bytes = backward_peaks(
            meta_module, probe.group_of, probe.view_names, example_input, loss_fn)
        probe.trainable.update((key, b) for key, b in grad_bytes.items() if key in probe.trainable)
        if held:  # NOTE [values held outside the program]
            layer = describe(probe.groups[min(held)]["members"][0], meta_module)
            raise TraceFailure(
                f"the value of {layer} is still held after a training step by something outside the traced "
                "program (a forward hook that keeps a layer's output, a list, a module attribute or a global "
                "it is stored in): no plan could free or recompute it, and every budget would be broken. Return "
                "the value from the forward instead (a loss can read several outputs)")
        traced = probe.result(gm, shares, work, peaks, early, frees, transients, unpacks, ran, handed)

        def node_of(t: torch.Tensor) -> int | None:
            g = probe._group(storage_of(t))
            return None if g is None else traced.group_of[probe.groups[g]["final"].name]

        loss = loss_fields(output, loss_fn, node_of, len(traced.graph))
    traced = dataclasses.replace(traced, graph=traced.graph.replace(**loss))
    if cost_model == "measured":  # on the example's device, outside the trace's default device (meta)
        traced = dataclasses.replace(traced, graph=traced.graph.replace(cost=measured_costs(traced, example_input)))
    return traced


def meta_copy(module: fx.GraphModule) -> fx.GraphModule:
    """A copy on the meta device, made without copying any weight."""
    memo = {id(t): t.detach().to("meta") for t in non_leaf_attributes(module)}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def on_meta(module: torch.nn.Module) -> bool:
    return all(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))


def _opaque_output(output) -> str:
    """The type name of the first object among the model's outputs that holds tensors pytree does not
    flatten (a dataclass not registered with it), or ''."""
    for leaf in tree_leaves(output):
        fields = vars(leaf).values() if hasattr(leaf, "__dict__") and not isinstance(leaf, torch.Tensor) else ()
        if any(isinstance(value, torch.Tensor) for value in fields):
            return type(leaf).__name__
    return ""
