"""Lab 1, the three regimes: its tasks, the cases the grader draws, and the references.

The references live here, not in the notebook: op costs from their formulas, the roofline
from `kernels.bench.predicted_ms`, the repeated FMA in fp64, the double-the-batch rule.
"""

import math

import torch

from kernels import check
from kernels.grader.tasks import KERNEL_DEFENCES, Case, Task

NAME = "lab01_regimes"
FMA_SCALE, FMA_SHIFT = 0.99, 0.01  # one step of repeat_fma: y = y * 0.99 + 0.01
OVERHEAD_GROWTH = 1.5  # doubling the batch grew the time by less than this: overhead-bound
ROOFLINE_NAMES = frozenset({"predicted_ms", "ridge_point"})


def op_cost_ref(op: str, sizes: dict, bytes_per_element: int):
    """(flops, bytes_moved, intensity); an FMA is 2 FLOPs; each tensor read or written once."""
    if op == "add":
        flops, elements = sizes["n"], 3 * sizes["n"]
    elif op == "repeat_fma":
        flops, elements = 2 * sizes["repeat"] * sizes["n"], 2 * sizes["n"]
    elif op == "matmul":
        m, n, k = sizes["m"], sizes["n"], sizes["k"]
        flops, elements = 2 * m * n * k, m * k + k * n + m * n
    else:
        raise ValueError(f"unknown op {op!r}")
    bytes_moved = elements * bytes_per_element
    return flops, bytes_moved, flops / bytes_moved


def roofline_ms_ref(flops, bytes_moved, peak_tflops, bandwidth_gbps):
    from kernels.bench import predicted_ms

    ceilings = {"copy_gbps": bandwidth_gbps, "matmul_tflops": {"fp32": peak_tflops}}
    return predicted_ms(flops, bytes_moved, ceilings, "fp32")


def diagnose_ref(flops, bytes_moved, ms, ms_doubled, peak_tflops, bandwidth_gbps) -> str:
    if ms_doubled < OVERHEAD_GROWTH * ms:
        return "overhead-bound"
    return roofline_ms_ref(flops, bytes_moved, peak_tflops, bandwidth_gbps)[1]


def repeat_fma_ref(x: torch.Tensor, repeat: int) -> torch.Tensor:
    y = x.double()
    for _ in range(repeat):
        y = y * FMA_SCALE + FMA_SHIFT
    return y


def _numbers(case: Case, out, names) -> str | None:
    expected = case.expected
    if not isinstance(out, list) or len(out) != len(expected):
        return f"returned {out!r:.80}, expected {len(expected)} values: {', '.join(names)}"
    for got, want, name in zip(out, expected, names, strict=True):
        if isinstance(want, str):
            if got != want:
                return f"returned {name} {got!r:.40}, expected {want!r}"
            continue
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"returned {name} = {got!r:.40}, expected a number"
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0):
            return f"returned {name} = {got:.6g}, expected {want:.6g}"
    return None


def _log_uniform(rng, lo, hi):
    return 10 ** rng.uniform(math.log10(lo), math.log10(hi))


def _op_cost_cases(rng):
    cases = []
    for i in range(12):
        op = ("add", "repeat_fma", "matmul")[i % 3]
        if op == "matmul":
            sizes = {d: rng.randint(1, 20_000) for d in "mnk"}
        else:
            sizes = {"n": rng.randint(1, 10**9)}
            if op == "repeat_fma":
                sizes["repeat"] = rng.randint(1, 1024)
        width = rng.choice((1, 2, 4, 8))
        cases.append(
            Case(
                (op, sizes, width),
                label=f"op_cost({op!r}, {sizes}, {width})",
                expected=op_cost_ref(op, sizes, width),
            )
        )
    return cases


def _ceilings(rng):
    return _log_uniform(rng, 0.5, 2000.0), _log_uniform(rng, 20.0, 10_000.0)


def _roofline_cases(rng):
    cases = []
    while len(cases) < 12:
        flops = round(_log_uniform(rng, 1e3, 1e15))
        bytes_moved = round(_log_uniform(rng, 1e3, 1e12))
        peak, bandwidth = _ceilings(rng)
        balance = (flops / (peak * 1e9)) / (bytes_moved / (bandwidth * 1e6))
        if 0.9 < balance < 1.1:
            continue  # too close to the ridge to call
        args = (flops, bytes_moved, peak, bandwidth)
        label = f"roofline_ms({flops}, {bytes_moved}, {peak:.6g}, {bandwidth:.6g})"
        cases.append(Case(args, label=label, expected=list(roofline_ms_ref(*args))))
    return cases


def _diagnose_cases(rng):
    cases = []
    for i in range(16):
        peak, bandwidth = _ceilings(rng)
        ridge = peak * 1e12 / (bandwidth * 1e9)
        intensity = ridge * 10 ** (rng.choice((-1, 1)) * rng.uniform(0.3, 2.0))
        bytes_moved = round(_log_uniform(rng, 1e4, 1e10))
        flops = round(intensity * bytes_moved)
        best_ms = roofline_ms_ref(flops, bytes_moved, peak, bandwidth)[0]
        if i % 2:  # overhead: far above the roofline, and doubling the work hardly shows
            ms = best_ms * rng.uniform(5.0, 100.0)
            ms_doubled = ms * rng.uniform(1.0, 1.3)
        else:
            ms = best_ms * rng.uniform(1.05, 1.6)
            ms_doubled = ms * rng.uniform(1.75, 2.2)
        args = (flops, bytes_moved, ms, ms_doubled, peak, bandwidth)
        label = "diagnose(" + ", ".join(f"{a:.6g}" for a in args) + ")"
        cases.append(Case(args, label=label, expected=[diagnose_ref(*args)]))
    return cases


FMA_SHAPES = ((1,), (3,), (127,), (129,), (1000,), (1023,), (1025,), (4097,), (33, 65))
FMA_REPEATS = (1, 2, 8, 33)


def _fma_case(rng, shape, dtype, repeat, transpose=False):
    seed = rng.randrange(2**31)
    scale = rng.choice((1.0, 10.0, 100.0))
    x = check.random_tensor(
        shape[::-1] if transpose else shape, dtype, seed=seed, device="cpu", scale=scale
    )
    x = x.t() if transpose else x
    kind = ", non-contiguous" if transpose else ""
    label = (
        f"shape {tuple(x.shape)}{kind}, {str(dtype).removeprefix('torch.')}, "
        f"repeat {repeat}, seed {seed}"
    )
    return Case((x, repeat), label=label, expected=repeat_fma_ref(x, repeat), dtype=dtype)


def _repeat_fma_cases(rng, dtypes=(torch.float32, torch.float16), shapes=FMA_SHAPES):
    cases = []
    for dtype in dtypes:
        for shape in shapes:
            cases.append(_fma_case(rng, shape, dtype, rng.choice(FMA_REPEATS)))
        # the same shape again with new data: a result cached across calls shows
        cases.append(_fma_case(rng, shapes[-2], dtype, cases[-2].args[1]))
        cases.append(_fma_case(rng, (65, 33), dtype, rng.choice(FMA_REPEATS), transpose=True))
    return cases


def _repeat_fma_gpu_cases(rng):
    cases = _repeat_fma_cases(rng, (torch.bfloat16,), ((1,), (127,), (4097,), (33, 65)))
    big = {"random": (1 << 26,), "dtype": torch.float32, "seed": rng.randrange(2**31)}
    cases.append(Case((big, 1), label="2**26 float32 elements, repeat 1, timed", action="time"))
    return cases


MIN_COPY_FRACTION = 0.5


def _check_repeat_fma(case: Case, out) -> str | None:
    if case.action == "time":
        if not isinstance(out, dict) or not out.get("ms", 0) > 0:
            return "no timing came back"
        fraction = out["copy_ms"] / out["ms"]
        if fraction < MIN_COPY_FRACTION:
            return (
                f"took {out['ms']:.3f} ms, {fraction:.0%} of the speed of torch copying the same "
                f"tensor ({out['copy_ms']:.3f} ms); at repeat 1 the kernel is memory-bound and "
                f"should reach {MIN_COPY_FRACTION:.0%} of it"
            )
        return None
    result = check.compare(out, case.expected, op="elementwise", dtype=case.dtype)
    return None if result.ok else f"wrong values: {result.message}"


TASKS = [
    Task(
        name="op_cost",
        function="op_cost",
        points=2,
        summary="FLOPs, bytes and intensity of add, repeat_fma and matmul on random sizes",
        hint="count an FMA as 2 FLOPs and every input and output as read or written once",
        cases=_op_cost_cases,
        check=lambda case, out: _numbers(case, out, ("flops", "bytes_moved", "intensity")),
    ),
    Task(
        name="roofline_ms",
        function="roofline_ms",
        points=2,
        summary="the roofline's time and regime on random workloads and ceilings",
        hint="time is the larger of flops / peak and bytes / bandwidth; mind the units",
        cases=_roofline_cases,
        check=lambda case, out: _numbers(case, out, ("ms", "regime")),
        forbidden_names=ROOFLINE_NAMES,
    ),
    Task(
        name="repeat_fma",
        function="repeat_fma",
        points=4,
        summary="a Triton kernel: odd sizes, 2-D and non-contiguous inputs, fp32 and fp16",
        hint="compute in fp32 inside the kernel and store in the input's dtype",
        cases=_repeat_fma_cases,
        check=_check_repeat_fma,
        **KERNEL_DEFENCES,
    ),
    Task(
        name="diagnose",
        function="diagnose",
        points=2,
        summary="the double-the-batch test and the roofline on random measurements",
        hint=f"time grew by less than {OVERHEAD_GROWTH}x when the batch doubled: overhead-bound; "
        "otherwise the roofline names the regime",
        cases=_diagnose_cases,
        check=lambda case, out: _numbers(case, [out], ("regime",)),
        forbidden_names=ROOFLINE_NAMES,
    ),
    Task(
        name="repeat_fma_gpu",
        function="repeat_fma",
        points=2,
        summary="on a GPU: bf16 values, and at least half the copy bandwidth at repeat 1",
        hint="one load and one store per element, a 1-D grid of large blocks",
        cases=_repeat_fma_gpu_cases,
        check=_check_repeat_fma,
        **KERNEL_DEFENCES,
        needs_gpu=True,
        exclusive=True,
    ),
]
