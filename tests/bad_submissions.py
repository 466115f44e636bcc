"""Bad submissions for the grader's tests: a lab's solution with its graded cells edited."""

from pathlib import Path

import nbformat


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
