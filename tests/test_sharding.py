"""One rank under FSDP2 (NOTE [a rank under FSDP2] in harness/execute/sharding.py): the static part is what
``fully_shard`` holds, measured on a fake process group; the plan's step releases each gradient as it is
accumulated, and the replay predicts that step to the byte."""

import pytest

from harness.execute import sharding
from harness.run import run_cell
from strategies import Graph, Plan, simulate

TINY_LLAMA = {"kwargs": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}}


def _parameters(net_options) -> tuple[int, int]:
    """The model's parameters, and its parameter tensors."""
    from harness.zoo import nets

    model, _, _ = nets.build("hf:llama", 1, 16, **net_options)
    return sum(p.numel() for p in model.parameters()), len(list(model.parameters()))


def test_the_static_part_is_fsdp2s_shards_and_adamw_states():
    """Sharded float32 parameters and AdamW's two states a parameter, each a 1/world_size share of the
    model's (FSDP2 pads each parameter's first dimension to a multiple of the ranks), and AdamW's step count,
    one float32 a parameter tensor."""
    count, tensors = _parameters(TINY_LLAMA)
    for world_size in (1, 4):
        parts = sharding.fsdp2_static("hf:llama", world_size, "adamw", "bfloat16", TINY_LLAMA)
        share = 4 * count / world_size
        assert share <= parts["Sharded Param"] <= share * 1.05, (world_size, parts)
        assert parts["OptState"] == 2 * parts["Sharded Param"] + 4 * tensors
        assert parts["static_bytes"] == parts["Total"] - parts["Activation"] - parts["Inputs"]
    without = sharding.fsdp2_static("hf:llama", 4, "none", "bfloat16", TINY_LLAMA)
    assert without.get("OptState", 0) == 0 and without["static_bytes"] < parts["static_bytes"]


@pytest.mark.parametrize("net, size, options", [("llama_1b", (1, 512), {}), ("hf:llama", (2, 32), TINY_LLAMA)])
def test_a_rank_is_predicted_to_the_byte(net, size, options, tmp_path):
    batch, side = size
    static = sharding.fsdp2_static(net, 8, "adamw", "bfloat16", options)["static_bytes"]
    for strategy in ("vanilla", "approx_dp", "megatron_selective"):
        row = run_cell(net, strategy, batch_size=batch, image_size=side, world_size=8, shard="fsdp2",
                       optimizer="adamw", dtype="bfloat16", net_options=options, results_dir=tmp_path)
        assert row["status"] == "ok", row.get("error")
        assert row["measured_peak_bytes"] == row["predicted_peak_bytes"], strategy
        assert row["rank_static_bytes"] == static
        assert row["measured_peak_bytes"] == static + row["rank_activations_bytes"]
        assert row["row_path"].endswith("__fsdp2-w8__adamw.json")
    unsharded = run_cell(net, "vanilla", batch_size=batch, image_size=side, dtype="bfloat16", net_options=options)
    assert unsharded["measured_peak_bytes"] == unsharded["predicted_peak_bytes"]
    assert row["rank_activations_bytes"] < unsharded["measured_peak_bytes"]


def test_released_gradients_go_as_their_backward_ends_and_a_shared_ones_after_its_last_reader():
    """A chain a -> b -> c: c's parameters (4 bytes) and a parameter b and a share (8 bytes, made at b, the
    last reader in the forward). Kept, the gradients stay to the end; released, c's go at once and the
    shared one once a's backward is done."""
    graph = Graph(mem_bytes=[1, 1, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)], param_bytes=[0, 8, 4],
                  param_sharers=[(), (0,), ()])
    plan = Plan.from_stages(graph, [graph.all_nodes], kept=graph.all_nodes)
    kept = simulate(graph, plan).peak_bytes
    released = simulate(Graph(**{**_fields(graph), "param_grads_released": True}), plan).peak_bytes
    assert kept - released == 4  # c's gradient no longer under b's and a's backward
    from strategies.replay import Buffer, timeline

    steps = timeline(Graph(**{**_fields(graph), "param_grads_released": True}), plan)
    freed_at = {key[1]: step.node for step in steps for key in step.frees if key[0] == Buffer.PARAM_GRAD}
    assert freed_at == {2: 2, 1: 0}


def _fields(graph: Graph) -> dict:
    return dict(mem_bytes=graph.mem_bytes, cost=graph.cost, edges=graph.edges, param_bytes=graph.profile.param_bytes,
                param_sharers=graph.profile.param_sharers)


@pytest.mark.parametrize("arguments, message", [
    ({"world_size": 0, "shard": "fsdp2"}, "world_size must be a whole number of ranks, at least 1, got 0"),
    ({"world_size": 8}, "world_size=8 needs shard=fsdp2"),
    ({"shard": "zero3"}, "unknown shard 'zero3'; valid: none, fsdp2"),
    ({"shard": "fsdp2", "optimizer": "sgd"}, "unknown optimizer 'sgd'; valid: none, adamw"),
    ({"optimizer": "adamw"}, "optimizer=adamw is measured with shard=fsdp2"),
    ({"shard": "fsdp2", "device": "cpu"}, "shard=fsdp2 is measured on device=meta"),
])
def test_bad_sharding_is_refused_naming_the_choices(arguments, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_cell("llama_1b", "vanilla", **arguments)


def test_a_net_without_units_to_shard_says_so(tmp_path):
    row = run_cell("torchvision:resnet18", "vanilla", batch_size=2, image_size=64, shard="fsdp2", world_size=2,
                   results_dir=tmp_path)
    assert row["status"] == "error" and "torchvision:resnet18 has no units to shard" in row["error"]
