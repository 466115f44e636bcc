"""The small fused kernels that a decoding step needs besides its GEMVs, norms and attention
(Chapter 6, v2): each replaces a chain of torch ops that a step would otherwise launch once per
layer.

rotary_kv(qkv, ...): one fused q/k/v projection's output (B, S, (H + 2 Hkv) * hd) in, the
  rotated queries out as (B, H, S, hd), and the rotated keys and the values written straight
  into the KV cache at each token's position. In torch's ops that is a transpose, two
  rotations of five kernels each (two multiplies, a negate, a concatenation, an add), two cache
  writes and their copies: about a dozen launches a layer for a few kilobytes of data.
rotary_gemv(x, qkv_weight, ...): the same rotation and cache writes as the q/k/v GEMV's epilogue,
  for a decoding step's rows (one token each): the weight's rows i and i + hd/2 of every head
  side by side (pair_halves), so each GEMV tile holds both members of its rotary pairs; one
  launch where the GEMV and rotary_kv take two, nothing recomputed. kernels.split_k's
  `accumulate` is the GEMV; the tile's last piece of K (an arrival counter) rotates and stores.
  Its input may be normalized on the way in (`norm`, below).
silu_mul(gate_up): SwiGLU's silu(gate) * up from one fused gate/up projection (M, 2F) -> (M, F),
  one kernel where torch launches two.
swiglu_linear(gate_up, w_down): the same product computed while the down projection's GEMV
  loads its input (kernels.split_k's GATED tiles), bit for bit what silu_mul then
  kernels.gemv.linear give, with one launch fewer: a decode step's rows only (M <= 64).
norm_linear(x, residual, g, eps, weight): the residual add and RMSNorm before a projection,
  formed while the GEMV loads its input (kernels.split_k's NORM tiles): (y, x + residual), one
  launch where kernels.norm.add_rms_norm and the GEMV take two (M <= 64).
linear_add(x, weight, residual) and the `norm` of the GEMVs after it: the same boundary split
  between two GEMVs, with nothing recomputed and no program waiting for another. The GEMV that
  ends a sub-block (wo, w_down) adds the residual in its epilogue and stores, from each column
  tile, the sum of the squares of its part of each row: (h, squares). The GEMV that starts the
  next (squares_linear; swiglu_gemv and rotary_gemv with `norm`) reads a weight with the
  norm's weight folded into its columns once (fold_norm), loads its input as it is, and scales
  each row of its product by the row's 1 / rms, from the row's few pieces: the norm's launch is
  gone and the GEMV's loop is the plain one.

attention(q, k, v, kv_lens): one query a row (decode) over a KV cache, with grouped-query
  heads: the GROUP query heads that share a key/value head are one tile of rows, so each key
  and value is read once for all of them, and the keys are cut into enough splits to fill the
  SMs (Chapter 5's split-KV kernels, split finer: a step has too few heads to fill a GPU with
  one program each, which left a 512-key decode at 9 programs reading in sequence).

Rotary here is rotate_half's (dimension i pairs with i + hd/2, as kernels.llm.model.rotary):
  out[i]        = x[i] cos[i] - x[i + hd/2] sin[i]
  out[i + hd/2] = x[i + hd/2] cos[i + hd/2] + x[i] sin[i + hd/2]
computed in fp32 and rounded once to the cache's dtype (torch's chain rounds after each op).

Bytes: each reads its input once and writes its output once (rotary_kv also reads cos and sin,
2 * S * hd per row): memory-bound and tiny at decode, so what they save is launches, not bytes.
Forward only; not registered as operators (rotary_kv writes into the cache it is given): they
are the model's, called by kernels.llm.model on the course's backend.
"""

import torch
import triton
import triton.language as tl

from kernels import arrivals, gemv, int8, runtime, split_k
from kernels import norm as course_norm
from kernels.arrivals import last_to_arrive
from kernels.attention import check_attention_inputs
from kernels.batch_invariant import split_kv_attention
from kernels.launch import cdiv, launch, next_power_of_2
from kernels.primitives import dependent_keywords, swiglu, wait_for_previous
from kernels.runtime import processors
from kernels.split_k import product
from kernels.validate import (
    FLOAT_DTYPES,
    check_row_vector,
    check_same,
    check_tensor,
    input_precision,
)


@triton.jit
def rotary_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, pos_ptr,
    S, H, HKV, stride_cb, stride_ch, stride_ct,
    HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    # One program per (token, head); heads 0..H-1 are queries, then Hkv keys, then Hkv values.
    wait_for_previous(PDL)  # dependent launch (kernels.primitives): qkv is the GEMV's output
    token = tl.program_id(0)  # b * S + s
    head = tl.program_id(1)
    b = token // S
    s = token % S
    i = tl.arange(0, BLOCK)
    m = i < HALF
    src = qkv_ptr + token.to(tl.int64) * (H + 2 * HKV) * (2 * HALF) + head * (2 * HALF)
    x1 = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    if head < H + HKV:  # queries and keys turn; values do not
        angle = token.to(tl.int64) * (2 * HALF)
        c1 = tl.load(cos_ptr + angle + i, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + angle + HALF + i, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + angle + i, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + angle + HALF + i, mask=m, other=0.0).to(tl.float32)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:
        y1 = x1
        y2 = x2
    if head < H:  # q (B, H, S, hd), contiguous
        dst = q_ptr + ((b.to(tl.int64) * H + head) * S + s) * (2 * HALF)
    else:  # this row's cache row, at this token's position
        row = tl.load(rows_ptr + b)
        at = tl.load(pos_ptr + token)
        kv_head = head - H
        cache = k_cache_ptr
        if head >= H + HKV:
            kv_head = head - H - HKV
            cache = v_cache_ptr
        dst = cache + row * stride_cb + kv_head * stride_ch + at * stride_ct
    tl.store(dst + i, y1.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(dst + HALF + i, y2.to(q_ptr.dtype.element_ty), mask=m)


def check_rotary_kv_inputs(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads, n_kv_heads):
    check_tensor("qkv", qkv, ndim=3)
    if not qkv.is_contiguous():
        raise ValueError("qkv must be contiguous")
    check_rotary_targets(qkv.shape, qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads,
                         n_kv_heads)  # fmt: skip


def check_rotary_targets(shape, like, cos, sin, k_cache, v_cache, rows, pos, n_heads, n_kv_heads):
    """A fused projection's output of `shape` (B, S, (H + 2 Hkv) * hd) with `like`'s dtype and
    device, against the tables, the caches and the positions it is rotated and written by."""
    B, S, width = shape
    Bc, Hkv, T, hd = k_cache.shape
    if n_kv_heads != Hkv or width != (n_heads + 2 * n_kv_heads) * hd or hd % 2:
        raise ValueError(
            f"qkv (B, S, (H + 2 Hkv) * hd) = {tuple(shape)} does not match {n_heads} query "
            f"heads and a cache of {tuple(k_cache.shape)} (Bc, Hkv, T, hd) with an even hd"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape != k_cache.shape or t.stride() != k_cache.stride() or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a (Bc, Hkv, T, hd) tensor with unit-stride hd, "
                             "the two caches alike")  # fmt: skip
        if t.dtype != like.dtype or t.device != like.device:
            raise ValueError(f"{name} must have qkv's dtype and device")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != B * S * hd or not t.is_contiguous() or t.device != like.device:
            raise ValueError(f"{name} must be a contiguous (B, 1, S, hd) tensor on qkv's device")
    if rows.shape != (B,) or pos.shape != (B, S) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be (B,) and pos (B, S) int64, got {tuple(rows.shape)}, "
                         f"{tuple(pos.shape)}")  # fmt: skip
    if not pos.is_contiguous() or pos.dtype != torch.int64:
        raise ValueError("pos must be contiguous int64")


def rotary_kv(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads: int, n_kv_heads: int):
    """Rotate q and k of a fused projection qkv (B, S, (H + 2 Hkv) * hd) by cos and sin
    (B, 1, S, hd); write k and v into k_cache, v_cache (Bc, Hkv, T, hd) at row rows[b] (B,),
    position pos[b, s] (B, S); return q (B, H, S, hd). Positions must lie inside the cache
    (the model checks that before the step)."""
    check_rotary_kv_inputs(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads, n_kv_heads)
    B, S, _ = qkv.shape
    hd = k_cache.shape[-1]
    q = qkv.new_empty((B, n_heads, S, hd))
    if B * S == 0:
        return q
    grid = (B * S, n_heads + 2 * n_kv_heads)
    launch(rotary_kv_kernel, grid,
           qkv, cos, sin, q, k_cache, v_cache, rows, pos, S, n_heads, n_kv_heads,
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           HALF=hd // 2, BLOCK=next_power_of_2(hd // 2),
           **dependent_keywords(runtime.PDL))  # fmt: skip
    return q


def rotary_kv_ref(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads: int, n_kv_heads: int):
    """The same in fp64 torch ops, writing into the caches (in their dtype) and returning q."""
    B, S, _ = qkv.shape
    hd = k_cache.shape[-1]
    x = qkv.double().view(B, S, n_heads + 2 * n_kv_heads, hd).transpose(1, 2)  # (B, nh, S, hd)
    c, s = cos.double().view(B, 1, S, hd), sin.double().view(B, 1, S, hd)
    x1, x2 = x.chunk(2, dim=-1)
    turned = x * c + torch.cat([-x2, x1], dim=-1) * s
    q, k = turned[:, :n_heads], turned[:, n_heads : n_heads + n_kv_heads]
    v = x[:, n_heads + n_kv_heads :]
    k_cache[rows[:, None], :, pos] = k.transpose(1, 2).to(k_cache.dtype)  # (B, S, Hkv, hd)
    v_cache[rows[:, None], :, pos] = v.transpose(1, 2).to(v_cache.dtype)
    return q.to(qkv.dtype)


def rotary_gemv_metadata(grid, kernel, args) -> dict:
    """split_k's profiler entry, with the keys and values the kernel writes into the cache."""
    meta = split_k.split_k_metadata(grid, kernel, args)
    written = 2 * args["M"] * args["HKV"] * 2 * args["HALF"] * args["out_ptr"].element_size()
    return {**meta, "bytes": meta["bytes"] + written}


# M is not specialized (see kernels.split_k): one kernel for every batch size.
@triton.jit(do_not_specialize=["M"], launch_metadata=rotary_gemv_metadata)
def rotary_gemv_kernel(
    a_ptr, b_ptr, out_ptr, part_ptr, scale_ptr, count_ptr, M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn,
    cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, pos_ptr,
    stride_cb, stride_ch, stride_ct, H, HKV, sq_ptr, eps, n_squares,
    # NORM 3: the product's rows scaled by 1 / rms from a's squares at sq (split_k's)
    NORM: tl.constexpr, ROW: tl.constexpr,
    HALF: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_ROWS: tl.constexpr = 0, LINE: tl.constexpr = 64,
):  # fmt: skip
    # kernels.split_k's GEMV (its rows scaled by 1 / rms or not, its input never gated), then
    # rotary_kv's work as its ending
    acc, rows, cols, split, tile, pieces = split_k.accumulate(
        a_ptr, b_ptr, M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn,
        sq_ptr, a_ptr, a_ptr, eps, n_squares, NORM, ROW, EVEN_K, INPUT_PRECISION, USE_DOT,
        False, BLOCK_M, BLOCK_N, BLOCK_K, PDL, PREFETCH_ROWS, LINE,
    )  # fmt: skip
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if DIRECT:
        store_rotated(acc, out_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                      rows_ptr, pos_ptr, rows, cols, mask, M, N, stride_cb, stride_ch, stride_ct,
                      H, HKV, HALF, HAS_SCALE)  # fmt: skip
    else:  # the tile's last piece to finish sums the partials (always: no reduce kernel)
        part_ptrs = split_k.store_partials(acc, part_ptr, rows, cols, mask, M, N, split)
        if last_to_arrive(count_ptr, tile, pieces):
            acc = split_k.sum_partials(part_ptrs, M * N, pieces, mask)
            store_rotated(acc, out_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                          rows_ptr, pos_ptr, rows, cols, mask, M, N, stride_cb, stride_ch,
                          stride_ct, H, HKV, HALF, HAS_SCALE)  # fmt: skip


@triton.jit
def store_rotated(
    acc, out_ptr, scale_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, rows_ptr, pos_ptr,
    rows, cols, mask, M, N, stride_cb, stride_ch, stride_ct, H, HKV,
    HALF: tl.constexpr, HAS_SCALE: tl.constexpr,
):  # fmt: skip
    """rotary_kv on a tile of the q/k/v product whose columns come in rotary pairs
    (pair_halves): column 2p holds dimension i of a head and 2p + 1 dimension i + HALF, so
    the tile holds both members of each pair. Each value is rounded to the output's dtype
    first, as the GEMV would store it for rotary_kv; queries go to q (M, H * hd), keys and
    values into the cache at each row's cache row and position. Row m is token m (S = 1)."""
    dtype = out_ptr.dtype.element_ty
    acc = split_k.scaled_epilogue(acc, scale_ptr, scale_ptr, cols, N, HAS_SCALE, False, "none")
    y = acc.to(dtype).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(y, (y.shape[0], y.shape[1] // 2, 2)))
    pair = tl.split(tl.reshape(cols, (cols.shape[0] // 2, 2)))[0] // 2
    mask = tl.split(tl.reshape(mask, (mask.shape[0], mask.shape[1] // 2, 2)))[0]
    head = (pair // HALF)[None, :]  # 0..H-1 queries, then HKV keys, then HKV values
    i = (pair % HALF)[None, :]
    token = rows.to(tl.int64)[:, None]
    angle = token * (2 * HALF) + i
    turn = mask & (head < H + HKV)  # queries and keys turn; values do not
    c1 = tl.load(cos_ptr + angle, mask=turn, other=1.0).to(tl.float32)
    c2 = tl.load(cos_ptr + angle + HALF, mask=turn, other=1.0).to(tl.float32)
    s1 = tl.load(sin_ptr + angle, mask=turn, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + angle + HALF, mask=turn, other=0.0).to(tl.float32)
    y1 = tl.where(turn, x1 * c1 - x2 * s1, x1).to(dtype)
    y2 = tl.where(turn, x2 * c2 + x1 * s2, x2).to(dtype)
    q = out_ptr + token * (H * 2 * HALF) + head * (2 * HALF) + i  # (M, H, 1, hd)
    is_q = mask & (head < H)
    tl.store(q, y1, mask=is_q)
    tl.store(q + HALF, y2, mask=is_q)
    slot = tl.load(rows_ptr + rows, mask=rows < M, other=0)[:, None]  # int64, as pos
    at = tl.load(pos_ptr + rows, mask=rows < M, other=0)[:, None]
    is_v = head >= H + HKV
    kv_head = tl.where(is_v, head - H - HKV, head - H)
    cache = slot * stride_cb + kv_head * stride_ch + at * stride_ct + i
    is_k = mask & (head >= H) & ~is_v
    tl.store(k_cache_ptr + cache, y1, mask=is_k)
    tl.store(k_cache_ptr + cache + HALF, y2, mask=is_k)
    tl.store(v_cache_ptr + cache, y1, mask=mask & is_v)
    tl.store(v_cache_ptr + cache + HALF, y2, mask=mask & is_v)


def weight_gemv(x, weight, scale=None):
    """x @ weight.T by kernels.gemv.linear, or with `scale` by kernels.int8.linear (an int8
    weight): the unfused GEMV that each fused one here is checked and falls back against."""
    return gemv.linear(x, weight) if scale is None else int8.linear(x, weight, scale)


def weight_gemv_ref(x, weight, scale=None):
    """weight_gemv's reference: kernels.gemv's, or kernels.int8's with `scale`."""
    return gemv.linear_ref(x, weight) if scale is None else int8.linear_ref(x, weight, scale)


def gemv_kind(x, weight, scale):
    """(kernels.split_k's kind, the scale to pass) for x @ weight.T, checked as
    kernels.gemv.linear checks it, or with `scale` as kernels.int8.linear does (an int8 weight)."""
    if scale is None:
        gemv.check_linear_inputs(x, weight, None)
        return "gemv", None
    int8.check_int8_inputs(x, weight, scale, None)
    return "int8", scale.contiguous()


def rotary_gemv(
    x,
    qkv_weight,
    cos,
    sin,
    k_cache,
    v_cache,
    rows,
    pos,
    n_heads: int,
    n_kv_heads: int,
    scale=None,
    splits=None,
    norm=None,
) -> torch.Tensor:
    """rotary_kv of x (B, K) @ w.T, w the fused q/k/v weight (H + 2 Hkv) * hd x K, in one
    kernel: the GEMV (kernels.gemv.linear; with `scale`, an int8 weight as kernels.int8.linear)
    with the rotation and the cache writes in its epilogue, one launch where the GEMV and
    rotary_kv take two. `qkv_weight` is pair_halves(w, hd / 2) (and `scale` paired the same
    way), so that every tile holds both members of each rotary pair. One token a row (a
    decoding step): cos, sin (B, 1, 1, hd), rows (B,), pos (B, 1); returns q (B, H, 1, hd), the
    values rotary_kv gives after the GEMV (q/k/v rounded to x's dtype first). `norm`:
    (squares, eps), x normalized by its sums of squares, the weight folded (check_norm).
    `splits`: K cut into at most that many pieces (kernels.split_k.choose_plan), for tests."""
    check_tensor("x", x, ndim=2)
    split_k.check_splits(splits)
    squares = check_norm(norm, x)
    B, hd = x.shape[0], k_cache.shape[-1]
    width = (n_heads + 2 * n_kv_heads) * hd
    check_rotary_targets((B, 1, width), x, cos, sin, k_cache, v_cache, rows, pos, n_heads,
                         n_kv_heads)  # fmt: skip
    if qkv_weight.dim() != 2 or qkv_weight.shape[0] != width:
        raise ValueError(f"qkv_weight must be ((H + 2 Hkv) * hd, K) = ({width}, K), got "
                         f"{tuple(qkv_weight.shape)}")  # fmt: skip
    kind, scale = gemv_kind(x, qkv_weight, scale)
    q = x.new_empty((B, n_heads, 1, hd))
    if B == 0:
        return q
    b = qkv_weight.t()
    plan = split_k.choose_plan(x, b, kind, scale, splits=splits)  # the plain GEMV's plan
    tiles = cdiv(B, plan.tile.BLOCK_M) * cdiv(width, plan.tile.BLOCK_N)
    count = arrivals.counters(x.device, tiles) if plan.splits > 1 else q
    if count is None:  # no counters to be had (kernels.arrivals): the GEMV, then rotary_kv
        qkv = split_k._run(x, b, plan, scale, squares=squares)
        qkv = unpair_halves(qkv, hd // 2).view(B, 1, width)
        return rotary_kv(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads, n_kv_heads)
    parts = q if plan.splits == 1 else x.new_empty((plan.splits, B, width), dtype=torch.float32)
    norm_args, norm_flags = norm_arguments(squares, q)
    launch(rotary_gemv_kernel, (tiles * plan.splits,),
           x, b, q, parts, q if scale is None else scale, count, B, width, x.shape[1],
           plan.k_per_split, *x.stride(), *b.stride(), cos, sin, k_cache, v_cache, rows, pos,
           *k_cache.stride()[:3], n_heads, n_kv_heads, *norm_args, **norm_flags,
           HALF=hd // 2, DIRECT=plan.splits == 1,
           EVEN_K=x.shape[1] % plan.tile.BLOCK_K == 0, HAS_SCALE=scale is not None,
           INPUT_PRECISION=input_precision(x.dtype), USE_DOT=not runtime.INTERPRET,
           **plan.tile.meta(), **split_k.pdl_keywords(b, plan, runtime.PDL))  # fmt: skip
    return q


def rotary_gemv_ref(
    x, qkv_weight, cos, sin, k_cache, v_cache, rows, pos, n_heads: int, n_kv_heads: int,
    scale=None, norm=None,
) -> torch.Tensor:  # fmt: skip
    """The GEMV's reference (with `norm`, normed_gemv_ref's), its columns unpaired, then
    rotary_kv's (fp64)."""
    y = normed_gemv_ref(x, qkv_weight, scale, norm)
    qkv = unpair_halves(y, k_cache.shape[-1] // 2).view(x.shape[0], 1, -1)
    return rotary_kv_ref(qkv, cos, sin, k_cache, v_cache, rows, pos, n_heads, n_kv_heads)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous(PDL)  # gate_up is the GEMV's output
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < F
    gate = tl.load(gu_ptr + row * 2 * F + cols, mask=m, other=0.0)
    up = tl.load(gu_ptr + row * 2 * F + F + cols, mask=m, other=0.0)
    out = swiglu(gate, up)
    tl.store(out_ptr + row * F + cols, out.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (..., 2F) holding gate then up: (..., F), in fp32 inside,
    output in gate_up's dtype."""
    check_tensor("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up's last dim must be 2F (gate, then up), got {tuple(gate_up.shape)}"
        )
    if not gate_up.is_contiguous():
        gate_up = gate_up.contiguous()
    F = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], F))
    rows = gate_up.numel() // max(2 * F, 1)
    if out.numel() == 0:
        return out
    block = min(1024, next_power_of_2(F))
    launch(silu_mul_kernel, (rows, cdiv(F, block)), gate_up, out, F, BLOCK=block,
           **dependent_keywords(runtime.PDL))  # fmt: skip
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def pair_halves(t: torch.Tensor, half: int) -> torch.Tensor:
    """t (n * 2 half, ...) with rows i and i + half of every block of 2 half rows side by side,
    at 2i and 2i + 1: the layout in which a GEMV's tile holds both members of each pair
    (swiglu_gemv's gate and up, rotary_gemv's rotary pairs). A weight or an int8 weight's
    scales, built once at load."""
    if t.dim() == 0 or half < 1 or t.shape[0] % (2 * half):
        raise ValueError(f"pair_halves needs rows in blocks of 2 * half = {2 * half}, got "
                         f"{tuple(t.shape)}")  # fmt: skip
    return t.reshape(-1, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpair_halves(y: torch.Tensor, half: int) -> torch.Tensor:
    """The columns of a product (M, n * 2 half) over pair_halves(w, half) put back in w's
    order: pair_halves' inverse, along the columns."""
    return y.reshape(y.shape[0], -1, half, 2).transpose(2, 3).reshape(y.shape)


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(2F, ...) with gate's row j at 2j and up's at 2j + 1: the layout swiglu_gemv reads."""
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}")  # fmt: skip
    return pair_halves(torch.cat((gate, up)), gate.shape[0])


def gate_then_up(y: torch.Tensor) -> torch.Tensor:
    """The columns of a product over interleave_rows(gate, up) (M, 2F) put back as silu_mul
    reads them: gate's F columns, then up's."""
    return unpair_halves(y, y.shape[1] // 2)


def swiglu_gemv(x: torch.Tensor, gate_up: torch.Tensor, scale=None, norm=None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for x (M, K) and gate_up = interleave_rows(gate, up)
    (2F, K): the gate-and-up GEMV (kernels.gemv.linear; with `scale` (2F,), interleaved the
    same way, an int8 weight as kernels.int8.linear) with SwiGLU's product in its epilogue: a
    GEMV tile holds each gate column beside its up column, so the product costs each program
    a few operations on what it already holds, and no kernel of its own. Output (M, F) in x's
    dtype: the values of silu_mul after the GEMV (gate and up rounded to x's dtype first).
    `norm`: (squares, eps), x normalized by its sums of squares, the weight folded
    (check_norm)."""
    if gate_up.dim() != 2 or gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must be (2F, K), gate and up rows interleaved "
                         f"(interleave_rows), got {tuple(gate_up.shape)}")  # fmt: skip
    kind, scale = gemv_kind(x, gate_up, scale)
    squares = check_norm(norm, x)
    return product(x, gate_up.t(), kind=kind, scale=scale, activation="swiglu", squares=squares)


def swiglu_gemv_ref(x: torch.Tensor, gate_up: torch.Tensor, scale=None, norm=None):
    """The GEMV's reference (with `norm`, normed_gemv_ref's), then silu_mul's."""
    y = normed_gemv_ref(x, gate_up, scale, norm)
    return silu_mul_ref(gate_then_up(y))


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, scale=None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up (M, 2F), gate then up, and weight (N, F): the
    decode GEMV (kernels.gemv.linear; with `scale`, an int8 weight as kernels.int8.linear) with
    SwiGLU's product formed as it loads its input. Output (M, N) in gate_up's dtype."""
    check_tensor("gate_up", gate_up, ndim=2)
    if gate_up.shape[1] != 2 * weight.shape[1]:
        raise ValueError(
            f"gate_up (M, 2F) must have twice weight's F columns: gate_up "
            f"{tuple(gate_up.shape)}, weight {tuple(weight.shape)} (N, F)"
        )
    up = gate_up[:, weight.shape[1] :]  # stands in for the checks: the kernel's input is (M, F)
    kind, scale = gemv_kind(up, weight, scale)
    return product(gate_up, weight.t(), kind=kind, scale=scale, gated=True)


def swiglu_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor, scale=None) -> torch.Tensor:
    """silu_mul then the GEMV's reference, in fp64 (the product rounded to gate_up's dtype
    first, as the kernel rounds it)."""
    return weight_gemv_ref(silu_mul_ref(gate_up), weight, scale)


NORM_MAX_K = 16384  # norm_linear's longest row: each program holds one row of x and residual


def norm_linear(x, residual, norm_weight, eps: float, weight, scale=None, keep_sum=True):
    """(y, h) with h = x + residual (rounded to x's dtype), y = rms_norm(h) * norm_weight @
    weight.T: the residual add and RMSNorm that come before a projection, formed inside the
    decode GEMV's loads (kernels.split_k's NORM tiles), so that the norm needs no launch of its
    own. x, residual (M, K) contiguous, M <= kernels.gemv.MAX_ROWS (every program sums its rows'
    squares over all of K first: cheap for a decoding step's few rows); norm_weight (K,);
    weight (N, K) in x's dtype, or int8 with its `scale` (N,) (kernels.int8.quantize). h is
    None without `keep_sum` (the head's norm: nothing reads the stream after it). The same
    values as kernels.norm.add_rms_norm then the GEMV; the same bits are not promised (each
    sums a row's squares in one fp32 reduction, whose order Triton lays out per kernel)."""
    check_tensor("x", x, ndim=2)
    check_same("x and residual", x, residual)
    check_row_vector("norm_weight", norm_weight, x)
    M = x.shape[0]
    if not x.is_contiguous() or not residual.is_contiguous():
        raise ValueError("norm_linear takes contiguous x and residual")
    if x.shape[1] > NORM_MAX_K:
        raise ValueError(f"norm_linear keeps a whole row in registers: at most {NORM_MAX_K} "
                         f"columns, got {x.shape[1]}")  # fmt: skip
    if M > gemv.MAX_ROWS:
        raise ValueError(f"norm_linear is for a decoding step's rows (M <= {gemv.MAX_ROWS}), "
                         f"got M = {M}: use kernels.norm.add_rms_norm, then a matmul")  # fmt: skip
    kind, scale = gemv_kind(x, weight, scale)
    g = norm_weight.contiguous()
    if M == 0 or x.shape[1] == 0:  # nothing to normalize over: the unfused path's answer
        y, h = course_norm.add_rms_norm(x, residual, g, eps)
        return weight_gemv(y, weight, scale), (h if keep_sum else None)
    h = torch.empty_like(x) if keep_sum else None
    y = product(x, weight.t(), kind=kind, scale=scale, norm=(residual, g, float(eps), h))
    return y, h


def norm_linear_ref(x, residual, norm_weight, eps: float, weight, scale=None):
    """(y, h) from kernels.norm's add_rms_norm reference, then the GEMV's, in fp64."""
    y, h = course_norm.add_rms_norm_ref(x, residual, norm_weight, eps)
    return weight_gemv_ref(y, weight, scale), h


def linear_add(x, weight, residual, scale=None, splits=None):
    """(h, squares): h = residual + x @ weight.T (the product rounded to x's dtype first, the
    sum as kernels.norm's add_rms_norm rounds it), a projection that ends a sub-block (wo,
    w_down) with the residual add in its GEMV's epilogue (kernels.split_k's "add_squares"
    ending); squares (M, column tiles) fp32: each column tile's sum of the squares of its part
    of each row of h, the pieces from which the GEMV after it (`norm`: check_norm) forms the
    rows' 1 / rms. Together the two replace kernels.norm.add_rms_norm's launch, nothing
    recomputed. x (M, K), M <= kernels.gemv.MAX_ROWS; weight (N, K) in x's dtype, or int8
    with its `scale` (N,); residual (M, N) in x's dtype. `splits`: K cut into at most that
    many pieces (kernels.split_k.choose_plan), for tests."""
    check_tensor("x", x, ndim=2)
    split_k.check_splits(splits)
    kind, scale = gemv_kind(x, weight, scale)
    M, K, N = x.shape[0], x.shape[1], weight.shape[0]
    check_tensor("residual", residual, ndim=2)
    check_same("x and residual", x, residual, shape=False)
    if residual.shape != (M, N):
        raise ValueError(f"residual must be (M, N) = ({M}, {N}), the product's shape, got "
                         f"{tuple(residual.shape)}")  # fmt: skip
    if M > gemv.MAX_ROWS:
        raise ValueError(f"linear_add is for a decoding step's rows (M <= {gemv.MAX_ROWS}), "
                         f"got M = {M}: use a matmul, then kernels.norm.add_rms_norm")  # fmt: skip
    residual = residual.contiguous()
    if M == 0 or N == 0 or K == 0:  # nothing to sum: the residual, its squares in one piece
        h = residual.clone()
        return h, h.float().pow(2).sum(-1, keepdim=True)
    b = weight.t()
    plan = split_k.choose_plan(x, b, kind, scale, splits=splits)  # the plain GEMV's plan
    tiles = cdiv(M, plan.tile.BLOCK_M) * cdiv(N, plan.tile.BLOCK_N)
    if plan.splits > 1 and not split_k.last_piece_sums(plan):  # too many partials for a
        # tile's last piece to sum: as many pieces as it sums (the 1B shape's w_down, nine
        # pieces of 64 x 128 tiles, in eight; in one it took 4x the GEMV's time)
        most = split_k.LAST_SUM_MAX_ELEMENTS // (plan.tile.BLOCK_M * plan.tile.BLOCK_N)
        plan = split_k._with_splits(plan, K, max(most, 1))
    if plan.splits > 1 and arrivals.counters(x.device, tiles) is None:  # nothing to count
        # arrivals with: one piece, nothing to sum
        plan = split_k._with_splits(plan, K, 1)
    squares = x.new_empty((M, cdiv(N, plan.tile.BLOCK_N)), dtype=torch.float32)
    h = split_k._run(x, b, plan, scale, None, "add_squares", norm=(residual, squares))
    return h, squares


def linear_add_ref(x, weight, residual, scale=None):
    """The GEMV's reference (rounded to x's dtype), then torch's add (rounded to x's dtype)."""
    return weight_gemv_ref(x, weight, scale) + residual


def check_norm(norm, x):
    """A GEMV's `norm` (None, or (squares, eps): its input x (M, K) is the stream, its weight
    has a norm's weight folded in (fold_norm), and the product is rms_norm(x) * g @ W.T, each
    row's sum of squares in pieces, squares (M, pieces) fp32 from linear_add) -> the squares
    tuple kernels.split_k takes."""
    if norm is None:
        return None
    if not isinstance(norm, tuple) or len(norm) != 2:
        raise TypeError("norm must be (squares, eps) (linear_add's squares; the weight folded "
                        "by fold_norm)")  # fmt: skip
    squares, eps = norm
    check_tensor("squares", squares, ndim=2)
    if (squares.dtype != torch.float32 or squares.shape[0] != x.shape[0] or squares.shape[1] < 1
            or not squares.is_contiguous() or squares.device != x.device):  # fmt: skip
        raise ValueError(f"squares must be a contiguous fp32 (M, pieces) tensor on x's device "
                         f"with x's {x.shape[0]} rows, got {tuple(squares.shape)} "
                         f"{squares.dtype}")  # fmt: skip
    return squares, float(eps)


def norm_arguments(squares, stand_in) -> tuple:
    """A kernel's (sq_ptr, eps, n_squares) and its NORM and ROW keywords, for check_norm's
    squares (or none: a stand-in, never read)."""
    if squares is None:
        return (stand_in, 0.0, 1), {"NORM": 0, "ROW": 1}
    sq, eps = squares
    return (sq, eps, sq.shape[1]), {"NORM": 3, "ROW": next_power_of_2(sq.shape[1])}


def fold_norm(weight, norm_weight, scale=None):
    """(weight, scale) of the GEMV after an RMSNorm with its weight g folded into the columns:
    rms_norm(x) * g @ W.T = (x @ (W * g).T) / rms(x), so that a GEMV given x's sums of squares
    (`norm`) loads x as it is and scales each row of its product once. W * g rounded to W's
    dtype; an int8 weight (with its `scale`) is dequantized, folded and quantized again
    (kernels.int8.quantize). Done once, when a model's weights are stacked."""
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES + (torch.int8,))
    check_tensor("norm_weight", norm_weight, ndim=1)
    if norm_weight.shape[0] != weight.shape[1]:
        raise ValueError(f"norm_weight must have the weight's {weight.shape[1]} columns, got "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    if weight.dtype == torch.int8 and scale is None:
        raise ValueError("an int8 weight needs its scale to be folded")
    g = norm_weight.float()[None, :]
    if scale is None:
        return (weight.float() * g).to(weight.dtype), None
    return int8.quantize(weight.float() * scale.float()[:, None] * g)


def normed_gemv_ref(x, weight, scale=None, norm=None):
    """weight_gemv's reference; with `norm` ((squares, eps); the squares unread, the weight
    folded), each row of the product in fp64 times the row's 1 / rms (fp64, over x itself),
    rounded to x's dtype."""
    if norm is None:
        return weight_gemv_ref(x, weight, scale)
    xd, w = x.double(), weight.double()
    if scale is not None:
        w = w * scale.double()[:, None]
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm[1])
    return ((xd @ w.T) * rstd).to(x.dtype)


def squares_linear(h, squares, eps: float, weight, scale=None):
    """rms_norm(h) * g @ W.T for the stream h (M, K) that linear_add formed, with its rows'
    sums of squares in pieces (`squares`), and weight = fold_norm(W, g) (with `scale`, an
    int8 weight as kernels.int8.linear): the plain GEMV's loop over h as it is, each row of
    the product scaled by its 1 / rms, which each program adds up from the row's few pieces:
    no norm kernel. M <= kernels.gemv.MAX_ROWS. Within rounding of kernels.norm.rms_norm then
    the GEMV (g is rounded into the weight, and the normalized h is never rounded)."""
    check_tensor("h", h, ndim=2)
    kind, scale = gemv_kind(h, weight, scale)
    norm = check_norm((squares, eps), h)
    if h.shape[0] > gemv.MAX_ROWS:
        raise ValueError(f"squares_linear is for a decoding step's rows (M <= "
                         f"{gemv.MAX_ROWS}), got M = {h.shape[0]}: use kernels.norm.rms_norm, "
                         "then a matmul")  # fmt: skip
    return product(h, weight.t(), kind=kind, scale=scale, squares=norm)


def squares_linear_ref(h, eps: float, weight, scale=None):
    """normed_gemv_ref for squares_linear (fp64, rounded to h's dtype)."""
    return normed_gemv_ref(h, weight, scale, (None, eps))


def decode_split(Sk: int, kv_heads: int, sms: int | None = None) -> int:
    """Keys a split for decode attention: enough splits that the key/value heads times the
    splits cover the SMs twice, each a whole number of BLOCK_N keys. From (Sk, kv_heads) and
    the device alone, never the batch: a row's bits do not depend on its company. 512 keys and
    3 key/value heads on 132 SMs: splits of 64, 8 a head, 24 programs a row."""
    block = split_kv_attention.CONFIG["BLOCK_N"]
    want = cdiv(2 * (sms or processors()), max(kv_heads, 1))
    return block * cdiv(cdiv(max(Sk, 1), want), block)


def attention(q, k, v, kv_lens=None, sm_scale=None) -> torch.Tensor:
    """softmax(q k^T * sm_scale) v for one query a row: q (B, H, 1, D) over k and v
    (B, H_kv, Sk, D), H a multiple of H_kv; the query is the row's last position, so it sees
    every key (or row b's first kv_lens[b], a (B,) integer tensor). -> (B, H, 1, D) in q's
    dtype, fp32 arithmetic."""
    sm_scale = check_attention_inputs(q, k, v, sm_scale)
    B, H, Sq, D = q.shape
    if Sq != 1:
        raise ValueError(f"decode attention takes one query a row, got q of shape {tuple(q.shape)}")
    H_kv = k.shape[1]
    lens = split_kv_attention._kv_lens(kv_lens, B, q.device)
    grouped = q.reshape(B, H_kv, H // H_kv, D)  # query heads kv_h * GROUP + g: rows of kv_h
    split = decode_split(k.shape[2], H_kv)
    out = split_kv_attention._attention(grouped, k, v, False, sm_scale, lens, split)
    return out.view(B, H, 1, D)
