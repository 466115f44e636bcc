"""The small fused kernels that a decoding step needs besides its GEMVs, norms and attention
(Chapter 6, v2): each replaces a chain of torch ops that a step would otherwise launch once per
layer.

rotary_kv(qkv, ...): one fused q/k/v projection's output (B, S, (H + 2 Hkv) * hd) in, the
  rotated queries out as (B, H, S, hd), and the rotated keys and the values written straight
  into the KV cache at each token's position. In torch's ops that is a transpose, two
  rotations of five kernels each (two multiplies, a negate, a concatenation, an add), two cache
  writes and their copies: about a dozen launches a layer for a few kilobytes of data.
silu_mul(gate_up): SwiGLU's silu(gate) * up from one fused gate/up projection (M, 2F) -> (M, F),
  one kernel where torch launches two.
swiglu_linear(gate_up, w_down): the same product computed while the down projection's GEMV
  loads its input (kernels.split_k's GATED tiles), bit for bit what silu_mul then
  kernels.gemv.linear give, with one launch fewer: a decode step's rows only (M <= 64).
norm_linear(x, residual, g, eps, weight): the residual add and RMSNorm before a projection,
  formed while the GEMV loads its input (kernels.split_k's NORM tiles): (y, x + residual), one
  launch where kernels.norm.add_rms_norm and the GEMV take two (M <= 64).

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

from kernels import gemv, int8, runtime
from kernels import norm as course_norm
from kernels.attention import check_attention_inputs
from kernels.batch_invariant import split_kv_attention
from kernels.launch import cdiv, launch, next_power_of_2
from kernels.primitives import dependent_keywords, swiglu, wait_for_previous
from kernels.runtime import processors
from kernels.split_k import product
from kernels.validate import check_row_vector, check_same, check_tensor


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
    B, S, width = qkv.shape
    Bc, Hkv, T, hd = k_cache.shape
    if n_kv_heads != Hkv or width != (n_heads + 2 * n_kv_heads) * hd or hd % 2:
        raise ValueError(
            f"qkv (B, S, (H + 2 Hkv) * hd) = {tuple(qkv.shape)} does not match {n_heads} query "
            f"heads and a cache of {tuple(k_cache.shape)} (Bc, Hkv, T, hd) with an even hd"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape != k_cache.shape or t.stride() != k_cache.stride() or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a (Bc, Hkv, T, hd) tensor with unit-stride hd, "
                             "the two caches alike")  # fmt: skip
        if t.dtype != qkv.dtype or t.device != qkv.device:
            raise ValueError(f"{name} must have qkv's dtype and device")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != B * S * hd or not t.is_contiguous() or t.device != qkv.device:
            raise ValueError(f"{name} must be a contiguous (B, 1, S, hd) tensor on qkv's device")
    if rows.shape != (B,) or pos.shape != (B, S) or rows.dtype != torch.int64:
        raise ValueError(f"rows must be (B,) and pos (B, S) int64, got {tuple(rows.shape)}, "
                         f"{tuple(pos.shape)}")  # fmt: skip
    if not qkv.is_contiguous() or not pos.is_contiguous() or pos.dtype != torch.int64:
        raise ValueError("qkv and pos must be contiguous, pos int64")


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


def interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(2F, ...) with gate's row j at 2j and up's at 2j + 1: the layout swiglu_gemv reads (a
    weight, or an int8 weight's scales), built once at load."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)}, "
                         f"{tuple(up.shape)}")  # fmt: skip
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def gate_then_up(y: torch.Tensor) -> torch.Tensor:
    """The columns of a product over interleave_rows(gate, up) (M, 2F) put back as silu_mul
    reads them: gate's F columns, then up's."""
    return torch.cat((y[:, 0::2], y[:, 1::2]), dim=1)


def swiglu_gemv(x: torch.Tensor, gate_up: torch.Tensor, scale=None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for x (M, K) and gate_up = interleave_rows(gate, up)
    (2F, K): the gate-and-up GEMV (kernels.gemv.linear; with `scale` (2F,), interleaved the
    same way, an int8 weight as kernels.int8.linear) with SwiGLU's product in its epilogue: a
    GEMV tile holds each gate column beside its up column, so the product costs each program
    a few operations on what it already holds, and no kernel of its own. Output (M, F) in x's
    dtype: the values of silu_mul after the GEMV (gate and up rounded to x's dtype first)."""
    if gate_up.dim() != 2 or gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must be (2F, K), gate and up rows interleaved "
                         f"(interleave_rows), got {tuple(gate_up.shape)}")  # fmt: skip
    if scale is None:
        gemv.check_linear_inputs(x, gate_up, None)
        return product(x, gate_up.t(), kind="gemv", activation="swiglu")
    int8.check_int8_inputs(x, gate_up, scale, None)
    return product(x, gate_up.t(), kind="int8", scale=scale.contiguous(), activation="swiglu")


def swiglu_gemv_ref(x: torch.Tensor, gate_up: torch.Tensor, scale=None) -> torch.Tensor:
    """The GEMV's reference (fp64), rounded to x's dtype, then silu_mul's reference."""
    y = gemv.linear_ref(x, gate_up) if scale is None else int8.linear_ref(x, gate_up, scale)
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
    if scale is None:
        gemv.check_linear_inputs(up, weight, None)
        return product(gate_up, weight.t(), kind="gemv", gated=True)
    int8.check_int8_inputs(up, weight, scale, None)
    return product(gate_up, weight.t(), kind="int8", scale=scale.contiguous(), gated=True)


def swiglu_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor, scale=None) -> torch.Tensor:
    """silu_mul then the GEMV's reference, in fp64 (the product rounded to gate_up's dtype
    first, as the kernel rounds it)."""
    act = silu_mul_ref(gate_up)
    if scale is not None:
        return int8.linear_ref(act, weight, scale)
    return gemv.linear_ref(act, weight)


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
    if scale is None:
        gemv.check_linear_inputs(x, weight, None)
        kind = "gemv"
    else:
        int8.check_int8_inputs(x, weight, scale, None)
        kind, scale = "int8", scale.contiguous()
    g = norm_weight.contiguous()
    if M == 0 or x.shape[1] == 0:  # nothing to normalize over: the unfused path's answer
        y, h = course_norm.add_rms_norm(x, residual, g, eps)
        out = int8.linear(y, weight, scale) if scale is not None else gemv.linear(y, weight)
        return out, (h if keep_sum else None)
    h = torch.empty_like(x) if keep_sum else None
    y = product(x, weight.t(), kind=kind, scale=scale, norm=(residual, g, float(eps), h))
    return y, h


def norm_linear_ref(x, residual, norm_weight, eps: float, weight, scale=None):
    """(y, h) from kernels.norm's add_rms_norm reference, then the GEMV's, in fp64."""
    y, h = course_norm.add_rms_norm_ref(x, residual, norm_weight, eps)
    if scale is not None:
        return int8.linear_ref(y, weight, scale), h
    return gemv.linear_ref(y, weight), h


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
