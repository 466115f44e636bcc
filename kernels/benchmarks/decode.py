"""Chapter 6's kernel benchmark: the decode GEMV (bf16 and int8 weights) against cuBLAS, and the
split-K matmul on KernelBench's large-K shape.

A GEMV row is rated in GB/s of the bytes it must move (weight + x + out; int8: its weight and
scales) against the copy bandwidth, timed two ways with its baselines timed the same way:
[graph]: back to back in one CUDA graph over rotating copies of the weight, together past the
L2 (bench.rotating_graph_ms): how a decode step runs them; [call]: one `time_ms` (do_bench)
call, which also pays a fixed few microseconds per call (a 33 MB problem tops out near 63% of
copy that way). Targets (issue 16): M=1 >= 0.85x copy and >= 1.2x cuBLAS [graph], M=16/64 >=
0.8x copy; int8 at M=1 >= 1.7x the bf16 GEMV. The split-K matmul: >= 0.9x cuBLAS (issue 17).

Then whole decoding steps (kernels.llm, one row at position 511 of a 512-position cache,
replayed from a CUDA graph, random weights in the models' shapes: the values do not change
the work), rated in GB/s of the step's bytes (kernels.llm.speed.step_bytes: every weight once
and the cache): their % of copy is the % of the speed-of-light line. Against torch's ops in the
same graph, the course's kernels without dependent launch (kernels.runtime.PDL), with
SwiGLU's product in a kernel of its own rather than the gate-and-up GEMV's epilogue, with
rotary and the cache writes in a kernel of their own rather than the q/k/v GEMV's epilogue
(decode.rotary_gemv), and with the norms in kernels of their own rather than split between
the GEMVs around them (decode.linear_add and the GEMVs after it): each of the model's three
epilogues taken out in turn; int8 weights against bf16.
Targets (issue 16): SmolLM2 bf16 >= 15% of its line, the llama-1b shape >= 65%, its int8 >=
1.6x its bf16.
"""

import torch
import torch.nn.functional as F

from kernels import bench
from kernels.benchmarks.rows import CUBLAS_IS_NOT_A_ROOF, READS_ONLY, both_ways, row, rows_both_ways
from kernels.runtime import DEVICE

DECODE_SHAPES = ((14336, 4096), (4096, 14336))  # (N, K): an 8B model's MLP up and down
DECODE_ROWS = (1, 16, 64)
SPLIT_K_SHAPE = (256, 256, 524288)  # (M, N, K): KernelBench level 1, "large K"
STEP_MODELS = ("smollm2-135m", "llama-1b-shape")
STEP_CONTEXT, STEP_CALLS = 512, 200


def _gemv_rows(label, ours, baselines, moved, ceilings):
    return rows_both_ways(
        label, ours, baselines, bytes_moved=moved, ceilings=ceilings, above_roof=READS_ONLY
    )


def bench_gemv(ceilings):
    """bf16 x (M, K) @ W.T for W (N, K), and the same with W quantized to int8 per channel."""
    from kernels import gemv, int8

    rows = []
    for n, k in DECODE_SHAPES:
        weight = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
        weights = bench.rotating_copies(weight)
        q, scale = int8.quantize(weight)
        quantized = [(c, scale) for c in bench.rotating_copies(q)]
        for m in DECODE_ROWS:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            dense = [(x, w) for w in weights]
            cublas = both_ways(F.linear, dense)
            ours = both_ways(gemv.linear, dense)
            moved = 2 * (n * k + m * k + m * n)
            label = f"gemv bf16 M={m} {n}x{k}"
            rows += _gemv_rows(label, ours, {"cuBLAS F.linear": cublas}, moved, ceilings)
            int8_ms = both_ways(int8.linear, [(x, c, s) for c, s in quantized])
            moved = n * k + 4 * n + 2 * (m * k + m * n)
            baselines = {"cuBLAS F.linear bf16": cublas, "gemv bf16": ours}
            rows += _gemv_rows(f"gemv int8 M={m} {n}x{k}", int8_ms, baselines, moved, ceilings)
        del weights, quantized
    return rows


def bench_split_k(ceilings):
    """The split-K matmul at 256 x 256 x 524288 bf16 against cuBLAS and kernels.matmul (which
    does not split K: 4 tiles for 132 SMs)."""
    from kernels.matmul import matmul
    from kernels.split_k import matmul_split_k

    m, n, k = SPLIT_K_SHAPE
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    baselines = {
        "torch.matmul": bench.time_ms(torch.matmul, a, b),
        "kernels.matmul": bench.time_ms(matmul, a, b),
    }
    ms = bench.time_ms(matmul_split_k, a, b)
    name = f"matmul_split_k bf16 {m}x{n}x{k}"
    return [
        row(
            name,
            ms,
            flops=2 * m * n * k,
            ceilings=ceilings,
            dtype="bf16",
            baselines=baselines,
            above_roof=CUBLAS_IS_NOT_A_ROOF,
        )
    ]


def bench_decode_steps(ceilings):
    """A decoding step of each of STEP_MODELS, bf16 (kernels.llm.speed.FUSION_LADDER's rungs
    its baselines) and int8, as the module says."""
    from kernels import llm
    from kernels.llm import quant, speed

    rows, T = [], STEP_CONTEXT
    for name in STEP_MODELS:
        model = llm.random_model(name, torch.bfloat16, DEVICE)
        ms = {k: v["ms"] for k, v in speed.fusion_ladder(model, 1, T, STEP_CALLS).items()}
        model.backend = "kernels"
        quant.quantize_int8(model)  # in place, the head included
        int8_ms = speed.graph_step_ms(model, 1, T, STEP_CALLS)
        step = f"decode step {name} B=1 T={T} [graph]"
        bf16 = ms.pop("kernels")
        rows.append(row(f"{step} bf16", bf16, bytes_moved=speed.step_bytes(name, 2, T),
                        ceilings=ceilings, dtype="bf16", baselines=ms))  # fmt: skip
        baselines = {"bf16": bf16, "torch's ops bf16": ms["torch's ops"]}
        int8_bytes = speed.step_bytes(name, 2, T, int8=True)
        rows.append(row(f"{step} int8", int8_ms, bytes_moved=int8_bytes, ceilings=ceilings,
                        dtype="bf16", baselines=baselines))  # fmt: skip
        del model
        torch.cuda.empty_cache()
    return rows


def bench_decode(ceilings):
    """The GEMV rows, the split-K matmul, then whole decoding steps (GPU only, as every
    benchmark)."""
    return bench_gemv(ceilings) + bench_split_k(ceilings) + bench_decode_steps(ceilings)
