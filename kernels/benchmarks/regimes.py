"""Chapter 1's benchmark: the repeat-the-op sweep and the fused cos(cos(x))."""

import torch

from kernels import bench
from kernels.benchmarks.rows import row
from kernels.runtime import DEVICE, pick

FMA_LOOP_BEATS_SGEMM = (
    "the fp32 ceiling is cuBLAS SGEMM, which spends issue slots on loads and shared memory; a "
    "loop of FMAs on registers keeps the FP32 units busier: about 65, under the datasheet's 67"
)
# Rows that may pass their measured ceiling, and why: (name pattern, unit, reason). Each row
# built now carries its reason as "above_roof"; this table gives it to rows recorded before.
ABOVE_ROOF = ((r"repeat_fma fp32 repeat=\d+ n=2\^\d+", "TFLOP/s", FMA_LOOP_BEATS_SGEMM),)


def bench_regimes(ceilings):
    """Points of the repeat-the-op sweep (each rated by its own regime on this machine's
    roofline) and fused cos(cos(x)) against eager PyTorch and torch.compile."""
    from kernels import regimes

    n = pick(cpu=1 << 12, gpu=1 << 27)  # 512 MiB of fp32 on a GPU: far past the L2
    x = torch.randn(n, device=DEVICE)
    rows = []
    for repeat in (1, 16, 64, 256):
        ms = bench.time_ms(regimes.repeat_fma, x, repeat)
        flops, nbytes = regimes.repeat_fma_flops(n, repeat), regimes.repeat_fma_bytes(n, 4)
        _, regime = bench.predicted_ms(flops, nbytes, ceilings, "fp32")
        if regime == "memory-bound":
            rate = {"bytes_moved": nbytes}
        else:
            rate = {"flops": flops, "above_roof": FMA_LOOP_BEATS_SGEMM}
        name = f"repeat_fma fp32 repeat={repeat} n=2^{n.bit_length() - 1}"
        rows.append(row(name, ms, ceilings=ceilings, **rate))
    compiled = torch.compile(regimes.cos_cos_ref)
    compiled(x)  # compile outside the timing
    baselines = {
        "torch eager": bench.time_ms(regimes.cos_cos_ref, x),
        "torch.compile": bench.time_ms(compiled, x),
    }
    rows.append(
        row(
            f"cos_cos fp32 n=2^{n.bit_length() - 1}",
            bench.time_ms(regimes.cos_cos, x),
            bytes_moved=regimes.cos_cos_bytes(n, 4, fused=True),
            ceilings=ceilings,
            baselines=baselines,
        )
    )
    return rows
