"""The tracer against a published closed form: Korthikanti et al. 2022 (Table 2) give a transformer layer's
activation bytes in 16-bit precision, with ``s`` the sequence, ``b`` the batch, ``h`` the hidden size and ``a``
the heads:

- without recomputation ``s·b·h·(34 + 5·a·s/h)``;
- with selective recomputation (the attention core recomputed) ``34·s·b·h``;
- with full recomputation (each layer's input kept alone) ``2·s·b·h``.

A GPT-style layer (``harness.zoo.nets.GPT2Block``: pre-norm, biases, dropout after the attention's softmax and on
both residual branches) in bfloat16 on meta, whose ``F.scaled_dot_product_attention`` runs PyTorch's math
decomposition (eager attention, no flash kernel). What the trace holds per layer is what the replay holds at
the turn to the backward pass, a layer's worth (three layers less two), under ``vanilla``,
``megatron_selective`` and ``torch_checkpoint_blocks``. Every byte it holds beyond the formula is named
below; a change in what the trace counts fails the test."""

import pytest
import torch
from torch import nn

import strategies
from harness.tracing.trace import trace
from harness.zoo.nets import GPT2Block
from harness.zoo.netspec import sum_loss
from strategies.replay import Phase, timeline

SIZES = [(128, 2, 256, 4), (256, 3, 512, 8)]  # s, b, h, a


def held_at_the_turn(graph, plan) -> int:
    """What the replay holds once the forward pass (the loss's too) is done, before the backward starts."""
    live, sizes = 0, {}
    for step in timeline(graph, plan):
        if step.phase == Phase.BACKWARD:
            return live
        for key, size in step.allocs:
            sizes[key] = size
            live += size
        for key in step.frees:
            live -= sizes.pop(key)
    raise AssertionError("the replay has no backward pass")


def per_layer(s, b, h, a, strategy) -> int:
    held = []
    for layers in (2, 3):
        with torch.device("meta"):
            model = nn.Sequential(*[GPT2Block(h, a, 0.1) for _ in range(layers)]).to(torch.bfloat16).train()
            x = torch.randn(b, s, h, dtype=torch.bfloat16)
        graph = trace(model, x, loss_fn=sum_loss).graph
        options = {"blocks": tuple(str(i) for i in range(layers))} if strategy == "torch_checkpoint_blocks" else {}
        held.append(held_at_the_turn(graph, strategies.solve(strategy, graph, **options)))
    return held[1] - held[0]


@pytest.mark.parametrize("s, b, h, a", SIZES)
def test_a_layers_activations_as_korthikanti_et_al_count_them(s, b, h, a):
    sbh, as2b = s * b * h, a * s * s * b
    # Named differences, in bytes:
    # - each of the two residual dropouts keeps its mask in the activations' dtype (2 bytes an element; CUDA's
    #   fused dropout keeps a bool, the formula's 1 byte);
    masks = 2 * sbh
    # - each of the two LayerNorms saves its mean and reciprocal standard deviation, one float32 a token;
    norm_statistics = 2 * 2 * 4 * s * b
    # - the math decomposition computes attention in float32 from 16-bit inputs: it saves float32 copies of
    #   the scaled queries and keys and of the values (12·sbh, where the formula keeps the 16-bit Q, K and V,
    #   6·sbh, which then nothing holds), and its softmax output, dropout mask and dropout output in float32
    #   (4 bytes an element each: 12·as²b where the formula counts 2 + 1 + 2).
    core = (12 * sbh - 6 * sbh) + (12 * as2b - 5 * as2b)
    assert per_layer(s, b, h, a, "vanilla") == sbh * 34 + 5 * as2b + masks + norm_statistics + core
    # Selective: checkpoint's frame holds the core's inputs, the 16-bit Q, K and V (one buffer of the three,
    # 6·sbh, as the formula counts them), and nothing the core saves.
    assert per_layer(s, b, h, a, "megatron_selective") == 34 * sbh + masks + norm_statistics
    # Full: the layer's input alone, exactly.
    assert per_layer(s, b, h, a, "torch_checkpoint_blocks") == 2 * sbh
