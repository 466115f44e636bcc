"""Lab 2, operator fusion: its tasks, the cases the grader draws, and the references.

The references are the course's own `_ref` functions run in float64 on the same inputs:
`bias_gelu_ref`, `softmax_ref` and `rms_norm_ref` (imported when the cases are drawn, so that
grading another lab does not load these kernels). Values are compared with the course's
tolerance table (`kernels.check`): elementwise for bias + GELU, reduction for the rest.
"""

import torch

from kernels import check
from kernels.grader.tasks import KERNEL_DEFENCES, Case, Task

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


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _draw(rng, shape, dtype, scale=1.0, transpose=False):
    """Fresh values of `shape` (made as the transpose of a contiguous tensor when asked)."""
    seed = rng.randrange(2**31)
    made = tuple(reversed(shape)) if transpose else shape
    x = check.random_tensor(made, torch.float32, seed=seed, device="cpu", scale=scale)
    return (x.t() if transpose else x), seed


def _label(x, dtype, seed, extra="") -> str:
    kind = ", non-contiguous" if not x.is_contiguous() else ""
    return f"shape {tuple(x.shape)}{kind}, {_dtype_name(dtype)}{extra}, seed {seed}"


def _values(op: str):
    def check_values(case: Case, out) -> str | None:
        result = check.compare(out, case.expected, op=op, dtype=case.dtype)
        return None if result.ok else f"wrong values: {result.message}"

    return check_values


# Task 1: bias + GELU


def _bias_gelu_case(rng, shape, dtype, transpose=False):
    from kernels.elementwise import bias_gelu_ref

    x, seed = _draw(rng, shape, dtype, scale=rng.choice((1.0, 3.0)), transpose=transpose)
    bias, _ = _draw(rng, shape[-1:], dtype)
    x, bias = x.to(dtype), bias.to(dtype)
    expected = bias_gelu_ref(x.double(), bias.double())
    return Case((x, bias), _label(x, dtype, seed), expected=expected, dtype=dtype)


BIAS_GELU_SHAPES = ((1,), (3,), (127,), (4097,), (3, 127), (129, 1000), (2, 3, 129), (5, 1025))


def _bias_gelu_cases(rng):
    cases = []
    for dtype in CPU_DTYPES:
        cases += [_bias_gelu_case(rng, shape, dtype) for shape in BIAS_GELU_SHAPES]
        cases.append(_bias_gelu_case(rng, (129, 1000), dtype))  # new data: a cache shows
        cases.append(_bias_gelu_case(rng, (33, 65), dtype, transpose=True))
    return cases


# Tasks 2, 3 and 5: softmax


def _softmax_case(rng, shape, dtype, kind="random", transpose=False, block=None):
    from kernels.softmax import softmax_ref

    x, seed = _draw(rng, shape, dtype, scale=4.0, transpose=transpose)
    extra = ""
    if kind == "large":  # exp(1000) overflows float32: only the max subtraction saves it
        x, extra = x * 25.0 + 1000.0, ", logits around 1000"
    elif kind == "negative":  # a masked lane that loads 0 instead of -inf becomes the max
        x, extra = x * 25.0 - 1000.0, ", logits around -1000"
    elif kind == "ascending":  # every block raises the running max
        x, extra = x.sort(dim=-1).values, ", each row sorted ascending"
    elif kind == "masked":  # a padded row: whole blocks of -inf before the first value
        masked = shape[-1] * 3 // 7
        x = x.clone()
        x[..., :masked] = float("-inf")
        extra = f", the first {masked} columns -inf"
    x = x.to(dtype)
    args = (x,) if block is None else (x, block)
    extra += "" if block is None else f", block {block}"
    label = _label(x, dtype, seed, extra)
    return Case(args, label, expected=softmax_ref(x.double()), dtype=dtype)


SOFTMAX_SHAPES = ((1, 1), (3, 127), (5, 129), (3, 1000), (2, 4097), (2, 3, 129))


def _softmax_cases(rng):
    cases = []
    for dtype in CPU_DTYPES:
        cases += [_softmax_case(rng, shape, dtype) for shape in SOFTMAX_SHAPES]
        cases.append(_softmax_case(rng, (3, 1000), dtype))  # new data: a cache shows
        cases.append(_softmax_case(rng, (4, 300), dtype, kind="large"))
        cases.append(_softmax_case(rng, (4, 300), dtype, kind="negative"))
        cases.append(_softmax_case(rng, (3, 300), dtype, kind="masked"))
        cases.append(_softmax_case(rng, (33, 65), dtype, transpose=True))
    return cases


# (shape, block): rows of one block, of several, and a last block of a single column
STREAMED_SHAPES = (
    ((1, 1), 16),
    ((3, 127), 32),
    ((5, 129), 64),
    ((3, 1000), 128),
    ((2, 4097), 512),
    ((2, 3, 300), 64),
)


def _softmax_streamed_cases(rng):
    cases = []
    for dtype in CPU_DTYPES:
        for shape, block in STREAMED_SHAPES:
            cases.append(_softmax_case(rng, shape, dtype, block=block))
        cases.append(_softmax_case(rng, (3, 1000), dtype, block=128))  # new data
        cases.append(_softmax_case(rng, (4, 1000), dtype, kind="ascending", block=128))
        cases.append(_softmax_case(rng, (4, 300), dtype, kind="large", block=64))
        cases.append(_softmax_case(rng, (4, 300), dtype, kind="negative", block=64))
        cases.append(_softmax_case(rng, (3, 700), dtype, kind="masked", block=128))
        cases.append(_softmax_case(rng, (6, 97), dtype, transpose=True, block=32))
    # longer than any Triton block can be: only a kernel that streams the row gets through
    cases.append(_softmax_case(rng, (1, LONG_ROW), torch.float32, block=4096))
    return cases


def _softmax_gpu_cases(rng):
    cases = [
        _softmax_case(rng, shape, torch.bfloat16)
        for shape in ((1, 1), (3, 127), (2, 4097), (2, 3, 129))
    ]
    cases.append(_softmax_case(rng, (4, 300), torch.bfloat16, kind="large"))
    big = {"random": (16384, 8192), "dtype": torch.float32, "seed": rng.randrange(2**31)}
    cases.append(Case((big,), label="shape (16384, 8192), float32, timed", action="time"))
    return cases


def _check_softmax_gpu(case: Case, out) -> str | None:
    if case.action != "time":
        return _values("reduction")(case, out)
    if not isinstance(out, dict) or not out.get("ms", 0) > 0:
        return "no timing came back"
    fraction = out["copy_ms"] / out["ms"]
    if fraction < MIN_COPY_FRACTION:
        return (
            f"took {out['ms']:.3f} ms, {fraction:.0%} of the speed of torch copying the same "
            f"tensor ({out['copy_ms']:.3f} ms); a fused softmax reads and writes each element "
            f"once, as the copy does, and should reach {MIN_COPY_FRACTION:.0%} of it"
        )
    return None


# Task 4: RMSNorm


def _rms_norm_case(rng, shape, dtype, scale=2.0, eps=None, transpose=False, extra=""):
    from kernels.norm import rms_norm_ref

    x, seed = _draw(rng, shape, dtype, scale=scale, transpose=transpose)
    weight, _ = _draw(rng, shape[-1:], dtype)
    x, weight = x.to(dtype), weight.to(dtype)
    eps = eps if eps is not None else rng.choice((1e-6, 1e-5))
    label = _label(x, dtype, seed, f"{extra}, eps {eps:g}")
    expected = rms_norm_ref(x.double(), weight.double(), eps)
    return Case((x, weight), label, expected=expected, dtype=dtype, kwargs={"eps": eps})


RMS_NORM_SHAPES = ((1, 1), (3, 127), (17, 33), (2, 5, 1000), (3, 4097))


def _rms_norm_cases(rng):
    cases = []
    for dtype in CPU_DTYPES:
        cases += [_rms_norm_case(rng, shape, dtype) for shape in RMS_NORM_SHAPES]
        cases.append(_rms_norm_case(rng, (3, 4097), dtype))  # new data: a cache shows
        # squares of 300 overflow float16 (max 65504): only float32 accumulation gets through
        cases.append(_rms_norm_case(rng, (4, 1000), dtype, scale=300.0, extra=", values ~300"))
        # mean(x^2) ~ 1e-4 next to eps = 0.01: eps sets the scale
        cases.append(_rms_norm_case(rng, (3, 300), dtype, scale=0.01, eps=0.01))
        cases.append(_rms_norm_case(rng, (40, 129), dtype, transpose=True))
    return cases


TASKS = [
    Task(
        name="bias_gelu",
        function="bias_gelu",
        points=3,
        summary="a fused Triton kernel: any leading dims, odd sizes, fp32 and fp16",
        hint="z = x + bias[column] in float32, then 0.5 * z * (1 + erf(z / sqrt(2))), "
        "stored in x's dtype",
        cases=_bias_gelu_cases,
        check=_values("elementwise"),
        **KERNEL_DEFENCES,
        forbidden_ops=GELU_OPS,
    ),
    Task(
        name="softmax",
        function="softmax",
        points=3,
        summary="one row per program: odd row lengths, large logits, -inf, fp32 and fp16",
        hint="masked lanes load -inf; subtract the row max before exp; compute in float32",
        cases=_softmax_cases,
        check=_values("reduction"),
        **KERNEL_DEFENCES,
        forbidden_ops=SOFTMAX_OPS,
    ),
    Task(
        name="softmax_streamed",
        function="softmax_streamed",
        points=3,
        summary="online softmax over blocks of a row: rows of many blocks, one of 2**20 + 1",
        hint="keep a running max and running sums, rescale the sums by exp(m_old - m_new), "
        "and guard the rescale while the max is still -inf",
        cases=_softmax_streamed_cases,
        check=_values("reduction"),
        **KERNEL_DEFENCES,
        forbidden_ops=SOFTMAX_OPS,
    ),
    Task(
        name="rms_norm",
        function="rms_norm",
        points=3,
        summary="RMSNorm forward, one row per program, float32 accumulation, fp32 and fp16",
        hint="x * rsqrt(mean(x * x) + eps) * weight, with x upcast to float32 before squaring",
        cases=_rms_norm_cases,
        check=_values("reduction"),
        **KERNEL_DEFENCES,
        forbidden_ops=RMS_NORM_OPS,
    ),
    Task(
        name="softmax_gpu",
        function="softmax",
        points=2,
        summary="on a GPU: bf16 values, and at least half a copy's speed on 16384 x 8192",
        hint="load bf16, compute in float32, store bf16; one read and one write per element",
        cases=_softmax_gpu_cases,
        check=_check_softmax_gpu,
        **KERNEL_DEFENCES,
        forbidden_ops=SOFTMAX_OPS,
        needs_gpu=True,
        exclusive=True,
    ),
]
