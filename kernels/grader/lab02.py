"""Lab 2, operator fusion: its tasks, the cases the grader draws, and the references.

The references are the course's own `_ref` functions run in float64 on the same inputs:
`bias_gelu_ref`, `softmax_ref` and `rms_norm_ref` (imported when the cases are drawn, so that
grading another lab does not load these kernels). Values are compared with the course's
tolerance table (`kernels.check`): elementwise for bias + GELU, reduction for the rest.
"""

import torch

from kernels.grader import cases
from kernels.grader.tasks import Case, kernel_task

NAME = "lab02_fusion"
CPU_DTYPES = (torch.float32, torch.float16)
LONG_ROW = (1 << 20) + 1  # one more column than Triton's largest block (2**20 elements)
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


# Tasks 2, 3 and 5: softmax


def _softmax_case(rng, shape, dtype, kind="random", strided=False, block=None):
    from kernels.softmax import softmax_ref

    x, seed = cases.draw(rng, shape, scale=4.0)
    extra = ""
    if kind == "large":  # exp(1000) overflows float32: only the max subtraction saves it
        x, extra = x * 25.0 + 1000.0, ", logits around 1000"
    elif kind == "negative":  # a masked lane that loads 0 instead of -inf becomes the max
        x, extra = x * 25.0 - 1000.0, ", logits around -1000"
    elif kind == "ascending":  # every block raises the running max
        x, extra = x.sort(dim=-1).values, ", each row sorted ascending"
    elif kind == "masked":  # a padded row: whole blocks of -inf before the first value
        masked = shape[-1] * 3 // 7
        x[..., :masked] = float("-inf")
        extra = f", the first {masked} columns -inf"
    x = x.to(dtype)
    x = cases.strided(x) if strided else x
    args = (x,) if block is None else (x, block)
    extra += "" if block is None else f", block {block}"
    label = cases.label(x, dtype, seed, extra)
    return Case(args, label, expected=softmax_ref(x.double()), dtype=dtype)


SOFTMAX_SHAPES = ((1, 1), (3, 127), (5, 129), (3, 1000), (2, 4097), (2, 3, 129))
SOFTMAX_EXTRA = (
    ((4, 300), {"kind": "large"}),
    ((4, 300), {"kind": "negative"}),
    ((3, 300), {"kind": "masked"}),
)


def _softmax_cases(rng):
    return cases.standard(
        _softmax_case,
        SOFTMAX_SHAPES,
        CPU_DTYPES,
        rng,
        again=(3, 1000),
        extra=SOFTMAX_EXTRA,
        strided_spec=(33, 65),
    )


# (shape, block): rows of one block, of several, and a last block of a single column
STREAMED_SPECS = (
    ((1, 1), 16),
    ((3, 127), 32),
    ((5, 129), 64),
    ((3, 1000), 128),
    ((2, 4097), 512),
    ((2, 3, 300), 64),
)
STREAMED_EXTRA = (
    (((4, 1000), 128), {"kind": "ascending"}),
    (((4, 300), 64), {"kind": "large"}),
    (((4, 300), 64), {"kind": "negative"}),
    (((3, 700), 128), {"kind": "masked"}),
)


def _streamed_case(rng, spec, dtype, **options):
    shape, block = spec
    return _softmax_case(rng, shape, dtype, block=block, **options)


def _softmax_streamed_cases(rng):
    drawn = cases.standard(
        _streamed_case,
        STREAMED_SPECS,
        CPU_DTYPES,
        rng,
        again=((3, 1000), 128),
        extra=STREAMED_EXTRA,
        strided_spec=((6, 97), 32),
    )
    # longer than any Triton block can be: only a kernel that streams the row gets through
    return drawn + [_softmax_case(rng, (1, LONG_ROW), torch.float32, block=4096)]


def _softmax_gpu_cases(rng):
    bf16 = torch.bfloat16
    drawn = [
        _softmax_case(rng, shape, bf16) for shape in ((1, 1), (3, 127), (2, 4097), (2, 3, 129))
    ]
    drawn.append(_softmax_case(rng, (4, 300), bf16, kind="large"))
    drawn.append(_softmax_case(rng, (33, 65), bf16, strided=True))
    big = cases.big_random(rng, (16384, 8192), torch.float32)
    timed = cases.timed(
        (big,),
        "shape (16384, 8192), float32, timed",
        against="copy",
        min_fraction=MIN_COPY_FRACTION,
        why="a fused softmax reads and writes each element once, as the copy does",
    )
    return drawn + [timed]


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


TASKS = [
    kernel_task(
        name="bias_gelu",
        function="bias_gelu",
        points=3,
        summary="a fused Triton kernel: any leading dims, odd sizes, fp32 and fp16",
        hint="z = x + bias[column] in float32, then 0.5 * z * (1 + erf(z / sqrt(2))), "
        "stored in x's dtype",
        cases=_bias_gelu_cases,
        check=cases.values("elementwise"),
        forbidden_ops=GELU_OPS,
    ),
    kernel_task(
        name="softmax",
        function="softmax",
        points=3,
        summary="one row per program: odd row lengths, large logits, -inf, fp32 and fp16",
        hint="masked lanes load -inf; subtract the row max before exp; compute in float32",
        cases=_softmax_cases,
        check=cases.values("reduction"),
        forbidden_ops=SOFTMAX_OPS,
    ),
    kernel_task(
        name="softmax_streamed",
        function="softmax_streamed",
        points=3,
        summary="online softmax over blocks of a row: rows of many blocks, one of 2**20 + 1",
        hint="keep a running max and running sums, rescale the sums by exp(m_old - m_new), "
        "and guard the rescale while the max is still -inf",
        cases=_softmax_streamed_cases,
        check=cases.values("reduction"),
        forbidden_ops=SOFTMAX_OPS,
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
        name="softmax_gpu",
        function="softmax",
        points=2,
        summary="on a GPU: bf16 values, and at least half a copy's speed on 16384 x 8192",
        hint="load bf16, compute in float32, store bf16; one read and one write per element",
        cases=_softmax_gpu_cases,
        check=cases.values("reduction"),
        forbidden_ops=SOFTMAX_OPS,
        needs_gpu=True,
        exclusive=True,
    ),
]
