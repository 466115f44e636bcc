"""Chapter 1's launch ladder: host microseconds per call of one small op, rung by rung, from
torch's own eager op to a CUDA-graph replay. Each row's baseline is torch's eager op on the
same inputs, so "vs torch eager" above 1 means the rung costs less host time than torch.

Host time is measured with the GPU kept busy (kernels.bench.cpu_us_per_call: the clock
stops before the final synchronize), under torch.no_grad() unless the rung says otherwise.
"""

import torch
import torch.nn.functional as F
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


def ladder(torch_fn, course_fn, launches, operator, kernel_operator, grad_inputs) -> dict:
    """Host microseconds per call of each rung of one op's ladder, {rung: us}. `launches` maps
    a rung to a launch alone (kernel[grid], kernels.launch, ...) into preallocated outputs with
    no checks; `operator` calls torch.ops.brrr.<op> (custom_op, with autograd) and
    `kernel_operator` torch.ops.brrr._<op> (torch.library.Library, none: what compiled graphs
    call); `grad_inputs()` returns (course call, torch call) on inputs that require grad."""
    with torch.no_grad():
        rungs = {
            "torch eager": torch_fn,
            **launches,
            "course function (checks, allocation, launch)": course_fn,
            "torch.library operator": operator,
            "kernel operator (no autograd)": kernel_operator,
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


def launch_rungs(kernel, grid, args, meta, key=None) -> dict:
    """The launch-alone rungs of a ladder, {rung: fn}: Triton's kernel[grid]; kernels.launch,
    keyed on every argument; with `key` (the course's call site's own key), kernels.launch's
    Launcher under that key, and below it the compiled kernel's C launcher called with the
    arguments ready (what is left once nothing is looked up)."""
    from kernels import launch

    rungs = {
        "Triton kernel[grid] alone": lambda: kernel[grid](*args, **meta),
        "cached compiled-kernel launch alone": lambda: launch.launch(kernel, grid, *args, **meta),
    }
    if key is None:
        return rungs
    keyed = launch.Launcher(kernel)
    rungs["cached launch, call-site key alone"] = lambda: keyed(key, grid, *args, **meta)
    keyed(key, grid, *args, **meta)  # compiles, and keeps the kernel under the key
    entry = keyed.entries.get((torch._C._cuda_getDevice(), key)) if DEVICE.type == "cuda" else None
    if entry is not None:
        values = (*args, *(meta[name] for name in entry.names))
        device = torch._C._cuda_getDevice()
        rungs["C launcher alone (arguments ready)"] = lambda: entry.launch(
            *grid, *(1,) * (3 - len(grid)), torch._C._cuda_getCurrentRawStream(device), values
        )
    return rungs


def add_ladder(n: int = 4096) -> dict:
    """Chapter 1's ladder: x + y on n fp32 elements, small enough that every rung is host time."""
    from kernels import elementwise

    x, y = torch.randn(2, n, device=DEVICE)
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, elementwise.BLOCK_SIZE),)
    args, block = (x, y, out, n), {"BLOCK_SIZE": elementwise.BLOCK_SIZE}
    key = elementwise.add_key(x, y, n)

    def grad_inputs():
        xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
        return (lambda: elementwise.add(xg, yg)), (lambda: xg + yg)

    rungs = ladder(
        lambda: x + y,
        lambda: elementwise.add(x, y),
        launch_rungs(elementwise.add_kernel, grid, args, block, key),
        lambda: torch.ops.brrr.add(x, y),
        lambda: torch.ops.brrr._add(x, y),
        grad_inputs,
    )
    return {"op": "add", "n": n, "dtype": "fp32", "rungs": rungs}


def rms_norm_ladder(rows: int = 64, cols: int = 4096) -> dict:
    """The ladder of rms_norm on (rows, cols) bf16 against F.rms_norm."""
    from kernels import norm

    x = torch.randn(rows, cols, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(cols, device=DEVICE, dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(rows, device=DEVICE)
    block = triton.next_power_of_2(cols)
    args = (x, w, y, rstd, cols, cols, cols, 1e-6, x, y, cols)
    meta = {"BLOCK": block, "HAS_RESIDUAL": False, "SAVE_STATS": True, "PDL": False}
    meta["num_warps"] = norm.num_warps(block, 32)

    def grad_inputs():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        return (lambda: norm.rms_norm(xg, wg)), (lambda: F.rms_norm(xg, (cols,), wg, 1e-6))

    key = norm.forward_key(x, w, block, True)

    rungs = ladder(
        lambda: F.rms_norm(x, (cols,), w, 1e-6),
        lambda: norm.rms_norm(x, w),
        launch_rungs(norm.rms_norm_fwd_kernel, (rows,), args, meta, key),
        lambda: torch.ops.brrr.rms_norm(x, w, 1e-6),
        lambda: torch.ops.brrr._rms_norm_forward(x, w, 1e-6),
        grad_inputs,
    )
    return {"op": "rms_norm", "n": f"{rows}x{cols}", "dtype": "bf16", "rungs": rungs}


def matmul_ladder(n: int = 1024) -> dict:
    """The ladder of matmul on n^3 bf16 against torch.matmul (cuBLAS), the pointer kernel
    with the config the course's autotuner chose."""
    from kernels import matmul
    from kernels import matmul_tuning as tuning

    a, b = torch.randn(2, n, n, device=DEVICE, dtype=torch.bfloat16)
    matmul.matmul(a, b)  # tunes once
    config, tma = matmul.chosen_config(a, b)
    c = torch.empty_like(a)
    args = (a, b, c, c, n, n, n, *a.stride(), *b.stride(), *c.stride())
    meta = {
        "HAS_BIAS": False,
        "ACTIVATION": "none",
        "INPUT_PRECISION": "tf32",
        **config.all_kwargs(),
    }
    grid = (tuning.tile_count(n, n, meta),)
    key = matmul.call_key(a, b, None, None, None)

    def grad_inputs():
        ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
        return (lambda: matmul.matmul(ag, bg)), (lambda: ag @ bg)

    rungs = ladder(
        lambda: a @ b,
        lambda: matmul.matmul(a, b),
        launch_rungs(matmul.matmul_kernel, grid, args, meta, key),
        lambda: torch.ops.brrr.matmul(a, b, None, None, None),
        lambda: torch.ops.brrr._matmul(a, b, None, None, None),
        grad_inputs,
    )
    return {"op": "matmul", "n": f"{n}^3", "dtype": "bf16", "tma": tma, "rungs": rungs}


def _host_row(name: str, us: float, baseline: str, baseline_us: float) -> dict:
    """A benchmark row of host time per call; host time has no roof, so it is read against
    its baseline (torch's own op or block) alone."""
    return {
        "name": name,
        "ms": us / 1000,
        "unit": "us/call",
        "rate": us,
        "pct_of_ceiling": None,
        "baselines": {baseline: baseline_us / 1000},
    }


def rows(result: dict) -> list:
    """A ladder as benchmark rows: host us per call, each against torch's eager op."""
    op = f"{result['op']} {result['dtype']} n={result['n']}"
    torch_us = result["rungs"]["torch eager"]
    return [
        _host_row(f"overhead {op}: {rung}", us, "torch eager", torch_us)
        for rung, us in result["rungs"].items()
    ]


def bench_overhead(ceilings):
    """The launch ladders (GPU only: under the interpreter, host time is the interpreter's)."""
    if DEVICE.type != "cuda":
        return []
    ladders = (add_ladder(), rms_norm_ladder(), matmul_ladder())
    return [r for result in ladders for r in rows(result)] + block_rows(block_ladder())


def block_rows(result: dict) -> list:
    """The block's host and wall time per call as rows, each against torch's block under the
    same mode (the ratio the targets name)."""
    out, shape = [], f"{result['dtype']} {result['rows']}x{result['d']}"
    for kind in ("host_us", "wall_us"):
        for label, us in result[kind].items():
            name, mode = label.split(" ", 1)
            row_name = f"overhead block {shape} {name} {mode}: {kind}"
            out.append(_host_row(row_name, us, f"torch {mode}", result[kind][f"torch {mode}"]))
    return out


def _block_inputs(rows: int, d: int):
    make = lambda *shape, scale=1.0: (
        scale * torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16)
    )
    return make(rows, d), make(d), make(d, d, scale=d**-0.5), make(d)


def block_course(x, w, W, bias):
    """rms_norm -> matmul with bias and GELU in its epilogue -> residual add: the course's ops."""
    from kernels import elementwise, matmul, norm

    h = norm.rms_norm(x, w)
    return elementwise.add(matmul.matmul(h, W, bias=bias, activation="gelu"), x)


def block_torch(x, w, W, bias):
    """The same block in torch's ops."""
    h = F.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return F.gelu(h @ W + bias) + x


_triton_ops = None


def _triton_op_block():
    """The same three kernels registered with torch.library.triton_op instead (Inductor sees
    inside them and may fuse around them; under the interpreter fake tensors cannot trace
    them, so the course registers custom_op): registered here only, to measure that choice."""
    global _triton_ops
    if _triton_ops is None:
        from torch.library import triton_op, wrap_triton

        from kernels import elementwise, matmul, norm

        @triton_op("brrr_triton::add", mutates_args={})
        def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out, n = torch.empty_like(x), x.numel()
            grid = (triton.cdiv(n, elementwise.BLOCK_SIZE),)
            wrap_triton(elementwise.add_kernel)[grid](
                x, y, out, n, BLOCK_SIZE=elementwise.BLOCK_SIZE
            )
            return out

        @triton_op("brrr_triton::rms_norm", mutates_args={})
        def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            (rows, cols), y = x.shape, torch.empty_like(x)
            rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
            block = triton.next_power_of_2(cols)
            wrap_triton(norm.rms_norm_fwd_kernel)[(rows,)](
                x, w, y, rstd, cols, x.stride(0), cols, 1e-6, x, y, x.stride(0),
                BLOCK=block, HAS_RESIDUAL=False, SAVE_STATS=True, PDL=False,
                num_warps=norm.num_warps(block, 32),
            )  # fmt: skip
            # every constexpr passed: Inductor (torch 2.11) drops a defaulted one that is not
            # from its launcher's signature, and the compiled call fails ("missing '_grid_2'")
            return y

        @triton_op("brrr_triton::linear_gelu", mutates_args={})
        def linear_gelu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            (M, K), N = a.shape, b.shape[1]
            c = torch.empty((M, N), dtype=a.dtype, device=a.device)
            tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
            grid = (triton.cdiv(M, 128) * triton.cdiv(N, 128),)
            wrap_triton(matmul.matmul_kernel)[grid](
                a, b, c, bias, M, N, K, *a.stride(), *b.stride(), *c.stride(), HAS_BIAS=True,
                ACTIVATION="gelu", INPUT_PRECISION="tf32", num_warps=8, num_stages=3, **tile,
            )  # fmt: skip
            return c

        _triton_ops = (add, rms_norm, linear_gelu)
    add, rms_norm, linear_gelu = _triton_ops

    def block(x, w, W, bias):
        return add(linear_gelu(rms_norm(x, w), W, bias), x)

    return block


def block_ladder(rows: int = 16, d: int = 1024) -> dict:
    """Host us per call and wall us per call (GPU included, synchronized once at the end) of
    the block three ways (the course's custom_op operators, the same kernels as triton_op,
    torch's ops), eager and under torch.compile default and reduce-overhead; with the compiled
    graphs' break counts and each variant's largest error against torch's block in fp32."""
    import time

    inputs = _block_inputs(rows, d)
    reference = block_torch(*(t.float() for t in inputs))
    variants = {"course": block_course, "triton_op": _triton_op_block(), "torch": block_torch}
    result = {
        "rows": rows,
        "d": d,
        "dtype": "bf16",
        "host_us": {},
        "wall_us": {},
        "graph_breaks": {},
    }
    with torch.no_grad():
        for name, fn in variants.items():
            for mode in ("eager", "default", "reduce-overhead"):
                label = f"{name} {mode}"
                if mode == "eager":
                    call = lambda fn=fn: fn(*inputs)
                else:
                    torch._dynamo.reset()
                    result["graph_breaks"][label] = torch._dynamo.explain(fn)(
                        *inputs
                    ).graph_break_count
                    call = _compiled(lambda fn=fn: fn(*inputs), None if mode == "default" else mode)
                error = (call().float() - reference).abs().max().item()
                result.setdefault("max_abs_error", {})[label] = error
                result["host_us"][label] = _host_us(call)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(CALLS // 4):
                    call()
                torch.cuda.synchronize()
                result["wall_us"][label] = 1e6 * (time.perf_counter() - start) / (CALLS // 4)
    return result
