"""Tracing modules into the IR."""

import pytest
import torch
from torch import nn

from harness.tracing.trace import trace
from harness.tracing.traced import TraceFailure
from harness.zoo import nets


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
    assert g.profile.backward_reads == ((), (0, 1), (1,))
    assert g.profile.param_bytes == ((4 * 3 * 9 + 4) * 4, 8 * 4, (144 * 2 + 2) * 4)


def test_flop_cost_model():
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU())
    g = trace(model, torch.randn(3, 8), cost_model="flops").graph
    assert g.cost[0] == 2 * 3 * 8 * 4
    with pytest.raises(ValueError, match="valid: paper, flops"):
        trace(model, torch.randn(3, 8), cost_model="seconds")


@pytest.mark.parametrize("net", ["googlenet", "gpt2"])
def test_the_graphs_flops_are_what_pytorchs_flop_counter_counts_in_the_forward(net):
    """Each IR node's FLOPs are counted per op by ``torch.utils.flop_counter``'s registry, without the Python
    decompositions ``FlopCounterMode`` runs for ops it has no rule for (BatchNorm's: none of its parts has one
    either); on a BatchNorm net and on attention, the forward's total is the library's."""
    from torch.utils.flop_counter import FlopCounterMode

    model, x, loss_fn = nets.build(net, 2, 64, "meta", "float32")
    graph = trace(model, x, loss_fn=loss_fn).graph
    with FlopCounterMode(display=False) as counter:
        model(x)
    assert sum(graph.flops) == counter.get_total_flops() > 0


def test_a_callable_cost_model_weighs_each_call_and_the_dp_plans_by_it():
    """A user's cost model: each fx call weighed by a callable of (what it calls, its FLOPs), summed per IR node."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Linear(16, 2))
    seen = []

    def launches_and_flops(layer, flops):
        seen.append(type(layer).__name__)
        return flops + 1000.0

    g = trace(model, torch.randn(3, 8), cost_model=launches_and_flops).graph
    flops = trace(model, torch.randn(3, 8), cost_model="flops").graph.cost
    assert seen == ["Linear", "ReLU", "Linear", "Linear"]
    assert g.cost == (flops[0] + 2000.0, flops[1] + 1000.0, flops[2] + 1000.0)  # the ReLU writes the first value
    with pytest.raises(ValueError, match="a cost is a number of at least 0"):
        trace(model, torch.randn(3, 8), cost_model=lambda layer, flops: -1.0)


def test_measured_cost_model_times_each_layer_and_leaves_the_model_as_it_was():
    # NOTE [measured costs]: the timing runs write running statistics and draw dropout masks, from the default
    # generator and from one the model holds; all of it is put back, so the step that follows starts where
    # plain PyTorch's would.
    class OwnDraw(nn.Module):
        def __init__(self):
            super().__init__()
            self.generator = torch.Generator().manual_seed(1)

        def forward(self, x):
            return x + torch.rand(x.shape, generator=self.generator)

    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.Dropout(0.5),
                          OwnDraw(), nn.Conv2d(64, 64, 3, padding=1))
    x = torch.randn(8, 16, 64, 64)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    rng, own = torch.get_rng_state(), model[4].generator.get_state()
    traced = trace(model, x, cost_model="measured")
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng) and torch.equal(model[4].generator.get_state(), own)
    cost = dict(zip((members[0] for members in traced.members), traced.graph.cost))
    assert all(c > 0 for c in cost.values()), cost
    # milliseconds: a 3x3 convolution over 64 channels (2.4 GFLOP) takes far longer than a ReLU over its output
    assert cost["_5"] > 3 * cost["_2"], cost
    with pytest.raises(ValueError, match="meta holds no values to time"):
        trace(model.to("meta"), x.to("meta"), cost_model="measured")


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


def test_the_cost_model_benchmark_runs_each_plan_and_reads_it_back(tmp_path):
    """``harness.bench.cost_models`` on cpu: approx_dp's plan under each cost model at each budget, run and
    timed; the measured model's rows hold layer times in milliseconds, and its predicted step is vanilla's
    plus what it recomputes; the table drawn again from the rows alone is the same."""
    import pandas as pd

    from harness.bench import cost_models
    from harness.results import load_results

    args = [str(tmp_path / "c"), "--net", "resnet50", "--batch", "2", "--side", "32", "--points", "2",
            "--cost-models", "paper,measured", "--timed-steps", "1", "--rows", str(tmp_path / "rows")]
    cost_models.main(args)
    table = pd.read_csv(tmp_path / "c.csv")
    assert list(table["cost model"]) == ["paper", "measured"] * 2 and (table.status == "ok").all()
    assert (table["peak GB"] <= table["budget GB"] * 1.001).all()  # each within its budget (the tracker's figure)
    rows = load_results(tmp_path / "rows")
    measured = rows[(rows.cost_model == "measured") & (rows.status == "ok")]
    vanilla = rows[rows.strategy == "vanilla"].iloc[0]
    assert len(measured) == 2 and (measured.total_cost > 0).all()
    assert (table[table["cost model"] == "measured"]["predicted ms"] >= vanilla.step_time_ms).all()
    assert table[table["cost model"] == "paper"]["predicted ms"].isna().all()
    text = (tmp_path / "c.md").read_text()
    assert text.count("- at ") == 2 and ", eager" in text
    assert (tmp_path / "c.png").stat().st_size > 10_000
    cost_models.main([str(tmp_path / "again"), *args[1:], "--from-rows"])
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "again.csv"), table)
    with pytest.raises(SystemExit, match="valid: paper, flops, measured"):
        cost_models.main([str(tmp_path / "bad"), "--cost-models", "seconds"])
