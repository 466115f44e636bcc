"""The roofline model and the one roofline plot every chapter uses.

A kernel that does F FLOPs and moves B bytes (read plus written) cannot finish faster than
max(F / peak_flops, B / bandwidth). Its arithmetic intensity is F / B; the ridge point,
peak_flops / bandwidth, is the intensity above which compute, not memory, sets the time.

A roof is the rate of the best program that measures it (`best_roofs`): a roof that one of the
course's own kernels beats is no roof. The datasheet's peaks (`datasheet_ceilings`) are drawn
beside the measured ones, never instead of them.

A live number that breaks the model says so: ceilings a CPU cannot be that slow at, and a
point above its roofline, are printed as warnings naming why (`implausible_cpu_ceilings`,
`above_roof`).
"""

import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np


@dataclass(frozen=True)
class RooflinePoint:
    """A measured workload: its FLOPs, bytes moved and median time."""

    name: str
    flops: float
    bytes_moved: float
    ms: float

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def tflops(self) -> float:
        return self.flops / self.ms / 1e9


def _peak(ceilings: dict, dtype: str) -> float:
    try:
        return ceilings["matmul_tflops"][dtype]
    except KeyError:
        raise ValueError(
            f"ceilings have no {dtype!r} matmul rate; they have "
            f"{sorted(ceilings.get('matmul_tflops', {}))}"
        ) from None


def best_roofs(ceilings: dict) -> dict:
    """The roofs to draw from measured ceilings (kernels.bench.measure_ceilings), in the same
    {"copy_gbps", "matmul_tflops"} shape: per dtype the faster of torch's matmul and, where
    measured (on a GPU), the course's own FMA loop at its plateau (`fma_tflops`): in fp32 a
    cuBLAS SGEMM is not pure FMAs and stays below the loop. Bandwidth stays the 1:1 copy, the
    stream an elementwise kernel that reads as much as it writes can reach (a read-mostly stream,
    `add_gbps`, goes a few percent past it: the memory turns from reading to writing less often)."""
    tflops = dict(ceilings["matmul_tflops"])
    for dtype, rate in ceilings.get("fma_tflops", {}).items():
        tflops[dtype] = max(rate, tflops.get(dtype, 0.0))
    return {"copy_gbps": ceilings["copy_gbps"], "matmul_tflops": tflops}


def datasheet_ceilings(gpu: str) -> dict:
    """The datasheet's peaks of `gpu` (a kernels.bench.gpu_slug, e.g. "h200") in the shape of
    measured ceilings, to draw beside them: HBM bandwidth and dense peaks per dtype."""
    from kernels.roofs import DATASHEET

    if gpu not in DATASHEET:
        raise ValueError(f"no datasheet figures for {gpu!r}; known: {sorted(DATASHEET)}")
    peaks = DATASHEET[gpu]
    return {"copy_gbps": peaks["hbm_gbps"], "matmul_tflops": dict(peaks["tflops"])}


def ridge_point(ceilings: dict, dtype: str = "fp32") -> float:
    """FLOPs per byte at which the bandwidth roof meets the compute roof."""
    return _peak(ceilings, dtype) * 1e12 / (ceilings["copy_gbps"] * 1e9)


def predicted_ms(flops: float, bytes_moved: float, ceilings: dict, dtype: str = "fp32"):
    """(lower-bound milliseconds, regime) from the roofline: 'memory-bound' or 'compute-bound'."""
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"flops and bytes_moved must be >= 0, got {flops}, {bytes_moved}")
    compute_ms = flops / (_peak(ceilings, dtype) * 1e9)
    memory_ms = bytes_moved / (ceilings["copy_gbps"] * 1e6)
    if compute_ms >= memory_ms:
        return compute_ms, "compute-bound"
    return memory_ms, "memory-bound"


# Below these, a live CPU ceiling is not the machine's but a busy machine's: one core of any
# CPU of the last twenty years copies several GB/s and multiplies fp32 at over 1 GFLOP/s.
CPU_FLOORS = {"copy_gbps": 1.0, "fp32_tflops": 1e-3}
BUSY = "the machine is busy (other processes, or threads waiting for each other)"


def implausible_cpu_ceilings(ceilings: dict) -> list[str]:
    """Why ceilings measured live on a CPU cannot be its own, one line each ([] if plausible)."""
    problems = []
    copy, fp32 = ceilings["copy_gbps"], ceilings["matmul_tflops"].get("fp32")
    if copy < CPU_FLOORS["copy_gbps"]:
        problems.append(
            f"this CPU's copy ran at {copy:.2g} GB/s, below {CPU_FLOORS['copy_gbps']:g} GB/s, "
            f"which one core of any recent CPU beats: {BUSY}"
        )
    if fp32 is not None and fp32 < CPU_FLOORS["fp32_tflops"]:
        problems.append(
            f"this CPU's fp32 matmul ran at {fp32 * 1e3:.2g} GFLOP/s, below "
            f"{CPU_FLOORS['fp32_tflops'] * 1e3:g} GFLOP/s, which one core of any recent CPU "
            f"beats: {BUSY}"
        )
    return problems


def above_roof(point: RooflinePoint, ceilings: dict, dtypes=("fp32",), slack: float = 1.05):
    """Why `point` cannot be right against these ceilings, or None: faster than the roofline
    allows (by more than `slack`) under every dtype's roof in `dtypes` that the ceilings have."""
    drawn = [d for d in dtypes if d in ceilings["matmul_tflops"]]
    if not drawn:
        return None
    best_ms, regime = min(predicted_ms(point.flops, point.bytes_moved, ceilings, d) for d in drawn)
    if point.ms * slack >= best_ms:
        return None
    return (
        f"{point.name}: {point.tflops:.3g} TFLOP/s at {point.intensity:.3g} FLOP/B is "
        f"{best_ms / point.ms:.2f}x above its roofline ({regime} there). Either the ceilings "
        f"were measured low ({BUSY}, or a better program than the one that measured them "
        "exists) or the point's FLOP or byte count is wrong"
    )


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _roof_tflops(ceilings: dict, dtype: str, intensity):
    """The roofline's TFLOP/s at each arithmetic intensity: min(bandwidth * I, peak)."""
    return np.minimum(ceilings["copy_gbps"] * intensity / 1e3, _peak(ceilings, dtype))


def plot_roofline(machines: dict, points=(), dtypes=("fp32",), ax=None, title=None):
    """Draw each machine's roofline (bandwidth slope, then one flat roof per dtype) on
    log-log axes, and the measured `points`, given as {machine label: [RooflinePoint]} or a
    plain list (placed for the first machine). Returns the axes."""
    if not machines:
        raise ValueError("plot_roofline needs at least one machine's ceilings")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    if not isinstance(points, dict):
        points = {next(iter(machines)): list(points)}
    lo, hi = 1 / 64, 4096.0
    for machine_points in points.values():
        for p in machine_points:
            lo, hi = min(lo, p.intensity / 2), max(hi, p.intensity * 2)
    x = np.geomspace(lo, hi, 256)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, ceilings) in enumerate(machines.items()):
        color = colors[i % len(colors)]
        for j, dtype in enumerate(dtypes):
            if dtype not in ceilings["matmul_tflops"]:
                continue
            ax.loglog(
                x,
                _roof_tflops(ceilings, dtype, x),
                color=color,
                linestyle=["-", "--", ":"][j % 3],
                label=f"{label} {dtype} (ridge {ridge_point(ceilings, dtype):.0f} FLOP/B)",
            )
        for p in points.get(label, ()):
            problem = above_roof(p, ceilings, dtypes)
            if problem:
                _warn(f"{label}: {problem}")
            ax.plot(p.intensity, p.tflops, "o", color=color)
            ax.annotate(
                p.name,
                (p.intensity, p.tflops),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or "Roofline")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return ax


DATASHEET_STYLES = ("--", ":", "-.")  # one per dtype, in the order given


def plot_datasheet(ax, sheet: dict, dtypes=("fp32",), name: str = "datasheet"):
    """Beside measured roofs on `ax` (from plot_roofline), a datasheet's (`datasheet_ceilings`),
    in grey, dashed for the first dtype and dotted for the second: a line no real program
    reaches, drawn across the axes' current width. Returns the axes."""
    x = np.geomspace(*ax.get_xlim(), 256)
    for j, dtype in enumerate(dtypes):
        style = DATASHEET_STYLES[j % len(DATASHEET_STYLES)]
        ax.loglog(
            x, _roof_tflops(sheet, dtype, x), style, color="gray", lw=1, label=f"{name} {dtype}"
        )
    ax.legend(fontsize=7, loc="lower right")
    return ax
