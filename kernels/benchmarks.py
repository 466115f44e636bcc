"""`python -m kernels bench`: the machine's ceilings, then every kernel against its baselines,
on the same inputs in the same run. Chapters add their kernels to BENCHMARKS.

A benchmark is a function (ceilings) -> list of rows:
{"name", "ms", "unit": "GB/s" | "TFLOP/s", "rate", "pct_of_ceiling", "baselines": {name: ms}}.
"""

import torch

from kernels import bench
from kernels.runtime import DEVICE


def _row(name, ms, *, bytes_moved=None, flops=None, ceilings, dtype="fp32", baselines=None):
    if bytes_moved is not None:
        unit, rate = "GB/s", bench.achieved_gbps(bytes_moved, ms)
        ceiling = ceilings["copy_gbps"]
    else:
        unit, rate = "TFLOP/s", bench.achieved_tflops(flops, ms)
        ceiling = ceilings["matmul_tflops"][dtype]
    return {
        "name": name,
        "ms": ms,
        "unit": unit,
        "rate": rate,
        "pct_of_ceiling": 100 * rate / ceiling,
        "baselines": baselines or {},
    }


def bench_add(ceilings):
    from kernels.elementwise import add

    rows = []
    for n in (1 << 20, 1 << 24, 1 << 28):
        x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
        ms = bench.time_ms(add, x, y)
        eager = bench.time_ms(torch.add, x, y)
        rows.append(
            _row(
                f"add fp32 n=2^{n.bit_length() - 1}",
                ms,
                bytes_moved=3 * 4 * n,
                ceilings=ceilings,
                baselines={"torch": eager},
            )
        )
    return rows


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
    import contextlib

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
                        _row(
                            f"attn {direction} {tag}",
                            ms,
                            flops=attention_flops(B, H, S, S, D, causal, backward),
                            ceilings=ceilings,
                            dtype="bf16",
                            baselines={name: pair[backward] for name, pair in times.items()},
                        )
                    )
    return rows


BENCHMARKS = {"add": bench_add, "attention": bench_attention}


def run(names=None, ceilings=None):
    """Measure the ceilings (unless given) and the named benchmarks (default: all)."""
    unknown = set(names or ()) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; known: {sorted(BENCHMARKS)}")
    ceilings = ceilings or bench.measure_ceilings()
    rows = []
    for name in names or BENCHMARKS:
        rows.extend(BENCHMARKS[name](ceilings))
    return {"ceilings": ceilings, "rows": rows}


def format_table(result) -> str:
    c = result["ceilings"]
    lines = [
        f"copy bandwidth {c['copy_gbps']:.0f} GB/s; matmul "
        + ", ".join(f"{k} {v:.1f}" for k, v in c["matmul_tflops"].items())
        + " TFLOP/s"
    ]
    if result["rows"]:
        lines.append(f"{'kernel':32} {'ms':>9} {'rate':>16} {'% ceiling':>10}  vs baselines")
        for r in result["rows"]:
            vs = ", ".join(f"{b} {ms / r['ms']:.2f}x" for b, ms in r["baselines"].items())
            lines.append(
                f"{r['name']:32} {r['ms']:9.4f} {r['rate']:9.1f} {r['unit']:>7}"
                f" {r['pct_of_ceiling']:9.1f}%  {vs}"
            )
        lines.append(
            "(vs baselines: baseline time / kernel time; above 1 means the kernel is faster)"
        )
    return "\n".join(lines)
