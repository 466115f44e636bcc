"""Negative controls: kernels that are deliberately NOT batch-invariant, or NOT deterministic.

A harness is only worth something if it can fail. These are the ops it must catch (and the
chapter's demonstration of where the bits come from); nothing in the course computes with them.

split_k_matmul, the batch-VARIANT control: a matmul that, as libraries do, splits the K
reduction when the output has too few tiles to keep every processor busy, choosing the split
from M (`split_k_for`). Each split sums its part of K; the partial sums are then added in a
fixed order. Deterministic run to run, but a row's bits change with M, because its sum is cut
into a different number of pieces. It pairs with full_k_matmul.py, which never splits K.

atomic_row_sum, the NONDETERMINISTIC control: row sums where many programs `atomic_add` their
partial sums into one output: the additions land in whatever order the programs finish. On a
GPU the bits change from run to run; under the CPU interpreter programs run one after another,
so they do not.
"""

import torch
import triton
import triton.language as tl

from kernels.batch_invariant.rows import add_combine
from kernels.launch import cdiv
from kernels.runtime import INTERPRET, pick, processors
from kernels.validate import check_matmul_inputs, check_tensor, input_precision

SPLIT_CONFIG = pick(
    cpu=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32),
    gpu=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
)
MAX_SPLIT_K = 16


def split_k_for(M: int, N: int, K: int) -> int:
    """How many pieces to cut K into for an (M, N, K) matmul: double the split while the tiles
    times the split still fit the processors and each piece keeps at least two K blocks."""
    cfg = SPLIT_CONFIG
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = 1
    while (
        split < MAX_SPLIT_K
        and tiles * split * 2 <= processors()
        and K // (split * 2) >= 2 * cfg["BLOCK_K"]
    ):
        split *= 2
    return split


@triton.jit
def split_k_matmul_kernel(
    a_ptr, b_ptr, part_ptr, M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn,
    INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    k_end = tl.minimum((split + 1) * k_per_split, K)
    for k0 in range(split * k_per_split, k_end, BLOCK_K):  # this split's part of K only
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end),
            other=0.0,
        )
        b = tl.load(
            b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
            mask=(offs_k[:, None] < k_end) & (offs_n[None, :] < N),
            other=0.0,
        )
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:  # see DOT_ON_CPU in kernels/batch_invariant/full_k_matmul.py
            acc += tl.reduce(
                a[:, :, None].to(tl.float32) * b[None, :, :].to(tl.float32), 1, add_combine
            )
    part = part_ptr + split.to(tl.int64) * M * N  # partial sums: (split, M, N) fp32
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


def split_k_matmul(a: torch.Tensor, b: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """The batch-variant control: a (M, K) @ b (K, N) with K cut into `split_k` pieces
    (default: `split_k_for(M, N, K)`, chosen from the shape as libraries do). Correct,
    deterministic, and batch-VARIANT; with `split_k` fixed by hand, invariant again."""
    check_matmul_inputs(a, b)
    (M, K), N = a.shape, b.shape[1]
    split_k = split_k or split_k_for(M, N, K)
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=a.dtype, device=a.device)
    cfg = SPLIT_CONFIG
    k_per_split = cdiv(cdiv(K, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    parts = torch.empty((split_k, M, N), dtype=torch.float32, device=a.device)
    grid = (cdiv(M, cfg["BLOCK_M"]), cdiv(N, cfg["BLOCK_N"]), split_k)
    split_k_matmul_kernel[grid](
        a, b, parts, M, N, K, k_per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        INPUT_PRECISION=input_precision(a.dtype), USE_DOT=not INTERPRET, **cfg,
    )  # fmt: skip
    out = parts[0]
    for s in range(1, split_k):  # the partial sums, added in a fixed order
        out = out + parts[s]
    return out.to(a.dtype)


@triton.jit
def atomic_row_sum_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + row, tl.reduce(x, 0, add_combine))  # the order of these adds is a race


def atomic_row_sum(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The nondeterministic control: the sum of each row of a 2-D x, in fp32, through atomic
    adds (its bits change from run to run on a GPU)."""
    check_tensor("x", x, ndim=2)
    x = x.contiguous()
    out = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    if x.numel():
        grid = (x.shape[0], cdiv(x.shape[1], block))
        atomic_row_sum_kernel[grid](x, out, x.shape[1], x.stride(0), BLOCK=block)
    return out
