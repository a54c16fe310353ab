"""Any PyTorch model, exact: randomness, in-place ops and state handled by mechanism (NOTE [replaying side
effects] in harness/execute/side_effects.py), on models from outside the zoo; and models named by source."""

import copy
import dataclasses
import json
import random
import sys
import textwrap
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import strategies
from harness.execute import execute
from harness.execute.exact import compare, switch_on_randomness, tolerance
from harness.measure import measure
from harness.run import fixed_bytes
from harness.tracing.trace import trace
from harness.tracing.traced import TraceFailure
from harness.zoo import nets

# torchvision models at small sizes, dropout and stochastic depth on: (name, side, builder kwargs).
TORCHVISION = [
    ("mobilenet_v2", 32, {}), ("mobilenet_v3_small", 32, {}), ("efficientnet_b0", 32, {}),
    ("shufflenet_v2_x0_5", 32, {}), ("squeezenet1_1", 48, {}), ("convnext_tiny", 32, {}),
    ("regnet_y_400mf", 32, {}), ("swin_t", 32, {}), ("vit_b_16", 32, {"image_size": 32}),
]


def assert_exact(model, x, loss_fn, strategies_to_check=("approx_dp", "chen_sqrt")):
    traced = trace(model, x)
    for name in strategies_to_check:
        plan = strategies.solve(name, traced.graph)
        assert plan.recomputed, f"{name} must recompute something for the check to mean anything"
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, f"{name}: {difference}"
    return traced


@pytest.mark.parametrize("name,side,kwargs", TORCHVISION, ids=[t[0] for t in TORCHVISION])
def test_torchvision_models_are_exact_with_randomness_on(name, side, kwargs):
    torch.manual_seed(0)
    model, x, loss_fn = nets.build(f"torchvision:{name}", 2, side, "cpu", kwargs=kwargs)
    switch_on_randomness(model)
    assert_exact(model, x, loss_fn)


class GPTDecoder(nn.Module):
    """A GPT-style decoder from nn.TransformerEncoderLayer: pre-norm, causal mask, dropout 0.1 (the
    attention's own dropout runs inside F.multi_head_attention_forward)."""

    def __init__(self, vocab=97, width=32, heads=4, depth=3, length=16):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Parameter(torch.randn(length, width) * 0.02)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(depth))
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position
        for layer in self.layers:
            x = layer(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


@pytest.mark.parametrize("seed", [0, 1])
def test_gpt_style_decoder_with_attention_dropout_is_exact(seed):
    torch.manual_seed(seed)
    model = GPTDecoder().train()
    tokens = torch.randint(0, 97, (2, 16))
    assert_exact(model, tokens, lambda logits: nets.next_token_loss(logits, tokens))


@pytest.mark.parametrize("net", ["gpt2", "vit_b_16"])
def test_every_plan_on_the_zoos_transformers(net):
    """Every strategy and peer (the zoo's blocks and sequence) against plain PyTorch, SDPA's and MHA's
    dropout on: the zoo's code with two blocks, GPT-2 narrower with a small vocabulary, ViT-B/16 at 32x32
    (torchvision fixes its side at construction); every plan on them says what it would on the full nets."""
    from test_executor import assert_step_matches, plans, reference_step

    torch.manual_seed(0)
    if net == "gpt2":
        model = nets.GPT2(vocab_size=512, context=32, width=64, depth=2, heads=4).train()
        x = torch.randint(0, 512, (2, 32))
        loss_fn = partial(nets.next_token_loss, tokens=x)
    else:
        model, x, loss_fn = nets.build("torchvision:vit_b_16", 2, 32, "cpu", kwargs={
            "image_size": 32, "dropout": 0.1, "attention_dropout": 0.1})
        model.encoder.layers = model.encoder.layers[:2]
    structure = nets.spec(net).blocks(model), nets.spec(net).sequence(model)
    structure = {"blocks": structure[0], "sequence": structure[1]}
    assert len(structure["blocks"]) == 2 and structure["sequence"]
    reference, reference_loss = reference_step(model, x, loss_fn)
    traced = trace(model, x)
    for name, plan in plans(traced.graph, structure):
        assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, structure)


class Randomness(nn.Module):
    """Random draws no list could name: a new tensor filled in place, torch.rand on a shape, a functional
    dropout, SDPA's dropout_p and stochastic depth, each feeding a value that gets recomputed."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        noise = x.new_empty(x.shape).uniform_()  # bernoulli_-style: a fresh tensor, written in place
        h = torch.tanh(self.a(x)) * noise
        h = h * (torch.rand(h.shape, device=h.device) > 0.3)
        h = F.dropout(torch.tanh(self.b(h)), 0.4, training=True)
        q = h.view(2, 1, 4, 8)
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).view(8, 8)
        from torchvision.ops import stochastic_depth

        return self.c(stochastic_depth(torch.sin(h), 0.5, "row", training=True))


class InPlace(nn.Module):
    """In-place ops of every kind: modules, F.*(inplace=True), tensor methods, writes to views."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.Hardswish(inplace=True)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.act(self.a(x))
        h = F.relu6(h, inplace=True)
        h = self.bn(h)
        h.add_(1.0)
        h[:, :3].mul_(2.0)
        h.view(-1)[::2].add_(0.5)
        h = h.relu_()
        return F.hardtanh(self.b(h), 0.1, 2.0, inplace=True)


class FunctionalBatchNorm(nn.Module):
    """Running statistics updated by F.batch_norm on buffers: no BatchNorm module to recognise."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x):
        h = F.batch_norm(self.a(x), self.mean, self.var, training=True, momentum=0.3)
        return self.b(torch.tanh(h))


@torch.fx.wrap
def scaled(x, scale):
    return x * scale


class ExpandedBuffer(nn.Module):
    """A buffer expanded from one value (stride 0), given to a call a plan recomputes: its copy as the call
    found it is laid out as ``clone`` lays it out (a copy into its own strides would write one element
    eight times, which PyTorch refuses). ``load_state_dict`` refuses such a buffer too, so ``compare``, which
    loads the model's state into its reference, cannot check it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((), 2.0).expand(8))

    def forward(self, x):
        return self.b(torch.tanh(scaled(self.a(x), self.scale)))


def test_a_recomputed_call_given_an_expanded_buffer_runs_as_plain_pytorch_runs_it():
    torch.manual_seed(0)
    model, x = ExpandedBuffer(), torch.randn(4, 8)
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    traced = trace(model, x)
    graph = traced.graph
    plan = strategies.Plan.from_stages(graph, [strategies.bits(range(len(graph)))])
    assert plan.recomputed >> graph.names.index("scaled") & 1
    execute(traced, plan, x)
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("model_type", [Randomness, InPlace, FunctionalBatchNorm])
def test_side_effects_are_replayed_by_mechanism(model_type):
    torch.manual_seed(0)
    model = model_type().train()
    x = torch.randn(8, 8)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    traced = trace(model, x)
    everything = strategies.Plan.from_stages(traced.graph, [strategies.bits(range(len(traced.graph)))])
    recompute_all = strategies.Plan.from_stages(
        traced.graph, [strategies.bits([v]) for v in range(len(traced.graph))])
    assert everything.recomputed or recompute_all.recomputed
    for plan in (everything, recompute_all, strategies.solve("approx_dp", traced.graph)):
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, difference
    # The program's own stream goes on as plain PyTorch's: the next draw is the same.
    torch.manual_seed(0)
    model(x)
    after_plain = torch.rand(3)
    torch.manual_seed(0)
    execute(traced, everything, x, loss_fn=loss_fn)
    torch.testing.assert_close(torch.rand(3), after_plain, rtol=0, atol=0)


class WritesAfterReads(nn.Module):
    """Writes in place to values another layer read first: a tensor method, an item assignment, a clamp
    under ``no_grad``, an in-place module, an in-place dropout. No reader saves what is written, so plain
    PyTorch's step runs."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(16, 16) for _ in range(5))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        seen = h + 1.0
        h.relu_()
        h = self.b(h)
        doubled = h * 2.0
        h[:, 0] = 0
        total = h.sum(-1, keepdim=True)
        with torch.no_grad():
            h.clamp_(max=1.0)
        h = self.c(h)
        halved = h * 0.5
        h = self.act(h)
        h = self.d(h)
        spread = h.sigmoid()
        h = F.dropout(h, 0.3, training=True, inplace=True)
        return self.e(h) + seen + doubled + total + halved + spread


def test_a_write_after_another_layers_read_writes_a_copy():
    # NOTE [a write after a read]: these writes were refused. Each now writes a clone of its value, and
    # every later call reads the copy; handed the value instead, they read it unwritten (the loss 109% off).
    torch.manual_seed(0)
    model, x = WritesAfterReads().double(), torch.randn(6, 16, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    nodes = {node.name: node for node in traced.module.graph.nodes}
    for write in ("relu_", "assign_item", "clamp_", "act", "dropout"):
        copied = nodes[write].args[0]
        assert copied.target == "clone" and traced.group_of[copied.name] == traced.group_of[write], write
    graph = traced.graph
    for plan in (strategies.Plan.from_stages(graph, [graph.all_nodes]),
                 strategies.Plan.from_stages(graph, [strategies.bits([v]) for v in range(len(graph))]),
                 strategies.solve("approx_dp", graph), strategies.solve("chen_sqrt", graph)):
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, (plan.strategy, difference)
    assert_predicted_on_meta(model.to("meta"), torch.randn(64, 16, device="meta"), loss_fn)


def test_a_write_after_a_read_is_refused_where_a_view_taken_before_reads_it_after():
    class ViewReadAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            part = h[:, :2]
            y = h + 1
            h.relu_()  # the model's ``part`` sees the write; a copy's would not
            return self.b(h) + y + part.sum()

    with pytest.raises(TraceFailure, match=r"in-place write relu_ .*changes the value of Linear .*after add .*read "
                                           r"it, and sum .*reads it after the write through getitem, a view"):
        trace(ViewReadAfter(), torch.randn(2, 4))


class SeveralValues(nn.Module):
    """Layers that make several storages at once, whose backward saves each of them: Q and R, variance and
    mean, singular vectors and values, sorted values and their indices."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))

    def forward(self, x):
        h = torch.tanh(self.layers[0](x))
        q, r = torch.linalg.qr(h.view(-1, 4, 4))
        h = torch.tanh(self.layers[1]((q @ r.tanh()).reshape(x.shape)))
        variance, mean = torch.var_mean(h, -1, keepdim=True)
        h = torch.tanh(self.layers[2]((h - mean) * variance))
        u, s, vh = torch.linalg.svd(h.view(-1, 4, 4) + 3 * torch.eye(4, dtype=h.dtype))
        h = torch.tanh(self.layers[3]((u * s.unsqueeze(-2)).sin().reshape(x.shape) + vh.reshape(x.shape)))
        ordered, _ = h.sort(-1)
        return self.layers[4](ordered)


def test_a_layer_that_makes_several_values_is_recomputed_whole_and_one_that_views_two_is_refused():
    # A recomputation hands each token the storage it was taken from in the forward pass: handed the first
    # output's (the executor's old way), Q's backward read R as Q and var_mean's read the variance as the
    # mean, and the gradients were silently wrong; sort's read its values as indices and failed.
    torch.manual_seed(0)
    model, x = SeveralValues().double(), torch.randn(4, 16, dtype=torch.double)
    traced = trace(model, x)
    graph = traced.graph
    layers = [graph.names.index(name) for name in ("linalg_qr", "var_mean", "linalg_svd", "sort")]
    recompute_all = strategies.Plan.from_stages(graph, [strategies.bits(range(len(graph)))])
    assert all(any(v in reads for reads in graph.profile.backward_reads) for v in layers)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    for plan in (recompute_all, strategies.solve("chen_sqrt", traced.graph),
                 strategies.solve("chen_greedy", traced.graph)):
        assert any(plan.recomputed >> v & 1 for v in layers)
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, difference
    assert all(recompute_all.recomputed >> v & 1 for v in layers)

    class Broadcast(nn.Module):
        def forward(self, x):
            a, b = torch.broadcast_tensors(x.tanh(), x.sum(-1, keepdim=True).exp())
            return a * b

    with pytest.raises(TraceFailure, match=r"broadcast_tensors .*returns \(views of\) the values of tanh .* and "
                                           r"exp .*Take each view in a call of its own \(a\.expand"):
        trace(nn.Sequential(nn.Linear(4, 4), Broadcast()), torch.randn(2, 4))


class Augmented(nn.Module):
    """Augmented assignments: in place where the model writes in place, out of place where the write
    cannot stay in place (a value another layer read first; the input)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        x += 1.0  # the caller's tensor: out of place, as plain fx traces it
        h = self.a(x)
        h += self.b(x)
        h *= 0.5
        h -= torch.tanh(self.c(x))
        h /= 2.0
        seen = h * 2.0  # read by another layer (which saves nothing: the model itself may write h) ...
        h += 1.0  # ... so this write goes out of place
        return self.d(h) + seen


def test_augmented_assignments_write_in_place_where_they_can():
    # NOTE [augmented assignments]: ``h += self.b(x)`` is one IR node with ``self.a``'s output, written in
    # place as the model writes it, not a new buffer; exact under recomputation either way.
    import operator

    torch.manual_seed(0)
    model, x = Augmented(), torch.randn(8, 8)
    traced = trace(model, x)
    targets = {node.name: node.target for node in traced.module.graph.nodes if node.op == "call_function"}
    in_place = [name for name, target in targets.items() if target in (operator.iadd, operator.imul, operator.isub,
                                                                           operator.itruediv)]
    assert len(in_place) == 4 and all(traced.group_of[name] == traced.group_of["a"] for name in in_place)
    assert targets["iadd"] is operator.add and targets["iadd_2"] is operator.add  # the input's, the read value's
    for plan in (strategies.Plan.from_stages(traced.graph, [strategies.bits([v]) for v in range(len(traced.graph))]),
                 strategies.solve("chen_sqrt", traced.graph)):
        loss_fn = lambda out: out.square().sum()  # noqa: E731
        # Each run gets its own input: the model's first line writes the caller's tensor.
        difference = compare(model, x.clone(), loss_fn, lambda: execute(traced, plan, x.clone(), loss_fn=loss_fn))
        assert difference.exact, difference
    # On meta the probe runs the module itself, not a copy: the same program.
    on_meta = trace(Augmented().to("meta"), x.to("meta"))
    assert [n.target for n in on_meta.module.graph.nodes] == [n.target for n in traced.module.graph.nodes]


class GradModeAndState(nn.Module):
    """A forward that writes its own buffers and turns autograd off for part of it: a step counter written
    by a node of its own and read after; an EMA updated under ``no_grad`` from a late value and read by a
    node whose other input is early; a statistic taken under ``no_grad`` and used as a constant."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("center", torch.full((8,), 0.5))

    def forward(self, x):
        self.steps.add_(1)
        h1 = torch.tanh(self.a(x)) * self.steps
        h3 = torch.tanh(self.c(torch.tanh(self.b(h1))))
        with torch.no_grad():
            self.center.mul_(0.5).add_(h3.mean(0), alpha=0.5)
            scale = torch.sigmoid(h3).mean()
        return self.d(torch.sin(h1 * self.center) * scale) + h3


def down_closure(graph, v: int) -> int:
    """The least lower set holding node ``v``: the earliest stage any plan can run ``v`` in."""
    lower, stack = 0, [v]
    while stack:
        u = stack.pop()
        if not lower >> u & 1:
            lower |= 1 << u
            stack += graph.preds[u]
    return lower


def test_grad_mode_and_state_writes_are_replayed_by_mechanism():
    # NOTE [grad mode], NOTE [state the forward writes]: without the first, gradients flow through the
    # no_grad statistic; without the second, the counter is never written (fx ran add_ on the real buffer),
    # and a plan whose first stage ends at the EMA's reader reads the EMA before it is written.
    torch.manual_seed(0)
    model, x = GradModeAndState(), torch.randn(8, 8)
    traced = trace(model, x)
    assert model.steps.item() == 0 and torch.equal(model.center, torch.full((8,), 0.5)), "tracing wrote no buffer"
    graph = traced.graph
    reader = graph.names.index("mul_1")  # h1 * self.center
    assert graph.names.index("mean") in graph.preds[reader]  # the EMA's write read ``mean``
    early = down_closure(graph, graph.names.index("sin"))
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    for plan in (strategies.Plan.from_stages(graph, [strategies.bits([v]) for v in range(len(graph))]),
                 strategies.Plan.from_stages(graph, [early, graph.all_nodes & ~early]),
                 strategies.solve("chen_sqrt", graph), strategies.solve("approx_dp", graph)):
        assert plan.recomputed
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, difference
    trace(GradModeAndState().to("meta"), x.to("meta"))  # on meta the probe runs the module itself


@torch.fx.wrap
def running_rms_norm(x, running, momentum: float):
    """Divides by a running mean square that the call first updates: a layer whose output reads the state
    it writes (fx.wrap keeps it one call, as a user keeps an untraceable function whole)."""
    with torch.no_grad():
        running.mul_(1 - momentum).add_(x.square().mean(), alpha=momentum)
    return x / running.sqrt()


class StateReadAndWritten(nn.Module):
    """Layers whose output depends on the state the same call updates: spectral normalisation's power
    iteration, as a parametrization (``_u``, ``_v``) and in its older form (``weight_u`` by a forward
    pre-hook), and a function given its buffer. A recomputation that started from the state the forward
    left would normalise by another estimate than the forward did."""

    def __init__(self, old_style: bool):
        super().__init__()
        norm = torch.nn.utils.spectral_norm if old_style else torch.nn.utils.parametrizations.spectral_norm
        self.convs = nn.ModuleList(norm(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1)) for i in range(4))
        self.head = norm(nn.Linear(8 * 8 * 8, 1))
        self.register_buffer("running", torch.ones(()))

    def forward(self, x):
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.2)
        return self.head(running_rms_norm(x, self.running, 0.5).flatten(1))


@pytest.mark.parametrize("old_style", [False, True], ids=["parametrization", "pre_hook"])
def test_a_layer_that_reads_the_state_it_writes_is_recomputed_from_the_state_its_forward_found(old_style):
    # NOTE [replaying side effects]: the recomputation starts from a copy of the state as the forward call
    # found it. Started from the state the forward left, the gradients were off by 0.3% to 57%.
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    recomputed = set()
    torch.manual_seed(0)
    model, x = StateReadAndWritten(old_style), torch.randn(4, 3, 8, 8)
    loss_fn(model(x)).backward()  # trained a step: the older form now keeps a non-leaf weight (deepcopy refuses)
    model.zero_grad(set_to_none=True)
    traced = trace(model, x, loss_fn=loss_fn)
    for name in ("approx_dp", "chen_sqrt"):
        plan = strategies.solve(name, traced.graph)
        recomputed |= {traced.graph.names[v] for v in strategies.members(plan.recomputed)}
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, f"{name}: {difference}"
    assert {"convs_0", "convs_1", "convs_2", "head", "running_rms_norm"} <= recomputed


class ListedStatistic(nn.Module):
    """Divides by a running mean square that it first updates, read through a list attribute that holds the
    buffer too (a library's layer keeping its statistics in one place)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.ones(()))
        self.statistics = [self.running]

    def forward(self, x):
        running = self.statistics[0]
        with torch.no_grad():
            running.mul_(0.5).add_(x.square().mean(), alpha=0.5)
        return x / running.sqrt()


ListedStatistic.__module__ = "torch.nn.modules.listed"  # fx keeps a module of torch.nn whole, as one call


def test_state_a_layer_also_holds_as_an_attribute_is_replayed_where_the_layer_reads_it():
    # NOTE [replaying side effects]: the state as found takes the buffer's place in the modules that register
    # it; this layer reads it through its list, which sees it only through ``.data``. Placed only in the
    # registry, the recomputation read the state its forward left and updated it a second time.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ListedStatistic(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    statistic = graph.names.index("_1")
    for stages in ([range(len(graph))], [range(3), range(3, len(graph))]):
        plan = strategies.Plan.from_stages(graph, [strategies.bits(stage) for stage in stages])
        assert plan.recomputed >> statistic & 1
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, difference


class ReverseGradient(torch.autograd.Function):
    """A domain-adversarial gradient reversal: the identity forward, whose own derivative is not its backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class SavingSwish(torch.autograd.Function):
    """A memory-saving swish that saves its sigmoid (timm's and EfficientNet's kind), with a backward made
    to differ from the forward's derivative by a factor, so that a dropped backward shows."""

    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x)
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return 0.5 * grad * y * (1 + x * (1 - y))


class CustomFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        h = SavingSwish.apply(self.a(x))
        h = ReverseGradient.apply(torch.tanh(self.b(h)), 0.3)
        h = checkpoint(self.e, h, use_reentrant=True)  # a Function too
        return self.d(SavingSwish.apply(self.c(h)))


def test_custom_autograd_functions_run_their_own_backward():
    # NOTE [custom autograd functions]: fx traced through apply, dropping the backward (the reversal did not
    # reverse) and, under NOTE [grad mode], every gradient through the swish and the reentrant checkpoint,
    # whose forwards run with grad mode off; each Function is now one call.
    torch.manual_seed(0)
    model, x = CustomFunctions(), torch.randn(8, 8)
    traced = trace(model, x)
    assert sum(name.startswith("saving_swish_apply") for name in traced.graph.names) == 2
    swish = traced.graph.names.index("saving_swish_apply")
    assert traced.graph.profile.saved_extra_bytes[swish] == traced.graph.mem_bytes[swish]  # its sigmoid
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    for plan in (strategies.solve("vanilla", traced.graph),
                 strategies.Plan.from_stages(traced.graph, [strategies.bits([v]) for v in range(len(traced.graph))]),
                 strategies.solve("chen_sqrt", traced.graph), strategies.solve("approx_dp", traced.graph)):
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, (plan.stages, difference)


class SavesEmpty(torch.autograd.Function):
    """Doubles, and saves an empty tensor (as an eval-mode batch norm on the CPU saves its statistics)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.new_empty(0))
        return 2 * x

    @staticmethod
    def backward(ctx, grad):
        (empty,) = ctx.saved_tensors
        return 2 * grad + empty.sum()


class EmptyExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(SavesEmpty.apply(h) + h))  # no backward reads the doubled value


def test_a_layer_that_saves_only_empty_tensors_calls_for_no_recomputation():
    # A stage is recomputed only where a backward reads its values or extras (``called_for``), and its kept
    # inputs are let go otherwise; the executor leaves an empty saved tensor as it is, where making it a
    # token to recompute called for a stage whose inputs were gone.
    torch.manual_seed(0)
    model, x = EmptyExtras(), torch.randn(4, 8)
    traced = trace(model, x)
    graph = traced.graph
    doubled = graph.names.index("saves_empty_apply")
    assert graph.profile.saved_extra_bytes[doubled] == 0
    assert all(doubled not in reads for reads in graph.profile.backward_reads)
    add = graph.succs[doubled][0]
    stages = [strategies.bits([v]) for v in range(len(graph)) if v != doubled]
    stages[stages.index(1 << add)] |= 1 << doubled
    plan = strategies.Plan.from_stages(graph, stages, kept=graph.all_nodes & ~(1 << doubled))
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
    assert difference.exact, difference


class OwnCheckpoints(nn.Module):
    """Blocks the model checkpoints itself, as timm's and Hugging Face's gradient checkpointing do."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2)) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_a_models_own_non_reentrant_checkpoint_is_traced_through():
    # The plan decides what is recomputed: every layer inside the model's checkpoints is an IR node, the
    # traced program runs no checkpoint of its own, and plans that recompute those layers are exact.
    torch.manual_seed(0)
    model, x = OwnCheckpoints(), torch.randn(8, 16)
    traced = assert_exact(model, x, lambda out: out.square().sum())
    assert len(traced.graph) == 12 and "blocks_3_2" in traced.graph.names
    assert "checkpoint" not in traced.module.code


class ReadThenWrite(nn.Module):
    """A buffer added to a value, then written: the layer that read it reads the old value."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        y = torch.tanh(self.a(x)) + self.scale
        self.scale.mul_(0.9)
        return self.b(torch.tanh(y))


class KeyQueue(nn.Module):
    """MoCo's queue of keys: the logits read a copy of (a view of) the keys queued so far (as MoCo reads
    ``self.queue.clone().detach()``), then this batch's keys are written into the queue, and a buffer the
    logits read is updated after them."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 16), nn.Linear(8, 16)
        self.register_buffer("queue", F.normalize(torch.randn(16, 32), dim=0))
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x):
        q = F.normalize(self.q(x), dim=1)
        with torch.no_grad():
            k = F.normalize(self.k(x), dim=1)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue[:, :24].clone()], 1) + self.shift
        with torch.no_grad():
            self.queue[:, :8].copy_(k.T)
            self.shift.add_(0.1)
        return torch.tanh(logits)


def test_a_buffer_read_before_a_write_is_read_as_it_was_and_an_inputs_write_is_refused():
    # NOTE [state the forward writes]: the write runs after every layer that read the buffer before it,
    # and a recomputation of such a layer starts from the buffer as its forward call found it (NOTE
    # [replaying side effects]). Such a model was refused; writing an input after a layer read it still is.
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    for make, x in ((ReadThenWrite, torch.randn(2, 4)), (KeyQueue, torch.randn(8, 8))):
        torch.manual_seed(0)
        model = make()
        traced = trace(model, x, loss_fn=loss_fn)
        graph = traced.graph
        readers = {reader for reader, _ in traced.state_order}
        assert readers and all(graph.profile.recompute_state_bytes[graph.names.index(r)] for r in readers)
        last, recomputed = len(graph) - 1, set()
        for plan in (strategies.solve("chen_sqrt", graph), strategies.solve("approx_dp", graph),
                     strategies.Plan.from_stages(graph, [graph.all_nodes & ~(1 << last), 1 << last])):
            difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
            assert difference.exact, (make.__name__, plan.strategy, difference)
            recomputed |= {graph.names[v] for v in strategies.members(plan.recomputed)}
        assert readers <= recomputed

    class WritesItsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            x.mul_(2.0)
            return y + self.a(x)

    with pytest.raises(TraceFailure, match=r"in-place write mul_ .*changes an input after Linear"):
        trace(WritesItsInput(), torch.randn(2, 4))


def test_an_untraceable_construct_is_named_with_its_module_and_the_usual_way_out():
    class Gate(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    class Selected(nn.Module):  # how many are selected lies in the values, which meta does not hold
        def forward(self, x):
            return x * 2 if (x > 0).nonzero().shape[0] > 3 else x

    model = nn.Sequential(nn.Linear(4, 4), Gate())
    with pytest.raises(TraceFailure, match=r"data-dependent control flow.*module '1' \(Gate\).*x\.sum\(\) > 0"):
        trace(model, torch.randn(2, 4))
    with pytest.raises(TraceFailure, match=r"control flow.*module '1' \(Selected\).*could not size nonzero "
                                           r"\(nonzero in module '1'\) on meta"):
        trace(nn.Sequential(nn.Linear(4, 4), Selected()), torch.randn(2, 4))
    # Traced, but a value read in Python (a cumulative BatchNorm's float(num_batches_tracked)) has no value on meta.
    with pytest.raises(TraceFailure, match=r"BatchNorm2d \(.*'1'\) reads a tensor's value in Python.*momentum"):
        trace(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=None)), torch.randn(2, 3, 4, 4))


class LayerDrop(nn.Module):
    """An older LayerDrop: each layer skipped with probability ``p`` by a draw from Python or NumPy."""

    def __init__(self, draw):
        super().__init__()
        self.layers, self.draw = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), draw

    def forward(self, x):
        for layer in self.layers:
            if self.draw() >= 0.3:
                x = layer(x)
        return x


@pytest.mark.parametrize("draw", [random.random, np.random.random], ids=["random", "numpy"])
def test_a_draw_from_python_or_numpy_in_the_forward_is_refused_naming_the_module(draw):
    # NOTE [random draws on constants]: fx ran the draw once, and every step skipped the same layers.
    with pytest.raises(TraceFailure, match=r"module '1' \(LayerDrop\) draws from Python's random module or NumPy"):
        trace(nn.Sequential(nn.Linear(4, 4), LayerDrop(draw)), torch.randn(2, 4))


class AutocastInside(nn.Module):
    """A forward that runs a block under ``torch.autocast`` itself, then goes back to float32."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(16, 64), nn.Linear(64, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.a(x))
        return self.head(h.float())


def test_autocast_in_the_forward_is_refused_naming_the_call_and_its_module():
    # NOTE [autocast in the forward]: traced, the block ran in float32 under every plan, vanilla included.
    model = nn.Sequential(nn.Linear(16, 16), AutocastInside())
    with pytest.raises(TraceFailure, match=r"Linear \(_1_a in module '1\.a'\) under torch\.autocast\(cpu, "
                                           r"torch\.bfloat16\)"):
        trace(model, torch.randn(8, 16))
    with torch.autocast("cpu", enabled=False):  # a block that turns autocast off casts nothing: traced
        trace(nn.Sequential(nn.Linear(16, 16)), torch.randn(8, 16))


class Features(nn.Module):
    """Three layers whose middle output a perceptual loss wants: kept by a forward hook, kept by the forward
    as an attribute, or returned."""

    def __init__(self, keep: str):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
        self.keep, self.kept = keep, []
        if keep in ("hook", "hook on a traced module"):  # fx calls a leaf (Tanh), and traces through the rest
            hooked = self.layers[1][1] if keep == "hook" else self.layers[1]
            hooked.register_forward_hook(lambda module, inputs, output: self.kept.append(output))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1 and self.keep == "attribute":
                self.feature = x
            elif i == 1 and self.keep == "shape":
                self.width = x.shape[1]
            elif i == 1 and self.keep == "return":
                feature = x
        return (x, feature) if self.keep == "return" else x


def test_a_value_held_outside_the_traced_program_is_refused_naming_it():
    # NOTE [values held outside the program]: the hooked output outlived its plan (chen_sqrt measured 9% above
    # its replay), and fx dropped the attribute assignment, so the traced program never made it.
    x = torch.randn(64, 32)
    with pytest.raises(TraceFailure, match=r"value of Tanh \(.* in module 'layers\.1\.1'\) is still held after a "
                                           r"training step .*forward hook.*Return the value from the forward"):
        trace(Features("hook"), x, loss_fn=lambda out: out.square().mean())
    model = Features("attribute")
    with pytest.raises(TraceFailure, match=r"module 'Features' keeps a value its forward or a hook computes "
                                           r"\(.*\) in attribute 'feature': torch\.fx records no such assignment"):
        trace(model, x)
    assert not hasattr(model, "feature")  # the trace left no fx Proxy on the model
    model = Features("shape")  # a shape kept so is no value: traced as before
    trace(model, x)
    assert not hasattr(model, "width")
    with pytest.raises(TraceFailure, match=r"module 'Features' keeps .* in attribute 'kept'"):
        trace(Features("hook on a traced module"), x)
    # The way out: the loss reads the feature as an output, and the plan holds it as it holds any value.
    model, x = Features("return").to("meta"), x.to("meta")
    loss_fn = lambda out: out[0].square().mean() + out[1].square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", traced.graph)
    assert plan.recomputed
    measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta").peak_bytes
    assert measured == strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    hidden: torch.Tensor


class ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        hidden = self.layers(x)
        return Prediction(hidden * 2, hidden)


def test_an_output_pytree_cannot_see_and_a_sparse_gradient_are_refused_naming_them():
    # Traced, the dataclass's tensors were no outputs: the trace crashed in autograd.grad, and a sparse
    # gradient crashed the storage count; both with raw errors.
    x = torch.randn(8, 16)
    loss_fn = lambda out: out.logits.square().mean()  # noqa: E731
    with pytest.raises(TraceFailure, match=r"ReturnsADataclass returns a Prediction, whose tensors torch's pytree "
                                           r"cannot see.*register_dataclass\(Prediction\)"):
        trace(ReturnsADataclass(), x, loss_fn=loss_fn)
    sparse = nn.Sequential(nn.Embedding(50, 16, sparse=True), nn.Linear(16, 4))
    with pytest.raises(TraceFailure, match=r"backward of Embedding \(.* in module '0'\) makes a sparse_coo "
                                           r"gradient.*set sparse=False"):
        trace(sparse, torch.randint(0, 50, (8, 5)), loss_fn=lambda out: out.square().mean())
    # Registered with pytree, the dataclass is an output like a tuple's, and a plan trains exactly.
    torch.utils._pytree.register_dataclass(Prediction)
    model = ReturnsADataclass().double()
    traced = trace(model, x.double(), loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", traced.graph)
    assert plan.recomputed
    assert compare(model, x.double(), loss_fn, lambda: execute(traced, plan, x.double(), loss_fn=loss_fn)).exact


class OptionalArguments(nn.Module):
    """A Hugging Face-style forward: the input, then arguments the harness never passes, which branch."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x, attention_mask=None, scale: float = 2.0, causal=False, return_dict=True):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if attention_mask is not None:
                x = x * attention_mask
            if causal:
                x = x.tril()
        return {"out": x * scale} if return_dict else x * scale


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x, mask):
        return self.layer(x) * mask


def test_a_forwards_other_arguments_take_their_defaults_and_one_without_is_refused():
    # Traced as proxies, ``attention_mask=None`` ran the masked branch (a TypeError on None) and
    # ``return_dict`` was refused as control flow; a required second input crashed in fx's interpreter.
    x = torch.randn(8, 16, dtype=torch.float64)
    loss_fn = lambda out: out["out"].square().mean()  # noqa: E731
    model = OptionalArguments().double()
    traced = trace(model, x, loss_fn=loss_fn)
    assert not any(n.op == "call_function" and "assert" in str(n.target) for n in traced.module.graph.nodes)
    for name in ("approx_dp", "chen_sqrt"):
        plan = strategies.solve(name, traced.graph)
        assert plan.recomputed
        assert compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn)).exact
    with pytest.raises(TraceFailure, match=r"TwoInputs.forward takes x, mask, and the harness feeds a model one "
                                           r"input: 'mask' has no default.*whose forward takes 'x' alone"):
        trace(TwoInputs(), x)


class SizedByItsInput(nn.Module):
    """Python that computes with the input's sizes, as models outside timm and torchvision do: a pad where
    the side is odd, branches on the device (transformers' experts count tokens so on the CPU) and its name
    handed to Python (``torch.autocast(device_type=x.device.type, enabled=False)``, as timm's), a tensor
    made for the batch, a position buffer cut to the sequence and expanded to the batch (BERT's), a causal
    mask made for the sequence, a loop over chunks, len(), an activation module made in the forward."""

    def __init__(self, width=8, length=32):
        super().__init__()
        self.conv, self.down = nn.Conv2d(3, width, 3, padding=1), nn.Conv2d(width, width, 2, stride=2)
        self.register_buffer("positions", torch.arange(length)[None], persistent=False)
        self.position = nn.Embedding(length, width)
        self.mix, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x = F.relu(self.conv(x))
        batch, _, height, width = x.shape
        if height % 2 == 1:
            x = F.pad(x, (0, width % 2, 0, 1))
        if x.device.type == "cpu" and not x.is_cuda:
            x = x * 2
        x = self.drop(F.relu(self.down(x))).flatten(2).transpose(1, 2)  # (batch, sequence, width)
        sequence = x.size(1)
        x = x + self.position(self.positions[:, :sequence].expand(len(x), -1))
        causal = torch.ones(sequence, sequence, dtype=torch.bool).tril()
        if x.device.type != "meta":  # timm's EfficientViT keeps its attention out of autocast so
            with torch.autocast(device_type=x.device.type, enabled=False):
                scores = self.mix(x) @ x.transpose(1, 2)
        else:
            scores = self.mix(x) @ x.transpose(1, 2)
        scores = scores.masked_fill(~causal, float("-inf"))
        x = self.drop(scores.softmax(-1)) @ x
        parts = [nn.Tanh()(part) for part in x.chunk(2, dim=-1)]
        x = torch.cat(parts, dim=-1)
        pooled = torch.zeros(batch, x.shape[-1], dtype=x.dtype).index_add(0, torch.arange(batch), x.mean(1))
        return self.head(pooled)


def test_python_on_the_inputs_sizes_is_traced_for_the_examples_sizes():
    # NOTE [sizes fixed at the example's]: fx refused the first ``if`` on a size, and, with the sizes numbers,
    # the expanded buffer, the mask and the zeros were made once by the trace and held as constants; traced
    # on meta, the branch on the device was meta's, which the CPU does not take; x.device.type was a proxy,
    # which torch.autocast refused.
    torch.manual_seed(0)
    model, x = SizedByItsInput().double(), torch.randn(3, 3, 9, 9, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    assert not [name for name, _ in traced.module.named_buffers() if name.startswith("_tensor_constant")]
    for name in ("approx_dp", "chen_sqrt", "chen_greedy"):
        plan = strategies.solve(name, traced.graph)
        assert plan.recomputed
        assert compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn)).exact, name
    assert_predicted_on_meta(model.to("meta"), x.to("meta"), loss_fn)


def assert_predicted_on_meta(model, x, loss_fn, within=0.0):
    """On meta, the replay predicts the tracker's peak to the byte (or ``within`` that fraction of it, where a
    caller says why) for vanilla, chen_sqrt and approx_dp (mc)."""
    traced = trace(model, x, loss_fn=loss_fn)
    for name, options in (("vanilla", {}), ("chen_sqrt", {}), ("approx_dp", {"mode": "mc"})):
        plan = strategies.solve(name, traced.graph, **options)
        measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta").peak_bytes
        predicted = strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)
        assert abs(predicted - measured) <= within * measured, (name, predicted, measured)


class AssignsItems(nn.Module):
    """Item assignments on traced values: a slice set to a constant, a permutation written through an index
    (transformers' experts invert their sort so), a part of a fresh tensor set from a layer's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        y[:, 0] = 0
        y = torch.tanh(y)
        order = torch.empty_like(y[:, 0], dtype=torch.long)
        order[torch.arange(len(y) - 1, -1, -1)] = torch.arange(len(y))
        z = torch.zeros_like(y)
        z[:, :4] = self.b(y)[:, :4].sigmoid()
        return y[order] + z


def test_an_item_assignment_is_a_write_in_place():
    # NOTE [augmented assignments]: fx's Proxy refused x[i] = y; it is a write in place, exact and counted.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), AssignsItems(), nn.Tanh(), AssignsItems(), nn.Linear(16, 4)).double()
    x = torch.randn(6, 16, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    for name in ("approx_dp", "chen_sqrt"):
        plan = strategies.solve(name, traced.graph)
        assert plan.recomputed
        assert compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn)).exact, name
    assert_predicted_on_meta(model.to("meta"), x.to("meta"), loss_fn)


HF_CONFIGS = {  # two small layers each; GPT-2's dropout on, Llama's grouped-query attention and rotary embedding
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 97},
    "llama": {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 97},
}


@pytest.mark.parametrize("model_type", HF_CONFIGS)
def test_hugging_face_causal_lms_by_model_type_are_exact_and_predicted(model_type):
    # NOTE [sizes fixed at the example's]: plain fx stopped at the causal mask transformers makes for the
    # sequence (``if q_length == 1 or kv_length == q_length``).
    name, kwargs = f"hf:{model_type}", HF_CONFIGS[model_type]
    torch.manual_seed(0)
    model, tokens, loss_fn = nets.build(name, 2, 16, "cpu", kwargs=kwargs)
    model = model.double()
    traced = trace(model, tokens, loss_fn=loss_fn)
    for strategy in ("approx_dp", "chen_sqrt"):
        plan = strategies.solve(strategy, traced.graph)
        assert plan.recomputed
        assert compare(model, tokens, loss_fn, lambda: execute(traced, plan, tokens, loss_fn=loss_fn)).exact, strategy
    model, tokens, loss_fn = nets.build(name, 4, 32, "meta", kwargs=kwargs)
    assert_predicted_on_meta(model, tokens, loss_fn)
    layers = "model.transformer.h" if model_type == "gpt2" else "model.model.layers"
    assert nets.structure(name, model, kwargs=kwargs)["blocks"] == [f"{layers}.0", f"{layers}.1"]


def test_a_step_in_bfloat16_is_exact_to_its_rounding_and_an_unreplayed_draw_is_not(monkeypatch):
    # NOTE [half precision] in harness/execute/exact.py: a plan's stage order makes a node later than the program
    # does, so autograd sums a value's gradient contributions in another order (GPT-2's tanh GELU reads its
    # input three times), which in bfloat16 moves a gradient by a few units in its last place.
    torch.manual_seed(0)
    model, tokens, loss_fn = nets.build("hf:gpt2", 2, 16, "cpu", "bfloat16", kwargs=HF_CONFIGS["gpt2"])
    switch_on_randomness(model)
    traced = trace(model, tokens, loss_fn=loss_fn)
    plans = [strategies.solve(strategy, traced.graph) for strategy in ("approx_dp", "chen_sqrt")]
    for plan in plans:
        difference = compare(model, tokens, loss_fn, lambda: execute(traced, plan, tokens, loss_fn=loss_fn))
        assert difference.exact and difference.tolerance == tolerance(torch.bfloat16), difference
    # The tolerance still tells a wrong step: a recomputation that draws its dropout masks afresh.
    monkeypatch.setattr(sys.modules["harness.execute.side_effects"], "set_rng_state", lambda state: None)
    for plan in plans:
        difference = compare(model, tokens, loss_fn, lambda: execute(traced, plan, tokens, loss_fn=loss_fn))
        assert difference.worst_gradient > 3 * difference.tolerance, difference


def test_a_mixture_of_experts_in_bfloat16_is_predicted():
    # Mixtral's experts invert their token sort by an item assignment (traced as a write in place) and
    # multiply through torch._grouped_mm, whose meta kernel sizes half precision (in float32 the refusal
    # names it).
    kwargs = {**HF_CONFIGS["llama"], "num_local_experts": 4, "num_experts_per_tok": 2}
    model, tokens, loss_fn = nets.build("hf:mixtral", 4, 32, "meta", "bfloat16", kwargs=kwargs)
    # Not to the byte: vanilla's replay is 4,096 B (0.4%) above the tracker here, bytes not yet accounted for
    # (every other model of this file is predicted exactly).
    assert_predicted_on_meta(model, tokens, loss_fn, within=0.01)


def test_unknown_names_list_the_near_matches():
    with pytest.raises(KeyError, match="near matches: convnext_tiny"):
        nets.spec("torchvision:convnext_tiyn")
    with pytest.raises(KeyError, match="near matches: vit_small_patch16_224"):
        nets.spec("timm:vit_smal_patch16_224")
    with pytest.raises(KeyError, match="no causal language model in transformers .*near matches: gpt2"):
        nets.spec("hf:gtp2")
    with pytest.raises(KeyError, match="valid sources: torchvision, timm, module, hf"):
        nets.spec("hub:resnet50")
    with pytest.raises(KeyError, match="other inputs than an image batch"):
        nets.spec("torchvision:fasterrcnn_resnet50_fpn")
    with pytest.raises(ValueError, match="valid: kwargs, input"):
        nets.spec("torchvision:resnet18", colour="blue")


def test_a_users_factory_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        def build(width=4):
            return nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(width, 5))

        def not_a_model():
            return "a string"
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, x, loss_fn = nets.build("module:my_models:build", 2, 16, "cpu", kwargs={"width": 6})
    assert model[0].out_channels == 6 and x.shape == (2, 3, 16, 16)
    assert_exact(model, x, loss_fn, ("approx_dp",))
    with pytest.raises(TypeError, match="returned a str, not an nn.Module"):
        nets.build("module:my_models:not_a_model", 2, 16, "cpu")
    with pytest.raises(KeyError, match="cannot import it"):
        nets.spec("module:no_such_package.models:build")
    with pytest.raises(ValueError, match="PACKAGE.MODULE:FACTORY"):
        nets.spec("module:my_models")
    sys.modules.pop("my_models", None)


def test_timm_models_by_name_never_pretrained():
    model, x, loss_fn = nets.build("timm:resnet10t", 2, 32, "cpu")
    assert x.shape == (2, 3, 32, 32) and nets.spec("timm:vit_small_patch16_224").image_size == 224
    assert_exact(model, x, loss_fn, ("approx_dp",))


def test_the_zoo_has_two_transformers():
    vit, gpt2 = nets.spec("vit_b_16"), nets.spec("gpt2")
    assert (vit.batch_size, vit.image_size, gpt2.batch_size, gpt2.image_size) == (64, 224, 8, 1024)
    model, tokens, loss_fn = nets.build("gpt2")
    assert tokens.shape == (8, 1024) and tokens.dtype == torch.long
    assert model.lm_head.weight is model.embed.wte.weight  # tied
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small
    assert len(nets.structure("gpt2", model)["blocks"]) == 12 and len(nets.structure("vit_b_16", nets.build(
        "vit_b_16")[0])["blocks"]) == 12


def test_a_recomputation_frees_what_its_rerun_saved():
    """A layer rerun to collect what it saves (MHA's attention weights, softmax outputs) must leave nothing
    behind: a saved output holds its own grad_fn, a cycle that once kept every rerun alive to the step's
    end (ViT-B/16 measured 4x its prediction)."""
    from harness.measure import measure
    from harness.run import fixed_bytes

    model, x, loss_fn = nets.build("vit_b_16", 8, None, "meta")
    traced = trace(model, x)
    plan = strategies.solve("approx_dp", traced.graph, mode="mc")
    predicted = strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)
    measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta", 0, 0).peak_bytes
    assert measured == predicted


class UntracedDraws(nn.Module):
    """Draws on no traced value, which fx ran once while it traced and kept as constants: a permutation of
    the features, noise of a fixed shape made with no device named, and a mask (from the model's own
    generator, where it has one)."""

    def __init__(self, own_generator: bool = True):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(1) if own_generator else None

    def forward(self, x):
        h = torch.tanh(self.a(x))[:, torch.randperm(8)]
        h = torch.tanh(self.b(h + 0.1 * torch.randn(8)))
        return self.c(h * (torch.rand(8, generator=self.generator) > 0.5))


def test_draws_on_no_traced_value_are_drawn_every_step_and_replayed():
    # NOTE [random draws on constants] in harness/tracing/tracer.py: fx kept one permutation and one noise for every
    # step (wrong under every plan, vanilla included), and a recomputation drew the mask again from the
    # model's generator (NOTE [replaying side effects]).
    torch.manual_seed(0)
    model, x = UntracedDraws().train(), torch.randn(8, 8)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    assert {"randperm", "randn", "rand"} <= traced.random_nodes
    every_node = strategies.Plan.from_stages(traced.graph, [strategies.bits([v]) for v in range(len(traced.graph))])
    for plan in (strategies.solve("vanilla", traced.graph), every_node, strategies.solve("chen_sqrt", traced.graph)):
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, (plan.stages, difference)
    # The model's generator goes on as in plain PyTorch, recomputations or not.
    start = model.generator.get_state()
    model(x)
    after_plain = model.generator.get_state()
    model.generator.set_state(start)
    execute(traced, every_node, x, loss_fn=loss_fn)
    assert torch.equal(model.generator.get_state(), after_plain)
    # On meta, the noise made with no device named is made on meta, and the step is predicted to the byte.
    meta_model = UntracedDraws().to("meta")
    meta_x = x.to("meta")
    meta_traced = trace(meta_model, meta_x, loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", meta_traced.graph)
    measured = measure(lambda: execute(meta_traced, plan, meta_x, loss_fn=loss_fn), meta_model, (meta_x,), "meta")
    predicted = strategies.simulate(meta_traced.graph, plan).peak_bytes + fixed_bytes(meta_model, meta_x)
    assert measured.peak_bytes == predicted


def test_draws_keep_program_order_when_stages_reorder_the_forward():
    """An auxiliary head (GoogLeNet's, Inception's) draws its dropout mask before the main head does; a plan
    that puts the auxiliary head in a later stage must not make the main head draw first."""

    class AuxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.aux, self.main = (nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            h = torch.tanh(self.a(x))
            aux = self.aux(F.dropout(h, 0.5))
            main = self.main(F.dropout(torch.tanh(self.b(h)), 0.5))
            return main, aux

    torch.manual_seed(0)
    model = AuxHead().train()
    x = torch.randn(4, 8)
    loss_fn = lambda out: out[0].square().sum()  # noqa: E731 (the auxiliary output is not trained here)
    traced = trace(model, x)
    names = traced.graph.names
    aux = strategies.bits(v for v, name in enumerate(names) if "aux" in name or name == "dropout")
    rest = traced.graph.all_nodes & ~aux
    plan = strategies.Plan.from_stages(traced.graph, [rest, aux])
    assert {"dropout", "dropout_1"} <= traced.random_nodes
    difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
    assert difference.exact, difference


class TwoViews(nn.Module):
    """One encoder with a BatchNorm on two views of a batch, and a stop-gradient (SimSiam)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 32))
        self.pred = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 32))

    def forward(self, x):
        z1, z2 = self.enc(x), self.enc(x.flip(0))
        p1, p2 = self.pred(z1), self.pred(z2)
        return -(F.cosine_similarity(p1, z2.detach()).mean() + F.cosine_similarity(p2, z1.detach()).mean()) / 2


def test_a_layer_called_twice_updates_its_state_in_program_order_whatever_the_stages():
    # A plan whose first stage holds the second view's encoder ran its BatchNorm first: the running
    # statistics took the views in the other order (approx_dp chose such stages here). The executor and the
    # replay both run a call that uses a buffer after every earlier call that uses it.
    torch.manual_seed(0)
    model, x = TwoViews().double(), torch.randn(8, 32, dtype=torch.double)
    loss_fn = lambda out: out  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    names = graph.names
    second_view = graph.ancestor_mask[names.index("enc_7")]
    assert names.index("enc_1") < names.index("enc_5") and not second_view >> names.index("enc_1") & 1
    first, second = (set(graph.profile.shared_state[names.index(name)]) for name in ("enc_1", "enc_5"))
    assert "enc.1.running_mean" in first & second
    plans = [strategies.Plan.from_stages(graph, [second_view, graph.all_nodes & ~second_view]),
             strategies.solve("approx_dp", graph)]
    for plan in plans:
        difference = compare(model, x, loss_fn, lambda: execute(traced, plan, x, loss_fn=loss_fn))
        assert difference.exact, difference
        measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "cpu").peak_bytes
        predicted = strategies.simulate(graph, plan).peak_bytes + fixed_bytes(model, x)
        assert predicted == measured  # the model returns its loss, which the step holds to its end


def test_the_loss_buffers_are_counted():
    """A language model's loss holds a log-softmax over the vocabulary and its gradient: traced with its
    loss, the graph carries them (``loss_bytes``) and the prediction meets the measurement; without, the
    prediction falls short."""
    from harness.measure import measure
    from harness.run import fixed_bytes

    model, tokens, loss_fn = nets.build("gpt2")  # on meta, at its size: the loss is the step's peak
    traced = trace(model, tokens, loss_fn=loss_fn)
    logits = 8 * 1024 * 50257 * 4
    assert traced.graph.profile.loss_bytes >= 2 * logits  # the log-softmax and its gradient at least
    # The same graph without the loss's buffers. (Traced without its loss, a graph also records the
    # gradients of the default sum loss, whose backward copies an expanded gradient the real one does not.)
    blind = traced.graph.replace(loss_bytes=0)
    for name, options in (("vanilla", {}), ("approx_dp", {"mode": "mc"})):
        plan = strategies.solve(name, traced.graph, **options)
        measured = measure(lambda: execute(traced, plan, tokens, loss_fn=loss_fn), model, (tokens,), "meta", 0,
                           0).peak_bytes
        predicted = strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, tokens)
        assert measured == predicted, (name, measured, predicted)
        # Without them the prediction misses by more than the tolerance the graph with them meets.
        assert strategies.simulate(blind, plan).peak_bytes + fixed_bytes(model, tokens) < 0.99 * measured


def test_coverage_runs_a_source_in_bfloat16_and_keeps_float32_rows_apart(tmp_path):
    from harness.bench import coverage

    names = coverage.catalogue()
    assert coverage.select(names, "hf:") == [f"hf:{t}" for t in coverage.HF_MODEL_TYPES]
    assert coverage.select(names, "hf:gpt2,smp:") == ["hf:gpt2", *(n for n in names if n.startswith("smp:"))]
    assert coverage.select(names, "timm:") == [f"timm:{name}" for name in coverage.TIMM_MODELS]
    for bad in ("hf:gpt3", "module:"):
        with pytest.raises(SystemExit, match=f"not in the catalogue: \\['{bad}'\\].*hf:"):
            coverage.select(names, bad)
    with pytest.raises(ValueError, match="bfloat16"):
        coverage.main([str(tmp_path / "cov"), "--models", "hf:gpt2", "--dtype", "half"])
    coverage.main([str(tmp_path / "cov"), "--models", "hf:gpt2", "--dtype", "bfloat16"])
    row = json.loads((tmp_path / "cov_rows" / "hf__gpt2.json").read_text())
    assert row["dtype"] == "bfloat16" and row["exact"] and row["reduction"] > 0.5, row
    assert row["worst_gradient"] <= tolerance(torch.bfloat16)
    markdown = (tmp_path / "cov.md").read_text()
    assert "; bfloat16; " in markdown.splitlines()[0] and "<= 0.0625 (bfloat16)" in markdown
    # A run resumes past a row of its dtype, and measures again a row of another.
    written = (tmp_path / "cov_rows" / "hf__gpt2.json").stat().st_mtime_ns
    coverage.main([str(tmp_path / "cov"), "--models", "hf:gpt2", "--dtype", "bfloat16"])
    assert (tmp_path / "cov_rows" / "hf__gpt2.json").stat().st_mtime_ns == written
    coverage.main([str(tmp_path / "cov"), "--models", "hf:gpt2"])
    row = json.loads((tmp_path / "cov_rows" / "hf__gpt2.json").read_text())
    assert row["dtype"] == "float32" and row["exact"] and row["worst_gradient"] <= tolerance(torch.float32), row
    assert "<= 0.0001 (float32)" in (tmp_path / "cov.md").read_text()
