"""Batch-invariant attention: split-KV with a fixed split SIZE, for prefill and decoding alike.

softmax(q k^T * sm_scale) v for q (B, H, Sq, D) and k, v (B, H_kv, Sk, D): grouped-query heads,
H a multiple of H_kv, query head h reading key/value head h // (H // H_kv) in place; head dims
1 to 256 (as `kernels.attention`), padded to a power of two inside the kernels. A query's output
must have the same bits whether it is computed in a full prefill, in a chunk of a prefill, or alone
in one decoding step over the KV cache, and whatever else is in the batch. So:

- the KV cache is updated before the kernel: cached and new keys are reduced together;
- the keys are cut into splits of SPLIT_SIZE at fixed absolute positions (1000 keys with a
  split size of 256 are 256 + 256 + 256 + 232, never 4 x 250 as a fixed NUMBER of splits
  would give); each program reduces one split for BLOCK_M queries of one (batch, head), in
  blocks of BLOCK_N keys, with an online softmax; the same BLOCK_M serves every Sq;
- a query's splits are combined in order, by the last split program of its tile to finish
  (kernels.arrivals: no second launch) or, where no counters are to be had, by a second
  kernel; the same arithmetic in the same order either way. Keys a query may not see (beyond its
  sequence's `kv_lens`, or in its causal future) add exact zeros, and splits it cannot see at
  all are skipped exactly: neither changes its bits.

Workspace: (B, H, Sq, n_splits) x (D + 2) fp32 partial results. Bytes: q, k, v read once,
the workspace written and read once, the output written once.
"""

import torch
import triton
import triton.language as tl

from kernels import arrivals, runtime
from kernels.arrivals import last_to_arrive
from kernels.attention import attention_ref as course_attention_ref
from kernels.attention import check_attention_inputs
from kernels.attention_tuning import block_d as padded_head_dim
from kernels.batch_invariant.rows import add_combine, max_combine
from kernels.launch import cdiv, launch
from kernels.operators import forward_road, operator
from kernels.primitives import LOG2E, dependent_keywords, prefetch_l2, wait_for_previous
from kernels.runtime import INTERPRET, pick
from kernels.validate import input_precision

# Fixed for every shape. The interpreter pays per operation, so on a CPU the tiles are larger
# and the split smaller (so that small tests still cross split boundaries).
CONFIG = pick(
    cpu=dict(BLOCK_M=32, BLOCK_N=64, SPLIT_SIZE=64, BLOCK_R=64),
    gpu=dict(BLOCK_M=16, BLOCK_N=64, SPLIT_SIZE=256, BLOCK_R=16),
)


# Profiler metadata (see rows.py): the launch's name and shape, FLOPs and the least bytes.


def split_metadata(grid, kernel, args) -> dict:
    """4*B*H*Sq*Sk*D FLOPs (q k^T and p v over every key: an upper bound, since causal masking
    and kv_lens skip some); q, k, v read once (k and v have H // GROUP heads), the fp32
    partials (m, l, acc) written once."""
    q, splits = args["q_ptr"], args["n_splits"]
    B, H, Sq, Sk, D = q.shape[0], args["H"], args["Sq"], args["Sk"], args["D"]
    H_kv = H // args["GROUP"]
    partials = 4 * B * H * Sq * splits * (D + 2)
    return {
        "name": f"{kernel.name} [B={B}, H={H}, Sq={Sq}, Sk={Sk}, D={D}, splits={splits}]",
        "flops": 4 * B * H * Sq * Sk * D,
        "bytes": q.element_size() * B * (H * Sq + 2 * H_kv * Sk) * D + partials,
    }


def combine_metadata(grid, kernel, args) -> dict:
    """3*(D+1) FLOPs a split and a row (rescale and add l and acc) plus D divides a row; the
    partials read once, the output written once."""
    rows, splits, D = args["n_rows"], args["n_splits"], args["D"]
    return {
        "name": f"{kernel.name} [rows={rows}, splits={splits}, D={D}]",
        "flops": rows * (3 * splits * (D + 1) + D),
        "bytes": 4 * rows * splits * (D + 2) + args["out_ptr"].element_size() * rows * D,
    }


@triton.jit(do_not_specialize=["H", "GROUP", "Sq", "Sk"], launch_metadata=split_metadata)
def attention_split_kernel(
    q_ptr, k_ptr, v_ptr, kv_lens_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr,
    H, GROUP, Sq, Sk, D, n_splits, qk_scale,  # GROUP = H // H_kv query heads per k/v head
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    HAS_KV_LENS: tl.constexpr, CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    USE_DOT: tl.constexpr, LAST_COMBINES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_SIZE: tl.constexpr, PDL: tl.constexpr = False, LINE: tl.constexpr = 64,
    LINES: tl.constexpr = 1,
):  # fmt: skip
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kv_h = h // GROUP  # grouped-query: the key/value head this query head reads, not a copy
    k_base = k_ptr + b * stride_kb + kv_h * stride_kh
    v_base = v_ptr + b * stride_vb + kv_h * stride_vh
    if PDL:  # dependent launch (kernels.primitives): while the kernel before (the one that
        # writes the new key) finishes, ask for this split's keys and values in L2, in lines
        # of LINE elements (LINES a key)
        if LINES > 0:
            n = tl.minimum(split * SPLIT_SIZE + tl.arange(0, SPLIT_SIZE), Sk - 1).to(tl.int64)
            lines = tl.minimum(tl.arange(0, LINES) * LINE, D - 1)
            prefetch_l2(k_base + n[:, None] * stride_ks + lines[None, :])
            prefetch_l2(v_base + n[:, None] * stride_vs + lines[None, :])
        wait_for_previous(PDL)  # q and the new key are the kernels before's
    if HAS_KV_LENS:
        kv_len = tl.load(kv_lens_ptr + b)
    else:
        kv_len = Sk
    # 64-bit offsets (the interpreter also checks every 32-bit integer operation for overflow)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = offs_d[None, :] < D
    q_pos = offs_m + (kv_len - Sq)  # a query's absolute position: causal aligned to the end
    q = tl.load(
        q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=(offs_m[:, None] < Sq) & d_ok,
        other=0.0,
    )

    lo = split * SPLIT_SIZE
    hi = tl.minimum(lo + SPLIT_SIZE, kv_len)
    if CAUSAL:  # no block past the last query of this tile
        hi = tl.minimum(hi, pid_m * BLOCK_M + BLOCK_M + (kv_len - Sq))
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, dtype=tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):  # blocks at fixed absolute positions
        offs_n = start_n + tl.arange(0, BLOCK_N).to(tl.int64)
        key_ok = offs_n[:, None] < kv_len
        k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=key_ok & d_ok,
                    other=0.0)  # fmt: skip
        if USE_DOT:  # see DOT_ON_CPU in kernels/batch_invariant/full_k_matmul.py
            s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        else:
            s = tl.reduce(
                q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), 2, add_combine
            )
        s = s * qk_scale  # log2 units
        visible = offs_n[None, :] < kv_len
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: stay at 0
        alpha = tl.exp2(m_i - m_use)  # exactly 1 when the max did not move
        p = tl.exp2(s - m_use[:, None])  # exactly 0 for keys the query may not see
        l_i = l_i * alpha + tl.reduce(p, 1, add_combine)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=key_ok & d_ok,
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None]
        if USE_DOT:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        else:
            pv = p.to(v.dtype).to(tl.float32)[:, :, None] * v[None, :, :].to(tl.float32)
            acc += tl.reduce(pv, 1, add_combine)
        m_i = m_new

    rows = (b * H + h) * Sq + offs_m  # (B, H, Sq) rows, each with n_splits partials
    row = rows * n_splits + split
    row_ok = offs_m < Sq
    tl.store(m_ptr + row, m_i, mask=row_ok)
    tl.store(l_ptr + row, l_i, mask=row_ok)
    tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
    if LAST_COMBINES:  # this tile's last split to finish combines them all (kernels.arrivals)
        if last_to_arrive(count_ptr, pid_bh * tl.num_programs(1) + pid_m, n_splits):
            combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, rows, row_ok, n_splits, D, BLOCK_D)


@triton.jit
def combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, rows, row_ok, n_splits, D,
                   BLOCK_D: tl.constexpr):  # fmt: skip
    """Rows' splits combined in order 0, 1, 2, ... and stored: by the combine kernel, or by a
    tile's last split kernel. A split the query cannot see has m = -inf, l = 0, acc = 0: it
    scales by exp2(-inf) = 0 and adds exact zeros. Partials load through L2 only (.cg): other
    programs wrote them."""
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    m = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    l = tl.full(rows.shape, 0.0, dtype=tl.float32)
    acc = tl.full((rows.shape[0], BLOCK_D), 0.0, dtype=tl.float32)
    for split in range(0, n_splits):
        part = rows * n_splits + split
        m_s = tl.load(m_ptr + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(l_ptr + part, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_s = tl.load(acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale_old = tl.exp2(m - m_use)
        scale_s = tl.exp2(m_s - m_use)
        l = l * scale_old + l_s * scale_s
        acc = acc * scale_old[:, None] + acc_s * scale_s[:, None]
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a query that sees no key: acc = 0, out 0
    out_ptrs = out_ptr + rows[:, None] * D + offs_d[None, :]
    tl.store(
        out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D)
    )


@triton.jit(do_not_specialize=["n_rows", "n_splits"], launch_metadata=combine_metadata)
def attention_combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, n_rows, n_splits, D,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # One (batch, head, query) row per lane, its splits combined in order.
    wait_for_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    combine_splits(m_ptr, l_ptr, acc_ptr, out_ptr, rows, rows < n_rows, n_splits, D, BLOCK_D)


def attention(q, k, v, causal=False, sm_scale=None, kv_lens=None) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v for q (B, H, Sq, D), k and v (B, H_kv, Sk, D), H a multiple
    of H_kv (grouped-query), head dims 1 to 256; fp32 arithmetic, output in q's dtype and shape.
    Sq <= Sk; with `causal`, query i sees keys <= i + Sk - Sq. `kv_lens` (B ints, a tensor or
    a list): sequence b's keys are its first kv_lens[b] positions (the rest is padding) and
    causal alignment is to kv_lens[b]. A query that sees no key gets zeros. Bits do not depend
    on the batch or on Sq."""
    sm_scale = check_attention_inputs(q, k, v, sm_scale)  # shapes, heads, head dim, scale
    B, H, Sq, D = q.shape
    lens = _kv_lens(kv_lens, B, q.device)
    call = forward_road(invariant_attention, q, k, v)  # the roads of kernels.operators
    if call is None:
        return _attention(q, k, v, bool(causal), sm_scale, lens)
    return call(q, k, v, bool(causal), sm_scale, lens)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float,
    lens: torch.Tensor | None, split_size: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The two launches; split_size: keys a split (a multiple of BLOCK_N), CONFIG's if None
    (kernels.decode.attention picks its own from the shape: the same kernels, split finer)."""
    B, H, Sq, D = q.shape
    Sk, group = k.shape[2], H // max(k.shape[1], 1)
    _check_kv_lens_values(lens, Sk)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    if Sk == 0:
        return out.zero_()
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cfg = CONFIG if split_size is None else {**CONFIG, "SPLIT_SIZE": split_size}
    n_splits = cdiv(Sk, cfg["SPLIT_SIZE"])
    block_d = padded_head_dim(D)
    n_rows = B * H * Sq
    part_m = torch.empty((n_rows * n_splits,), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((n_rows * n_splits, block_d), dtype=torch.float32, device=q.device)
    grid = (B * H, cdiv(Sq, cfg["BLOCK_M"]), n_splits)
    count = arrivals.counters(q.device, grid[0] * grid[1])  # None: the combine kernel combines
    launch(attention_split_kernel, grid,
        q, k, v, lens if lens is not None else part_m, part_m, part_l, part_acc, out,
        part_m if count is None else count,
        H, group, Sq, Sk, D, n_splits, sm_scale * LOG2E.value,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HAS_KV_LENS=lens is not None, CAUSAL=bool(causal),
        INPUT_PRECISION=input_precision(q.dtype), USE_DOT=not INTERPRET,
        LAST_COMBINES=count is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=block_d,
        SPLIT_SIZE=cfg["SPLIT_SIZE"], num_warps=4, num_stages=split_stages(q.dtype, block_d),
        **pdl_keywords(k, block_d),
    )  # fmt: skip
    if count is None:
        launch(attention_combine_kernel, (cdiv(n_rows, cfg["BLOCK_R"]),),
            part_m, part_l, part_acc, out, n_rows, n_splits, D,
            BLOCK_R=cfg["BLOCK_R"], BLOCK_D=block_d, num_warps=4,
            **dependent_keywords(runtime.PDL),
        )  # fmt: skip
    return out


# Under dependent launch, each split asks for its keys and values in L2 before it waits. A
# small gain on an H100 (2026-12-06, a decoding step at 512 positions in a CUDA graph):
# SmolLM2's shapes 0.746 ms a step against 0.767 without, the llama-1b shape 1.229 against 1.236.
PREFETCH_KV = True


def pdl_keywords(k: torch.Tensor, block_d: int) -> dict:
    """The split kernel's dependent-launch keywords (kernels.runtime.PDL), every one passed:
    lines of 128 bytes, LINES of them a key of block_d elements (0: no prefetch)."""
    line = 128 // k.element_size()
    lines = max(1, block_d // line) if PREFETCH_KV else 0
    return dict(**dependent_keywords(runtime.PDL), LINE=line, LINES=lines)


def split_stages(dtype, block_d: int) -> int:
    """Pipeline stages of the split kernel: 2, but 1 for fp32 past D = 128, where two stages of
    (BLOCK_N, 256) fp32 K and V tiles (64 KB each) would not fit Hopper's 227 KB a block. Fixed by
    the dtype and head dim alone, never by the batch; stages change when a load is issued, not the
    order of any addition."""
    return 1 if dtype == torch.float32 and block_d > 128 else 2


# torch.ops.brrr.invariant_attention: forward only (a gradient reaching it raises torch's error)
invariant_attention = operator(
    "invariant_attention",
    _attention,
    lambda q, k, v, causal, sm_scale, lens: torch.empty_like(
        q, memory_format=torch.contiguous_format
    ),
)


def _kv_lens(kv_lens, B, device):
    """kv_lens as an int32 tensor on the kernels' device, its type and length checked."""
    if kv_lens is None:
        return None
    if not isinstance(kv_lens, torch.Tensor):
        kv_lens = torch.tensor(list(kv_lens), dtype=torch.int64)
    if kv_lens.dtype.is_floating_point or kv_lens.dtype == torch.bool or kv_lens.dim() != 1:
        raise TypeError(f"kv_lens must be a 1-D integer tensor, got {kv_lens.dtype} "
                        f"{tuple(kv_lens.shape)}")  # fmt: skip
    if kv_lens.shape[0] != B:
        raise ValueError(f"kv_lens must have B = {B} entries, got {kv_lens.shape[0]}")
    return kv_lens.to(device=device, dtype=torch.int32)


def _check_kv_lens_values(lens, Sk):
    """The values of kv_lens, checked inside the operator: a check that reads a tensor's
    values would break a torch.compile graph, so it runs where the kernel does. Not while a
    CUDA graph is being captured, where nothing can be read back: a server that replays one
    (kernels.llm.serve) checks its positions on the host before each replay."""
    if lens is None or (lens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    if bool(((lens < 0) | (lens > Sk)).any()):
        raise ValueError(f"kv_lens must be in [0, Sk = {Sk}], got {lens.tolist()}")


def attention_ref(q, k, v, causal=False, sm_scale=None, kv_lens=None) -> torch.Tensor:
    """The course's reference (kernels.attention.attention_ref) with `kv_lens`: sequence b
    attends over its first kv_lens[b] keys alone, and a query that sees no key gets zeros
    (where the course's softmax over no key would give NaN)."""
    if kv_lens is None:
        return course_attention_ref(q, k, v, causal, sm_scale)
    Sq = q.shape[2]
    out = torch.zeros_like(q)
    for b, n in enumerate(int(n) for n in kv_lens):
        blind = max(Sq - n, 0) if causal else (Sq if n == 0 else 0)  # the first queries see no key
        one = course_attention_ref(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                   causal, sm_scale)  # fmt: skip
        out[b, :, blind:] = one[0, :, blind:]
    return out
