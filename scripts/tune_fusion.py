"""Tune Chapter 2's memory-bound kernels on a GPU: where their time goes and which launch
settings move the most bytes per second.

    python scripts/tune_fusion.py [--json OUT] [--only SECTION ...]
    python scripts/tune_fusion.py --tiny    # the same run at tiny sizes; on a CPU too

The H200's run is kernels/data/h200/tune_fusion.json.

Every candidate is launched once on an output poisoned with NaN and checked against the fp64
reference; only a correct one is timed, replayed from a CUDA graph (the GPU's time alone). The
overhead section also times each op as called (`bench.time_ms`, launch overhead included): the
gap between the two is the Python cost of the call. Rates are GB/s of the minimum bytes (read x,
write y) and % of the copy bandwidth measured in the same run. The exit status is 1 if any
candidate was wrong or any section failed.

On a CPU (only with --tiny) the interpreter runs the kernels: CUDA graphs and the torch.compile
baselines are skipped, saying so, candidates are timed with `bench.time_ms`, and bf16 becomes
fp32 (the interpreter's bf16 is not the GPU's). Such a run checks the script, not the kernels'
speed.
"""

import argparse
import datetime
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import kernels  # noqa: F401, I001  (fixes the mode before kernels are defined)
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import bench, check, elementwise, norm, softmax
from kernels.primitives import INV_SQRT2, gelu
from kernels.runtime import DEVICE, ON_GPU, versions
from kernels.validate import check_row_vector, check_tensor


@dataclass(frozen=True)
class Sizes:
    """The shapes and launch settings each section sweeps."""

    overhead_shape: tuple  # the "big" input; the tiny one is a single row of the same width
    host_calls: int  # calls per host-time measurement
    norm_fwd_shapes: tuple
    norm_fwd_warps: tuple
    norm_bwd_shapes: tuple
    norm_bwd_per_sm: tuple  # programs per SM sharing the rows
    norm_bwd_warps: tuple
    softmax_elements: int  # per row length: rows = elements // length
    softmax_cols: tuple
    softmax_row_max: int  # longest row the one-pass kernel is tried at (held in registers)
    softmax_row_warps: tuple
    softmax_streamed_min: int  # shortest row the streamed kernel is tried at
    softmax_stream_blocks: tuple
    softmax_stream_warps: tuple
    bias_gelu_shape: tuple
    bias_gelu_flat: tuple  # (BLOCK_SIZE, num_warps) of the course's flat kernel
    bias_gelu_tiles: tuple  # (BLOCK_M, BLOCK_N, num_warps) of the 2-D tiles below


FULL = Sizes(
    overhead_shape=(4096, 4096),
    host_calls=2000,
    norm_fwd_shapes=((4096, 4096), (16384, 4096), (16384, 8192)),
    norm_fwd_warps=(2, 4, 8, 16, 32),
    norm_bwd_shapes=((4096, 4096), (16384, 8192)),
    norm_bwd_per_sm=(1, 2, 4, 8, 16),
    norm_bwd_warps=(4, 8, 16),
    softmax_elements=1 << 26,
    softmax_cols=(2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144),
    softmax_row_max=65536,
    softmax_row_warps=(4, 8, 16, 32),
    softmax_streamed_min=16384,
    softmax_stream_blocks=(2048, 4096, 8192),
    softmax_stream_warps=(4, 8, 16),
    bias_gelu_shape=(16384, 8192),
    bias_gelu_flat=tuple((block, warps) for block in (1024, 2048, 4096) for warps in (4, 8)),
    bias_gelu_tiles=((1, 1024, 4), (4, 1024, 4), (8, 1024, 8)),
)
# Odd widths (masked tails) and every branch of every section, a few programs per launch
TINY = Sizes(
    overhead_shape=(8, 96),
    host_calls=3,
    norm_fwd_shapes=((5, 96),),
    norm_fwd_warps=(2, 4),
    norm_bwd_shapes=((9, 96),),
    norm_bwd_per_sm=(1, 4),
    norm_bwd_warps=(4,),
    softmax_elements=768,
    softmax_cols=(96, 256),
    softmax_row_max=256,
    softmax_row_warps=(4, 8),
    softmax_streamed_min=128,
    softmax_stream_blocks=(32, 64),
    softmax_stream_warps=(4,),
    bias_gelu_shape=(7, 96),
    bias_gelu_flat=((64, 4), (128, 4)),
    bias_gelu_tiles=((1, 64, 4), (4, 32, 4)),
)


class Tuning:
    """One run: its sizes and dtype, the tables so far, and how many candidates were checked,
    found wrong and timed."""

    def __init__(self, sizes, dtype, copy_gbps, sms):
        self.sizes, self.dtype, self.copy_gbps, self.sms = sizes, dtype, copy_gbps, sms
        self.results = {}
        self.checked, self.timed, self.wrong = 0, 0, []

    def table(self, name):
        return self.results.setdefault(name, [])

    def time(self, fn):
        """The GPU's own time (a CUDA graph replay); a CPU has no graphs: time the call."""
        self.timed += 1
        return bench.graph_ms(fn) if ON_GPU else bench.time_ms(fn)


def report(run, table, name, nbytes, ms, **extra):
    rate = bench.achieved_gbps(nbytes, ms)
    row = {"name": name, "ms": ms, "gbps": rate, "pct_copy": 100 * rate / run.copy_gbps, **extra}
    run.table(table).append(row)
    more = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(f"  {name:48} {1e3 * ms:9.1f} us {rate:7.0f} GB/s {row['pct_copy']:5.1f}%  {more}")


def verified(run, name, comparison) -> bool:
    run.checked += 1
    if not comparison.ok:
        run.wrong.append(name)
        print(f"  {name:48} WRONG: {comparison.message}")
    return comparison.ok


def candidate(run, table, name, launch, verify, outputs, nbytes, **extra):
    """Launch once into poisoned `outputs`, check them with `verify()`; time only if correct."""
    for out in outputs:
        out.fill_(float("nan"))  # an element the kernel does not write shows as NaN
    try:
        launch()
    except Exception as exc:  # out of registers or shared memory on this GPU: say so, go on
        print(f"  {name:48} does not run: {type(exc).__name__} {str(exc)[:80]}")
        return
    if verified(run, name, verify()):
        report(run, table, name, nbytes, run.time(launch), **extra)


def baseline(run, table, name, fn, nbytes, **extra):
    """PyTorch's own op, timed the same way (not checked: it is the yardstick)."""
    if fn is not None:
        report(run, table, name, nbytes, run.time(fn), **extra)


def compiled(fn):
    """torch.compile(fn), compiled now so that its compile time stays out of the timing; None on
    a CPU, where each compile costs tens of seconds (see the note main prints)."""
    if not ON_GPU:
        return None
    fn = torch.compile(fn)
    fn()
    return fn


def fp64(*tensors):
    return [t.double() for t in tensors]


# --- overhead: host time per call and do_bench against graph replay -----------------------
# op: (the course's kernel, eager PyTorch, the reference run in fp64, tolerance class)
OVERHEAD_OPS = {
    "add": (
        lambda x, w, b: elementwise.add(x, x),
        lambda x, w, b: torch.add(x, x),
        lambda x, w, b: x + x,
        "elementwise",
    ),
    "bias_gelu": (
        lambda x, w, b: elementwise.bias_gelu(x, b),
        lambda x, w, b: F.gelu(x + b),
        lambda x, w, b: F.gelu(x + b),
        "elementwise",
    ),
    "softmax": (
        lambda x, w, b: softmax.softmax(x),
        lambda x, w, b: torch.softmax(x, -1),
        lambda x, w, b: torch.softmax(x, -1),
        "reduction",
    ),
    "rms_norm": (
        lambda x, w, b: norm.rms_norm(x, w),
        lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        lambda x, w, b: norm.rms_norm_ref(x, w),
        "reduction",
    ),
    "layer_norm": (
        lambda x, w, b: norm.layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        lambda x, w, b: norm.layer_norm_ref(x, w, b),
        "reduction",
    ),
}


def overhead(run):
    rows, cols = run.sizes.overhead_shape
    print(f"\nHost cost per call, tiny input (1 x {cols}), and {rows}x{cols} timed two ways")
    w = torch.randn(cols, device=DEVICE, dtype=run.dtype)
    b = torch.randn_like(w)
    tiny = torch.randn(1, cols, device=DEVICE, dtype=run.dtype)
    big = torch.randn(rows, cols, device=DEVICE, dtype=run.dtype)
    host_us = partial(bench.cpu_us_per_call, calls=run.sizes.host_calls)
    for name, (ours, theirs, ref, op) in OVERHEAD_OPS.items():
        expected = ref(*fp64(big, w, b))
        if not verified(run, name, check.compare(ours(big, w, b), expected, op=op)):
            continue
        row = {
            "op": name,
            "host_us_ours": host_us(partial(ours, tiny, w, b)),
            "host_us_torch": host_us(partial(theirs, tiny, w, b)),
            "bench_ms_ours": bench.time_ms(ours, big, w, b),
            "bench_ms_torch": bench.time_ms(theirs, big, w, b),
        }
        run.timed += 2
        if ON_GPU:
            row["graph_ms_ours"] = run.time(partial(ours, big, w, b))
            row["graph_ms_torch"] = run.time(partial(theirs, big, w, b))
        run.table("overhead").append(row)
        print(
            "  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else v for k, v in row.items())
        )
    # the pieces of a call, on the tiny input
    out = torch.empty_like(tiny)
    rstd = torch.empty(1, device=DEVICE)
    pieces = {
        "check_tensor": lambda: (check_tensor("x", tiny), check_row_vector("weight", w, tiny)),
        "torch.empty": lambda: torch.empty(tiny.shape, dtype=tiny.dtype, device=tiny.device),
        "raw rms launch": lambda: norm.rms_norm_fwd_kernel[(1,)](
            *(tiny, w, out, rstd, cols, cols, cols, 1e-6, tiny, out, cols),
            BLOCK=triton.next_power_of_2(cols),
        ),
        "rms_norm, no autograd": lambda: norm.rms_norm(tiny, w),
        "operator": lambda: norm.rms_norm_forward(tiny, w, 1e-6),
    }
    run.results["pieces_us"] = {k: host_us(f) for k, f in pieces.items()}
    print("  pieces (host us):", {k: round(v, 1) for k, v in run.results["pieces_us"].items()})


# --- norms ---------------------------------------------------------------------------------
def norms_forward(run):
    print(f"\nNorm forward, raw kernel, num_warps swept ({run.dtype})")
    for m, n in run.sizes.norm_fwd_shapes:
        _norm_forward_shape(run, m, n)


def _norm_forward_shape(run, m, n):
    x = torch.randn(m, n, device=DEVICE, dtype=run.dtype)
    w, b = torch.randn(2, n, device=DEVICE, dtype=x.dtype).unbind()
    y, (mean, rstd) = torch.empty_like(x), torch.empty(2, m, device=DEVICE).unbind()
    expected = {"rms": norm.rms_norm_ref(*fp64(x, w)), "ln": norm.layer_norm_ref(*fp64(x, w, b))}
    block = triton.next_power_of_2(n)
    nbytes = 2 * x.numel() * x.element_size()
    for warps in run.sizes.norm_fwd_warps:
        launches = {
            "rms": partial(
                norm.rms_norm_fwd_kernel[(m,)],
                *(x, w, y, rstd, n, n, n, 1e-6, x, y, n),
                BLOCK=block,
                num_warps=warps,
            ),
            "ln": partial(
                norm.layer_norm_fwd_kernel[(m,)],
                *(x, w, b, y, mean, rstd, n, n, n, 1e-5),
                BLOCK=block,
                num_warps=warps,
            ),
        }
        for op, launch in launches.items():
            verify = partial(check.compare, y, expected[op], op="reduction")
            name = f"{op} {m}x{n} w{warps}"
            shape = f"{m}x{n}"
            candidate(
                run, "norm_fwd", name, launch, verify, [y], nbytes, op=op, shape=shape, warps=warps
            )
    torch_ops = {
        "rms": compiled(lambda: norm.rms_norm_ref(x, w)),
        "ln": compiled(lambda: F.layer_norm(x, (n,), w, b, 1e-5)),
    }
    for op, fn in torch_ops.items():
        name = f"{op} {m}x{n} torch.compile"
        baseline(run, "norm_fwd", name, fn, nbytes, op=op + " compile", shape=f"{m}x{n}")


def norms_backward(run):
    print(f"\nNorm backward (main kernel), programs per SM and num_warps swept ({run.dtype})")
    for m, n in run.sizes.norm_bwd_shapes:
        _norm_backward_shape(run, m, n)


def _check_gradients(dx, dw_part, expected_dx, expected_dw):
    """dx as written, and dw as the sum of the programs' fp32 partial sums."""
    result = check.compare(dx, expected_dx, op="reduction")
    if not result.ok:
        return result
    return check.compare(dw_part.sum(0), expected_dw, op="reduction", dtype=dx.dtype)


def _norm_backward_shape(run, m, n):
    x = torch.randn(m, n, device=DEVICE, dtype=run.dtype)
    dy, w = torch.randn_like(x), torch.randn(n, device=DEVICE, dtype=x.dtype)
    rstd = torch.empty(m, device=DEVICE)  # fp32, one per row: what the forward keeps
    block = triton.next_power_of_2(n)
    y = torch.empty_like(x)
    norm.rms_norm_fwd_kernel[(m,)](x, w, y, rstd, n, n, n, 1e-6, x, y, n, BLOCK=block)
    x64, w64 = (t.double().requires_grad_() for t in (x, w))
    expected = torch.autograd.grad(norm.rms_norm_ref(x64, w64), (x64, w64), dy.double())
    dx = torch.empty_like(x)
    nbytes = 3 * x.numel() * x.element_size()  # read x and dy, write dx
    for per_sm in run.sizes.norm_bwd_per_sm:
        rows_per = triton.cdiv(m, per_sm * run.sms)
        programs = triton.cdiv(m, rows_per)
        part = torch.empty((programs, n), device=DEVICE)
        for warps in run.sizes.norm_bwd_warps:
            # RMSNorm has no mean: rstd stands in for it, as in the course's launcher
            launch = partial(
                norm.norm_bwd_kernel[(programs,)],
                *(dy, x, w, rstd, rstd, dx, part, part, m, n, n, n, n, rows_per),
                BLOCK=block,
                LAYER_NORM=False,
                num_warps=warps,
            )
            verify = partial(_check_gradients, dx, part, *expected)
            name = f"rms bwd {m}x{n} {per_sm}/SM w{warps}"
            extra = dict(shape=f"{m}x{n}", per_sm=per_sm, warps=warps)
            candidate(run, "norm_bwd", name, launch, verify, [dx, part], nbytes, **extra)
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    forward = compiled(lambda: norm.rms_norm_ref(xr, wr))  # the backward runs outside the graph
    fwd_bwd = None if forward is None else lambda: torch.autograd.grad(forward(), (xr, wr), dy)
    name = f"rms fwd+bwd {m}x{n} torch.compile (5 tensor passes)"
    baseline(run, "norm_bwd", name, fwd_bwd, 5 * x.numel() * x.element_size(), shape=f"{m}x{n}")


# --- softmax -------------------------------------------------------------------------------
def softmax_sweep(run):
    print(f"\nSoftmax, {run.dtype}, {run.sizes.softmax_elements} elements per shape")
    for n in run.sizes.softmax_cols:
        _softmax_shape(run, n)


def _softmax_shape(run, n):
    s = run.sizes
    m = max(1, s.softmax_elements // n)
    x = torch.randn(m, n, device=DEVICE, dtype=run.dtype)
    out = torch.empty_like(x)
    verify = partial(check.compare, out, softmax.softmax_ref(x.double()), op="reduction")
    nbytes = 2 * x.numel() * x.element_size()
    args = (x, out, n, n, n)
    row_args = (x, out, m, n, n, n)  # the row kernel also takes the row count
    candidates = {}
    if n <= s.softmax_row_max:
        for warps in s.softmax_row_warps:
            candidates[f"row w{warps}"] = partial(
                softmax.softmax_row_kernel[(m,)],
                *row_args,
                BLOCK_ROWS=1,
                BLOCK=triton.next_power_of_2(n),
                num_warps=warps,
            )
    if n >= s.softmax_streamed_min:
        for block in s.softmax_stream_blocks:
            for warps in s.softmax_stream_warps:
                candidates[f"streamed b{block} w{warps}"] = partial(
                    softmax.softmax_streamed_kernel[(m,)], *args, BLOCK=block, num_warps=warps
                )
    for name, launch in candidates.items():
        candidate(run, "softmax", f"softmax {m}x{n} {name}", launch, verify, [out], nbytes, n=n)
    torch_softmax = lambda: torch.softmax(x, -1)
    baseline(run, "softmax", f"softmax {m}x{n} torch.compile", compiled(torch_softmax), nbytes, n=n)
    baseline(run, "softmax", f"softmax {m}x{n} torch.softmax", torch_softmax, nbytes, n=n)


# --- bias + GELU -----------------------------------------------------------------------------
@triton.jit
def _erf_fast(u):
    # Abramowitz & Stegun 7.1.26: |error| < 1.5e-7, one exp and one reciprocal
    a = tl.abs(u)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    e = 1.0 - poly * tl.exp(-a * a)
    return tl.where(u < 0, -e, e)


@triton.jit
def bias_gelu_tiles(
    x_ptr,
    b_ptr,
    out_ptr,
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    z = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    z += tl.load(b_ptr + cols, mask=cols < n_cols).to(tl.float32)[None, :]
    if MODE == "erf":
        y = gelu(z)
    elif MODE == "fast":
        y = 0.5 * z * (1.0 + _erf_fast(z * INV_SQRT2))
    else:  # "none": bias only, the bytes without the GELU's instructions
        y = z
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu_variants(run):
    m, n = run.sizes.bias_gelu_shape
    print(f"\nbias + GELU, {m}x{n}")
    # bf16 and fp32 on a GPU; the interpreter's bf16 is not the GPU's, so a CPU runs fp32 only
    for dtype in dict.fromkeys((run.dtype, torch.float32)):
        _bias_gelu_dtype(run, m, n, dtype)


def _bias_gelu_dtype(run, m, n, dtype):
    x = torch.randn(m, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, device=DEVICE, dtype=dtype)
    out = torch.empty_like(x)
    z = x.double() + b.double()
    verify = {
        mode: partial(check.compare, out, expected, op="elementwise")
        for mode, expected in (("gelu", F.gelu(z)), ("none", z))
    }
    nbytes = 2 * x.numel() * x.element_size()
    tag = str(dtype).removeprefix("torch.")
    for block, warps in run.sizes.bias_gelu_flat:
        launch = partial(
            elementwise.bias_gelu_kernel[(triton.cdiv(x.numel(), block),)],
            *(x, b, out, x.numel(), n),
            BLOCK_SIZE=block,
            num_warps=warps,
        )
        name = f"{tag} flat b{block} w{warps}"
        candidate(run, "bias_gelu", name, launch, verify["gelu"], [out], nbytes)
    for mode in ("erf", "fast", "none"):
        for bm, bn, warps in run.sizes.bias_gelu_tiles:
            launch = partial(
                bias_gelu_tiles[(triton.cdiv(m, bm), triton.cdiv(n, bn))],
                *(x, b, out, m, n),
                BLOCK_M=bm,
                BLOCK_N=bn,
                MODE=mode,
                num_warps=warps,
            )
            name = f"{tag} tiles {mode} {bm}x{bn} w{warps}"
            check_as = verify["none" if mode == "none" else "gelu"]
            candidate(run, "bias_gelu", name, launch, check_as, [out], nbytes)
    torch_op = compiled(lambda: F.gelu(x + b))
    baseline(run, "bias_gelu", f"{tag} torch.compile", torch_op, nbytes)
    baseline(run, "bias_gelu", f"{tag} x.clone()", x.clone, nbytes)


SECTIONS = {
    "overhead": overhead,
    "norm_fwd": norms_forward,
    "norm_bwd": norms_backward,
    "softmax": softmax_sweep,
    "bias_gelu": bias_gelu_variants,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", nargs="*", choices=SECTIONS, help="sections (default: all)")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes: checks the script, on a CPU too"
    )
    args = parser.parse_args(argv)
    if not ON_GPU and not args.tiny:
        print("tune_fusion needs a GPU: the interpreter's timings mean nothing (--tiny runs)")
        return 1
    sizes = TINY if args.tiny else FULL
    small = {"copy_bytes": 1 << 24, "matmul_n": 256} if args.tiny else {}
    ceilings = bench.measure_ceilings(**small)
    copy = ceilings["copy_gbps"]
    if ON_GPU:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, {sms} SMs")
        run = Tuning(sizes, torch.bfloat16, copy, sms)
    else:
        print(
            f"No GPU: the interpreter runs the kernels (copy {copy:.0f} GB/s on this CPU). CUDA "
            "graphs and torch.compile baselines are GPU-only and skipped; candidates run in fp32 "
            "and are timed with bench.time_ms: the numbers check the script, not the speed."
        )
        run = Tuning(sizes, torch.float32, copy, sms=1)
    run.results["ceilings"] = ceilings
    meta = {**versions(), "date": datetime.date.today().isoformat()}
    failed = []
    for name, section in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        try:
            section(run)
        except Exception as exc:  # keep the other sections' numbers
            failed.append(name)
            print(f"section {name} failed: {type(exc).__name__}: {exc}")
        if args.json:
            record = {"meta": meta, "results": run.results}  # the layout of kernels/data/<gpu>/
            Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(
        f"\n{run.checked} candidates checked against the fp64 reference, {len(run.wrong)} wrong; "
        f"{run.timed} timings"
    )
    if run.wrong or failed:
        print(f"wrong: {run.wrong}; failed sections: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
