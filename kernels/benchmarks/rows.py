"""One row of the benchmark table: a kernel's time, its rate and how close that rate comes to
the machine's ceiling, with its baselines' times beside it."""

from kernels import bench

# The bf16/fp16 matmul ceilings are cuBLAS (torch.matmul) timed on 8192^3 once per run.
CUBLAS_IS_NOT_A_ROOF = (
    "the bf16/fp16 ceiling is cuBLAS timed once per run at 8192^3, a rate achieved and not a "
    "roof: a tuned kernel can tie or pass it within its run-to-run spread (650-710 TFLOP/s "
    "in bench.json's runs); the datasheet's dense tensor-core peak still bounds it"
)
READS_ONLY = (
    "the kernel reads its operands and writes almost nothing, so DRAM seldom turns from reads "
    "to writes and the rate can pass the 1:1 copy's (which writes as much as it reads); the "
    "datasheet's HBM peak still bounds it"
)


def row(
    name,
    ms,
    *,
    bytes_moved=None,
    flops=None,
    ceilings,
    dtype="fp32",
    baselines=None,
    above_roof=None,
):
    """A memory-bound kernel gives `bytes_moved` (read plus written) and is rated in GB/s
    against the copy bandwidth; a compute-bound one gives `flops` and is rated in TFLOP/s
    against torch's matmul in `dtype` (kept in the row: the datasheet's peak depends on it).
    `above_roof` says why the row may pass its measured ceiling (kernels.roofs checks every
    recorded row; none may pass the datasheet's peak)."""
    if bytes_moved is not None:
        unit, rate = "GB/s", bench.achieved_gbps(bytes_moved, ms)
        ceiling = ceilings["copy_gbps"]
    else:
        unit, rate = "TFLOP/s", bench.achieved_tflops(flops, ms)
        ceiling = ceilings["matmul_tflops"][dtype]
    result = {
        "name": name,
        "ms": ms,
        "unit": unit,
        "rate": rate,
        "pct_of_ceiling": 100 * rate / ceiling,
        "baselines": baselines or {},
    }
    if unit == "TFLOP/s":
        result["dtype"] = dtype
    if above_roof:
        result["above_roof"] = above_roof
    return result
