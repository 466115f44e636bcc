"""Chapter 4's benchmark, and the attention timing helpers that Chapter 4 and
scripts/tune_attention.py share: the course's kernel against SDPA, one backend at a time,
forward and backward on the same inputs."""

import contextlib

import torch

from kernels import bench
from kernels.benchmarks.rows import row
from kernels.runtime import DEVICE

# torch's scaled_dot_product_attention restricted to one backend: name -> SDPBackend member
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
ATTENTION_TOKENS = 16 * 32768  # B * H * S: enough programs to fill the GPU at every length


def attention_flops(B, H, Sq, Sk, D, causal, backward=False) -> float:
    """4*B*H*Sq*Sk*D for the two matmuls of the forward pass, halved with the causal mask;
    the backward pass counts 2.5x (five matmuls of the same size)."""
    flops = 4 * B * H * Sq * Sk * D / (2 if causal else 1)
    return 2.5 * flops if backward else flops


def attention_impls() -> dict:
    """name -> fn(q, k, v, causal): the course's kernel, and SDPA (its backend set by the name)."""
    import torch.nn.functional as F

    from kernels.attention import attention

    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return {"triton": attention, **{name: sdpa for name in SDPA_BACKENDS}}


def time_attention(B, H, S, D, causal, impls=None, dtype=torch.bfloat16) -> dict:
    """{name: (forward ms, backward ms)} for each of `impls` (default: attention_impls()) on the
    same (B, H, S, D) inputs. An SDPA backend that refuses the inputs is left out, saying so."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = (torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) for _ in range(4))
    results = {}
    for name, fn in (impls or attention_impls()).items():
        backend = SDPA_BACKENDS.get(name)
        context = sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()
        try:
            with context:
                results[name] = _forward_backward_ms(fn, q, k, v, do, causal)
        except RuntimeError as exc:  # this backend does not take these inputs on this GPU
            print(f"  {name} skipped at B={B} H={H} S={S} D={D}: {str(exc).splitlines()[0][:90]}")
    return results


def _forward_backward_ms(fn, q, k, v, do, causal):
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(qq, kk, vv, causal)  # the first call compiles and autotunes: untimed
    grads = lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
    grads()
    with torch.no_grad():
        forward_ms = bench.time_ms(fn, q, k, v, causal)
    return forward_ms, bench.time_ms(grads)


def bench_attention(ceilings):
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            for S in (1024, 4096, 16384):
                H = 16
                B = max(1, ATTENTION_TOKENS // (H * S))
                times = time_attention(B, H, S, D, causal)
                fwd, bwd = times.pop("triton")
                tag = f"bf16 D={D} S={S // 1024}k{' causal' if causal else ''}"
                for direction, ms, backward in (("fwd", fwd, False), ("bwd", bwd, True)):
                    rows.append(
                        row(
                            f"attn {direction} {tag}",
                            ms,
                            flops=attention_flops(B, H, S, S, D, causal, backward),
                            ceilings=ceilings,
                            dtype="bf16",
                            baselines={name: pair[backward] for name, pair in times.items()},
                        )
                    )
    return rows
