"""Trace a module into the IR: torch.fx at layer granularity, sizes from a run on the meta device.

NOTE [nodes are storages]
fx gives one node per layer call (torch.nn modules stay leaves: convolution, normalisation, activation,
pooling, linear; functions such as add, cat, interpolate and flatten are nodes of their own). An IR node
is a *value*, and in PyTorch a value is a storage: an in-place layer (``ReLU(inplace=True)``, ``out +=
identity``) or a view (``flatten``, slicing) writes or reads its input's storage and allocates nothing. So
fx nodes are grouped by the storage they produce: a node that allocates a new storage starts an IR node;
one that only aliases an existing storage joins that storage's IR node. IR nodes are ordered by their
last member (the moment the value is final), which keeps the order topological when a later in-place
member writes in place reading another value (``out += identity``); a view does not move it. Nodes that produce no tensor (``x.size(0)``) and views
of inputs or parameters stay out of the IR: they cost nothing to keep.

While the meta run goes, ``saved_tensors_hooks`` record what autograd saves for each layer: saved
storages that belong to an IR node become ``backward_reads``; any other saved storage (max-pooling
indices, batch-norm statistics, the input an in-place op saves before it writes) counts as
``saved_extra_bytes``, once however many views of it are saved (an LSTM saves each step's gates as views
of one storage).

The probe also notes the state each fx node uses (``shared_state``): the generators, if it draws random
numbers (from ATen's op tags), and the buffers it can reach. The executor may run the forward pass in
another topological order than the program's, but never uses the same state in another order.

An in-place write to a value that a node of *another* IR node has already read (``y = x + 1;
x.relu_()``) is refused: a recomputation of ``y`` would read the written ``x``, and one IR node per
storage cannot hold both versions. The error names the module and the two calls.

NOTE [values held outside the program]
A plan decides when each value goes; that promise breaks if something outside the traced program holds
a value: a forward hook that appends a layer's output to a list (feature extraction for a perceptual
loss), a module attribute or a global it is stored in. Such a value lives to the step's end whatever the
plan, and a plan that recomputes it makes a second copy (a hooked activation measured 9% above its
plan's replay). The step on meta that ``_backward_peaks`` runs shows them: an IR node's storage still
alive after its backward, its output and its loss gone (that step packs saved tensors detached and lets
go of the autograd nodes it noted, so what an unused branch saved goes as it does in plain PyTorch).
Likewise ``self.feat = x`` in a forward: fx records no attribute assignment, so the traced program would
never make it (fx leaves the attribute holding its Proxy; the trace puts the old value back). Both are
refused, naming the layer or the attribute; the way out is to return the value from the forward, where
a loss can read it like any output. A shape kept so (``self.H = x.shape[2]``) is no value, and traces.

NOTE [augmented assignments]
fx's own Proxy has no ``__iadd__``, so Python runs ``out += identity`` as ``out = out + identity``: a new
buffer that the model never allocates (torchvision's bottleneck would hold one more feature map in every
recomputation than the model does under ``torch.utils.checkpoint``). Our tracer records the augmented
assignment itself (``operator.iadd``), and the program writes in place as the model does. Where the write
cannot stay in place, the probe turns it back into fx's out-of-place operator before it runs, which is
exactly what plain fx traces: when the target is not an IR node's value (an input, a parameter, a
buffer, whose earlier readers a recomputation would rerun on the written tensor), or when another IR node
has already read it (NOTE [a write after a read]). So tracing in place never refuses a model that fx traces.
An item assignment (``x[:, 0] = 0``, ``inv_perm[perm] = torch.arange(n)`` in transformers' experts),
which fx's Proxy refuses, is recorded as ``assign_item``: a write in place that returns the tensor it
wrote, joining that value's IR node as ``relu_`` would (after another layer read it, as the next note says).

Written in place, ``bn3``'s output, ``+= identity`` and the ReLU are one IR node, and the downsampling
branch the block computes between ``bn3`` and the addition sits between its members. Two things follow:
- the executor runs ``bn3`` just before the addition (``_delayed`` in ``harness/execute.py``), so that
  the IR node's autograd nodes are made together and its backward is not split by the branch's;
- its backward starts with the in-place members, which hand the branch its gradient (the ReLU's, passed
  on by the addition) before the batch norm's backward reads its input: ``Graph.early_grads``, which the
  replay makes in the node's first backward step.

NOTE [a write after a read]
Any other write in place (``relu_``, ``nn.ReLU(inplace=True)``, ``x[mask] = 0``, a ``clamp_`` under
``no_grad``, an in-place dropout) cannot stay in place once another IR node has read the value
(``y = h + 1; h.relu_()``): a recomputation of that reader, run after the write, would read the new value.
So the program writes a copy, the way a functional program would: the probe stops at the write
(``_CopyFirst``), the trace puts ``clone`` of the value just before it, hands the write the copy, and
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
read of another node's value (``Graph.extras_after_reads``), and the replay makes those extras after the
values that go at the node have gone (``_call`` in ``strategies/simulate.py``; made beside the value, they
put two plans of 32 tried 7% and 9% above their measured peak; no zoo net has such a node).

NOTE [one input]
The harness feeds a model one tensor, the forward's first argument. Hugging Face-style forwards take more
(``attention_mask=None``, ``return_dict=True``) and branch on them; traced as proxies, ``if attention_mask
is not None`` takes the branch (the program multiplied by None) and ``if return_dict`` is control flow fx
refuses. So each argument after the first is traced fixed at its default (fx's ``concrete_args``, the
program the model runs when called with the input alone), and fx's checks that it is given so are taken
out; an argument with no default is refused, naming it.

NOTE [sizes fixed at the example's]
fx traces every value as a proxy, sizes too, so Python that computes with a size is control flow or an
argument it cannot record: ``if height % 2: x = F.pad(...)``, ``torch.zeros(x.shape[0], n)``, a loop over
``x.chunk(2)``, the causal mask a Hugging Face model makes for its sequence length. A plan is made for one
input size (the harness traces again for each batch and side), so where the plain trace stops, the model
is traced again by ``_SizedTracer``, which also runs each call on meta: a proxy answers ``shape``,
``size()``, ``dim()``, ``numel()``, ``dtype`` and ``len()`` with its value's, iterates as its parts and
is true or false as its value, and the program takes the branch the example's sizes take. The device is
the example's, not meta: ``x.device.type == "cpu"`` takes the branch of the device the model runs on
(transformers counts a mixture of experts' tokens one way on the CPU, another on CUDA), and its name is a
string (timm's EfficientViT hands ``v.device.type`` to ``torch.autocast``; a proxy's attributes are sized
proxies in their turn, ``_SizedAttribute``, and a device's ``type`` and ``index`` its own). With sizes
numbers, a torch call on no traced value would run once in the trace and its tensor be held as a
constant: a buffer cut to the sequence and expanded to the batch (BERT's position and token type ids), a
mask made for the sequence. Such a call that makes a tensor is a node instead, made every step as the
model makes it. A module the forward makes and holds no state (transformers' ``ACT2FN["silu"]``) is traced
through, as a function. Control flow on a tensor's values is still refused, naming the module. Where a
call cannot run on meta (``nonzero``, whose size lies in the values; ``torch._grouped_mm`` in float32,
whose meta kernel takes half precision only), its sizes and those after it stay proxies, and if the trace
then stops, the refusal names that call. A model the plain trace takes keeps the plain trace.

NOTE [attention on the device]
``scaled_dot_product_attention`` picks its kernel by device: on meta always the math path (it saves the
attention matrix and the scaled queries and keys), on the CPU a fused kernel where it can (without
dropout: it saves the queries, keys and values themselves, the output and the log-sum-exp), on CUDA flash,
memory-efficient or cuDNN attention. The probe must size what the device will run: traced on meta, a plan
that discarded keys which only the CPU's kernel saves crashed on the CPU (the executor found a backward
reading what no plan kept), and other plans' peaks were 3-8% off. So for a CPU input the trace asks the
CPU's own choice (``torch._fused_sdp_choice``, of empty tensors with the same sizes and strides) and runs
that kernel on meta, whose saved tensors match the CPU's (tested). On meta, trace and tracker both run the
math path. A CUDA input is still traced so: asking the GPU, and running flash or memory-efficient
attention on meta as CUDA pads and masks them, is left to check against on a GPU.

NOTE [grad mode]
torch.fx records calls, not the grad mode they ran in: a ``with torch.no_grad():`` block in a forward (an
EMA update, a codebook assignment, a statistic used as a constant) would run with autograd on, and
gradients would flow where the model sends none. The tracer notes each node made while grad mode is off
(``node.meta["no_grad"]``), and every runner runs it so: the probe, the executor (``grad_mode``) and the
compiled path, whose fx module turns the mode off around it (``marked_module`` in ``harness/compiled.py``;
its marks, the values themselves, run with the mode on, so a write under ``no_grad`` cuts no gradient).

NOTE [autocast in the forward]
fx records calls, not the autocast they ran in, and the probe runs on meta, where ``torch.autocast``
casts nothing: a ``with torch.autocast(...)`` block in a forward would be traced as float32 code, its
values sized as float32, and run so by every plan, vanilla included (a bfloat16 block's gradients came
out 0.6% off plain PyTorch's). Running the recorded nodes under their autocast again is not enough: a
cast autocast makes (``h.float()`` after a bfloat16 block) is a new storage on the device and an alias on
meta, so the IR's storages would not be the program's. The tracer notes each node made under autocast,
and a model with one is refused, naming the call and its module. A block that turns autocast off
(``torch.autocast(..., enabled=False)``, to keep a part in float32 where the caller casts) makes no node
under autocast, and traces: the harness runs no autocast around the model.

NOTE [custom autograd functions]
fx traces through a custom ``torch.autograd.Function``: ``apply`` runs its forward on the proxies, which
records the forward's ops and drops the Function's own backward (pytorch/pytorch#84515). The program
would then train with the forward's plain derivative (a gradient reversal would not reverse), and since
``apply`` runs the forward with grad mode off, NOTE [grad mode] would cut the gradient there altogether.
So while fx traces, ``apply`` on a traced value records one ``call_function`` node that calls the
Function's ``apply``: the executor runs the real Function, its backward included, and what it saves
(``ctx.save_for_backward``) goes through the same ``saved_tensors_hooks`` as any layer's. A tensor kept
on ``ctx`` itself is out of the hooks' sight: it lives to the Function's backward whatever the plan, and
the replay does not count it.

NOTE [random draws on constants]
fx records a call only when a traced value is among its arguments; any other call runs once, while fx
traces, and its result is kept as a constant. For a draw (``torch.randperm(8)``, ``torch.randn(8)``,
``torch.empty(8).uniform_()``, ``torch.rand(8, generator=self.generator)``) that meant one permutation or
one noise for every step, under every plan, vanilla included. So while fx traces, a call on no traced
value that draws random numbers (ATen's ``nondeterministic_seeded`` tag, as ``random_nodes`` uses) is
recorded as a node, and the generators it drew from are put back: the trace draws nothing. The executor
replays such a node like any draw, from the default generators or from the model's own (NOTE [replaying
side effects] in ``harness/execute.py``). A tensor the program makes without naming a device is made on
the default device, which the meta runs (the trace's, ``measure``'s, the compiled replay's, and a
recomputation on autograd's thread) set to meta: a cpu model's noise would otherwise meet meta values. A
draw whose value steers Python control flow (``if torch.rand(1) < p``) now fails to trace as data-dependent
control flow, where fx kept one branch. A draw from Python's ``random`` or NumPy's global generator (an
older LayerDrop's ``if random.random() < p: continue``) is no torch op, and its branch too was kept for
every step: a module call that moves either generator while fx traces is refused, naming the module
(``_host_rng_state``).

NOTE [state the forward writes]
fx proxies parameters but not buffers: ``self.steps.add_(1)`` runs on the real buffer while fx traces and
leaves no node, so the program would never write it (and the trace would have written the model's
buffer). Where a trace wrote a buffer, the buffer is put back and the model traced again with buffers as
proxies (only then: a buffer used in Python control flow traces as before). The write is then a node
outside the IR, which the executor runs with its latest input. Three orders matter:
- a node that reads an input, parameter or buffer after a write reads the written value, in the forward
  and in a recomputation alike; its IR node gets edges from the IR nodes the write read and from those
  that read the state before it, so that no stage plan runs it before the write;
- a write to a buffer that IR nodes read before it (MoCo's queue: the logits read a copy of it, then the
  batch's keys are written in) runs after them in every stage order (``Traced.state_order``), and their
  recomputations start from the buffer as their forward calls found it, through a view too
  (``Traced.written_buffers``; NOTE [replaying side effects] in ``harness/execute.py``);
- a write to an input or a parameter after another IR node has read it is refused, naming both: the
  copies a recomputation starts from are the buffers'.
A layer that reads and writes its own state in one call (BatchNorm's running statistics) is replayed as
NOTE [replaying side effects] in ``harness/execute.py`` says.

NOTE [the loss]
The loss is not in the IR, but what it holds is part of the step, and it depends on the loss, not on the
model. So the trace runs the loss (and its backward) on meta, on the model's outputs, and records:
- which IR nodes the outputs are (``Graph.outputs``): the model returns them, so they stay until the
  loss's forward has read them, wherever they were made;
- what the loss's forward holds at its peak besides them (``loss_forward_bytes``);
- which outputs its backward reads (``loss_reads``), seen by a ``saved_tensors_hooks`` on the loss's
  forward: a squared error saves its input, so the output stays until the loss's backward is done, and
  if a plan discards it, the executor's token makes that backward recompute the output's stage;
- what each output's gradient adds (``loss_grad_bytes``): a sum hands the output an expanded view of
  the backward's seed, which adds nothing, where Kusumoto et al. 2019 counts a gradient the output's size; a view
  of another output's gradient adds nothing either; an output that is part of a value (a class token's
  row, ``x[:, 0]``) hands the value a new gradient of its whole, which the view's backward makes (left
  out, a class-token model's step was predicted 5% low);
- what the backward holds at its peak besides those gradients (``loss_bytes``: a cross entropy's
  log-softmax and its gradient), and what stays to the step's end (``loss_held_bytes``: the loss's value
  and the seed, which ``loss.backward()`` holds until it returns), and what it holds when it first unpacks
  an output (``loss_unpack_bytes``: a mean's backward has made its gradient before a square's unpacks
  its input), on top of which a recomputation of that output's stage runs (left out, 4% low).
Kusumoto et al.'s model, every sink an output handed a gradient its own size and nothing read, missed a small
head's vanilla step by +14% under a sum and by -19% and -31% under squared errors
(``tests/test_accounting.py``).

NOTE [tensors a module keeps]
The pre-hook forms of ``spectral_norm`` and ``weight_norm`` compute the layer's weight before each call
and keep it as a plain attribute of the module (``module.weight``) until the next call replaces it.
The layer saves that weight for its backward, but dropping the saved tensor frees nothing: the module
holds it to the step's end whatever the plan, and a recomputation makes another while the first is
still there. So what a layer saves that a module keeps as an attribute after the forward is not a
saved extra but ``Graph.attribute_bytes``, made by the layer's first call and held to the end; each
recomputation's pre-hook makes a second one, which replaces the first before the layer runs. Counted as
a saved extra, which a plan that recomputes the layer drops, such a discriminator's plans were predicted
2-3% low. A layer that does not save it (a product whose input takes no gradient saves no weight) leaves
it on the module all the same: the probe notes every tensor a module call leaves as an attribute, saved
or not, and only what the layer saves (``Graph.attribute_saved``) calls for its recomputation.

NOTE [parameter gradients]
A parameter's gradient is made once, by the first backward in the step that reaches it, and stays to the
step's end; the autograd engine sums what later readers' backwards hand it into that buffer. So the probe
notes, by storage, which IR nodes read each parameter that takes a gradient: through its module's call,
or as an input, directly or through a view (a bare ``nn.Parameter`` such as a class token, a layer
scale, a LoRA factor; a tied embedding's ``weight.t()``). Its bytes count once (``Graph.param_bytes``),
at its last reader in the forward order, and its other readers are that node's ``param_sharers``: the
replay makes the gradient at whichever of them its backward reaches first. Counted per module call, a
block applied four times had its gradients counted four times (+48% on its step's peak, a Siamese
encoder's twice, +21%); counted for modules only, a bare parameter's gradient was left out (-1% on a
LoRA model under ``chen_sqrt``, whose low-rank factors are bare parameters).
Only a backward that runs makes gradients: a parameter that only unreached layers read (NOTE [what no
gradient reaches]) gets none and is not counted. A gradient holds what its storage holds, seen after the
plain step on meta: autograd keeps the gradient it is handed where it can, and a slice of a larger one (a
``torch.cat`` of a query bias, a zero key bias and a value bias, as EVA's attention builds its bias)
keeps that whole gradient alive to the step's end, shared by the parameters it was cut for. Counted at
their sizes, an EVA-02's plans were predicted 768 bytes per block low.

NOTE [what no gradient reaches]
Not every layer's backward runs. An output the loss leaves out (an auxiliary classifier, torchvision's
``aux`` segmentation head, a pooler beside a language model's logits) gets no gradient, nor does any
layer only it reads; a value made from the input alone (a mask, positions from ``torch.arange``) takes
none either. The trace's backward on meta notes which IR nodes' autograd nodes ran (``_gradients``); the
others are ``Graph.unreached``. Their layers make no gradients, and what they saved is let go with the
outputs at the loss's forward, as in plain PyTorch, where their autograd graph dies with the output: the
executor drops their saved tensors there (the hooks' tokens would hold them to the step's end, each
output's own grad_fn in a cycle with it), and the replay frees them there. A value nothing reads (dead
code, a stray ``zeros_like``) goes as soon as it is made. Replayed as if their backward ran (gradients of
an auxiliary head's parameters and of its input, what it saved held into the backward pass), and run with
what it saved held to the step's end, an auxiliary head's step was predicted from 10% low (vanilla) to
15% high (``chen_greedy``; ``tests/test_accounting.py``).

NOTE [measured costs]
Kusumoto et al. 2019 weighs a convolution as 10 and any other layer as 1 (``cost_model=paper``); FLOPs weigh a
BatchNorm or a ReLU as nearly free, though on a GPU they take memory bandwidth and, eagerly, a launch each.
``cost_model=measured`` gives each IR node the time its members take to run, in milliseconds, on the
device the cell runs on: the traced program runs under ``torch.no_grad`` (as a recomputation does,
``harness/execute.py``), each fx node timed alone (on CUDA between synchronisations, so its launches
count, as they do in an eager recomputation), the median of three runs after a warm-up. The timing runs
leave the model as they found it: every buffer written (running statistics) is put back, by tensor and
value, and so is every generator the program draws from. What the time-centric DPs then minimise, and
the row's ``predicted_overhead_cost``, is the forward time a plan recomputes, in milliseconds. Each cell
times its layers again, so two runs of a cell may choose different plans where two cost nearly the same. The
times are eager; a compiled step fuses what it recomputes with the backward (``harness/compiled.py``),
where a BatchNorm's or a ReLU's recomputation is nearly free. Meta holds no values to time: refused there.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import inspect
import itertools
import operator
import random
import re
import statistics
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from harness.measure import DEVICE_PARTS, MemoryTracker
from harness.state import generators_of, grad_mode, rng_state, set_rng_state, state_kept, written_state
from harness.nets import sum_loss
from strategies import Graph

COST_MODELS = ("paper", "flops", "measured")
_CONV_TYPES = (torch.nn.modules.conv._ConvNd,)
_CONV_FUNCTIONS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d}


@dataclass(frozen=True)
class Traced:
    """A traced module: the fx module the executor runs and the IR strategies plan on."""

    module: fx.GraphModule
    graph: Graph
    members: tuple[tuple[str, ...], ...]  # fx node names of each IR node, in execution order
    group_of: dict[str, int]  # fx node name -> IR node, for the fx nodes that belong to one
    fx_node_count: int  # layer calls (fx nodes other than inputs, attributes and the output)
    written_in_place: frozenset[str] = frozenset()  # fx nodes that write their IR node's storage in place
    # The members before an IR node's last writer that return the tensor it returns (a layer's output that a
    # write in place such as ``x[i] = y`` or ``h.relu_()`` then wrote, read by name after the write) -> the IR node
    same_tensor: dict[str, int] = dataclasses.field(default_factory=dict)
    writes_state: frozenset[str] = frozenset()  # fx nodes that write an input, parameter or buffer in place
    state_order: frozenset[tuple[str, str]] = frozenset()  # (reader, writer): a buffer read before a write
    written_buffers: frozenset[str] = frozenset()  # buffers such a write writes
    # fx node -> the state it uses in the program's order: "generators" (it draws), buffers it can reach
    shared_state: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    @property
    def random_nodes(self) -> frozenset[str]:
        """The fx nodes that draw random numbers."""
        return frozenset(name for name, state in self.shared_state.items() if "generators" in state)


class TraceFailure(RuntimeError):
    pass


class _CopyFirst(Exception):
    """The probe's word that in-place write ``write`` is to write a copy of the value ``holders`` hold
    (NOTE [a write after a read]); ``via_write``: the write returns the tensor it wrote."""

    def __init__(self, write: str, holders: list[str], via_write: bool):
        super().__init__(f"write {write} is to write a copy")
        self.write, self.holders, self.via_write = write, holders, via_write


def _copy_before_write(gm: fx.GraphModule, copy_first: _CopyFirst):
    """Make the write of ``copy_first`` write a copy (NOTE [a write after a read]): a ``clone`` of the value
    just before the write, which the write writes instead, and which every later call reads."""
    nodes = {node.name: node for node in gm.graph.nodes}
    write, holders = nodes[copy_first.write], [nodes[name] for name in copy_first.holders]
    with gm.graph.inserting_before(write):
        copied = gm.graph.call_method("clone", (next(h for h in holders if h in write.all_input_nodes),))
    for holder in holders:
        write.replace_input_with(holder, copied)
    written = write if copy_first.via_write else copied
    for later in _nodes_after(write):
        for holder in holders:
            later.replace_input_with(holder, written)
    gm.recompile()


def _nodes_after(node: fx.Node):
    """The nodes of ``node``'s graph that come after it, in order."""
    while (node := node.next).op != "root":
        yield node


def trace(model: torch.nn.Module, example_input: torch.Tensor, cost_model: str = "paper", loss_fn=None) -> Traced:
    """Trace ``model`` on ``example_input`` into a ``Traced`` (see NOTE [nodes are storages]); the graph's
    ``loss_bytes`` and ``loss_held_bytes`` are what ``loss_fn`` (default: the executor's, the sum of the
    outputs) holds beside the outputs and their gradients, measured on meta."""
    check_cost_model(cost_model, example_input.device.type)
    gm = _symbolic_trace(model, example_input)
    # On meta, a tensor the program makes without naming a device (``torch.randn(8)``) is made on meta too.
    with torch.device("meta"), _attention_as_on(example_input.device, gm):
        while True:
            meta_module = gm if _on_meta(gm) else _meta_copy(gm)
            probe = _Probe(meta_module, cost_model)
            try:
                with torch.enable_grad():
                    output = probe.run(example_input.to("meta").requires_grad_(False))
                break
            except _CopyFirst as copy_first:  # NOTE [a write after a read]; then probe the new program
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
        # What layers saved that a module keeps as an attribute (NOTE [tensors a module keeps]).
        probe.kept_by_modules = {id(_storage(t)) for t in non_leaf_attributes(meta_module)}
        if probe.out_of_place:  # where the probe ran a copy, the same out-of-place turns here
            for node in gm.graph.nodes:
                if node.name in probe.out_of_place:
                    node.target = _AUGMENTED.get(node.target, node.target)
            gm.recompile()
        loss_fn = loss_fn or sum_loss  # the executor's default
        shares, work, early, ran, handed = _gradients(probe, output, loss_fn)
        peaks, frees, transients, unpacks, held, grad_bytes = _backward_peaks(
            meta_module, probe.group_of, probe.view_names, example_input, loss_fn)
        probe.trainable.update((key, b) for key, b in grad_bytes.items() if key in probe.trainable)
        if held:  # NOTE [values held outside the program]
            layer = _describe(probe.groups[min(held)]["members"][0], meta_module)
            raise TraceFailure(
                f"the value of {layer} is still held after a training step by something outside the traced "
                "program (a forward hook that keeps a layer's output, a list, a module attribute or a global "
                "it is stored in): no plan could free or recompute it, and every budget would be broken. Return "
                "the value from the forward instead (a loss can read several outputs)")
        traced = probe.result(gm, shares, work, peaks, early, frees, transients, unpacks, ran, handed)

        def node_of(t: torch.Tensor) -> int | None:
            g = probe._group(_storage(t))
            return None if g is None else traced.group_of[probe.groups[g]["final"].name]

        loss = _loss_fields(output, loss_fn, node_of, len(traced.graph))
    traced = dataclasses.replace(traced, graph=traced.graph.replace(**loss))
    if cost_model == "measured":  # on the example's device, outside the trace's default device (meta)
        traced = dataclasses.replace(traced, graph=traced.graph.replace(cost=measured_costs(traced, example_input)))
    return traced


def check_cost_model(cost_model: str, device: str) -> None:
    if cost_model not in COST_MODELS:
        raise ValueError(f"unknown cost_model {cost_model!r}; valid: {', '.join(COST_MODELS)}")
    if cost_model == "measured" and device == "meta":
        raise ValueError("cost_model=measured times every layer on the device, and meta holds no values to time: "
                         "use device=cpu or device=cuda, or cost_model=paper or flops on meta")


def measured_costs(traced: Traced, example_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each IR node's forward time in milliseconds on the example's device (NOTE [measured costs])."""
    module, device = traced.module, example_input.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {}

    class Timed(fx.Interpreter):
        def run_node(self, node):
            if node.op in ("placeholder", "get_attr", "output"):
                return super().run_node(node)
            sync()
            start = time.perf_counter()
            result = super().run_node(node)
            sync()
            times.setdefault(node.name, []).append(time.perf_counter() - start)
            return result

    with state_kept(module, ({device}, generators_of(module))), torch.no_grad():
        for _ in range(1 + repeats):  # the first warms up (allocator, cuDNN's choice of algorithm)
            Timed(module).run(example_input.clone())
    # The median of the timed runs (the warm-up's time is left out), summed over an IR node's members.
    return [sum(1e3 * statistics.median(times[name][1:]) for name in names if name in times)
            for names in traced.members]


def _gradients(probe: "_Probe", output, loss_fn) -> tuple[dict, dict, dict, set[int] | None, set[tuple[int, int]]]:
    """What each IR node's backward hands its predecessors (``Graph.grad_shares``), the gradients it
    works with on the way (``Graph.backward_work_bytes``), the predecessors its in-place members hand a
    gradient (``Graph.early_grads``), the IR nodes whose backward ran at all (NOTE [what no gradient
    reaches]; None: the outputs take no gradient) and the pairs (node, predecessor) it handed one, seen in
    a backward pass on meta: per autograd node of the node's layer, the gradients it reads and makes,
    compared by storage with the gradient the layer received and with those it passes to another IR node's
    autograd nodes."""
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not leaves:
        return {}, {}, {}, None, set()
    ran: set[int] = set()
    received: dict[int, set[int]] = {}  # probe group -> storages of the gradient its backward started from
    handed: list[tuple[int, int, object, int]] = []  # (group, predecessor group, its autograd node, storage)
    early: dict[int, set[int]] = {}  # group -> predecessor groups its in-place members hand a gradient
    through: dict[tuple[object, int], int] = {}  # (view's autograd node, storage in) -> storage out
    working: list[tuple[int, set[int]]] = []  # per autograd node run: its group, the gradients it reads and makes
    sizes: dict[int, int] = {}
    held = []  # the gradients stay alive, so that no storage address is reused while we compare

    def post_hook(fn, g):
        def hook(grad_inputs, grad_outputs):
            ran.add(g)
            held.extend(t for t in (*grad_inputs, *grad_outputs) if t is not None)
            for t in (*grad_inputs, *grad_outputs):
                if t is not None and t.layout != torch.strided:
                    raise TraceFailure(
                        f"the backward of {_describe(probe.groups[g]['members'][0], probe.module)} makes a "
                        f"{str(t.layout).removeprefix('torch.')} gradient (an nn.Embedding or EmbeddingBag with "
                        "sparse=True): the plans and the measurements count dense gradients; set sparse=False")
                if t is not None:
                    sizes[_storage(t)._cdata] = _storage(t).nbytes()
            if fn in probe.view_nodes:  # what a view's backward makes is the storage's gradient, received
                if grad_inputs and grad_inputs[0] is not None and grad_outputs[0] is not None:
                    through[(fn, _storage(grad_outputs[0])._cdata)] = _storage(grad_inputs[0])._cdata
                return
            if _to_parameters(fn, probe.autograd_group):  # a parameter's gradient on its way
                return
            inner = {_storage(t)._cdata for t in grad_outputs if t is not None}
            received.setdefault(g, set(inner))
            for (target, _), grad in zip(fn.next_functions, grad_inputs):
                h = probe.autograd_group.get(target)
                if grad is not None and h is not None and h != g:
                    handed.append((g, h, target, _storage(grad)._cdata))
                    if fn in probe.in_place_nodes:
                        early.setdefault(g, set()).add(h)
                elif grad is not None and h == g and not _to_parameters(target, probe.autograd_group):
                    inner.add(_storage(grad)._cdata)
            working.append((g, inner))
        return hook

    handles = [fn.register_hook(post_hook(fn, g)) for fn, g in probe.autograd_group.items()]
    try:
        with torch.enable_grad():
            loss = loss_fn(output)
        torch.autograd.backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    passed: dict[int, dict[int, set[int]]] = {}  # group -> predecessor group -> storages its gradient is in
    outside: dict[int, set[int]] = {}  # group -> storages it handed on, as handed
    for g, h, target, key in handed:
        outside.setdefault(g, set()).add(key)
        while target in probe.view_nodes:  # through the views' backward to the storage's own gradient
            key = through.get((target, key), key)
            target = target.next_functions[0][0] if target.next_functions else None
        passed.setdefault(g, {}).setdefault(h, set()).add(key)
    # A layer's working gradients: those its autograd nodes pass among themselves (an in-place ReLU's, on
    # its way to the convolution before it), beside the one it received and those it hands on.
    work: dict[int, int] = {}
    for g, inner in working:
        own = inner - received.get(g, set()) - outside.get(g, set())
        work[g] = max(work.get(g, 0), sum(sizes[k] for k in own))
    shares: dict[int, list[tuple[list[int], int]]] = {}
    for g, by_pred in passed.items():
        by_storage: dict[int, list[int]] = {}
        for h, storages in by_pred.items():
            if len(storages) == 1:
                by_storage.setdefault(next(iter(storages)), []).append(h)
        shares[g] = [(preds, -1 if key in received.get(g, ()) else sizes[key])
                     for key, preds in by_storage.items() if key in received.get(g, ()) or len(preds) > 1]
    return shares, work, early, ran, {(g, h) for g, h, _, _ in handed}


def _backward_peaks(module: fx.GraphModule, group_of: dict[str, int], views: set[str], example_input: torch.Tensor,
                    loss_fn) -> tuple[dict[int, int], dict[int, tuple[set[int], int]], dict[int, int], dict, set[int]]:
    """The most each layer's backward holds above what was live as it began (``Graph.backward_peak_bytes``),
    seen in a plain training step on meta: the gradients it makes (working ones, its inputs', its
    parameters') less what it frees on the way (its saved extras as each of its autograd nodes finishes,
    the gradient it received). Forward values are held as if never freed: the replay decides when they go.
    Beside it, for each layer, the forward values its backward freed and the peak with them going as they
    went (``Graph.backward_frees``), the most its forward call held above what it left
    (``Graph.forward_transient_bytes``), and what its backward held above what was live as it began the
    first time it unpacked each IR node's value or, its own, what it saved besides
    (``Graph.unpack_held_bytes``); the layers whose value outlives the step (NOTE [values held outside
    the program]); last, the bytes each parameter's gradient holds, by parameter storage (NOTE
    [parameter gradients])."""

    layers: dict[object, int] = {}  # autograd node -> the probe group whose layer call made it
    values: dict[int, int] = {}  # storages of IR nodes' values -> their probe group
    transients: dict[int, int] = {}  # probe group -> the most one of its calls held above what it left
    unpacks: dict[int, dict[int, int]] = {}  # probe group -> {group unpacked: held at its first unpack}

    class Claiming(fx.Interpreter):
        def run_node(self, node: fx.Node):
            tracker.call_peak = tracker.freeing
            with grad_mode(node):
                result = super().run_node(node)
            g = group_of.get(node.name)
            if g is not None:
                transients[g] = max(transients.get(g, 0), tracker.call_peak - tracker.freeing)
                outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
                values.update((id(_storage(t)), g) for t in outputs)
                # A view's backward (U-Net's crop, padding the gradient to the whole storage) runs as
                # part of its reader's, where the replay makes the gradient it hands on.
                if node.name not in views:
                    layers.update((fn, g) for fn in _new_autograd_nodes(outputs, layers))
            return result

    class LayerPeaks(MemoryTracker):
        def __init__(self, *args):
            self.level = 0  # live bytes, forward values counted as never freed
            self.freeing = 0  # live bytes
            self.call_peak = 0  # the most live during the forward's current call
            self.layer, self.start, self.freeing_start = None, 0, 0
            self.peaks: dict[int, int] = {}
            self.frees: dict[int, tuple[set[int], int]] = {}  # layer -> (values it freed, peak as they went)
            super().__init__(*args)

        def _add(self, storage, part):
            known = id(storage) in self.live
            super()._add(storage, part)
            if not known:
                values.pop(id(storage), None)  # a new storage, wherever an old value's id is reused
                self.level += storage.nbytes()
                self.freeing += storage.nbytes()
                self.call_peak = max(self.call_peak, self.freeing)
                if self.layer is not None:
                    self.peaks[self.layer] = max(self.peaks.get(self.layer, 0), self.level - self.start)
                    freed, peak = self.frees.setdefault(self.layer, (set(), 0))
                    self.frees[self.layer] = (freed, max(peak, self.freeing - self.freeing_start))

        def _free(self, key):
            size = self.live[key][0]
            super()._free(key)
            self.freeing -= size
            if key in values:
                g = values.pop(key)
                if self.layer is not None:
                    self.frees.setdefault(self.layer, (set(), 0))[0].add(g)
            else:
                self.level -= size

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._count_sum()  # a sum the engine made after the last layer's node is that layer's
            g = layers.get(torch._C._current_autograd_node())
            if g is not None and g != self.layer:
                self.layer, self.start, self.freeing_start = g, self.level, self.freeing
            return super().__torch_dispatch__(func, types, args, kwargs)

    def unpack(t):
        g = layers.get(torch._C._current_autograd_node())
        key = id(_storage(t))
        if g is not None and key not in static:  # an IR node's value, or (g's own) what g's layer saved besides
            # Before the layer's first op, it holds nothing yet.
            held = tracker.level - tracker.start if g == tracker.layer else 0
            unpacks.setdefault(g, {}).setdefault(values.get(key, g), held)
        return t

    x = example_input.to("meta")
    static = {id(_storage(t)) for t in [*module.parameters(), *module.buffers(), x]}
    module.zero_grad(set_to_none=True)  # as every step starts (a gradient already there is summed into)
    with torch.enable_grad(), LayerPeaks(module, (x,)) as tracker:
        # Packed detached: a saved output packed as itself would hold its own grad_fn, a cycle through C++
        # that kept what an unreached branch saved alive after the step (NOTE [values held outside the program]).
        with torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, unpack):
            loss_fn(Claiming(module).run(x)).backward()
    # What each parameter's gradient holds: a gradient autograd hands a parameter as a view of a larger
    # one it keeps as it is (a ``torch.cat`` of biases), which then lives to the step's end whole.
    grad_bytes, counted = {}, set()
    for p in module.parameters():
        if p.grad is not None:
            grad_bytes[id(_storage(p))] = 0 if id(_storage(p.grad)) in counted else _storage(p.grad).nbytes()
            counted.add(id(_storage(p.grad)))
    module.zero_grad(set_to_none=True)
    layers.clear()  # the autograd nodes no backward ran (an unused branch's) hold what they saved
    if values:  # what a reference cycle holds (a Function's ctx) goes at the next collection
        gc.collect()
    held = {g for key, g in values.items() if key not in static}  # still alive (NOTE [values held outside
    return tracker.peaks, tracker.frees, transients, unpacks, held, grad_bytes  # the program])


def _new_autograd_nodes(outputs, known: dict) -> list:
    """The autograd nodes a layer call made: those its outputs reach that are not ``known`` (an earlier
    call's), parameters' accumulators aside."""
    found, stack = [], [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in known or fn in found or fn.name() == "torch::autograd::AccumulateGrad":
            continue
        found.append(fn)
        stack += [f for f, _ in fn.next_functions if f is not None]
    return found


def _loss_fields(output, loss_fn, node_of, n: int) -> dict:
    """The loss's part of the graph (``Graph.loss_bytes`` and the other ``loss_*`` fields), measured on
    meta (NOTE [the loss]): the outputs are counted from the start and taken off every figure, since the
    replay holds them as the IR nodes' values."""

    leaves, bases = [], []  # bases: what a view's backward pads its gradient to (None: not part of a value)

    def leaf(t):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            leaves.append(t.detach().requires_grad_())
            bases.append(t._base if t._base is not None and t.numel() < t._base.numel() else None)
            return leaves[-1]
        return t

    saved = set()
    unpacked = []  # what is live when the backward first unpacks an output

    def pack(t):
        saved.add(id(_storage(t)))
        return t

    def unpack(t):
        if not unpacked and id(_storage(t)) in output_storages:
            unpacked.append(sum(tracker.current[part] for part in DEVICE_PARTS))
        return t

    output = tree_map(leaf, output)
    output_storages = {id(_storage(t)) for t in leaves}
    output_bytes = sum(t.untyped_storage().nbytes() for t in {id(_storage(t)): t for t in leaves}.values())
    with torch.enable_grad(), MemoryTracker(torch.nn.Module(), tuple(leaves)) as tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = loss_fn(output)
        del output
        forward = tracker.peak_bytes
        tracker.peak_bytes = sum(tracker.current[part] for part in DEVICE_PARTS)  # the backward's own peak
        seed = torch.ones_like(loss)  # ``loss.backward()`` holds it until the step's backward is done
        grads = torch.autograd.grad(loss, leaves, seed, allow_unused=True)
        ends = sum(tracker.current[part] for part in DEVICE_PARTS)
    grad_bytes, reads, counted = [0] * n, set(), {id(_storage(seed))}
    made = 0  # of those gradients, what the loss's backward made (the tracker counted it)
    for t, base, grad in zip(leaves, bases, grads):
        v = node_of(t)
        if v is None or grad is None:
            continue
        if id(_storage(grad)) not in counted:  # a view of the seed, or of another output's gradient, is free
            counted.add(id(_storage(grad)))
            made += grad.untyped_storage().nbytes()
            grad_bytes[v] += 0 if base is not None else grad.untyped_storage().nbytes()
        if base is not None and ("whole", v) not in counted:
            # Part of a value (``x[:, 0]``): its view's backward hands the node a new gradient of the whole.
            counted.add(("whole", v))
            grad_bytes[v] += base.numel() * base.element_size()
        if id(_storage(t)) in saved:
            reads.add(v)
    held = max(0, ends - output_bytes - made)  # the loss's value and the seed, to the step's end
    if id(_storage(loss)) in output_storages:  # the model returns its loss, which the step holds to its end
        held += loss.untyped_storage().nbytes()
    fields = dict(loss_forward_bytes=max(0, forward - output_bytes), loss_held_bytes=held,
                  loss_bytes=max(0, tracker.peak_bytes - output_bytes - made - held),
                  loss_unpack_bytes=max(0, unpacked[0] - output_bytes) if unpacked else 0)
    outputs = sorted({v for t in leaves if (v := node_of(t)) is not None})
    if not outputs:  # the model returns no IR node's value: Kusumoto et al.'s sinks stand in, at full size
        return fields
    return dict(fields, outputs=outputs, loss_grad_bytes=grad_bytes, loss_reads=sorted(reads))


def _to_parameters(fn, group_of: dict, depth: int = 4) -> bool:
    """Whether an autograd node only passes gradients on to parameters (``weight.t()``'s, in a linear
    layer), within its own layer and a few steps: what it is handed is a parameter's gradient, not a
    working one."""
    nexts = [f for f, _ in fn.next_functions if f is not None]
    return depth > 0 and bool(nexts) and all(
        f.name() == "torch::autograd::AccumulateGrad"
        or (group_of.get(f) == group_of.get(fn) and _to_parameters(f, group_of, depth - 1)) for f in nexts)


def _meta_copy(module: fx.GraphModule) -> fx.GraphModule:
    """A copy on the meta device, made without copying any weight."""
    memo = {id(t): t.detach().to("meta") for t in non_leaf_attributes(module)}
    for t in list(module.parameters()) + list(module.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def non_leaf_attributes(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors autograd made that a module keeps as plain attributes (the pre-hook forms of
    ``spectral_norm`` and ``weight_norm`` keep the weight of their last forward): ``copy.deepcopy`` refuses
    them, so a copy takes them detached (the next forward makes them again)."""
    return [value for m in module.modules() for value in vars(m).values()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None]


def _on_meta(module: torch.nn.Module) -> bool:
    return all(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))


# Each augmented assignment on a tensor, and the operator fx would have traced instead.
_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.ipow: operator.pow}


class _AugmentedProxy(fx.Proxy):
    """A Proxy that records ``x += y`` as ``operator.iadd`` (NOTE [augmented assignments]), and ``x[i] = y``
    as a call of ``assign_item``, a write in place that returns what it wrote."""

    def __setitem__(self, key, value):
        self.tracer.create_proxy("call_function", assign_item, (self, key, value), {})


def assign_item(tensor: torch.Tensor, key, value) -> torch.Tensor:
    """``tensor[key] = value``, returning ``tensor`` as an in-place op does."""
    tensor[key] = value
    return tensor


for _op in _AUGMENTED:
    setattr(_AugmentedProxy, f"__{_op.__name__}__",
            lambda self, other, op=_op: self.tracer.create_proxy("call_function", op, (self, other), {}))


class _Tracer(fx.Tracer):
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _AugmentedProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        try:
            self.path_of_module(m)
        except NameError:  # made in the forward, holding no state (NOTE [sizes fixed at the example's])
            if next(itertools.chain(m.parameters(), m.buffers()), None) is None:
                return forward(*args, **kwargs)
        before = _host_rng_state()
        result = super().call_module(m, forward, args, kwargs)
        if _host_rng_state() != before:  # the innermost module that drew raises first
            raise TraceFailure(_host_draw(f"module {self.path_of_module(m)!r} ({type(m).__name__})"))
        return result

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        if not torch.is_grad_enabled():  # NOTE [grad mode]
            node.meta["no_grad"] = True
        autocast = [f"{device}, {torch.get_autocast_dtype(device)}" for device in ("cpu", "cuda")
                    if torch.is_autocast_enabled(device)]
        if autocast:  # NOTE [autocast in the forward]
            node.meta["autocast"] = "; ".join(autocast)
        return node


class _SizedProxy(_AugmentedProxy):
    """A Proxy that answers with its value's sizes, dimensions and dtype where the trace knows its value
    (NOTE [sizes fixed at the example's])."""

    def _value(self):
        """The proxy's value on meta, where the trace knows it."""
        tracer = self.__dict__.get("tracer")  # absent on a proxy copy or pickle makes without __init__
        return tracer.values.get(self.node) if isinstance(tracer, _SizedTracer) else None

    def __getattr__(self, name: str):
        value = self._value()
        if isinstance(value, torch.Tensor) and name in _SIZES:
            return getattr(value, name)
        if isinstance(value, torch.device) and name in ("type", "index"):  # a name, not a device to make on
            return getattr(value, name)  # (timm: ``torch.autocast(device_type=v.device.type, enabled=False)``)
        return _SizedAttribute(self, name)

    def __len__(self):
        if isinstance(value := self._value(), (torch.Tensor, tuple, list)):
            return len(value)
        return super().__len__()


class _SizedAttribute(fx.proxy.Attribute, _SizedProxy):
    """An attribute of a sized proxy (``x.device``), sized in its turn; fx makes its node when it is used."""


# What a sized proxy answers from its value; the device is the example's, not meta (NOTE [sizes fixed at
# the example's]).
_SIZES = frozenset({"shape", "ndim", "dtype", "size", "dim", "numel", "nelement", "is_floating_point"})
_DEVICE = frozenset({"device", "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "get_device"})


class _SizedTracer(_Tracer):
    """fx's tracer that also runs each call on meta, so that the program's sizes are numbers, not proxies
    (NOTE [sizes fixed at the example's])."""

    def __init__(self, example_input: torch.Tensor):
        super().__init__()
        self.example_input = example_input.to("meta")
        self.on_the_device = torch.empty(0, dtype=example_input.dtype, device=example_input.device)
        self.values: dict[fx.Node, object] = {}  # each node's value on meta, where it could be run there
        self.unsized: tuple[str, str] | None = None  # the first call that could not run on meta, and why
        self.computing = False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _SizedProxy(node, self)

    def call_module(self, m, forward, args, kwargs):
        if self.computing:  # a leaf module's own submodules, run on meta
            return forward(*args, **kwargs)
        self.leaf_forward = m.forward  # for create_proxy, where a leaf's call becomes a node (its hooks not run)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        return attr_val if self.computing else super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: fx.Proxy) -> bool:
        if isinstance(value := self.values.get(obj.node), (bool, int, float)):
            return bool(value)
        return super().to_bool(obj)

    def iter(self, obj: fx.Proxy):
        if isinstance(value := self.values.get(obj.node), (torch.Tensor, tuple, list)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if any(isinstance(a, fx.Proxy) and a.node not in self.values for a in tree_leaves((args, kwargs))):
            return proxy  # sized after an input that could not be
        self.computing = True
        try:
            with torch.device("meta"):  # what the program makes without naming a device too
                self.values[proxy.node] = self._value(kind, target, args, kwargs)
        except Exception as error:  # its sizes stay proxies, as fx traces them
            if self.unsized is None and kind != "output":
                self.unsized = (_describe(proxy.node, self.root), f"{type(error).__name__}: {error}".splitlines()[0])
        finally:
            self.computing = False
        return proxy

    def _value(self, kind, target, args, kwargs):
        if kind == "placeholder":  # the input, then the forward's tensor defaults (NOTE [one input])
            first = not any(node.op == "placeholder" for node in self.values)
            return self.example_input if first else _on_meta_like(args[0])
        if kind == "get_attr":
            return _on_meta_like(functools.reduce(getattr, target.split("."), self.root))
        if kind == "call_function" and target is getattr and args[1] in _DEVICE:
            return getattr(self.on_the_device, args[1])
        if kind == "call_method" and target in _DEVICE:
            return getattr(self.on_the_device, target)()
        # The value of x.device is the example's device, for the program's branches (x.device.type ==
        # "cpu"); a call that is given it (torch.arange(n, device=x.device)) runs on meta.
        python = kind == "call_function" and (target is getattr or getattr(target, "__module__", "") == "_operator")

        def on_meta(a):
            a = self.values[a.node] if isinstance(a, fx.Proxy) else _on_meta_like(a)
            return torch.device("meta") if isinstance(a, torch.device) and not python else a

        args, kwargs = tree_map(on_meta, (args, kwargs))
        if kind == "call_function":
            return target(*args, **kwargs)
        if kind == "call_method":
            return getattr(args[0], target)(*args[1:], **kwargs)
        if kind == "call_module":
            with _state_on_meta(self.root.get_submodule(target)):
                return self.leaf_forward(*args, **kwargs)
        return None  # the output


def _on_meta_like(t, device="meta"):
    """An empty tensor on ``device`` with ``t``'s sizes, strides, dtype and requires_grad; anything else,
    itself."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).requires_grad_(t.requires_grad)


@contextlib.contextmanager
def _state_on_meta(module: torch.nn.Module):
    """``module``'s parameters and buffers swapped for empty meta tensors of their sizes while a call runs
    on meta values."""
    swapped = []
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    swapped.append((table, key, t))
                    table[key] = _on_meta_like(t)
    try:
        yield
    finally:
        for table, key, t in swapped:
            table[key] = t


@contextlib.contextmanager
def _functions_as_calls():
    """While fx traces, a custom ``torch.autograd.Function`` applied to a traced value is recorded as one
    call of its ``apply`` (NOTE [custom autograd functions])."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        proxies = [a for a in tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)]
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", _applying(cls), args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


_ATTENTION = torch.nn.functional.scaled_dot_product_attention


@contextlib.contextmanager
def _attention_as_on(device: torch.device, gm: fx.GraphModule):
    """While the trace runs on meta, ``scaled_dot_product_attention`` picks the kernel ``device`` would
    (NOTE [attention on the device]): the fx nodes that call it and the name modules call it by
    (``nn.MultiheadAttention``'s) lead to ``_attention_on_cpu`` for a CPU input."""
    if device.type != "cpu":
        yield
        return
    nodes = [node for node in gm.graph.nodes if node.target is _ATTENTION]
    for node in nodes:
        node.target = _attention_on_cpu
    torch.nn.functional.scaled_dot_product_attention = _attention_on_cpu
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = _ATTENTION
        for node in nodes:
            node.target = _ATTENTION
        if nodes:
            gm.recompile()  # its code may have been made meanwhile (augmented assignments turned out of place)


def _attention_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """``scaled_dot_product_attention`` on meta as the CPU runs it: its fused kernel where the CPU's
    choice (asked of empty tensors of the same sizes and strides) is that one, else the math path, as on
    meta."""
    if query.device.type == "meta" and not enable_gqa:
        with _disable_current_modes():  # no tracker counts the empty tensors
            like = [_on_meta_like(t, device="cpu") for t in (query, key, value, attn_mask)]
            choice = torch._fused_sdp_choice(*like, dropout_p, is_causal, scale=scale)
            del like
        if choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU converts it
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _ATTENTION(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa)


@functools.cache
def _applying(cls: type) -> Callable:
    """The call of ``cls.apply`` the fx module makes, under the Function's own name."""
    def call(*args, **kwargs):
        return cls.apply(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
    return call


class _DrawsAsCalls(TorchFunctionMode):
    """While fx traces, a torch call on no traced value that draws random numbers is recorded as a node
    (NOTE [random draws on constants])."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, fx.Proxy) for a in leaves):
            return func(*args, **kwargs)
        if isinstance(self.tracer, _SizedTracer):
            if self.tracer.computing:
                return func(*args, **kwargs)
            if _makes_tensor(func, args, kwargs):  # NOTE [sizes fixed at the example's]
                return self.tracer.create_proxy("call_function", func, args, kwargs)
        cuda = [torch.device("cuda", i) for i in range(torch.cuda.device_count() if torch.cuda.is_initialized() else 0)]
        before = rng_state((cuda, [g for g in leaves if isinstance(g, torch.Generator)]))
        with _Draws() as draws:
            value = func(*args, **kwargs)
        if not draws.seen:
            return value
        set_rng_state(before)  # the trace draws nothing
        return self.tracer.create_proxy("call_function", func, args, kwargs)


def _makes_tensor(func, args, kwargs) -> bool:
    """Whether ``func`` makes a tensor, asked of meta stand-ins for its tensor arguments."""
    try:
        with torch.device("meta"):
            made = func(*tree_map(_on_meta_like, args), **tree_map(_on_meta_like, kwargs))
    except Exception:
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(made))


def _symbolic_trace(model: torch.nn.Module, example_input: torch.Tensor) -> fx.GraphModule:
    """The model's fx module; where fx stops at a construct it cannot record, traced again with the
    example's sizes fixed (NOTE [sizes fixed at the example's])."""
    try:
        return _buffer_writes_traced(model, None)
    except TraceFailure as plain:
        if plain.__cause__ is None:  # the harness's own refusal, which the example's sizes do not change
            raise
        try:
            return _buffer_writes_traced(model, example_input)
        except TraceFailure as fixed:
            raise fixed from plain


def _buffer_writes_traced(model: torch.nn.Module, example_input: torch.Tensor | None) -> fx.GraphModule:
    """The model's fx module; where its code writes a buffer in place, traced again with buffers as
    proxies, so that the write is a node (NOTE [state the forward writes])."""
    buffers = dict(model.named_buffers())
    saved = {name: (b._version, b.detach().clone()) for name, b in buffers.items()}
    gm = _fx_trace(model, proxy_buffers=False, example_input=example_input)
    if _undo_writes(buffers, saved):
        gm = _fx_trace(model, proxy_buffers=True, example_input=example_input)
        if written := _undo_writes(buffers, saved):
            raise TraceFailure(f"{type(model).__name__} writes buffer {written[0]!r} in its forward in a way "
                               "torch.fx does not record; write it through the module attribute (self.name.add_(...))")
    return gm


def _undo_writes(buffers: dict[str, torch.Tensor], saved: dict[str, tuple]) -> list[str]:
    """The buffers a trace wrote in place (the write ran on the real tensor and left no node), each put
    back as it was."""
    written = [name for name, b in buffers.items() if b._version != saved[name][0]]
    with torch.no_grad():
        for name in written:
            buffers[name].copy_(saved[name][1])
            saved[name] = (buffers[name]._version, saved[name][1])
    return written


def _fx_trace(model: torch.nn.Module, proxy_buffers: bool, example_input: torch.Tensor | None = None
              ) -> fx.GraphModule:
    before = _host_rng_state()
    try:
        tracer = _Tracer() if example_input is None else _SizedTracer(example_input)
        tracer.proxy_buffer_attributes = proxy_buffers
        attributes = {id(m): dict(vars(m)) for m in model.modules()}
        concrete = _one_input(model)
        with torch.enable_grad(), _functions_as_calls(), _DrawsAsCalls(tracer):
            graph = tracer.trace(model, concrete_args=concrete or None)
        _drop_specialisation_checks(graph)
        kept = _proxies_kept(model, attributes)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        gm.meta["kept_as_attributes"] = kept  # NOTE [values held outside the program]
    except TraceFailure:
        raise
    except Exception as error:  # fx raises TraceError, but also TypeError/AttributeError from user code
        unsized = getattr(tracer, "unsized", None)
        why = f" (the trace could not size {unsized[0]} on meta: {unsized[1]})" if unsized else ""
        raise TraceFailure(_why_untraceable(model, error) + why) from error
    if _host_rng_state() != before:
        raise TraceFailure(_host_draw(type(model).__name__))
    if autocast := next((node for node in graph.nodes if "autocast" in node.meta), None):
        raise TraceFailure(
            f"{type(model).__name__} runs {_describe(autocast, gm)} under torch.autocast({autocast.meta['autocast']}) "
            "in its forward: the trace sizes every value on meta, where autocast casts nothing, so the plans and "
            "the executor would run another program than the model's (NOTE [autocast in the forward]). Take the "
            "autocast out of the forward; the harness trains in the parameters' dtype")
    return gm


def _one_input(model: torch.nn.Module) -> dict:
    """The forward's arguments after the first, fixed at their defaults (NOTE [one input]); a tensor default
    stays an argument, which the probe and the executor give its default."""
    plain = [p for p in inspect.signature(model.forward).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required := [p.name for p in plain[1:] if p.default is p.empty]:
        raise TraceFailure(
            f"{type(model).__name__}.forward takes {', '.join(p.name for p in plain)}, and the harness feeds a model "
            f"one input: {', '.join(map(repr, required))} {'has' if len(required) == 1 else 'have'} no default. Give "
            f"{'it' if len(required) == 1 else 'them'} a default, or wrap the model in a module whose forward takes "
            f"{plain[0].name!r} alone and makes the rest from it (an attention mask from the token ids)")
    return {p.name: p.default for p in plain[1:] if p.default is None or isinstance(p.default, (bool, int, float, str))}


def _drop_specialisation_checks(graph: fx.Graph):
    """Takes out the checks fx adds for each fixed argument (that it is given its default): the harness
    never passes one, and they are no layers."""
    checks = [n for n in graph.nodes if n.op == "call_function" and len(n.args) == 2
              and n.target in (torch._assert, fx._symbolic_trace._assert_is_none)
              and "has been specialized to have value" in str(n.args[1])]
    for check in reversed(checks):
        tested = check.args[0]
        graph.erase_node(check)
        if tested.op == "call_function" and not tested.users:
            graph.erase_node(tested)


def _opaque_output(output) -> str:
    """The type name of the first object among the model's outputs that holds tensors pytree does not
    flatten (a dataclass not registered with it), or ''."""
    for leaf in tree_leaves(output):
        fields = vars(leaf).values() if hasattr(leaf, "__dict__") and not isinstance(leaf, torch.Tensor) else ()
        if any(isinstance(value, torch.Tensor) for value in fields):
            return type(leaf).__name__
    return ""


def _proxies_kept(model: torch.nn.Module, before: dict[int, dict]) -> dict[str, tuple[str, str]]:
    """The fx nodes whose Proxy a trace left in a module's attribute, directly or in a list, tuple or dict:
    node name -> (module, attribute). Each attribute that holds one gets its value from before the trace
    back. A shape kept so (``self.H = x.shape[2]``) is harmless; a tensor is not (NOTE [values held outside
    the program])."""
    found = {}
    for name, m in model.named_modules():
        for key, value in list(vars(m).items()):
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            for item in items:
                if isinstance(item, fx.Proxy):
                    found.setdefault(item.node.name, (name or type(model).__name__, key))
            if isinstance(value, fx.Proxy):
                if key in before.get(id(m), {}):
                    setattr(m, key, before[id(m)][key])
                else:
                    delattr(m, key)
    return found


# What fx's errors mean in the model's own terms (a pattern of the error's text; the construct, and the way
# out where there is a usual one).
_CONSTRUCTS = [
    ("cannot be used as inputs to control flow", "data-dependent control flow (if, while, assert or bool() on a "
                                                 "tensor's value)"),
    ("cannot be iterated", "iteration over a traced value (unpacking, a for loop, *args)"),
    ("'len' is not supported", "len() of a traced value"),
    (r"^(zeros|ones|empty|full|rand|randn|randint|arange)\(\) (takes|received)",
     "a tensor made from a traced shape (torch.zeros(x.shape[0], n); make it from the traced value instead: "
     "x.new_zeros((x.shape[0], n)), torch.zeros_like)"),
]


def _host_rng_state() -> tuple:
    """Python's ``random`` state and NumPy's global one, where NumPy is loaded (NOTE [random draws on
    constants])."""
    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    return random.getstate(), None if state is None else (state[1].tobytes(), state[2:])


def _host_draw(where: str) -> str:
    return (f"{where} draws from Python's random module or NumPy's global generator in its forward (LayerDrop's "
            "`if random.random() < p`, say): torch.fx runs that draw once, while it traces, so every step of the "
            "traced program would take the branch this one took. Switch it off (a layer-drop probability of 0), "
            "or draw with torch and mask instead of branching (x + mask * f(x), as torchvision's StochasticDepth "
            "does)")


def _why_untraceable(model: torch.nn.Module, error: Exception) -> str:
    """The module (its path in ``model``) and the construct torch.fx stopped at, and where in the code."""
    paths = {id(m): path for path, m in model.named_modules()}
    module, where = None, ""
    frames = zip(traceback.walk_tb(error.__traceback__), traceback.extract_tb(error.__traceback__))
    for (frame, _), summary in frames:
        if "/torch/" in summary.filename or summary.filename == __file__:
            continue
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in paths:
            module = f"module {paths[id(owner)] or '(the model itself)'!r} ({type(owner).__name__})"
        where = f" at {summary.filename}:{summary.lineno}" + (f" ({summary.line})" if summary.line else "")
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    construct = next((what for key, what in _CONSTRUCTS if re.search(key, text)), f"{type(error).__name__}: {text}")
    return (f"torch.fx cannot trace {type(model).__name__}: {construct}, in {module or 'the model'}{where}. Make "
            "that code traceable, or wrap the module in a traceable one that leaves that call out")


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


class _Draws(TorchDispatchMode):
    """Whether an op drew random numbers: ATen tags every op that consumes the generator
    ``nondeterministic_seeded`` (dropout's bernoulli_, rand, randn, randperm, SDPA's dropout)."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen = self.seen or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


class _Probe(fx.Interpreter):
    """Runs the fx module on meta tensors and groups its nodes into IR nodes."""

    def __init__(self, gm: fx.GraphModule, cost_model: str):
        super().__init__(gm)
        self.cost_model = cost_model
        self.static = {id(_storage(t)) for t in list(gm.parameters()) + list(gm.buffers())}
        self.trainable: dict[int, int] = {}  # storage of parameters that take gradients -> their gradients' bytes
        for p in gm.parameters():
            if p.requires_grad:
                self.trainable[id(_storage(p))] = self.trainable.get(id(_storage(p)), 0) + p.numel() * p.element_size()
        self.buffer_ids = {id(b) for b in gm.buffers()}
        self.buffer_names = {id(b): name for name, b in gm.named_buffers()}
        self.shared_state: dict[str, frozenset[str]] = {}  # Traced.shared_state
        self.buffer_of_storage = {id(_storage(b)): (name, b) for name, b in gm.named_buffers()}
        self.static_names = {id(_storage(t)): f"{kind} {name!r}" for kind, named in
                             (("parameter", gm.named_parameters()), ("buffer", gm.named_buffers())) for name, t in named}
        self.group_of_storage: dict[int, tuple[weakref.ref, int]] = {}
        self.groups: list[dict] = []  # each: members, bytes, cost, reads, extra, params, kind
        self.group_of: dict[str, int] = {}
        self.fx_count = 0
        self.readers: dict[int, dict[int, fx.Node]] = {}  # IR node -> {IR node reading it: first reading fx node}
        self._keep_alive = []  # meta tensors are free; holding them keeps storage ids unique
        self.autograd_group: dict[object, int] = {}  # autograd node -> the IR node whose layer made it
        self.view_nodes: set[object] = set()  # autograd nodes of views of an IR node's storage
        self.view_names: set[str] = set()  # the fx nodes that are such views
        self.in_place_nodes: set[object] = set()  # autograd nodes of in-place writes (a ReLU's, ``+=``'s)
        self.in_place_names: set[str] = set()  # the fx nodes that make those writes
        self.out_of_place: set[str] = set()  # augmented assignments that cannot write in place
        self.returned: dict[str, int] = {}  # fx node -> id of the tensor it returned (alive: ``_keep_alive``)
        self.state_readers: dict[int, list[fx.Node]] = {}  # static storage -> the IR node members that read it
        self.state_after: dict[int, set[int]] = {}  # static storage -> the IR nodes its last write follows
        self.state_writers: set[str] = set()
        self.state_order: set[tuple[str, str]] = set()  # (reader, writer) of a buffer
        self.written_buffers: dict[int, str] = {}  # storage -> name of a buffer a node of its own writes
        self.node_inputs: dict[str, list[torch.Tensor]] = {}  # fx node -> its input tensors, for ``_state_bytes``
        self.kept_by_modules: set[int] = set()  # storages of what modules keep as attributes after the run

    def _group(self, storage) -> int | None:
        entry = self.group_of_storage.get(id(storage))
        return entry[1] if entry and entry[0]() is storage else None

    def run_node(self, node: fx.Node):
        if node.op in ("placeholder", "get_attr", "output"):
            result = super().run_node(node)
            if node.op == "placeholder":
                self.static.update(id(_storage(t)) for t in tree_leaves(result) if isinstance(t, torch.Tensor))
            return result
        self.fx_count += 1
        if node.target in _AUGMENTED and not self._may_write(node.args[0]):
            node.target = _AUGMENTED[node.target]
            self.out_of_place.add(node.name)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        flops = FlopCounterMode(display=False)  # for cost_model=flops, and every graph's ``flops``
        inputs = [t for t in tree_leaves(self._inputs(node)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        draws = _Draws()
        self.node_inputs[node.name] = inputs  # which buffers a later node writes is known at the end
        called = self.module.get_submodule(node.target) if node.op == "call_module" else None
        attributes_before = {id(_storage(t)) for t in non_leaf_attributes(called)} if called is not None else set()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), flops, draws, grad_mode(node):
            try:
                result = super().run_node(node)
            except (RuntimeError, NotImplementedError) as error:
                if "meta tensor" not in str(error):
                    raise
                raise TraceFailure(
                    f"{_describe(node, self.module)} reads a tensor's value in Python (.item(), float(), int(), "
                    ".tolist()); the trace sizes every value on meta, which holds none (a BatchNorm with "
                    "momentum=None divides by its num_batches_tracked: give it a momentum); keep such a value a "
                    "tensor") from error
        reached = [*inputs, *(called.buffers() if called is not None else ())]
        state = {self.buffer_names[id(t)] for t in reached if id(t) in self.buffer_names} | (
            {"generators"} if draws.seen else set())
        if state:
            self.shared_state[node.name] = frozenset(state)
        written = [t for t, v in zip(inputs, versions) if t._version != v and id(_storage(t)) not in self.static]
        self._record(node, result, saved, flops.get_total_flops(), written)
        if called is not None and (g := self.group_of.get(node.name)) is not None:  # NOTE [tensors a module keeps]
            made = [t for t in non_leaf_attributes(called)
                    if id(_storage(t)) not in attributes_before and self._group(_storage(t)) is None]
            self.groups[g]["made_attributes"].update((id(_storage(t)), _storage(t).nbytes()) for t in made)
            self._keep_alive += made
        self._note_params(node, inputs)
        self._note_state(node, inputs, versions)
        return result

    def _note_state(self, node: fx.Node, inputs: list[torch.Tensor], versions: list[int]):
        """Note which IR nodes read an input, parameter or buffer, and refuse a write to an input or a
        parameter after another IR node read it; a write to a buffer follows the IR nodes that read it
        before, and those that read it after a write follow the write's inputs and those readers (NOTE
        [state the forward writes])."""
        g = self.group_of.get(node.name)
        for t, version in zip(inputs, versions):
            key = id(_storage(t))
            if key not in self.static:
                continue
            if t._version != version:
                readers = [r for r in self.state_readers.get(key, []) if r is not node]
                if readers and key not in self.buffer_of_storage:
                    raise TraceFailure(
                        f"in-place write {_describe(node, self.module)} changes {self.static_names.get(key, 'an input')} "
                        f"after {_describe(readers[0], self.module)} read it; a recomputation of that reader would see "
                        "the new value. Write out of place, or before any layer reads it")
                before = {self.group_of[r.name] for r in readers}
                self.state_order.update((r.name, node.name) for r in readers)
                if g is not None:
                    self.groups[g]["after"] |= before - {g}
                inputs_of_write = {h for n in node.all_input_nodes if (h := self.group_of.get(n.name)) is not None}
                self.state_after[key] = inputs_of_write | before
                self.state_writers.add(node.name)
                if key in self.buffer_of_storage:
                    self.written_buffers[key] = self.buffer_of_storage[key][0]
            elif g is not None:
                self.state_readers.setdefault(key, []).append(node)
                self.groups[g]["after"] |= self.state_after.get(key, set())

    def _note_params(self, node: fx.Node, inputs: list[torch.Tensor]):
        """Note the trainable parameters an IR node's member reads: its module's, for a module call, and any
        among its inputs, directly or through a view (a bare ``nn.Parameter``, ``self.cls_token.expand(...)``,
        a tied embedding's ``weight.t()``) (NOTE [parameter gradients])."""
        g = self.group_of.get(node.name)
        if g is None:
            return
        read = [*inputs, *(self.module.get_submodule(node.target).parameters() if node.op == "call_module" else ())]
        self.groups[g]["params"].update(key for t in read if (key := id(_storage(t))) in self.trainable)

    def _may_write(self, target) -> bool:
        """Whether an augmented assignment may write ``target`` in place (NOTE [augmented assignments]):
        it is an IR node's value that no other IR node has read yet."""
        value = self.env.get(target) if isinstance(target, fx.Node) else target
        if not isinstance(value, torch.Tensor):
            return True  # a Python number: the operator is out of place anyway
        g = self._group(_storage(value))
        return g is not None and all(h == g for h in self.readers.get(g, {}))

    def _copy_first(self, node: fx.Node, written: list[torch.Tensor], result, g: int, reader: fx.Node):
        """``node`` wrote the value of IR node ``g`` in place after ``reader`` read it: raise ``_CopyFirst``
        for the trace to make it write a copy (NOTE [a write after a read]), or refuse where a later call
        would read the value as a tensor the copy does not replace."""
        def refuse(why: str):
            raise TraceFailure(
                f"in-place write {_describe(node, self.module)} changes the value of "
                f"{_describe(self.groups[g]['members'][0], self.module)} after {_describe(reader, self.module)} "
                f"read it, and {why}, so it cannot write a copy instead. Write out of place (e.g. relu instead "
                "of relu_, inplace=False; for x[i] = y, torch.where or x.index_put)")

        target = written[0]
        if any(t is not target for t in written):
            refuse("it writes several tensors")
        holders = {n for n, value in self.env.items() if value is target}  # the value as the tensor written
        if not holders & set(node.all_input_nodes):
            refuse("it writes a tensor no call returned as such (a part of a tuple or list)")
        aliases = {n for n, value in self.env.items() if n not in holders and any(
            isinstance(t, torch.Tensor) and self._group(_storage(t)) == g for t in tree_leaves(value))}
        for later in _nodes_after(node):
            if seen := next((n for n in later.all_input_nodes if n in aliases), None):
                refuse(f"{_describe(later, self.module)} reads it after the write through {seen.name}, a view "
                       "of it (or a tuple holding one) made before")
        raise _CopyFirst(node.name, sorted(n.name for n in holders), result is target)

    def _inputs(self, node: fx.Node):
        return [self.env[n] for n in node.all_input_nodes if n in self.env]

    def _record(self, node: fx.Node, result, saved, flop_count, written: list[torch.Tensor]):
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        self._keep_alive += outputs
        if isinstance(result, torch.Tensor):
            self.returned[node.name] = id(result)
        new = {}
        for t in outputs:
            s = _storage(t)
            if id(s) not in self.static and self._group(s) is None:
                new[id(s)] = s
        aliased = [self._group(_storage(t)) for t in outputs if self._group(_storage(t)) is not None]
        # The model's output may gather several values (a dataclass of them is a node of its own); a call a
        # later layer reads may not.
        if len(set(aliased)) + bool(new) > 1 and any(user.op != "output" for user in node.users):
            raise TraceFailure(
                f"{_describe(node, self.module)} returns (views of) the values of "
                f"{' and '.join(_describe(self.groups[h]['members'][0], self.module) for h in dict.fromkeys(aliased))}"
                f"{' beside a new one' if new else ''}; an IR node is one value (NOTE [nodes are storages]), and "
                "a plan that recomputes one of them could not tell which. Take each view in a call of its own "
                "(a.expand(shape) and b.expand(shape) for torch.broadcast_tensors or torch.meshgrid)")
        if new:
            g = len(self.groups)
            self.groups.append(dict(members=[], final=node, bytes=sum(s.nbytes() for s in new.values()), cost=0.0, flops=0,
                                    reads=set(), extra={}, made_attributes={}, params=set(), after=set(),
                                    kind=_kind(node, self.module), saved_since_read=set()))
            for s in new.values():
                self.group_of_storage[id(s)] = (weakref.ref(s), g)
        elif aliased:
            g = aliased[0]
        else:
            return  # no tensor, or a view of an input or parameter: not an IR node
        group = self.groups[g]
        group["members"].append(node)
        view = not new and not written
        if view:
            self.view_names.add(node.name)
        self._claim(outputs, g, view, bool(written))
        if written:
            group["final"] = node
            self.in_place_names.add(node.name)
            others = [reader for h, reader in self.readers.get(g, {}).items() if h != g]
            if others:
                self._copy_first(node, written, result, g, others[0])
        read = {h for source in node.all_input_nodes if (h := self.group_of.get(source.name)) is not None}
        for h in read:
            self.readers.setdefault(h, {}).setdefault(g, node)
        group["cost"] += _cost(node, self.module, self.cost_model, flop_count)
        group["flops"] += flop_count
        self.group_of[node.name] = g
        extras = {}  # a storage saved as several views (an LSTM's gates, step by step) is held once
        for t in saved:
            owner = self._group(_storage(t))
            if owner is not None:
                group["reads"].add(owner)
            elif id(_storage(t)) not in self.static:
                extras[id(_storage(t))] = _storage(t).nbytes()
        group["extra"].update(extras)
        if read - {g}:
            group["saved_since_read"] = set()  # for Graph.extras_after_reads: saved while it reads, not after
        else:
            group["saved_since_read"].update(extras)
        self._keep_alive += saved

    def _claim(self, outputs, g: int, view: bool, in_place: bool):
        """Note the autograd nodes this layer call made, those of a view of the IR node's storage (U-Net's
        crop), whose backward may build a gradient of the whole storage out of the one it is handed, and
        those of an in-place write, whose backward runs before the rest of the layer's."""
        for fn in _new_autograd_nodes(outputs, self.autograd_group):
            self.autograd_group[fn] = g
            if view:
                self.view_nodes.add(fn)
            if in_place:
                self.in_place_nodes.add(fn)

    def result(self, gm: fx.GraphModule, shares: dict | None = None, work: dict | None = None,
               peaks: dict | None = None, early: dict | None = None, frees: dict | None = None,
               transients: dict | None = None, unpacks: dict | None = None, ran: set[int] | None = None,
               handed: set[tuple[int, int]] | None = None) -> Traced:
        # The probe may run a meta copy of gm: match nodes by name.
        position = {node.name: i for i, node in enumerate(gm.graph.nodes)}
        order = sorted(range(len(self.groups)), key=lambda g: position[self.groups[g]["final"].name])
        rank = {g: i for i, g in enumerate(order)}
        edges = set()
        for g, group in enumerate(self.groups):
            for node in group["members"]:
                for source in node.all_input_nodes:
                    h = self.group_of.get(source.name)
                    if h is not None and h != g:
                        edges.add((rank[h], rank[g]))
            edges.update((rank[h], rank[g]) for h in group["after"] if h != g)  # NOTE [state the forward writes]
        groups = [self.groups[g] for g in order]
        param_bytes, sharers = [0] * len(groups), [set() for _ in groups]  # NOTE [parameter gradients]
        readers_of: dict[int, set[int]] = {}
        reached = set(range(len(self.groups))) if ran is None else ran  # NOTE [what no gradient reaches]
        for g, group in enumerate(self.groups):
            for key in group["params"] if g in reached else ():
                readers_of.setdefault(key, set()).add(rank[g])
        for key, readers in readers_of.items():
            owner = max(readers)
            param_bytes[owner] += self.trainable[key]
            sharers[owner] |= readers - {owner}
        written = {key: self.buffer_of_storage[key][1] for key in self.written_buffers}
        without_grad = [[] for _ in groups]  # what a backward that ran handed no gradient (Graph.preds_without_grad)
        for u, v in edges if ran is not None and handed is not None else ():
            if order[v] in reached and (order[v], order[u]) not in handed:
                without_grad[v].append(u)
        graph = Graph(
            mem_bytes=[g["bytes"] for g in groups],
            cost=[g["cost"] for g in groups],
            edges=sorted(edges),
            names=[g["final"].name for g in groups],
            kinds=[g["kind"] for g in groups],
            backward_reads=[sorted(rank[h] for h in g["reads"]) for g in groups],
            saved_extra_bytes=[sum(b for key, b in g["extra"].items() if key not in self.kept_by_modules)
                               for g in groups],
            attribute_bytes=[sum(b for key, b in {**g["made_attributes"], **g["extra"]}.items()
                                 if key in self.kept_by_modules) for g in groups],
            attribute_saved=[any(key in self.kept_by_modules for key in g["extra"]) for g in groups],
            extras_after_reads=[bool(saved := set(g["extra"]) - self.kept_by_modules) and saved <= g["saved_since_read"]
                                for g in groups],
            param_bytes=param_bytes, param_sharers=[sorted(s) for s in sharers],
            scopes=[_scope(g["final"]) for g in groups],
            flops=[g["flops"] for g in groups],
            grad_shares=[[(kept, size) for preds, size in (shares or {}).get(g, [])
                          if (kept := sorted(rank[h] for h in preds if (rank[h], rank[g]) in edges))] for g in order],
            backward_work_bytes=[(work or {}).get(g, 0) for g in order],
            recompute_state_bytes=[self._state_bytes(g, written) for g in groups],
            backward_peak_bytes=None if peaks is None else [peaks.get(g, 0) for g in order],
            backward_frees=None if frees is None else [
                (sorted(rank[h] for h in freed if h in rank), peak)
                for freed, peak in (frees.get(g, (set(), peaks.get(g, 0))) for g in order)],
            forward_transient_bytes=None if transients is None else [transients.get(g, 0) for g in order],
            unpack_held_bytes=None if unpacks is None else [
                [(rank[h], held) for h, held in unpacks.get(g, {}).items() if h in rank] for g in order],
            early_grads=[sorted(rank[h] for h in (early or {}).get(g, ()) if (rank[h], rank[g]) in edges) for g in order],
            unreached=[rank[g] for g in order if g not in reached],
            preds_without_grad=without_grad,
            shared_state=[set().union(*(self.shared_state.get(node.name, ()) for node in g["members"]))
                          for g in groups],
        )
        members = tuple(tuple(node.name for node in g["members"]) for g in groups)
        group_of = {name: i for i, names in enumerate(members) for name in names}
        same_tensor = {node.name: rank[g] for g, group in enumerate(self.groups)
                       for node in group["members"][:group["members"].index(group["final"])]
                       if self.returned.get(node.name, -1) == self.returned.get(group["final"].name)}
        return Traced(module=gm, graph=graph, members=members, group_of=group_of, fx_node_count=self.fx_count,
                      written_in_place=frozenset(self.in_place_names), same_tensor=same_tensor,
                      writes_state=frozenset(self.state_writers), state_order=frozenset(self.state_order),
                      written_buffers=frozenset(self.written_buffers.values()), shared_state=dict(self.shared_state))

    def _state_bytes(self, group: dict, written: dict[int, torch.Tensor]) -> int:
        """The copies of the state a recomputation of ``group`` starts from, one per call, held from the
        forward call to the recomputation (``Graph.recompute_state_bytes``); the buffers among a call's inputs
        are those among its arguments."""
        return sum(t.numel() * t.element_size() for node in group["members"]
                   for t in written_state(self.module, node, self.node_inputs[node.name], {}, self.buffer_ids, written))


def _describe(node: fx.Node, module: torch.nn.Module) -> str:
    """An fx node as a person finds it in the model's code: the call and the module it sits in."""
    target = _target(node, module)
    call = type(target).__name__ if isinstance(target, torch.nn.Module) else getattr(target, "__name__", str(target))
    scope = _scope(node) or (node.target if node.op == "call_module" else "")
    return f"{call} ({node.name}" + (f" in module {scope!r})" if scope else ")")


def _scope(node: fx.Node) -> str:
    """The path of the innermost module whose forward made ``node`` (fx records the module stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _target(node: fx.Node, module: torch.nn.Module):
    return module.get_submodule(node.target) if node.op == "call_module" else node.target


_KINDS = [
    ("conv", (torch.nn.modules.conv._ConvNd,), {"conv1d", "conv2d", "conv3d", "conv_transpose2d"}),
    ("norm", (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm),
     {"batch_norm", "layer_norm", "group_norm"}),
    ("act", (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid, torch.nn.Tanh,
             torch.nn.LeakyReLU, torch.nn.Identity), {"relu", "relu_", "gelu", "silu", "sigmoid", "tanh"}),
    ("pool", (torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
              torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.modules.pooling._AdaptiveMaxPoolNd),
     {"max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"}),
    ("linear", (torch.nn.Linear,), {"linear", "matmul"}),
    ("dropout", (torch.nn.modules.dropout._DropoutNd,), {"dropout", "dropout2d"}),
    ("upsample", (torch.nn.Upsample, torch.nn.UpsamplingBilinear2d), {"interpolate", "upsample"}),
    ("add", (), {"add", "iadd", "add_", "sub"}),
    ("mul", (), {"mul", "imul", "mul_"}),
    ("cat", (), {"cat", "concat", "stack"}),
]


def _kind(node: fx.Node, module: torch.nn.Module) -> str:
    target = _target(node, module)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    for kind, types, names in _KINDS:
        if (node.op == "call_module" and isinstance(target, types)) or (node.op != "call_module" and name in names):
            return kind
    return "other"


def _cost(node: fx.Node, module: torch.nn.Module, cost_model: str, flop_count: int | None) -> float:
    if cost_model == "flops":
        return float(flop_count)
    # Kusumoto et al. 2019: 10 for a convolution, 1 for anything else (its Chainer class name starts with "Conv").
    target = _target(node, module)
    is_conv = isinstance(target, _CONV_TYPES) and not isinstance(target, torch.nn.modules.conv._ConvTransposeNd)
    return 10.0 if is_conv or target in _CONV_FUNCTIONS else 1.0
