"""Lab 5's grader against bad submissions: a kernel that is right but batch-variant, or
invariant but wrong, or combined by atomics, earns nothing, and says which.

Every bad submission is Lab 5's solution with one graded cell changed, graded with only the
task it breaks, so the file stays within about a minute on two cores.
"""

from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, reports_by_group

from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_batch_invariance.ipynb"

MATMUL_GRID = 'grid = (triton.cdiv(M, CONFIG["BLOCK_M"]), triton.cdiv(N, CONFIG["BLOCK_N"]))'
MATMUL_STORE = "acc.to(c_ptr.dtype.element_ty), mask=mask)"
COMPARE = "if not torch.equal(op(x[:b])[0], alone):"
PARTIALS = "m, l, acc = decode_partials(q, k, v, split_size)"
COMBINE_ORDER = "for s in range(0, n_splits):  # split 0, 1, 2, ...: the same order in every batch"
COMBINE_ADD = "acc += w * tl.load(acc_ptr + (bh * n_splits + s) * D + d)"
NO_MAX = "p = tl.exp(s - m_new)"
N_SPLITS = "n_splits = triton.cdiv(S, split_size)"
FOUR_SPLITS = "split_size = max(16, triton.next_power_of_2(triton.cdiv(S, 4)))"

# name -> (the task it breaks, the function whose cell changes, [(old, new)], message fragments)
CASES = {
    # the library's choice: more, smaller splits for a small batch; the values stay right
    "decode_split_from_batch": (
        "decode_attention",
        "decode_attention",
        [(PARTIALS, PARTIALS.replace("split_size)", "split_size if q.shape[0] >= 4 else 16)"))],
        ["not batch-invariant", "differs from f(X)[:", "ULP", "rows]"],
    ),
    # the combine's adds from atomics: refused before anything runs
    "decode_atomic_combine": (
        "decode_attention",
        "decode_combine_kernel",
        [(COMBINE_ADD, "tl.atomic_add(out_ptr + bh * D + d, w)\n        " + COMBINE_ADD)],
        ["uses atomic_add", "order the programs finish"],
    ),
    # the partials without the max: exp of a score of ~100 overflows float32
    "partials_no_max": (
        "decode_partials",
        "decode_split_kernel",
        [(NO_MAX, "p = tl.exp(s)")],
        ["wrong l", "float32", "seed"],
    ),
    # the splits of a fixed NUMBER (4) rather than a fixed size: the partials' shape shows it
    "partials_fixed_count": (
        "decode_partials",
        "decode_partials",
        [(N_SPLITS, FOUR_SPLITS + "\n    " + N_SPLITS)],
        ["expected"],
    ),
    "matmul_block_k_from_m": (
        "invariant_matmul",
        "invariant_matmul",
        [
            (MATMUL_GRID, MATMUL_GRID + '\n    cfg = dict(CONFIG, BLOCK_K=16 if M < 32 else 32)'),
            ("**CONFIG,\n    )", "**cfg,\n    )"),
        ],
        ["not batch-invariant", "differs from f(X)[:", "ULP", "rows]"],
    ),
    "matmul_zeros": (
        "invariant_matmul",
        "invariant_matmul",
        [(MATMUL_STORE, MATMUL_STORE.replace("acc.to", "(acc * 0.0).to"))],
        ["wrong values", "full batch", "seed"],
    ),
    "first_batch_with_tolerance": (
        "first_variant_batch",
        "first_variant_batch",
        [(COMPARE, "if not torch.allclose(op(x[:b])[0], alone, rtol=1e-3):")],
        ["expected", "a hidden op"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{bad submission: {task: its report}}, one grader run per group of tasks."""
    tasks = ("invariant_matmul", "first_variant_batch", "decode_partials", "decode_attention")
    groups = [[task] for task in tasks]  # one run each
    return reports_by_group(tmp_path_factory, SOLUTION, CASES, groups, time_limit=60)


# Compiled for tensor cores, a dot adds into its accumulator K step by K step (16 at a time
# for bf16) whatever BLOCK_K is, so changing BLOCK_K may not change a single rounding there,
# as it does in the interpreter. On the H200 (2026-12-03) this case failed this test, the
# likely reason; the failure's message was not kept. CPU only until a GPU variant of the
# defect is written and checked there.
GPU_INVARIANT = {"matmul_block_k_from_m"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                ON_GPU and name in GPU_INVARIANT,
                reason="BLOCK_K need not change a rounding on tensor cores (see GPU_INVARIANT)",
            ),
        )
        for name in sorted(CASES)
    ],
)
def test_each_bad_submission_fails_its_task_with_its_own_message(reports, name):
    task, _, _, fragments = CASES[name]
    assert_fails_with(reports[name][task], fragments)
