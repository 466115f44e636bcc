"""Fused attention, backward pass: recomputed from the saved log-sum-exp, without atomics.

With S = scale * Q K^T, P = softmax(S), O = P V and the incoming dO:
    dV = P^T dO      dP = dO V^T      dS = P * (dP - delta),  delta_i = sum_d dO_id * O_id
    dQ = scale * dS K                 dK = scale * dS^T Q
P is never stored: P_ij = exp(S_ij - LSE_i), recomputed block by block from the forward's
log-sum-exp. Three kernels: delta (one pass over O and dO); dK and dV (a program per key block
of one key/value head, looping over the query blocks that see it); dQ (a program per query block,
looping over its key blocks). With grouped-query attention dK and dV of a key/value head sum over
its H // H_kv query heads: the same program loops over them, one after another in head order,
into the same fp32 accumulators. Every output block has one owner, so there are no atomic adds
and every run gives the same bits; the price is computing S and dP twice, 7 matmuls where the
formulas need 5. The rate is counted, as usual, as 2.5x the forward's FLOPs. Configurations
and launch plumbing are in `kernels.attention_tuning`; the loads, masks and key ranges the dQ
kernel shares with the forward in `kernels.primitives`.
"""

import torch
import triton
import triton.language as tl

from kernels.attention_tuning import (
    CPU_DKDV_CONFIG,
    CPU_DQ_CONFIG,
    autotuned,
    block_d,
    choose_config,
    dkdv_candidates,
    dq_candidates,
    launch,
    length_buckets,
    profiler_metadata,
    with_32bit_head_offsets,
)
from kernels.launch import cdiv
from kernels.launch import launch as launch_kernel
from kernels.primitives import (
    LOG2E,
    causal_sees,
    head_index,
    head_tile,
    key_mask,
    key_ranges,
    kv_block,
    tile_mask,
)

DELTA_BLOCK_M = 64  # query rows per program of the delta pass, a pure stream over O and dO


@triton.jit
def attention_bwd_delta_kernel(
    O, DO, DELTA, stride_db, stride_dh, stride_dm, stride_dd, H, SEQ_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    # delta_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij: reads O and dO once, writes an fp32 per row
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows_in = offs_m < SEQ_Q
    in_tile = tile_mask(rows_in, offs_d, HEAD_DIM, BLOCK_D)
    head = head_index(H) * SEQ_Q  # O and DELTA are ours: contiguous
    o_ptrs = O + head * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(o_ptrs, mask=in_tile, other=0.0).to(tl.float32)
    do_ptrs = head_tile(DO, stride_db, stride_dh, stride_dm, stride_dd, tl.program_id(1), offs_m,
                        offs_d)  # fmt: skip
    do = tl.load(do_ptrs, mask=in_tile, other=0.0).to(tl.float32)
    tl.store(DELTA + head + offs_m, tl.sum(o * do, 1), mask=rows_in)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm, LSE, DELTA, offs_n,
                 offs_d, start, end, seq_q, diagonal, qk_scale, BLOCK_M: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    # Query rows [start, end) against this program's keys, computed transposed (keys along
    # dim 0) so that dK and dV accumulate without a transpose.
    rows = tl.arange(0, BLOCK_M)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + rows
        rows_in = offs_m < seq_q
        in_tile = tile_mask(rows_in, offs_d, HEAD_DIM, BLOCK_D)
        q = tl.load(q_ptrs + start_m * stride_qm, mask=in_tile, other=0.0)
        # rows past the end get LSE = +inf: their probabilities are exactly 0
        lse = tl.load(LSE + offs_m, mask=rows_in, other=float("inf"))
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_M)
        p_t = tl.exp2(s_t * qk_scale - lse[None, :] * LOG2E)
        if MASKED:  # the causal diagonal
            p_t = tl.where(causal_sees(offs_m[None, :], offs_n[:, None], diagonal), p_t, 0.0)
        do = tl.load(do_ptrs + start_m * stride_dm, mask=in_tile, other=0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        delta = tl.load(DELTA + offs_m, mask=rows_in, other=0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


# FLOPs: S^T, dV, dP^T and dK, four matmuls, 8*D per visible score.
dkdv_metadata = profiler_metadata(
    flops_per_score=8, tensors=("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV")
)


@triton.jit(launch_metadata=dkdv_metadata)
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    H, GROUP, SEQ_Q, SEQ_K, sm_scale, qk_scale,  # H query heads, GROUP = H // H_kv
    SEQ_Q_BUCKET, SEQ_K_BUCKET,  # the autotuner's key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # The grid is (key blocks, H_kv, B): this program owns keys [n0, n0 + BLOCK_N) of key/value
    # head kv_head and sums their gradients over the GROUP query heads that read them.
    n0 = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols_in = offs_n < SEQ_K
    in_tile = tile_mask(cols_in, offs_d, HEAD_DIM, BLOCK_D)
    diagonal = SEQ_K - SEQ_Q
    # this program's keys and values, read once; keys past the end load as 0 and their rows of
    # dK and dV are never stored
    k_ptrs = head_tile(K, stride_kb, stride_kh, stride_kn, stride_kd, kv_head, offs_n, offs_d)
    k = tl.load(k_ptrs, mask=in_tile, other=0.0)
    v_ptrs = head_tile(V, stride_vb, stride_vh, stride_vn, stride_vd, kv_head, offs_n, offs_d)
    v = tl.load(v_ptrs, mask=in_tile, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    rows = tl.arange(0, BLOCK_M)
    if CAUSAL:
        # Rows before n0 - diagonal see none of these keys: skipped. Rows from
        # n0 + BLOCK_N - 1 - diagonal on see all of them: no mask. Between: the diagonal.
        start = tl.maximum(n0 - diagonal, 0) // BLOCK_M * BLOCK_M
        full = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - diagonal, 0), BLOCK_M) * BLOCK_M
        full = tl.minimum(full, SEQ_Q)
    else:
        start = 0
        full = 0
    # The group's query heads one after another, in head order, into the same accumulators:
    # a fixed order of fp32 additions, so the same bits on every run, and no atomics.
    for g in range(0, GROUP):
        head = kv_head * GROUP + g
        q_ptrs = head_tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, head, rows, offs_d)
        do_ptrs = head_tile(DO, stride_db, stride_dh, stride_dm, stride_dd, head, rows, offs_d)
        rows0 = (tl.program_id(2).to(tl.int64) * H + head) * SEQ_Q  # LSE, DELTA: contiguous
        if CAUSAL:
            dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm,
                                  LSE + rows0, DELTA + rows0, offs_n, offs_d, start, full,
                                  SEQ_Q, diagonal, qk_scale, BLOCK_M, True, DOT_PRECISION,
                                  HEAD_DIM, BLOCK_D)  # fmt: skip
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dm, LSE + rows0,
                              DELTA + rows0, offs_n, offs_d, full, SEQ_Q, SEQ_Q, diagonal,
                              qk_scale, BLOCK_M, False, DOT_PRECISION, HEAD_DIM,
                              BLOCK_D)  # fmt: skip

    out = head_index(H // GROUP) * SEQ_K * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_tile)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=in_tile)


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
               start, end, seq_k, diagonal, qk_scale, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    # Keys [start, end) for this program's query rows: the same ranges, loads and masks as the
    # forward's _fwd_blocks, with P recomputed from the log-sum-exp instead of a running max.
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = kv_block(k_ptrs, start_n, stride_kn, cols, seq_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        v = kv_block(v_ptrs, start_n, stride_vn, cols, seq_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:  # keys past the end, and the causal diagonal
            p = tl.where(key_mask(offs_m, cols, seq_k, diagonal, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


# FLOPs: S, dP and dQ, three matmuls, 6*D per visible score.
dq_metadata = profiler_metadata(
    flops_per_score=6, tensors=("Q", "K", "V", "DO", "LSE", "DELTA", "DQ")
)


@triton.jit(launch_metadata=dq_metadata)
def attention_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_db, stride_dh, stride_dm, stride_dd,
    H, GROUP, SEQ_Q, SEQ_K, sm_scale, qk_scale,
    SEQ_Q_BUCKET, SEQ_K_BUCKET,  # the autotuner's key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows_in = offs_m < SEQ_Q
    in_tile = tile_mask(rows_in, offs_d, HEAD_DIM, BLOCK_D)
    diagonal = SEQ_K - SEQ_Q
    head = tl.program_id(1)
    kv_head = head // GROUP
    q_ptrs = head_tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, head, offs_m, offs_d)
    q = tl.load(q_ptrs, mask=in_tile, other=0.0)
    do_ptrs = head_tile(DO, stride_db, stride_dh, stride_dm, stride_dd, head, offs_m, offs_d)
    do = tl.load(do_ptrs, mask=in_tile, other=0.0)
    rows0 = head_index(H) * SEQ_Q  # LSE, DELTA and DQ are ours: contiguous
    lse2 = tl.load(LSE + rows0 + offs_m, mask=rows_in, other=0.0) * LOG2E
    delta = tl.load(DELTA + rows0 + offs_m, mask=rows_in, other=0.0)
    k_ptrs = head_tile(K, stride_kb, stride_kh, stride_kn, stride_kd, kv_head, offs_n, offs_d)
    v_ptrs = head_tile(V, stride_vb, stride_vh, stride_vn, stride_vd, kv_head, offs_n, offs_d)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = key_ranges(m0, SEQ_K, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                    0, full, SEQ_K, diagonal, qk_scale, BLOCK_N, False, CAUSAL, DOT_PRECISION,
                    HEAD_DIM, BLOCK_D)  # fmt: skip
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d,
                    full, end, SEQ_K, diagonal, qk_scale, BLOCK_N, True, CAUSAL, DOT_PRECISION,
                    HEAD_DIM, BLOCK_D)  # fmt: skip
    dq_ptrs = DQ + rows0 * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=in_tile)


_dkdv_tuned = autotuned(attention_bwd_dkdv_kernel, dkdv_candidates)
_dq_tuned = autotuned(attention_bwd_dq_kernel, dq_candidates)


def attention_backward(do, q, k, v, o, lse, causal, sm_scale, precision, configs=(None, None)):
    """(dq, dk, dv) from dO, the forward's inputs, its output O and log-sum-exp, and tl.dot's
    input precision. k and v may have H_kv < H heads (grouped-query): dk and dv have k's shape.
    `configs` = (dK/dV config, dQ config), each (BLOCK_M, BLOCK_N, num_warps, num_stages), or
    None to let `choose_config` decide."""
    q, k, v, do = (with_32bit_head_offsets(t) for t in (q, k, v, do))
    B, H, Sq, D = q.shape
    H_kv, Sk = k.shape[1], k.shape[2]
    dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, H_kv, Sk, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, H_kv, Sk, D), dtype=v.dtype, device=v.device)
    if Sq == 0 or B * H == 0:  # no query reads any key: zero gradients
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    grid = (cdiv(Sq, DELTA_BLOCK_M), H, B)
    launch_kernel(attention_bwd_delta_kernel, grid, o, do, delta, *do.stride(), H, Sq,
                                     HEAD_DIM=D, BLOCK_D=block_d(D),
                                     BLOCK_M=DELTA_BLOCK_M)  # fmt: skip
    args = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), H, H // H_kv, Sq, Sk, sm_scale,
            sm_scale * LOG2E.value, *length_buckets(Sq, Sk))  # fmt: skip
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=causal, DOT_PRECISION=precision)
    dkdv_config = choose_config(configs[0], CPU_DKDV_CONFIG, dkdv_candidates, q, k)
    launch(attention_bwd_dkdv_kernel, _dkdv_tuned, (q, k, v, do, lse, delta, dk, dv, *args),
           meta, rows=Sk, block="BLOCK_N", config=dkdv_config, B=B, H=H_kv)  # fmt: skip
    dq_config = choose_config(configs[1], CPU_DQ_CONFIG, dq_candidates, q, k)
    launch(attention_bwd_dq_kernel, _dq_tuned, (q, k, v, do, lse, delta, dq, *args),
           meta, rows=Sq, block="BLOCK_M", config=dq_config, B=B, H=H)  # fmt: skip
    return dq, dk, dv
