"""Lab 1, the three regimes: its tasks, the cases the grader draws, and the references.

The references live here, not in the notebook: op costs from their formulas, the roofline
from `kernels.bench.predicted_ms`, the polynomial by Horner's rule in fp64, the double-the-batch
rule, and the persistent kernel's values in fp64 with its schedule (block b belongs to program
b % programs), read from the owner of each block that the kernel stores. On the interpreter
programs run one after another, so a block handled twice shows its last program there (on a
GPU, whichever program stored last).
"""

import torch

from kernels import check, regimes
from kernels.grader import cases
from kernels.grader.cases import log_uniform
from kernels.grader.tasks import Case, Task, kernel_task

NAME = "lab01_regimes"
# doubling the batch grew the time by less than this: overhead-bound; Chapter 1's threshold, and why
OVERHEAD_GROWTH = regimes.OVERHEAD_GROWTH
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


def poly_ref(x: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """c[0] x^d + c[1] x^(d-1) + ... + c[d], highest power first, by Horner's rule in fp64."""
    x, coeffs = x.double(), coeffs.double()
    y = torch.full_like(x, coeffs[0].item())
    for c in coeffs[1:].tolist():
        y = y * x + c
    return y


def _op_cost_cases(rng):
    drawn = []
    for i in range(12):
        op = ("add", "repeat_fma", "matmul")[i % 3]
        if op == "matmul":
            sizes = {d: rng.randint(1, 20_000) for d in "mnk"}
        else:
            sizes = {"n": rng.randint(1, 10**9)}
            if op == "repeat_fma":
                sizes["repeat"] = rng.randint(1, 1024)
        width = rng.choice((1, 2, 4, 8))
        drawn.append(
            Case(
                (op, sizes, width),
                label=f"op_cost({op!r}, {sizes}, {width})",
                expected=op_cost_ref(op, sizes, width),
            )
        )
    return drawn


def _ceilings(rng):
    return log_uniform(rng, 0.5, 2000.0), log_uniform(rng, 20.0, 10_000.0)


def _roofline_cases(rng):
    drawn = []
    while len(drawn) < 12:
        flops = round(log_uniform(rng, 1e3, 1e15))
        bytes_moved = round(log_uniform(rng, 1e3, 1e12))
        peak, bandwidth = _ceilings(rng)
        balance = (flops / (peak * 1e9)) / (bytes_moved / (bandwidth * 1e6))
        if 0.9 < balance < 1.1:
            continue  # too close to the ridge to call
        args = (flops, bytes_moved, peak, bandwidth)
        label = f"roofline_ms({flops}, {bytes_moved}, {peak:.6g}, {bandwidth:.6g})"
        drawn.append(Case(args, label=label, expected=list(roofline_ms_ref(*args))))
    return drawn


def _diagnose_cases(rng):
    drawn = []
    for i in range(16):
        peak, bandwidth = _ceilings(rng)
        ridge = peak * 1e12 / (bandwidth * 1e9)
        intensity = ridge * 10 ** (rng.choice((-1, 1)) * rng.uniform(0.3, 2.0))
        bytes_moved = round(log_uniform(rng, 1e4, 1e10))
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
        drawn.append(Case(args, label=label, expected=[diagnose_ref(*args)]))
    return drawn


# (shape, degree): odd sizes across blocks of 1024, a 2-D input, degrees 0 to 8. With |x| <= 2
# and coefficients in [-1, 1] every value stays below 2**9, and fp32 Horner (a mul and an add,
# each rounded, as the interpreter does) against fp64 stayed within half the elementwise
# tolerance on 300 random polynomials of degree 0 to 8, 4097 values each: at most 0.2 of it in
# fp32, 0.48 in fp16 (the output's own rounding), 0.24 in bf16.
POLY_SPECS = (
    ((1,), 3), ((3,), 8), ((127,), 1), ((129,), 5), ((1000,), 0), ((1023,), 8),
    ((1025,), 2), ((4097,), 8), ((33, 65), 4),
)  # fmt: skip
POLY_AGAIN, POLY_STRIDED = ((4097,), 8), ((33, 65), 7)
X_BOUND = 2.0
# On an H200 (torch 2.11, triton 3.6) the solution's poly at degree 1 (the same bytes as copy
# plus one scalar load per coefficient, shared by each block) ran at 0.988 of copy's speed.
MIN_COPY_FRACTION = 0.5


def _uniform(shape, seed: int, bound: float, dtype=torch.float32) -> torch.Tensor:
    """Values drawn evenly from [-bound, bound]."""
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(shape, generator=gen) * 2 - 1) * bound).to(dtype)


def _poly_case(rng, spec, dtype, strided=False):
    (shape, degree), seed = spec, cases.new_seed(rng)
    x = _uniform(shape, seed, X_BOUND, dtype)
    coeffs = _uniform((degree + 1,), seed + 1, 1.0)  # float32 whatever x's dtype
    if strided:
        x, coeffs = cases.strided(x), cases.strided(coeffs)
    label = cases.label(x, dtype, seed, f", degree {degree}")
    return Case((x, coeffs), label=label, expected=poly_ref(x, coeffs), dtype=dtype)


def _poly_cases(rng, dtypes=(torch.float32, torch.float16), specs=POLY_SPECS):
    return cases.standard(
        _poly_case, specs, dtypes, rng, again=POLY_AGAIN, strided_spec=POLY_STRIDED
    )


def _poly_gpu_cases(rng):
    specs = (((1,), 3), ((127,), 1), ((4097,), 8), ((33, 65), 4))
    big = cases.big_random(rng, (1 << 26,), torch.float32)
    coeffs = _uniform((2,), cases.new_seed(rng), 1.0)
    timed = cases.timed(
        (big, coeffs),
        "2**26 float32 elements, degree 1, timed",
        against="copy",
        min_fraction=MIN_COPY_FRACTION,
        why="at degree 1 the kernel is memory-bound, as the copy is",
    )
    return _poly_cases(rng, (torch.bfloat16,), specs) + [timed]


def persistent_fma_ref(x: torch.Tensor, scale: float, shift: float) -> torch.Tensor:
    """Chapter 1's version 1, x * scale + shift, in fp64."""
    return x.double() * scale + shift


def owner_ref(n: int, programs: int, block_size: int) -> torch.Tensor:
    """Who handles each block in a grid-stride loop: block b belongs to program b % programs."""
    return torch.arange(-(-n // block_size), dtype=torch.int32) % programs


# (shape, programs, block_size): fewer elements than a block with more programs than blocks
# (idle programs), one program for everything, a last block with one element, blocks that do
# not divide among the programs (3, 3, 2), an exact multiple, 64 programs for 5 blocks, 2-D.
PERSISTENT_SPECS = (
    ((1,), 4, 128), ((3,), 1, 1024), ((127,), 3, 128), ((129,), 2, 128), ((1000,), 3, 128),
    ((1025,), 4, 256), ((4096,), 4, 256), ((4097,), 5, 128), ((4097,), 64, 1024),
    ((33, 65), 3, 256),
)  # fmt: skip
PERSISTENT_AGAIN, PERSISTENT_STRIDED = ((4097,), 5, 128), ((33, 65), 7, 128)
INT32_POISON = torch.iinfo(torch.int32).max  # what new int32 memory holds during a call


def _fp32_exact(value: float) -> float:
    """value rounded to float32, as the kernel receives it: the reference uses the same."""
    return torch.tensor(value, dtype=torch.float32).item()


def _persistent_case(rng, spec, dtype, strided=False):
    (shape, programs, block_size), seed = spec, cases.new_seed(rng)
    x = _uniform(shape, seed, X_BOUND, dtype)
    if strided:
        x = cases.strided(x)
    scale, shift = _fp32_exact(rng.uniform(-2, 2)), _fp32_exact(rng.uniform(-2, 2))
    plural = "s" if programs > 1 else ""
    label = cases.label(x, dtype, seed, f", {programs} program{plural}, blocks of {block_size}")
    expected = (persistent_fma_ref(x, scale, shift), owner_ref(x.numel(), programs, block_size))
    return Case(
        (x, scale, shift, programs, block_size), label=label, expected=expected, dtype=dtype
    )


def _persistent_cases(rng):
    return cases.standard(
        _persistent_case, PERSISTENT_SPECS, (torch.float32, torch.float16), rng,
        again=PERSISTENT_AGAIN, strided_spec=PERSISTENT_STRIDED,
    )  # fmt: skip


def _owner_problem(owner: torch.Tensor, expected: torch.Tensor, programs: int) -> str | None:
    wrong = (owner != expected).nonzero()
    if not len(wrong):
        return None
    block = int(wrong[0])
    got, want = int(owner[block]), int(expected[block])
    if got == INT32_POISON:
        return (
            f"owner[{block}] was never written: no program handled block {block} (it should be "
            f"program {want}'s)"
        )
    if not 0 <= got < programs:
        return (
            f"owner[{block}] says program {got} handled block {block}, but only {programs} "
            f"program{'s' if programs > 1 else ''} were asked for: the grid is (programs,)"
        )
    return (
        f"owner[{block}] says program {got} handled block {block}, expected program {want}: "
        f"program p handles blocks p, p + {programs}, p + {2 * programs}, ..."
    )


def _check_persistent(case: Case, out) -> str | None:
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        return f"returned {type(out).__name__}, expected a pair (out, owner)"
    (y, owner), (y_ref, owner_expected) = out, case.expected
    problem = cases.tensor_form("out", y, y_ref.shape, case.dtype) or cases.tensor_form(
        "owner", owner, owner_expected.shape, torch.int32
    )
    if problem:
        return problem
    unwritten = (check.unwritten(y) & y_ref.isfinite()).flatten()
    if unwritten.any():
        first, block_size = int(unwritten.nonzero()[0]), case.args[4]
        return (
            f"{int(unwritten.sum())} of {y.numel()} elements of out were never written: they "
            f"still hold the NaN the grader filled new memory with (first at flat index {first}, "
            f"in block {first // block_size})"
        )
    result = check.compare(y, y_ref, op="elementwise", dtype=case.dtype)
    if not result.ok:
        return f"wrong values of out: {result.message}"
    return _owner_problem(owner, owner_expected, case.args[3])


TASKS = [
    Task(
        name="op_cost",
        function="op_cost",
        points=2,
        summary="FLOPs, bytes and intensity of add, repeat_fma and matmul on random sizes",
        hint="count an FMA as 2 FLOPs and every input and output as read or written once",
        cases=_op_cost_cases,
        check=cases.numbers(("flops", "bytes_moved", "intensity")),
    ),
    Task(
        name="roofline_ms",
        function="roofline_ms",
        points=2,
        summary="the roofline's time and regime on random workloads and ceilings",
        hint="time is the larger of flops / peak and bytes / bandwidth; mind the units",
        cases=_roofline_cases,
        check=cases.numbers(("ms", "regime")),
        forbidden_names=ROOFLINE_NAMES,
    ),
    kernel_task(
        name="poly",
        function="poly",
        points=4,
        summary="a Triton kernel: degrees 0 to 8, odd sizes, 2-D and non-contiguous inputs, "
        "fp32 and fp16",
        hint="start from c[0], then y = y * x + c[i] for i from 1 to degree, in fp32 inside the "
        "kernel; store in the input's dtype",
        cases=_poly_cases,
        check=cases.values("elementwise"),
    ),
    Task(
        name="diagnose",
        function="diagnose",
        points=2,
        summary="the double-the-batch test and the roofline on random measurements",
        hint=f"time grew by less than {OVERHEAD_GROWTH}x when the batch doubled: overhead-bound; "
        "otherwise the roofline names the regime",
        cases=_diagnose_cases,
        check=cases.value("regime"),
        forbidden_names=ROOFLINE_NAMES,
    ),
    kernel_task(
        name="persistent",
        function="persistent_fma",
        points=3,
        summary="a persistent kernel: a grid of `programs` programs, each looping over blocks "
        "pid, pid + programs, ...; odd sizes, more programs than blocks, fp32 and fp16",
        hint="launch a grid of (programs,); loop for block in range(pid, cdiv(n, BLOCK_SIZE), "
        "programs), mask each block's offsets to n, and store pid in owner[block]",
        cases=_persistent_cases,
        check=_check_persistent,
    ),
    kernel_task(
        name="poly_gpu",
        function="poly",
        points=2,
        summary="on a GPU: bf16 values, and at least half the copy bandwidth at degree 1",
        hint="one load and one store per element, a 1-D grid of large blocks",
        cases=_poly_gpu_cases,
        check=cases.values("elementwise"),
        needs_gpu=True,
        exclusive=True,
    ),
]
