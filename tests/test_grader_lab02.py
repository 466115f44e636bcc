"""The grader against bad Lab 2 submissions: the mistakes fusion invites, each caught with a
message that names it.

Every bad submission is Lab 2's solution with one graded cell changed. They are graded in one
batch per task (one `python -m kernels grade` each, the task's notebooks together), so the file
stays within about a minute on two cores.
"""

from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, grade_cases, in_function

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab02_fusion.ipynb"

GELU = "y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))"
TANH_GELU = "y = z * tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))"
BLOCK_END = "\n    ### END SOLUTION"
END = "    return out" + BLOCK_END
ROW_LOAD = (
    "x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, "
    'other=float("-inf"))'
)
EXP = "numerator = tl.exp(x - tl.max(x, axis=1)[:, None])"
VARIANCE = "rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)"
ONE_PASS = "rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols - mean * mean + eps)"
NORM_LOAD = "x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)"

TORCH_SOFTMAX = "    return torch.softmax(x, dim=-1)" + BLOCK_END
NO_MINUS_INF = ROW_LOAD.replace(', other=float("-inf")', "")
FP16_LOAD = NORM_LOAD.replace(".to(tl.float32)", "")

# name -> (the task, which is also the function whose graded cell changes, [(old, new), ...])
CASES = {
    "tanh_gelu": ("bias_gelu", [(GELU, TANH_GELU)]),
    "calls_softmax": ("softmax_rows", [(END, TORCH_SOFTMAX)]),
    "no_max": ("softmax_rows", [(EXP, "numerator = tl.exp(x)")]),
    "no_minus_inf": ("softmax_rows", [(ROW_LOAD, NO_MINUS_INF)]),
    "one_pass_variance": ("layer_norm", [(VARIANCE, ONE_PASS)]),
    "fp16_squares": ("rms_norm", [(NORM_LOAD, FP16_LOAD)]),
}  # fmt: skip

EXPECTED = {
    "tanh_gelu": ["wrong values: max abs error", "float32", "seed", "Hint:", "erf"],
    "calls_softmax": ["called torch's softmax"],
    "no_max": ["non-finite values", "logits around 1000", "float32"],
    "no_minus_inf": ["wrong values"],  # caught on whichever row has a small max first
    "one_pass_variance": ["wrong values", "mean ~30"],
    "fp16_squares": ["wrong values", "float16"],
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{bad submission: {task: its report}}, one grader run per task."""
    found = {}
    for task in dict.fromkeys(spec[0] for spec in CASES.values()):
        cases = {name: in_function(*spec) for name, spec in CASES.items() if spec[0] == task}
        found.update(grade_cases(SOLUTION, tmp_path_factory.mktemp(task), cases, [task], jobs=2))
    assert set(found) == set(CASES)
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_mistake_fails_its_task_with_its_own_message(reports, name):
    task_name = CASES[name][0]
    assert_fails_with(reports[name][task_name], EXPECTED[name])
