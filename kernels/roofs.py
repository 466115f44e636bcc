"""Physics checks on benchmark rows: no recorded rate may pass what the hardware can do.

A row (kernels.benchmarks.rows.row) is rated against a ceiling measured in its own run: the
1:1 device copy for GB/s, torch's matmul in its dtype for TFLOP/s. Those ceilings are what the
best program we know reached, not roofs, so a row may pass one, but only with a reason declared
next to the benchmark that makes it (the row's "above_roof", or for rows recorded before that
field existed the benchmark module's ABOVE_ROOF table). No reason excuses a rate above the
GPU's datasheet peak. A GPU without a DATASHEET entry gets the measured-ceiling check only.
"""

import json
import re
from pathlib import Path

RATE_UNITS = ("GB/s", "TFLOP/s")  # rows in tok/s have no roof

# Peaks from NVIDIA's Tensor Core GPU datasheets, SXM columns (nvidia.com/h200, nvidia.com/h100),
# keyed by bench.gpu_slug of the device name. The datasheets' tensor-core figures assume 2:4
# structured sparsity; a dense matmul gets half of each.
DATASHEET = {
    "h200": {
        "hbm_gbps": 4800.0,  # "GPU memory bandwidth 4.8TB/s" (HBM3e)
        "tflops": {
            "bf16": 989.5,  # "BF16 Tensor Core 1,979 TFLOPS" with sparsity: 989.5 dense
            "fp16": 989.5,  # "FP16 Tensor Core 1,979 TFLOPS" with sparsity: 989.5 dense
            "tf32": 494.5,  # "TF32 Tensor Core 989 TFLOPS" with sparsity: 494.5 dense
            "fp32": 67.0,  # "FP32 67 TFLOPS": CUDA cores, no tensor cores (IEEE fp32 matmul too)
        },
    },
    # "NVIDIA H100 80GB HBM3" is the SXM part (the PCIe card's HBM2e runs at 2 TB/s): the same
    # SMs and clocks as the H200, so the same compute peaks, with less and slower memory
    "h100-80gb-hbm3": {
        "hbm_gbps": 3350.0,  # "GPU memory bandwidth 3.35TB/s"
        "tflops": {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0},  # as the H200's
    },
}


def describe(gpu: str) -> str:
    """Which checks rows recorded on `gpu` get, in one line."""
    if gpu in DATASHEET:
        return f"physics: rows checked against their measured ceilings and the {gpu} datasheet"
    return (
        f"physics: no datasheet figures for {gpu!r}: rows checked against their measured "
        "ceilings only (add its peaks to kernels.roofs.DATASHEET)"
    )


def _find(data, wanted, where=""):
    """(location, dict) for each dict in `data` that `wanted` accepts, not looking inside it."""
    if isinstance(data, dict):
        if wanted(data):
            yield where, data
            return
        for key, value in data.items():
            yield from _find(value, wanted, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _find(value, wanted, f"{where}[{i}]")


def benchmark_rows(data):
    """(location, row) for every benchmark row inside `data` (a bench run, a chapter's JSON or
    one recorded value): any dict with a unit in GB/s or TFLOP/s, a rate and a % of ceiling."""
    is_row = lambda d: d.get("unit") in RATE_UNITS and {"rate", "pct_of_ceiling"} <= set(d)
    return _find(data, is_row)


def check(data, source: str, gpu: str, declared=()) -> list[str]:
    """The physics problems in `data` recorded on `gpu`, one line each naming the file and row
    (`source` names the file), the value and its roof; [] when there are none. `declared`:
    (name pattern, unit, reason) for rows recorded before rows carried their own reason
    (`kernels.benchmarks.ABOVE_ROOF`, passed in by the callers that read recorded files)."""
    peaks = DATASHEET.get(gpu)
    problems = []
    at = lambda where: source + ("" if where.startswith("[") else " ") + where
    for where, r in benchmark_rows(data):
        problems += _check_row(r, f"{at(where)} {r.get('name', '?')!r}", peaks, declared)
    for where, ceilings in _ceilings(data):
        problems += _check_ceilings(ceilings, at(where), peaks)
    return problems


def check_file(path, declared=()) -> list[str]:
    """check() on a recorded JSON file; its folder names the GPU (kernels/data/<gpu>/)."""
    path = Path(path)
    data = json.loads(path.read_text())
    return check(data, f"{path.parent.name}/{path.name}", path.parent.name, declared)


def reason(r: dict, declared=()) -> str | None:
    """Why row `r` may pass its measured ceiling: the row's own "above_roof", else the reason
    `declared` gives for rows of that name and unit; None if neither gives one."""
    if r.get("above_roof"):
        return r["above_roof"]
    for pattern, unit, why in declared:
        if unit == r["unit"] and re.fullmatch(pattern, r.get("name", "")):
            return why
    return None


def dtype_of(r: dict, peaks: dict) -> str:
    """A TFLOP/s row's dtype: its "dtype", else the dtype its name gives ("fp32 tf32" is tf32),
    else the dtype of the GPU's highest peak: the loosest bound, never a false alarm."""
    if r.get("dtype"):
        return r["dtype"]
    words = r.get("name", "").split()
    for dtype in ("tf32", "bf16", "fp16", "fp32"):
        if dtype in words:
            return dtype
    return max(peaks["tflops"], key=peaks["tflops"].get)


def _check_row(r, label, peaks, declared) -> list[str]:
    rate, pct, unit = r["rate"], r["pct_of_ceiling"], r["unit"]
    problems = []
    if pct is not None and pct > 100 and not reason(r, declared):
        ceiling = "copy ceiling" if unit == "GB/s" else "matmul ceiling"
        problems.append(
            f"{label}: {rate:.1f} {unit} is {pct:.1f}% of its run's measured {ceiling} "
            f"({100 * rate / pct:.1f} {unit}), and the row gives no reason (above_roof)"
        )
    if peaks is None:
        return problems
    if unit == "GB/s":
        peak, what = peaks["hbm_gbps"], "HBM bandwidth"
    else:
        dtype = dtype_of(r, peaks)
        if dtype not in peaks["tflops"]:
            return problems + [f"{label}: the datasheet gives no {dtype} peak to check it against"]
        peak, what = peaks["tflops"][dtype], f"{dtype} peak"
    if rate > peak:
        problems.append(
            f"{label}: {rate:.1f} {unit} is above the datasheet's {what} ({peak:.1f} {unit}); "
            "no reason excuses that"
        )
    return problems


def _ceilings(data):
    """(location, ceilings) for every measured-ceilings dict inside `data`."""
    for where, found in _find(data, lambda d: {"copy_gbps", "matmul_tflops"} <= set(d)):
        yield where or "ceilings", found


def _check_ceilings(ceilings, label, peaks) -> list[str]:
    """A measured ceiling is itself a rate: none may pass the datasheet."""
    if peaks is None:
        return []
    measured = [("copy", ceilings["copy_gbps"], peaks["hbm_gbps"], "GB/s")]
    for dtype, tflops in ceilings["matmul_tflops"].items():
        if dtype in peaks["tflops"]:
            measured.append((f"{dtype} matmul", tflops, peaks["tflops"][dtype], "TFLOP/s"))
    return [
        f"{label}: measured {name} {value:.1f} {unit} is above the datasheet's {peak:.1f} {unit}"
        for name, value, peak, unit in measured
        if value > peak
    ]
