"""Lab 5's grader against bad submissions: a kernel that is right but batch-variant, or
invariant but wrong, earns nothing, and says which.

Every bad submission is Lab 5's solution with one graded cell changed, graded with only the
task it breaks, so the file stays within about a minute on two cores.
"""

from pathlib import Path

import pytest
from bad_submissions import grade_cases, in_function

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab05_batch_invariance.ipynb"

RMS_BLOCK = "block_c = min(triton.next_power_of_2(n_cols), MAX_BLOCK_C)"
MATMUL_GRID = 'grid = (triton.cdiv(M, CONFIG["BLOCK_M"]), triton.cdiv(N, CONFIG["BLOCK_N"]))'
MATMUL_STORE = "acc.to(c_ptr.dtype.element_ty), mask=mask)"
COMPARE = "if not torch.equal(op(x[:b])[0], alone):"
SPLITS = (
    "return [(start, min(start + split_size, kv_len)) for start in range(0, kv_len, split_size)]"
)

# name -> (the task it breaks, the function whose cell changes, [(old, new)], message fragments)
CASES = {
    # a smaller block (more, shorter chunks per row) for small batches: a split reduction's order
    "rms_norm_small_batch_blocks": (
        "invariant_rms_norm",
        "invariant_rms_norm",
        [(RMS_BLOCK, RMS_BLOCK.replace("MAX_BLOCK_C)", "MAX_BLOCK_C if n_rows >= 8 else 64)"))],
        ["not batch-invariant", "differs from f(X)[:", "ULP", "rows]"],
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
    "kv_splits_fixed_count": (
        "kv_splits",
        "kv_splits",
        [(SPLITS, "return [(kv_len * i // 4, kv_len * (i + 1) // 4) for i in range(4)]")],
        ["kv_splits(1000, 256)", "expected"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{bad submission: {task: its report}}, one grader run per group of tasks."""
    found = {}
    for tasks in (
        ["invariant_rms_norm"],
        ["invariant_matmul"],
        ["first_variant_batch", "kv_splits"],
    ):
        cases = {name: in_function(*spec[1:3]) for name, spec in CASES.items() if spec[0] in tasks}
        folder = tmp_path_factory.mktemp(tasks[0])
        found.update(grade_cases(SOLUTION, folder, cases, tasks, time_limit=60))
    assert set(found) == set(CASES)
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_bad_submission_fails_its_task_with_its_own_message(reports, name):
    task, _, _, fragments = CASES[name]
    found = reports[name][task]
    assert found["status"] == "failed" and found["points"] == 0, found
    for fragment in fragments:
        assert fragment in found["message"], (fragment, found["message"])
    assert "grader error" not in found["message"]
