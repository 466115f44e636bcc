"""Lab 3, a Triton matmul: its tasks, the cases the grader draws, and the references.

The references live here, not in the notebook: the napkin math from its formulas, the grouped
program order built tile by tile, every product in fp64 (`kernels.matmul.matmul_ref`,
`swiglu_ref`) with torch's own same-dtype result beside it for the rule "at most twice torch's
error". Split-K (task 5) is checked three ways: each fp32 partial against its slice of K in
fp64, the product against fp64, and the product bit for bit against its partials summed in
order (split 0, 1, 2, ...) in fp32 by torch, which rounds every addition the way a kernel does.
"""

from functools import partial

import torch

from kernels.check import compare
from kernels.grader import cases
from kernels.grader.cases import log_uniform
from kernels.grader.lab05 import ATOMIC_REASONS, ATOMICS
from kernels.grader.tasks import Case, Task, kernel_task
from kernels.matmul import matmul_ref

NAME = "lab03_matmul"
# The op the kernel tasks ask for, under the names torch gives it (`@` is "matmul")...
MATMUL_OPS = frozenset(
    {"matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "linear", "tensordot",
     "dot", "mv", "inner", "chain_matmul"}
)  # fmt: skip
# ...and the names that reach it from the graded cells: torch.matmul, kernels.matmul, F.linear.
MATMUL_NAMES = frozenset({"matmul", "mm", "bmm", "addmm", "einsum", "linear"})
SPEED_N = 4096  # the timed problem: bf16 SPEED_N^3
# On an H200 (torch 2.11, triton 3.6) the solution's SwiGLU runs at 0.82 of cuBLAS's rate
# (0.41 of one product's speed, against 0.25 needed).
MIN_CUBLAS_FRACTION = 0.5


def napkin_ref(m, n, k, bytes_per_element, peak_tflops, bandwidth_gbps):
    """(flops, min_bytes, intensity, regime) of a (m, k) @ (k, n) product on these ceilings."""
    flops = 2 * m * n * k
    min_bytes = (m * k + k * n + m * n) * bytes_per_element  # read a and b once, write c once
    intensity = flops / min_bytes
    ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)  # FLOP per byte where the roofs meet
    return flops, min_bytes, intensity, "compute-bound" if intensity >= ridge else "memory-bound"


def tile_order_ref(tiles_m: int, tiles_n: int, group_m: int) -> torch.Tensor:
    """(tiles_m * tiles_n, 2) int32: row p is the tile (pid_m, pid_n) program p computes. Bands
    of group_m rows of tiles (the last may be shorter), each walked column by column."""
    order = []
    for first_m in range(0, tiles_m, group_m):
        band = range(first_m, min(first_m + group_m, tiles_m))
        order += [(pid_m, pid_n) for pid_n in range(tiles_n) for pid_m in band]
    return torch.tensor(order, dtype=torch.int32)


def _napkin_cases(rng):
    drawn = []
    while len(drawn) < 12:
        m, n, k = (round(log_uniform(rng, 1, 16384)) for _ in range(3))
        width = rng.choice((1, 2, 4))
        peak, bandwidth = log_uniform(rng, 1.0, 2000.0), log_uniform(rng, 50.0, 8000.0)
        args = (m, n, k, width, peak, bandwidth)
        flops, min_bytes, intensity, regime = napkin_ref(*args)
        balance = intensity / (peak * 1e3 / bandwidth)
        if 0.8 < balance < 1.25 or (regime == "compute-bound") != (len(drawn) % 2 == 0):
            continue  # too close to the ridge to call, or not the regime this case's turn wants
        label = f"matmul_napkin({m}, {n}, {k}, {width}, {peak:.6g}, {bandwidth:.6g})"
        drawn.append(Case(args, label=label, expected=[flops, min_bytes, intensity, regime]))
    return drawn


# (tiles_m, tiles_n, group_m): chapter 3's 6 x 8 example first, then bands that do not divide
# the rows, a band taller than the grid, one row or one column of tiles, and row-major order.
TILE_GRIDS = (
    (6, 8, 3),
    (7, 5, 2),
    (13, 11, 4),
    (5, 7, 8),
    (1, 9, 4),
    (9, 1, 4),
    (8, 12, 1),
    (1, 1, 1),
)


def _tile_order_cases(rng):
    grids = list(TILE_GRIDS)
    grids += [(rng.randint(2, 16), rng.randint(2, 16), rng.randint(2, 8)) for _ in range(3)]
    return [
        Case(grid, label="tile_order({}, {}, {})".format(*grid), expected=tile_order_ref(*grid),
             dtype=torch.int32)
        for grid in grids
    ]  # fmt: skip


def _check_tile_order(case: Case, out) -> str | None:
    wrong = (out != case.expected).any(dim=1).nonzero()
    if len(wrong) == 0:
        return None
    p = int(wrong[0])
    got, want = tuple(out[p].tolist()), tuple(case.expected[p].tolist())
    return f"program {p} computed tile {got}, expected {want} (pid_m, pid_n)"


def _matmul_case(rng, shape, dtype, bias=False, relu=False, strided=False):
    """Inputs of magnitude about 1 whatever k; centred (half the outputs negative) for ReLU.
    Strided: a and b are transposed, strided views (neither row- nor column-major memory)."""
    m, n, k = shape
    seed, scale, centred = cases.new_seed(rng), k**-0.25, bias or relu

    def draw(made, offset, scale=scale):
        x = cases.tensor(made, seed + offset, scale=scale)
        return (x - 0.5 * scale if centred else x).to(dtype)

    def operand(rows, cols, offset):
        if strided:
            return cases.strided(draw((cols, rows), offset)).t()
        return draw((rows, cols), offset)

    a, b = operand(m, k, 0), operand(k, n, 1)
    kwargs = {"bias": draw((n,), 2, scale=1.0)} if bias else {}
    if relu:
        kwargs["relu"] = True
    epilogue = "".join((" + bias" if bias else "", ", then ReLU" if relu else ""))
    layout = " (both non-contiguous: strided, transposed views)" if strided else ""
    label = f"a ({m}, {k}) @ b ({k}, {n}){epilogue}{layout}, {cases.dtype_name(dtype)}, seed {seed}"
    expected = matmul_ref(
        a.double(), b.double(), kwargs["bias"].double() if bias else None, "relu" if relu else None
    )
    baseline = None
    if dtype != torch.float32:  # fp32 must be IEEE: its tolerance, not torch's error, applies
        baseline = a @ b + kwargs["bias"] if bias else a @ b
        baseline = torch.relu(baseline) if relu else baseline
    return Case(
        (a, b), label=label, expected=expected, dtype=dtype, kwargs=kwargs, baseline=baseline
    )


DTYPES = (torch.float32, torch.float16)
# (M, N, K): 1s, small odd sizes, block boundaries +-1 for blocks of 16, 32 and 64, K = 1.
MATMUL_SHAPES = (
    (1, 1, 1), (3, 5, 7), (1, 96, 65), (96, 1, 33), (17, 40, 1), (33, 31, 97), (64, 64, 64),
    (95, 97, 63),
)  # fmt: skip
BIAS_SHAPES = ((1, 1, 1), (3, 5, 7), (1, 96, 65), (33, 31, 97), (95, 97, 63))
BIAS_EXTRA = (((33, 65, 17), {"relu": False}), ((47, 33, 9), {"bias": False}))


def _tiled_matmul_cases(rng):
    return cases.standard(
        _matmul_case, MATMUL_SHAPES, DTYPES, rng, again=MATMUL_SHAPES[-1], strided_spec=(65, 47, 33)
    )


def _bias_relu_cases(rng):
    return cases.standard(
        partial(_matmul_case, bias=True, relu=True),
        BIAS_SHAPES,
        DTYPES,
        rng,
        again=None,
        extra=BIAS_EXTRA,
        strided_spec=(65, 47, 33),
    )


def _swiglu_case(rng, shape, dtype, strided=False):
    """silu(x @ w_gate) * (x @ w_up): centred inputs (half the gates negative), outputs of
    magnitude about 1 whatever k. Strided: every operand a transposed, strided view."""
    m, n, k = shape
    seed, scale = cases.new_seed(rng), k**-0.25

    def operand(rows, cols, offset):
        made = (cols, rows) if strided else (rows, cols)
        x = (cases.tensor(made, seed + offset, scale=scale) - 0.5 * scale).to(dtype)
        return cases.strided(x).t() if strided else x

    x, w_gate, w_up = operand(m, k, 0), operand(k, n, 1), operand(k, n, 2)
    layout = " (all non-contiguous: strided, transposed views)" if strided else ""
    label = (
        f"x ({m}, {k}), w_gate and w_up ({k}, {n}){layout}, {cases.dtype_name(dtype)}, seed {seed}"
    )
    expected = swiglu_ref(x.double(), w_gate.double(), w_up.double())
    baseline = None if dtype == torch.float32 else swiglu_ref(x, w_gate, w_up)
    return Case((x, w_gate, w_up), label, expected=expected, dtype=dtype, baseline=baseline)


def swiglu_ref(x, w_gate, w_up):
    """silu(x @ w_gate) * (x @ w_up) in the inputs' dtype (float64 for the reference)."""
    return torch.nn.functional.silu(x @ w_gate) * (x @ w_up)


SWIGLU_SHAPES = ((1, 1, 1), (3, 5, 7), (1, 96, 65), (17, 40, 1), (33, 31, 97), (95, 97, 63))


def _swiglu_cases(rng):
    return cases.standard(
        _swiglu_case, SWIGLU_SHAPES, DTYPES, rng, again=SWIGLU_SHAPES[-1], strided_spec=(65, 47, 33)
    )


def _swiglu_gpu_cases(rng):
    bf16 = torch.bfloat16
    drawn = [
        _swiglu_case(rng, shape, bf16)
        for shape in ((1, 1, 1), (1000, 1003, 517), (1, 2048, 2048), (257, 129, 4097))
    ]
    drawn.append(_swiglu_case(rng, (129, 257, 1025), bf16, strided=True))
    operands = tuple(cases.big_random(rng, (SPEED_N, SPEED_N), bf16) for _ in range(3))
    timed = cases.timed(
        operands,
        f"bfloat16 {SPEED_N}^3, two products, timed against one torch.matmul (cuBLAS)",
        against="matmul",
        min_fraction=MIN_CUBLAS_FRACTION / 2,
        why="the fused kernel does two products, so half of cuBLAS's rate is "
        f"{MIN_CUBLAS_FRACTION / 2:.0%} of the speed of its one",
        rate=lambda ms: f"{4 * SPEED_N**3 / (ms * 1e9):.0f} TFLOP/s",
    )
    return drawn + [timed]


def split_bounds(k: int, splits: int) -> list[tuple[int, int]]:
    """[lo, hi) of each split's slice of K: cdiv(k, splits) each, the last shorter, and the
    splits past K empty (lo >= hi)."""
    chunk = -(-k // splits)
    return [(s * chunk, min((s + 1) * chunk, k)) for s in range(splits)]


def split_k_partials_ref(a, b, splits: int) -> torch.Tensor:
    """(splits, M, N) float64: partial s is a[:, lo:hi] @ b[lo:hi] over split s's slice of K
    (zeros for an empty one)."""
    a, b = a.double(), b.double()
    return torch.stack(
        [a[:, lo:hi] @ b[lo:hi] if lo < hi else a.new_zeros(a.shape[0], b.shape[1])
         for lo, hi in split_bounds(a.shape[1], splits)]
    )  # fmt: skip


def in_order_sum(partials: torch.Tensor) -> torch.Tensor:
    """partials[0] + partials[1] + ... in that order, in fp32: one IEEE rounding per addition."""
    total = partials[0].clone()
    for later in partials[1:]:
        total += later
    return total


def _split_k_case(rng, spec, dtype, strided=False):
    """Inputs of magnitude about 1 whatever k (as _matmul_case); strided: both operands
    transposed, strided views."""
    m, n, k, splits = spec
    seed, scale = cases.new_seed(rng), k**-0.25

    def operand(rows, cols, offset):
        if strided:
            made = cases.tensor((cols, rows), seed + offset, scale=scale).to(dtype)
            return cases.strided(made).t()
        return cases.tensor((rows, cols), seed + offset, scale=scale).to(dtype)

    a, b = operand(m, k, 0), operand(k, n, 1)
    layout = " (both non-contiguous: strided, transposed views)" if strided else ""
    in_splits = f"in {splits} split{'s' if splits > 1 else ''}"
    label = (
        f"a ({m}, {k}) @ b ({k}, {n}) {in_splits}{layout}, {cases.dtype_name(dtype)}, seed {seed}"
    )
    expected = (matmul_ref(a.double(), b.double()), split_k_partials_ref(a, b, splits))
    baseline = None if dtype == torch.float32 else a @ b
    return Case((a, b, splits), label=label, expected=expected, dtype=dtype, baseline=baseline)


# (M, N, K, splits): one split, K not a multiple of the split count, more splits than K has
# elements (empty splits), more splits than K has blocks, a long K for one row, even halves.
SPLIT_K_SHAPES = (
    (1, 1, 1, 1), (3, 5, 7, 1), (33, 31, 97, 3), (5, 7, 3, 8), (40, 33, 129, 16),
    (1, 96, 1000, 7), (95, 97, 63, 2),
)  # fmt: skip


def _split_k_cases(rng):
    return cases.standard(
        _split_k_case, SPLIT_K_SHAPES, DTYPES, rng, again=SPLIT_K_SHAPES[-1],
        strided_spec=(65, 47, 33, 4),
    )  # fmt: skip


def _check_split_k(case: Case, out) -> str | None:
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        return f"returned {type(out).__name__}, expected a pair (c, partials)"
    (c, partials), (c_ref, partials_ref) = out, case.expected
    problem = cases.tensor_form("c", c, c_ref.shape, case.dtype) or cases.tensor_form(
        "partials", partials, partials_ref.shape, torch.float32
    )
    if problem:
        return problem
    a, _, splits = case.args
    for s, (lo, hi) in enumerate(split_bounds(a.shape[1], splits)):
        result = compare(partials[s], partials_ref[s], op="matmul", dtype=torch.float32)
        if not result.ok:
            held = f"k in [{lo}, {hi})" if lo < hi else "no k: an empty split, all zeros"
            return f"wrong partial {s} ({held}): {result.message}"
    result = compare(c, c_ref, op="matmul", dtype=case.dtype, baseline=case.baseline)
    if not result.ok:
        return f"wrong values of c: {result.message}"
    ordered = in_order_sum(partials).to(case.dtype)
    differ = c != ordered
    if differ.any():
        index = tuple(int(i) for i in differ.nonzero()[0])
        return (
            f"c is not its partials summed in order: {int(differ.sum())} of {c.numel()} "
            f"elements differ from partials[0] + partials[1] + ... in fp32 (first at index "
            f"{index}: {c[index].item():.9g}, in order {ordered[index].item():.9g})"
        )
    return None


SILU_OPS = frozenset({"silu", "sigmoid", "glu", "swish"})

# The matmul task shares the learner's function, its check and what it may not call.
matmul_task = partial(
    kernel_task,
    function="tiled_matmul",
    check=cases.values("matmul"),
    forbidden_ops=MATMUL_OPS,
    forbidden_names=MATMUL_NAMES,
    time_limit=180.0,  # on a GPU, each new specialisation of the kernel compiles first
)


TASKS = [
    Task(
        name="matmul_napkin",
        function="matmul_napkin",
        points=2,
        summary="FLOPs, minimum bytes, intensity and regime of random matmuls on random ceilings",
        hint="2mnk FLOPs; a, b and c each moved once; compute-bound when the intensity reaches "
        "peak / bandwidth",
        cases=_napkin_cases,
        check=cases.numbers(("flops", "min_bytes", "intensity", "regime")),
    ),
    kernel_task(
        name="grouped_order",
        function="tile_order",
        points=2,
        summary="your grouped_tile, launched once per tile, against the grouped order on "
        "random grids",
        hint="bands of GROUP_M rows of tiles, each walked down a column before the next column; "
        "the last band may be shorter",
        cases=_tile_order_cases,
        check=_check_tile_order,
    ),
    matmul_task(
        name="tiled_matmul",
        points=4,
        summary="the warm-up: a tiled Triton matmul with its bias + ReLU epilogue, odd shapes, "
        "K = 1, transposed inputs, fp32 and fp16",
        hint="accumulate in fp32, mask the loads along K and the store along M and N; fp32 "
        'needs tl.dot(..., input_precision="ieee"); bias[cols] on every row, then ReLU',
        cases=lambda rng: _tiled_matmul_cases(rng) + _bias_relu_cases(rng),
    ),
    kernel_task(
        name="swiglu",
        function="swiglu",
        points=4,
        summary="a fused SwiGLU: silu(x @ w_gate) * (x @ w_up) from two accumulators and one "
        "store, odd shapes, fp32 and fp16",
        hint="one slab of x and one of each weight per step, two tl.dot accumulators in fp32; "
        "then g * sigmoid(g) * u on the tiles, one store",
        cases=_swiglu_cases,
        check=cases.values("matmul"),
        forbidden_ops=MATMUL_OPS | SILU_OPS,
        forbidden_names=MATMUL_NAMES,
        time_limit=180.0,
    ),
    kernel_task(
        name="split_k",
        function="split_k_matmul",
        points=3,
        summary="split-K: partials of each slice of K in an fp32 workspace, then their sum in "
        "a fixed order, bit for bit; odd shapes, 1 to 16 splits, fp32 and fp16",
        hint="split s holds k in [s * cdiv(K, splits), (s + 1) * cdiv(K, splits)), masked to "
        "its own end and to K; an empty split stores zeros; sum split 0, 1, 2, ... in fp32, "
        "then cast once",
        cases=_split_k_cases,
        check=_check_split_k,
        forbidden_ops=MATMUL_OPS,
        forbidden_names=MATMUL_NAMES | ATOMICS,
        forbidden_reasons=ATOMIC_REASONS,
        time_limit=180.0,
    ),
    kernel_task(
        name="swiglu_gpu",
        function="swiglu",
        points=3,
        summary=f"on a GPU: bf16 values, and two products at {SPEED_N}^3 at least "
        f"{MIN_CUBLAS_FRACTION / 2}x the speed of cuBLAS's one",
        hint="block_config's GPU tiles for both accumulators: two fp32 tiles of 128 x 128 fit "
        "in 8 warps' registers, 128 x 256 do not",
        cases=_swiglu_gpu_cases,
        check=cases.values("matmul"),
        forbidden_ops=MATMUL_OPS | SILU_OPS,
        forbidden_names=MATMUL_NAMES,
        needs_gpu=True,
        exclusive=True,
        time_limit=180.0,
    ),
]
