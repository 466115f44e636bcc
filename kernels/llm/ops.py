"""The model's reductions behind one switch: torch's ops or the course's.

    backend "torch":    F.linear, an RMSNorm written with `mean`, scaled_dot_product_attention
    backend "kernels":  kernels.gemv / kernels.matmul, kernels.norm.rms_norm and add_rms_norm,
                        kernels.attention (kernels.decode.attention for one query a row); an
                        int8 weight (kernels.llm.quant) goes to kernels.int8

Inside `batch_invariant_mode()` both run batch-invariant: "kernels" calls the
kernels.batch_invariant ops itself; "torch" gets them from the mode, which routes aten::mm,
addmm and mean.dim (the mode cannot route SDPA, so its attention is called here, with kv_lens).

Attention is always causal, over (B, Hkv, Sk, hd) keys and values shared by n_heads / n_kv_heads
query heads, with `kv_lens` (B,): row b's keys are its first kv_lens[b] (the rest is padding)
and its queries are the last positions before kv_lens[b]. None: every row sees all Sk keys.
"""

import torch
import torch.nn.functional as F

from kernels import attention as course_attention
from kernels import batch_invariant, decode, gemv, int8
from kernels import matmul as course_matmul
from kernels import norm as course_norm

BACKENDS = ("torch", "kernels")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; the backends are {BACKENDS}")
    return backend


def linear(x, weight, backend, scale=None):
    """x (..., K) @ weight (N, K).T -> (..., N): one matmul of M = x.numel() / K rows; a decode
    step's few rows go to the GEMV (kernels.gemv), which reads each weight row once. With
    `scale` (N,) fp32, weight is int8 (kernels.int8.quantize): x @ (weight * scale[:, None]).T."""
    if scale is not None:
        if backend == "torch":  # torch's way (gpt-fast's): upcast the int8 weight, scale after
            return F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        return int8.linear(x2, weight, scale).view(*x.shape[:-1], weight.shape[0])
    if backend == "torch":
        return F.linear(x, weight)
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    if batch_invariant.enabled():  # one kernel whatever M: the invariant matmul
        out = batch_invariant.matmul(x2, weight.t())
    elif x2.shape[0] <= gemv.MAX_ROWS:
        out = gemv.linear(x2, weight)
    else:
        out = course_matmul.matmul(x2, weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm(x, weight, eps, backend):
    """RMSNorm over the last dim, statistics in fp32, output in x's dtype."""
    if backend == "torch":  # `mean`, not F.rms_norm: the mode routes aten::mean.dim
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)
    norm = batch_invariant.rms_norm if batch_invariant.enabled() else course_norm.rms_norm
    return norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps, backend):
    """(y, h): h = x + residual, y = rms_norm(h): one fused kernel on the course's backend
    (kernels.norm.add_rms_norm: reads x and residual once), two steps on torch's."""
    if backend == "torch" or batch_invariant.enabled():
        h = x + residual
        return rms_norm(h, weight, eps, backend), h
    return course_norm.add_rms_norm(x, residual, weight, eps)


def attention(q, k, v, kv_lens, backend):
    """Causal attention of q (B, H, Sq, hd) over k, v (B, Hkv, Sk, hd) -> (B, H, Sq, hd)."""
    if batch_invariant.enabled():  # either backend: the split-KV kernel with kv_lens
        return batch_invariant.attention(q, k, v, causal=True, kv_lens=kv_lens)
    if backend == "torch":
        return sdpa_attention(q, k, v, causal=True, kv_lens=kv_lens)
    if q.shape[2] == 1:  # decode: a group's query heads share one tile, the keys split finely
        return decode.attention(q, k, v, kv_lens)
    if kv_lens is None:
        return course_attention.attention(q, k, v, causal=True)
    # kernels.attention has no kv_lens: one launch for each distinct length, over its keys
    out = torch.empty_like(q)
    lens = kv_lens.tolist() if isinstance(kv_lens, torch.Tensor) else list(kv_lens)
    for n in sorted(set(lens)):
        rows = torch.tensor([b for b, m in enumerate(lens) if m == n], device=q.device)
        out[rows] = course_attention.attention(q[rows], k[rows, :, :n], v[rows, :, :n], causal=True)
    return out


def sdpa_attention(q, k, v, causal=False, kv_lens=None):
    """torch's scaled_dot_product_attention behind the batch-invariant attention's interface:
    `kv_lens` and the causal alignment to it become a boolean mask; grouped heads allowed."""
    gqa = k.shape[1] != q.shape[1]
    if kv_lens is None and (not causal or q.shape[2] == k.shape[2] or q.shape[2] == 1):
        # one query aligned to the end sees every key: no mask (nothing built on the host)
        causal = causal and q.shape[2] > 1
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if kv_lens is None:
        kv_lens = [Sk] * B
    lens = torch.as_tensor(kv_lens, device=q.device)[:, None, None]  # (B, 1, 1)
    key_pos = torch.arange(Sk, device=q.device)[None, None, :]  # (1, 1, Sk)
    visible = key_pos < lens  # (B, 1, Sk)
    if causal:
        query_pos = lens - Sq + torch.arange(Sq, device=q.device)[None, :, None]  # (B, Sq, 1)
        visible = visible & (key_pos <= query_pos)  # (B, Sq, Sk)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], enable_gqa=gqa)
