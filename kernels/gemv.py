"""The decode matmul: y = x @ weight.T (+ bias) for x (M, K) with M = 1..64 rows (a decoding
step's batch) and an nn.Linear weight (N, K), each output reading one K-contiguous weight row.

Decode is memory-bound: N*K weight elements are read for 2*M*N*K FLOPs, M FLOPs per byte of
bf16 weight, against about 200 FLOPs a byte at an H200's ridge point. The time is the weight's
bytes over the bandwidth (117 MB for N=14336, K=4096: 28 us at 4.2 TB/s), and a kernel wins by
keeping enough loads in flight to reach it.

The kernel is kernels.split_k's, with tl.dot and the rows padded to BLOCK_M >= 16 (tl.dot's
least). A CUDA-core FMA kernel would suit M = 1, but at M = 64 it needs 64 FMAs per weight
element where an H200's CUDA cores manage about 14 while HBM delivers one (67 TFLOP/s of fp32
against 2.4 T elements/s), so it would have to hand over to tl.dot above some M, and a row's
bits would then change with the batch size. Padded rows cost tensor-core FLOPs, which decode
has to spare. One kernel, with one tile and one split for every M (chosen from N, K and the
dtype: kernels.split_k_tuning, kind "gemv"), keeps a row's result the same whatever the batch
(Chapter 5). Where N / BLOCK_N tiles leave SMs idle (N = 4096, K = 14336), K is split and the
partials reduced in a fixed order.

Bytes: N*K + M*K + M*N elements (+ N for the bias). Forward only.
"""

import torch

from kernels.operators import forward_road, operator
from kernels.split_k import product
from kernels.validate import check_same, check_tensor

MAX_ROWS = 64  # the decode shapes the kernel is tuned for; more rows work, a matmul suits them


def check_linear_inputs(x, weight, bias, weight_dtypes=None):
    """x (M, K) and weight (N, K) on one device, bias (N,) in x's dtype or None; the weight in
    x's dtype, or (kernels.int8) in one of `weight_dtypes`."""
    check_tensor("x", x, ndim=2)
    if weight_dtypes is None:
        check_tensor("weight", weight, ndim=2)
        check_same("x and weight", x, weight, shape=False)
    else:
        check_tensor("qweight", weight, dtypes=weight_dtypes, ndim=2)
        if weight.device != x.device:
            raise ValueError(
                f"x and qweight must be on one device, got {x.device}, {weight.device}"
            )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x @ weight.T needs x's columns to match weight's: x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)} (an nn.Linear weight is (out_features, in_features))"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        check_same("x and bias", x, bias, shape=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return product(x, weight.t(), kind="gemv", bias=bias)  # b = W.T: (K, N), K-contiguous


def _linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


# Forward only: no autograd is registered, so a backward through it raises (decode needs none).
linear_op = operator("linear", _linear, fake=_linear_fake)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ weight.T + bias, as F.linear, for x (M, K), weight (N, K), bias (N,) or None, all of
    one dtype (fp32, fp16, bf16). fp32 accumulation; the output has x's dtype. A row's result
    does not depend on M. The operator torch.ops.brrr.linear; forward only."""
    check_linear_inputs(x, weight, bias)
    call = forward_road(linear_op, x, weight, bias)  # the roads of kernels.operators
    return _linear(x, weight, bias) if call is None else call(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear in fp32 (fp64 for fp64 inputs), output in x's dtype. Reads N*K + M*K (+ N),
    writes M*N elements."""
    compute = torch.promote_types(x.dtype, torch.float32)
    out = x.to(compute) @ weight.to(compute).t()
    if bias is not None:
        out = out + bias.to(compute)
    return out.to(x.dtype)
