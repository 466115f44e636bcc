"""Pick kernels.matmul's autotuning configs on a GPU: check, then time, every candidate config
on the benchmark's shapes, against torch.matmul (cuBLAS) on the same inputs.

    python scripts/tune_matmul.py                   # bf16 and fp16, all candidates
    python scripts/tune_matmul.py --dtypes bf16 --tma
    python scripts/tune_matmul.py --paths           # pointer against TMA kernel, host costs
    python scripts/tune_matmul.py --tiny            # the same sweep at sizes <= 128, any device

Prints, per shape, each config's TFLOP/s and its ratio to torch.matmul (best marked *), the
autotuned kernels.matmul on the same shapes, and a short list of configs that together stay
close to the best on every shape: a candidate for kernels.matmul_tuning.CONFIGS. `--tma` also
times a variant that loads tiles through tensor descriptors (TMA, Hopper and later), as an
experiment. `--tiny` runs the sweep (check, then time) on a few candidates at tiny sizes in fp16:
on a CPU, through Triton's interpreter, whose timings mean nothing; it shows the script works.
"""

import argparse
import functools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import kernels  # noqa: F401, I001  (fixes the mode before kernels are defined)
import torch
import triton
import triton.language as tl

from kernels import bench, check
from kernels.matmul import (
    matmul,
    matmul_kernel,
    matmul_kernel_autotuned,
    matmul_pointers,
    matmul_tma,
    matmul_tma_kernel,
)
from kernels.matmul_tuning import (
    CONFIGS,
    pad_operands,
    set_tma_blocks,
    shared_memory_bytes,
    shared_memory_limit,
    tile_config,
    tile_count,
    tma_descriptors,
    tma_problem,
)
from kernels.primitives import grouped_tile
from kernels.runtime import DEVICE, ON_GPU
from kernels.validate import check_matmul_inputs

EXTRA_CANDIDATES = [
    tile_config(128, 256, 64, num_warps=8, num_stages=4),
    tile_config(256, 128, 64, num_warps=8, num_stages=4),
    tile_config(128, 256, 32, num_warps=8, num_stages=4),
    tile_config(128, 128, 128, num_warps=8, num_stages=3),
    tile_config(64, 256, 64, num_warps=4, num_stages=4),
    tile_config(128, 256, 64, num_warps=8, num_stages=3, group_m=16),
    tile_config(128, 256, 64, num_warps=8, num_stages=3, group_m=4),
    # small tiles: more programs than SMs for problems of 1024^2 outputs and below
    tile_config(64, 64, 64, num_warps=4, num_stages=4),
    tile_config(64, 128, 64, num_warps=4, num_stages=4),
    tile_config(128, 64, 64, num_warps=4, num_stages=4),
    tile_config(64, 64, 128, num_warps=4, num_stages=3),
]
SQUARES = (1024, 2048, 4096, 8192)
LLM = ((4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336))  # x @ W.t(), (M, N, K)
IRREGULAR = (8205, 5921, 2949)
DECODE = tuple((m, 4096, 4096) for m in (1, 16, 64))  # a few tokens through a 4096 layer
# --tiny: the same kinds of shape at sizes the interpreter runs in seconds, in fp16 (the
# interpreter gets bf16 wrong), on the first few candidates.
TINY_SQUARES = (48, 128)
TINY_LAYERS = ((64, 96, 64), (1, 64, 128))  # x @ W.t() and a decode step
TINY_IRREGULAR = (65, 47, 33)
TINY_CANDIDATES = 3


def label(config) -> str:
    k = config.kwargs
    return (
        f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{config.num_warps} "
        f"s{config.num_stages} g{k['GROUP_M']}"
    )


def launch(config, a, b):
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    meta = config.kwargs
    matmul_kernel[(tile_count(m, n, meta),)](
        a, b, c, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
        HAS_BIAS=False, ACTIVATION="none", INPUT_PRECISION="tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **meta,
    )  # fmt: skip
    return c


def launch_tma(config, a, b):
    """kernels.matmul's TMA kernel with one config; b may be W.t() (W row-major (N, K))."""
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    b_is_w = b.stride(1) != 1
    descs = tma_descriptors(a, b, c, b_is_w)
    meta = config.kwargs
    set_tma_blocks(
        {"a_desc": descs[0], "b_desc": descs[1], "c_desc": descs[2], "B_IS_W": b_is_w, **meta}
    )
    matmul_tma_kernel[(tile_count(m, n, meta),)](
        *descs, c, m, n, k, HAS_BIAS=False, ACTIVATION="none", INPUT_PRECISION="tf32",
        B_IS_W=b_is_w, num_warps=config.num_warps, num_stages=config.num_stages, **meta,
    )  # fmt: skip
    return c


@triton.jit
def wt_matmul_kernel(
    a_ptr, w_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # a @ W.t() with W (N, K) loaded as (BLOCK_N, BLOCK_K) tiles, K-contiguous, and transposed
    # in registers for the dot: the layout an nn.Linear weight has.
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    w_ptrs = w_ptr + (cols % N).to(tl.int64)[:, None] * stride_wn + ks[None, :] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
        w = tl.load(w_ptrs, mask=ks[None, :] < K - k0, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def launch_wt(config, a, b):
    w = b.t()  # b is W.t(): W itself is (N, K), K contiguous
    (m, k), n = a.shape, w.shape[0]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    meta = config.kwargs
    wt_matmul_kernel[(tile_count(m, n, meta),)](
        a, w, c, m, n, k, *a.stride(), *w.stride(), *c.stride(),
        num_warps=config.num_warps, num_stages=config.num_stages, **meta,
    )  # fmt: skip
    return c


def padded_matmul(a, b, multiple=64):
    """kernels.matmul on zero-padded copies whose rows start 16-byte aligned: every load can
    be a wide one. Zeros in the padding of K add nothing; the padding of N is cut off."""
    a_p, b_p, _ = pad_operands(a, b, multiple=multiple)
    return matmul(a_p, b_p)[:, : b.shape[1]].contiguous()


def experiments():
    """Layouts: x @ W.t() three ways; an irregular shape padded to aligned rows."""
    configs = CONFIGS
    for m, n, k in LLM:
        a, b = operands(torch.bfloat16, m, n, k, True)
        torch_ms = bench.time_ms(torch.matmul, a, b)
        torch_tflops = bench.achieved_tflops(2 * m * n * k, torch_ms)
        print(f"\nbf16 {m}x{n}x{k} Wt: torch {torch_tflops:.0f} TFLOP/s")
        for kind, fn in (("ptr", launch), ("W tiles", launch_wt), ("TMA W", launch_tma)):
            results = [
                (label(c), *measure(functools.partial(fn, c), a, b, torch_ms)) for c in configs
            ]
            ok = [r for r in results if r[1] is not None]
            best = max(ok, key=lambda r: r[2]) if ok else results[0]
            print(f"  {kind:8} best {best[0]:24} {best[1]} TFLOP/s {best[2]}")
        contiguous_first = lambda a, b: matmul(a, b.contiguous())
        print(f"  b made contiguous first: {measure(contiguous_first, a, b, torch_ms)}")
    m, n, k = IRREGULAR
    a, b = operands(torch.bfloat16, m, n, k, False)
    torch_ms = bench.time_ms(torch.matmul, a, b)
    print(f"\nbf16 {m}x{n}x{k}: torch {bench.achieved_tflops(2 * m * n * k, torch_ms):.0f} TFLOP/s")
    print(f"  kernels.matmul: {measure(matmul, a, b, torch_ms)}")
    print(f"  padded to 64: {measure(padded_matmul, a, b, torch_ms)}")
    print(f"  padded to 8: {measure(functools.partial(padded_matmul, multiple=8), a, b, torch_ms)}")


def paths():
    """Every sweep shape through both autotuned kernels (pointer loads, TMA) and through the
    dispatching kernels.matmul; TF32 by layout; where the time of a small matmul goes."""
    for shape_name, dtype_name, (m, n, k), transposed_b in shapes(["bf16", "fp16"]):
        a, b = operands(bench.DTYPE_NAMES[dtype_name], m, n, k, transposed_b)
        torch_ms = bench.time_ms(torch.matmul, a, b)
        print(f"\n{shape_name}: torch {bench.achieved_tflops(2 * m * n * k, torch_ms):.0f} TFLOP/s")
        print(f"  pointer  {fmt(measure(matmul_pointers, a, b, torch_ms))}")
        if not tma_problem(a, b):
            print(f"  TMA      {fmt(measure(matmul_tma, a, b, torch_ms))}")
        print(f"  matmul   {fmt(measure(matmul, a, b, torch_ms))}")
        del a, b
    tf32_layouts()
    print("\nWhere a small matmul's time goes (us; 'graph' = replayed from a CUDA graph):")
    for m, n, k in ((1024, 1024, 1024), (2048, 2048, 2048), (16, 4096, 4096)):
        print(time_per_call(m, n, k))


def time_per_call(m, n, k) -> str:
    """GPU and host microseconds of one bf16 m x n x k matmul, by layer of the call."""
    a, b = operands(torch.bfloat16, m, n, k, False)
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    matmul(a, b)  # tuned
    args = (a, b, c, c, m, n, k, *a.stride(), *b.stride(), *c.stride())
    flags = {"HAS_BIAS": False, "ACTIVATION": "none", "INPUT_PRECISION": "tf32"}
    grid = lambda meta: (tile_count(m, n, meta),)
    timings = {
        "torch.matmul": bench.time_ms(torch.matmul, a, b),
        "torch.matmul graph": bench.graph_ms(lambda: torch.matmul(a, b)),
        "kernels.matmul": bench.time_ms(matmul, a, b),
        "kernels.matmul graph": bench.graph_ms(lambda: matmul(a, b)),
    }
    host = {
        "host: torch.matmul": bench.cpu_us_per_call(lambda: torch.matmul(a, b)),
        "host: kernels.matmul": bench.cpu_us_per_call(lambda: matmul(a, b)),
        "host: validation": bench.cpu_us_per_call(lambda: check_matmul_inputs(a, b)),
        "host: autotuned launch": bench.cpu_us_per_call(
            lambda: matmul_kernel_autotuned[grid](*args, **flags)
        ),
    }
    best = matmul_kernel_autotuned.best_config
    fixed = best.all_kwargs()
    host["host: fixed-config launch"] = bench.cpu_us_per_call(
        lambda: matmul_kernel[grid(fixed)](*args, **flags, **fixed)
    )
    return (
        f"  {m}x{n}x{k} ({label(best)}): "
        + ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in timings.items())
        + "; "
        + ", ".join(f"{name} {us:.1f}" for name, us in host.items())
    )


def tf32_layouts():
    """fp32 with TF32 allowed, b row-major (N-major) and b = W.t() (K-major), both kernels."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        for transposed_b in (False, True):
            a, b = operands(torch.float32, 4096, 4096, 4096, transposed_b)
            torch_ms = bench.time_ms(torch.matmul, a, b)
            layout = "b = W.t() (K-major)" if transposed_b else "b row-major (N-major)"
            tflops = lambda ms: bench.achieved_tflops(2 * 4096**3, ms)
            print(f"\nfp32 TF32 4096^3, {layout}: torch {tflops(torch_ms):.0f} TFLOP/s")
            exact = a.double() @ b.double()
            print(f"  torch error {check.relative_error(a @ b, exact):.2e}")
            for tma, fn in ((False, matmul_pointers), (True, matmul_tma)):
                # timed whatever the error: the error is reported
                error = check.relative_error(fn(a, b), exact)
                ms = bench.time_ms(fn, a, b)
                print(
                    f"  {'TMA' if tma else 'pointer':8} {tflops(ms):6.0f} TFLOP/s"
                    f"  {torch_ms / ms:5.2f}x torch, error {error:.2e}"
                )
    finally:
        torch.set_float32_matmul_precision(previous)


def fmt(result):
    tflops, ratio = result
    return ratio if tflops is None else f"{tflops:6.0f} TFLOP/s  {ratio:5.2f}x torch"


def measure(fn, a, b, torch_ms):
    """(TFLOP/s, ratio to torch) after checking the result, or (None, reason)."""
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    try:
        out = fn(a, b)
        ref = a.double() @ b.double()  # fp64: a TF32 product is no reference for TF32
        result = check.compare(out, ref, op="matmul", dtype=a.dtype, baseline=a @ b)
        if not result.ok:
            return None, f"WRONG: {result.message}"
        ms = bench.time_ms(fn, a, b)
    except Exception as exc:  # a config that does not compile or fit is reported, not fatal
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:60] if str(exc) else ''}"
    return bench.achieved_tflops(flops, ms), torch_ms / ms


def shapes(
    dtypes, squares=SQUARES, llm=True, layers=LLM + DECODE, irregular=IRREGULAR, layer_dtype="bf16"
):
    """(name, dtype name, (m, n, k), b is W.t()): squares in every dtype, then the layer
    shapes and one irregular shape in `layer_dtype`, if it is among `dtypes`."""
    for name in dtypes:
        for n in squares:
            yield f"{name} {n}^3", name, (n, n, n), False
    if layer_dtype in dtypes and llm:
        for m, n, k in layers:
            yield f"{layer_dtype} {m}x{n}x{k} Wt", layer_dtype, (m, n, k), True
        yield f"{layer_dtype} " + "x".join(map(str, irregular)), layer_dtype, irregular, False


def operands(dtype, m, n, k, transposed_b):
    a = torch.randn(m, k, device=DEVICE, dtype=dtype)
    if transposed_b:  # an nn.Linear weight (N, K), used as W.t()
        return a, torch.randn(n, k, device=DEVICE, dtype=dtype).t()
    return a, torch.randn(k, n, device=DEVICE, dtype=dtype)


def pick_configs(ratios, max_configs=5, tolerance=0.01):
    """Greedy: add the config that most raises the sum over shapes of the best ratio so far,
    until every shape is within `tolerance` of its best or max_configs are chosen."""
    shape_names = {s for r in ratios.values() for s in r}
    best = {s: max(r.get(s, 0.0) for r in ratios.values()) for s in shape_names}
    chosen = []
    while len(chosen) < max_configs:
        score = lambda cfg: sum(max(ratios[c].get(s, 0.0) for c in chosen + [cfg]) for s in best)
        chosen.append(max((c for c in ratios if c not in chosen), key=score))
        if all(max(ratios[c].get(s, 0.0) for c in chosen) >= best[s] - tolerance for s in best):
            break
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    parser.add_argument("--tma", action="store_true", help="also time the TMA variant")
    parser.add_argument("--squares", nargs="*", type=int, default=SQUARES, help="square sizes")
    parser.add_argument("--no-llm", action="store_true", help="skip LLM, decode, odd shapes")
    parser.add_argument("--experiments", action="store_true", help="layout experiments only")
    parser.add_argument("--paths", action="store_true", help="pointer against TMA, host costs")
    parser.add_argument("--tf32", action="store_true", help="TF32 by layout and kernel only")
    parser.add_argument("--tiny", action="store_true", help="the sweep at sizes <= 128, fp16")
    args = parser.parse_args(argv)
    if args.tiny and (args.experiments or args.paths or args.tf32):
        parser.error("--tiny runs the config sweep only")
    if not (ON_GPU or args.tiny):
        print("tune_matmul needs a CUDA GPU (the interpreter's timings mean nothing); try --tiny")
        return 1
    device = torch.cuda.get_device_name() if ON_GPU else "CPU, Triton's interpreter"
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    if args.experiments:
        experiments()
        return 0
    if args.paths:
        paths()
        return 0
    if args.tf32:
        tf32_layouts()
        return 0
    limit = shared_memory_limit(DEVICE.index or 0) if ON_GPU else math.inf
    candidates = [c for c in CONFIGS + EXTRA_CANDIDATES if shared_memory_bytes(c, 2) <= limit]
    sweep = shapes(args.dtypes, args.squares, not args.no_llm)
    if args.tiny:
        candidates = candidates[:TINY_CANDIDATES]
        sweep = shapes(["fp16"], TINY_SQUARES, True, TINY_LAYERS, TINY_IRREGULAR, "fp16")
    variants = [(label(c), c, launch) for c in candidates]
    if args.tma:
        variants += [("TMA " + label(c), c, launch_tma) for c in candidates]
    ratios = {name: {} for name, _, _ in variants}
    wrong = []
    for shape_name, dtype_name, (m, n, k), transposed_b in sweep:
        a, b = operands(bench.DTYPE_NAMES[dtype_name], m, n, k, transposed_b)
        torch_ms = bench.time_ms(torch.matmul, a, b)
        flops = 2 * m * n * k
        print(f"\n{shape_name}: torch.matmul {bench.achieved_tflops(flops, torch_ms):.0f} TFLOP/s")
        rows = []
        for name, config, fn in variants:
            tflops, ratio = measure(functools.partial(fn, config), a, b, torch_ms)
            if tflops is not None:
                ratios[name][shape_name] = ratio
            rows.append((name, tflops, ratio))
        rows.append(("kernels.matmul (autotuned)", *measure(matmul, a, b, torch_ms)))
        best = max((r for _, t, r in rows if t is not None), default=None)
        for name, tflops, ratio in rows:
            if tflops is None:
                print(f"  {name:34} {ratio}")
                if ratio.startswith("WRONG"):
                    wrong.append(f"{shape_name}, {name}")
            else:
                mark = "*" if ratio == best else " "
                print(f"  {name:34} {tflops:7.0f} TFLOP/s  {ratio:5.2f}x torch {mark}")
        del a, b
    ratios = {name: r for name, r in ratios.items() if r and not name.startswith("TMA")}
    if ratios:
        print("\nA short list that stays near the best on every shape (for CONFIGS):")
        for name in pick_configs(ratios):
            print(f"  {name}")
    if wrong:
        print("\nWrong results (a kernel bug, not a slow config):\n  " + "\n  ".join(wrong))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
