"""Chapter 1's launch ladder: host microseconds per call of one small op, rung by rung, from
torch's own eager op to a CUDA-graph replay. Each row's baseline is torch's eager op on the
same inputs, so "vs torch eager" above 1 means the rung costs less host time than torch.

Host time is measured with the GPU kept busy (kernels.bench.cpu_us_per_call: the clock
stops before the final synchronize), under torch.no_grad() unless the rung says otherwise.
"""

import torch
import triton

from kernels import bench
from kernels.runtime import DEVICE

CALLS = 2000


def _host_us(fn) -> float:
    """The best of three rounds: host time is noisy, and the least disturbed round is the one
    that measures the code rather than the machine."""
    fn()
    return min(bench.cpu_us_per_call(fn, CALLS) for _ in range(3))


def _graph(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream): returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _compiled(fn, mode):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for _ in range(3):  # compile, then let reduce-overhead record its graph
        compiled()
    return compiled


def ladder(torch_fn, course_fn, kernel_only, cached_only, operator, grad_inputs) -> dict:
    """Host microseconds per call of each rung of one op's ladder, {rung: us}. `kernel_only`
    launches through kernel[grid] and `cached_only` through kernels.launch, both into
    preallocated outputs with no checks; `operator` calls torch.ops.brrr.<op>; `grad_inputs()`
    returns (course call, torch call) on inputs that require grad."""
    with torch.no_grad():
        rungs = {
            "torch eager": torch_fn,
            "Triton kernel[grid] alone": kernel_only,
            "cached compiled-kernel launch alone": cached_only,
            "course function (checks, allocation, launch)": course_fn,
            "torch.library operator": operator,
        }
        us = {rung: _host_us(fn) for rung, fn in rungs.items()}
        for mode in (None, "reduce-overhead"):
            us[f"torch.compile {mode or 'default'}"] = _host_us(_compiled(course_fn, mode))
            us[f"torch.compile {mode or 'default'}, torch's op"] = _host_us(
                _compiled(torch_fn, mode)
            )
        us["CUDA graph replay"] = _host_us(_graph(course_fn))
        us["CUDA graph replay, torch's op"] = _host_us(_graph(torch_fn))
    course_grad, torch_grad = grad_inputs()
    us["course function, inputs require grad"] = _host_us(course_grad)
    us["torch eager, inputs require grad"] = _host_us(torch_grad)
    return us


def add_ladder(n: int = 4096) -> dict:
    """Chapter 1's ladder: x + y on n fp32 elements, small enough that every rung is host time."""
    from kernels import elementwise, launch

    x, y = torch.randn(2, n, device=DEVICE)
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, elementwise.BLOCK_SIZE),)
    args, block = (x, y, out, n), {"BLOCK_SIZE": elementwise.BLOCK_SIZE}

    def grad_inputs():
        xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
        return (lambda: elementwise.add(xg, yg)), (lambda: xg + yg)

    rungs = ladder(
        lambda: x + y,
        lambda: elementwise.add(x, y),
        lambda: elementwise.add_kernel[grid](*args, **block),
        lambda: launch.launch(elementwise.add_kernel, grid, *args, **block),
        lambda: torch.ops.brrr.add(x, y),
        grad_inputs,
    )
    return {"op": "add", "n": n, "dtype": "fp32", "rungs": rungs}


def rows(result: dict) -> list:
    """A ladder as benchmark rows: host us per call, each against torch's eager op."""
    op = f"{result['op']} {result['dtype']} n={result['n']}"
    rungs = result["rungs"]
    return [
        {
            "name": f"overhead {op}: {rung}",
            "ms": us / 1000,
            "unit": "us/call",
            "rate": us,
            "pct_of_ceiling": None,  # host time has no roof: its baseline is torch's own op
            "baselines": {"torch eager": rungs["torch eager"] / 1000},
        }
        for rung, us in rungs.items()
    ]


def bench_overhead(ceilings):
    """The launch ladders (GPU only: under the interpreter, host time is the interpreter's)."""
    if DEVICE.type != "cuda":
        return []
    return rows(add_ladder())
