"""A notebook as the book shows it: the same cells, minus what only makes sense in JupyterLab.

- nbval's markers (`# NBVAL_CHECK_OUTPUT`, `# NBVAL_SKIP`, ...) tell the test suite which
  outputs to compare; a reader of the book has no use for them, so their lines are dropped
  from the code cells.
- A recorded run prints "measured now on <GPU>, ..., today": true in the notebook that ran,
  not on a page read weeks later. "Measured now" becomes "measured", and "today" or "this GPU"
  become the date and device of the notebook's recorded run (its metadata `recorded`, written
  by `python -m kernels record`).

- A notebook links the book's pages from where it sits (`../book/glossary.md`); its copy in the
  book sits beside them, so such links lose their `book/` (`../glossary.md`).

`for_static_page` works on the notebook's JSON (a dict) and changes nothing else.
"""

import re

NBVAL_LINE = re.compile(r"^[ \t]*# NBVAL_[A-Z_]+[^\n]*(\n|$)", re.MULTILINE)
# "[ceilings] measured now on NVIDIA H200, torch ..., triton 3.6.0, today" (or a date)
MEASURED_NOW = re.compile(r"measured now on (?!this GPU)([^\n]*?), (today|\d{4}-\d\d-\d\d)\b")
# the banner's "GPU figures: measured now on this GPU (and recorded into ...)" (or ", <date> (")
THIS_GPU_NOW = re.compile(r"measured now on this GPU(?:, (\d{4}-\d\d-\d\d))?")


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def drop_nbval_markers(source: str) -> str:
    """The cell's source without its nbval marker lines (and no trailing blank line)."""
    return NBVAL_LINE.sub("", source).rstrip("\n")


def date_the_run(text: str, device: str, date: str) -> str:
    """Output text with "measured now ... today" stated as the recorded run's device and date."""
    text = MEASURED_NOW.sub(
        lambda m: f"measured on {m.group(1)}, {date if m.group(2) == 'today' else m.group(2)}",
        text,
    )
    return THIS_GPU_NOW.sub(lambda m: f"measured on {device}, {m.group(1) or date}", text)


def for_static_page(nb: dict) -> dict:
    """The notebook `nb` (its JSON) with the changes above, in place; returns it."""
    run = nb.get("metadata", {}).get("recorded") or {}
    device, date = run.get("device", "the recorded GPU"), run.get("date", "the recorded date")
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            cell["source"] = _text(cell.get("source", "")).replace("](../book/", "](../")
        if cell.get("cell_type") != "code":
            continue
        cell["source"] = drop_nbval_markers(_text(cell.get("source", "")))
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = date_the_run(_text(output["text"]), device, date)
            for mime, value in output.get("data", {}).items():
                if mime == "text/plain" or mime == "text/html":
                    output["data"][mime] = date_the_run(_text(value), device, date)
    return nb
