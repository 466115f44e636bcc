"""int8 weight-only linear: y = x @ (q * scale[:, None]).T (+ bias), the weight stored as int8
q (N, K) with one fp32 scale per output channel, dequantized inside the kernel.

Why this is the first quantization lesson:
- Decode is memory-bound (kernels.gemv): its time is the weight's bytes over the bandwidth. An
  int8 weight is half a bf16 one, so a step can take about half the time; nothing else about
  the product changes.
- One scale per output channel (row of the weight), symmetric: scale = absmax(row) / 127 and
  q = round(w / scale), so |w - q * scale| <= scale / 2. A row's scale follows its own range,
  and an outlier spoils only its own row's resolution, not the whole matrix's.
- The math stays bf16/fp32: each int8 tile is converted to x's dtype in registers (exact,
  |q| <= 127), multiplied on the tensor cores and accumulated in fp32; the scale multiplies the
  fp32 sum once per output, in the epilogue (q's sum scaled once, not every product). No int8
  activations, no calibration: weights only, quantized once at load.

The kernel is kernels.split_k's with an int8 right-hand side (kind "int8": its own tile list,
twice the K per load for the same bytes), and the same rule: tile and split from N, K and the
dtypes, never M, so a row's result does not depend on the batch.

Bytes: N*K (int8) + 4N (scales) + (M*K + M*N (+ N)) in x's dtype. Forward only.
"""

import torch

from kernels.gemv import check_linear_inputs
from kernels.operators import forward_road, operator
from kernels.split_k import product
from kernels.validate import check_tensor

QMAX = 127  # symmetric: -127..127 (-128 unused, so q and -q are both representable)
QUANTIZE_ROWS = 4096  # rows quantized at once: 4096 x 8192 fp64 quotients are 256 MiB


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 (N, K), scale fp32 (N,)) for a float weight (N, K): per output channel,
    symmetric, scale = absmax / 127 (0 for an all-zero row, whose q is 0), q the nearest integer
    to w / scale, so |w - q * scale| <= scale / 2. The quotients are taken in fp64 (in fp32 one
    that is just under k + 1/2 can round up to it, then away from w), a block of rows at a time."""
    check_tensor("weight", weight, ndim=2)
    n, k = weight.shape
    scale = torch.zeros(n, dtype=torch.float32, device=weight.device)
    if k:
        # (N,): the quotient in fp64, then rounded once to fp32 (on a GPU, fp32 `/ 127` runs
        # as a product with 1/127, which can land an ulp off the correctly rounded quotient)
        scale = (weight.abs().amax(dim=1).double() / QMAX).float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    q = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    for start in range(0, n, QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        quotient = weight[rows].double() / step[rows, None]
        q[rows] = torch.round(quotient).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q * scale[:, None] in fp32 (fp64 for an fp64 scale), then `dtype`: the weight the kernel
    computes with, for references and error measurements."""
    compute = torch.promote_types(scale.dtype, torch.float32)
    return (qweight.to(compute) * scale.to(compute)[:, None]).to(dtype)


def check_int8_inputs(x, qweight, scale, bias):
    check_linear_inputs(x, qweight, bias, weight_dtypes=(torch.int8,))
    check_tensor("scale", scale, dtypes=(torch.float32,), ndim=1)
    if scale.shape[0] != qweight.shape[0] or scale.device != x.device:
        raise ValueError(
            f"scale must be ({qweight.shape[0]},) on {x.device}, one per output channel, "
            f"got {tuple(scale.shape)} on {scale.device}"
        )


def _linear_int8(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    # b = q.T: (K, N), K-contiguous; the scale is read once per output column
    return product(x, qweight.t(), kind="int8", scale=scale.contiguous(), bias=bias)


def _linear_int8_fake(x, qweight, scale, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))


# Forward only: no autograd is registered, so a backward through it raises (decode needs none).
linear_int8_op = operator("linear_int8", _linear_int8, fake=_linear_int8_fake)


def linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias=None):
    """x @ (qweight * scale[:, None]).T + bias for x (M, K) in fp32/fp16/bf16, qweight int8
    (N, K), scale fp32 (N,), bias (N,) in x's dtype or None (from `quantize`). fp32
    accumulation; the output has x's dtype. The operator torch.ops.brrr.linear_int8; forward
    only."""
    check_int8_inputs(x, qweight, scale, bias)
    call = forward_road(linear_int8_op, x, scale, bias)  # the roads of kernels.operators
    return _linear_int8(x, qweight, scale, bias) if call is None else call(x, qweight, scale, bias)


def linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias=None):
    """x @ dequantize(qweight, scale).T + bias in fp32 (fp64 for fp64 x), output in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = x.to(compute) @ dequantize(qweight, scale, compute).t()
    if bias is not None:
        out = out + bias.to(compute)
    return out.to(x.dtype)
