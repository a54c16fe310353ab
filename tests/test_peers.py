"""PyTorch's own tools as peers: the plan mirrors the blocks, and BatchNorm statistics stay exact."""

import copy

import pytest
import torch
from torch import nn

import strategies
from harness.execute import peers
from harness.tracing.trace import trace
from harness.zoo import nets


def test_block_plan_follows_the_zoo_blocks():
    model, x, _ = nets.build("resnet50", 2, 64)
    graph = trace(model, x).graph
    blocks = tuple(nets.spec("resnet50").blocks(model))
    assert len(blocks) == 16  # 3 + 4 + 6 + 3 bottlenecks
    plan = strategies.solve("torch_checkpoint_blocks", graph, blocks=blocks)
    inside = [v for v in range(len(graph)) if graph.scopes[v].startswith("layer")]
    stem_and_head = len(graph) - len(inside)
    assert len(plan.stages) == len(blocks) + stem_and_head
    assert plan.runner == "torch_checkpoint"


def test_vgg_stages_are_slices_of_features():
    model, _, _ = nets.build("vgg19", 1, 32)
    assert nets.spec("vgg19").blocks(model) == ["features[0:5]", "features[5:10]", "features[10:19]",
                                                "features[19:28]", "features[28:37]"]


def test_without_blocks_the_error_says_what_is_needed():
    model, x, _ = nets.build("vgg19", 1, 32)
    with pytest.raises(ValueError, match="needs the net's blocks"):
        strategies.solve("torch_checkpoint_blocks", trace(model, x).graph)


def test_plain_checkpoint_would_update_batchnorm_twice():
    # Why peers.batchnorm_once exists: recomputation runs BatchNorm's forward again.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).train()
    x = torch.randn(2, 3, 8, 8)
    once, twice, again = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    once(x).sum().backward()
    with peers.checkpointed(twice, ["0"]):
        twice(x).sum().backward()
    assert twice[0][1].num_batches_tracked == 2
    assert not torch.equal(once[0][1].running_mean, twice[0][1].running_mean)
    with peers.checkpointed(again, ["0"]), peers.batchnorm_once(again):
        again(x).sum().backward()
    assert torch.equal(once[0][1].running_mean, again[0][1].running_mean)
    assert torch.equal(once[0][1].running_var, again[0][1].running_var)
    assert again[0][1].num_batches_tracked == 1


def test_sequential_plan_splits_as_pytorch_does():
    model, x, _ = nets.build("resnet50", 2, 64)
    graph = trace(model, x).graph
    sequence = tuple(nets.structure("resnet50", model)["sequence"])
    assert len(sequence) == 4 + 16 + 3  # stem, bottlenecks, pool/flatten/fc
    plan = strategies.solve("torch_checkpoint_sequential", graph, sequence=sequence)
    assert plan.info["segments"] == round(len(sequence) ** 0.5) == len(plan.stages)
    last = plan.stages[-1]
    assert plan.kept & last == last, "the last segment runs outside checkpoint and keeps its values"
    assert plan.recomputed, "the checkpointed segments are recomputed"
    fewer = strategies.solve("torch_checkpoint_sequential", graph, sequence=sequence, segments=2)
    assert len(fewer.stages) == 2
    with pytest.raises(ValueError, match="segments must be between 1 and the 23 steps"):
        strategies.solve("torch_checkpoint_sequential", graph, sequence=sequence, segments=24)


def test_unet_has_no_sequence_and_the_row_says_why(tmp_path):
    from harness.run import run_cell

    row = run_cell("unet", "torch_checkpoint_sequential", batch_size=1, image_size=188, results_dir=tmp_path)
    assert row["status"] == "infeasible"
    assert "no sequential view" in row["error"]


def test_segment_start_relus_run_out_of_place():
    model, _, _ = nets.build("vgg19", 1, 32)
    sequence = nets.structure("vgg19", model)["sequence"]
    segments = round(len(sequence) ** 0.5)
    functions = peers.sequential_functions(model, sequence, segments)
    starts = set(range(0, len(sequence) - len(sequence) % segments, len(sequence) // segments))
    relus = [i for i, f in enumerate(functions) if isinstance(f, nn.ReLU)]
    assert any(i in starts for i in relus), "vgg19's split should start a segment with a ReLU"
    for i in relus:
        assert functions[i].inplace == (i not in starts), i
    assert all(m.inplace for m in model.modules() if isinstance(m, nn.ReLU)), "the model itself is untouched"


# Not ResNet-152, DenseNet-161 and PSPNet, deeper nets of ResNet-50's, GoogLeNet's and U-Net's kinds of layer
# (PSPNet: ResNet-50's blocks, pooled and upsampled): compiling them made the slowest cases (75, 41 and 82 s).
@pytest.mark.parametrize("net", ["unet", "resnet50", "vgg19", "googlenet"])
def test_compiled_step_matches_eager_in_float64(net):
    # torch.compile with activation_memory_budget, run for real on cpu (aot_eager_decomp_partition). Its
    # decompositions round differently from eager kernels; float64 shows the step is the same function.
    from test_executor import SMALL

    batch, side = SMALL.get(net, (2, 64))
    torch.manual_seed(0)
    model, x, loss_fn = nets.build(net, batch, side, device="cpu")
    model, x = model.double(), x.double()
    # Compiled dropout draws its masks from decomposed random ops, not eager's kernel: no seed makes them
    # equal, so dropout layers (GoogLeNet's, VGG-19's) are switched off on both sides.
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.eval()
    reference = copy.deepcopy(model)
    reference_loss = loss_fn(reference(x))
    reference_loss.backward()
    plan = strategies.solve("torch_compile_budget", trace(model, x).graph, budget_ratio=0.5)
    loss = peers.step(plan, model, nets.structure(net, model), x, loss_fn)()
    assert_same_step_in_float64(model, reference, loss, reference_loss)


def assert_same_step_in_float64(model, reference, loss, reference_loss):
    """One step of ``model`` (``loss``) equals ``reference``'s in float64: the loss, every gradient, and the
    BatchNorm statistics (updated once)."""
    torch.testing.assert_close(loss, reference_loss.detach(), rtol=1e-10, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None or q.grad is None:  # a layer the loss does not reach through autograd
            assert p.grad is None and q.grad is None, f"{name}: a gradient on one side only"
            continue
        if torch.equal(p.grad, q.grad):  # before assert_close, which takes seconds on VGG's 100M weights
            continue
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-7, atol=1e-9 * scale, msg=lambda m: f"{name}: {m}")
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, r, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")  # updated once


def test_compile_budget_rows(tmp_path):
    from harness.run import run_cell

    with pytest.raises(ValueError, match=r"budget_ratio must lie in \[0, 1\]"):
        strategies.solve("torch_compile_budget", strategies.Graph(mem_bytes=[1], cost=[1], edges=[]),
                         budget_ratio=1.5)
    row = run_cell("vgg19", "torch_compile_budget", batch_size=2, image_size=32, results_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["predicted_peak_bytes"] is None and row["compile_time_s"] > 0
    assert row["measured_peak_bytes"] > row["static_bytes"]
    on_cpu = run_cell("vgg19", "torch_compile_budget", batch_size=2, image_size=32, device="cpu",
                      warmup_steps=0, timed_steps=1)
    assert on_cpu["status"] == "ok" and on_cpu["measured_peak_bytes"] is None and on_cpu["step_time_ms"] > 0
    assert "nothing measures its memory" in on_cpu["method"]  # compiled code: time only, and said so


def test_compile_budget_on_tied_weights(tmp_path):
    """GPT-2's output layer shares the token embedding's weight; aot_module alone refuses tied weights."""
    from harness.run import run_cell

    row = run_cell("gpt2", "torch_compile_budget", batch_size=1, image_size=32, results_dir=tmp_path)
    assert row["status"] == "ok", row.get("error")
    assert row["measured_peak_bytes"] > row["static_bytes"]


def test_the_compile_peer_compiles_before_any_dispatch_mode():
    """A step whose first call runs under the tracker (a dispatch mode) would never be compiled: dynamo
    skips that frame for good, and every later step, timed ones included, would run eagerly."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from harness.measure import MemoryTracker

    torch._dynamo.reset()
    counters.clear()
    model, x, loss_fn = nets.build("vgg19", 1, 32, device="cpu")
    run = peers.compiled_step(model, x, loss_fn, budget_ratio=0.5)  # resets dynamo, then compiles
    compiled = counters["stats"]["unique_graphs"]
    assert compiled >= 1 and counters["frames"]["ok"] >= 1, "compiled when built, before any dispatch mode"
    assert run.compile_time_s > 0
    with MemoryTracker(model, (x,)):  # what measure() does first
        run()
    run()
    assert counters["stats"]["unique_graphs"] == compiled  # compiled once, then reused


class KeywordBlocks(nn.Module):
    """Blocks called with keyword arguments besides their input, as a transformers decoder calls its layers
    (``attention_mask=``, ``position_embeddings=``); the mask is skipped while fx traces, as transformers
    skips its check for packed sequences, which reads the positions' values."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Gated() for _ in range(3))

    def forward(self, x):
        scale = torch.linspace(0.5, 1.5, x.shape[-1], device=x.device, dtype=x.dtype)
        if not torch.fx._symbolic_trace.is_fx_tracing() and bool((scale == 0).any()):
            scale = scale + 1
        for layer in self.layers:
            x = layer(x, scale=scale)
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.drop = nn.Linear(8, 8), nn.Dropout(0.2)

    def forward(self, x, scale=None):
        return x + self.drop(torch.tanh(self.linear(x)) * scale)


def test_checkpointed_blocks_take_keyword_arguments_and_on_meta_the_models_own_value_reads_are_named():
    from harness.execute.exact import compare

    blocks = {"blocks": [f"layers.{i}" for i in range(3)]}
    torch.manual_seed(0)
    model, x = KeywordBlocks().double(), torch.randn(4, 8, dtype=torch.float64)
    plan = strategies.solve("torch_checkpoint_blocks", trace(model, x).graph, **peers.zoo_options(
        "torch_checkpoint_blocks", blocks))
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    assert compare(model, x, loss_fn, peers.step(plan, model, blocks, x, loss_fn)).exact
    model, x = model.to("meta"), x.to("meta")
    with pytest.raises(RuntimeError, match=r"torch_checkpoint_blocks runs the model's own code, which reads a "
                                           r"tensor's value in Python at .*test_peers\.py:\d+ .*device=cpu or cuda"):
        peers.step(plan, model, blocks, x, loss_fn)()
