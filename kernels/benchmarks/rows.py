"""One row of the benchmark table: a kernel's time, its rate and how close that rate comes to
the machine's ceiling, with its baselines' times beside it.

A kernel whose work takes under about 100 us gets two rows, "<name> [graph]" and "<name>
[call]", its baselines timed the same two ways: [graph] is GPU time, the calls back to back in
one CUDA graph over rotating copies of the inputs (bench.rotating_graph_ms: no host in the way,
no operand left in L2 by the call before); [call] is one call as a program makes it
(bench.time_ms), the host's launch included. Under about 100 us the host's few to tens of
microseconds a call can be most of [call]: the gap between the two rows is that cost."""

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


def both_ways(fn, argsets) -> dict:
    """{"graph": GPU ms a call of fn, back to back over `argsets`; "call": ms of one call}."""
    return {"graph": bench.rotating_graph_ms(fn, argsets), "call": bench.time_ms(fn, *argsets[0])}


def rows_both_ways(name, ours, baselines, **row_args) -> list:
    """The [graph] and [call] rows of a kernel timed both ways (`ours` and each baseline a
    both_ways dict); `row_args` as row() takes them."""
    return [
        row(
            f"{name} [{how}]",
            ours[how],
            baselines={b: times[how] for b, times in baselines.items()},
            **row_args,
        )
        for how in ("graph", "call")
    ]


def timed_rows(name, fn, argsets, baselines, *, graph, **row_args) -> list:
    """`fn` and its `baselines` (name: function taking the same arguments) timed on `argsets`
    (rotating copies of the inputs: see both_ways): with `graph` (the caller's choice for work
    that takes under about 100 us), the [graph] and [call] rows, else one row as called."""
    if not graph:
        args = argsets[0]
        times = {b: bench.time_ms(f, *args) for b, f in baselines.items()}
        return [row(name, bench.time_ms(fn, *args), baselines=times, **row_args)]
    times = {b: both_ways(f, argsets) for b, f in baselines.items()}
    return rows_both_ways(name, both_ways(fn, argsets), times, **row_args)


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
