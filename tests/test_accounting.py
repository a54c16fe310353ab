"""One accounting: the simulator's replay is the step the executor runs, byte for byte on meta."""

import functools
import importlib
import itertools
import random
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import strategies
from harness.execute import peers
from harness.zoo import nets
from strategies import schedule
from strategies.replay import Buffer, peak_of, timeline
from strategies.schedule_replay import schedule_timeline
from strategies.simulate import step_flops
from harness.execute import execute
from harness.measure import MemoryTracker, measure
from harness.run import fixed_bytes
from harness.tracing.probe import non_leaf_attributes
from harness.tracing.trace import trace
from test_any_model import WritesAfterReads

side_effects = importlib.import_module("harness.execute.side_effects")  # where the executor calls each node
measure_module = importlib.import_module("harness.measure")

CORE = [("vanilla", {}), ("liveness_only", {}), ("chen_sqrt", {}), ("chen_greedy", {}),
        ("approx_dp", {"mode": "tc"}), ("approx_dp", {"mode": "mc"})]
# net -> (batch, side or sequence); others at 2 x 64 x 64
SIZES = {"unet": (1, 188), "pspnet": (1, 128), "vit_b_16": (2, 224), "gpt2": (2, 256)}


def built(net):
    batch, side = SIZES.get(net, (2, 64))
    model, x, loss_fn = nets.build(net, batch, side, device="meta")
    return model, x, loss_fn, trace(model, x, loss_fn=loss_fn)


def as_schedule_peak(graph, plan, told=True):
    """The peak of ``plan`` written as a Checkmate schedule, replayed as ilp_optimal's schedules are; ``told``:
    given the values the plan discards, which a schedule cannot tell from kept ones (NOTE [a schedule's
    replay])."""
    as_schedule = schedule.from_plan(graph, plan, loss_reads_outputs=False)
    discarded = graph.all_nodes & ~plan.kept if told else None
    return peak_of(schedule_timeline(graph, *as_schedule, discarded=discarded))


def measured_and_predicted(model, x, loss_fn, traced, plan):
    measured = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta").peak_bytes
    return measured, strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)


class TwoReaders(nn.Module):
    """A value read by two layers, whose gradients the autograd engine sums."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(256, 256)

    def forward(self, x):
        y = self.linear(x)
        return y.exp() + y.sin()


def test_the_tracker_sums_gradients_in_place_as_the_device_does():
    # Under a dispatch mode the engine sums out of place: one gradient more than the device holds.
    model, x = TwoReaders().to("meta"), torch.empty(512, 256, device="meta")
    traced = trace(model, x)
    plan = strategies.solve("vanilla", traced.graph)
    measured, predicted = measured_and_predicted(model, x, None, traced, plan)
    assert measured == predicted


class FrozenBaseAdapters(nn.Module):
    """Frozen layers with trainable low-rank adapters: ``tanh(base(x) + x @ a @ b)``; no backward reads
    the sum's operands."""

    def __init__(self, width=32, rank=4):
        super().__init__()
        self.base = nn.ModuleList([nn.Linear(width, width).requires_grad_(False) for _ in range(6)])
        self.a = nn.ParameterList([nn.Parameter(torch.randn(width, rank)) for _ in range(6)])
        self.b = nn.ParameterList([nn.Parameter(torch.randn(rank, width)) for _ in range(6)])

    def forward(self, x):
        for base, a, b in zip(self.base, self.a, self.b):
            x = torch.tanh(base(x) + x @ a @ b)
        return x.mean(1)


@pytest.mark.parametrize("name, options", [("chen_sqrt", {}), ("approx_dp", {"mode": "mc"})])
def test_a_recomputed_addition_is_counted_as_the_program_makes_it(name, options):
    # The recomputation runs in the backward pass with grad mode off, as the engine's gradient sums do;
    # taken for one, the sum was counted after its operands went, and the step measured 2% below the replay.
    model, x = FrozenBaseAdapters().to("meta"), torch.empty(4, 16, 32, device="meta")
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve(name, traced.graph, **options)
    assert plan.recomputed
    measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
    assert measured == predicted, plan.stages


class WideHead(nn.Module):
    """An output far larger than the rest, so that what the loss holds makes the step's peak."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(16, 32), nn.Linear(32, 1024)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)))


LOSSES = {  # name -> (loss, whether its backward reads the output)
    "sum": (nets.sum_loss, False),  # hands the output an expanded view of its seed: no new buffer
    "squared": (lambda out: out.square().mean(), True),
    "mse": (lambda out: nn.functional.mse_loss(out, torch.zeros_like(out)), True),
    "exp": (lambda out: out.exp().sum(), False),  # saves its result, a buffer of the loss's own
    "classification": (lambda out: nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long,
                                                                                 device=out.device)), False),
}


@pytest.mark.parametrize("loss", LOSSES)
def test_the_replay_holds_what_the_loss_holds(loss):
    # NOTE [the loss] in harness/tracing/backward_profile.py: the outputs stay until the loss has read them, an
    # output the loss's backward reads stays (or comes back) until that backward is done, and each output's gradient
    # is what the loss really hands it. Kusumoto et al.'s model (each output handed a gradient its own size,
    # nothing read) missed vanilla by +14% on the sum, -19% on the squared error, -31% on mse_loss.
    loss_fn, reads = LOSSES[loss]
    model, x = WideHead().to("meta"), torch.empty(256, 16, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    out = graph.names.index("c")
    assert graph.outputs == (out,) and graph.profile.loss_reads == ((out,) if reads else ())
    assert (graph.profile.loss_grad_bytes[out] == 0) == (loss == "sum")
    last = graph.all_nodes & ~(1 << out)
    plans = [strategies.solve("vanilla", graph),
             strategies.Plan.from_stages(graph, [last, 1 << out], kept=last),  # the output alone is recomputed
             strategies.Plan.from_stages(graph, [1 << v for v in range(len(graph))])]  # and every value kept
    for plan in plans:
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages
        assert as_schedule_peak(graph, plan) == strategies.simulate(graph, plan).peak_bytes


class ReturnsItsHidden(nn.Module):
    """Returns a value a later layer reads too: its gradient is the loss's plus the layer's."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 512), nn.Linear(512, 512)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"hidden": h, "out": self.b(h)}


def test_a_gradient_summed_onto_a_view_of_the_seed_is_a_new_buffer():
    # A sum hands the hidden value a view of its seed; the engine cannot add the layer's contribution into
    # that, so it adds the view into the contribution, which becomes the gradient. Summed "in place"
    # into the view, the replay kept no buffer for it: 9% short.
    model, x = ReturnsItsHidden().to("meta"), torch.empty(128, 16, device="meta")
    traced = trace(model, x)
    hidden = traced.graph.names.index("relu")
    assert hidden in traced.graph.outputs and traced.graph.succs[hidden]
    for plan in (strategies.solve("vanilla", traced.graph), strategies.solve("chen_sqrt", traced.graph)):
        measured, predicted = measured_and_predicted(model, x, None, traced, plan)
        assert measured == predicted, plan.stages


class ScaledProduct(nn.Module):
    """A product with a broadcast scalar, whose backward makes the whole product before it sums it down to
    the scalar's gradient: more than the gradients the layer hands on."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 1024), nn.Linear(1024, 1), nn.Linear(1024, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(h * torch.sigmoid(self.b(h)).mean())


def test_a_layers_backward_is_replayed_at_its_measured_peak_above_what_it_hands_on():
    # NOTE [a layer's backward peak] in strategies/replay_steps.py. Replayed as the gradients it hands on, the
    # product's backward was 24% short of the tracker under vanilla.
    model, x = ScaledProduct().to("meta"), torch.empty(256, 16, device="meta")
    traced = trace(model, x)
    graph = traced.graph
    product = graph.names.index("mul")
    assert graph.profile.backward_peak_bytes[product] > sum(graph.mem_bytes[u] for u in graph.preds[product])
    every_value_kept = strategies.Plan.from_stages(graph, [1 << v for v in range(len(graph))])
    for plan in (strategies.solve("vanilla", graph), every_value_kept):
        measured, predicted = measured_and_predicted(model, x, None, traced, plan)
        assert measured == predicted, plan.stages


def test_a_layer_whose_backward_frees_its_input_before_its_peak_is_replayed_as_it_runs():
    # ``Profile.backward_frees``: a spectrally normalised layer's convolution hands on its gradients and frees
    # its saved input, then the backward of the weight's normalisation runs. Held to the end of the layer's
    # step, the input put the replay 32 KB (an SN-GAN discriminator at batch 64: 17 MB, 1.4%) above the
    # tracker.
    norm = torch.nn.utils.parametrizations.spectral_norm
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.LeakyReLU(0.2), norm(nn.Conv2d(16, 16, 3, padding=1)),
                          nn.LeakyReLU(0.2), norm(nn.Conv2d(16, 32, 4, stride=2, padding=1)), nn.Flatten(),
                          norm(nn.Linear(32 * 8 * 8, 1))).to("meta")
    x, loss_fn = torch.empty(8, 3, 16, 16, device="meta"), lambda out: out.square().sum()
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    freed, peak = graph.profile.backward_frees[graph.names.index("_4")]
    assert freed == (graph.names.index("_3"),) and peak < graph.profile.backward_peak_bytes[graph.names.index("_4")]
    every_value_kept = strategies.Plan.from_stages(graph, [1 << v for v in range(len(graph))])
    for plan in (strategies.solve("vanilla", graph), strategies.solve("chen_sqrt", graph), every_value_kept):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages


class Recurrent(nn.Module):
    """A two-layer LSTM, which on meta (as on cpu) saves each step's gates and states as views of a few
    storages."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.lstm = nn.LSTM(16, 16, num_layers=2, batch_first=True)

    def forward(self, x):
        h, _ = self.lstm(torch.relu(self.emb(x)))
        return self.head(h.contiguous())


def test_a_storage_saved_as_many_views_is_held_once():
    # Counted once per saved view, the LSTM's saved extras came to 13.6 MB instead of 2.0 MB, and the replay
    # predicted 5.7 times the tracker's peak.
    model, x = Recurrent().to("meta"), torch.empty(64, 32, 8, device="meta")
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    for plan in (strategies.solve("vanilla", traced.graph), strategies.solve("approx_dp", traced.graph)):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages


def test_a_recomputation_an_lstm_s_backward_calls_for_late_runs_on_what_it_has_freed_by_then():
    # On meta the LSTM runs step by step, and its backward frees the second layer's saved extras before the first
    # layer's first step unpacks the input: the recomputation of a stage before it runs on 1 MB less than was live
    # as that backward began (``Profile.unpack_held_bytes``, negative). Counted on top of all of it, the replay was
    # 98,320 bytes over the tracker. What is left: the replay holds a kept layer's whole output, the LSTM's final
    # states (16,384 bytes) too, which the step frees at once since nothing reads them.
    model, x = Recurrent().to("meta"), torch.empty(64, 32, 8, device="meta")
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    lstm = graph.names.index("lstm")
    assert min(held for _, held in graph.profile.unpack_held_bytes[lstm]) < -graph.mem_bytes[lstm]
    unread = graph.mem_bytes[lstm] - graph.mem_bytes[graph.names.index("contiguous")]
    for cut in range(lstm + 1):
        plan = strategies.Plan.from_chain(graph, [graph.ancestor_mask[cut], graph.all_nodes])
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert 0 <= predicted - measured <= unread, cut


class TimeMajorHead(nn.Module):
    """A ``Linear`` on a transposed batch of sequences: not contiguous, so it multiplies, then adds its bias
    into a new buffer, and the product is a temporary of the output's size."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(16, 64), nn.Linear(64, 512)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)).transpose(0, 1)).mean(-1)


def test_a_layers_forward_temporary_is_counted():
    # ``Profile.forward_transient_bytes``: without it the replay was one output short of the tracker.
    model, x = TimeMajorHead().to("meta"), torch.empty(64, 32, 16, device="meta")
    traced = trace(model, x)
    graph = traced.graph
    head = graph.names.index("head")
    assert graph.profile.forward_transient_bytes[head] == graph.mem_bytes[head]
    last = len(graph) - 1
    two_stages = strategies.Plan.from_stages(graph, [graph.all_nodes & ~(1 << last), 1 << last])
    assert two_stages.recomputed and two_stages.kept >> head & 1
    for plan in (strategies.solve("vanilla", graph), two_stages):
        measured, predicted = measured_and_predicted(model, x, None, traced, plan)
        assert measured == predicted, plan.stages


def test_a_recomputation_runs_on_what_its_layers_backward_holds_when_it_unpacks():
    # A weight-normalised linear layer makes its weight's gradient (its product's backward) before the
    # normalisation's backward unpacks its norms, which a plan that discards the layer recomputes: the
    # recomputation runs on top of that gradient (``Profile.unpack_held_bytes``). Replayed at the start of
    # the layer's backward, it was predicted 2% low.
    from torch.nn.utils.parametrizations import weight_norm

    model = nn.Sequential(*[nn.Sequential(weight_norm(nn.Linear(64, 64)), nn.Tanh()) for _ in range(5)]).to("meta")
    x, loss_fn = torch.empty(16, 64, device="meta"), lambda out: out.square().mean()
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    first = graph.names.index("_0_0")  # reads the input: its product saves no weight for its backward
    # Its weight's and bias's gradients, less the gradient it received, gone by then.
    assert graph.profile.unpack_held_bytes[first][0] == (first, (64 * 64 + 64 - 16 * 64) * 4)
    every_other = strategies.Plan.from_stages(graph, [strategies.bits(range(2 * i, 2 * i + 2)) for i in range(5)])
    for plan in (every_other, strategies.solve("approx_dp", graph, mode="mc")):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("norm", ["spectral_norm", "weight_norm", "prune"])
def test_what_a_module_keeps_is_held_whatever_the_plan(norm):
    # NOTE [tensors a module keeps] in harness/tracing/probe.py: the pre-hook norms keep the weight they compute on
    # the module; counted as a saved extra that recomputation drops, plans were predicted 2-3% low. The
    # weight a recomputation makes again, with autograd on, held that rerun's saved-tensor hook and so all
    # the rerun had saved (its input too) until the next step: three activations were left after a step
    # here, and a pruned ResNet-18 measured 0.6% above its replay.
    wrap = functools.partial(prune.l1_unstructured, name="weight", amount=0.3) if norm == "prune" else \
        getattr(torch.nn.utils, norm)
    model = nn.Sequential(*[nn.Sequential(wrap(nn.Conv2d(8, 8, 3, padding=1)), nn.LeakyReLU(0.1))
                            for _ in range(5)]).to("meta")
    x, loss_fn = torch.empty(4, 8, 16, 16, device="meta"), lambda out: out.square().mean()
    traced = trace(model, x, loss_fn=loss_fn)
    assert traced.graph.profile.attribute_bytes[traced.graph.names.index("_0_0")] == 8 * 8 * 3 * 3 * 4  # the weight
    for plan in (strategies.solve("chen_sqrt", traced.graph), strategies.solve("approx_dp", traced.graph, mode="mc")):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages
        with MemoryTracker(model, (x,)) as tracker:  # after the step: the input and what the modules keep
            execute(traced, plan, x, loss_fn=loss_fn)
        kept = sum(t.untyped_storage().nbytes() for t in non_leaf_attributes(model))
        assert tracker.current["activations"] == x.untyped_storage().nbytes() + kept, plan.stages
        model.zero_grad(set_to_none=True)

class Doubled(nn.Module):
    def forward(self, x):
        return x * 2  # saves nothing: no backward reads the value before it


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("norm", ["spectral_norm", "weight_norm", "prune"])
def test_what_a_module_keeps_counts_whether_or_not_its_layer_saves_it(norm):
    # The first product reads the input, which takes no gradient, so it saves no weight: the weight its
    # module keeps was not counted (plans predicted 16 KiB, 8%, low). What a layer saves calls for its
    # recomputation, and what it only leaves on the module must not (pruning, whose weight is the layer's
    # only such tensor: a stage was predicted recomputed that never was); a stage recomputed for that alone
    # left its inputs never freed in the replay; and a recomputation's pre-hook makes the weight again
    # before the layer runs, not beside its value (predicted 2% high).
    wrap = functools.partial(prune.l1_unstructured, name="weight", amount=0.3) if norm == "prune" else \
        getattr(torch.nn.utils, norm)
    model = nn.Sequential(wrap(nn.Linear(64, 64)), Doubled(), wrap(nn.Linear(64, 64)), nn.Tanh(),
                          wrap(nn.Linear(64, 64)), nn.Tanh()).to("meta")
    x, loss_fn = torch.empty(16, 64, device="meta"), lambda out: out.square().mean()
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    assert graph.profile.attribute_bytes[0] == graph.profile.attribute_bytes[2] == 64 * 64 * 4
    assert not graph.profile.attribute_saved[0] and graph.profile.attribute_saved[2]
    n = len(graph)
    for cuts in [*itertools.combinations(range(1, n), 2), *itertools.combinations(range(1, n), 3)]:
        bounds = [0, *cuts, n]
        plan = strategies.Plan.from_stages(graph, [strategies.bits(range(a, b)) for a, b in zip(bounds, bounds[1:])])
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, cuts
        model.zero_grad(set_to_none=True)


class ScaledAttention(nn.Module):
    """Attention on scaled queries and keys: values of their own, which only the attention reads."""

    def __init__(self, width=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q * 0.5, k * 0.5, v)
        return torch.tanh(self.out(attended.transpose(1, 2).reshape(batch, length, width)))


def test_attention_is_traced_as_the_cpu_runs_it():
    # On meta, scaled_dot_product_attention runs its math path (the attention matrix, the scaled keys'
    # transpose); on the CPU its fused kernel, which saves the keys themselves. Traced on meta, a plan that
    # discarded the keys crashed on the CPU ("a backward saved what ['mul_1'] compute") and the others'
    # peaks were 3-8% off; now the trace asks the CPU which kernel it would run (NOTE [attention on the
    # device]; a learned mask, a relative position bias, keeps the math path), and every plan is exact and
    # measured as replayed.
    from harness.execute.exact import compare
    from harness.tracing.attention import attention_on_cpu

    def saved(attention, device, **options):
        q, k, v = (torch.randn(2, 4, 9, 8, device=device, requires_grad=True) for _ in range(3))
        options = {key: value.detach().to(device).requires_grad_(value.requires_grad)
                   if isinstance(value, torch.Tensor) else value for key, value in options.items()}
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            out = attention(q, k, v, **options)
        out.sum().backward()  # the fused kernel's backward runs on meta too
        return out.grad_fn.name(), [(t.shape, t.dtype, t.stride()) for t in tensors]

    for options in ({}, {"is_causal": True}, {"dropout_p": 0.1}, {"attn_mask": torch.rand(9, 9) > 0.3},
                    {"attn_mask": torch.randn(2, 1, 9, 9)},
                    {"attn_mask": torch.randn(2, 1, 9, 9, requires_grad=True)}):  # a learned bias: the math path
        assert saved(F.scaled_dot_product_attention, "cpu", **options) == saved(attention_on_cpu, "meta", **options)
    torch.manual_seed(0)
    model, x = nn.Sequential(ScaledAttention(), ScaledAttention()).double(), torch.randn(2, 16, 32, dtype=torch.float64)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    attention = graph.names.index("scaled_dot_product_attention")
    assert set(graph.preds[attention]) <= set(graph.profile.backward_reads[attention])  # q, k and v themselves
    n = len(graph)
    for cuts in itertools.combinations(range(1, n), 2):
        bounds = [0, *cuts, n]
        plan = strategies.Plan.from_stages(graph, [strategies.bits(range(a, b)) for a, b in zip(bounds, bounds[1:])])
        step = lambda: execute(traced, plan, x, loss_fn=loss_fn)  # noqa: E731
        assert compare(model, x, loss_fn, step).exact, cuts
        measured = measure(step, model, (x,), "cpu", warmup_steps=0, timed_steps=1).peak_bytes
        assert measured == strategies.simulate(graph, plan).peak_bytes + fixed_bytes(model, x), cuts


class ConcatenatedBias(nn.Module):
    """EVA's attention bias: a query and a value bias around a zero key bias, concatenated each call."""

    def __init__(self, width=64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3 * width, width) / 8)
        self.q_bias, self.v_bias = nn.Parameter(torch.zeros(width)), nn.Parameter(torch.zeros(width))
        self.register_buffer("k_bias", torch.zeros(width), persistent=False)
        self.out = nn.Linear(3 * width, width)

    def forward(self, x):
        return torch.tanh(self.out(F.linear(x, self.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))))


def test_a_gradient_handed_as_a_slice_holds_the_whole_it_was_cut_from():
    # cat's backward hands each bias a slice of the concatenated bias's gradient, which autograd keeps as
    # the parameters' gradient: the whole stays to the step's end, the zero key bias's third too. Counted
    # at the two biases' sizes, every plan was predicted 256 bytes per block low (EVA-02: 0.01%).
    model = nn.Sequential(*[ConcatenatedBias() for _ in range(3)]).to("meta")
    x, loss_fn = torch.empty(8, 64, device="meta"), lambda out: out.square().mean()
    traced = trace(model, x, loss_fn=loss_fn)
    biases = traced.graph.names.index("cat")
    assert traced.graph.profile.param_bytes[biases] == 3 * 64 * 4
    for plan in (strategies.solve("vanilla", traced.graph), strategies.solve("chen_sqrt", traced.graph),
                 strategies.solve("approx_dp", traced.graph, mode="mc")):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages
        model.zero_grad(set_to_none=True)


class AppliedFourTimes(nn.Module):
    """One block applied four times (ALBERT, universal transformers): its parameters take one gradient."""

    def __init__(self):
        super().__init__()
        self.inp, self.block = nn.Linear(64, 256), nn.Sequential(nn.Linear(256, 256), nn.GELU())

    def forward(self, x):
        x = self.inp(x)
        for _ in range(4):
            x = x + self.block(x)
        return x


class Siamese(nn.Module):
    """One encoder on both halves of the input, side by side."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(3)])

    def forward(self, x):
        a, b = x.chunk(2, dim=1)
        return (self.enc(a) - self.enc(b)).square()


class LoRA(nn.Module):
    """Frozen linear layers with trainable low-rank factors, which are bare parameters, and dropout."""

    def __init__(self, width=64, rank=4):
        super().__init__()
        self.base = nn.ModuleList([nn.Linear(width, width).requires_grad_(False) for _ in range(6)])
        self.down = nn.ParameterList([nn.Parameter(torch.randn(rank, width)) for _ in range(6)])
        self.up = nn.ParameterList([nn.Parameter(torch.randn(width, rank)) for _ in range(6)])
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.nn.functional.gelu(base(x) + self.drop(x) @ down.t() @ up.t())
        return x


class ClassToken(nn.Module):
    """A class token, position embeddings and layer scales as bare parameters; the output is the class
    token's row, a part of the last value."""

    def __init__(self):
        super().__init__()
        self.cls, self.pos = nn.Parameter(torch.randn(1, 1, 64)), nn.Parameter(torch.randn(1, 17, 64))
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])
        self.scales = nn.ParameterList([nn.Parameter(torch.full((64,), 0.1)) for _ in range(4)])

    def forward(self, x):
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block, scale in zip(self.blocks, self.scales):
            x = x + scale * torch.nn.functional.gelu(block(x))
        return x[:, 0]


SHARED_PARAMETERS = {  # name -> (model, input)
    "applied_four_times": (AppliedFourTimes, (16, 64)), "siamese": (Siamese, (16, 256)),
    "lora": (LoRA, (32, 64)), "class_token": (ClassToken, (8, 16, 64)),
}


@pytest.mark.parametrize("name", SHARED_PARAMETERS)
def test_a_parameters_gradient_is_counted_once_whoever_reads_it(name):
    # NOTE [parameter gradients] in harness/tracing/probe.py. Counted per module call, the block applied four times
    # was predicted at +48% and the Siamese encoder at +21%; counted for modules only, LoRA's factors were
    # left out (-0.5% under chen_sqrt); the class token's row hands the last value a gradient of the
    # whole (-5%).
    make, shape = SHARED_PARAMETERS[name]
    model, x = make().to("meta"), torch.empty(*shape, device="meta")
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert sum(graph.profile.param_bytes) == trainable
    for strategy in ("vanilla", "approx_dp", *(["chen_sqrt"] if name == "lora" else [])):
        plan = strategies.solve(strategy, graph)
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, (plan.strategy, plan.stages)


def test_a_residual_addition_hands_its_gradient_to_both_branches():
    model, x, loss_fn, traced = built("resnet50")
    graph = traced.graph
    block = graph.names.index("layer1_0_relu_2")  # out = bn3(...); out += downsample(x); relu(out)
    assert [name.split("_", 2)[-1] for name in traced.members[block]] == ["bn3", "iadd", "relu_2"]
    # The addition and the ReLU, in place, hand the downsampling branch its gradient before the batch norm's
    # backward runs (the ReLU's gradient, one buffer for both branches).
    assert [graph.names[u] for u in graph.profile.early_grads[block]] == ["layer1_0_downsample_1"]
    assert not graph.profile.grad_shares[block]


@functools.cache
def resnet50_at(batch: int):
    model, x, loss_fn = nets.build("resnet50", batch, 224, device="meta")
    return model, x, loss_fn, trace(model, x, loss_fn=loss_fn)


class ShuffleDecoder(nn.Module):
    """Up by a pixel shuffle, down by interpolation: neither layer's backward reads a value."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(4, 32, 3, padding=1)
        self.shuffle = nn.PixelShuffle(2)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        return self.out(F.interpolate(self.shuffle(self.expand(x)), scale_factor=0.5, mode="bilinear"))


@pytest.mark.parametrize("loss_fn", [lambda out: out.square().sum(), lambda out: out.sum(),
                                     lambda out: out.square().mean()], ids=["square", "sum", "mean_square"])
def test_a_kept_value_is_held_while_a_recomputation_may_call_for_it(loss_fn):
    # The shuffle's stage is never recomputed, as no backward reads its values (``called_for``); the
    # executor held the kept expansion for it all through the forward pass, and its peak, at the
    # interpolation, was above the replay's (chen_greedy on such a decoder: 4.2%). An output's stage is
    # held to the end of the forward pass, where the loss's saves tell whether it is (``to_loss``: 10%
    # below with the sum), and when the loss's backward calls for it, the loss and its seed are there, and
    # the gradient a mean's backward made before the square's unpacked the output (4% low without it).
    model, x = ShuffleDecoder().to("meta"), torch.randn(2, 4, 16, 16, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    expand, shuffle, interpolate, out = map(graph.names.index, ("expand", "shuffle", "interpolate", "out"))
    middle = (1 << shuffle) | (1 << interpolate)
    for plan in (strategies.Plan.from_stages(graph, [1 << expand, middle, 1 << out],
                                             kept=graph.all_nodes & ~(1 << shuffle)),
                 strategies.Plan.from_stages(graph, [1 << expand, graph.all_nodes & ~(1 << expand)],
                                             kept=(1 << expand) | (1 << interpolate))):
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan.stages


class AuxiliaryHead(nn.Module):
    """A trunk and its head, an auxiliary head the loss leaves out (Inception's, a torchvision segmentation
    model's ``aux``), and a value nothing reads."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Conv2d(16, 4, 1)
        self.aux = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 4, 1))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        torch.zeros_like(h)  # dead code
        return {"out": self.head(h), "aux": self.aux(h)}


@pytest.mark.parametrize("name, options", CORE)
def test_what_no_gradient_reaches_makes_no_gradient_and_goes_at_the_loss(name, options):
    # The replay ran the auxiliary head's backward (its gradients, its parameters', what it saved held into
    # the backward pass), and the executor held what the head saved to the step's end, and the dead value
    # to the next node's: predicted from 10% low (vanilla) to 15% high (chen_greedy). Plain PyTorch lets
    # the head's autograd graph go with the outputs, at the loss; both do so now.
    loss_fn = lambda out: out["out"].mean()  # noqa: E731
    model, x = AuxiliaryHead().to("meta"), torch.randn(4, 3, 32, 32, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    aux = {v for v in range(len(graph)) if graph.scopes[v].startswith("aux")}
    assert len(aux) == 4 and set(graph.profile.unreached) == aux | {graph.names.index("zeros_like")}
    trained = [*model.trunk.parameters(), *model.head.parameters()]
    assert sum(graph.profile.param_bytes) == sum(p.numel() * p.element_size() for p in trained)
    plan = strategies.solve(name, graph, **options)
    measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
    assert measured == predicted


class Quantiser(nn.Module):
    """A vector quantiser: the code passes the decoder's gradient straight through to the encoder
    (``z + (q - z).detach()``), and each commitment term stops the gradient of one side."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1))
        self.book = nn.Embedding(32, 8)
        self.dec = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))

    def forward(self, x):
        z = self.enc(x).permute(0, 2, 3, 1)
        q = self.book(torch.cdist(z.reshape(-1, 8), self.book.weight).argmin(1)).view_as(z)
        commitment = (q.detach() - z).square().mean() + (q - z.detach()).square().mean()
        return self.dec((z + (q - z).detach()).permute(0, 3, 1, 2)), commitment


@pytest.mark.parametrize("name, options", CORE)
def test_a_value_read_through_detach_takes_no_gradient_from_its_reader(name, options):
    # A backward that runs handed every predecessor a gradient of its size in the replay; ``q - z.detach()``
    # hands ``z`` none, though ``z`` takes one from elsewhere: approx_dp (tc) was predicted 9% high here.
    loss_fn = lambda out: out[0].square().mean() + out[1]  # noqa: E731
    model, x = Quantiser().to("meta"), torch.empty(2, 3, 16, 16, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    without = {(graph.names[u], graph.names[v]) for v in range(len(graph)) for u in graph.profile.preds_without_grad[v]}
    assert {("enc_2", "sub_1"), ("book", "sub"), ("sub_2", "add_1")} <= without, without
    plan = strategies.solve(name, graph, **options)
    measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
    assert measured == predicted


@pytest.mark.parametrize("name", ["vanilla", "chen_sqrt"])
def test_a_schedule_replays_what_no_gradient_reaches_as_a_stage_plan_does(name):
    # ilp_optimal's replay. A schedule holds what an unreached layer saved when that layer's record is its
    # forward computation: it cannot tell a value discarded that nothing recomputes from a kept one, and
    # holds both (NOTE [a schedule's replay]). chen_sqrt discards the auxiliary head, which its recomputation
    # does not make (nothing reads it): told so, the schedule's replay is the plan's; not told, above it.
    loss_fn = lambda out: out["out"].mean()  # noqa: E731
    graph = trace(AuxiliaryHead().to("meta"), torch.randn(4, 3, 32, 32, device="meta"), loss_fn=loss_fn).graph
    plan = strategies.solve(name, graph)
    assert as_schedule_peak(graph, plan) == strategies.simulate(graph, plan).peak_bytes
    assert as_schedule_peak(graph, plan, told=False) >= strategies.simulate(graph, plan).peak_bytes


@pytest.mark.parametrize("name", ["chen_sqrt", "chen_greedy"])
def test_an_addition_in_place_after_a_branch_is_predicted_to_the_byte(name):
    # torchvision's bottleneck: out = bn3(conv3(...)); identity = downsample(x); out += identity; relu.
    # Traced in place (NOTE [augmented assignments]), the batch norm, the addition and the ReLU are one IR
    # node, and the downsampling branch sits between its members. Without the executor running the batch
    # norm just before the addition (``_delayed``), autograd runs the branch's backward inside the node's
    # (chen_sqrt measured 3.4% above its prediction here); without ``Profile.early_grads`` the replay makes
    # the branch's gradient after the batch norm's backward (3.4% and 8.2% above the measured peak).
    model, x, loss_fn, traced = resnet50_at(16)
    plan = strategies.solve(name, traced.graph)
    measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
    assert measured == predicted


def test_a_layer_that_saves_after_its_inputs_go_is_replayed_so():
    # Profile.extras_after_reads: a write after a read writes a copy (NOTE [a write after a read] in
    # harness/tracing/trace.py), and where the clone is the value's last reader, the value goes before the in-place
    # dropout saves its mask. Replayed with the mask made beside the value, two of these plans were
    # predicted 7% and 9% above their measured peak.
    model, x = WritesAfterReads().to("meta"), torch.randn(64, 16, device="meta")
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace(model, x, loss_fn=loss_fn)
    graph = traced.graph
    assert [graph.names[v] for v in range(len(graph)) if graph.profile.extras_after_reads[v]] == ["dropout"]
    rng, n = random.Random(0), len(graph)
    plans = [strategies.solve(name, graph) for name in ("chen_sqrt", "approx_dp")]
    for _ in range(30):
        cuts = [0, *sorted(rng.sample(range(1, n), rng.randint(1, n - 1))), n]
        plans.append(strategies.Plan.from_stages(graph, [strategies.bits(range(a, b)) for a, b in zip(cuts, cuts[1:])]))
    before = graph.replace(extras_after_reads=None)
    moved = 0
    for plan in plans:
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured == predicted, plan
        moved += strategies.simulate(before, plan).peak_bytes != strategies.simulate(graph, plan).peak_bytes
    assert moved


@pytest.mark.parametrize("net", [*nets.PAPER_NETS, "vit_b_16", "gpt2"])
def test_predicted_peak_is_the_measured_one_to_the_byte(net):
    # On ViT-B/16 the DPs' plans peak in an attention layer's backward, whose autograd nodes free the
    # layer's saved tensors one by one (NOTE [a layer's backward peak]): held to the end, +1.5% here.
    # One known gap: the replay makes a layer's parameter gradients together, where autograd makes a
    # linear layer's bias gradient on a 3-D input (a sum over the tokens) apart from its weight's. Under
    # chen_sqrt, ViT-B/16's step peaks in an MLP's output layer's backward before its bias gradient exists:
    # measured one bias gradient (768 floats, 3,072 B) under the prediction. Nowhere else does it show.
    model, x, loss_fn, traced = built(net)
    bias_bytes = max((m.bias.nelement() * m.bias.element_size() for m in model.modules()
                      if isinstance(m, nn.Linear) and m.bias is not None), default=0)
    for name, options in CORE:
        plan = strategies.solve(name, traced.graph, **options)
        measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
        if (net, name) == ("vit_b_16", "chen_sqrt"):
            assert 0 < predicted - measured <= bias_bytes, (measured, predicted)
        else:
            assert predicted == measured, (name, options, measured, predicted)


def recomputed_lifetimes_replayed(graph, plan):
    """For each value the replay recomputes: how many recomputed values it has made when that one goes."""
    made, made_by_replay, freed = 0, set(), {}
    for step in timeline(graph, plan):
        for (kind, u, *_), _size in step.allocs:
            if step.phase == "recompute" and kind == Buffer.VALUE and graph.mem_bytes[u]:
                made, made_by_replay = made + 1, made_by_replay | {u}
        for kind, u, *_ in step.frees:
            if kind == Buffer.VALUE and u in made_by_replay:
                freed[u] = made
    return freed


def recomputed_lifetimes_run(monkeypatch, model, x, loss_fn, traced, plan):
    """The same count in the executor's step: each recomputed value's storage is watched until it dies."""
    # A value is made as its layer's first call begins, as the replay's step makes it before its inputs go.
    first = {names[0] for g, names in enumerate(traced.members) if traced.graph.mem_bytes[g]}
    final = {names[-1]: g for g, names in enumerate(traced.members) if traced.graph.mem_bytes[g]}
    made, freed = [0], {}
    call_node = side_effects.call_node

    def watched(module, modules, node, args, kwargs):
        recomputing = getattr(measure_module._placement, "recomputing", 0)
        made[0] += bool(recomputing and node.name in first)
        out = call_node(module, modules, node, args, kwargs)
        if recomputing and node.name in final:
            g = final[node.name]
            weakref.finalize(out.untyped_storage(), lambda: freed.__setitem__(g, made[0]))
        return out

    monkeypatch.setattr(side_effects, "call_node", watched)
    measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta", 0, 0)
    return freed


@pytest.mark.parametrize("net", [*nets.PAPER_NETS, "vit_b_16", "gpt2"])
def test_each_recomputed_value_goes_when_the_replay_lets_it_go(net, monkeypatch):
    """Not only the peak: every value a recomputation makes is freed by the executor at the point the replay
    frees it, counted in the recomputed values made by then. A value held past its last read (to its stage's
    end, or past the next stage's recomputation) changes the count where it changes no peak."""
    model, x, loss_fn, traced = built(net)
    for name, options in [("chen_sqrt", {}), ("approx_dp", {"mode": "mc"})]:
        plan = strategies.solve(name, traced.graph, **options)
        replayed = recomputed_lifetimes_replayed(traced.graph, plan)
        assert replayed, f"{name} recomputes nothing on {net}"
        ran = recomputed_lifetimes_run(monkeypatch, model, x, loss_fn, traced, plan)
        late = {traced.graph.names[u]: (ran.get(u), made) for u, made in replayed.items() if ran.get(u) != made}
        assert not late, f"{name}: value: (freed after this many made, run; replayed): {late}"
        monkeypatch.undo()


@pytest.mark.parametrize("net", ["resnet50", "unet", "pspnet"])
def test_the_minimal_budget_is_the_measured_peak_and_is_accepted(net):
    model, x, loss_fn, traced = built(net)
    static = fixed_bytes(model, x)
    for name in ("approx_dp", "chen_greedy"):
        with pytest.raises(strategies.InfeasibleBudget) as refused:
            strategies.solve(name, traced.graph, 1)
        minimum = refused.value.min_feasible_bytes
        plan = strategies.solve(name, traced.graph, minimum)  # the least it names is accepted
        measured, _ = measured_and_predicted(model, x, loss_fn, traced, plan)
        # One-sided: the least budget a strategy names is the replay of the least plan its search found, not a
        # proven minimum; solved at that budget, approx_dp's bisection can find a plan that holds less (ResNet-50
        # 0.07% and PSPNet 0.25% less here). The plan it returns measures what its replay predicts, to the byte.
        assert measured <= minimum + static <= 1.005 * measured, (name, minimum + static, measured)
        assert measured == strategies.simulate(traced.graph, plan).peak_bytes + static


@pytest.mark.parametrize("net", ["resnet50", "unet", "googlenet"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fraction=st.floats(0.0, 1.0))
def test_a_budgeted_plan_never_measures_above_its_budget(net, fraction):
    model, x, loss_fn, traced = _cached(net)
    static = fixed_bytes(model, x)
    least = strategies.simulate(traced.graph, strategies.solve("approx_dp", traced.graph, mode="mc")).peak_bytes
    most = strategies.simulate(traced.graph, strategies.solve("vanilla", traced.graph)).peak_bytes
    budget = int(least + fraction * (most - least))
    for name in ("approx_dp", "chen_greedy", "swap"):
        try:
            plan = strategies.solve(name, traced.graph, budget)
        except strategies.InfeasibleBudget:
            continue
        measured, _ = measured_and_predicted(model, x, loss_fn, traced, plan)
        assert measured <= budget + static, (name, budget + static, measured)


_BUILT = {}


def _cached(net):
    if net not in _BUILT:
        _BUILT[net] = built(net)
    return _BUILT[net]


def test_a_relu_after_an_addition_reads_its_value_while_it_makes_the_gradient_it_hands_on():
    # ResNet's block output relu(bn3 + downsample): the ReLU's backward makes the gradient both branches
    # share while the value and the gradient it received are live. At batch 32 the step's peak is there
    # (the replay freed the value first and predicted 12.6 MB, 0.44%, too little).
    model, x, loss_fn = nets.build("resnet50", 32, 224, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    plan = strategies.solve("vanilla", traced.graph)
    measured, predicted = measured_and_predicted(model, x, loss_fn, traced, plan)
    assert measured == predicted


@pytest.mark.parametrize("net, batch, side, strategy", [
    ("unet", 2, None, "torch_checkpoint_blocks"), ("resnet152", 8, 224, "torch_checkpoint_sequential"),
    ("googlenet", 32, 224, "torch_checkpoint_sequential"), ("densenet161", 16, 224, "torch_checkpoint_blocks")])
def test_a_peers_plan_predicts_what_torch_checkpoint_holds(net, batch, side, strategy):
    # The peer runs torch.utils.checkpoint itself. It keeps nothing a block saves, and its recomputation
    # rebuilds all of it, the block's output included, up to the last layer that saves (NOTE [a
    # checkpointed stage]): predicted as the executor's plain stages, +5.4%, +3.0% and -4.6% here. Its
    # frame holds the block's inputs until the block's backward is done: DenseNet's earlier features, which
    # the replay let go after the recomputation read them (+1.2%).
    model, x, loss_fn = nets.build(net, batch, side, device="meta")
    traced = trace(model, x, loss_fn=loss_fn)
    structure = nets.structure(net, model)
    plan = strategies.solve(strategy, traced.graph, **peers.zoo_options(strategy, structure))
    measured = measure(peers.step(plan, model, structure, x, loss_fn), model, (x,), "meta").peak_bytes
    predicted = strategies.simulate(traced.graph, plan).peak_bytes + fixed_bytes(model, x)
    # Not to the byte: PyTorch's checkpoint runs its own recomputation, which the replay models from outside
    # (what its frame holds, when its rerun's values go); within 0.1% on these four (0 to 0.098%).
    assert abs(predicted - measured) <= 0.001 * measured, (measured, predicted)


class CroppedSkip(nn.Module):
    """U-Net's skip connection: a crop (a view) of one value, concatenated with another."""

    def __init__(self):
        super().__init__()
        self.wide, self.narrow = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return torch.cat([self.wide(x)[:, :, 1:-1, 1:-1], self.narrow(x)], 1)


def test_a_views_backward_is_measured_with_its_readers():
    # The crop's backward pads its gradient to the whole value; it runs right after the concatenation's,
    # and the replay makes that gradient in the concatenation's step. Measured as the crop's own, it was
    # missing from the concatenation's backward peak (0), and the replay's step there went 4.7 MB too low.
    model, x = CroppedSkip().to("meta"), torch.empty(8, 3, 64, 64, device="meta")
    graph = trace(model, x).graph
    cat, wide = graph.names.index("cat"), graph.names.index("wide")
    assert graph.profile.backward_peak_bytes[cat] >= graph.mem_bytes[wide]


# A schedule runs its backwards in node order, not in the executor's (NOTE [a schedule's replay]): a plan whose stages
# do not follow node order is not written as a schedule here. chen_greedy's on GPT-2 (the position embedding's stage
# before the token embedding's: 0.12% apart at the last two backwards), the memory-centric DP's on ResNet-50 (a
# downsampling branch a stage of its own before its block's main branch).
def in_node_order(plan, n) -> bool:
    return plan.stage_of(n) == sorted(plan.stage_of(n))


@pytest.mark.parametrize("net", [*nets.PAPER_NETS, "vit_b_16"])
def test_a_stage_plan_replayed_as_a_schedule_peaks_as_the_plan_does(net):
    # ilp_optimal's schedules are judged by schedule_timeline, which the executor never runs: on every
    # stage plan in node order (written as a Checkmate schedule) it must give the stage replay's peak, the tracker's.
    graph = built(net)[3].graph
    plans = [strategies.solve(name, graph, **options) for name, options in CORE]
    in_order = [plan for plan in plans if in_node_order(plan, len(graph))]
    for plan in in_order:
        assert as_schedule_peak(graph, plan, told=False) == strategies.simulate(graph, plan).peak_bytes, plan.strategy
    assert any(plan.recomputed for plan in in_order), "no recomputing plan here follows node order"


def test_the_ilp_is_judged_by_the_replay_on_a_traced_net():
    pytest.importorskip("highspy")
    model, x, loss_fn = nets.build("vgg19", 2, 32, device="meta")
    graph = trace(model, x, loss_fn=loss_fn).graph
    least = strategies.solve("ilp_optimal", graph, time_limit_s=10, probes=4)
    vanilla = strategies.simulate(graph, strategies.solve("vanilla", graph)).peak_bytes
    for budget in (least.budget_bytes, (least.budget_bytes + vanilla) // 2):
        plan = strategies.solve("ilp_optimal", graph, budget, time_limit_s=10, probes=4)
        assert strategies.simulate(graph, plan).peak_bytes <= budget
        approx = strategies.solve("approx_dp", graph, budget)
        assert strategies.simulate(graph, plan).overhead_cost <= strategies.simulate(graph, approx).overhead_cost
    with pytest.raises(strategies.InfeasibleBudget) as error:
        strategies.solve("ilp_optimal", graph, least.budget_bytes // 2, time_limit_s=10, probes=4)
    assert error.value.min_feasible_bytes <= least.budget_bytes


@pytest.mark.parametrize("net", ["vgg19", "unet"])
def test_the_predicted_flops_of_a_step_count_each_call_once(net):
    # A layer's call may take several replay steps (its in-place ReLU's backward first, what it holds while
    # it unpacks, a kept value let go after a recomputation): counted once per step, VGG-19's vanilla step
    # was predicted at 1.67x the FLOPs it ran, and DenseNet-161's DP plans at 1.13x. What is left is the cost
    # model's backward at twice its forward (a first layer makes no input gradient).
    model, x, loss_fn, traced = built(net)
    for name, options in [("vanilla", {}), ("approx_dp", {"mode": "mc"})]:
        plan = strategies.solve(name, traced.graph, **options)
        ran = measure(lambda: execute(traced, plan, x, loss_fn=loss_fn), model, (x,), "meta").step_flops
        assert step_flops(traced.graph, plan) == pytest.approx(ran, rel=0.01), name


def test_a_checkpointed_block_stops_before_a_last_layer_that_saves_only_what_it_reads():
    # torch.utils.checkpoint stops its recomputation once the block's last saved tensor is saved again, and
    # a convolution saves its input before it runs: a DenseNet layer's last convolution is not rerun. The
    # replay ran it, and charged DenseNet-161's blocks 1.67x the FLOPs they recompute.
    model, x, loss_fn, traced = built("densenet161")
    structure = nets.structure("densenet161", model)
    recomputed = {}
    for name in ("vanilla", "torch_checkpoint_blocks"):
        plan = strategies.solve(name, traced.graph, **peers.zoo_options(name, structure))
        step = (peers.step(plan, model, structure, x, loss_fn) if plan.runner is not None
                else lambda: execute(traced, plan, x, loss_fn=loss_fn))
        recomputed[name] = (step_flops(traced.graph, plan), measure(step, model, (x,), "meta").step_flops)
    predicted, ran = (blocks - plain for blocks, plain in zip(recomputed["torch_checkpoint_blocks"],
                                                              recomputed["vanilla"]))
    assert predicted == pytest.approx(ran, rel=0.01)
