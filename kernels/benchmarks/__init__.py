"""`python -m kernels bench`: the machine's ceilings, then every kernel against its baselines,
on the same inputs in the same run. One module per chapter; each chapter's benchmarks are
named in BENCHMARKS.

A benchmark is a function (ceilings) -> list of rows (built by `row`):
{"name", "ms", "unit": "GB/s" | "TFLOP/s" | "tok/s" | "us/call" (host time), "rate",
"pct_of_ceiling",
"baselines": {name: ms}}. A run is {"ceilings", "rows", "meta"} (and "runs" once merged); the
run recorded on the course's GPU is kernels/data/<gpu>/bench.json.
"""

import datetime
import json
import sys
from pathlib import Path

from kernels import bench, roofs, runtime
from kernels.benchmarks import batch_invariant, fusion, matmul, regimes
from kernels.benchmarks.attention import bench_attention
from kernels.benchmarks.batch_invariant import bench_batch_invariant
from kernels.benchmarks.decode import bench_decode
from kernels.benchmarks.fusion import bench_add, bench_fusion, bench_norm_backward, bench_softmax
from kernels.benchmarks.matmul import bench_matmul
from kernels.benchmarks.overhead import bench_overhead
from kernels.benchmarks.regimes import bench_regimes
from kernels.benchmarks.rows import row
from kernels.benchmarks.shapes import bench_shapes

__all__ = [
    "BENCHMARKS",
    "ABOVE_ROOF",
    "run",
    "merge",
    "format_table",
    "row",
    "recorded_path",
    "main",
]

BENCHMARKS = {
    "add": bench_add,
    "regimes": bench_regimes,
    "matmul": bench_matmul,
    "fusion": bench_fusion,
    "softmax": bench_softmax,
    "norm_backward": bench_norm_backward,
    "attention": bench_attention,
    "batch_invariant": bench_batch_invariant,
    "overhead": bench_overhead,
    "decode": bench_decode,
    "shapes": bench_shapes,
}

# Recorded rows that may pass their measured ceiling, and why, from each chapter's module:
# (name pattern, unit, reason), for rows recorded before each row carried its "above_roof".
ABOVE_ROOF = fusion.ABOVE_ROOF + regimes.ABOVE_ROOF + matmul.ABOVE_ROOF + batch_invariant.ABOVE_ROOF


def run(names=None, ceilings=None):
    """Measure the ceilings (unless given) and the named benchmarks (default: all)."""
    unknown = set(names or ()) - set(BENCHMARKS)
    if unknown:
        raise ValueError(f"unknown benchmarks {sorted(unknown)}; known: {sorted(BENCHMARKS)}")
    ceilings = ceilings or bench.measure_ceilings()
    rows = []
    for name in names or BENCHMARKS:
        rows.extend(BENCHMARKS[name](ceilings))
    return {"ceilings": ceilings, "rows": rows}


def merge(earlier, later):
    """Rows of two bench runs in one result: `later`'s rows replace `earlier`'s of the same
    name. Each row's % of ceiling and baselines come from its own run; "runs" keeps every
    run's ceilings and metadata, and the top-level ceilings and meta are the latest run's."""
    names = {r["name"] for r in later["rows"]}
    runs = earlier.get("runs") or [_run_summary(earlier)]
    return {
        **later,
        "rows": [r for r in earlier["rows"] if r["name"] not in names] + later["rows"],
        "runs": runs + [_run_summary(later)],
    }


def _run_summary(result):
    return {
        "ceilings": result["ceilings"],
        "meta": result.get("meta", {}),
        "rows": [r["name"] for r in result["rows"]],
    }


def format_table(result) -> str:
    c = result["ceilings"]
    lines = [
        f"copy bandwidth {c['copy_gbps']:.0f} GB/s; matmul "
        + ", ".join(f"{k} {v:.1f}" for k, v in c["matmul_tflops"].items())
        + " TFLOP/s"
    ]
    if result["rows"]:
        lines.append(f"{'kernel':32} {'ms':>9} {'rate':>16} {'% ceiling':>10}  vs baselines")
        for r in result["rows"]:
            vs = ", ".join(f"{b} {ms / r['ms']:.2f}x" for b, ms in r["baselines"].items())
            pct = r["pct_of_ceiling"]
            pct = f"{pct:9.1f}%" if pct is not None else " " * 10  # None: no ceiling applies
            lines.append(
                f"{r['name']:32} {r['ms']:9.4f} {r['rate']:9.1f} {r['unit']:>7} {pct}  {vs}"
            )
        lines.append(
            "(vs baselines: baseline time / kernel time; above 1 means the kernel is faster)"
        )
    return "\n".join(lines)


def recorded_path(gpu: str = bench.RECORDED_GPU) -> Path:
    """Where the benchmark run recorded on `gpu` lives."""
    return bench.DATA_DIR / gpu / "bench.json"


def main(names=(), json_path=None, update=False) -> int:
    """The `bench` command. On a GPU: run the named benchmarks (default: all), print the table
    and, with `json_path`, write the run there (with `update`, merged into the run already in
    that file). On a CPU the interpreter's timings would mean nothing: print the run recorded
    on the course's GPU instead (and write it to `json_path`). A run with a row that breaks
    physics (kernels.roofs) is printed but not written, and the exit status is 1."""
    if not runtime.ON_GPU:
        path = recorded_path()
        print(
            "No GPU here: Triton runs in its interpreter on a CPU, so kernel timings would "
            "mean nothing."
        )
        if not path.exists():
            print(f"No recorded results yet ({path.name}): run `make gpu-record` on a GPU.")
            return 0
        result = json.loads(path.read_text())
        print(f"Recorded results from {bench.describe(result['meta'])}:\n")
    else:
        result = run(list(names) or None)
        result["meta"] = {**runtime.versions(), "date": datetime.date.today().isoformat()}
        if update and json_path and Path(json_path).exists():
            result = merge(json.loads(Path(json_path).read_text()), result)
    print(format_table(result))
    gpu = bench.gpu_slug(result["meta"]["device"])
    print(roofs.describe(gpu))
    problems = roofs.check(result, Path(json_path or "bench.json").name, gpu, ABOVE_ROOF)
    if problems:
        refused = f"NOT written to {json_path}: " if json_path else ""
        print(
            f"{refused}{len(problems)} physics problems (a rate above its roof: declare a true "
            "reason next to the benchmark that makes the row, or find the bug):",
            *problems,
            sep="\n  ",
            file=sys.stderr,
        )
        return 1
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {json_path}")
    return 0
