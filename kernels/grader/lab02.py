"""Lab 2, operator fusion: its tasks, the cases the grader draws, and the references.

The references are the course's own `_ref` functions run in float64 on the same inputs:
`bias_gelu_ref`, `softmax_ref`, `layer_norm_ref` and `rms_norm_ref` (imported when the cases
are drawn, so that grading another lab does not load these kernels). Values are compared
with the course's tolerance table (`kernels.check`): elementwise for bias + GELU, reduction
for the rest.
"""

import torch

from kernels.grader import cases
from kernels.grader.tasks import Case, kernel_task

NAME = "lab02_fusion"
CPU_DTYPES = (torch.float32, torch.float16)
# On an H200 (torch 2.11, triton 3.6) the solution runs at 0.99 of copy's speed.
MIN_COPY_FRACTION = 0.5

GELU_OPS = frozenset({"gelu", "erf", "erfc", "special_erf", "tanh"})
SOFTMAX_OPS = frozenset(
    {"softmax", "special_softmax", "log_softmax", "_softmax", "exp", "logsumexp"}
)
RMS_NORM_OPS = frozenset(
    {"rms_norm", "rsqrt", "norm", "linalg_vector_norm", "pow", "square", "mean"}
)


# Task 1: bias + GELU


def _bias_gelu_case(rng, shape, dtype, strided=False):
    from kernels.elementwise import bias_gelu_ref

    x, seed = cases.draw(rng, shape, dtype, scale=rng.choice((1.0, 3.0)))
    bias, _ = cases.draw(rng, shape[-1:], dtype)
    x = cases.strided(x) if strided else x
    expected = bias_gelu_ref(x.double(), bias.double())
    return Case((x, bias), cases.label(x, dtype, seed), expected=expected, dtype=dtype)


BIAS_GELU_SHAPES = ((1,), (3,), (127,), (4097,), (3, 127), (129, 1000), (2, 3, 129), (5, 1025))


def _bias_gelu_cases(rng):
    return cases.standard(
        _bias_gelu_case,
        BIAS_GELU_SHAPES,
        CPU_DTYPES,
        rng,
        again=(129, 1000),
        strided_spec=(33, 65),
    )


# Tasks 2 and 5: softmax, several rows per program


def _softmax_case(rng, shape, dtype, kind="random", strided=False, rows=4):
    from kernels.softmax import softmax_ref

    x, seed = cases.draw(rng, shape, scale=4.0)
    extra = ""
    if kind == "large":  # exp(1000) overflows float32: only the max subtraction saves it
        x, extra = x * 25.0 + 1000.0, ", logits around 1000"
    elif kind == "negative":  # a masked lane that loads 0 instead of -inf becomes the max
        x, extra = x * 25.0 - 1000.0, ", logits around -1000"
    elif kind == "masked":  # a padded row: a run of -inf before the first value
        masked = shape[-1] * 3 // 7
        x[..., :masked] = float("-inf")
        extra = f", the first {masked} columns -inf"
    x = x.to(dtype)
    x = cases.strided(x) if strided else x
    label = cases.label(x, dtype, seed, f"{extra}, rows_per_program {rows}")
    return Case((x, rows), label, expected=softmax_ref(x.double()), dtype=dtype)


# (shape, rows_per_program): rows that do not fill the last program, one row, one program of
# more rows than the tensor has, long rows and short ones
SOFTMAX_SPECS = (
    ((1, 1), 4),
    ((3, 127), 2),
    ((5, 129), 4),
    ((17, 64), 8),
    ((3, 1000), 1),
    ((2, 4097), 2),
    ((2, 3, 129), 4),
    ((37, 33), 16),
    ((6, 20), 32),
)
SOFTMAX_EXTRA = (
    (((9, 300), 4), {"kind": "large"}),
    (((9, 300), 4), {"kind": "negative"}),
    (((7, 300), 2), {"kind": "masked"}),
)


def _rows_case(rng, spec, dtype, **options):
    shape, rows = spec
    return _softmax_case(rng, shape, dtype, rows=rows, **options)


def _softmax_cases(rng):
    return cases.standard(
        _rows_case,
        SOFTMAX_SPECS,
        CPU_DTYPES,
        rng,
        again=((17, 64), 8),
        extra=SOFTMAX_EXTRA,
        strided_spec=((33, 65), 4),
    )


SHORT_ROWS = (1 << 20, 64)  # the timed input: a million rows of 256 bytes (float32)


def _softmax_gpu_cases(rng):
    bf16 = torch.bfloat16
    drawn = [
        _softmax_case(rng, shape, bf16, rows=rows)
        for shape, rows in (((1, 1), 4), ((3, 127), 2), ((37, 64), 16), ((2, 3, 129), 4))
    ]
    drawn.append(_softmax_case(rng, (9, 300), bf16, kind="large"))
    drawn.append(_softmax_case(rng, (33, 65), bf16, strided=True))
    big = cases.big_random(rng, SHORT_ROWS, torch.float32)
    timed = cases.timed(
        (big, 16),
        f"shape {SHORT_ROWS}, float32, rows_per_program 16, timed",
        against="copy",
        min_fraction=MIN_COPY_FRACTION,
        why="a fused softmax reads and writes each element once, as the copy does",
    )
    return drawn + [timed]


# Task 3: LayerNorm


def _layer_norm_case(rng, shape, dtype, scale=2.0, shift=0.0, eps=None, strided=False, extra=""):
    from kernels.norm import layer_norm_ref

    x, seed = cases.draw(rng, shape, scale=scale)
    x = (x + shift).to(dtype)
    weight, _ = cases.draw(rng, shape[-1:], dtype)
    bias, _ = cases.draw(rng, shape[-1:], dtype)
    x = cases.strided(x) if strided else x
    eps = eps if eps is not None else rng.choice((1e-5, 1e-6))
    label = cases.label(x, dtype, seed, f"{extra}, eps {eps:g}")
    expected = layer_norm_ref(x.double(), weight.double(), bias.double(), eps)
    return Case((x, weight, bias), label, expected=expected, dtype=dtype, kwargs={"eps": eps})


LAYER_NORM_SHAPES = ((1, 1), (3, 127), (17, 33), (2, 5, 1000), (3, 4097))
LAYER_NORM_EXTRA = (
    # mean 30, spread 1: E[x^2] - E[x]^2 cancels 900 against 900 in float32, about 20 times
    # the tolerance off; the two-pass variance stays within it (a mean of 100 would not)
    ((4, 1000), {"scale": 1.0, "shift": 30.0, "extra": ", mean ~30 and spread ~1"}),
    # variance ~1e-4 next to eps = 0.01: eps sets the scale
    ((3, 300), {"scale": 0.01, "eps": 0.01}),
)


def _layer_norm_cases(rng):
    return cases.standard(
        _layer_norm_case,
        LAYER_NORM_SHAPES,
        CPU_DTYPES,
        rng,
        again=(3, 4097),
        extra=LAYER_NORM_EXTRA,
        strided_spec=(40, 129),
    )


# Task 4: RMSNorm


def _rms_norm_case(rng, shape, dtype, scale=2.0, eps=None, strided=False, extra=""):
    from kernels.norm import rms_norm_ref

    x, seed = cases.draw(rng, shape, dtype, scale=scale)
    weight, _ = cases.draw(rng, shape[-1:], dtype)
    x = cases.strided(x) if strided else x
    eps = eps if eps is not None else rng.choice((1e-6, 1e-5))
    label = cases.label(x, dtype, seed, f"{extra}, eps {eps:g}")
    expected = rms_norm_ref(x.double(), weight.double(), eps)
    return Case((x, weight), label, expected=expected, dtype=dtype, kwargs={"eps": eps})


RMS_NORM_SHAPES = ((1, 1), (3, 127), (17, 33), (2, 5, 1000), (3, 4097))
RMS_NORM_EXTRA = (
    # squares of 300 overflow float16 (max 65504): only float32 accumulation gets through
    ((4, 1000), {"scale": 300.0, "extra": ", values ~300"}),
    # mean(x^2) ~ 1e-4 next to eps = 0.01: eps sets the scale
    ((3, 300), {"scale": 0.01, "eps": 0.01}),
)


def _rms_norm_cases(rng):
    return cases.standard(
        _rms_norm_case,
        RMS_NORM_SHAPES,
        CPU_DTYPES,
        rng,
        again=(3, 4097),
        extra=RMS_NORM_EXTRA,
        strided_spec=(40, 129),
    )


LAYER_NORM_OPS = frozenset(
    {"layer_norm", "native_layer_norm", "rsqrt", "var", "var_mean", "std", "mean", "pow", "square"}
)

TASKS = [
    kernel_task(
        name="bias_gelu",
        function="bias_gelu",
        points=2,
        summary="the warm-up: a fused bias + GELU kernel, any leading dims, odd sizes, fp32, fp16",
        hint="z = x + bias[column] in float32, then 0.5 * z * (1 + erf(z / sqrt(2))), "
        "stored in x's dtype",
        cases=_bias_gelu_cases,
        check=cases.values("elementwise"),
        forbidden_ops=GELU_OPS,
    ),
    kernel_task(
        name="softmax_rows",
        function="softmax_rows",
        points=4,
        summary="several rows per program (a 2-D block): odd row counts and lengths, large "
        "logits, -inf, fp32 and fp16",
        hint="a (ROWS, BLOCK) tile: mask rows past the end and columns past n_cols (other=-inf), "
        "reduce along axis 1",
        cases=_softmax_cases,
        check=cases.values("reduction"),
        forbidden_ops=SOFTMAX_OPS,
    ),
    kernel_task(
        name="layer_norm",
        function="layer_norm",
        points=4,
        summary="LayerNorm forward: mean and variance in float32, rows of mean 30, fp32 and fp16",
        hint="mean first, then the variance of (x - mean) (masked lanes contribute 0), "
        "y = (x - mean) * rstd * weight + bias",
        cases=_layer_norm_cases,
        check=cases.values("reduction"),
        forbidden_ops=LAYER_NORM_OPS,
    ),
    kernel_task(
        name="rms_norm",
        function="rms_norm",
        points=3,
        summary="RMSNorm forward, one row per program, float32 accumulation, fp32 and fp16",
        hint="x * rsqrt(mean(x * x) + eps) * weight, with x upcast to float32 before squaring",
        cases=_rms_norm_cases,
        check=cases.values("reduction"),
        forbidden_ops=RMS_NORM_OPS,
    ),
    kernel_task(
        name="softmax_rows_gpu",
        function="softmax_rows",
        points=3,
        summary="on a GPU: bf16 values, and at least half a copy's speed on a million rows of 64",
        hint="one row of 64 columns is 256 bytes: pack 8 to 32 rows per program, num_warps 4",
        cases=_softmax_gpu_cases,
        check=cases.values("reduction"),
        forbidden_ops=SOFTMAX_OPS,
        needs_gpu=True,
        exclusive=True,
    ),
]
