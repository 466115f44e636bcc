"""One row of the benchmark table: a kernel's time, its rate and how close that rate comes to
the machine's ceiling, with its baselines' times beside it."""

from kernels import bench


def row(name, ms, *, bytes_moved=None, flops=None, ceilings, dtype="fp32", baselines=None):
    """A memory-bound kernel gives `bytes_moved` (read plus written) and is rated in GB/s
    against the copy bandwidth; a compute-bound one gives `flops` and is rated in TFLOP/s
    against torch's matmul in `dtype`."""
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
