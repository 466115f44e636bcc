"""Lab 4's own defences: bad submissions that compute attention with torch, launch no kernel,
or align the causal mask to the top-left, or break the window's guard or dV's mask, each fail
with their own message.

Every bad submission is Lab 4's solution with one graded cell changed, graded in two batches
with a short time limit, only the tasks each one is about.
"""

from pathlib import Path

import pytest
from bad_submissions import grade_cases, in_function

from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab04_attention.ipynb"
TIME_LIMIT = "60" if ON_GPU else "30"

RETURN = "    return o\n    ### END SOLUTION"
GRID = "grid = (triton.cdiv(Sq, BLOCK_M), H, B)"
SDPA = "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)"
SCORES = "scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(D)  # (B, H, Sq, Sk)"

# name -> (the graded cell to change, by a function it defines, [(old, new), ...])
KERNEL_CASES = {
    "sdpa": ("attention", [(RETURN, f"    return {SDPA}\n    ### END SOLUTION")]),
    "torch_scores": ("attention", [(GRID, f"{SCORES}\n    {GRID}")]),
    "no_kernel": ("attention", [("attention_kernel[grid](", "(lambda *args, **kwargs: None)(")]),
}
MASK_CASES = {
    "top_left_causal": ("attention", [("shift = SEQ_K - SEQ_Q", "shift = 0")]),
    "no_rescale": ("online_softmax_update", [("acc * alpha[:, None] + p", "acc + p")]),
}


def batch(tmp_path_factory, cases, *tasks):
    cases = {name: in_function(*spec) for name, spec in cases.items()}
    folder = tmp_path_factory.mktemp("submissions")
    return grade_cases(SOLUTION, folder, cases, tasks, time_limit=TIME_LIMIT)


@pytest.fixture(scope="module")
def kernel_batch(tmp_path_factory):
    return batch(tmp_path_factory, KERNEL_CASES, "attention")


@pytest.fixture(scope="module")
def mask_batch(tmp_path_factory):
    return batch(tmp_path_factory, MASK_CASES, "attention", "online_softmax_update")


# the extensions: the window's guard, dV's normaliser and its causal mask
GUARD = 'm_safe = tl.where(m_new == float("-inf"), 0.0, m_new)'
P_T = "p_t = tl.where(keep, tl.exp(s_t - lse[None, :]), 0.0)"
DV_CAUSAL = "keep = keep & (offs_n[:, None] <= rows[None, :] + shift)"
EXTENSION_CASES = {
    "window_no_guard": ("attention", [(GUARD, "m_safe = m_new")]),
    "dv_without_lse": ("attention_dv", [(P_T, P_T.replace(" - lse[None, :]", ""))]),
    "dv_not_causal": ("attention_dv", [(DV_CAUSAL, "keep = keep")]),
}


@pytest.fixture(scope="module")
def extension_batch(tmp_path_factory):
    return batch(tmp_path_factory, EXTENSION_CASES, "attention_window", "attention_dv")


@pytest.mark.parametrize(
    "name, task, fragments",
    [
        ("window_no_guard", "attention_window", ["non-finite", "window 5", "-inf"]),
        ("dv_without_lse", "attention_dv", ["wrong values", "dO of q's shape"]),
        ("dv_not_causal", "attention_dv", ["wrong values", "causal=True"]),
    ],
)
def test_each_broken_extension_fails_its_task(extension_batch, name, task, fragments):
    found = extension_batch[name][task]
    assert found["status"] == "failed" and found["points"] == 0, found
    for fragment in fragments:
        assert fragment in found["message"], (fragment, found["message"])
    other = "attention_dv" if task == "attention_window" else "attention_window"
    assert extension_batch[name][other]["status"] == "passed", extension_batch[name]


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("sdpa", ["called torch's scaled_dot_product_attention", "the op this task asks"]),
        ("torch_scores", ["called torch's matmul", "q (1, 1, 1, 16)", "float32"]),
        ("no_kernel", ["launched no Triton kernel"]),
    ],
)
def test_attention_computed_outside_a_kernel_earns_nothing(kernel_batch, name, fragments):
    found = kernel_batch[name]["attention"]
    assert found["status"] == "failed" and found["points"] == 0, found
    for fragment in fragments:
        assert fragment in found["message"], (fragment, found["message"])


def test_a_causal_mask_aligned_to_the_top_left_fails_when_sq_is_below_sk(mask_batch):
    found = mask_batch["top_left_causal"]["attention"]
    assert found["status"] == "failed" and found["points"] == 0, found
    for fragment in ("wrong values", "q (1, 2, 5, 32), k and v (1, 2, 33, 32)", "causal=True"):
        assert fragment in found["message"], (fragment, found["message"])
    assert "j <= i + Sk - Sq" in found["message"]
    assert mask_batch["top_left_causal"]["online_softmax_update"]["status"] == "passed"


def test_an_update_that_does_not_rescale_the_accumulator_fails(mask_batch):
    found = mask_batch["no_rescale"]["online_softmax_update"]
    assert found["status"] == "failed" and "wrong acc_new" in found["message"], found
    assert mask_batch["no_rescale"]["attention"]["status"] == "passed"


# A window applied as a mask alone: right values, but the loop still walks every key from 0.
LOOP_START = "lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N"
MASK_ONLY = {"window_mask_only": ("attention", [(LOOP_START, "lo = 0 * start_m")])}


@pytest.mark.gpu
def test_a_window_that_only_masks_is_right_but_too_slow(tmp_path_factory):
    found = batch(tmp_path_factory, MASK_ONLY, "attention_window", "attention_window_gpu")
    found = found["window_mask_only"]
    assert found["attention_window"]["status"] == "passed", found
    slow = found["attention_window_gpu"]
    assert slow["status"] == "failed" and "timed" in slow["message"], slow
    assert "causal scaled_dot_product_attention" in slow["message"], slow
