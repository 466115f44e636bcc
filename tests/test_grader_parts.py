"""The grader's parts on their own: the submission reader, static checks, the child runner,
the verdicts, the case kit, the op log, and the starter generator. Fast: the only child
processes are tiny scripts."""

import importlib.util
import json
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.grader import runner, starters, static_checks, submission
from kernels.grader.child import Observer, learners, op_name
from kernels.grader.tasks import Case, Task, evaluate
from kernels.runtime import DEVICE


def read(source: str, tmp_path, tags=("graded",)) -> submission.Submission:
    nb = {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# Lab"},
            {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": source},
            {"cell_type": "code", "metadata": {}, "source": "print('not graded')"},
        ],
        "metadata": {"lab": "lab01_regimes"},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / "lab01_regimes.ipynb"
    path.write_text(json.dumps(nb))
    return submission.load(path, {"lab01_regimes": []})


def analyse(source, tmp_path):
    return static_checks.analyse(read(source, tmp_path))


HEADER = "import math\nimport torch\nimport triton\nimport triton.language as tl\n"


def test_only_graded_cells_are_loaded_and_lines_map_back(tmp_path):
    sub = read("x = 1\n%timeit x\ny = 2", tmp_path)
    assert "not graded" not in sub.source
    assert "pass  # notebook magic" in sub.source
    assert sub.where(3) == "cell 2, line 3: `y = 2`"


def test_a_notebook_without_graded_cells_is_still_a_lab(tmp_path):
    sub = read("x = 1", tmp_path, tags=())
    assert sub.source.strip() == ""


def test_files_that_are_not_labs_are_refused(tmp_path):
    with pytest.raises(submission.NotALab, match="no such file"):
        submission.load(tmp_path / "missing.ipynb", {"lab01_regimes": []})
    (tmp_path / "notes.ipynb").write_text("not json")
    with pytest.raises(submission.NotALab, match="not a Jupyter notebook"):
        submission.load(tmp_path / "notes.ipynb", {"lab01_regimes": []})
    (tmp_path / "other.ipynb").write_text(json.dumps({"cells": [], "metadata": {}}))
    with pytest.raises(submission.NotALab, match="not one of the course's labs"):
        submission.load(tmp_path / "other.ipynb", {"lab01_regimes": []})


def test_the_lab_is_found_from_the_file_name_when_metadata_is_missing(tmp_path):
    path = tmp_path / "alice_lab01.ipynb"
    path.write_text(json.dumps({"cells": [], "metadata": {}}))
    assert submission.load(path, {"lab01_regimes": []}).lab == "lab01_regimes"


def test_a_clean_kernel_passes_the_static_checks(tmp_path):
    found = analyse(
        HEADER
        + textwrap.dedent("""
        SCALE = tl.constexpr(2.0)

        @triton.jit
        def scaled(x):
            return x * SCALE

        @triton.jit
        def kernel(x_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            y = tl.load(x_ptr + offsets, mask=offsets < n)
            for _ in range(3):
                y = scaled(y) + math.pi
            tl.store(x_ptr + offsets, y, mask=offsets < n)
        """),
        tmp_path,
    )
    assert found.problems == [] and found.kernel_problems == []
    assert {"kernel", "scaled", "SCALE"} <= found.defined


@pytest.mark.parametrize(
    "body, message",
    [
        ("y = torch.sin(x_ptr)", "uses torch"),
        ("y = np.sin(x_ptr)", "uses np (numpy)"),
        ("y = BLOCK_SIZE", "uses BLOCK_SIZE, neither a @triton.jit function nor a tl.constexpr"),
        ("y = plain(x_ptr)", "uses plain, neither"),
    ],
)
def test_a_kernel_body_may_use_only_triton(tmp_path, body, message):
    found = analyse(
        HEADER
        + textwrap.dedent(f"""
        import numpy as np
        BLOCK_SIZE = 128

        def plain(x):
            return x

        @triton.jit
        def kernel(x_ptr):
            {body}
        """),
        tmp_path,
    )
    assert any(message in p and "kernel kernel" in p for p in found.kernel_problems), found


@pytest.mark.parametrize(
    "line, message",
    [
        ("import os", "imports os"),
        ("from kernels.grader import child", "imports kernels.grader.child"),
        ("import torch._dynamo", "private or * import"),
        ("torch.matmul = print", "changes torch.matmul"),
        ("kernels.check.TOLERANCES[0] = 1", "changes kernels.check.TOLERANCES[0]"),
        ("f = getattr(torch, 'matmul')", "uses getattr"),
        ("exec('x = 1')", "uses exec"),
        ("x = torch.os", "reaches os"),
        ("x = __builtins__", "uses __builtins__"),
        ("x = torch.tensor(1).__class__", "private attribute __class__"),
        ("a, torch.nn.functional.gelu = 1, print", "changes torch.nn.functional.gelu"),
    ],
)
def test_tampering_is_refused(tmp_path, line, message):
    found = analyse(HEADER + "import kernels\n" + line, tmp_path)
    assert any(message in p for p in found.problems), found.problems


def test_ordinary_code_is_not_mistaken_for_tampering(tmp_path):
    found = analyse(
        "from __future__ import annotations\n"
        + HEADER
        + "x = torch.zeros(4)\nx[torch.arange(2)] = 1.0\nx += torch.ones(4)\n"
        + "y, z = x.shape[0], math.pi\nif __name__ == '__main__':\n    print(y)\n",
        tmp_path,
    )
    assert found.problems == []


def test_stubs_and_their_hints_are_found(tmp_path):
    found = analyse(
        textwrap.dedent('''
        def todo(x):
            """Docstring."""
            raise NotImplementedError("write it")

        def bare():
            raise NotImplementedError

        def done(x):
            return x
        '''),
        tmp_path,
    )
    assert found.stubs == {"todo": "write it", "bare": ""}


def test_syntax_errors_point_at_the_cell(tmp_path):
    found = analyse("def f(:\n    pass", tmp_path)
    assert found.problems and found.problems[0].startswith("syntax error at cell 2, line 1")


def script(tmp_path, body: str) -> list:
    return [sys.executable, "-c", f"open('progress', 'w').write('start\\n')\n{body}"]


def test_an_exit_status_of_zero_without_a_result_is_a_failure(tmp_path):
    run = runner.run_child(script(tmp_path, "print('all tests passed')"), tmp_path, 10)
    assert run.result is None and "exited with status 0" in run.failure
    assert "all tests passed" in run.output


def test_a_result_that_is_not_plain_data_is_not_read(tmp_path):
    body = (
        "import torch\n"
        "class Payload:\n"
        "    pass\n"
        "torch.save(Payload(), 'result.pt')"  # pickled code: weights_only refuses it
    )
    run = runner.run_child(script(tmp_path, body), tmp_path, 60)
    assert run.result is None and "cannot read" in run.failure


def test_a_hang_is_killed_with_what_it_started(tmp_path):
    body = (
        "import subprocess, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        "open('grandchild', 'w').write(str(p.pid))\n"
        "time.sleep(300)"
    )
    begun = time.monotonic()
    run = runner.run_child(script(tmp_path, body), tmp_path, 1.5)
    assert "did not finish within 1.5 s" in run.failure and time.monotonic() - begun < 30
    grandchild = Path("/proc") / (tmp_path / "grandchild").read_text() / "stat"
    time.sleep(0.2)
    if grandchild.exists():  # killed with its session: gone, or a zombie nobody reaped yet
        assert grandchild.read_text().split(")")[-1].split()[0] in ("Z", "X")


def test_a_child_that_never_starts_is_stopped(tmp_path):
    command = [sys.executable, "-c", "import time; time.sleep(300)"]
    run = runner.run_child(command, tmp_path, 60, startup_limit=1)
    assert "did not start within 1 s" in run.failure


def test_a_crash_names_its_signal(tmp_path):
    body = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
    run = runner.run_child(script(tmp_path, body), tmp_path, 10)
    assert "crashed (signal SIGSEGV" in run.failure
    assert signal.SIGSEGV  # the name comes from the signal module


def test_a_child_killed_from_outside_is_asked_about_memory(tmp_path):
    body = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    run = runner.run_child(script(tmp_path, body), tmp_path, 10)
    assert "crashed (signal SIGKILL; out of memory?)" in run.failure


def _run(report: dict) -> runner.ChildRun:
    return runner.ChildRun({"cases": [report], "error": None}, None, "done", "")


def _matmul_task(**flags) -> Task:
    return Task("mm", "mm", 3, "", "hint", cases=lambda rng: [], check=lambda c, o: None, **flags)


def test_calling_the_op_the_task_asks_for_earns_nothing():
    case = Case((torch.ones(2, 2), torch.ones(2, 2)), "shape (2, 2)", expected=torch.ones(2, 2))
    report = {
        "output": torch.ones(2, 2),
        "inputs_after": list(case.args),
        "launches": 1,
        "ops": ["empty", "matmul"],
        "from_kernel": True,
        "device": DEVICE.type,  # a result on another device fails for that reason instead
    }
    outcome = evaluate(_matmul_task(forbidden_ops=frozenset({"matmul"})), [case], _run(report), str)
    assert outcome.status == "failed" and outcome.points == 0
    assert "called torch's matmul, the op this task asks you to write" in outcome.message
    assert evaluate(_matmul_task(), [case], _run(report), str).status == "passed"


def test_a_missing_or_short_result_is_never_a_pass():
    case = Case((1,), "one", expected=[1])
    task = _matmul_task()
    assert evaluate(task, [case], runner.ChildRun({}, None, "done", ""), str).status == "failed"
    empty = runner.ChildRun({"cases": [], "error": None}, None, "done", "")
    assert "0 of 1 cases" in evaluate(task, [case], empty, str).message


def test_the_op_log_names_the_ops_a_task_forbids():
    observer = Observer()
    x = torch.randn(4, 4)
    with observer.recording():
        torch.matmul(x, x)
        _ = x @ x
        F.softmax(x, dim=-1)
        F.scaled_dot_product_attention(x[None], x[None], x[None])
        _ = x.shape
    assert {"matmul", "softmax", "scaled_dot_product_attention", "shape"} <= observer.ops
    assert op_name(torch.Tensor.add) == "add"


def test_only_kernels_defined_in_the_graded_cells_are_the_learners(tmp_path):
    from kernels.matmul import matmul_kernel

    # the child imports the graded cells from a file, as the module "submission" (a file:
    # outside the interpreter, triton.jit reads the kernel's source)
    path = tmp_path / "graded.py"
    path.write_text("import triton\n\n\n@triton.jit\ndef kernel(x_ptr):\n    pass\n")
    spec = importlib.util.spec_from_file_location("submission", path)
    graded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graded)
    assert learners(graded.kernel) and not learners(matmul_kernel)


def test_solution_blocks_become_stubs_with_their_hints():
    source = textwrap.dedent(
        """
        def f(x):
            '''Doc.'''
            ### BEGIN SOLUTION
            ### HINT: add one
            return x + 1
            ### END SOLUTION

        def g():
            ### BEGIN SOLUTION
            return "quote \\" inside"
            ### END SOLUTION
        """
    )
    stub = starters.strip_solutions(source)
    assert "x + 1" not in stub and "BEGIN" not in stub
    assert '    raise NotImplementedError("add one")' in stub
    assert f'    raise NotImplementedError("{starters.DEFAULT_HINT}")' in stub
    compile(stub, "stub", "exec")


KERNEL_STUBS = textwrap.dedent(
    """\
    import triton
    import triton.language as tl


    @triton.jit
    def whole_kernel(
        x_ptr, BLOCK: tl.constexpr,
    ):
        \"\"\"A docstring,
        on two lines.\"\"\"
        ### BEGIN SOLUTION
        ### HINT: load, add one, store
        tl.store(x_ptr, tl.load(x_ptr) + 1)
        ### END SOLUTION


    @triton.jit
    def partial_kernel(x_ptr, BIAS: tl.constexpr):
        x = tl.load(x_ptr)
        if BIAS:
            ### BEGIN SOLUTION
            ### HINT: add the bias
            x = x + 1
            ### END SOLUTION
        tl.store(x_ptr, x * 2)


    def launcher(x):
        ### BEGIN SOLUTION
        whole_kernel[(1,)](x, BLOCK=1)
        ### END SOLUTION
    """
)


def test_a_kernels_blocks_become_static_assertions_that_say_the_hint(tmp_path, monkeypatch):
    """Triton's compiler rejects `raise` in a kernel: a stubbed kernel fails with its hint when
    compiled or interpreted, and only on a branch that runs."""
    stub = starters.strip_solutions(KERNEL_STUBS)
    assert '    tl.static_assert(False, "load, add one, store")' in stub
    assert '        tl.static_assert(False, "add the bias")' in stub
    assert stub.count("raise NotImplementedError") == 1  # the launcher's
    assert "tl.load(x_ptr) + 1" not in stub and "x = x + 1" not in stub
    (tmp_path / "stubbed_kernels.py").write_text(stub)  # a file: Triton's compiler reads it
    monkeypatch.syspath_prepend(tmp_path)
    found = vars(importlib.import_module("stubbed_kernels"))
    x = torch.ones(1, device=DEVICE)
    found["partial_kernel"][(1,)](x, BIAS=False)  # the block's branch is not taken
    assert x.item() == 2.0
    for kernel, hint in (("partial_kernel", "add the bias"), ("whole_kernel", "load, add one")):
        with pytest.raises(Exception, match=hint):
            found[kernel][(1,)](
                x, **({"BIAS": True} if kernel == "partial_kernel" else {"BLOCK": 1})
            )
    with pytest.raises(NotImplementedError, match="your code here"):
        found["launcher"](x)


@pytest.mark.parametrize(
    "source", ["### BEGIN SOLUTION\nx = 1", "x = 1\n### END SOLUTION", "### BEGIN SOLUTION\n" * 2]
)
def test_unbalanced_solution_markers_are_an_error(source):
    with pytest.raises(ValueError, match="SOLUTION"):
        starters.strip_solutions(source)
