"""Lab 5, batch invariance: its tasks, the cases the grader draws, and the references.

Invariance is checked the way Chapter 5's harness checks it, in the grader's process: the
child returns f(X) and f(X[:B]) for several B, and once every value is right against the
course's references in float64 (`kernels.batch_invariant.rms_norm_ref` and `matmul_ref`,
through `kernels.check`), the task's group check compares them bit for bit
(`kernels.batch_invariant.harness`).
Tasks 3 to 5, split-KV decoding, draw their cases in `lab05_decode`.
The first task's ops are built in the child from a description (`variant_op`): the grader
builds the same op from the same description and finds the answer itself.
"""

import bisect
from functools import partial

import torch

from kernels.batch_invariant import matmul_ref
from kernels.grader import cases
from kernels.grader.lab05_decode import (
    check_partials,
    decode_attention_cases,
    decode_gpu_cases,
    decode_partials_cases,
)
from kernels.grader.prefixes import check_prefixes, prefix_group, prefix_sizes
from kernels.grader.tasks import Case, Task, kernel_task

NAME = "lab05_batch_invariance"
OP_K, OP_N = 32, 8  # the hidden ops' weight: x (B, OP_K) @ w (OP_K, OP_N)
# The course's own invariant kernels and harness: the lab asks you to write them.
COURSE_NAMES = frozenset(
    {"batch_invariant", "invariant_rows", "invariant_matmul", "invariant_attention", "norm",
     "batch_variant", "first_row_drift", "check_batch_invariance", "first_bad_batch"}
)  # fmt: skip


# Task 1: the batch size where an op changes strategy


def _split_k(x: torch.Tensor, w: torch.Tensor, pieces: int) -> torch.Tensor:
    """x @ w with K cut into `pieces` parts, each summed in order, then the parts in order.
    Elementwise torch ops only: every result is one IEEE rounding per step, on any device."""
    k = w.shape[0]
    bounds = [k * i // pieces for i in range(pieces + 1)]
    total = None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        part = x[:, lo : lo + 1] * w[lo]
        for j in range(lo + 1, hi):
            part = part + x[:, j : j + 1] * w[j]
        total = part if total is None else total + part
    return total


def variant_op(seed: int, switches: list, splits: list):
    """A split-K-style matmul x (B, OP_K) @ w -> (B, OP_N) that picks its split from the
    batch size, as libraries do: splits[i] pieces while B < switches[i], then splits[-1]."""
    w = cases.tensor((OP_K, OP_N), seed)

    def op(x: torch.Tensor) -> torch.Tensor:
        pieces = splits[bisect.bisect_right(switches, x.shape[0])]
        return _split_k(x, w.to(x.device), pieces)

    return op


def first_variant_batch_ref(op, x: torch.Tensor):
    """The smallest B for which row 0 of op(x[:B]) is not bitwise op(x[:1])[0]; None if none."""
    alone = op(x[:1])[0]
    for b in range(2, x.shape[0] + 1):
        if not torch.equal(op(x[:b])[0], alone):
            return b
    return None


# (switches, splits): a library's ladder of strategies, and ladders whose answer is not the
# first switch (a change that keeps row 0's bits) or is no switch at all
LADDERS = (
    ([17], [4, 1]),
    ([2], [2, 1]),
    ([9, 33], [8, 4, 1]),
    ([5, 40], [4, 4, 1]),
    ([24, 60], [1, 2, 1]),
    ([], [2]),
    ([500], [4, 1]),
    ([3, 7, 100], [16, 8, 2, 1]),
)


def _first_variant_cases(rng):
    drawn = []
    for switches, splits in LADDERS:
        seed, bmax = cases.new_seed(rng), rng.randint(64, 160)
        shift = rng.randint(0, 9) if switches and switches[0] > 2 else 0
        switches = [s + shift for s in switches]
        x = cases.tensor((bmax, OP_K), seed + 1)
        spec = {
            "builder": "kernels.grader.lab05:variant_op",
            "kwargs": {"seed": seed, "switches": switches, "splits": splits},
        }
        expected = first_variant_batch_ref(variant_op(seed, switches, splits), x)
        label = f"a hidden op on x of shape {tuple(x.shape)}, seed {seed}"
        drawn.append(Case((spec, x), label=label, expected=[expected]))
    return drawn


def _check_first_variant(case: Case, out) -> str | None:
    (want,) = case.expected
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        out = out.item()
    if out != want or isinstance(out, bool):
        return f"returned {out!r:.40}, expected {want!r}"
    return None


# Tasks 2 and 3: a function checked for values and for bitwise invariance in B


MATMUL_SHAPES = ((67, 129, 33), (40, 64, 65))  # (M, K, N), M the largest batch
MATMUL_PREFIXES = (16, 17, 31, 32, 33, 64, 65)  # block edges of 16, 32 and 64 rows


def _matmul_group(rng, shape, dtype, prefixes=MATMUL_PREFIXES, strided=False):
    rows, k, n = shape
    a, seed = cases.draw(rng, (rows, k), dtype)
    b = cases.tensor((k, n), seed + 1, dtype)
    a = cases.strided(a) if strided else a
    kind = " (non-contiguous)" if strided else ""
    label = f"a ({rows}, {k}){kind} @ b ({k}, {n}), {cases.dtype_name(dtype)}, seed {seed}"
    ref = lambda a: matmul_ref(a.double(), b.double())
    sizes = prefix_sizes(rows, rng, prefixes)
    return prefix_group(a, (b,), label, ref, dtype, sizes)


def _matmul_cases(rng):
    drawn = []
    for dtype in (torch.float32, torch.float16):
        for shape in MATMUL_SHAPES:
            drawn += _matmul_group(rng, shape, dtype)
    return drawn + _matmul_group(rng, MATMUL_SHAPES[1], torch.float32, strided=True)


MATMUL_OPS = frozenset({"matmul", "mm", "addmm", "__matmul__", "bmm", "einsum"})
# The kernel tasks: values, then bitwise invariance across each group's batch sizes, and none
# of the course's own invariant kernels.
invariant_task = partial(kernel_task, check_group=check_prefixes, forbidden_names=COURSE_NAMES)

# Atomics add in the order the programs happen to finish: a combine built on them is not
# invariant on a GPU (on a CPU the interpreter runs programs in order and hides it).
ATOMICS = frozenset({"atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min"})
ATOMIC_REASONS = dict.fromkeys(
    ATOMICS, "an atomic adds in the order the programs finish, which changes from run to run"
)
decode_task = partial(
    invariant_task,
    forbidden_names=COURSE_NAMES | ATOMICS,
    forbidden_reasons=ATOMIC_REASONS,
    forbidden_ops=frozenset({"scaled_dot_product_attention", "softmax", *MATMUL_OPS}),
)

TASKS = [
    Task(
        name="first_variant_batch",
        function="first_variant_batch",
        points=2,
        summary="the first batch size where hidden split-K-style ops change row 0's bits",
        hint="compare op(x[:B])[0] with op(x[:1])[0] with torch.equal for B = 2, 3, ...",
        cases=_first_variant_cases,
        check=_check_first_variant,
        forbidden_names=COURSE_NAMES,
    ),
    invariant_task(
        name="invariant_matmul",
        function="invariant_matmul",
        points=3,
        summary="a Triton matmul: values, and bitwise f(A[:M]) == f(A)[:M], fp32 and fp16",
        hint="one tile configuration for every M, and the whole K in one program, in order",
        cases=_matmul_cases,
        check=cases.values("matmul"),
        forbidden_ops=MATMUL_OPS,
    ),
    decode_task(
        name="decode_partials",
        function="decode_partials",
        points=3,
        summary="split-KV partials (m, l, acc) of one decoding query, splits of a fixed size",
        hint="split s holds keys [s * split_size, (s + 1) * split_size); m its max scaled score, "
        "l the sum of exp(score - m), acc the sum of exp(score - m) * v",
        cases=decode_partials_cases,
        check=check_partials,
        check_group=None,
    ),
    decode_task(
        name="decode_attention",
        function="decode_attention",
        points=4,
        summary="split-KV decoding with an ordered combine: values, and bitwise f(Q[:B]) == "
        "f(Q)[:B]",
        hint="the same split_size for every batch; combine split 0, 1, 2, ... in one program per "
        "(batch, head), rescaling by exp(m_s - max m)",
        cases=decode_attention_cases,
        check=cases.values("attention"),
    ),
    decode_task(
        name="decode_attention_gpu",
        function="decode_attention",
        points=3,
        summary="on a GPU: bf16 and fp16, bitwise across batches of 1 to 48, and at least half "
        "the speed of copying K and V",
        hint="one program per (batch, head, split), BLOCK_N keys at a time; the combine is tiny",
        cases=decode_gpu_cases,
        check=cases.values("attention"),
        needs_gpu=True,
        exclusive=True,
        time_limit=180.0,  # compiles the two kernels for each dtype, then times a 1 GiB step
    ),
]
