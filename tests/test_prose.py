"""A chapter's prose states the numbers of its recorded run (kernels.prose)."""

import json
import re
import shutil
from pathlib import Path

import pytest

from kernels import prose
from kernels.bench import RECORDED_GPU

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
# Converted cells, by the heading they start with: every number with a unit in them is tied to
# the recorded data (every other markdown cell is checked too: it may hold no such number).
CONVERTED = {
    "03_matmul": ["### The chapter's targets, measured"],
    "05_batch_invariance": ["### The targets, measured"],
}
# More converted cells, by heading; some hold only cited numbers and targets (Chapters 1 and 4).
CONVERTED_CITED = {
    "01_three_regimes": ["## 1. Napkin math", "### The double-the-batch test"],
    "02_fusion": ["### The chapter's targets, measured"],
    "04_attention": ["**Targets.**", "## 8. Where FlexAttention fits"],
}
MATMUL = ROOT / "chapters" / "03_matmul.ipynb"
TARGETS = next(  # Chapter 3's targets cell
    i
    for i, c in enumerate(json.loads(MATMUL.read_text())["cells"])
    if "".join(c["source"]).startswith("### The chapter's targets, measured")
)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_prose_states_the_recorded_numbers(path):
    _, problems = prose.check_notebook(path)
    assert not problems, "\n".join(problems)


def converted_cells(chapter, headings):
    """The cells of `chapter` starting with each heading, each still carrying its block."""
    path = ROOT / "chapters" / f"{chapter}.ipynb"
    nb = json.loads(path.read_text())
    converted = prose.coverage(path)
    for heading in headings:
        cells = [i for i, c in enumerate(nb["cells"]) if "".join(c["source"]).startswith(heading)]
        assert len(cells) == 1, f"{chapter}: {len(cells)} cells start with {heading!r}"
        assert cells[0] in converted, f"{chapter} cell {cells[0]} ({heading!r}) lost its block"
    return path, converted


@pytest.mark.parametrize("chapter", sorted(CONVERTED))
def test_the_targets_tables_stay_converted(chapter):
    path, converted = converted_cells(chapter, CONVERTED[chapter])
    annotations, _ = prose.check_notebook(path)
    assert len([a for a in annotations if a.cell in converted]) >= 10


@pytest.mark.parametrize("chapter", sorted(CONVERTED_CITED))
def test_the_other_converted_cells_keep_their_blocks(chapter):
    converted_cells(chapter, CONVERTED_CITED[chapter])


def test_chapter_2s_targets_quote_the_benchmark_and_the_tuning_run():
    """Its table cites `python -m kernels bench` and scripts/tune_fusion.py: both are read."""
    path = ROOT / "chapters" / "02_fusion.ipynb"
    annotations, _ = prose.check_notebook(path)
    exprs = " ".join(a.expr for a in annotations)
    assert len(annotations) >= 30 and "tune." in exprs and "bench." in exprs


def test_recorded_reads_another_recorded_json_of_the_folder_only():
    names = prose.names_for(MATMUL, {"cells": []})
    tune = prose.evaluate('recorded("tune_fusion")', names)
    assert "bias_gelu" in tune
    with pytest.raises(LookupError, match="not recorded"):
        prose.evaluate('recorded("../../../pyproject")', names)


# --- planted mismatches in a copy of Chapter 3


def _planted(tmp_path, old, new, cell=TARGETS):
    """A copy of Chapter 3 (same name, so it reads the same recorded data) with one edit."""
    nb = json.loads(MATMUL.read_text())
    source = "".join(nb["cells"][cell]["source"])
    assert source.count(old) >= 1, f"{old!r} is not in cell {cell}"
    nb["cells"][cell]["source"] = source.replace(old, new, 1)
    path = tmp_path / MATMUL.name
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return prose.check_notebook(path)[1]


def _prose_number(name, cell=TARGETS):
    """The number Chapter 3's prose ties to `name` first, as written ("0.96", "3.23")."""
    source = "".join(json.loads(MATMUL.read_text())["cells"][cell]["source"])
    return re.search(rf"([\d.]+)×?<!-- = {name} -->", source).group(1)


def test_a_changed_number_in_prose_fails_naming_cell_number_and_recorded_value(tmp_path):
    said = _prose_number("bf16_4096")
    wrong = f"{float(said) - 0.05:.2f}"
    problems = _planted(tmp_path, f"{said}×<!-- = bf16_4096 -->", f"{wrong}×<!-- = bf16_4096 -->")
    assert len(problems) == 1, problems
    assert f"03_matmul cell {TARGETS}" in problems[0] and f"prose says {wrong}" in problems[0]
    bench = json.loads((prose.DATA_DIR / RECORDED_GPU / "bench.json").read_text())
    row = next(r for r in bench["rows"] if r["name"] == "matmul bf16 4096^3")
    assert f"is {row['baselines']['torch.matmul'] / row['ms']:.4g}" in problems[0]  # recorded


def test_an_annotation_to_a_value_no_longer_recorded_fails(tmp_path):
    problems = _planted(tmp_path, '"matmul bf16 4096^3"', '"matmul bf16 4097^3"')
    assert any("bf16_4096" in p and "4097^3" in p for p in problems), problems
    problems = _planted(tmp_path, "ch.precision[", "ch.precisions[")
    assert any("no recorded key 'precisions'" in p for p in problems), problems


def test_a_rerecorded_run_leaves_the_prose_behind(tmp_path, monkeypatch):
    """The recorded benchmark changes (a re-recording): the unchanged prose fails."""
    data = tmp_path / RECORDED_GPU
    shutil.copytree(prose.DATA_DIR / RECORDED_GPU, data)
    bench = json.loads((data / "bench.json").read_text())
    row = next(r for r in bench["rows"] if r["name"] == "matmul bf16 4096^3")
    row["ms"] *= 1.1
    bench["rows"] = [r for r in bench["rows"] if r["name"] != "matmul fp32 tf32 4096^3"]
    (data / "bench.json").write_text(json.dumps(bench))
    monkeypatch.setattr(prose, "DATA_DIR", tmp_path)
    problems = prose.check_notebook(MATMUL)[1]
    said = _prose_number("bf16_4096")
    assert any(f"prose says {said}" in p and "bf16_4096" in p for p in problems), problems
    assert any("fp32_tf32" in p and "matmul fp32 tf32 4096^3" in p for p in problems), problems


def test_an_unannotated_measurement_in_a_converted_cell_fails(tmp_path):
    said = _prose_number("odd")
    problems = _planted(tmp_path, f"{said}×<!-- = odd --> cuBLAS.", f"{said}× cuBLAS.")
    assert len(problems) == 1 and f"'{said}×' has no annotation" in problems[0], problems


def test_a_block_name_with_no_number_left_fails(tmp_path):
    problems = _planted(tmp_path, "2.6×<!-- = tf32_error_ratio -->", "2.6×<!-- cited -->")
    assert problems == [
        f"03_matmul cell {TARGETS}: `tf32_error_ratio` is defined in the block "
        "but no number uses it"
    ]


# --- the rules, on single cells

NAMES = {
    **prose.FUNCTIONS,
    "ch": {"rows": [{"name": "k n=8", "ms": 2.0, "baselines": {"torch": 3.0}}], "sms": 132},
    "out": prose._Output(["k took 26.0 us a call\n", "copy 4245 GB/s"]),
}


def _check(source):
    return prose.check_cell(source, "demo cell 1", 1, NAMES)


def test_a_correct_annotation_passes():
    annotations, problems = _check(
        "1.50×<!-- = fast --> faster, on 132<!-- = ch.sms --> SMs, 26 µs<!-- = out(r'took "
        r"([\d.]+) us') -->, 4,245 GB/s<!-- = out(r'copy (\d+) GB/s') -->"
        '\n<!-- measured\nfast = speedup(ch.rows["k n=8"], "torch")\n-->'
    )
    assert problems == []
    assert [a.value for a in annotations] == [1.5, 132, 26.0, 4245.0]


def test_numbers_are_compared_at_the_precision_the_prose_writes():
    assert prose._matches("0.97", 0.9749) and prose._matches("0.97", 0.9651)
    assert not prose._matches("0.97", 0.9751) and not prose._matches("0.97", 0.9649)
    assert prose._matches("135", 134.7) and prose._matches("1,234", 1234.4)
    assert not prose._matches("2", "2") and not prose._matches("2", None)


def test_targets_and_cited_numbers_need_no_annotation_but_others_do():
    block = "\n<!-- measured\n-->"
    assert _check("≥ 0.90× cuBLAS, at most 1.5× the default, no shape under 0.6×" + block)[1] == []
    assert _check("the post measured 26 s<!-- cited: the post -->" + block)[1] == []
    assert _check("`0.5×` in code and $2×$ in math" + block)[1] == []
    problems = _check("we measured 0.8× and 52%, 4.5 µs, 4245 GB/s, 3 s" + block)[1]
    assert len(problems) == 5, problems


def test_unconverted_cells_are_checked_too_and_annotations_need_a_block():
    problems = _check("we measured 0.8× and 52%, at least 2× faster")[1]
    assert len(problems) == 2 and all("has no annotation" in p for p in problems), problems
    assert _check("no measurement: 2048 rows, 132 SMs, n / (1.5·s) FLOP per byte") == ([], [])
    _, problems = _check("0.67×<!-- = speedup(ch.rows[0], 'torch') -->")
    assert problems == [
        "demo cell 1: prose says 0.67: annotated, but the cell has no <!-- measured --> block"
    ]


def test_an_expression_reads_only_the_recorded_data():
    with pytest.raises(ValueError, match="not allowed"):
        prose.evaluate("__import__('os').getcwd()", NAMES)
    with pytest.raises(ValueError, match="not allowed"):
        prose.evaluate("[x for x in ch]", NAMES)
    with pytest.raises(LookupError, match="unknown name 'open'"):
        prose.evaluate("open", NAMES)
    with pytest.raises(LookupError, match="no recorded key '__class__'"):
        prose.evaluate("ch.__class__", NAMES)
    with pytest.raises(LookupError, match="0 recorded items named"):
        prose.evaluate('ch.rows["k n=9"]', NAMES)
    with pytest.raises(LookupError, match="matches nothing"):
        prose.evaluate(r"out(r'took ([\d.]+) ms')", NAMES)
    assert prose.evaluate("find(ch.rows, ms=2.0).baselines.torch / 2", NAMES) == 1.5
