"""The roofline model and the one roofline plot every chapter uses.

A kernel that does F FLOPs and moves B bytes (read plus written) cannot finish faster than
max(F / peak_flops, B / bandwidth). Its arithmetic intensity is F / B; the ridge point,
peak_flops / bandwidth, is the intensity above which compute, not memory, sets the time.

A roof is the rate of the best program that measures it (`best_roofs`): a roof that one of the
course's own kernels beats is no roof. The datasheet's peaks (`datasheet_ceilings`) are drawn
beside the measured ones, never instead of them.
"""

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
            roof = np.minimum(ceilings["copy_gbps"] * x / 1e3, _peak(ceilings, dtype))
            ax.loglog(
                x,
                roof,
                color=color,
                linestyle=["-", "--", ":"][j % 3],
                label=f"{label} {dtype} (ridge {ridge_point(ceilings, dtype):.0f} FLOP/B)",
            )
        for p in points.get(label, ()):
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
