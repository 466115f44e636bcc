"""What the attention tests share: inputs, the fp64 reference through autograd, torch's own
same-dtype attention (the 'within 2x torch's error' baseline), and one check of an output and
its three gradients. Grouped-query inputs (k and v with H_kv < H heads) are checked against the
reference on k and v repeat_interleave'd to H heads: autograd through the repeat sums each
key/value head's gradient over its query heads, independently of the kernels' own sum."""

import torch
import torch.nn.functional as F

from kernels import check
from kernels.attention import attention, attention_ref


def make_inputs(shape, dtype, seed=0, scale=1.0, h_kv=None):
    """q, k, v, dO for shape (B, H, Sq, Sk, D), k and v with h_kv heads (H by default)."""
    B, H, Sq, Sk, D = shape
    h_kv = H if h_kv is None else h_kv
    q = check.random_tensor((B, H, Sq, D), dtype, seed=seed, scale=scale)
    k = check.random_tensor((B, h_kv, Sk, D), dtype, seed=seed + 1, scale=scale)
    v = check.random_tensor((B, h_kv, Sk, D), dtype, seed=seed + 2)
    do = check.random_tensor((B, H, Sq, D), dtype, seed=seed + 3)
    return q, k, v, do


def repeated(q, k, v):
    """k and v with each key/value head repeated for the query heads that read it (copies)."""
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def repeated_ref(q, k, v, causal=False, sm_scale=None):
    """attention_ref on repeat_interleave'd k and v: the reference for grouped-query inputs."""
    return attention_ref(q, *repeated(q, k, v), causal, sm_scale)


def reference(q, k, v, do, causal, sm_scale=None):
    """fp64 output and gradients through autograd on the plain PyTorch reference."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = repeated_ref(q64, k64, v64, causal, sm_scale)
    out.backward(do.double())
    return out, q64.grad, k64.grad, v64.grad


def sdpa(q, k, v, causal=False, sm_scale=None):
    """torch's own same-dtype attention: the 'at most 2x torch's error' baseline."""
    Sq, Sk = q.shape[2], k.shape[2]
    mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq) if causal else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def sdpa_baseline(q, k, v, do, causal):
    """sdpa's output and gradients."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = sdpa(q, k, v, causal)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


def run_and_check(q, k, v, do, causal, dtype, sm_scale=None, baseline=False):
    """kernels.attention's output and gradients against the fp64 reference; returns the output."""
    # the forward's values through the shared checker: poisoned outputs, the fp64 reference,
    # dtype and contiguity of the output, inputs unchanged
    result = check.against_fp64(attention, q, k, v, ref=repeated_ref, op="attention",
                                baseline=sdpa if baseline else None, causal=causal,
                                sm_scale=sm_scale)  # fmt: skip
    assert result.ok, f"out: {result.message}"
    # the gradients, against autograd through the fp64 reference
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with check.poisoned_allocations():  # elements the kernels fail to write show up as NaN
        out = attention(q, k, v, causal=causal, sm_scale=sm_scale)
        out.backward(do)
    expected = reference(q, k, v, do, causal, sm_scale)
    theirs = sdpa_baseline(q, k, v, do, causal) if baseline else [None] * 4
    for name, got, want, base in zip(
        ("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected, theirs, strict=True
    ):
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, not {tuple(want.shape)}"
        result = check.compare(got, want, op="attention", dtype=dtype, baseline=base)
        assert result.ok, f"{name}: {result.message}"
    assert torch.equal(q.detach(), q0) and torch.equal(k.detach(), k0)
    assert torch.equal(v.detach(), v0), "inputs must not be modified"
    return out


def check_every_config(q, k, v, do, causal, scale):
    """Each candidate config of the forward, dK/dV and dQ kernels (the autotuner may pick any)
    launched in turn, the others at their first candidate, and checked against the reference."""
    from kernels.attention import attention_forward
    from kernels.attention_backward import attention_backward
    from kernels.attention_tuning import dkdv_candidates, dq_candidates, forward_candidates

    dtype, Sq, D = q.dtype, q.shape[2], q.shape[3]
    expected = reference(q, k, v, do, causal)
    theirs = sdpa_baseline(q, k, v, do, causal)
    first_dkdv, first_dq = dkdv_candidates(dtype, D, Sq)[0], dq_candidates(dtype, D, Sq)[0]
    runs = [(f"forward {c}", c, first_dkdv, first_dq) for c in forward_candidates(dtype, D, Sq)]
    runs += [(f"dK/dV {c}", None, c, first_dq) for c in dkdv_candidates(dtype, D, Sq)]
    runs += [(f"dQ {c}", None, first_dkdv, c) for c in dq_candidates(dtype, D, Sq)]
    for label, fwd, dkdv, dq in runs:
        with check.poisoned_allocations():
            out, lse = attention_forward(q, k, v, causal, scale, config=fwd)
            grads = attention_backward(do, q, k, v, out, lse, causal, scale, "tf32", (dkdv, dq))
        for name, got, want, base in zip(
            ("out", "dq", "dk", "dv"), (out, *grads), expected, theirs, strict=True
        ):
            result = check.compare(got, want, op="attention", dtype=dtype, baseline=base)
            assert result.ok, f"{label}, {name}: {result.message}"
