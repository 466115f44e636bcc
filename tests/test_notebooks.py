"""Stored notebook outputs come from a recorded run of the current code."""

from pathlib import Path

import nbformat
import pytest

from kernels import bench, notebook
from kernels.runtime import ON_GPU

ROOT = Path(__file__).resolve().parents[1]
RECORDED = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted(
    (ROOT / "solutions").glob("*.ipynb")
)
MAX_BYTES = 2 * 1024 * 1024
# `import kernels` fixes the mode before triton is imported; `# isort: split` keeps ruff from
# sorting it below `import triton`.
PREAMBLE_START = "import kernels  # first: "
ISORT_SPLIT = "# isort: split"


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_outputs_were_recorded_from_the_current_code(path):
    problem = notebook.check_recorded(path)
    assert problem is None, problem


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_stays_small(path):
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size / 1e6:.1f} MB"


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_notebook_starts_with_the_preamble(path):
    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    lines = code[0].splitlines()
    assert lines[0].startswith(PREAMBLE_START), f"first code line: {lines[0]!r}"
    assert ISORT_SPLIT in lines[1:3], "`# isort: split` must follow `import kernels`"
    chapter = path.parent.name == "chapters"
    expected = "banner(CHAPTER)" if chapter else "banner()"
    assert lines[-1] == expected, f"the first cell must end with {expected}, not {lines[-1]!r}"
    if chapter:
        assert f'CHAPTER = "{path.stem}"' in code[0], f"CHAPTER must be {path.stem!r}"
    for source in code:  # the banner sets the figure style, once for every notebook
        assert "rcParams" not in source, "figure settings belong in kernels.notebook.figure_style"
        assert "print(versions())" not in source


def test_banner_says_where_gpu_figures_come_from(capsys):
    notebook.banner("03_matmul")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: ") and "triton" in out[0]
    assert len(out) == 2 and out[1].startswith("GPU figures: ")
    assert "03_matmul.json" in out[1]
    notebook.banner()
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_origin_names_the_run_behind_a_result():
    text = notebook.origin("03_matmul", "ceilings")
    if not ON_GPU:
        _, meta = bench.recorded("03_matmul", "ceilings")
        assert text == bench.describe(meta)
        assert notebook.origin("03_matmul", "ceilings", live=True) == text + "; this CPU: live"
    assert "torch" in text and "triton" in text


def _tiny_notebook(tmp_path, source):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# demo"), nbformat.v4.new_code_cell(source)]
    path = tmp_path / "demo.ipynb"
    nbformat.write(nb, path)
    return path


def test_runner_records_outputs_and_metadata(tmp_path):
    path = _tiny_notebook(tmp_path, "import kernels\nprint(6 * 7, kernels.ON_GPU)")
    assert "no recorded run" in notebook.check_recorded(path)
    meta = notebook.record(path, timeout=120)
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[1].outputs[0]["text"].startswith("42")
    assert nb.cells[1].execution_count == 1
    assert nb.metadata["recorded"] == meta
    assert meta["device"] and meta["torch"] and meta["triton"] and meta["date"]
    assert notebook.check_recorded(path) is None
    nb.cells[1].source += "\nprint('edited')"
    nbformat.write(nb, path)
    assert "edited after its outputs were recorded" in notebook.check_recorded(path)


def test_code_hash_ignores_markdown_and_outputs(tmp_path):
    nb = nbformat.read(_tiny_notebook(tmp_path, "x = 1"), as_version=4)
    before = notebook.code_hash(nb)
    nb.cells[0].source = "# another title"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1")]
    assert notebook.code_hash(nb) == before


@pytest.mark.parametrize(
    "text, shown",
    [  # an install path in a warning; a cell's temporary file in a compile log
        (
            "/opt/x/.venv/lib/python3.12/site-packages/torch/profiler.py:224: UserWarning: w\n",
            ".../site-packages/torch/profiler.py:224: UserWarning: w\n",
        ),
        (
            "Recompiling function chain_eager in /tmp/ipykernel_850/1524573934.py:9\n",
            "Recompiling function chain_eager in <cell>:9\n",
        ),
    ],
)
def test_recording_strips_machine_paths_from_outputs(text, shown):
    import nbformat

    from kernels.notebook import strip_install_paths

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("f()")
    cell.outputs = [nbformat.v4.new_output("stream", name="stderr", text=text)]
    nb.cells.append(cell)
    strip_install_paths(nb)
    assert cell.outputs[0]["text"] == shown
