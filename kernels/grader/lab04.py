"""Lab 4, attention: its tasks, the cases the grader draws, and the references.

The references are computed here in fp64: the online-softmax step from its formulas, the
attention from `kernels.attention.attention_ref` on upcast inputs. Shapes stay tiny on a CPU
(the interpreter runs every program in Python) and odd, so that masks on the last query
block, the last key block and the causal diagonal are all exercised.
"""

import math
from functools import partial

import torch

from kernels import check
from kernels.attention import attention_ref
from kernels.grader import cases
from kernels.grader.tasks import Case, Task, kernel_task

NAME = "lab04_attention"
# The torch ops that are attention, or its pieces: calling them outside a kernel earns nothing.
ATTENTION_OPS = frozenset(
    {"scaled_dot_product_attention", "softmax", "log_softmax", "matmul", "bmm", "baddbmm",
     "einsum", "mm", "logsumexp"}
)  # fmt: skip
SOFTMAX_OPS = frozenset({"softmax", "log_softmax", "logsumexp", "scaled_dot_product_attention"})


def online_softmax_update_ref(m, l, acc, scores, values):
    """One step of the online softmax in fp64: (m_new, l_new, acc_new)."""
    m, l, acc, scores, values = (t.double() for t in (m, l, acc, scores, values))
    m_new = torch.maximum(m, scores.amax(dim=1))  # (M,)
    p = torch.exp(scores - m_new[:, None])  # (M, N)
    alpha = torch.exp(m - m_new)  # (M,): how much the old state shrinks
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def _state(rng, rows, head_dim, seed, scale):
    """A running state as a kernel would hold it after one earlier block (or the initial one)."""
    if rng.random() < 0.25:
        return (
            torch.full((rows,), -math.inf),
            torch.zeros(rows),
            torch.zeros(rows, head_dim),
            "initial state (m = -inf)",
        )
    n = rng.randint(1, 40)
    scores = cases.tensor((rows, n), seed, scale=scale)
    values = cases.tensor((n, head_dim), seed + 1)
    m0, l0, acc0 = torch.full((rows,), -math.inf), torch.zeros(rows), torch.zeros(rows, head_dim)
    m, l, acc = online_softmax_update_ref(m0, l0, acc0, scores, values)
    return m.float(), l.float(), acc.float(), f"state after {n} keys"


def _online_softmax_cases(rng):
    drawn = []
    for i in range(12):
        rows, n, head_dim = rng.choice((1, 3, 16, 17)), rng.choice((1, 5, 16, 33)), 16
        seed = cases.new_seed(rng)
        scale = (1.0, 10.0, 300.0)[i % 3]  # 300: exp() of the raw scores overflows fp32
        m, l, acc, state = _state(rng, rows, head_dim, seed, scale)
        shift = rng.choice((-2.0, 0.0, 2.0)) * scale  # the new block's max above or below m
        scores = cases.tensor((rows, n), seed + 2, scale=scale) + shift
        if i % 4 == 3 and n > 1:  # masked keys, as a kernel's last block has them
            scores[:, n // 2 :] = -math.inf
        values = cases.tensor((n, head_dim), seed + 3)
        args = (m, l, acc, scores, values)
        label = f"{state}, scores ({rows}, {n}) of scale {scale:g} shifted {shift:+g}, seed {seed}"
        drawn.append(Case(args, label=label, expected=online_softmax_update_ref(*args)))
    return drawn


def _check_online_softmax(case: Case, out) -> str | None:
    names = ("m_new", "l_new", "acc_new")
    if not isinstance(out, (list, tuple)) or len(out) != 3:
        return f"returned {type(out).__name__}, expected a tuple (m_new, l_new, acc_new)"
    for got, want, name in zip(out, case.expected, names, strict=True):
        if not isinstance(got, torch.Tensor):
            return f"returned {name} as {type(got).__name__}, expected a tensor"
        if got.dtype != torch.float32:
            return f"returned {name} as {got.dtype}, expected torch.float32"
        result = check.compare(got, want, op="reduction", dtype=torch.float32)
        if not result.ok:
            return f"wrong {name}: {result.message}"
    return None


# (B, H, Sq, Sk, D): one query row, odd lengths across the 16-row blocks, Sq < Sk (decoding).
CPU_SHAPES = ((1, 1, 1, 1, 16), (1, 2, 17, 17, 16), (2, 1, 33, 33, 32), (1, 2, 5, 33, 32),
              (1, 1, 1, 17, 16), (1, 1, 16, 31, 32))  # fmt: skip
GPU_SHAPES = ((2, 3, 257, 257, 64), (1, 2, 1, 1000, 128), (1, 4, 129, 300, 128))


def _attention_case(rng, shape, dtype, causal, strided=False):
    """q, k and v of one (B, H, Sq, Sk, D) shape; strided: each a view of every other element
    of its head dimension."""
    B, H, Sq, Sk, D = shape
    seed = cases.new_seed(rng)
    q, k, v = (
        cases.tensor(made, seed + offset, dtype)
        for offset, made in enumerate(((B, H, Sq, D), (B, H, Sk, D), (B, H, Sk, D)))
    )
    if strided:
        q, k, v = cases.strided(q), cases.strided(k), cases.strided(v)
    expected = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    kind = ", non-contiguous" if strided else ""
    label = (
        f"q {tuple(q.shape)}, k and v {tuple(k.shape)}{kind}, "
        f"{cases.dtype_name(dtype)}, causal={causal}, seed {seed}"
    )
    return Case((q, k, v), label, expected, dtype, kwargs={"causal": causal})


def _attention_cases(rng, causal):
    return cases.standard(
        partial(_attention_case, causal=causal),
        CPU_SHAPES,
        (torch.float32, torch.float16),
        rng,
        again=CPU_SHAPES[2],
        strided_spec=CPU_SHAPES[3],
    )


def _attention_gpu_cases(rng):
    drawn = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            drawn += [_attention_case(rng, shape, dtype, causal) for shape in GPU_SHAPES]
        drawn.append(_attention_case(rng, GPU_SHAPES[2], dtype, True, strided=True))
    return drawn


# The three kernel tasks share the learner's function, its check and the torch ops they forbid.
attention_task = partial(
    kernel_task,
    function="attention",
    check=cases.values("attention"),
    forbidden_ops=ATTENTION_OPS,
)

TASKS = [
    Task(
        name="online_softmax_update",
        function="online_softmax_update",
        points=3,
        summary="one online-softmax step on random blocks and states, large logits, masked keys",
        hint="m_new = max(m, row max); rescale l and acc by exp(m - m_new); add exp(s - m_new)",
        cases=_online_softmax_cases,
        check=_check_online_softmax,
        forbidden_ops=SOFTMAX_OPS,
    ),
    attention_task(
        name="attention",
        summary="the fused forward, no mask: odd Sq <= Sk, D 16 and 32, fp32 and fp16",
        hint="mask the last query rows and the last keys (scores -inf); divide by l at the end",
        cases=partial(_attention_cases, causal=False),
        points=4,
    ),
    attention_task(
        name="attention_causal",
        summary="the same kernel with causal=True, the mask aligned to the end when Sq < Sk",
        hint="query i sees key j when j <= i + Sk - Sq",
        cases=partial(_attention_cases, causal=True),
        points=3,
    ),
    attention_task(
        name="attention_gpu",
        summary="on a GPU: compiled, bf16 and fp16, D 64 and 128, causal and not",
        hint="compute in fp32 inside the kernel; feed tl.dot the inputs' dtype",
        cases=_attention_gpu_cases,
        points=2,
        needs_gpu=True,
    ),
]
