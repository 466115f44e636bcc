"""Lab 6's grader against bad submissions: an operator that is not registered, or whose fake
lies about its output, a GQA step that reads the wrong key/value head, an int8 GEMV that forgets
the scale, and napkin math that forgets the KV cache: each earns nothing, and says why.

Every bad submission is Lab 6's solution with one graded cell changed, graded with only the
tasks it breaks.
"""

from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, reports_by_group

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab06_llm_inference.ipynb"

REGISTER = "\n    op = torch.library.custom_op("  # the line itself, not the hint that quotes it
FAKE = "return torch.empty_like(gate)  # shape and dtype only: no kernel runs"
STORE = "(acc * scale).to(out_ptr.dtype.element_ty)"

CASES = {
    "plain_function": (
        "silu_mul_operator", "make_silu_mul",
        [(REGISTER, "\n    return silu_mul_launch" + REGISTER)],
        ["expected an operator registered with torch.library.custom_op"],
    ),
    "fake_of_the_wrong_shape": (
        "silu_mul_operator", "make_silu_mul", [(FAKE, "return gate.new_empty((1,))")],
        ["[shape"],
    ),
    "int8_without_scale": (
        "int8_gemv", "int8_gemv_kernel", [(STORE, "acc.to(out_ptr.dtype.element_ty)")],
        ["wrong values"],
    ),
    "gqa_wrong_heads": (
        "gqa_decode", "gqa_decode",
        [("qg = q.float().view(B, Hkv, H // Hkv, hd)",
          "qg = q.float().view(B, H // Hkv, Hkv, hd).transpose(1, 2)")],
        ["wrong values"],
    ),
    "napkin_without_kv": (
        "decode_napkin", "decode_napkin", [("nbytes = weights + kv", "nbytes = weights")],
        ["expected"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    groups = (["silu_mul_operator"], ["int8_gemv", "gqa_decode", "decode_napkin"])
    return reports_by_group(tmp_path_factory, SOLUTION, CASES, groups, time_limit=180)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_bad_submission_fails_its_task_with_its_own_message(reports, name):
    task, _, _, fragments = CASES[name]
    assert_fails_with(reports[name][task], fragments)
