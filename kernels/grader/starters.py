"""Starter notebooks: `labs/` generated from `solutions/`, the single source of each lab.

In every code cell, the lines from `### BEGIN SOLUTION` to `### END SOLUTION` become one
line, `raise NotImplementedError("<hint>")`, indented like the marker; the hint is the text
of a `### HINT: ...` line inside the block, or a default. A block that is the whole body of an
`@triton.jit` function becomes `pass  # TODO: <hint>` instead: Triton's compiler rejects a
`raise` in a kernel, so on a GPU the learner would see a compile error rather than the hint (its
launcher, a stub of its own, raises the hint). Outputs, execution counts and the record of the
solution's run are cleared.
"""

import copy
from pathlib import Path

import nbformat

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:"
DEFAULT_HINT = "your code here (see the task above)"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _whole_jit_body(lines: list, begin: int, end: int) -> bool:
    """Whether lines[begin..end] (a solution block) are the whole body of an @triton.jit function:
    only comments, a docstring or blank lines between its `def` and the block, nothing after it."""
    i = begin - 1
    while i >= 0 and (not lines[i].strip() or lines[i].strip().startswith(("#", '"""', "'"))):
        i -= 1
    head = i  # the `def` line, or the last line of its signature
    while i >= 0 and not lines[i].lstrip().startswith("def "):
        if _indent(lines[i]) >= _indent(lines[begin]):
            return False  # code of the body above the block
        i -= 1
    if i < 0 or head < i or not (i > 0 and lines[i - 1].strip().startswith("@triton.jit")):
        return False
    after = next((line for line in lines[end + 1 :] if line.strip()), None)
    return after is None or _indent(after) <= _indent(lines[i])


def strip_solutions(source: str) -> str:
    """The cell's source with each solution block replaced by a NotImplementedError stub (a
    `pass` where the block is a whole @triton.jit body)."""
    lines = source.splitlines()
    out, indent, hint, begin = [], None, None, None
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if indent is not None:
                raise ValueError(f"line {number}: {BEGIN} inside another solution block")
            indent, hint, begin = line[: len(line) - len(line.lstrip())], None, number - 1
        elif stripped.startswith(END):
            if indent is None:
                raise ValueError(f"line {number}: {END} without {BEGIN}")
            if _whole_jit_body(lines, begin, number - 1):
                out.append(f"{indent}pass  # TODO: {hint or DEFAULT_HINT}")
            else:
                text = (hint or DEFAULT_HINT).replace("\\", "\\\\").replace('"', '\\"')
                out.append(f'{indent}raise NotImplementedError("{text}")')
            indent = None
        elif indent is not None:
            if stripped.startswith(HINT) and hint is None:
                hint = stripped[len(HINT) :].strip()
        else:
            out.append(line)
    if indent is not None:
        raise ValueError(f"{BEGIN} without {END}")
    return "\n".join(out)


def starter(solution, lab: str):
    """The learner's notebook made from a solution notebook."""
    nb = copy.deepcopy(solution)
    nb.metadata.pop("recorded", None)
    nb.metadata["lab"] = lab
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source)
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)
    return nb


def render(solution_path) -> str:
    """The text of the starter notebook for `solution_path`, as `generate` writes it."""
    path = Path(solution_path)
    nb = starter(nbformat.read(path, as_version=4), path.stem)
    return nbformat.writes(nb) + "\n"


def generate(solutions="solutions", labs="labs", check_only=False) -> list:
    """Write labs/labNN_*.ipynb from solutions/; returns the paths that were (or would be,
    with check_only) changed."""
    changed = []
    for path in sorted(Path(solutions).glob("lab*.ipynb")):
        target = Path(labs) / path.name
        text = render(path)
        if not target.exists() or target.read_text() != text:
            changed.append(target)
            if not check_only:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
    return changed
