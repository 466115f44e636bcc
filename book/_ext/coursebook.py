"""The course's Sphinx extension: gathers the notebooks and tables where their numbers came from.

- At `builder-inited`, `chapters/`, `labs/` and `kernels/` at the repository root are copied
  afresh into the book's source folder (`book/chapters/` etc., git-ignored), keeping their
  modification times so that an unchanged notebook need not be read again. The notebooks of
  chapters/ and labs/ become pages (conf.py's `include_patterns`); kernels/ is there so that
  a notebook's link to the course's code (`../kernels/softmax.py`) becomes a download in the
  book. `solutions/` is never gathered. The copied notebooks lose their nbval markers and
  state their recorded run's date where they said "today" (`static_page`).
- Each lab's page opens with a note on how to do the lab and grade it.
- The directive `notebook-toctree` is a globbing toctree that, while its folder holds no
  notebook yet, says so instead of warning (and is read again at the next build).
- The directive `recorded-runs notebooks|results` writes two tables: for each gathered
  notebook, where its stored outputs were recorded (its metadata `recorded`, written by
  `python -m kernels record`), and for each file of recorded GPU results under
  `kernels/data/`, the run that produced it. The page that holds it is read again at every
  build, so the tables never go stale.
"""

import json
import os
import shutil
from pathlib import Path

import static_page
from docutils import nodes
from sphinx import addnodes
from sphinx.directives.other import TocTree
from sphinx.util.docutils import SphinxDirective
from sphinx.util.matching import patfilter

from kernels.grader.cli import grading_command

GATHERED = ("chapters", "labs", "kernels")
PAGES = ("chapters", "labs")  # the folders whose notebooks are pages
SKIPPED = ("__pycache__", ".*")  # .ipynb_checkpoints and other hidden files
PROVENANCE_DOC = "provenance"  # the page that holds the `recorded-runs` directive


def repository_root(srcdir) -> Path:
    return Path(srcdir).resolve().parent


def gather(root: Path, srcdir: Path) -> None:
    """Replace srcdir/chapters, srcdir/labs and srcdir/kernels with copies of the originals,
    the notebooks made ready for a static page (`static_page`)."""
    for name in GATHERED:
        target = srcdir / name
        shutil.rmtree(target, ignore_errors=True)
        if (root / name).is_dir():
            shutil.copytree(root / name, target, ignore=shutil.ignore_patterns(*SKIPPED))
        else:
            target.mkdir()
    for name in PAGES:
        for path in (srcdir / name).glob("*.ipynb"):
            _rewrite_for_the_page(path)


def _rewrite_for_the_page(path: Path) -> None:
    """The copy at `path` as the book shows it, keeping the original's modification time."""
    times = path.stat()
    nb = json.loads(path.read_text(encoding="utf-8"))
    text = json.dumps(static_page.for_static_page(nb), indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def _cell(value) -> str:
    return str(value).replace("|", "\\|") if value not in (None, "") else "-"


def _run(meta: dict) -> list[str]:
    """The table cells that say where a run happened: device, versions, date."""
    versions = f"torch {meta.get('torch')}, triton {meta.get('triton')}"
    return [_cell(meta.get("device")), _cell(versions), _cell(meta.get("date"))]


def _notebook_row(docname: str, path: Path) -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    meta = nb.get("metadata", {}).get("recorded")
    if meta:
        cells = _run(meta)
    elif any(cell.get("outputs") for cell in nb.get("cells", [])):
        cells = ["outputs not recorded by `python -m kernels record`", "-", "-"]
    else:
        cells = ["no stored outputs", "-", "-"]
    return "| {doc}`" + docname + "` | " + " | ".join(cells) + " |"


def notebook_table(srcdir: Path) -> list[str]:
    rows = [
        _notebook_row(f"{name}/{path.stem}", path)
        for name in PAGES
        for path in sorted((srcdir / name).glob("*.ipynb"))
    ]
    if not rows:
        return ["No chapter or lab has been written yet."]
    return ["| page | recorded on | versions | date |", "|---|---|---|---|", *rows]


def results_table(data_dir: Path) -> list[str]:
    rows = []
    for path in sorted(data_dir.glob("*/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        keys = _cell(", ".join(sorted(data.get("results", {}))))
        rel = path.relative_to(data_dir).as_posix()
        rows.append(f"| `{rel}` | " + " | ".join([*_run(data.get("meta", {})), keys]) + " |")
    if not rows:
        return ["No GPU results have been recorded yet."]
    return ["| file | measured on | versions | date | results |", "|---|---|---|---|---|", *rows]


class RecordedRuns(SphinxDirective):
    """`recorded-runs notebooks` or `recorded-runs results`: a provenance table, as MyST markdown
    parsed in place."""

    required_arguments = 1

    def run(self):
        if self.arguments[0] == "notebooks":
            lines = notebook_table(Path(self.env.srcdir))
        elif self.arguments[0] == "results":
            lines = results_table(repository_root(self.env.srcdir) / "kernels" / "data")
        else:
            raise self.error(
                f"recorded-runs takes 'notebooks' or 'results', not {self.arguments[0]!r}"
            )
        return self.parse_text_to_nodes("\n".join(lines))


class NotebookToctree(TocTree):
    """`notebook-toctree`: always globbing; a note instead of a warning while nothing matches."""

    def run(self):
        self.options["glob"] = True
        patterns = [line.strip() for line in self.content if line.strip()]
        if any(patfilter(self.env.found_docs, pattern) for pattern in patterns):
            return super().run()
        self.env.note_reread()
        return [nodes.paragraph(text=f"{self.options.get('caption', 'Pages')}: none yet.")]


def _lab_note(app, doctree) -> None:
    """At the top of each lab's page: how to work on it and grade it."""
    docname = app.env.docname
    if not docname.startswith("labs/"):
        return
    path = f"{docname}.ipynb"
    grading = addnodes.pending_xref(
        "",
        refdomain="std",
        reftype="doc",
        reftarget="/grading",
        refdoc=docname,
        refexplicit=False,
        refwarn=True,
    )
    grading += nodes.inline(text="grading")
    text = nodes.paragraph()
    text += [
        nodes.Text("This page is the lab's statement. To do it, open "),
        nodes.literal(text=path),
        nodes.Text(" in JupyterLab ("),
        nodes.literal(text="make lab"),
        nodes.Text("), write the graded functions, save, then run "),
        nodes.literal(text=grading_command(path)),
        nodes.Text(" in a terminal in the course's folder. See "),
        grading,
        nodes.Text("."),
    ]
    section = next(doctree.findall(nodes.section), None)
    if section is not None and section.children and isinstance(section[0], nodes.title):
        section.insert(1, nodes.note("", text))


def _gather(app) -> None:
    gather(repository_root(app.srcdir), Path(app.srcdir))


def _reread_provenance(app, env, added, changed, removed):
    return [PROVENANCE_DOC] if PROVENANCE_DOC in env.found_docs else []


def setup(app):
    app.connect("builder-inited", _gather)
    app.connect("env-get-outdated", _reread_provenance)
    app.connect("doctree-read", _lab_note)
    app.add_directive("notebook-toctree", NotebookToctree)
    app.add_directive("recorded-runs", RecordedRuns)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
