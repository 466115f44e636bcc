"""The shapes that outside suites and real models run, beyond the chapters' own: softmax at
every row length from 1k to 393k, matmul where K dominates (split-K), where K is tiny, and an
LLM down projection, and bias + GELU in bf16. Each row holds the baselines that decide the
thresholds still marked as not yet measured (kernels.softmax_tuning, kernels.matmul_tuning):
the other softmax paths on the same input, the matmul without its split.

Memory-bound rows are rated in GB/s of the bytes the op must move at least (softmax: read x,
write y; the two-pass paths move 1.5x that), compute-bound ones in TFLOP/s of 2*M*N*K.
"""

import torch

from kernels import bench
from kernels.benchmarks.rows import CUBLAS_IS_NOT_A_ROOF, row
from kernels.runtime import DEVICE, ON_GPU, pick

# Row lengths 1k to 393k, each with enough rows for SOFTMAX_BYTES of traffic (read + write):
# from 128 MB up a call's fixed cost (about 4.6 us under do_bench) stays under 1% of its time.
SOFTMAX_COLS = pick(
    cpu=(64, 300),
    gpu=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 393216),
)
SOFTMAX_BYTES = pick(cpu=1 << 16, gpu=1 << 27)
SOFTMAX_DTYPES = pick(cpu=("fp32",), gpu=("bf16", "fp32"))  # the interpreter's bf16 is wrong
SOFTMAX_EXTRA = pick(cpu=(), gpu=(("fp32", 512, 393216),))  # (dtype, rows, n_cols), issue 17's
# (M, N, K, b given as W.t()): split-K's case, a tiny K, an LLM's down projection x @ W.t()
MATMUL_SHAPES = pick(
    cpu=((16, 16, 512, False), (64, 64, 16, False), (32, 64, 128, True)),
    gpu=((256, 256, 524288, False), (32768, 32768, 64, False), (4096, 4096, 14336, True)),
)
MATMUL_DTYPE = pick(cpu="fp32", gpu="bf16")
BIAS_GELU_SHAPE = pick(cpu=(64, 256), gpu=(8192, 8192))


def bench_shapes(ceilings):
    return _softmax_rows(ceilings) + _matmul_rows(ceilings) + _bias_gelu_rows(ceilings)


def softmax_sizes():
    """(dtype name, rows, n_cols) of every softmax row."""
    sizes = []
    for name in SOFTMAX_DTYPES:
        element_size = bench.DTYPE_NAMES[name].itemsize
        for n in SOFTMAX_COLS:
            sizes.append((name, max(1, SOFTMAX_BYTES // (2 * n * element_size)), n))
    return sizes + list(SOFTMAX_EXTRA)


def _softmax_rows(ceilings):
    """The kernel as called (softmax_tuning's path), against torch.softmax and each other path
    on the same input ("rows"/"row" hold a row in registers: up to FUSED_MAX_COLS only), and on
    a GPU the same call replayed from a CUDA graph (GPU time alone: the gap is host cost)."""
    from kernels import softmax_tuning
    from kernels.softmax import softmax, softmax_path

    rows = []
    for name, m, n in softmax_sizes():
        x = torch.randn(m, n, device=DEVICE, dtype=bench.DTYPE_NAMES[name])
        baselines = {"torch": bench.time_ms(torch.softmax, x, -1)}
        for path in softmax_tuning.PATHS:
            if path in ("split", "streamed") or n <= softmax_tuning.FUSED_MAX_COLS:
                baselines[f"path {path}"] = bench.time_ms(softmax_path, x, path)
        if ON_GPU:
            baselines["ours in a CUDA graph"] = bench.graph_ms(lambda x=x: softmax(x))
        ms = bench.time_ms(softmax, x)  # its path's baseline is the same kernel, timed again
        rows.append(
            row(
                f"softmax sweep {name} {m}x{n}",
                ms,
                bytes_moved=2 * x.numel() * x.element_size(),
                ceilings=ceilings,
                baselines=baselines,
            )
        )
        del x
    return rows


def _matmul_rows(ceilings):
    """kernels.matmul against cuBLAS (torch.matmul); where plan() takes split-K, also the
    pointer kernel on the whole K (the before of Chapter 3's before/after)."""
    from kernels import matmul_tuning
    from kernels.matmul import matmul, matmul_pointers

    dtype = bench.DTYPE_NAMES[MATMUL_DTYPE]
    rows = []
    for m, n, k, b_is_w in MATMUL_SHAPES:
        a = torch.randn(m, k, device=DEVICE, dtype=dtype)
        b = torch.randn(n, k, device=DEVICE, dtype=dtype).t() if b_is_w else None
        b = torch.randn(k, n, device=DEVICE, dtype=dtype) if b is None else b
        baselines = {"torch.matmul": bench.time_ms(torch.matmul, a, b)}
        split = matmul_tuning.plan(a, b).split_k
        if split:
            baselines["pointer kernel, K unsplit"] = bench.time_ms(matmul_pointers, a, b)
        ms = bench.time_ms(matmul, a, b)
        label = f"matmul shapes {MATMUL_DTYPE} {m}x{n}x{k}" + (" Wt" if b_is_w else "")
        rows.append(
            row(
                label,
                ms,
                flops=2 * m * n * k,
                ceilings=ceilings,
                dtype=MATMUL_DTYPE,
                baselines=baselines,
                above_roof=CUBLAS_IS_NOT_A_ROOF if MATMUL_DTYPE in ("bf16", "fp16") else None,
            )
        )
        del a, b
    return rows


def _bias_gelu_rows(ceilings):
    """bias_gelu (GELU's tanh form for 16-bit outputs) against PyTorch's and against a copy of
    x, which moves the same bytes with no arithmetic: the instruction cost is the gap."""
    from kernels.elementwise import bias_gelu

    m, n = BIAS_GELU_SHAPE
    name = pick(cpu="fp32", gpu="bf16")
    x = torch.randn(m, n, device=DEVICE, dtype=bench.DTYPE_NAMES[name])
    bias = torch.randn(n, device=DEVICE, dtype=x.dtype)
    baselines = {
        "torch": bench.time_ms(lambda: torch.nn.functional.gelu(x + bias)),
        "x.clone()": bench.time_ms(torch.clone, x),
    }
    ms = bench.time_ms(bias_gelu, x, bias)
    nbytes = (2 * m * n + n) * x.element_size()  # read x and the bias, write y
    return [
        row(
            f"bias_gelu {name} {m}x{n}",
            ms,
            bytes_moved=nbytes,
            ceilings=ceilings,
            baselines=baselines,
        )  # fmt: skip
    ]
