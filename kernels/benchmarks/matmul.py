"""Chapter 3's benchmark: the course's matmul against cuBLAS (through torch.matmul), rated in
TFLOP/s of 2*M*N*K against torch's own matmul ceiling in the same dtype."""

import torch

from kernels import bench
from kernels.benchmarks.rows import CUBLAS_IS_NOT_A_ROOF, row
from kernels.runtime import DEVICE

MATMUL_LAYERS = ((4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336))  # (M, N, K)
MATMUL_DECODE = tuple((m, 4096, 4096) for m in (1, 16, 64))  # reported, no target
MATMUL_IRREGULAR = (8205, 5921, 2949)
# Rows that may pass their measured ceiling, and why: (name pattern, unit, reason). Each row
# built now carries its reason as "above_roof"; this table gives it to rows recorded before.
ABOVE_ROOF = ((r"matmul (bf16|fp16) .+", "TFLOP/s", CUBLAS_IS_NOT_A_ROOF),)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _epilogue_rows(ceilings):
    """bias + exact GELU fused into the matmul, against cuBLAS then PyTorch's bias-GELU (two
    more kernels) and against the course's matmul then its fused bias_gelu (one more)."""
    from kernels.elementwise import bias_gelu
    from kernels.matmul import matmul

    eager = lambda x, w, bias: torch.nn.functional.gelu(torch.matmul(x, w) + bias)
    unfused = lambda x, w, bias: bias_gelu(matmul(x, w), bias)
    rows = []
    for m, n, k in ((4096, 14336, 1024), (4096, 14336, 4096)):
        x, weight = _randn(m, k, dtype=torch.bfloat16), _randn(n, k, dtype=torch.bfloat16)
        args = (x, weight.t(), _randn(n, dtype=torch.bfloat16))
        baselines = {
            "torch.matmul + bias-GELU": bench.time_ms(eager, *args),
            "matmul + bias_gelu": bench.time_ms(unfused, *args),
        }
        ms = bench.time_ms(matmul, *args, "gelu")
        name = f"matmul+bias+gelu bf16 {m}x{n}x{k} Wt"
        rows.append(
            row(name, ms, flops=2 * m * n * k, ceilings=ceilings, dtype="bf16", baselines=baselines)
        )
    return rows


def bench_matmul(ceilings):
    """Squares in bf16 and fp16, LLM layer shapes (x @ W.t() with W an (N, K) nn.Linear weight),
    and fp32 both as IEEE (torch's default "highest") and with TF32 allowed: 2*M*N*K FLOPs."""
    from kernels.matmul import matmul

    def timed(label, a, b, dtype, ceilings=ceilings):
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        baselines = {"torch.matmul": bench.time_ms(torch.matmul, a, b)}
        ms = bench.time_ms(matmul, a, b)
        why = CUBLAS_IS_NOT_A_ROOF if dtype in ("bf16", "fp16") else None
        return row(
            f"matmul {label}",
            ms,
            flops=flops,
            ceilings=ceilings,
            dtype=dtype,
            baselines=baselines,
            above_roof=why,
        )

    rows = []
    for name in ("bf16", "fp16"):
        dtype = bench.DTYPE_NAMES[name]
        for n in (1024, 2048, 4096, 8192):
            a, b = _randn(n, n, dtype=dtype), _randn(n, n, dtype=dtype)
            rows.append(timed(f"{name} {n}^3", a, b, name))
    for m, n, k in MATMUL_LAYERS + MATMUL_DECODE:
        x, weight = _randn(m, k, dtype=torch.bfloat16), _randn(n, k, dtype=torch.bfloat16)
        rows.append(timed(f"bf16 {m}x{n}x{k} Wt", x, weight.t(), "bf16"))
    m, n, k = MATMUL_IRREGULAR
    a, b = _randn(m, k, dtype=torch.bfloat16), _randn(k, n, dtype=torch.bfloat16)
    rows.append(timed(f"bf16 {m}x{n}x{k}", a, b, "bf16"))
    rows.extend(_epilogue_rows(ceilings))
    a, b = _randn(4096, 4096), _randn(4096, 4096)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        rows.append(timed("fp32 ieee 4096^3", a, b, "fp32"))
        torch.set_float32_matmul_precision("high")
        # The TF32 ceiling, measured like the others (8192 cubed through torch)
        big = _randn(8192, 8192)
        tf32 = bench.achieved_tflops(2 * 8192**3, bench.time_ms(torch.matmul, big, big))
        tf32_ceilings = {**ceilings, "matmul_tflops": {**ceilings["matmul_tflops"], "tf32": tf32}}
        rows.append(timed("fp32 tf32 4096^3", a, b, "tf32", tf32_ceilings))
    finally:
        torch.set_float32_matmul_precision(previous)
    return rows
