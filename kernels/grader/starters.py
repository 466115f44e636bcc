"""Starter notebooks: `labs/` generated from `solutions/`, the single source of each lab.

In every code cell, the lines from `### BEGIN SOLUTION` to `### END SOLUTION` become one
line, `raise NotImplementedError("<hint>")`, indented like the marker; the hint is the text
of a `### HINT: ...` line inside the block, or a default. A block inside an `@triton.jit`
function becomes `tl.static_assert(False, "<hint>")` instead: Triton's compiler rejects a
`raise` in a kernel (on a GPU the learner would see that, not the hint), while a static
assertion fails with the hint when the kernel is compiled (on a GPU) or run (in the
interpreter), and only on a branch that is taken: an epilogue block under `if HAS_BIAS:` stays
quiet while the bias is off. Outputs, execution counts and the record of the solution's run
are cleared.
"""

import ast
import copy
from pathlib import Path

import nbformat

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:"
DEFAULT_HINT = "your code here (see the task above)"


def _jit_lines(source: str) -> set:
    """The line numbers (1-based) inside @triton.jit functions; none if the source does not
    parse (a cell with IPython magic)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
            inside.update(range(node.lineno, node.end_lineno + 1))
    return inside


def _is_jit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("triton.jit", "jit")


def strip_solutions(source: str) -> str:
    """The cell's source with each solution block replaced by a NotImplementedError stub (a
    static assertion inside an @triton.jit function)."""
    lines, in_kernel = source.splitlines(), _jit_lines(source)
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
            text = (hint or DEFAULT_HINT).replace("\\", "\\\\").replace('"', '\\"')
            stub = (
                "tl.static_assert(False, "
                if begin + 1 in in_kernel
                else "raise NotImplementedError("
            )
            out.append(f'{indent}{stub}"{text}")')
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
