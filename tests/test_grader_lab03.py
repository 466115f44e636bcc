"""The grader against bad submissions of Lab 3, the matmul: each fails the task it breaks, with
a message that says why, and leaves the others alone.

Every bad submission is Lab 3's solution with a few lines changed. They are graded in three
batches (one `python -m kernels grade` each, restricted to the tasks they break), with a short
time limit, so the file stays within about a minute and a half on two cores.
"""

from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, grade_cases

from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab03_matmul.ipynb"
TIME_LIMIT = "120" if ON_GPU else "30"  # the GPU compiles each new specialisation first

RETURN = "    return c\n    ### END SOLUTION"
LAUNCH = "tiled_matmul_kernel[grid]("
LOOP = "for k0 in range(0, K, BLOCK_K):"
LOAD_A = "a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)"
LOAD_B = "b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)"
STORE_MASK = "mask=(rows[:, None] < M) & (cols[None, :] < N)"
BIAS = "acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]"
BIAS_BY_ROWS = "acc += tl.load(bias_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]"
IMPORTS = "from kernels.runtime import DEVICE, ON_GPU"
SWIGLU = "y = g * tl.sigmoid(g) * u"
SWIGLU_STORE = "y.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok)"
EXTRA_SIGMOID = SWIGLU_STORE.replace("y.to(", "tl.sigmoid(y).to(")
GROUPED = "return first_m + in_band % band_height, in_band // band_height"
SUM_LOOP = "for s in range(0, SPLITS):  # split 0 first"
SUM_LOAD = "acc += tl.load(partials_ptr + s * MN + offsets, mask=mask, other=0.0)"
SUM_LAUNCH = (
    "split_k_sum_kernel[(triton.cdiv(M * N, sum_block),)](partials, c, M * N, splits, "
    "BLOCK=sum_block)"
)
SPLIT_GRID = 'grid = (triton.cdiv(M, tiles["BLOCK_M"]), triton.cdiv(N, tiles["BLOCK_N"]), splits)'
C_ALLOC = "c = torch.empty((M, N), dtype=a.dtype, device=a.device)"
SLICE_END_A, SLICE_END_B = "mask=row_ok & (kk[None, :] < hi)", "mask=(kk[:, None] < hi) & col_ok"

# name -> [(the graded cell to change: a function it defines, or "import"), old, new), ...]
KERNEL_CASES = {
    "uses_at": [("tiled_matmul", RETURN, "    return a @ b\n    ### END SOLUTION")],
    # written for K a multiple of BLOCK_K: no masks, and the last partial block never loaded
    "no_k_mask": [
        ("tiled_matmul", LOOP, "for k0 in range(0, K // BLOCK_K * BLOCK_K, BLOCK_K):"),
        ("tiled_matmul", LOAD_A, "a = tl.load(a_ptrs)"),
        ("tiled_matmul", LOAD_B, "b = tl.load(b_ptrs)"),
    ],
    "empty_output": [
        ("tiled_matmul", RETURN, "    return torch.empty_like(c)\n    ### END SOLUTION")
    ],
    "store_off_by_one": [("tiled_matmul", STORE_MASK, STORE_MASK.replace("< M", "< M - 1"))],
    # the course's own kernel, launched from the graded cells
    "course_kernel": [
        ("import", IMPORTS, IMPORTS + "\nfrom kernels.matmul import matmul_kernel"),
        ("tiled_matmul", LAUNCH, "matmul_kernel[grid]("),
        ("tiled_matmul", "RELU=relu", 'ACTIVATION="relu" if relu else "none"'),
    ],
    "calls_kernels_matmul": [
        ("tiled_matmul", RETURN, "    return kernels.matmul.matmul(a, b)\n    ### END SOLUTION")
    ],
}
EPILOGUE_CASES = {
    "bias_by_rows": [("tiled_matmul", BIAS, BIAS_BY_ROWS)],
    "epilogue_stub": [("tiled_matmul", BIAS, "raise NotImplementedError('add the bias')")],
    "row_major_order": [("grouped_tile", GROUPED, "return pid // tiles_n, pid % tiles_n")],
    # the activation on the wrong product: silu(x @ w_up) * (x @ w_gate)
    "swiglu_swapped": [("swiglu", SWIGLU, "y = u * tl.sigmoid(u) * g")],
    # one activation too many: sigmoid(silu(g) * u)
    "swiglu_extra_sigmoid": [("swiglu", SWIGLU_STORE, EXTRA_SIGMOID)],
}  # fmt: skip

# Split-K: every edit is in the cell that defines split_k_matmul and both its kernels.
SPLIT_K_CASES = {
    "sum_drops_last_split": [
        ("split_k_matmul", SUM_LOOP, SUM_LOOP.replace("SPLITS)", "SPLITS - 1)"))
    ],
    # as accurate, in another order: split SPLITS - 1 first
    "sum_in_reverse": [
        ("split_k_matmul", SUM_LOAD, SUM_LOAD.replace("s * MN", "(SPLITS - 1 - s) * MN"))
    ],
    # the loads masked to K only: a split also sums the next split's first elements
    "slice_end_unmasked": [
        ("split_k_matmul", SLICE_END_A, SLICE_END_A.replace("< hi", "< K")),
        ("split_k_matmul", SLICE_END_B, SLICE_END_B.replace("< hi", "< K")),
    ],
    # an atomic read-modify-write in the sum: the same values on the interpreter, which runs
    # programs in order; refused for what it does on a GPU
    "atomic_sum": [
        ("split_k_matmul", SUM_LOAD,
         "acc += tl.atomic_add(partials_ptr + s * MN + offsets, 0.0, mask=mask)"),
    ],
    "fp32_output": [("split_k_matmul", C_ALLOC, C_ALLOC.replace("a.dtype", "torch.float32"))],
    "sum_in_torch": [("split_k_matmul", SUM_LAUNCH, "c = partials.sum(dim=0).to(a.dtype)")],
    # programs only for the splits that hold some k: the empty ones keep the NaN of new memory
    "empty_splits_unwritten": [
        ("split_k_matmul", SPLIT_GRID,
         SPLIT_GRID.replace(", splits)", ", triton.cdiv(K, triton.cdiv(K, splits)))")),
    ],
}  # fmt: skip


def markers(edits):
    """(cell, old, new) edits, "import" naming the imports cell, as make_submission's markers."""
    return [(IMPORTS if cell == "import" else f"def {cell}(", old, new) for cell, old, new in edits]


def batch(tmp_path_factory, cases, *tasks):
    cases = {name: markers(edits) for name, edits in cases.items()}
    folder = tmp_path_factory.mktemp("submissions")
    return grade_cases(SOLUTION, folder, cases, tasks, time_limit=TIME_LIMIT)


@pytest.fixture(scope="module")
def kernel_batch(tmp_path_factory):
    return batch(tmp_path_factory, KERNEL_CASES, "tiled_matmul")


@pytest.fixture(scope="module")
def epilogue_batch(tmp_path_factory):
    return batch(tmp_path_factory, EPILOGUE_CASES, "tiled_matmul", "grouped_order", "swiglu")


@pytest.fixture(scope="module")
def split_k_batch(tmp_path_factory):
    return batch(tmp_path_factory, SPLIT_K_CASES, "split_k")


KERNEL_EXPECTED = {
    "uses_at": ["called torch's matmul, the op this task asks you to write"],
    "no_k_mask": ["wrong values", "a (1, 1) @ b (1, 1), float32, seed"],
    "empty_output": ["returned a tensor that was not given to any kernel launch"],
    "store_off_by_one": ["never written", "NaN", "a (1, 1) @ b (1, 1), float32"],
    "course_kernel": ["launched no Triton kernel of your own"],
    "calls_kernels_matmul": ["uses matmul at cell", "asks you to write yourself"],
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_each_broken_matmul_fails_with_its_own_message(kernel_batch, name):
    assert_fails_with(kernel_batch[name]["tiled_matmul"], KERNEL_EXPECTED[name])


def test_a_bias_on_the_wrong_axis_fails_the_epilogue_only(epilogue_batch):
    found = epilogue_batch["bias_by_rows"]
    assert found["tiled_matmul"]["status"] == "failed", found
    message = found["tiled_matmul"]["message"]
    if ON_GPU:  # the first case, 3 rows and 5 columns: wrong values, every load inside the bias
        assert "wrong values" in message
        assert "a (3, 7) @ b (7, 5) + bias, then ReLU, float32" in message
    else:  # the interpreter stops the first case with more rows than the bias has elements
        assert (
            "IndexError: tl.load past the end of bias_ptr: element 31, where it has 31" in message
        )
        assert "a (33, 97) @ b (97, 31) + bias, then ReLU, float32" in message
    assert found["swiglu"]["status"] == "passed", found
    assert found["grouped_order"]["status"] == "passed", found


def test_an_unwritten_epilogue_is_not_implemented_yet(epilogue_batch):
    found = epilogue_batch["epilogue_stub"]["tiled_matmul"]
    assert found["status"] == "failed" and found["points"] == 0, found
    if not ON_GPU:  # compiled Triton refuses a kernel that raises, with its own message
        assert found["message"].startswith("not implemented yet: add the bias"), found


def test_row_major_order_fails_the_grouped_order_and_nothing_else(epilogue_batch):
    found = epilogue_batch["row_major_order"]
    message = found["grouped_order"]["message"]
    assert found["grouped_order"]["status"] == "failed", found
    assert "program 1 computed tile (0, 1), expected (1, 0)" in message, message
    assert "tile_order(6, 8, 3)" in message
    assert found["tiled_matmul"]["status"] == "passed", found  # any order computes the same c
    assert found["swiglu"]["status"] == "passed", found


@pytest.mark.parametrize("name", ["swiglu_swapped", "swiglu_extra_sigmoid"])
def test_a_wrong_swiglu_fails_it_and_nothing_else(epilogue_batch, name):
    found = epilogue_batch[name]
    assert found["swiglu"]["status"] == "failed" and found["swiglu"]["points"] == 0, found
    assert "wrong values" in found["swiglu"]["message"], found
    assert "w_gate and w_up" in found["swiglu"]["message"], found
    assert found["tiled_matmul"]["status"] == "passed", found


SPLIT_K_EXPECTED = {
    "sum_drops_last_split": ["wrong values of c", "a (1, 1) @ b (1, 1) in 1 split, float32"],
    "sum_in_reverse": [
        "c is not its partials summed in order",
        "a (33, 97) @ b (97, 31) in 3 splits, float32",
    ],
    "slice_end_unmasked": [
        "wrong partial 0 (k in [0, 33))",
        "a (33, 97) @ b (97, 31) in 3 splits, float32",
    ],
    "atomic_sum": ["uses atomic_add at", "in the order the programs finish"],
    "fp32_output": ["returned c as torch.float32, expected torch.float16"],
    "sum_in_torch": ["computed with torch outside a kernel", "sum"],
    "empty_splits_unwritten": [
        "wrong partial 3 (no k: an empty split, all zeros)",
        "non-finite",
        "a (5, 3) @ b (3, 7) in 8 splits, float32",
    ],
}


@pytest.mark.parametrize("name", sorted(SPLIT_K_CASES))
def test_each_broken_split_k_fails_with_its_own_message(split_k_batch, name):
    assert_fails_with(split_k_batch[name]["split_k"], SPLIT_K_EXPECTED[name])
