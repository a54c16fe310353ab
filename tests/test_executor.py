"""Exactness: under every plan, the loss, every gradient and the BatchNorm statistics equal plain PyTorch's."""

import copy

import pytest
import torch
from torch import nn

import strategies
from harness.execute import execute, peers, recorded_recomputations
from harness.tracing.trace import trace
from harness.zoo import nets
from strategies import Plan, bits

SMALL = {"unet": (1, 188)}  # net -> (batch, side) where 2 x 64 x 64 does not fit the net


class SkipToOutput(nn.Module):
    """Convolution, BatchNorm, ReLU and dropout layers, each with a skip connection to the output."""

    def __init__(self, width=4, depth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(0.5))
            for _ in range(depth))
        self.head = nn.Linear(width * (depth + 1), 3)

    def forward(self, x):
        x = self.stem(x)
        outputs = [x]
        for layer in self.layers:
            x = layer(x)
            outputs.append(x)
        return self.head(torch.cat(outputs, dim=1).mean(dim=(2, 3)))


def quarter_plan(graph) -> Plan:
    """Four stages along the node order, canonical cache: recomputes most nodes, whatever the net."""
    n = len(graph)
    cuts = [round(i * n / 4) for i in range(5)]
    return Plan.from_stages(graph, [bits(range(cuts[i], cuts[i + 1])) for i in range(4) if cuts[i] < cuts[i + 1]])


def plans(graph, structure):
    """Every strategy's plan at its default budget (peers get the net's layout), and a recomputing one; a
    peer that does not apply to the net (checkpoint_sequential without a chain) yields nothing."""
    for name in strategies.available():
        if name == "ilp_optimal":  # predicted only: execute refuses its schedules (tests/test_ilp.py)
            continue
        if name in ("optimal", "brute_force"):  # a search of minutes on a zoo net, or of every plan of a small
            continue                              # graph; optimal's plans run in tests/test_optimal.py
        if name == "torch_compile_budget":  # checked in float64 (tests/test_peers.py): its decompositions round
            continue                        # differently in float32, which small-batch BatchNorm amplifies
        if name == "swap":  # every value swapped, at once and on a recomputation plan
            swapped = strategies.solve(name, graph, min_bytes=0)
            assert swapped.swapped, "swap must swap something on a zoo net"
            yield name, swapped
            yield "swap+approx_dp", strategies.solve(name, graph, min_bytes=0, base="approx_dp")
            continue
        try:
            yield name, strategies.solve(name, graph, **peers.zoo_options(name, structure))
        except strategies.Inapplicable:
            if name == "torch_checkpoint_sequential":
                assert not structure["sequence"], f"{name} does not apply though the net has a sequence"
            else:  # the transformer peers on a net without attention, or whose blocks hold no linear layer
                assert name in ("megatron_selective", "sac_ops"), f"{name} does not apply"
    yield "four_stages", quarter_plan(graph)


def reference_step(model, x, loss_fn):
    reference = copy.deepcopy(model)
    torch.manual_seed(0)
    loss = loss_fn(reference(x))
    loss.backward()
    return reference, loss.detach()


def assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, structure):
    state = copy.deepcopy(model.state_dict())
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    if plan.runner is not None:  # a PyTorch peer: the model under torch.utils.checkpoint
        loss = peers.step(plan, model, structure, x, loss_fn)()
    else:
        loss = execute(traced, plan, x, loss_fn=loss_fn)
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        elif not torch.equal(p.grad, q.grad):  # equal first: assert_close takes seconds on VGG's 100M weights
            # Float32 tolerance at the gradient's scale: a plan's stage order changes the order in which
            # autograd sums the gradient contributions of a value read by several layers.
            scale = q.grad.abs().max().item()
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, r, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")  # updated exactly once
    model.load_state_dict(state)


@pytest.mark.parametrize("net", nets.PAPER_NETS)  # the transformers: tests/test_any_model.py, made smaller
def test_every_plan_matches_plain_pytorch_on_the_zoo(net):
    batch, side = SMALL.get(net, (2, 64))
    torch.manual_seed(0)
    model, x, loss_fn = nets.build(net, batch, side, device="cpu")
    reference, reference_loss = reference_step(model, x, loss_fn)
    traced = trace(model, x)
    structure = nets.structure(net, model)
    assert structure["blocks"], f"{net}: the zoo lists no blocks"
    assert structure["sequence"] or net == "unet", f"{net}: the zoo gives no sequence"
    for name, plan in plans(traced.graph, structure):
        assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, structure)


def test_dropout_masks_and_skips_to_the_output():
    torch.manual_seed(0)
    model = SkipToOutput().train()
    x = torch.randn(2, 3, 8, 8)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    reference, reference_loss = reference_step(model, x, loss_fn)
    traced = trace(model, x)
    recomputing = quarter_plan(traced.graph)
    assert recomputing.recomputed, "the plan must recompute something, dropout layers included"
    structure = {"blocks": [f"layers.{i}" for i in range(len(model.layers))], "sequence": []}  # skips: no chain
    for name, plan in plans(traced.graph, structure):
        assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, structure)
    # Without replaying the RNG, recomputed dropout would draw new masks: the check above would fail.
    assert any(traced.graph.kinds[v] == "dropout" for v in strategies.members(recomputing.recomputed))


def test_default_loss_is_the_sum_of_the_output():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    x = torch.randn(2, 4)
    traced = trace(model, x)
    loss = execute(traced, strategies.solve("vanilla", traced.graph), x)
    torch.testing.assert_close(loss, model(x).sum().detach())


@pytest.mark.parametrize("strategy", ["vanilla", "approx_dp", "swap"])
def test_a_failed_step_leaves_nothing_alive(strategy):
    """A step that fails in its backward (a CUDA OOM, say) must not keep its graph's saved tensors: the
    next cell of a sweep would start on a full device."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = SkipToOutput().train()
    x = torch.randn(2, 3, 8, 8)
    traced = trace(model, x)
    plan = strategies.solve(strategy, traced.graph, **({"min_bytes": 1} if strategy == "swap" else {}))
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
             for layer in model.modules() if isinstance(layer, (nn.Conv2d, nn.BatchNorm2d, nn.ReLU))]

    class Failing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out):
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.cuda.OutOfMemoryError("planted")

    # Fails at the loss (before any recomputation), or at the stem (after every recomputation).
    failing_stem = model.stem.register_forward_hook(lambda module, args, out: Failing.apply(out))
    with pytest.raises(torch.cuda.OutOfMemoryError, match="planted"):
        execute(traced, plan, x, loss_fn=lambda out: out.sum())
    failing_stem.remove()
    with pytest.raises(torch.cuda.OutOfMemoryError, match="planted"):
        execute(traced, plan, x, loss_fn=lambda out: Failing.apply(out).sum())
    for hook in hooks:
        hook.remove()
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)


def test_a_traced_model_that_is_gone_is_not_kept_by_the_executor():
    """What the executor keeps across a traced module's steps (its modules by name, its generators) goes with
    it: a sweep that runs cell after cell in one process would otherwise keep every model's weights."""
    import gc
    import weakref

    model = SkipToOutput().train()
    x = torch.randn(2, 3, 8, 8)
    traced = trace(model, x)
    execute(traced, strategies.solve("chen_sqrt", traced.graph), x)
    gone = weakref.ref(traced.module), weakref.ref(model.stem.weight)
    del model, traced
    gc.collect()
    assert all(ref() is None for ref in gone)


class TwoHeads(nn.Module):
    """A main head, and an auxiliary one the loss leaves out (an Inception's auxiliary logits at weight 0)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.main = nn.Linear(16, 64), nn.Linear(64, 8)
        self.aux = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.main(h), self.aux(h)


@pytest.mark.parametrize("strategy", ["vanilla", "chen_sqrt"])
def test_what_no_backward_reached_goes_with_the_step(strategy):
    """The aux head's ReLU saves its output, which the hook's token holds: a cycle through C++ that only a
    backward breaks, and no backward reaches that head. Each step kept it, a leak a timed run adds up."""
    import gc
    import weakref

    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(32, 16)
    loss_fn = lambda out: out[0].square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve(strategy, traced.graph)
    outputs = []
    hook = model.aux[1].register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    for _ in range(2):
        execute(traced, plan, x, loss_fn=loss_fn)
    hook.remove()
    gc.collect()
    assert outputs and all(ref() is None for ref in outputs)


@pytest.mark.parametrize("strategy", ["vanilla", "chen_sqrt"])
def test_what_no_gradient_reaches_goes_at_the_loss(strategy):
    """What the aux head saved (its ReLU's output) is gone when the backward pass starts, as in plain
    PyTorch, where the head's autograd graph dies with the outputs; a loss that reads the aux head, which
    the traced one did not, is refused where its backward first reads what the head saved."""
    import weakref

    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(32, 16)
    loss_fn = lambda out: out[0].square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve(strategy, traced.graph)
    outputs, alive = [], []
    hook = model.aux[1].register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out)))
    model.main.weight.register_hook(lambda grad: alive.append(outputs[-1]() is not None))
    execute(traced, plan, x, loss_fn=loss_fn)
    hook.remove()
    assert alive == [False]
    with pytest.raises(RuntimeError, match="trace with the loss the step runs"):
        execute(traced, plan, x, loss_fn=lambda out: out[0].square().mean() + out[1].square().mean())


def test_a_recomputation_holds_only_what_the_backward_reads():
    """A recomputed value no backward reads (ResNet's downsampling branch, read only by an addition) goes
    after its last use in the stage, as the simulator frees it, not at the stage's end; a recomputed
    BatchNorm's copies of its running statistics (8 bytes above the prediction before the replay counted
    them, ``Profile.recompute_state_bytes``) are counted."""
    from harness.measure import measure
    from harness.run import fixed_bytes

    model, x, loss_fn = nets.build("resnet50", 8, 224, "meta")
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve("chen_sqrt", traced.graph)
    predicted = strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)
    measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta", 0, 0).peak_bytes
    assert measured == predicted, (measured, predicted)


class ClassifierHead(nn.Module):
    """A body with dropout and a batch norm, and a head whose backward reads only the body's output. (No bias
    on the linear whose backward recomputes: the replay makes a bias's gradient with its weight's at that
    backward's peak, the step after it, a known gap of the bias's size.)"""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.5), nn.BatchNorm1d(64),
                                  nn.Linear(64, 32, bias=False), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def test_what_a_plan_needs_is_found_at_its_first_step_and_each_step_recomputes_what_its_backward_reads():
    """The order of the calls and each recomputation's schedule are made once per trace and plan (NOTE [what a
    call needs, found once] in harness/execute/step.py), and a recomputation's by what the step's tokens read: a
    later step whose loss reads the head's output recomputes it too, and both steps are plain PyTorch's."""
    torch.manual_seed(0)
    model, x = ClassifierHead().train(), torch.randn(8, 16)
    traced = trace(model, x)
    graph = traced.graph
    plan = Plan.from_stages(graph, [graph.all_nodes], kept=1 << graph.names.index("body_5"))
    recomputed = []
    for loss_fn in (lambda out: out.sum() * 2, lambda out: out.square().sum(), lambda out: out.sum() * 2):
        reference, reference_loss = reference_step(model, x, loss_fn)
        with recorded_recomputations() as stages:
            assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, {})
        recomputed.append(stages[-1])
    assert len(traced.layouts) == 1
    (layout,) = traced.layouts.values()
    assert len(layout.recomputations) == 2  # the second step's wanted the head's value; the third is the first's
    assert "head" not in recomputed[0] and "head" in recomputed[1] and recomputed[2] == recomputed[0]


def test_a_recomputation_makes_only_what_the_rest_of_the_backward_reads():
    # One stage, the tanh kept: the head's backward, the tanh's and the second linear's value are not read
    # again by the time the first backward that needs a discarded value runs (the second linear's, of the
    # batch norm). Rerunning the whole stage made the head's logits and that linear's output again for
    # nothing (a language model's logits over its vocabulary), as the executor did before NOTE [what a
    # recomputation makes] in strategies/replay.py.
    from harness.measure import measure
    from harness.run import fixed_bytes
    from strategies.simulate import step_flops

    torch.manual_seed(0)
    model, x = ClassifierHead().train(), torch.randn(8, 16)
    loss_fn = lambda out: out.sum() * 2  # noqa: E731  (reads no output: nothing recomputed for the loss)
    reference, reference_loss = reference_step(model, x, loss_fn)
    traced = trace(model, x)
    graph = traced.graph
    tanh = graph.names.index("body_5")
    plan = Plan.from_stages(graph, [graph.all_nodes], kept=1 << tanh)
    calls = []
    for name in ("body.0", "body.4", "head"):
        model.get_submodule(name).register_forward_hook(lambda *_, name=name: calls.append(name))
    assert_step_matches(model, x, loss_fn, reference, reference_loss, plan, traced, {})
    assert calls == ["body.0", "body.4", "head", "body.0"], calls  # the body's start again, up to the batch norm
    unmade = bits(graph.names.index(name) for name in ("body_4", "head"))
    assert strategies.simulate(graph, plan).overhead_cost == graph.time(plan.recomputed & ~unmade)
    # The replay counts the same computations, and so the same memory, on meta.
    model, x = ClassifierHead().train().to("meta"), x.to("meta")
    traced = trace(model, x)
    graph = traced.graph
    plan, vanilla = Plan.from_stages(graph, [graph.all_nodes], kept=1 << tanh), strategies.solve("vanilla", graph)
    ran = {name: measure(lambda: execute(traced, p, x, loss_fn=loss_fn), model, (x,), "meta")
           for name, p in [("plan", plan), ("vanilla", vanilla)]}
    assert ran["plan"].peak_bytes == strategies.simulate(graph, plan).peak_bytes + fixed_bytes(model, x)
    assert (ran["plan"].step_flops - ran["vanilla"].step_flops
            == step_flops(graph, plan) - step_flops(graph, vanilla) > 0)
