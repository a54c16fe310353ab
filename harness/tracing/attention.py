"""Scaled dot-product attention as the device will run it, for a trace made on meta.

NOTE [attention on the device]
``scaled_dot_product_attention`` picks its kernel by device: on meta always the math path (it saves the
attention matrix and the scaled queries and keys), on the CPU a fused kernel where it can (without
dropout: it saves the queries, keys and values themselves, the output and the log-sum-exp), on CUDA flash,
memory-efficient or cuDNN attention. The probe must size what the device will run: traced on meta, a plan
that discarded keys which only the CPU's kernel saves crashed on the CPU (the executor found a backward
reading what no plan kept), and other plans' peaks were 3-8% off. So for a CPU input the trace asks the
CPU's own choice (``torch._fused_sdp_choice``, of empty tensors with the same sizes and strides) and runs
that kernel on meta, whose saved tensors match the CPU's (tested). On meta, trace and tracker both run the
math path. A CUDA input is still traced so: asking the GPU, and running flash or memory-efficient
attention on meta as CUDA pads and masks them, is left to check against on a GPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

from harness.tracing.tracer import on_meta_like


_ATTENTION = torch.nn.functional.scaled_dot_product_attention


@contextlib.contextmanager
def attention_as_on(device: torch.device, gm: fx.GraphModule):
    """While the trace runs on meta, ``scaled_dot_product_attention`` picks the kernel ``device`` would
    (NOTE [attention on the device]): the fx nodes that call it and the name modules call it by
    (``nn.MultiheadAttention``'s) lead to ``attention_on_cpu`` for a CPU input."""
    if device.type != "cpu":
        yield
        return
    nodes = [node for node in gm.graph.nodes if node.target is _ATTENTION]
    for node in nodes:
        node.target = attention_on_cpu
    torch.nn.functional.scaled_dot_product_attention = attention_on_cpu
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = _ATTENTION
        for node in nodes:
            node.target = _ATTENTION
        if nodes:
            gm.recompile()  # its code may have been made meanwhile (augmented assignments turned out of place)


def attention_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """``scaled_dot_product_attention`` on meta as the CPU runs it: its fused kernel where the CPU's
    choice (asked of empty tensors of the same sizes and strides) is that one, else the math path, as on
    meta."""
    if query.device.type == "meta" and not enable_gqa:
        with _disable_current_modes():  # no tracker counts the empty tensors
            like = [on_meta_like(t, device="cpu") for t in (query, key, value, attn_mask)]
            choice = torch._fused_sdp_choice(*like, dropout_p, is_causal, scale=scale)
            del like
        if choice == torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU converts it
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _ATTENTION(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                      scale=scale, enable_gqa=enable_gqa)
