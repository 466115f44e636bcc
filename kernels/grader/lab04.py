"""Lab 4, attention: its tasks, the cases the grader draws, and the references.

The references are computed here in fp64: the online-softmax step from its formulas, the
attention from `kernels.attention.attention_ref` on upcast inputs, the sliding window and dV
from the masked probabilities. Shapes stay tiny on a CPU
(the interpreter runs every program in Python) and odd, so that masks on the last query
block, the last key block and the causal diagonal are all exercised.
"""

import math
from functools import partial

import torch

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
    return cases.fp32_tuple_problem(out, case.expected, ("m_new", "l_new", "acc_new"))


# (B, H, Sq, Sk, D): one query row, odd lengths across the 16-row blocks, Sq < Sk (decoding).
CPU_SHAPES = ((1, 1, 1, 1, 16), (1, 2, 17, 17, 16), (2, 1, 33, 33, 32), (1, 2, 5, 33, 32),
              (1, 1, 1, 17, 16), (1, 1, 16, 31, 32))  # fmt: skip


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


# Task 3: a sliding window. Query i, at position p = i + Sk - Sq, sees keys p - window < j <= p.


def visible(Sq: int, Sk: int, causal: bool, window: int | None = None) -> torch.Tensor:
    """(Sq, Sk) bool: which keys each query sees, the causal mask aligned to the end."""
    pos = torch.arange(Sq)[:, None] + (Sk - Sq)
    j = torch.arange(Sk)[None, :]
    seen = j <= pos if causal or window else torch.ones(Sq, Sk, dtype=torch.bool)
    return seen & (j > pos - window) if window else seen


def masked_probs(q, k, mask) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) in float64 with the hidden scores -inf: (B, H, Sq, Sk)."""
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)


def window_ref(q, k, v, window: int) -> torch.Tensor:
    mask = visible(q.shape[-2], k.shape[-2], True, window)
    return masked_probs(q, k, mask) @ v.double()


# (B, H, Sq, Sk, D, window): a window of one key, windows shorter and longer than a block of 16,
# Sq < Sk, and a window longer than the sequence (plain causal attention)
WINDOW_SPECS = (
    (1, 1, 1, 1, 16, 1),
    (1, 2, 17, 17, 16, 1),
    (1, 2, 33, 33, 32, 5),
    (2, 1, 40, 40, 16, 17),
    (1, 2, 5, 33, 32, 16),
    (1, 1, 31, 70, 16, 40),
    (1, 1, 20, 20, 32, 64),
)


def _window_case(rng, spec, dtype, strided=False):
    B, H, Sq, Sk, D, window = spec
    case = _attention_case(rng, (B, H, Sq, Sk, D), dtype, causal=True, strided=strided)
    q, k, v = case.args
    label = case.label.replace("causal=True", f"window {window}")
    return Case((q, k, v, window), label, window_ref(q, k, v, window), dtype)


def _window_cases(rng):
    return cases.standard(
        _window_case,
        WINDOW_SPECS,
        (torch.float32, torch.float16),
        rng,
        again=WINDOW_SPECS[3],
        strided_spec=WINDOW_SPECS[4],
    )


WINDOW_GPU_SPECS = (
    (2, 3, 257, 257, 64, 100),
    (1, 2, 1, 1000, 128, 256),
    (1, 4, 129, 300, 128, 64),
)
WINDOW_TIMED = (1, 16, 16384, 128, 512)  # (B, H, S, D, window), bf16
# On an H200 (torch 2.11, triton 3.6) the solution's window of 512 runs 7.8x causal SDPA's speed.
MIN_SDPA_FRACTION = 1.0


def _window_gpu_cases(rng):
    drawn = []
    for dtype in (torch.bfloat16, torch.float16):
        drawn += [_window_case(rng, spec, dtype) for spec in WINDOW_GPU_SPECS]
        drawn.append(_window_case(rng, WINDOW_GPU_SPECS[2], dtype, strided=True))
    B, H, S, D, window = WINDOW_TIMED
    qkv = tuple(cases.big_random(rng, (B, H, S, D), torch.bfloat16) for _ in range(3))
    fraction = window / (S / 2)
    timed = cases.timed(
        (*qkv, window),
        f"q, k, v ({B}, {H}, {S}, {D}), bfloat16, window {window}, timed",
        against="attention",
        min_fraction=MIN_SDPA_FRACTION,
        why=f"a window of {window} keys is {fraction:.0%} of causal attention's work at this "
        "length, when the kernel skips the key blocks outside it",
        rate=lambda ms: f"{4 * B * H * S * window * D / (ms * 1e9):.0f} TFLOP/s",
    )
    return drawn + [timed]


# Task 4: dV, the first gradient of the backward


def dv_ref(q, k, do, causal: bool) -> torch.Tensor:
    """dV = P^T dO in float64: (B, H, Sk, D)."""
    mask = visible(q.shape[-2], k.shape[-2], causal)
    return masked_probs(q, k, mask).transpose(-2, -1) @ do.double()


def lse_ref(q, k, causal: bool) -> torch.Tensor:
    """The log-sum-exp of each query's scaled, masked scores, float32: (B, H, Sq)."""
    mask = visible(q.shape[-2], k.shape[-2], causal)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1).float()


def _dv_case(rng, shape, dtype, causal=None, strided=False):
    causal = rng.random() < 0.5 if causal is None else causal
    case = _attention_case(rng, shape, dtype, causal=causal, strided=strided)
    q, k, do = case.args  # the third operand plays dO: (B, H, Sk, D) is its shape only when Sq = Sk
    B, H, Sq, Sk, D = shape
    do = cases.tensor((B, H, Sq, D), cases.new_seed(rng), dtype)
    do = cases.strided(do) if strided else do
    lse = lse_ref(q, k, causal)
    label = case.label.replace("k and v", "k").replace(", causal", ", dO of q's shape, causal")
    return Case((q, k, do, lse), label, dv_ref(q, k, do, causal), dtype, kwargs={"causal": causal})


def _dv_cases(rng):
    drawn = []
    for dtype in (torch.float32, torch.float16):
        for causal in (False, True):
            drawn += [_dv_case(rng, shape, dtype, causal) for shape in CPU_SHAPES]
        drawn.append(_dv_case(rng, CPU_SHAPES[3], dtype, True, strided=True))
    return drawn


# The kernel tasks share their check and the torch ops they forbid.
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
        summary="the warm-up: the fused forward, causal and not, odd Sq <= Sk, D 16 and 32, "
        "fp32 and fp16",
        hint="mask the last query rows and the last keys (scores -inf); query i sees key j when "
        "j <= i + Sk - Sq; divide by l at the end",
        cases=lambda rng: _attention_cases(rng, False) + _attention_cases(rng, True),
        points=4,
    ),
    attention_task(
        name="attention_window",
        function="attention_window",
        summary="a sliding window: query i sees the last `window` keys up to its own position, "
        "windows of 1 to longer than Sk",
        hint="start the key loop at the block of the first row's first visible key; a row may "
        "see nothing in a block: guard m = -inf as the streamed softmax does",
        cases=_window_cases,
        points=3,
    ),
    attention_task(
        name="attention_dv",
        function="attention_dv",
        summary="dV = P^T dO from q, k, dO and the forward's log-sum-exp, causal and not, fp32 "
        "and fp16",
        hint="one program per key block, looping over query blocks: P^T = exp(scale * K Q^T - "
        "lse) with the masks, dv += tl.dot(P^T, dO)",
        cases=_dv_cases,
        points=4,
    ),
    attention_task(
        name="attention_window_gpu",
        function="attention_window",
        summary="on a GPU: bf16 and fp16, D 64 and 128, and a window of 512 at 16384 tokens "
        "at least as fast as causal SDPA",
        hint="the loop over keys runs from the window's first block to the diagonal: about "
        "(window + BLOCK_M) / BLOCK_N blocks per program, whatever S is",
        cases=_window_gpu_cases,
        points=2,
        needs_gpu=True,
        exclusive=True,
    ),
]
