"""The notebook runner: execute a notebook top to bottom and record where it ran.

A chapter keeps the outputs of one recorded run. The runner writes into the notebook's
metadata the device (GPU name or "cpu"), the torch and triton versions, the date and a hash
of the code cells; `check_recorded` tells when the code changed after its outputs were
recorded.
"""

import datetime
import hashlib
import re
import sys
from pathlib import Path

import nbformat

from kernels.runtime import versions

METADATA_KEY = "recorded"


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


def strip_install_paths(nb) -> None:
    """Shorten install paths in stream outputs (warnings) to `.../site-packages/...`."""
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = _INSTALL_PREFIX.sub(".../site-packages/", output["text"])


def check_recorded(path) -> str | None:
    """None when the notebook's outputs come from a recorded run of its current code;
    otherwise what is wrong, in one line."""
    nb = nbformat.read(Path(path), as_version=4)
    meta = nb.metadata.get(METADATA_KEY)
    if not meta:
        return f"{path}: no recorded run: record it with `python -m kernels record {path}`"
    if meta.get("code_hash") != code_hash(nb):
        return f"{path}: edited after its outputs were recorded: re-run it (`make record`)"
    return None


def main(paths) -> int:
    for path in paths:
        print(f"recording {path} ...", flush=True)
        meta = record(path)
        print(f"  recorded on {meta['device']} (torch {meta['torch']}, triton {meta['triton']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
