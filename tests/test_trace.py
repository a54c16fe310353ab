"""Tracing modules into the IR."""

import pytest
import torch
from torch import nn

from harness import nets
from harness.trace import TraceFailure, trace


def test_in_place_and_views_join_the_value_they_write():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 2))
    traced = trace(model, torch.randn(2, 3, 8, 8))
    g = traced.graph
    # conv, bn (+ in-place relu, + flatten view), linear: three values.
    assert [len(m) for m in traced.members] == [1, 3, 1]
    assert g.kinds == ("conv", "norm", "linear")
    assert g.mem_bytes == (2 * 4 * 6 * 6 * 4, 2 * 4 * 6 * 6 * 4, 2 * 2 * 4)
    assert g.edges == ((0, 1), (1, 2))
    assert g.cost == (10.0, 3.0, 1.0)  # paper cost model: 10 per convolution, 1 per other layer (bn, relu, flatten)
    # BatchNorm saves its input (the conv output), the in-place ReLU its output, Linear its input.
    assert g.backward_reads == ((), (0, 1), (1,))
    assert g.param_bytes == ((4 * 3 * 9 + 4) * 4, 8 * 4, (144 * 2 + 2) * 4)


def test_flop_cost_model():
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU())
    g = trace(model, torch.randn(3, 8), cost_model="flops").graph
    assert g.cost[0] == 2 * 3 * 8 * 4
    with pytest.raises(ValueError, match="valid: paper, flops"):
        trace(model, torch.randn(3, 8), cost_model="seconds")


def test_an_untraceable_module_names_the_failing_call():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(TraceFailure, match=r"Branchy: data-dependent control flow.*test_trace.py:\d+ \(if x.sum\(\) > 0:\)"):
        trace(Branchy(), torch.randn(2))


@pytest.mark.parametrize("net", nets.PAPER_NETS)
def test_zoo_layer_counts_are_near_the_papers(net):
    model, x, _ = nets.build(net)
    traced = trace(model, x)
    spec = nets.spec(net)
    # Our layers are torchvision's / smp's, not the paper's Chainer models: within 15% of its #V,
    # except GoogLeNet, whose torchvision version adds a BatchNorm after every convolution.
    limit = 0.6 if net == "googlenet" else 0.15
    assert abs(len(traced.group_of) - spec.paper_nodes) <= limit * spec.paper_nodes
    assert len(traced.graph) <= len(traced.group_of)


def test_zoo_bad_input():
    with pytest.raises(KeyError, match="valid nets: densenet161, googlenet"):
        nets.build("resnet51")
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        nets.build("resnet50", batch_size=0)
    with pytest.raises(ValueError, match="pspnet needs an image side that is a multiple of 8"):
        nets.build("pspnet", image_size=713)
