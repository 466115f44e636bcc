"""Measuring: the timers, the machine's ceilings, achieved rates, recorded results.

Every number a chapter shows goes through here. On a GPU, times are medians from
`triton.testing.do_bench` (warm-up, many runs, L2 flushed between runs). On a CPU, times
are wall-clock medians; they are real for PyTorch's CPU ops (the laptop's own roofline)
but not for Triton kernels, which the interpreter runs in Python: for those, chapters
show the results recorded on a GPU (`measure_or_recorded`).
"""

import contextlib
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from kernels.roofline import (
    BUSY,
    RooflinePoint,
    implausible_cpu_ceilings,
    plot_roofline,
    predicted_ms,
    ridge_point,
)
from kernels.runtime import DEVICE, ON_GPU, versions

__all__ = [
    "time_ms",
    "graph_ms",
    "cpu_us_per_call",
    "loop_us",
    "measure_ceilings",
    "achieved_gbps",
    "achieved_tflops",
    "measure_or_recorded",
    "recorded",
    "record",
    "RooflinePoint",
    "plot_roofline",
    "predicted_ms",
    "ridge_point",
]

DATA_DIR = Path(__file__).parent / "data"
RECORDED_GPU = "h200"  # the GPU whose results CPU-mode chapters show
DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_ms(fn, *args, **kwargs) -> float:
    """Median milliseconds of one call of `fn(*args, **kwargs)`."""
    if not callable(fn):
        raise TypeError(f"time_ms needs a callable first, got {type(fn).__name__}")
    call = lambda: fn(*args, **kwargs)
    if ON_GPU:
        import triton.testing

        return float(triton.testing.do_bench(call, return_mode="median"))
    return _cpu_median_ms(call)


def graph_ms(fn) -> float:
    """GPU milliseconds of fn() replayed from a CUDA graph: no Python, no launch overhead.
    GPU only; set against time_ms(fn), the gap is the host's cost of the call."""
    if not ON_GPU:
        raise RuntimeError("graph_ms replays a CUDA graph: it needs a CUDA GPU")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def cpu_us_per_call(fn, calls=2000) -> float:
    """Microseconds of host time per call, with the GPU kept busy enough not to block: the
    clock stops before the final synchronize (unlike `loop_us`, which waits for the device)."""
    fn()
    _synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    _synchronize()
    return 1e6 * elapsed / calls


def loop_us(fn, *args, budget_s: float = 0.05, rounds: int = 5, max_calls: int = 1 << 16) -> float:
    """Microseconds per call of `fn(*args)` issued back to back from a Python loop, synchronizing
    once at the end: the rate a training loop sees, overhead included (unlike `time_ms` on a
    GPU, which times the device). The best of `rounds` loops of about `budget_s / rounds` each,
    as timeit does: other processes only ever add time."""

    def seconds(calls):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        _synchronize()
        return time.perf_counter() - start

    seconds(1)  # warm-up: caches, allocator, compilation
    calls, elapsed = 1, seconds(1)
    while elapsed < budget_s / rounds and calls < max_calls:
        calls *= 2
        elapsed = seconds(calls)
    best = min([elapsed] + [seconds(calls) for _ in range(rounds - 1)])
    return best / calls * 1e6


@contextlib.contextmanager
def launches():
    """Every Triton launch inside the block, as the dict its kernel's `launch_metadata` gives
    ({"name": kernel and shape, "flops", "bytes"}; a kernel without one gives its name). It is
    the launch hook that profilers such as Proton set, so it needs no profiler and runs beside
    torch.profiler (two CUPTI profilers cannot share a process). GPU only: the interpreter
    calls no launch hooks."""
    from triton import knobs

    seen = []
    record = lambda metadata: seen.append(dict(metadata.get()))
    hooks = knobs.runtime
    previous = hooks.launch_enter_hook
    chained = hasattr(previous, "add")  # a chain of hooks in newer Triton, a single one in 3.6
    if chained:
        previous.add(record)
    else:
        hooks.launch_enter_hook = record
    try:
        yield seen
    finally:
        if chained:
            previous.remove(record)
        else:
            hooks.launch_enter_hook = previous


def _synchronize():
    # Wait for the GPU's queued work; on a CPU every call has finished when it returns.
    if ON_GPU:
        torch.cuda.synchronize()


# A median this many times the fastest run means most runs waited for something else.
CPU_SPREAD = 4.0


def _cpu_median_ms(call, budget_s: float = 0.2, max_runs: int = 1000) -> float:
    call()  # warm-up: first-call costs (allocation, dispatch caches) stay out
    samples, start = [], time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < budget_s and len(samples) < max_runs):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(samples)
    if unsteady_timing(samples):
        _warn(
            f"a CPU timing ran from {min(samples):.3g} to {max(samples):.3g} ms (median "
            f"{median:.3g} ms, over {CPU_SPREAD:g}x the fastest): {BUSY}; re-run when it is idle"
        )
    return median


def unsteady_timing(samples_ms) -> bool:
    """True when the median of repeated runs is over CPU_SPREAD times the fastest one."""
    return statistics.median(samples_ms) > CPU_SPREAD * min(samples_ms)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def achieved_gbps(bytes_moved: float, ms: float) -> float:
    """GB/s (1e9 bytes per second) from bytes read plus written and milliseconds."""
    _check_positive(ms=ms)
    return bytes_moved / ms / 1e6


def achieved_tflops(flops: float, ms: float) -> float:
    """TFLOP/s (1e12 per second) from a FLOP count (an FMA is 2 FLOPs) and milliseconds."""
    _check_positive(ms=ms)
    return flops / ms / 1e9


def _check_positive(**values):
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be positive, got {v}")


def measure_ceilings(copy_bytes: int | None = None, matmul_n: int | None = None) -> dict:
    """The machine's own ceilings, measured now (they drift between runs and machines).

    copy_gbps: a device-to-device copy, counting bytes read plus bytes written (a kernel that
    reads more than it writes can go a few percent past it: DRAM turns around less often).
    matmul_tflops: 2*n^3 / time for an n x n x n `torch.matmul` per dtype (cuBLAS on a GPU,
    the CPU's BLAS otherwise), on random inputs; fp32 at torch's default "highest" precision.
    """
    copy_bytes = copy_bytes or (1 << 30 if ON_GPU else 1 << 26)  # well past the L2 / last cache
    numel = copy_bytes // 4
    src = torch.rand(numel, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = time_ms(dst.copy_, src)
    del src, dst
    tflops = {}
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for name, dtype in DTYPE_NAMES.items():
            n = matmul_n or (8192 if ON_GPU else (512 if dtype == torch.float32 else 256))
            a = torch.randn(n, n, device=DEVICE).to(dtype)
            b = torch.randn(n, n, device=DEVICE).to(dtype)
            tflops[name] = achieved_tflops(2 * n**3, time_ms(torch.matmul, a, b))
    finally:
        torch.set_float32_matmul_precision(previous)
    ceilings = {"copy_gbps": achieved_gbps(2 * numel * 4, copy_ms), "matmul_tflops": tflops}
    if not ON_GPU:
        for problem in implausible_cpu_ceilings(ceilings):
            _warn(problem)
    return ceilings


# Recorded results: one JSON file per chapter under kernels/data/<gpu>/, written on a GPU,
# read on a CPU. {"meta": {device, torch, triton, ...,  date}, "results": {key: value}}


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the folder a GPU's results live in."""
    name = re.sub(r"^nvidia\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def _path(chapter: str, gpu: str) -> Path:
    if not re.fullmatch(r"[a-z0-9_]+", chapter):
        raise ValueError(f"chapter must be a name like '01_three_regimes', got {chapter!r}")
    return DATA_DIR / gpu / f"{chapter}.json"


def record(chapter: str, key: str, value) -> None:
    """Store a result measured on this GPU (with the versions that produced it). A value with a
    benchmark row above its roof (kernels.roofs) is refused with a ValueError naming the rows."""
    if not ON_GPU:
        raise RuntimeError("record() stores GPU measurements; this machine has no GPU")
    from kernels import roofs

    gpu = gpu_slug(torch.cuda.get_device_name())
    problems = roofs.check(value, f"{chapter}.json results[{key!r}]", gpu)
    if problems:
        raise ValueError(
            f"not recorded: {len(problems)} physics problems (declare a true reason next to "
            "the benchmark that makes the row, or find the bug):\n  " + "\n  ".join(problems)
        )
    path = _path(chapter, gpu)
    data = json.loads(path.read_text()) if path.exists() else {"results": {}}
    data["meta"] = {**versions(), "date": datetime.date.today().isoformat()}
    data["results"][key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def recorded(chapter: str, key: str, gpu: str = RECORDED_GPU):
    """A result recorded on `gpu`, and the meta of its run."""
    path = _path(chapter, gpu)
    if not path.exists():
        raise FileNotFoundError(
            f"no results recorded on {gpu} for {chapter} ({path.name}): "
            f"run `make gpu-record` on a GPU machine"
        )
    data = json.loads(path.read_text())
    if key not in data["results"]:
        raise KeyError(
            f"{chapter} has no recorded result {key!r} on {gpu}; recorded: "
            f"{sorted(data['results'])}"
        )
    return data["results"][key], data["meta"]


def describe(meta: dict) -> str:
    """'NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-11-29'."""
    return (
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta.get('date', '')}"
    )


def measure_or_recorded(chapter: str, key: str, measure):
    """On a GPU, run `measure()` and record its (JSON-able) result; on a CPU, return the result
    recorded on the course's reference GPU. Says which, and where the numbers come from."""
    if ON_GPU:
        value = measure()
        record(chapter, key, value)
        today = datetime.date.today().isoformat()  # a date, not "today": the book is static
        print(f"[{key}] measured now on {describe({**versions(), 'date': today})}")
        return value
    value, meta = recorded(chapter, key)
    print(f"[{key}] no GPU here: showing the results recorded on {describe(meta)}")
    return value
