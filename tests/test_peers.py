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
