"""Notebooks: the line every chapter and lab prints first, and the runner that records them.

`banner(chapter)` ends each notebook's first cell: the device, whether Triton compiles or
interprets, the versions, and where the chapter's GPU figures come from on this machine;
`origin(chapter, key)` names the run behind one GPU result.

A chapter keeps the outputs of one recorded run. The runner writes into the notebook's
metadata the device (GPU name or "cpu"), the torch and triton versions, the date and a hash
of the code cells; `check_recorded` tells when the code changed after its outputs were
recorded.
"""

import datetime
import hashlib
import json
import re
import sys
from pathlib import Path

from kernels.runtime import ON_GPU, versions

# kernels.bench (and through it pyplot) is imported only where a chapter needs it: a lab's first
# cell calls banner() in every process the grader starts, and should not pay for plotting.

METADATA_KEY = "recorded"


# Small figures: a chapter keeps many plots, and the notebook stays under about 2 MB.
FIGURE_STYLE = {"figure.dpi": 80, "figure.figsize": (6, 4), "font.size": 9}


def figure_style() -> None:
    """The course's matplotlib settings, set once for the whole notebook."""
    import matplotlib

    matplotlib.rcParams.update(FIGURE_STYLE)


def _recorded_meta(chapter: str) -> dict:
    from kernels import bench

    path = bench.DATA_DIR / bench.RECORDED_GPU / f"{chapter}.json"
    if not path.exists():
        raise FileNotFoundError(f"no results recorded on {bench.RECORDED_GPU} for {chapter}")
    return json.loads(path.read_text())["meta"]


def banner(chapter: str | None = None) -> None:
    """Print where this notebook runs and, for a chapter, where its GPU figures come from:
    measured now on this GPU, or read from the results recorded on the course's GPU. A
    chapter's figures also get the course's style (a lab draws none).

    In CPU mode it pins torch to one thread: on a busy machine (2 cores shared with other
    work), OpenMP threads waiting for each other turn a live CPU timing into nonsense (a copy at
    a few GB/s one moment and 1000x slower the next) that would pass for overhead."""
    info = versions()
    mode = "compiles for the GPU" if ON_GPU else "runs in its interpreter (correct, not fast)"
    where = f"device: {info['device']}; Triton {mode}"
    if not ON_GPU:
        import torch

        torch.set_num_threads(1)
        where += "; torch on 1 CPU thread (live CPU timings stay steady on a busy machine)"
    print(f"{where}; torch {info['torch']}, triton {info['triton']}")
    if chapter is None:
        return
    from kernels import bench

    figure_style()
    if ON_GPU:
        data = f"kernels/data/{bench.gpu_slug(info['device'])}/{chapter}.json"
        today = datetime.date.today().isoformat()
        print(f"GPU figures: measured now on this GPU, {today} (and recorded into {data})")
    else:
        data = f"kernels/data/{bench.RECORDED_GPU}/{chapter}.json"
        if not (bench.DATA_DIR / bench.RECORDED_GPU / f"{chapter}.json").exists():
            print(f"GPU figures: none recorded yet ({data} does not exist): this chapter has not "
                  "been recorded on the course's GPU, so only its CPU figures show")  # fmt: skip
            return
        run = bench.describe(_recorded_meta(chapter))
        print(f"GPU figures: no GPU here, so the run recorded in {data}: {run}")


def origin(chapter: str, key: str, live: bool = False) -> str:
    """The run a GPU result comes from: this GPU today, or the recorded run (bench.describe).
    `live=True` adds, on a CPU, that this CPU's own curves beside it are measured now."""
    from kernels import bench

    if ON_GPU:
        return bench.describe({**versions(), "date": datetime.date.today().isoformat()})
    _, meta = bench.recorded(chapter, key)
    return bench.describe(meta) + ("; this CPU: live" if live else "")


def code_hash(nb) -> str:
    """sha256 of the code cells' sources, in order: what the stored outputs were computed from."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode())
            digest.update(b"\x00")
    return digest.hexdigest()


def record(path, timeout: int = 1800, kernel_name: str = "python3") -> dict:
    """Execute the notebook at `path` in place (in its own folder) and store its outputs and
    the record of the run. Raises nbclient's CellExecutionError if a cell fails."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    strip_install_paths(nb)
    info = versions()
    meta = {
        "device": info["device"],
        "torch": info["torch"],
        "triton": info["triton"],
        "date": datetime.date.today().isoformat(),
        "code_hash": code_hash(nb),
    }
    nb.metadata[METADATA_KEY] = meta
    nbformat.write(nb, path)
    return meta


# A warning names the file it came from with the machine's own install path; the book needs
# only the part from "site-packages" on.
_INSTALL_PREFIX = re.compile(r"(?:/[\w.+-]+)+/(?:site|dist)-packages/")
# A cell's code as Python names it in a traceback or a compile log: a file of the machine's
# temporary folder (/tmp/ipykernel_850/1524573934.py), which means nothing on another one.
_CELL_FILE = re.compile(r"(?:/[\w.+-]+)*/ipykernel_\d+/\d+\.py")


def strip_install_paths(nb) -> None:
    """Shorten install paths in stream outputs (warnings) to `.../site-packages/...`, and name
    a cell's temporary file `<cell>`."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                text = _INSTALL_PREFIX.sub(".../site-packages/", output["text"])
                output["text"] = _CELL_FILE.sub("<cell>", text)


def check_recorded(path) -> str | None:
    """None when the notebook's outputs come from a recorded run of its current code;
    otherwise what is wrong, in one line."""
    import nbformat

    nb = nbformat.read(Path(path), as_version=4)
    meta = nb.metadata.get(METADATA_KEY)
    if not meta:
        return f"{path}: no recorded run: record it with `python -m kernels record {path}`"
    if meta.get("code_hash") != code_hash(nb):
        return f"{path}: edited after its outputs were recorded: re-run it (`make record`)"
    return None


def check_physics(path, device: str) -> list[str]:
    """The physics problems (kernels.roofs) in the results the chapter at `path` recorded on
    `device`: kernels/data/<gpu>/<notebook name>.json; [] when it keeps none (a lab)."""
    from kernels import bench, roofs
    from kernels.benchmarks import ABOVE_ROOF

    data = bench.DATA_DIR / bench.gpu_slug(device) / f"{Path(path).stem}.json"
    return roofs.check_file(data, ABOVE_ROOF) if data.exists() else []


def main(paths) -> int:
    for path in paths:
        print(f"recording {path} ...", flush=True)
        meta = record(path)
        print(f"  recorded on {meta['device']} (torch {meta['torch']}, triton {meta['triton']})")
        problems = check_physics(path, meta["device"])
        if problems:
            print(
                f"PHYSICS: {path} recorded {len(problems)} rates above their roofs; its "
                "results must not be committed:",
                *problems,
                sep="\n  ",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
