"""The grader against bad submissions of Lab 1's persistent kernel (task 5): each fails the task
with a message that names its mistake. The defences every kernel task shares (torch in the
launcher, crashes, hangs, cached results) are tested on task 3 in test_grader.py.

Every bad submission is Lab 1's solution with a few lines of the cell that defines
`persistent_fma` and its kernel changed. They are graded in one batch (one `python -m kernels
grade`, restricted to the task), so the file stays within about half a minute on two cores.
"""

import math
from pathlib import Path

import pytest
from bad_submissions import assert_fails_with, grade_cases, in_function

from kernels.grader import lab01
from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab01_regimes.ipynb"
TIME_LIMIT = "120" if ON_GPU else "30"  # the GPU compiles each new specialisation first

LOOP = "for block in range(pid, n_blocks, programs):"
N_BLOCKS = "n_blocks = tl.cdiv(n_elements, BLOCK_SIZE)"
LAUNCH = "persistent_fma_kernel[(programs,)]("
FMA = "(x * scale + shift).to(out_ptr.dtype.element_ty)"
LOAD = "x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)"
STORE = "tl.store(out_ptr + offsets, " + FMA + ", mask=mask)"
OUT_ALLOC = "out = torch.empty_like(x)"
OWNER_STORE = "tl.store(owner_ptr + block, pid.to(tl.int32))"
RETURN = "    return out, owner\n    ### END SOLUTION"
OWNER_IN_TORCH = "    owner = torch.arange(owner.numel(), dtype=torch.int32) % programs\n" + RETURN

# name -> [(old, new), ...] in the graded cell that defines persistent_fma
CASES = {
    # every program runs from its first block to the end: right values, each block done again
    # by every later program
    "no_stride": [(LOOP, "for block in range(pid, n_blocks):")],
    # a stride one too long: every (programs + 1)-th block is nobody's
    "stride_plus_one": [(LOOP, "for block in range(pid, n_blocks, programs + 1):")],
    # Chapter 1's kernel on a grid of (programs,): one block each (block pid), then stop
    "one_block_each": [(LOOP, "for block in range(pid, n_blocks, n_blocks):")],
    # the loop, but one program per block as before: programs past `programs` redo blocks
    "grid_per_block": [(LAUNCH, "persistent_fma_kernel[(triton.cdiv(n, block_size),)](")],
    # no masks: the last block reads and writes past the end of the tensors
    "unmasked_tail": [
        (LOAD, LOAD.replace(", mask=mask)", ")")),
        (STORE, STORE.replace(", mask=mask)", ")")),
    ],
    # only the full blocks: the tail block, and any tensor smaller than a block, is skipped
    "tail_skipped": [(N_BLOCKS, "n_blocks = n_elements // BLOCK_SIZE")],
    "fp32_output": [(OUT_ALLOC, "out = torch.empty_like(x, dtype=torch.float32)")],
    "shift_first": [(FMA, FMA.replace("(x * scale + shift)", "((x + shift) * scale)"))],
    # the schedule written by torch in the launcher, not observed in the kernel
    "owner_in_torch": [(OWNER_STORE, "pass"), (RETURN, OWNER_IN_TORCH)],
}

EXPECTED = {
    "no_stride": [
        "owner[3] says program 2 handled block 3, expected program 0",
        "program p handles blocks p, p + 3, p + 6",
        "shape (1000,), float32, 3 programs, blocks of 128, seed",
    ],
    "stride_plus_one": [
        "elements of out were never written",
        "in block 3)",
        "shape (1000,), float32, 3 programs",
    ],
    "one_block_each": [
        "616 of 1000 elements of out were never written",
        "first at flat index 384, in block 3",
        "shape (1000,), float32, 3 programs",
    ],
    "grid_per_block": [
        "owner[3] says program 3 handled block 3, but only 3 programs were asked for",
        "shape (1000,), float32, 3 programs",
    ],
    # past the end of a tensor of one element: the interpreter stops the access (kernels.bounds)
    "unmasked_tail": [
        "IndexError: tl.load past the end of x_ptr: element 1, where it has 1 (127 of this",
        "Mask it",
        "`x = tl.load(x_ptr + offsets).to(tl.float32)`",
        "shape (1,), float32, 4 programs, blocks of 128",
    ],
    "tail_skipped": [
        "1 of 1 elements of out were never written",
        "shape (1,), float32, 4 programs, blocks of 128",
    ],
    "fp32_output": ["returned out as torch.float32, expected torch.float16", "float16"],
    "shift_first": ["wrong values of out", "shape (1,), float32", "Hint:"],
    "owner_in_torch": ["computed with torch outside a kernel", "arange"],
}


# On a GPU the programs run at once: which of two programs that handle one block stores its
# owner last is a race, and a few bytes past a tensor need not fault. The interpreter runs the
# programs in order, one after another, and the course stops its accesses past a tensor.
CPU_ONLY = {"no_stride", "grid_per_block", "unmasked_tail"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{bad submission: the persistent task's report}, from one grader run."""
    graded = {name: edits for name, edits in CASES.items() if not (ON_GPU and name in CPU_ONLY)}
    cases = {name: in_function("persistent_fma", edits) for name, edits in graded.items()}
    folder = tmp_path_factory.mktemp("persistent")
    found = grade_cases(SOLUTION, folder, cases, ["persistent"], time_limit=TIME_LIMIT)
    return {name: tasks["persistent"] for name, tasks in found.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_broken_persistent_kernel_fails_with_its_own_message(reports, name):
    if ON_GPU and name in CPU_ONLY:
        pytest.skip("checked under the interpreter, which runs the programs in order")
    assert_fails_with(reports[name], EXPECTED[name])


def test_the_cases_cover_what_a_grid_stride_loop_gets_wrong():
    """Sizes under one block, a last block with one element, more programs than blocks, one
    program, blocks that do not divide among the programs, and a non-contiguous 2-D input."""
    specs = [*lab01.PERSISTENT_SPECS, lab01.PERSISTENT_STRIDED]
    sizes = {spec: math.prod(spec[0]) for spec in specs}
    blocks = {spec: -(-sizes[spec] // spec[2]) for spec in specs}
    assert any(sizes[s] < s[2] for s in specs)
    assert any(sizes[s] % s[2] == 1 for s in specs)
    assert any(s[1] > blocks[s] for s in specs) and any(s[1] == 1 for s in specs)
    assert any(blocks[s] > s[1] and blocks[s] % s[1] for s in specs)
    assert len(lab01.PERSISTENT_STRIDED[0]) == 2
