"""Batch-invariant matmul: c = a @ b (+ bias) (+ activation), the same bits for a row of `a`
whatever the number of rows M.

Row i of c is a dot product of row i of a with every column of b. A library picks its tile
shape and its split of the K reduction from (M, N, K) so that small M still fills the GPU;
the split changes the order of the additions, so row i changes with M. Here one tile
configuration (BLOCK_M, BLOCK_N, BLOCK_K) per dtype serves every M, and each program walks
the whole K dimension in steps of BLOCK_K: one fixed order of additions per output element.
Masked rows (beyond M) load zeros and never touch the other rows of the tile.

FLOPs 2*M*N*K; bytes (M*K + K*N + M*N) * element size at best.
"""

import torch
import triton
import triton.language as tl

from kernels.batch_invariant.rows import add_combine
from kernels.launch import cdiv, launch
from kernels.matmul import matmul_fake, matmul_grads, save_operands
from kernels.matmul import matmul_ref as matmul_ref  # the course's reference: the same maths
from kernels.operators import operator, through_operator
from kernels.primitives import epilogue, grouped_tile, matmul_launch_metadata
from kernels.runtime import INTERPRET, pick
from kernels.validate import check_matmul_inputs, input_precision

# DOT_ON_CPU: on the GPU, tl.dot runs on tensor cores (or FMA units for IEEE fp32), and an
# output element's sum does not depend on which row of the tile it sits in. Under the CPU
# interpreter, tl.dot calls numpy's BLAS, which rounds a row differently depending on its
# position in the block (rows 0-5 and 6-11 take different code paths). So the kernels here
# take USE_DOT=False under the interpreter and sum the products over K explicitly, in
# order. (Written out in each kernel: the interpreter pays milliseconds for every call of a
# @jit helper; see add_combine in kernels/primitives.py.)

# One configuration per dtype, for every M (the point of this kernel). On the GPU, 128x256x64
# with 8 warps and 3 stages is a strong tile for large bf16/fp16 matmuls on Hopper; fp32 takes
# a smaller K step. The interpreter takes one smaller tile (its explicit sum over K holds a
# BLOCK_M x BLOCK_K x BLOCK_N product, and Triton caps a block at 2**20 elements).
_BIG_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
_FP32_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
_CPU_TILE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)
CONFIGS = pick(
    cpu={torch.bfloat16: _CPU_TILE, torch.float16: _CPU_TILE, torch.float32: _CPU_TILE},
    gpu={torch.bfloat16: _BIG_TILE, torch.float16: _BIG_TILE, torch.float32: _FP32_TILE},
)


# M is not specialized: Triton would otherwise compile a different kernel for M == 1 or for M
# divisible by 16, and the point is one kernel for every M.
@triton.jit(do_not_specialize=["M"], launch_metadata=matmul_launch_metadata)
def invariant_matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)

    # 64-bit offsets: tensors may pass 2**31 elements (and the interpreter checks every
    # 32-bit integer operation for overflow, which is slow)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K, in order: no split-K
        k_left = K - k0
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:  # see DOT_ON_CPU
            acc += tl.reduce(
                a[:, :, None].to(tl.float32) * b[None, :, :].to(tl.float32), 1, add_combine
            )
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = epilogue(acc, bias_ptr, offs_n, N, HAS_BIAS, ACTIVATION)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    # K == 0 launches too: the loop over K takes no step and the epilogue alone writes
    # act(bias), or zeros (no torch matmul here, which batch_invariant_mode routes back to us)
    cfg = CONFIGS[a.dtype]
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    launch(invariant_matmul_kernel, grid,
        a, b, bias if bias is not None else c, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, ACTIVATION=activation,
        INPUT_PRECISION=input_precision(a.dtype), USE_DOT=not INTERPRET, **cfg,
    )  # fmt: skip
    return c


# torch.ops.brrr.invariant_matmul. Its backward is the course's matmul backward (three
# matmuls) through this same operator, so the gradients are batch-invariant too.
invariant_matmul = operator("invariant_matmul", _matmul, matmul_fake)
invariant_matmul.register_autograd(
    lambda ctx, dout: matmul_grads(invariant_matmul, ctx, dout), setup_context=save_operands
)


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias (N,)) then `activation` in {None, "gelu", "relu"}; fp32
    accumulation, output in the inputs' dtype. Row i of the result does not depend on M.
    The operator torch.ops.brrr.invariant_matmul; differentiable."""
    check_matmul_inputs(a, b, bias, activation)
    if through_operator(a, b, bias):
        return invariant_matmul(a, b, bias, activation)
    return _matmul(a, b, bias, activation)
