"""Lab 7's grader against bad submissions: a ring that counts one pass, a fit on the absolute
error, a tensor-parallel MLP with no all-reduce, with two, or one that raises on one rank: each
earns nothing, and says why. The task that needs two GPUs is not graded on fewer, with the reason.

Every bad submission is Lab 7's solution with one graded cell changed, graded with only the
tasks it breaks. (The solution's full marks and the starter's zero: tests/test_labs.py.)
"""

from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, reports_by_group

from kernels.grader.grade import precheck
from kernels.grader.labs import LABS
from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab07_multi_gpu.ipynb"

ALL_REDUCE = "    dist.all_reduce(partial)  # + the other rank's"

CASES = {
    "ring_one_pass": (
        "ring_bytes", "ring_bytes", [("2 * (n - 1) * nbytes / n", "(n - 1) * nbytes / n")],
        ["returned bytes = "],
    ),
    "fit_absolute_error": (
        "alpha_beta_fit", "alpha_beta_fit", [(" / t[:, None]  # (m, 2)", "  # (m, 2)"),
                                             ("torch.ones_like(t)[:, None]", "t[:, None]")],
        ["returned alpha = "],
    ),
    "no_all_reduce": ("tp_mlp", "tp_mlp", [(ALL_REDUCE, "")], ["rank 0: wrong values"]),
    "two_all_reduces": (
        "tp_mlp", "tp_mlp", [(ALL_REDUCE, ALL_REDUCE + "\n    dist.all_reduce(torch.zeros(1))")],
        ["rank 0 called these collectives: all_reduce x2", "exactly one all_reduce"],
    ),
    "raises_on_rank_one": (
        "tp_mlp", "tp_mlp",
        [(ALL_REDUCE, "    if dist.get_rank() == 1:\n        raise ValueError('only rank one')\n"
          + ALL_REDUCE)],
        ["rank 1 failed: ValueError: only rank one"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    groups = (["ring_bytes", "alpha_beta_fit"], ["tp_mlp"])
    return reports_by_group(tmp_path_factory, SOLUTION, CASES, groups, time_limit=120)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_bad_submission_fails_its_task_with_its_own_message(reports, name):
    task, _, _, fragments = CASES[name]
    assert_fails_with(reports[name][task], fragments)


@pytest.mark.skipif(ON_GPU, reason="checks a machine without GPUs")
def test_the_two_gpu_task_says_why_it_is_not_graded_here():
    (task,) = [t for t in LABS["lab07_multi_gpu"] if t.name == "tp_mlp_speed"]
    outcome = precheck(task, notebook=None)
    assert outcome.status == "needs_gpu" and outcome.points == 0
    assert outcome.message == "checked on 2 GPUs; this machine has 0"
