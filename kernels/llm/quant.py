"""int8 weight-only quantization of a loaded model (Chapter 6, v3): every linear layer's weight
becomes int8 with one fp32 scale per output channel (kernels.int8.quantize), the head included
(a tied head gets its own int8 copy: the embedding lookup stays in the float dtype, it reads
one row per token). Bytes per step: about half of bf16's, a quarter of fp32's."""

import torch
from torch import nn

from kernels import int8

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@torch.no_grad()
def quantize_int8(model, head: bool = True):
    """Quantize `model`'s linear weights in place (and the head, unless head=False); returns it.
    Each nn.Linear keeps its int8 weight as `weight` (no gradient) and its scale as a buffer
    `scale`; kernels.llm.model.project sends both to ops.linear."""
    for block in model.layers:
        for name in LINEARS:
            _quantize_linear(getattr(block, name))
    if head:
        weight = model.embed.weight if model.config.tied_embeddings else model.head.weight
        q, scale = int8.quantize(weight)
        model.register_buffer("head_int8", q, persistent=False)
        model.register_buffer("head_scale", scale, persistent=False)
    return model


def _quantize_linear(linear: nn.Linear):
    if linear.weight.dtype == torch.int8:
        raise ValueError("this model's weights are int8 already")
    q, scale = int8.quantize(linear.weight)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.register_buffer("scale", scale, persistent=False)


def weight_bytes(model) -> int:
    """The bytes of weight one decoding step reads: every linear weight (and scale) and the
    head; the embedding table only where it is the head (a lookup reads a row per token)."""
    total = 0
    for block in model.layers:
        for name in LINEARS:
            linear = getattr(block, name)
            total += linear.weight.nbytes + getattr(linear, "scale", torch.empty(0)).nbytes
        total += block.attn_norm.weight.nbytes + block.mlp_norm.weight.nbytes
    total += model.norm.weight.nbytes
    if hasattr(model, "head_int8"):
        return total + model.head_int8.nbytes + model.head_scale.nbytes
    head = model.embed.weight if model.config.tied_embeddings else model.head.weight
    return total + head.nbytes
