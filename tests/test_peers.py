"""PyTorch's own tools as peers: the plan mirrors the blocks, and BatchNorm statistics stay exact."""

import copy

import pytest
import torch
from torch import nn

import strategies
from harness import nets, peers
from harness.trace import trace


def test_block_plan_follows_the_zoo_blocks():
    model, x, _ = nets.build("resnet50", 2, 64)
    graph = trace(model, x).graph
    blocks = tuple(nets.spec("resnet50").blocks(model))
    assert len(blocks) == 16  # 3 + 4 + 6 + 3 bottlenecks
    plan = strategies.solve("torch_checkpoint_blocks", graph, blocks=blocks)
    inside = [v for v in range(len(graph)) if graph.scopes[v].startswith("layer")]
    stem_and_head = len(graph) - len(inside)
    assert len(plan.stages) == len(blocks) + stem_and_head
    assert plan.info["runner"] == "torch_checkpoint"


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
