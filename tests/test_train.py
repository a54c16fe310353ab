"""Training with a plan in the user's own loop (``harness.train``): exact over many optimizer steps, eager and
compiled; the peak a cell measures; plans saved, loaded and refused; bad batches refused."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import strategies
from harness.measure import measure
from harness.plans import PlanFileError
from harness.run import run_cell
from harness.tracing.trace import trace
from harness.train import CheckpointedStages, as_checkpoint_plan, plan_training
from harness.zoo import nets

STEPS = 20


def small_cnn():
    """Convolutions with BatchNorm (running statistics updated once a step) and dropout."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.2),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 5))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class SmallGPT(nn.Module):
    """A GPT-style decoder: token and position embeddings, two blocks with attention and MLP dropout, a head."""

    def __init__(self, vocab=50, width=16, length=12):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(Block(width, 2), Block(width, 2))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.norm(self.blocks(self.drop(self.tokens(ids) + self.positions(positions)))))


def next_token_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def image_batch():
    return torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (4,))


def token_batch():
    ids = torch.randint(0, 50, (3, 12))
    return ids, torch.roll(ids, -1, dims=1)


MODELS = {"cnn_batchnorm": (small_cnn, image_batch, F.cross_entropy),
          "gpt_dropout": (SmallGPT, token_batch, next_token_loss)}


@pytest.mark.parametrize("form", ["eager", "compiled", "checkpoint"])
@pytest.mark.parametrize("strategy", ["approx_dp", "chen_sqrt"])
@pytest.mark.parametrize("name", MODELS)
def test_twenty_adamw_steps_equal_plain_pytorch_training(name, strategy, form):
    """Twenty AdamW steps on new random batches with labels, in float64: every loss, and every parameter and
    buffer at the end, equal plain PyTorch's (compiled: the model compiled as its users compile it, whose
    random ops draw their own masks), BatchNorm's statistics updated once a step. As checkpoint regions, a
    recomputed BatchNorm is refused, naming it: torch.utils.checkpoint would update its statistics twice."""
    make, batch, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    step = plan_training(model, *batch(), loss_fn=loss_fn, strategy=strategy)
    assert step.plan.recomputed, f"{strategy} recomputes nothing on {name}"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    if form == "compiled":
        planned = torch.compile(step.module, backend=step.backend)
        plain = torch.compile(reference, backend="aot_eager_decomp_partition")
    if form == "checkpoint":
        if name == "cnn_batchnorm":
            with pytest.raises(ValueError, match=r"recomputes BatchNorm2d \(.*\), which writes the model's state"):
                step.checkpointed()
            return
        planned = step.checkpointed()
        assert planned.get_parameter("program.head.weight") is model.head.weight
    for i in range(STEPS):
        inputs, labels = batch()
        torch.manual_seed(i)
        if form != "eager":
            loss = loss_fn(planned(inputs), labels)
            loss.backward()
        else:
            loss = step(inputs, labels)
        optimizer.step()
        optimizer.zero_grad()
        torch.manual_seed(i)
        reference_loss = loss_fn((plain if form == "compiled" else reference)(inputs), labels)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss.detach(), reference_loss.detach(), rtol=1e-10, atol=0, msg=f"step {i}")
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12, msg=key)


def test_micro_batches_accumulate_and_the_model_stays_the_users():
    """Two micro-batches before one optimizer step give the gradients of both, as ``loss.backward()`` does; the
    model's parameters are the very tensors the user's optimizer holds."""
    torch.manual_seed(0)
    model = small_cnn().double()
    reference = copy.deepcopy(model)
    step = plan_training(model, *image_batch(), loss_fn=F.cross_entropy, strategy="chen_sqrt")
    assert step.module.get_parameter("0.weight") is model[0].weight
    batches = [image_batch() for _ in range(2)]
    for i, (inputs, labels) in enumerate(batches):
        torch.manual_seed(i)
        step(inputs, labels)
        torch.manual_seed(i)
        F.cross_entropy(reference(inputs), labels).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


def test_on_meta_a_training_step_measures_what_the_cell_measures():
    """The wrapped step of the zoo's ResNet-50 (its loss included) holds, on meta, the peak the harness's cell
    measures for the same plan, to the byte, and its prediction; AdamW's states come apart, after the step."""
    model, x, loss_fn = nets.build("resnet50", 2, 64, "meta")
    step = plan_training(model, x, loss_fn=loss_fn, strategy="approx_dp")
    row = run_cell("resnet50", "approx_dp", batch_size=2, image_size=64)
    measured = measure(lambda: step(x), model, (x,), "meta")
    assert measured.peak_bytes == row["measured_peak_bytes"] == step.predicted_peak_bytes
    optimizer = torch.optim.AdamW(model.parameters())
    step(x)  # the measurement leaves no gradients behind
    optimizer.step()
    states = sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim())
    assert states == 2 * sum(p.nbytes for p in model.parameters())


def test_a_plan_saved_loads_back_and_is_refused_elsewhere(tmp_path):
    """``step.save`` writes the plan with the graph's fingerprint; it loads back into the same plan, and is
    refused, naming the first difference, for another model, another shape, a truncated file and an edited one.
    The command line writes the same file (``plan_out=``)."""
    torch.manual_seed(0)
    model = small_cnn().double()
    inputs, labels = image_batch()
    step = plan_training(model, inputs, labels, loss_fn=F.cross_entropy, strategy="chen_sqrt")
    path = step.save(tmp_path / "plan.json")
    again = plan_training(model, inputs, labels, loss_fn=F.cross_entropy, plan=path)
    assert (again.plan.stages, again.plan.kept) == (step.plan.stages, step.plan.kept)
    state = copy.deepcopy(model.state_dict())

    other = nn.Sequential(*list(small_cnn().double())[:6], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    with pytest.raises(PlanFileError, match="made for another graph: node 6 is"):
        plan_training(other, inputs, labels, loss_fn=F.cross_entropy, plan=path)
    with pytest.raises(PlanFileError, match=r"input of shape \(4, 3, 16, 16\) .* \(2, 3, 16, 16\)"):
        plan_training(model, inputs[:2], labels[:2], loss_fn=F.cross_entropy, plan=path)
    text = path.read_text()
    (tmp_path / "truncated.json").write_text(text[:len(text) // 2])
    with pytest.raises(PlanFileError, match="not a whole plan file"):
        plan_training(model, inputs, labels, loss_fn=F.cross_entropy, plan=tmp_path / "truncated.json")
    saved = json.loads(text)
    saved["body"]["plan"]["kept"] = saved["body"]["plan"]["kept"][1:]
    (tmp_path / "edited.json").write_text(json.dumps(saved))
    with pytest.raises(PlanFileError, match="edited or damaged"):
        plan_training(model, inputs, labels, loss_fn=F.cross_entropy, plan=tmp_path / "edited.json")
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key

    meta, x, loss_fn = nets.build("vgg19", 1, 32, "meta")
    row = run_cell("vgg19", "approx_dp", batch_size=1, image_size=32, budget="2GB",
                   plan_out=tmp_path / "vgg19.json")
    loaded = plan_training(meta, x, loss_fn=loss_fn, plan=tmp_path / "vgg19.json")
    assert loaded.plan.strategy == "approx_dp" and loaded.predicted_peak_bytes == row["predicted_peak_bytes"]
    assert loaded.budget_bytes == row["budget_bytes"] == 2 * 10**9 and loaded.options == row["options"]


def test_bad_batches_and_budgets_are_refused_and_the_model_is_left_as_it_was():
    torch.manual_seed(0)
    model = small_cnn().double()
    inputs, labels = image_batch()
    step = plan_training(model, inputs, labels, loss_fn=F.cross_entropy, strategy="approx_dp")
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"the input has shape \(2, 3, 16, 16\), but the plan was made for "
                                         r"\(4, 3, 16, 16\)"):
        step(inputs[:2], labels[:2])
    with pytest.raises(ValueError, match="the input has dtype float32, but the plan was made for float64"):
        step(inputs.float(), labels)
    with pytest.raises(ValueError, match="target 0 has shape"):
        step(inputs, labels[:3])
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    least = step.predicted_peak_bytes
    with pytest.raises(strategies.InfeasibleBudget, match=f"minimal feasible budget is {least} bytes"):
        plan_training(model, inputs, labels, loss_fn=F.cross_entropy, strategy="approx_dp", budget=least - 1)
    with pytest.raises(ValueError, match="not one the executor runs"):
        plan_training(model, inputs, labels, loss_fn=F.cross_entropy, strategy="torch_compile_budget")


def test_as_checkpoint_regions_the_plan_holds_what_its_checkpointed_form_predicts_on_meta():
    """GPT-2 on meta: the plan run as ``torch.utils.checkpoint`` regions measures what the replay predicts for
    the plan with those stages checkpointed (``as_checkpoint_plan``), to the byte: a little above the executor's
    step, by what checkpoint's frames hold (a region's inputs through its backward)."""
    model, x, loss_fn = nets.build("gpt2", 2, 256, "meta")
    step = plan_training(model, x, loss_fn=loss_fn, strategy="approx_dp")
    regions = step.checkpointed()

    def run():
        loss = loss_fn(regions(x))
        loss.backward()
        return loss.detach()

    measured = measure(run, model, (x,), "meta").peak_bytes
    predicted = strategies.simulate(step.traced.graph, as_checkpoint_plan(step.plan)).peak_bytes + step.static_bytes
    assert measured == predicted
    assert step.predicted_peak_bytes < measured <= 1.01 * step.predicted_peak_bytes


def test_as_checkpoint_regions_a_recomputed_draw_after_a_cached_one_gets_the_state_its_forward_found():
    """One stage that keeps the first dropout's value and recomputes the second: the recomputation skips the
    cached first dropout, so the second draws from the state its forward call found, recorded then, not from
    the stage's start (``checkpoint``'s own RNG replay), and the gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    traced = trace(model, x)
    graph = traced.graph
    dropouts = [v for v in range(len(graph)) if graph.scopes[v] in ("1", "3")]
    plan = strategies.Plan.from_stages(graph, [graph.all_nodes], kept=1 << dropouts[0])
    assert plan.recomputed >> dropouts[1] & 1
    regions = CheckpointedStages(traced, plan, x)
    for module, seed in ((regions, 1), (reference, 1)):
        torch.manual_seed(seed)
        module(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("net, batch, size", [("unet", 1, 188), ("gpt2", 1, 32)])
def test_as_checkpoint_regions_a_zoo_net_without_batchnorm_computes_plain_pytorchs_step(net, batch, size):
    """U-Net crops its skip connections to shapes made in later stages: such a view runs in the region of the
    stage it waits for, as the executor orders it; the loss and gradients are plain PyTorch's, in float64."""
    torch.manual_seed(0)
    model, x, loss_fn = nets.build(net, batch, size, "cpu", "float64")
    reference = copy.deepcopy(model)
    for strategy in ("approx_dp", "chen_sqrt"):
        regions = plan_training(model, x, loss_fn=loss_fn, strategy=strategy).checkpointed()
        for module in (regions, reference):
            torch.manual_seed(1)
            loss_fn(module(x)).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12 * q.grad.abs().max().item())
            p.grad = q.grad = None
