"""The labs: starters in sync with the solutions, the notebooks state their tasks, the
solutions earn full marks, the starters earn nothing, and the commands around them work."""

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from kernels.grader import starters, static_checks, submission
from kernels.grader.cli import grading_command
from kernels.grader.labs import LABS
from kernels.notebook import check_recorded
from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
IDS = [p.stem for p in SOLUTIONS]


def kernels_cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "kernels", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
    )


def committed(path: Path) -> str | None:
    """The file as the last commit has it, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "show", f"HEAD:{path.relative_to(ROOT).as_posix()}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
    except OSError:
        return None
    return out.stdout if out.returncode == 0 else None


def sync_problem(expected: str, working: str | None, at_head: str | None) -> str | None:
    """The starter must match what its solution generates, in the working tree (a developer who
    just ran `make labs`) or in the last commit (a learner who fills in labs/ in place)."""
    if expected in (working, at_head):
        return None
    if working is None and at_head is None:
        return "missing: run `make labs`"
    return "out of date with its solution: run `make labs` and commit labs/"


def test_every_lab_has_a_solution_and_every_solution_a_lab():
    assert {p.stem for p in SOLUTIONS} == set(LABS)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_starters_match_their_solutions(solution):
    lab = ROOT / "labs" / solution.name
    working = lab.read_text() if lab.exists() else None
    problem = sync_problem(starters.render(solution), working, committed(lab))
    assert problem is None, f"labs/{solution.name}: {problem}"


def test_the_sync_rule_lets_learners_edit_their_labs():
    assert sync_problem("gen", "gen", None) is None  # regenerated, not yet committed
    assert sync_problem("gen", "learner's work", "gen") is None  # filled in place
    assert sync_problem("gen", "old", "old") is not None  # solution changed, labs not
    assert sync_problem("gen", None, None) == "missing: run `make labs`"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_solutions_keep_their_recorded_outputs(solution):
    assert check_recorded(solution) is None


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_a_lab_states_each_task_and_its_points(solution):
    nb = nbformat.read(solution, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert grading_command("labs/" + solution.name) in text  # the one command, as printed
    for task in LABS[solution.stem]:
        row = re.search(rf"^\| \d+ `{task.name}` \|.*$", text, re.MULTILINE)
        assert row, f"no row for task {task.name} in the lab's table"
        assert row.group(0).split("|")[3].strip() == str(task.points), row.group(0)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_graded_cells_define_every_task_cleanly(solution):
    found = static_checks.analyse(submission.load(solution, LABS))
    assert found.problems == [] and found.kernel_problems == []
    assert {task.function for task in LABS[solution.stem]} <= found.defined
    assert not found.stubs


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_starters_have_stubs_and_no_outputs(solution, tmp_path):
    text = starters.render(solution)
    nb = nbformat.reads(text, as_version=4)
    assert "recorded" not in nb.metadata and nb.metadata["lab"] == solution.stem
    for cell in nb.cells:
        assert starters.BEGIN not in cell.source and starters.END not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    path = tmp_path / solution.name
    path.write_text(text)
    found = static_checks.analyse(submission.load(path, LABS))
    assert {task.function for task in LABS[solution.stem]} <= set(found.stubs)


def test_solutions_get_full_marks(tmp_path):
    out = kernels_cli("grade", *SOLUTIONS, "--json", tmp_path / "grades.json")
    assert out.returncode == 0, out.stdout + out.stderr
    reports = json.loads((tmp_path / "grades.json").read_text())
    assert [Path(r["path"]).name for r in reports] == [p.name for p in SOLUTIONS]
    for r in reports:
        assert r["score"] == r["max_score"] > 0, r
        assert set(r) == {"path", "lab", "score", "max_score", "tasks"}
        for task in r["tasks"]:
            assert set(task) == {"name", "points", "max_points", "status", "message"}
            # on a GPU every task runs but those for more GPUs than this machine has
            wanted = next(t.gpus for t in LABS[r["lab"]] if t.name == task["name"])
            runs_here = ON_GPU and wanted <= torch.cuda.device_count()
            assert task["status"] in (("passed",) if runs_here else ("passed", "needs_gpu")), task
    assert "score" in out.stdout and "seed" in out.stdout


def test_starters_get_zero_with_not_implemented_messages(tmp_path):
    paths = []
    for solution in SOLUTIONS:
        paths.append(tmp_path / solution.name)
        paths[-1].write_text(starters.render(solution))
    out = kernels_cli("grade", *paths, "--json", tmp_path / "grades.json")
    assert out.returncode == 1, out.stdout + out.stderr
    for r in json.loads((tmp_path / "grades.json").read_text()):
        assert r["score"] == 0 and r["max_score"] > 0
        for task in r["tasks"]:
            assert task["status"] in ("failed", "needs_gpu")
            if task["status"] == "failed":
                assert task["message"].startswith("not implemented yet"), task


def test_progress_shows_every_lab_and_what_remains(tmp_path):
    (tmp_path / "labs").mkdir()
    for solution in SOLUTIONS:
        (tmp_path / "labs" / solution.name).write_text(starters.render(solution))
    out = kernels_cli("progress", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for solution in SOLUTIONS:
        assert re.search(rf"^{solution.stem} +\[", out.stdout, re.MULTILINE), out.stdout
        for task in LABS[solution.stem]:
            assert f"{task.name} (" in out.stdout


def test_the_labs_command_writes_and_checks_the_starters(tmp_path):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    for solution in SOLUTIONS:
        (solutions / solution.name).write_bytes(solution.read_bytes())
    out = kernels_cli("labs", cwd=tmp_path)
    assert out.returncode == 0 and "wrote labs/" in out.stdout, out.stdout + out.stderr
    assert starters.generate(solutions, labs, check_only=True) == []
    lab = labs / SOLUTIONS[0].name
    lab.write_text(lab.read_text().replace("NotImplementedError", "ValueError", 1))
    assert starters.generate(solutions, labs, check_only=True) == [lab]
    assert starters.generate(solutions, labs) == [lab]
    assert starters.generate(solutions, labs, check_only=True) == []


def test_a_missing_file_is_exit_status_2(tmp_path):
    out = kernels_cli("grade", tmp_path / "missing.ipynb")
    assert out.returncode == 2 and "no such file" in out.stderr


def test_a_file_that_is_not_a_notebook_is_exit_status_2(tmp_path):
    (tmp_path / "notes.ipynb").write_text("{")
    out = kernels_cli("grade", tmp_path / "notes.ipynb", *SOLUTIONS[:1], "--task", "op_cost")
    assert out.returncode == 2 and "not a Jupyter notebook" in out.stderr
    assert "score 2/2" in out.stdout  # the other notebook was still graded


def test_an_unknown_task_is_exit_status_2():
    out = kernels_cli("grade", *SOLUTIONS, "--task", "no_such_task")
    assert out.returncode == 2, out.stdout + out.stderr
    for solution in SOLUTIONS:
        assert f"{solution.stem} has no task named no_such_task" in out.stderr
    assert "score" not in out.stdout


def test_a_task_of_another_lab_is_exit_status_2_and_names_this_labs_tasks():
    lab = ROOT / "labs" / "lab01_regimes.ipynb"
    out = kernels_cli("grade", lab, "--task", "attention")
    assert out.returncode == 2, out.stdout + out.stderr
    tasks = ", ".join(task.name for task in LABS["lab01_regimes"])
    assert f"lab01_regimes has no task named attention; its tasks: {tasks}" in out.stderr
    assert "score" not in out.stdout  # nothing graded, rather than 0/0


@pytest.mark.gpu
def test_solutions_get_full_marks_with_compiled_triton(tmp_path):
    out = kernels_cli("grade", *SOLUTIONS, "--json", tmp_path / "grades.json")
    assert out.returncode == 0, out.stdout + out.stderr
    gpus = torch.cuda.device_count()
    for r in json.loads((tmp_path / "grades.json").read_text()):
        for t in r["tasks"]:  # a task for more GPUs than this machine has says so
            wanted = next(task.gpus for task in LABS[r["lab"]] if task.name == t["name"])
            assert t["status"] == ("passed" if wanted <= gpus else "needs_gpu"), (t, r)
        graded = [t for t in r["tasks"] if t["status"] == "passed"]
        assert r["score"] == r["max_score"] == sum(t["max_points"] for t in graded) > 0
