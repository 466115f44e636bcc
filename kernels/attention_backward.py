"""Fused attention, backward pass: recomputed from the saved log-sum-exp, without atomics.

With S = scale * Q K^T, P = softmax(S), O = P V and the incoming dO:
    dV = P^T dO      dP = dO V^T      dS = P * (dP - delta),  delta_i = sum_d dO_id * O_id
    dQ = scale * dS K                 dK = scale * dS^T Q
P is never stored: P_ij = exp(S_ij - LSE_i), recomputed block by block from the forward's
log-sum-exp. Three kernels: delta (one pass over O and dO); dK and dV (a program per key block,
looping over the query blocks that see it); dQ (a program per query block, looping over its key
blocks). Every output block has one owner, so there are no atomic adds and every run gives the
same bits; the price is computing S and dP twice, 7 matmuls where the formulas need 5. The rate
is counted, as usual, as 2.5x the forward's FLOPs.
"""

import torch
import triton
import triton.language as tl

from kernels.attention import (
    LOG2E,
    autotuned,
    choose_config,
    launch,
    length_buckets,
    with_32bit_head_offsets,
)

# (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M query rows, BLOCK_N keys.
CPU_DKDV_CONFIG = (16, 32, 4, 1)
CPU_DQ_CONFIG = (32, 16, 4, 1)
DELTA_BLOCK_M = 64


def dkdv_candidates(dtype, head_dim: int, seq_q: int) -> list:
    """Configurations the GPU autotuner times for the dK/dV kernel (BLOCK_N keys per program).
    Compiled for the H200 with triton 3.6, none of the 16-bit ones spills registers."""
    if dtype == torch.float32:
        return [(16, 32, 4, 2)]
    if seq_q <= 64:
        return [(32, 64, 4, 3), (32, 64, 8, 3)]
    if head_dim <= 64:
        return [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3)]
    return [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3)]


def dq_candidates(dtype, head_dim: int, seq_q: int) -> list:
    """Configurations the GPU autotuner times for the dQ kernel (BLOCK_M queries per program)."""
    if dtype == torch.float32:
        return [(32, 16, 4, 2)]
    if seq_q <= 64:
        return [(64, 64, 4, 3)]
    if head_dim <= 64:
        return [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)]
    return [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]


@triton.jit
def attention_bwd_delta_kernel(
    O, DO, DELTA, stride_db, stride_dh, stride_dm, stride_dd, H, SEQ_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: reads O and dO once, writes an fp32 per row
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows_in = offs_m < SEQ_Q
    head = (off_b * H + off_h) * SEQ_Q  # O and DELTA are ours: contiguous
    o_ptrs = O + head * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptrs, mask=rows_in[:, None], other=0.0).to(tl.float32)
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh
    do_ptrs += offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd
    do = tl.load(do_ptrs, mask=rows_in[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + head + offs_m, tl.sum(o * do, 1), mask=rows_in)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm, LSE, DELTA, offs_n,
                 start, end, seq_q, diagonal, qk_scale, BLOCK_M: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    # Query rows [start, end) against this program's keys, computed transposed (keys along
    # dim 0) so that dK and dV accumulate without a transpose.
    rows = tl.arange(0, BLOCK_M)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + rows
        rows_in = offs_m < seq_q
        q = tl.load(q_ptrs + start_m * stride_qm, mask=rows_in[:, None], other=0.0)
        # rows past the end get LSE = +inf: their probabilities are exactly 0
        lse = tl.load(LSE + offs_m, mask=rows_in, other=float("inf"))
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t * qk_scale - lse[None, :] * 1.4426950408889634)
        if MASKED:  # the causal diagonal: query i sees key j when j <= i + Sk - Sq
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + diagonal, p_t, 0.0)
        do = tl.load(do_ptrs + start_m * stride_dm, mask=rows_in[:, None], other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        delta = tl.load(DELTA + offs_m, mask=rows_in, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    H, SEQ_Q, SEQ_K, sm_scale, qk_scale,
    SEQ_Q_BUCKET, SEQ_K_BUCKET,  # the autotuner's key only
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    cols_in = offs_n < SEQ_K
    diagonal = SEQ_K - SEQ_Q
    # this program's keys and values, read once; keys past the end load as 0 and their rows of
    # dK and dV are never stored
    k_ptrs = K + off_b * stride_kb + off_h * stride_kh
    k = tl.load(k_ptrs + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=cols_in[:, None], other=0.0)  # fmt: skip
    v_ptrs = V + off_b * stride_vb + off_h * stride_vh
    v = tl.load(v_ptrs + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=cols_in[:, None], other=0.0)  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    rows = tl.arange(0, BLOCK_M)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh
    q_ptrs += rows[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh
    do_ptrs += rows[:, None] * stride_dm + offs_d[None, :] * stride_dd
    head = (off_b * H + off_h) * SEQ_Q
    if CAUSAL:
        # Rows before n0 - diagonal see none of these keys: skipped. Rows from
        # n0 + BLOCK_N - 1 - diagonal on see all of them: no mask. Between: the diagonal.
        start = tl.maximum(n0 - diagonal, 0) // BLOCK_M * BLOCK_M
        full = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diagonal, 0), BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm, LSE + head,
                              DELTA + head, offs_n, start, tl.minimum(full, SEQ_Q), SEQ_Q,
                              diagonal, qk_scale, BLOCK_M, True, DOT_PRECISION)  # fmt: skip
    else:
        full = 0
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm, LSE + head,
                          DELTA + head, offs_n, full, SEQ_Q, SEQ_Q, diagonal, qk_scale,
                          BLOCK_M, False, DOT_PRECISION)  # fmt: skip

    out = (off_b * H + off_h) * SEQ_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols_in[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols_in[:, None])


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, start, end,
               seq_k, diagonal, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    # Keys [start, end) for this program's query rows: the same ranges as the forward pass.
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=cols[:, None] < seq_k, other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=cols[:, None] < seq_k, other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # keys past the end, and the causal diagonal
            keep = cols[None, :] < seq_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diagonal)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    H, SEQ_Q, SEQ_K, sm_scale, qk_scale,
    SEQ_Q_BUCKET, SEQ_K_BUCKET,  # the autotuner's key only
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows_in = offs_m < SEQ_Q
    diagonal = SEQ_K - SEQ_Q
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh
    q = tl.load(q_ptrs + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=rows_in[:, None], other=0.0)  # fmt: skip
    do_ptrs = DO + off_b * stride_db + off_h * stride_dh
    do = tl.load(do_ptrs + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd,
                 mask=rows_in[:, None], other=0.0)  # fmt: skip
    head = (off_b * H + off_h) * SEQ_Q  # LSE, DELTA and DQ are ours: contiguous
    lse2 = tl.load(LSE + head + offs_m, mask=rows_in, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + head + offs_m, mask=rows_in, other=0.0)
    k_ptrs = K + off_b * stride_kb + off_h * stride_kh
    k_ptrs += offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_h * stride_vh
    v_ptrs += offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        end = tl.minimum(m0 + BLOCK_M + diagonal, SEQ_K)
        full = tl.minimum(m0 + diagonal + 1, SEQ_K) // BLOCK_N * BLOCK_N
    else:
        end = SEQ_K
        full = SEQ_K // BLOCK_N * BLOCK_N
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, 0, full,
                    SEQ_K, diagonal, qk_scale, BLOCK_N, False, CAUSAL, DOT_PRECISION)  # fmt: skip
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, full,
                    end, SEQ_K, diagonal, qk_scale, BLOCK_N, True, CAUSAL,
                    DOT_PRECISION)  # fmt: skip
    dq_ptrs = DQ + head * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows_in[:, None])


_dkdv_tuned = autotuned(attention_bwd_dkdv_kernel, dkdv_candidates)
_dq_tuned = autotuned(attention_bwd_dq_kernel, dq_candidates)


def attention_backward(do, q, k, v, o, lse, causal, sm_scale, precision, configs=(None, None)):
    """(dq, dk, dv) from dO, the forward's inputs, its output O and log-sum-exp, and tl.dot's
    input precision. `configs` = (dK/dV config, dQ config), each (BLOCK_M, BLOCK_N, num_warps,
    num_stages), or None to let `choose_config` decide."""
    q, k, v, do = (with_32bit_head_offsets(t) for t in (q, k, v, do))
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H, Sk, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, H, Sk, D), dtype=v.dtype, device=v.device)
    if Sq == 0 or B * H == 0:  # no query reads any key: zero gradients
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(Sq, DELTA_BLOCK_M), H, B)
    attention_bwd_delta_kernel[grid](o, do, delta, *do.stride(), H, Sq,
                                     HEAD_DIM=D, BLOCK_M=DELTA_BLOCK_M)  # fmt: skip
    args = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, Sq, Sk, sm_scale,
            sm_scale * LOG2E, *length_buckets(Sq, Sk))  # fmt: skip
    meta = dict(HEAD_DIM=D, CAUSAL=causal, DOT_PRECISION=precision)
    dkdv_config = choose_config(configs[0], CPU_DKDV_CONFIG, dkdv_candidates, q, k)
    launch(attention_bwd_dkdv_kernel, _dkdv_tuned, (q, k, v, do, lse, delta, dk, dv, *args),
           meta, rows=Sk, block="BLOCK_N", config=dkdv_config, B=B, H=H)  # fmt: skip
    dq_config = choose_config(configs[1], CPU_DQ_CONFIG, dq_candidates, q, k)
    launch(attention_bwd_dq_kernel, _dq_tuned, (q, k, v, do, lse, delta, dq, *args),
           meta, rows=Sq, block="BLOCK_M", config=dq_config, B=B, H=H)  # fmt: skip
    return dq, dk, dv
