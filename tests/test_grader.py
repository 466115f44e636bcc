"""The grader against bad submissions: each defence catches its own case with its own message.

Every bad submission is Lab 1's solution with one graded cell changed. They are graded in a
few batches (one `python -m kernels grade` per batch, many notebooks at once), with a short
time limit, so the file stays within a couple of minutes on two cores.
"""

import json
import time
from pathlib import Path

import pytest
from bad_submissions import make_submission, run_grader

from kernels.grader import grade, lab01, lab03, runner
from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab01_regimes.ipynb"
TIME_LIMIT = "30" if ON_GPU else "10"  # the GPU pays for CUDA start-up and compiling first

LAUNCH = "poly_kernel[grid](x, coeffs, out, n, coeffs.numel(), BLOCK_SIZE=BLOCK_SIZE)"
STORE = "tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)"
LOAD = "x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)"
GRID = "grid = (triton.cdiv(n, BLOCK_SIZE),)"
END = "    return out\n    ### END SOLUTION"
IMPORTS = "import math"
DOC_END = '"""\n    ### BEGIN SOLUTION'
TORCH_MATH = "out.copy_((x.float() * 0.99 + 0.01).to(x.dtype))\n        "
NO_KERNEL = END + "\n\n\ndef poly(x, coeffs):\n    return x.clone()"
STORE_TO_X = STORE + "\n    " + STORE.replace("out_ptr +", "x_ptr +")
CACHE = ("BLOCK_SIZE = 1024", "BLOCK_SIZE = 1024\nseen = {}")
PREDICTED = DOC_END.replace("\n", "\n    from kernels.bench import predicted_ms\n", 1)
CACHED_RETURN = (
    "    return seen.setdefault((x.shape, x.dtype, coeffs.numel()), out)\n    ### END SOLUTION"
)
CONTIGUOUS = "    x = x.contiguous()  # flat indexing needs dense memory\n"

# name -> (the graded cell to change: a function's name or "import", [(old, new), ...])
KERNEL_CASES = {
    "torch_in_launcher": ("poly", [(LAUNCH, TORCH_MATH + LAUNCH)]),
    "no_kernel": ("poly", [(END, NO_KERNEL)]),
    "torch_in_kernel": ("poly", [(LOAD, LOAD + "\n    x = torch.clamp(x, -1e4, 1e4)")]),
    "unwritten": ("poly", [(GRID, "grid = (n // BLOCK_SIZE,)")]),
    "unwritten_new_empty": (
        "poly",
        [
            ("out = torch.empty_like(x)", "out = x.new_empty(x.shape)"),
            (GRID, "grid = (n // BLOCK_SIZE,)"),
        ],
    ),
    "modifies_input": ("poly", [(STORE, STORE_TO_X)]),
    "cached": ("poly", [CACHE, (END, CACHED_RETURN)]),
    "out_of_bounds": ("poly", [(LOAD, "x = tl.load(x_ptr + offsets * 100000000 + 100000000000)")]),
    "hang": ("poly", [(GRID, "while True:\n            pass")]),
    "exit": ("poly", [(GRID, "exit(0)")]),
    "exception": ("poly", [(GRID, GRID + "\n        raise ValueError('boom')")]),
    "flood": ("poly", [(GRID, "while True:\n            print('spam ' * 200)")]),
    "kernel_stub": ("poly", [(LOAD, "raise NotImplementedError('write the kernel')")]),
    "other_tensor": (
        "poly",
        [(END, "    return torch.empty_like(out)\n    ### END SOLUTION")],
    ),
    # wrong by at least 0.0075 for any x (0.01 * (x^2 + x + 1) at degree 3), so the first case
    # fails whatever the seed (a scale, 0.98 * x, is right where x is near 0)
    "wrong_values": ("poly", [("y = y * x + tl.load", "y = y * x + 0.01 + tl.load")]),
    # flat indexing of a strided view reads the wrong memory; a transposed view hid this
    "no_contiguous": ("poly", [(CONTIGUOUS, "")]),
}
LOAD_CASES = {
    "syntax_error": ("op_cost", [('if op == "add":', 'if op == "add"')]),
    "tamper": ("import", [(IMPORTS, IMPORTS + "\ntorch.allclose = lambda *args, **kwargs: True")]),
    "imports_os": ("import", [(IMPORTS, IMPORTS + "\nimport os")]),
    "private_api": ("import", [(IMPORTS, IMPORTS + "\ntorch._C._set_grad_enabled(True)")]),
    "load_hang": ("import", [(IMPORTS, IMPORTS + "\nwhile True:\n    pass")]),
    "load_exit": ("import", [(IMPORTS, IMPORTS + "\nexit(3)")]),
}
VALUE_CASES = {
    "wrong_formula": ("op_cost", [('3 * sizes["n"]', '2 * sizes["n"]')]),
    "calls_predicted_ms": ("roofline_ms", [(DOC_END, PREDICTED)]),
}  # fmt: skip


def submission(folder: Path, name: str, cell: str, edits) -> Path:
    marker = IMPORTS if cell == "import" else f"def {cell}("
    return make_submission(SOLUTION, folder, name, [(marker, old, new) for old, new in edits])


def batch(tmp_path_factory, cases, *options):
    folder = tmp_path_factory.mktemp("submissions")
    paths = {name: submission(folder, name, *spec) for name, spec in cases.items()}
    target = folder / "grades.json"
    out = run_grader(
        paths.values(), "--json", str(target), "--time-limit", TIME_LIMIT, "--jobs", "3", *options
    )
    assert out.returncode == 1, out.stdout + out.stderr
    reports = {Path(r["path"]).name.split("_lab01")[0]: r for r in json.loads(target.read_text())}
    assert set(reports) == set(cases)
    return reports, out.stdout


@pytest.fixture(scope="module")
def kernel_batch(tmp_path_factory):
    return batch(tmp_path_factory, KERNEL_CASES, "--task", "poly")


@pytest.fixture(scope="module")
def load_batch(tmp_path_factory):
    return batch(tmp_path_factory, LOAD_CASES)


@pytest.fixture(scope="module")
def value_batch(tmp_path_factory):
    return batch(tmp_path_factory, VALUE_CASES, "--task", "op_cost", "--task", "roofline_ms")


def runnable(tasks) -> list:
    """The tasks that run on this machine (the others are needs_gpu on a CPU)."""
    return [t for t in tasks if ON_GPU or not t.needs_gpu]


def task(reports, submission, name="poly"):
    (found,) = [t for t in reports[submission]["tasks"] if t["name"] == name]
    return found


EXPECTED = {
    "torch_in_launcher": ["computed with torch outside a kernel", "mul", "Hint:"],
    "no_kernel": ["launched no Triton kernel"],
    "torch_in_kernel": ["kernel poly_kernel uses torch", "cell 11, line"],
    "unwritten": ["never written", "NaN", "shape (1,)", "seed"],
    "unwritten_new_empty": ["never written", "NaN", "shape (1,)", "seed"],
    "modifies_input": ["modified its input 1", "shape (1,)"],
    "cached": ["a result cached across calls", "shape (4097,)"],
    # stopped by kernels.bounds; a child killed by a signal is tested in test_grader_parts
    "out_of_bounds": ["IndexError: tl.load ", "outside it). Mask it", "cell 11, line"],
    "hang": [f"did not finish within {TIME_LIMIT} s", "shape (1,)"],
    "exit": ["called exit()", "cell 11, line", "an exit is not a pass"],
    "exception": ["ValueError: boom", "cell 11, line", "raise ValueError('boom')", "shape (1,)"],
    "flood": ["printed more than 1 MB"],
    "kernel_stub": ["not implemented yet", "write the kernel", "cell 11, line"],
    "other_tensor": ["returned a tensor that was not given to any kernel launch"],
    "wrong_values": ["wrong values: max abs error", "shape (1,), float32", "seed", "Hint:"],
    "no_contiguous": ["wrong values", "shape (33, 65), non-contiguous, float32"],
}


# Compiled Triton reports these differently: an illegal address is a CUDA error, and a kernel
# that raises does not compile.
EXPECTED_ON_GPU = {
    "out_of_bounds": ["illegal memory access", "check your masks"],
    "kernel_stub": [],
}


@pytest.mark.parametrize("name", sorted(KERNEL_CASES))
def test_each_kernel_defence_fails_the_task_with_its_own_message(kernel_batch, name):
    reports, _ = kernel_batch
    found = task(reports, name)
    assert found["status"] == "failed" and found["points"] == 0, found
    expected = EXPECTED_ON_GPU.get(name, EXPECTED[name]) if ON_GPU else EXPECTED[name]
    for fragment in expected:
        assert fragment in found["message"], (fragment, found["message"])
    assert reports[name]["score"] == 0 and reports[name]["max_score"] == 4
    assert "grader error" not in found["message"]


def test_the_table_shows_one_line_per_failure(kernel_batch):
    _, stdout = kernel_batch
    assert stdout.count("poly  ") >= len(KERNEL_CASES)
    assert stdout.count("score 0/4") == len(KERNEL_CASES)


@pytest.mark.parametrize(
    "name, fragments",
    [
        ("syntax_error", ["syntax error at cell 4, line"]),
        ("tamper", ["changes torch.allclose", "may not modify torch"]),
        ("imports_os", ["imports os", "may import only"]),
        ("private_api", ["uses the private attribute", "public APIs"]),
        ("load_hang", [f"did not finish within {TIME_LIMIT} s", "while loading your graded cells"]),
        ("load_exit", ["called exit()", "while loading your graded cells"]),
    ],
)
def test_a_broken_load_fails_every_task(load_batch, name, fragments):
    reports, _ = load_batch
    report = reports[name]
    ran = [t for t in report["tasks"] if t["status"] != "needs_gpu"]
    here = runnable(lab01.TASKS)
    assert len(ran) == len(here) and report["score"] == 0
    assert report["max_score"] == sum(t.points for t in here)
    for found in ran:
        assert found["status"] == "failed", found
        for fragment in fragments:
            assert fragment in found["message"], (fragment, found["message"])


def test_a_wrong_formula_names_the_value_and_the_case(value_batch):
    reports, _ = value_batch
    found = task(reports, "wrong_formula", "op_cost")
    assert found["status"] == "failed"
    assert "bytes_moved" in found["message"] and "op_cost('add'" in found["message"]
    assert task(reports, "wrong_formula", "roofline_ms")["status"] == "passed"


def test_calling_the_courses_roofline_earns_nothing(value_batch):
    reports, _ = value_batch
    found = task(reports, "calls_predicted_ms", "roofline_ms")
    assert found["status"] == "failed" and "predicted_ms" in found["message"]
    assert task(reports, "calls_predicted_ms", "op_cost")["status"] == "passed"


def test_a_submission_that_hangs_while_loading_is_loaded_once_and_fails_every_task(tmp_path):
    """Lab 3's kernel tasks allow 180 s each; a hang at the top level of a graded cell is found
    by one child, within the load's own limit, and fails every task with that one message."""
    solution = ROOT / "solutions" / "lab03_matmul.ipynb"
    marker = "from kernels.runtime import DEVICE, ON_GPU"
    sleep = marker + "\nimport time\ntime.sleep(10**6)"  # a hang that costs no CPU
    path = make_submission(solution, tmp_path, "sleeps", [(marker, marker, sleep)])
    started = []

    def command(jobdir):
        started.append(Path(jobdir).name)
        return runner.child_command(jobdir)

    begun = time.monotonic()
    (report,), errors, _ = grade.grade([path], jobs=4, command=command)
    assert time.monotonic() - begun < 90 and errors == []
    assert len(started) == 1, started
    ran = [t for t in report["tasks"] if t["status"] != "needs_gpu"]
    assert len(ran) == len(runnable(lab03.TASKS)) and all(t["status"] == "failed" for t in ran), ran
    (message,) = {t["message"] for t in ran}
    assert f"did not finish within {grade.LOAD_LIMIT_S:g} s" in message
    assert "while loading your graded cells" in message
