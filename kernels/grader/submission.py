"""Reading a submission: the cells tagged `graded`, joined into one module's source.

The grader never runs this source in its own process; it parses it (static checks) and
writes it to a real .py file for the child process, which imports it from there (compiled
Triton needs a kernel's source in a file). Every line of that file maps back to a cell.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

GRADED_TAG = "graded"
_MAGIC = re.compile(r"^(\s*)[%!]")


class NotALab(Exception):
    """The path cannot be graded at all: missing, not a notebook, or no known lab."""


@dataclass
class Submission:
    path: Path
    lab: str
    source: str
    origins: list  # origins[i] = (cell number, line in cell) of source line i + 1
    lines: list  # the source's lines, for quoting

    def where(self, lineno: int) -> str:
        """'cell 7, line 3: `y = x * 2`' for a line of the module's source."""
        if not 1 <= lineno <= len(self.origins):
            return f"line {lineno}"
        cell, line = self.origins[lineno - 1]
        code = self.lines[lineno - 1].strip()
        if len(code) > 70:
            code = code[:67] + "..."
        return f"cell {cell}, line {line}: `{code}`"


def lab_name(nb: dict, path: Path, known) -> str:
    """The lab a notebook belongs to: its metadata, else a `labNN` in its file name."""
    metadata = nb.get("metadata")
    name = metadata.get("lab") if isinstance(metadata, dict) else None
    if name in known:
        return name
    match = re.search(r"lab(\d\d)", path.name)
    if match:
        for lab in known:
            if lab.startswith(f"lab{match.group(1)}"):
                return lab
    raise NotALab(f"{path}: not one of the course's labs ({', '.join(sorted(known))})")


def load(path, known_labs) -> Submission:
    """The graded cells of the notebook at `path`, as one module's source."""
    path = Path(path)
    if not path.is_file():
        raise NotALab(f"{path}: no such file")
    try:  # plain JSON: nbformat's schema validation costs seconds of start-up
        nb = json.loads(path.read_text(encoding="utf-8"))
        cells = nb["cells"]
        if not isinstance(cells, list) or not all(isinstance(c, dict) for c in cells):
            raise ValueError("cells")
    except Exception:  # unreadable, not JSON, or JSON that is not a notebook
        raise NotALab(f"{path}: not a Jupyter notebook") from None
    lab = lab_name(nb, path, known_labs)
    lines, origins = [], []
    for number, cell in enumerate(cells, start=1):
        metadata = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        if cell.get("cell_type") != "code" or GRADED_TAG not in (metadata.get("tags") or []):
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else str(source)
        cell_lines = source.replace("\r\n", "\n").split("\n")  # as Python counts lines
        for line_number, line in enumerate(cell_lines, start=1):
            # IPython magics and shell escapes are not Python: neutralise them, keeping lines
            lines.append(_MAGIC.sub(r"\1pass  # notebook magic, ignored: ", line, count=1))
            origins.append((number, line_number))
        lines.append("")
        origins.append((number, len(cell_lines) + 1))
    return Submission(path, lab, "\n".join(lines) + "\n", origins, lines)
