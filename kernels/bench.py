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
    best_roofs,
    datasheet_ceilings,
    implausible_cpu_ceilings,
    plot_datasheet,
    plot_roofline,
    predicted_ms,
    ridge_point,
)
from kernels.runtime import DEVICE, ON_GPU, versions

__all__ = [
    "time_ms",
    "graph_ms",
    "rotating_graph_ms",
    "rotating_copies",
    "l2_bytes",
    "cpu_us_per_call",
    "loop_us",
    "measure_ceilings",
    "achieved_gbps",
    "achieved_tflops",
    "measure_or_recorded",
    "measure_or_note",
    "gpu_count",
    "recorded",
    "record",
    "RooflinePoint",
    "plot_roofline",
    "plot_datasheet",
    "predicted_ms",
    "ridge_point",
    "best_roofs",
    "datasheet_ceilings",
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


def l2_bytes() -> int:
    """The GPU's L2 cache in bytes (60 MiB on an H200, as it reports itself). GPU only."""
    if not ON_GPU:
        raise RuntimeError("l2_bytes reads the GPU's properties: it needs a CUDA GPU")
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20))


def rotating_copies(
    t: torch.Tensor, past_bytes: int | None = None, most: int | None = None
) -> list[torch.Tensor]:
    """Copies of `t` (t itself first) that together hold more than `past_bytes` (default: twice
    the L2) and number at least two: cycled through by `rotating_graph_ms`, no call finds its
    operand in L2 from the calls before, as a model's next layer finds its own weight cold.
    `most` caps the count: an activation of a few KB stays in L2 in a model too (the kernel
    before wrote it), and thousands of copies would make thousands of calls."""
    past_bytes = 2 * l2_bytes() if past_bytes is None else past_bytes
    count = max(2, -(-past_bytes // max(t.nbytes, 1)) + 1)
    count = count if most is None else min(count, max(most, 1))
    return [t] + [t.clone() for _ in range(count - 1)]


def rotating_graph_ms(fn, argsets, calls: int | None = None, rep_ms: int = 100) -> float:
    """GPU milliseconds per call of fn(*args), `calls` calls (default: at least 32, a whole
    number of rounds) captured back to back in one CUDA graph, cycling through `argsets` (for
    example the rotating_copies of a weight): the way a decode step runs its layers, with no
    launch overhead between calls and no help from the L2 (each call also writes its own
    output buffer, as each layer does). A single `time_ms` call of a small kernel also pays a
    fixed few microseconds; the two side by side show it. `rep_ms`: how
    long the replays are timed for (kernels.split_k_tuning ranks tiles with short runs). GPU
    only."""
    if not ON_GPU:
        raise RuntimeError("rotating_graph_ms replays a CUDA graph: it needs a CUDA GPU")
    argsets = [tuple(args) for args in argsets]
    if not argsets:
        raise ValueError("rotating_graph_ms needs at least one set of arguments")
    calls = calls or len(argsets) * -(-32 // len(argsets))
    side = torch.cuda.Stream()  # warm up off the capture stream: compiles, tunes, allocates
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in argsets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Each output is kept while capturing, so every call gets a buffer of its own: no call
    # writes over lines that the call before left dirty in L2 (the graph's pool keeps them).
    with torch.cuda.graph(graph):
        outputs = [fn(*argsets[i % len(argsets)]) for i in range(calls)]
    del outputs
    import triton.testing

    ms = triton.testing.do_bench(graph.replay, warmup=rep_ms // 4, rep=rep_ms, return_mode="median")
    return float(ms) / calls


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
    chained = hasattr(previous, "add")  # a chain of hooks (Triton 3.6 on), else a single one
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
    add_gbps: `torch.add(x, y, out=z)` on tensors of half the copy's size, counting its two reads
    and one write: the read-mostly stream beside the 1:1 copy.
    fma_tflops (GPU only, {} on a CPU, where the interpreter runs the loop in Python):
    {"fp32": rate} of the course's FMA loop (kernels.regimes.repeat_fma) at FMA_PROBE_REPEAT
    FMAs per element, its plateau: the fp32 roof, which cuBLAS's SGEMM does not reach.
    Roofs for a plot come from kernels.roofline.best_roofs(ceilings).
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
    ceilings = {
        "copy_gbps": achieved_gbps(2 * numel * 4, copy_ms),
        "matmul_tflops": tflops,
        "add_gbps": _add_gbps(numel // 2),
        "fma_tflops": {"fp32": _fma_plateau_tflops(numel)} if ON_GPU else {},
    }
    if not ON_GPU:
        for problem in implausible_cpu_ceilings(ceilings):
            _warn(problem)
    return ceilings


FMA_PROBE_REPEAT = 2048  # FMAs per element: compute takes about 30x the memory time, a plateau


def _add_gbps(numel: int) -> float:
    x, y = torch.rand(2, numel, device=DEVICE)
    out = torch.empty_like(x)
    return achieved_gbps(3 * numel * 4, time_ms(torch.add, x, y, out=out))  # 2 reads, 1 write


def _fma_plateau_tflops(numel: int) -> float:
    from kernels import regimes

    x = torch.rand(numel, device=DEVICE)
    ms = time_ms(regimes.repeat_fma, x, FMA_PROBE_REPEAT)
    return achieved_tflops(regimes.repeat_fma_flops(numel, FMA_PROBE_REPEAT), ms)


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


def gpu_count() -> int:
    """GPUs this process can use (0 on a CPU)."""
    return torch.cuda.device_count() if ON_GPU else 0


def measure_or_recorded(chapter: str, key: str, measure, gpus: int = 1):
    """On a machine with at least `gpus` GPUs, run `measure()` and record its (JSON-able)
    result; elsewhere, return the result recorded on the course's reference GPU. Says which,
    and where the numbers come from."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive int, got {gpus!r}")
    if gpu_count() >= gpus:
        value = measure()
        record(chapter, key, value)
        today = datetime.date.today().isoformat()  # a date, not "today": the book is static
        on = f" on {gpus} GPUs" if gpus > 1 else ""
        print(f"[{key}] measured now{on} on {describe({**versions(), 'date': today})}")
        return value
    value, meta = recorded(chapter, key)
    print(f"[{key}] {_why_not_measured(gpus)}: showing the results recorded on {describe(meta)}")
    return value


def _why_not_measured(gpus: int) -> str:
    if not ON_GPU:
        return "no GPU here"
    return f"this needs {gpus} GPUs and this machine has {gpu_count()}"


def measure_or_note(chapter: str, key: str, measure, gpus: int = 1):
    """measure_or_recorded, or None with a printed note where the course's recorded GPU run
    does not hold `key` yet (a section newer than the chapter's last GPU recording, or one that
    needs more GPUs than any recording had)."""
    try:
        return measure_or_recorded(chapter, key, measure, gpus)
    except (KeyError, FileNotFoundError):  # a key, or the whole chapter, not recorded yet
        if gpus > 1:
            why = _why_not_measured(gpus)
            print(f"[{key}] not recorded yet on {gpus} GPUs ({why}): it shows here once the "
                  f"chapter is recorded on a machine with {gpus} GPUs")  # fmt: skip
        else:
            print(f"[{key}] not in the recorded H200 run yet: it shows here once the chapter is "
                  "next recorded on a GPU")  # fmt: skip
        return None
