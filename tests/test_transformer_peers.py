"""The transformer peers (``sac_ops``, ``megatron_selective``) and the Llama-class nets of the zoo: exact under
dropout, recomputing what their policies say, predicted to the byte on meta, and the 8B net traced and solved
on meta in seconds."""

import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import strategies
from harness.execute import peers
from harness.execute.exact import compare, tolerance
from harness.run import run_cell, traced_net
from harness.tracing.trace import trace
from harness.zoo import nets
from harness.zoo.nets import GPT2
from harness.zoo.netspec import next_token_loss

PEERS = [("sac_ops", {}), ("sac_ops", {"every_second_mm": True}), ("megatron_selective", {})]
TINY_LLAMA = {"kwargs": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 96, "attention_dropout": 0.1,
                         "max_position_embeddings": 64}}


def _tiny(net: str, device: str = "cpu"):
    """A GPT-2 and a Llama (grouped-query attention) small enough for float64 on the CPU, dropout on
    everywhere it can be: ``(model, tokens, loss_fn, blocks)``."""
    torch.manual_seed(0)
    if net == "gpt2":
        with torch.device(device):
            model = GPT2(vocab_size=96, context=32, width=32, depth=2, heads=4, dropout=0.1).train()
        blocks = [f"blocks.{i}" for i in range(2)]
    else:
        model, _, _ = nets.build("hf:llama", 2, 16, device=device, **TINY_LLAMA)
        blocks = nets.structure("hf:llama", model, **TINY_LLAMA)["blocks"]
    if device == "cpu":
        model = model.double()
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    return model, tokens, lambda out: next_token_loss(out, tokens), blocks


def _plan(name, options, model, tokens, loss_fn, blocks):
    structure = {"blocks": blocks, "sequence": []}
    graph = trace(model, tokens, loss_fn=loss_fn).graph
    return strategies.solve(name, graph, **{**peers.zoo_options(name, structure), **options}), structure


@pytest.mark.parametrize("net", ["gpt2", "llama"])
@pytest.mark.parametrize("name, options", PEERS)
def test_each_peer_is_exact_under_dropout_in_float64(net, name, options):
    model, tokens, loss_fn, blocks = _tiny(net)
    plan, structure = _plan(name, options, model, tokens, loss_fn, blocks)
    difference = compare(model, tokens, loss_fn, peers.step(plan, model, structure, tokens, loss_fn))
    assert difference.exact, difference
    assert difference.worst_gradient <= tolerance(torch.float64)


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls (``mm``, ``addmm``) that run while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in peers.MATMULS
        return func(*args, **(kwargs or {}))


def _backward_matmuls(step_of_plan, model, tokens, loss_fn) -> int:
    """The matmuls a step runs in its backward pass (gradients and recomputations)."""
    counter = _Matmuls()
    original = torch.Tensor.backward

    def counted(self, *args, **kwargs):
        with counter:
            return original(self, *args, **kwargs)

    torch.Tensor.backward = counted
    try:
        step_of_plan()
    finally:
        torch.Tensor.backward = original
    return counter.count


@pytest.mark.parametrize("net", ["gpt2", "llama"])
def test_the_op_policy_recomputes_no_matmul_and_every_second_mm_half_of_them(net):
    """Against the plain backward's matmuls: ``sac_ops`` adds none (every matmul output is saved), with
    ``every_second_mm`` it adds each block's 2nd, 4th, ... one, and checkpoint per block adds every one."""
    model, tokens, loss_fn, blocks = _tiny(net)
    per_block = sum(1 for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                    and path.startswith(blocks[0] + "."))
    counts = {}
    for name, options in [("vanilla", {}), ("torch_checkpoint_blocks", {}), *PEERS[:2]]:
        plan, structure = _plan(name, options, model, tokens, loss_fn, blocks)
        if name == "vanilla":
            step = lambda: loss_fn(model(tokens)).backward()  # noqa: E731
        else:
            step = peers.step(plan, model, structure, tokens, loss_fn)
        counts[name, tuple(options)] = _backward_matmuls(step, model, tokens, loss_fn)
    plain = counts["vanilla", ()]
    # checkpoint's early stop: a Llama block's last matmul (the MLP's down projection) saves only its input,
    # and the recomputation stops once that is saved again; GPT-2's MLP ends in a dropout, which runs it.
    rerun = per_block - (net == "llama")
    assert counts["torch_checkpoint_blocks", ()] == plain + len(blocks) * rerun
    assert counts["sac_ops", ()] == plain
    assert counts["sac_ops", ("every_second_mm",)] == plain + len(blocks) * (per_block // 2)


def test_the_attention_core_alone_is_recomputed():
    """``megatron_selective`` checkpoints each call of ``F.scaled_dot_product_attention`` and nothing else: its
    plan keeps every node and checkpoints exactly the attention nodes, one stage each."""
    model, tokens, loss_fn, blocks = _tiny("gpt2")
    plan, _ = _plan("megatron_selective", {}, model, tokens, loss_fn, blocks)
    graph = trace(model, tokens, loss_fn=loss_fn).graph
    cores = [v for v in range(len(graph)) if graph.kinds[v] == "attention"]
    assert len(cores) == 2 and plan.kept == graph.all_nodes
    assert [i for i in range(len(plan.stages)) if plan.checkpointed >> i & 1] == cores
    assert all(plan.stages[v] == 1 << v for v in cores)


@pytest.mark.parametrize("net, size", [("gpt2", (2, 256)), ("llama_1b", (1, 2048))])
def test_on_meta_each_peer_is_predicted_as_checkpoint_per_block_is(net, size, tmp_path):
    """The IR plans (``Plan.selective``: NOTE [selective checkpointing]) replay the real
    ``torch.utils.checkpoint`` runs: ``megatron_selective``'s measured peak is its prediction to the byte, and
    ``sac_ops``' is off it by what checkpoint per block's is on the same cell (nothing on GPT-2; on a Llama
    block, two per-token float32 values, 16 KiB at sequence 2048, 0.0002%, not yet explained), and the FLOPs
    the step ran equal the prediction (``megatron_selective``'s recomputation stops inside the attention's
    math decomposition, before its last batched matmul, so it runs at most the FLOPs predicted). At sequence
    2048 a Llama block's last matmul output, held by the policy's cache to the block's backward (past the
    early stop), decides the peak."""
    batch, side = size
    blocks, *rows = [run_cell(net, name, batch_size=batch, image_size=side, options=options, results_dir=tmp_path)
                     for name, options in [("torch_checkpoint_blocks", {}), *PEERS]]
    gap = blocks["measured_peak_bytes"] - blocks["predicted_peak_bytes"]
    assert 0 <= gap <= (0 if net == "gpt2" else 1e-5 * blocks["measured_peak_bytes"])
    for row in rows:
        assert row["status"] == "ok", row.get("error")
    sac, every_second, megatron = rows
    for row in (sac, every_second):  # blocks checkpointed, as checkpoint per block's
        assert row["measured_peak_bytes"] - row["predicted_peak_bytes"] == gap, row["options"]
    assert megatron["measured_peak_bytes"] == megatron["predicted_peak_bytes"]  # only the attention checkpointed
    assert sac["measured_step_flops"] == sac["predicted_step_flops"]
    assert every_second["measured_step_flops"] == every_second["predicted_step_flops"] > sac["measured_step_flops"]
    assert megatron["measured_step_flops"] <= megatron["predicted_step_flops"]


def test_where_a_peer_cannot_apply_the_row_says_why(tmp_path):
    row = run_cell("resnet50", "megatron_selective", batch_size=2, image_size=64, results_dir=tmp_path)
    assert row["status"] == "infeasible" and "no attention core" in row["error"]
    row = run_cell("vgg19", "sac_ops", batch_size=2, image_size=32, results_dir=tmp_path)
    assert row["status"] == "infeasible" and "no block of the net holds a matrix multiplication" in row["error"]
    row = run_cell("torchvision:resnet18", "sac_ops", batch_size=2, image_size=32, results_dir=tmp_path)
    assert row["status"] == "infeasible" and "no blocks to checkpoint" in row["error"]
    # torchvision's ViT computes attention inside nn.MultiheadAttention, one node of the trace
    row = run_cell("vit_b_16", "megatron_selective", batch_size=1, results_dir=tmp_path)
    assert row["status"] == "infeasible" and "inside nn.MultiheadAttention (encoder.layers." in row["error"]
    row = run_cell("vit_b_16", "sac_ops", batch_size=1, results_dir=tmp_path)
    assert row["status"] == "ok" and row["measured_peak_bytes"] and row["predicted_peak_bytes"] is None
    assert row["plan_prediction"].startswith("none: the policy saves the matmuls inside nn.MultiheadAttention")
    row = run_cell("vit_b_16", "sac_ops", batch_size=1, budget="4GB", results_dir=tmp_path)
    assert row["status"] == "infeasible" and "no prediction to judge a budget by" in row["error"]


def _llama_parameters(config) -> int:
    """Llama's parameter count from its config: embeddings (tied or not), per layer the attention's four
    projections (grouped-query: keys and values at ``num_key_value_heads``), the gated MLP's three and two
    RMSNorm weights, and the final norm."""
    h, head = config.hidden_size, config.head_dim
    attention = 2 * h * config.num_attention_heads * head + 2 * h * config.num_key_value_heads * head
    layer = attention + 3 * h * config.intermediate_size + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * layer + h


@pytest.mark.parametrize("net, billions", [("llama_1b", 1.2), ("llama_8b", 8.0)])
def test_the_llama_nets_are_built_as_their_configs_say(net, billions):
    model, tokens, _ = nets.build(net)
    config = model.model.config
    count = sum(p.numel() for p in model.parameters())
    assert count == _llama_parameters(config)
    assert round(count / 1e9, 1) == billions
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and config._attn_implementation == "sdpa"
    assert tokens.shape == (nets.spec(net).batch_size, nets.spec(net).image_size)
    assert len(nets.structure(net, model)["blocks"]) == config.num_hidden_layers


def test_the_8b_net_traces_and_solves_on_meta_within_a_minute():
    """Trace and ``approx_dp`` together within a minute, the solve within 2 s; ``exact_dp`` (906,136 lower
    sets) and ``optimal`` end within their time limits, give or take a block of the DP's passes or CP-SAT's
    own overrun: the exact DP with a timeout naming ``approx_dp``, the optimum with the DPs' plan, its lower
    bound and gap."""
    start = time.perf_counter()
    graph = traced_net("llama_8b").traced.graph
    plan = strategies.solve("approx_dp", graph, None)
    assert time.perf_counter() - start <= 60
    assert plan.solve_time_s <= 2
    assert len(graph) > 32 * 30  # the 32 decoder layers' ops, each a node
    assert math.isfinite(strategies.simulate(graph, plan).peak_bytes)
    limit, over = 8.0, 4.0
    start = time.perf_counter()
    with pytest.raises(strategies.SolverTimeout, match="exact_dp: no plan within 8 s over .* approx_dp"):
        strategies.solve("exact_dp", graph, None, time_limit_s=limit)
    assert time.perf_counter() - start <= limit + over
    best = strategies.solve("optimal", graph, None, time_limit_s=limit)
    assert best.solve_time_s <= limit + over
    cost = strategies.simulate(graph, best).overhead_cost
    assert best.info["optimal_status"] == "timeout" and 0 <= best.info["lower_bound"] <= cost
    assert best.info["gap"] == pytest.approx((cost - best.info["lower_bound"]) / cost)


def test_the_op_policys_plan_on_a_hand_worked_block():
    """a -> (b, c) -> d, with b, c and d in one block: b a linear layer, c an attention, d a linear layer. The
    block is one checkpointed stage after a's own; the policy saves both linears (every second matmul: the
    first only); the kept set is the block's input a, which its recomputation reads, and what the policy saves."""
    graph = strategies.Graph(mem_bytes=[1, 2, 3, 4], cost=[1, 1, 1, 1], edges=[(0, 1), (0, 2), (1, 3), (2, 3)],
                             kinds=["op", "linear", "attention", "linear"],
                             scopes=["", "block.q", "block.attention", "block.o"])
    plan = strategies.solve("sac_ops", graph, blocks=("block",))
    assert plan.stages == (0b0001, 0b1110) and plan.checkpointed == 0b10 and plan.policy == "ops"
    assert plan.selective == 0b1010 and plan.kept == 0b1011 and plan.recomputed == 0b0100
    half = strategies.solve("sac_ops", graph, blocks=("block",), every_second_mm=True)
    assert half.selective == 0b0010 and half.kept == 0b0011 and half.policy == "ops_every_second_mm"
    megatron = strategies.solve("megatron_selective", graph)
    assert megatron.stages == (1, 2, 4, 8) and megatron.checkpointed == 0b0100 and megatron.kept == 0b1111
