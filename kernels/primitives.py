"""Triton building blocks that several ops share, each written once.

- LOG2E: exp(x) = exp2(x * log2(e)); exp2 is the GPU's native instruction (attention).
- gelu: the exact (erf) GELU, F.gelu's default (bias_gelu and the matmul epilogues).
- grouped_tile: the order in which a matmul's programs visit output tiles (both matmuls).
- epilogue: bias and activation applied to a matmul's fp32 tile before its one store.

A kernel may read a module-level constant only if it is a `tl.constexpr`; host code reads
its `.value`.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
INV_SQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def gelu(z):
    """Exact GELU in fp32: z * Phi(z) = 0.5 z (1 + erf(z / sqrt(2)))."""
    return 0.5 * z * (1.0 + tl.erf(z * INV_SQRT2))


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): the tile of c this program computes, in grouped order. Consecutive
    programs walk down a column of GROUP_M tiles before moving right, so the rows of a and
    columns of b they share are still in L2 when read again. The order changes when a tile
    is computed, never how."""
    pid = tl.program_id(0)
    tiles_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // tiles_per_group) * GROUP_M
    group_height = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    in_group = pid % tiles_per_group
    return first_m + in_group % group_height, in_group // group_height


@triton.jit
def epilogue(acc, bias_ptr, cols, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(acc + bias) on the fp32 tile while it is still in registers (elementwise, so it
    cannot change a result's dependence on the batch)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        acc = gelu(acc)
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    return acc
