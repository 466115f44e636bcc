"""Bad submissions for the grader's tests: a lab's solution with its graded cells edited."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
# The grader draws new inputs each run; its tests draw them from one seed, so that the case a
# message names (the first that shows the planted bug) is the same on every run, where a rare
# draw could otherwise hide a bug's first case within the tolerance. GRADER_TEST_SEED=N draws
# other inputs, to look for such draws.
SEED = os.environ.get("GRADER_TEST_SEED", "20261207")


def make_submission(solution: Path, folder: Path, name: str, edits) -> Path:
    """A copy of `solution`, saved as `<name>_<solution's name>` in `folder`, with each edit
    (marker, old, new) applied once to the graded cell whose source contains `marker`."""
    nb = nbformat.read(solution, as_version=4)
    graded = [c for c in nb.cells if "graded" in c.metadata.get("tags", [])]
    for marker, old, new in edits:
        (target,) = [c for c in graded if marker in c.source]
        assert old in target.source, f"{name}: {old!r} not in the solution's cell"
        target.source = target.source.replace(old, new, 1)
    path = folder / f"{name}_{solution.name}"
    nbformat.write(nb, path)
    return path


def in_function(function: str, edits):
    """The (old, new) edits of the graded cell defining `function`, for make_submission."""
    return [(f"def {function}(", old, new) for old, new in edits]


def run_grader(paths, *options) -> subprocess.CompletedProcess:
    """`python -m kernels grade PATHS OPTIONS --seed SEED` from the repository root, output
    captured."""
    return subprocess.run(
        [sys.executable, "-m", "kernels", "grade", *map(str, paths), *options, "--seed", SEED],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def grade_submissions(solution: Path, paths, tasks, time_limit=None, jobs: int = 3) -> dict:
    """Grade the submissions at `paths` (from make_submission) on `tasks` in one run of the
    grader, which must report failures: {submission name: {task name: its report}}. No
    time_limit: each task's own."""
    target = paths[0].parent / "grades.json"
    options = ["--json", str(target), "--jobs", str(jobs)]
    if time_limit is not None:
        options += ["--time-limit", str(time_limit)]
    for task in tasks:
        options += ["--task", task]
    out = run_grader(paths, *options)
    assert out.returncode == 1, out.stdout + out.stderr
    suffix = f"_{solution.name}"
    reports = {Path(r["path"]).name.removesuffix(suffix): r for r in json.loads(target.read_text())}
    return {name: {t["name"]: t for t in r["tasks"]} for name, r in reports.items()}


def grade_cases(solution: Path, folder: Path, cases: dict, tasks, **options) -> dict:
    """One submission per {name: edits for make_submission} in `folder`, graded together by
    grade_submissions(**options); every case must be in the report."""
    paths = [make_submission(solution, folder, name, edits) for name, edits in cases.items()]
    found = grade_submissions(solution, paths, tasks, **options)
    assert set(found) == set(cases)
    return found


def reports_by_group(tmp_path_factory, solution: Path, cases: dict, groups, **options) -> dict:
    """{bad submission: {task: its report}} for cases {name: (task, function, edits, ...)}, one
    grader run per group of tasks (the cases of the group's tasks, in a folder of their own)."""
    found = {}
    for tasks in groups:
        group = {name: in_function(*spec[1:3]) for name, spec in cases.items() if spec[0] in tasks}
        folder = tmp_path_factory.mktemp(tasks[0])
        found.update(grade_cases(solution, folder, group, tasks, **options))
    assert set(found) == set(cases)
    return found


def assert_fails_with(found: dict, fragments) -> None:
    """A task's report: failed with no points, its message holding each fragment, and the
    submission's own fault (not the grader's)."""
    assert found["status"] == "failed" and found["points"] == 0, found
    for fragment in fragments:
        assert fragment in found["message"], (fragment, found["message"])
    assert "grader error" not in found["message"]
