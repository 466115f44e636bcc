"""Fused attention, FlashAttention-style: the forward kernel, its operators, the reference.

softmax(Q K^T * scale) V for q (B, H, Sq, D) and k, v (B, H_kv, Sk, D) without ever materializing
the Sq x Sk scores. Grouped-query attention: H is a multiple of H_kv, and query head h reads
key/value head h // (H // H_kv) in place (K and V are never copied). Any head dim from 1 to 256:
the kernels compute on the next power of two (16 at least) and mask the padded columns.
A program owns BLOCK_M query rows and streams over the keys and values BLOCK_N at a time, keeping
a running max, a running sum and a rescaled fp32 accumulator (the online softmax). It reads its
queries once and K, V once per query block, and writes O plus one log-sum-exp per row: O(S) memory
where the naive version stores B*H*Sq*Sk scores. FLOPs: 4*B*H*Sq*Sk*D (two matmuls), about half
with the causal mask, whose fully masked blocks are never visited. The backward pass
(`kernels.attention_backward`) recomputes the probabilities from the saved log-sum-exp. The
configurations and launch plumbing are in `kernels.attention_tuning`; the kernel code forward and
backward share (addressing, causal rule, key ranges) in `kernels.primitives`.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.attention_backward import attention_backward
from kernels.attention_tuning import (
    CPU_CONFIG,
    MAX_HEAD_DIM,
    autotuned,
    block_d,
    choose_config,
    forward_candidates,
    launch,
    length_buckets,
    profiler_metadata,
    with_32bit_head_offsets,
)
from kernels.operators import (
    backward_operator,
    dense_like,
    eager_autograd,
    one_output,
    operator,
)
from kernels.primitives import (
    LOG2E,
    head_index,
    head_tile,
    key_mask,
    key_ranges,
    kv_block,
    tile_mask,
)
from kernels.validate import check_same, check_tensor, input_precision, needs_grad


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_d, start,
                end, seq_k, diagonal, qk_scale, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    # Keys [start, end), BLOCK_N at a time. MASKED=False is the hot loop: whole blocks that every
    # row sees, so no masks at all; MASKED=True covers the ragged end and the causal diagonal.
    # Offsets come from the loop index, not from pointers carried through the loop: carried
    # (BLOCK_N, BLOCK_D) pointer tiles cost registers, which made the compiled kernel spill.
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = kv_block(k_ptrs, start_n, stride_kn, cols, seq_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N) fp32
        if MASKED:  # keys past the end, and with CAUSAL those after each row's diagonal
            s = tl.where(key_mask(offs_m, cols, seq_k, diagonal, CAUSAL), s, float("-inf"))
        # The online softmax, in base 2: m_i is the running max of s * scale * log2(e) and l_i
        # the running sum of exp2(. - m_i); when the max grows, l_i and acc are rescaled.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = kv_block(v_ptrs, start_n, stride_vn, cols, seq_k, offs_d, MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# A profiler names each launch by its shape; FLOPs: two matmuls, 4*D per visible score.
forward_metadata = profiler_metadata(flops_per_score=4, tensors=("Q", "K", "V", "O", "LSE"))


@triton.jit(launch_metadata=forward_metadata)
def attention_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H, GROUP, SEQ_Q, SEQ_K, qk_scale,  # GROUP = H // H_kv query heads per key/value head
    SEQ_Q_BUCKET, SEQ_K_BUCKET,  # the autotuner's key only
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows start first, so that they do not finish last
        pid_m = tl.num_programs(0) - 1 - pid_m
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)  # the head dim padded to a power of two; HEAD_DIM exist
    rows_in = offs_m < SEQ_Q
    diagonal = SEQ_K - SEQ_Q  # the causal mask is aligned to the end: the last query sees all keys
    head = tl.program_id(1)
    kv_head = head // GROUP  # grouped-query attention: GROUP query heads share one K and V

    q_ptrs = head_tile(Q, stride_qb, stride_qh, stride_qm, stride_qd, head, offs_m, offs_d)
    q_in = tile_mask(rows_in, offs_d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptrs, mask=q_in, other=0.0)  # (BLOCK_M, BLOCK_D), read once
    k_ptrs = head_tile(K, stride_kb, stride_kh, stride_kn, stride_kd, kv_head, offs_n, offs_d)
    v_ptrs = head_tile(V, stride_vb, stride_vh, stride_vn, stride_vd, kv_head, offs_n, offs_d)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = key_ranges(m0, SEQ_K, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m,
                                offs_d, 0, full, SEQ_K, diagonal, qk_scale, BLOCK_N, False,
                                CAUSAL, DOT_PRECISION, HEAD_DIM, BLOCK_D)  # fmt: skip
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m,
                                offs_d, full, end, SEQ_K, diagonal, qk_scale, BLOCK_N, True,
                                CAUSAL, DOT_PRECISION, HEAD_DIM, BLOCK_D)  # fmt: skip

    # Every row sees key 0, so l_i >= 1: no division by zero, no fully masked row.
    acc = acc / l_i[:, None]
    row0 = head_index(H) * SEQ_Q + m0  # O and LSE are ours: contiguous
    rows = tl.arange(0, BLOCK_M)
    o_ptrs = O + (row0 + rows[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=q_in)  # the padded columns: never
    # the natural-log LSE, max + log(sum), from the base-2 running values (times ln 2)
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + row0 + rows, lse, mask=rows_in)


_attention_fwd_tuned = autotuned(attention_fwd_kernel, forward_candidates)


def attention_forward(q, k, v, causal: bool, sm_scale: float, config=None):
    """(O, LSE) for checked inputs: O like q, contiguous; LSE (B, H, Sq) fp32, natural log.
    k and v may have fewer heads than q (grouped-query). `config` = (BLOCK_M, BLOCK_N,
    num_warps, num_stages) skips the autotuner."""
    q, k, v = (with_32bit_head_offsets(t) for t in (q, k, v))
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    o = q.new_empty((B, H, Sq, D))
    lse = q.new_empty((B, H, Sq), dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    args = (q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), H, H // k.shape[1], Sq, Sk,
            sm_scale * LOG2E.value, *length_buckets(Sq, Sk))  # fmt: skip
    meta = dict(HEAD_DIM=D, BLOCK_D=block_d(D), CAUSAL=causal,
                DOT_PRECISION=input_precision(q.dtype))  # fmt: skip
    config = choose_config(config, CPU_CONFIG, forward_candidates, q, k)
    launch(attention_fwd_kernel, _attention_fwd_tuned, args, meta, rows=Sq, block="BLOCK_M",
           config=config, B=B, H=H)  # fmt: skip
    return o, lse


# The operators (see kernels.operators): brrr::attention_forward returns (O, LSE), the
# log-sum-exp its registered backward passes to brrr::attention_backward; brrr::attention
# returns O alone.


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, causal, sm_scale)


def _attention_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, causal: bool, sm_scale: float, precision: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return attention_backward(do, q, k, v, o, lse, causal, sm_scale, precision)


attention_forward_op = operator(
    "attention_forward",
    _attention_forward,
    lambda q, k, v, causal, sm_scale: (
        dense_like(q),
        q.new_empty(q.shape[:3], dtype=torch.float32),
    ),
)
attention_backward_op = backward_operator(
    "attention_backward",
    _attention_backward,
    lambda do, q, k, v, o, lse, causal, sm_scale, precision: (
        dense_like(q),
        dense_like(k),
        dense_like(v),
    ),
)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, sm_scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse)
    # tl.dot's precision as of the forward (torch.get_float32_matmul_precision may change)
    ctx.causal, ctx.sm_scale, ctx.precision = causal, sm_scale, input_precision(q.dtype)


def _attention_grads(ctx, do, _dlse):
    grads = attention_backward_op(do, *ctx.saved_tensors, ctx.causal, ctx.sm_scale, ctx.precision)
    return *grads, None, None


# the backward on the operator, and the same as an autograd Function for eager calls that
# autograd records (kernels.operators, road 3). No traced Function for torch.compile: the setup
# reads torch.get_float32_matmul_precision(), a string, which Dynamo cannot trace inside a
# Function (torch 2.13), so compiled graphs call the operator, whose setup runs outside Dynamo.
attention_forward_op.register_autograd(_attention_grads, setup_context=_attention_setup)
_attention_autograd = eager_autograd(_attention_forward, _attention_setup, _attention_grads)
one_output("attention", attention_forward_op)


def check_attention_inputs(q, k, v, sm_scale):
    """Validate q (B, H, Sq, D), k and v (B, H_kv, Sk, D) with H a multiple of H_kv, Sq <= Sk and
    1 <= D <= MAX_HEAD_DIM (256); return the softmax scale (default 1/sqrt(D)). Shared with the
    batch-invariant attention, so that both accept the same shapes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=4)
    check_same("q, k and v", q, k, v, shape=False)
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must share batch and head dim (B, _, _, D): got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}"
        )
    (H, Sq, D), (H_kv, Sk) = q.shape[1:], k.shape[1:3]
    if (H_kv == 0 and H != 0) or (H_kv != 0 and H % H_kv != 0):
        raise ValueError(
            f"q's heads H={H} must be a multiple of k and v's heads H_kv={H_kv} "
            "(grouped-query attention: each key/value head serves H // H_kv query heads)"
        )
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {D} is not supported: head dims 1 to {MAX_HEAD_DIM}")
    if Sq > Sk:
        raise ValueError(
            f"Sq={Sq} > Sk={Sk}: need Sq <= Sk, the queries being the last Sq of the Sk positions"
        )
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    return float(sm_scale)


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v for q (B, H, Sq, D), k and v (B, H_kv, Sk, D), differentiable.

    Grouped-query attention: H a multiple of H_kv, query head h reads key/value head
    h // (H // H_kv). Sq <= Sk: the queries are the last Sq positions (decoding against a KV
    cache), so with `causal` query i sees keys j <= i + Sk - Sq. sm_scale defaults to 1/sqrt(D).
    Any head dim from 1 to 256; fp32 inputs follow torch.get_float32_matmul_precision() (IEEE
    at "highest").
    """
    sm_scale = check_attention_inputs(q, k, v, sm_scale)
    if torch.compiler.is_compiling():  # the roads of kernels.operators
        return attention_forward_op(q, k, v, bool(causal), sm_scale)[0]
    if needs_grad(q, k, v):
        return _attention_autograd(q, k, v, bool(causal), sm_scale)[0]
    return attention_forward(q, k, v, bool(causal), sm_scale)[0]


def attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Plain PyTorch, materializing the (B, H, Sq, Sk) scores; fp32 math (fp64 for fp64 inputs).
    Grouped-query k and v (fewer heads than q) are repeated to q's heads first. Bytes: reads
    q, k, v, then writes and reads back B*H*Sq*Sk scores and probabilities."""
    Sq, Sk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    if k.dim() == 4 and k.shape[1] != q.shape[1]:  # grouped-query: copies, as the kernels do not
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q.to(compute) @ k.to(compute).transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if causal:
        visible = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(diagonal=Sk - Sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.to(compute)).to(q.dtype)
