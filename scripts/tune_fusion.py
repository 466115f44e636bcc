"""Tune Chapter 2's memory-bound kernels on a GPU: where their time goes and which launch
settings move the most bytes per second.

    python scripts/tune_fusion.py [--json OUT]    # the H200's: kernels/data/h200/tune_fusion.json

Every candidate is checked against the reference first, then timed twice: as called
(`bench.time_ms`, launch overhead included) and replayed from a CUDA graph (the GPU's time
alone); the gap between the two is the Python cost of the call. Rates are GB/s of the minimum
bytes (read x, write y) and % of the copy bandwidth measured in the same run.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import kernels  # noqa: F401, I001  (fixes the mode before kernels are defined)
import torch
import triton
import triton.language as tl

from kernels import bench, check, elementwise, norm, softmax
from kernels.runtime import DEVICE, ON_GPU


def report(table, name, nbytes, ms, copy_gbps, **extra):
    rate = bench.achieved_gbps(nbytes, ms)
    row = {"name": name, "ms": ms, "gbps": rate, "pct_copy": 100 * rate / copy_gbps, **extra}
    table.append(row)
    more = " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    print(f"  {name:48} {1e3 * ms:9.1f} us {rate:7.0f} GB/s {row['pct_copy']:5.1f}%  {more}")


# --- overhead: host time per call and do_bench against graph replay -----------------------
def overhead(results, copy_gbps):
    import torch.nn.functional as F

    print("\nHost cost per call, tiny input (1 x 4096 bf16), and 4096x4096 bf16 timed two ways")
    ops = {
        "add": (lambda x, w, b: elementwise.add(x, x), lambda x, w, b: torch.add(x, x)),
        "bias_gelu": (lambda x, w, b: elementwise.bias_gelu(x, b), lambda x, w, b: F.gelu(x + b)),
        "softmax": (lambda x, w, b: softmax.softmax(x), lambda x, w, b: torch.softmax(x, -1)),
        "rms_norm": (
            lambda x, w, b: norm.rms_norm(x, w),
            lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
        ),
        "layer_norm": (
            lambda x, w, b: norm.layer_norm(x, w, b),
            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        ),
    }
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn_like(w)
    tiny = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    big = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    rows = results.setdefault("overhead", [])
    for name, (ours, theirs) in ops.items():
        row = {
            "op": name,
            "host_us_ours": bench.cpu_us_per_call(lambda: ours(tiny, w, b)),
            "host_us_torch": bench.cpu_us_per_call(lambda: theirs(tiny, w, b)),
            "bench_ms_ours": bench.time_ms(ours, big, w, b),
            "graph_ms_ours": bench.graph_ms(lambda: ours(big, w, b)),
            "bench_ms_torch": bench.time_ms(theirs, big, w, b),
            "graph_ms_torch": bench.graph_ms(lambda: theirs(big, w, b)),
        }
        rows.append(row)
        print(
            "  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else v for k, v in row.items())
        )
    # the pieces of a call, on the tiny input
    pieces = {
        "check_tensor": lambda: norm._check(tiny, 1e-6, weight=w),
        "torch.empty": lambda: torch.empty(tiny.shape, dtype=tiny.dtype, device=tiny.device),
        "raw rms launch": lambda: norm.rms_norm_fwd_kernel[(1,)](
            tiny, w, out, rstd, 4096, 4096, 4096, 1e-6, BLOCK=4096, num_warps=8
        ),
        "_forward": lambda: norm._forward(tiny, w, None, 1e-6),
        "Function.apply": lambda: norm.RMSNormFunction.apply(tiny, w, 1e-6),
    }
    out = torch.empty_like(tiny)
    rstd = torch.empty(1, device=DEVICE)
    results["pieces_us"] = {k: bench.cpu_us_per_call(f) for k, f in pieces.items()}
    print("  pieces (host us):", {k: round(v, 1) for k, v in results["pieces_us"].items()})


# --- norms ---------------------------------------------------------------------------------
def norms_forward(results, copy_gbps):
    print("\nNorm forward, raw kernel in a CUDA graph, num_warps swept (bf16)")
    table = results.setdefault("norm_fwd", [])
    for m, n in ((4096, 4096), (16384, 4096), (16384, 8192)):
        x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        w, b = (
            torch.randn(n, device=DEVICE, dtype=x.dtype),
            torch.randn(n, device=DEVICE, dtype=x.dtype),
        )
        y, mean, rstd = (
            torch.empty_like(x),
            torch.empty(m, device=DEVICE),
            torch.empty(m, device=DEVICE),
        )
        block = triton.next_power_of_2(n)
        for warps in (2, 4, 8, 16, 32):
            rms = lambda: norm.rms_norm_fwd_kernel[(m,)](
                x, w, y, rstd, n, n, n, 1e-6, BLOCK=block, num_warps=warps
            )
            ln = lambda: norm.layer_norm_fwd_kernel[(m,)](
                x, w, b, y, mean, rstd, n, n, n, 1e-5, BLOCK=block, num_warps=warps
            )
            for name, fn, ref in (
                ("rms", rms, lambda: norm.rms_norm_ref(x, w)),
                ("ln", ln, lambda: norm.layer_norm_ref(x, w, b)),
            ):
                fn()
                ok = check.compare(y, ref(), op="reduction", dtype=x.dtype).ok
                report(
                    table,
                    f"{name} {m}x{n} w{warps}",
                    2 * x.numel() * 2,
                    bench.graph_ms(fn),
                    copy_gbps,
                    ok=ok,
                    op=name,
                    shape=f"{m}x{n}",
                    warps=warps,
                )
        compiled = {
            "rms": torch.compile(lambda: norm.rms_norm_ref(x, w)),
            "ln": torch.compile(lambda: torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)),
        }
        for name, fn in compiled.items():
            report(
                table,
                f"{name} {m}x{n} torch.compile",
                2 * x.numel() * 2,
                bench.graph_ms(fn),
                copy_gbps,
                op=name + " compile",
                shape=f"{m}x{n}",
            )


def norms_backward(results, copy_gbps, sms):
    print("\nNorm backward (main kernel), programs per SM and num_warps swept (bf16)")
    table = results.setdefault("norm_bwd", [])
    for m, n in ((4096, 4096), (16384, 8192)):
        x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        dy, w = torch.randn_like(x), torch.randn(n, device=DEVICE, dtype=x.dtype)
        _, x2, mean, rstd = norm._forward(x, w, None, 1e-6)
        dx = torch.empty_like(x)
        block = triton.next_power_of_2(n)
        for per_sm in (1, 2, 4, 8, 16):
            rows_per = triton.cdiv(m, per_sm * sms)
            programs = triton.cdiv(m, rows_per)
            part = torch.empty((programs, n), device=DEVICE)
            for warps in (4, 8, 16):
                fn = lambda: norm.norm_bwd_kernel[(programs,)](
                    dy,
                    x2,
                    w,
                    mean,
                    rstd,
                    dx,
                    part,
                    part,
                    m,
                    n,
                    n,
                    n,
                    n,
                    rows_per,
                    BLOCK=block,
                    LAYER_NORM=False,
                    num_warps=warps,
                )
                report(
                    table,
                    f"rms bwd {m}x{n} {per_sm}/SM w{warps}",
                    3 * x.numel() * 2,
                    bench.graph_ms(fn),
                    copy_gbps,
                    shape=f"{m}x{n}",
                    per_sm=per_sm,
                    warps=warps,
                )
        xr = x.detach().requires_grad_()
        wr = w.detach().requires_grad_()
        f = torch.compile(lambda x, w: norm.rms_norm_ref(x, w))
        fwd_bwd = lambda: torch.autograd.grad(f(xr, wr), (xr, wr), dy)
        report(
            table,
            f"rms fwd+bwd {m}x{n} torch.compile (5 tensor passes)",
            5 * x.numel() * 2,
            bench.time_ms(fwd_bwd),
            copy_gbps,
            shape=f"{m}x{n}",
        )


# --- softmax -------------------------------------------------------------------------------
def softmax_sweep(results, copy_gbps):
    print("\nSoftmax, bf16, 2^26 elements per shape")
    table = results.setdefault("softmax", [])
    for n in (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144):
        m = (1 << 26) // n
        x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        ref = softmax.softmax_ref(x)
        nbytes = 2 * x.numel() * 2
        args = (x, out, n, n, n)
        candidates = {}
        if n <= 65536:
            for warps in (4, 8, 16, 32):
                candidates[f"row w{warps}"] = lambda warps=warps: softmax.softmax_row_kernel[(m,)](
                    *args, BLOCK=n, num_warps=warps
                )
        if n >= 16384:
            for block in (2048, 4096, 8192):
                for warps in (4, 8, 16):
                    candidates[f"streamed b{block} w{warps}"] = lambda block=block, warps=warps: (
                        softmax.softmax_streamed_kernel[(m,)](*args, BLOCK=block, num_warps=warps)
                    )
        for name, fn in candidates.items():
            out.zero_()
            try:
                fn()
            except Exception as exc:  # out of registers or shared memory
                print(f"  {n} {name}: {type(exc).__name__} {str(exc)[:80]}")
                continue
            ok = check.compare(out, ref, op="reduction", dtype=x.dtype).ok
            report(
                table, f"softmax {m}x{n} {name}", nbytes, bench.graph_ms(fn), copy_gbps, ok=ok, n=n
            )
        compiled = torch.compile(lambda: torch.softmax(x, -1))
        report(
            table,
            f"softmax {m}x{n} torch.compile",
            nbytes,
            bench.graph_ms(compiled),
            copy_gbps,
            n=n,
        )
        report(
            table,
            f"softmax {m}x{n} torch.softmax",
            nbytes,
            bench.graph_ms(lambda: torch.softmax(x, -1)),
            copy_gbps,
            n=n,
        )


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
        y = 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif MODE == "fast":
        y = 0.5 * z * (1.0 + _erf_fast(z * 0.7071067811865476))
    else:  # "none": bias only, the bytes without the GELU's instructions
        y = z
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu_variants(results, copy_gbps):
    print("\nbias + GELU, 16384x8192")
    table = results.setdefault("bias_gelu", [])
    for dtype in (torch.bfloat16, torch.float32):
        m, n = 16384, 8192
        x = torch.randn(m, n, device=DEVICE, dtype=dtype)
        b = torch.randn(n, device=DEVICE, dtype=dtype)
        out = torch.empty_like(x)
        ref = elementwise.bias_gelu_ref(x.double(), b.double())
        nbytes = 2 * x.numel() * x.element_size()
        tag = str(dtype).removeprefix("torch.")
        for block in (1024, 2048, 4096):
            for warps in (4, 8):
                fn = lambda block=block, warps=warps: elementwise.bias_gelu_kernel[
                    (triton.cdiv(x.numel(), block),)
                ](x, b, out, x.numel(), n, BLOCK_SIZE=block, num_warps=warps)
                fn()
                ok = check.compare(out, ref, op="elementwise", dtype=dtype).ok
                report(
                    table,
                    f"{tag} flat b{block} w{warps}",
                    nbytes,
                    bench.graph_ms(fn),
                    copy_gbps,
                    ok=ok,
                )
        for mode in ("erf", "fast", "none"):
            for bm, bn, warps in ((1, 1024, 4), (4, 1024, 4), (8, 1024, 8)):
                grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
                fn = lambda bm=bm, bn=bn, warps=warps, mode=mode, grid=grid: bias_gelu_tiles[grid](
                    x, b, out, m, n, BLOCK_M=bm, BLOCK_N=bn, MODE=mode, num_warps=warps
                )
                fn()
                ok = (
                    check.compare(out, ref, op="elementwise", dtype=dtype).ok
                    if mode != "none"
                    else None
                )
                report(
                    table,
                    f"{tag} tiles {mode} {bm}x{bn} w{warps}",
                    nbytes,
                    bench.graph_ms(fn),
                    copy_gbps,
                    ok=ok,
                )
        compiled = torch.compile(lambda: torch.nn.functional.gelu(x + b))
        report(table, f"{tag} torch.compile", nbytes, bench.graph_ms(compiled), copy_gbps)
        report(table, f"{tag} x.clone()", nbytes, bench.graph_ms(lambda: x.clone()), copy_gbps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", nargs="*", help="sections to run (default: all)")
    args = parser.parse_args(argv)
    if not ON_GPU:
        print("tune_fusion needs a GPU: the interpreter's timings mean nothing")
        return 1
    ceilings = bench.measure_ceilings()
    copy = ceilings["copy_gbps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, {sms} SMs")
    results = {"ceilings": ceilings}
    meta = {**kernels.runtime.versions(), "date": datetime.date.today().isoformat()}
    sections = {
        "overhead": lambda: overhead(results, copy),
        "norm_fwd": lambda: norms_forward(results, copy),
        "norm_bwd": lambda: norms_backward(results, copy, sms),
        "softmax": lambda: softmax_sweep(results, copy),
        "bias_gelu": lambda: bias_gelu_variants(results, copy),
    }
    for name, section in sections.items():
        if args.only and name not in args.only:
            continue
        try:
            section()
        except Exception as exc:  # keep the other sections' numbers
            print(f"section {name} failed: {type(exc).__name__}: {exc}")
        if args.json:
            record = {"meta": meta, "results": results}  # the layout of kernels/data/<gpu>/*.json
            Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
