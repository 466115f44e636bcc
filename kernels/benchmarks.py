"""`python -m kernels bench`: the machine's ceilings, then every kernel against its baselines,
on the same inputs in the same run. Chapters add their kernels to BENCHMARKS.

A benchmark is a function (ceilings) -> list of rows:
{"name", "ms", "unit": "GB/s" | "TFLOP/s", "rate", "pct_of_ceiling", "baselines": {name: ms}}.
"""

import contextlib

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


def bench_batch_invariant(ceilings):
    """Chapter 5: each batch-invariant kernel against its ordinary counterpart, in bf16: matmul
    (M x 4096 @ 4096 x 4096) against cuBLAS, RMSNorm (rows of 4096) against PyTorch, decoding
    attention (one query, 32 heads of 128) against SDPA; and serving the tiny LM with and without
    batch_invariant_mode()."""
    import torch.nn.functional as F

    from kernels import batch_invariant as bi

    rows = []
    n = k = 4096
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    for m in (1, 16, 64, 256, 1024, 2048, 4096, 8192):
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        cublas = {"cuBLAS": bench.time_ms(torch.mm, a, b)}
        ms = bench.time_ms(bi.matmul, a, b)
        name = f"invariant matmul M={m}"  # bf16, N = K = 4096
        rows.append(
            _row(name, ms, flops=2 * m * n * k, ceilings=ceilings, dtype="bf16", baselines=cublas)
        )
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    for m in (1, 64, 4096, 16384):
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        baselines = {
            "torch fp32 math": bench.time_ms(bi.rms_norm_ref, x, w),
            "F.rms_norm": bench.time_ms(F.rms_norm, x, (4096,), w, 1e-6),
        }
        ms = bench.time_ms(bi.rms_norm, x, w)
        name = f"invariant rms_norm {m}x4096"  # bf16
        rows.append(
            _row(name, ms, bytes_moved=2 * x.numel() * 2, ceilings=ceilings, baselines=baselines)
        )
    for batch, keys in ((1, 4096), (8, 4096), (64, 1024), (32, 8192)):
        q = torch.randn(batch, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
        kv = torch.randn(batch, 32, keys, 128, device=DEVICE, dtype=torch.bfloat16)
        sdpa = {"SDPA": bench.time_ms(F.scaled_dot_product_attention, q, kv, kv)}
        ms = bench.time_ms(bi.attention, q, kv, kv)
        name = f"invariant attention B={batch} Sk={keys}"  # bf16, Sq=1, H=32, D=128
        rows.append(
            _row(name, ms, bytes_moved=2 * kv.numel() * 2, ceilings=ceilings, baselines=sdpa)
        )
    rows.append(_serving_row())
    return rows


def _serving_row():
    """Serving the same traffic to the tiny LM, default kernels against batch_invariant_mode()."""
    from kernels.batch_invariant import batch_invariant_mode
    from kernels.serving import run_experiment
    from kernels.tiny_lm import TinyLM

    model = TinyLM()
    traffic = dict(
        prompt="Tell me about Richard Feynman.",
        copies=200,
        new_tokens=32,
        fillers=50,
        max_batch=64,
        spread=200,
    )
    seconds = {}
    for mode in ("default", "invariant"):
        with batch_invariant_mode() if mode == "invariant" else contextlib.nullcontext():
            run_experiment(model, **dict(traffic, copies=8, fillers=2))  # warm-up, compiles
            result = run_experiment(model, **traffic)
        seconds[mode] = result["seconds"]
    tokens = sum(len(r.tokens) for r in result["requests"])
    return {
        "name": f"tiny LM serving {tokens} tokens",
        "ms": 1e3 * seconds["invariant"],
        "unit": "tok/s",
        "rate": tokens / seconds["invariant"],
        "pct_of_ceiling": None,
        "baselines": {"default kernels": 1e3 * seconds["default"]},
    }


BENCHMARKS = {"add": bench_add, "batch_invariant": bench_batch_invariant}


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
            pct = r["pct_of_ceiling"]
            pct = f"{pct:9.1f}%" if pct is not None else " " * 10  # None: no ceiling applies
            lines.append(
                f"{r['name']:32} {r['ms']:9.4f} {r['rate']:9.1f} {r['unit']:>7} {pct}  {vs}"
            )
        lines.append(
            "(vs baselines: baseline time / kernel time; above 1 means the kernel is faster)"
        )
    return "\n".join(lines)
