"""Pick the one tile configuration of the batch-invariant matmul on a GPU.

    python scripts/tune_invariant_matmul.py           # a GPU: bf16, N = K = 4096
    python scripts/tune_invariant_matmul.py --tiny    # anywhere (the interpreter on a CPU): fp32,
                                                      # N = K = 64, two candidates, in seconds

The invariant matmul uses ONE configuration for every M (CONFIGS in
kernels/batch_invariant/full_k_matmul.py). For each candidate: correctness against the fp64
reference (within twice torch's error), a quick bitwise batch-invariance check (the harness
with a few batch sizes and needles), then ms and the ratio to torch.mm (cuBLAS on a GPU) for
M from 1 to 8192. The course's target is at least 0.80x cuBLAS for M >= 2048; the candidate
with the best geometric mean there is marked with '*'. Copy it into CONFIGS[torch.bfloat16]
(and float16). Exits 1 when no candidate is both correct and invariant.
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the repo

import kernels  # noqa: F401, I001  (fixes the mode before kernels are defined)
import torch

from kernels import bench, check
from kernels.batch_invariant.full_k_matmul import CONFIGS, matmul, matmul_ref
from kernels.batch_invariant.harness import check_batch_invariance
from kernels.runtime import DEVICE, ON_GPU

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
GPU = dict(
    dtype=torch.bfloat16,
    n=4096,
    k=4096,
    m_values=(1, 16, 64, 256, 1024, 2048, 4096, 8192),
    big_m=2048,  # the target's range
    sweep=(1, 7, 131, 132, 133),  # around the H200's 132 SMs
    candidates=[
        (128, 256, 64, 8, 3),
        (128, 256, 64, 8, 4),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (64, 256, 64, 4, 4),
        (128, 128, 128, 8, 3),
    ],
)
# The same steps at a size the CPU interpreter runs in seconds (fp32: the interpreter computes
# bf16 wrongly). Tiles must stay below the interpreter's product block of 2**20 elements.
TINY = dict(
    dtype=torch.float32,
    n=64,
    k=64,
    m_values=(1, 7, 33, 64),
    big_m=33,
    sweep=(1, 7, 17, 33),
    candidates=[(16, 32, 32, 4, 1), (32, 64, 16, 4, 1)],
)


def tile(bm, bn, bk, warps, stages) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


def try_candidate(b, x, inputs, baseline_ms, setup):
    """(ratios to torch.mm by M, None) for a correct and invariant config, else (None, why)."""
    rows = min(100, x.shape[0])
    r = check.against_fp64(matmul, x[:rows], b, ref=matmul_ref, op="matmul", baseline=torch.mm)
    if not r.ok:
        return None, f"WRONG: {r.message}"
    report = check_batch_invariance(lambda t: matmul(t, b), x, sizes=setup["sweep"], needles=4)
    if not report.ok:
        return None, f"NOT INVARIANT: {report}"
    return {m: baseline_ms[m] / bench.time_ms(matmul, a, b) for m, a in inputs.items()}, None


def tune(setup) -> dict:
    """{config name: geometric mean of its ratio to torch.mm for M >= big_m}, printing a table."""
    dtype, n, k, m_values = setup["dtype"], setup["n"], setup["k"], setup["m_values"]
    b = check.random_tensor((k, n), dtype, seed=1, device=DEVICE)
    inputs = {m: check.random_tensor((m, k), dtype, seed=m + 2, device=DEVICE) for m in m_values}
    baseline_ms = {m: bench.time_ms(torch.mm, a, b) for m, a in inputs.items()}
    x = check.random_tensor((max(m_values), k), dtype, seed=0, device=DEVICE)
    print(f"{str(dtype).removeprefix('torch.')}, N = {n}, K = {k}, on {DEVICE.type}")
    print(
        f"{'config (M, N, K, warps, stages)':34}" + "".join(f"{'M=' + str(m):>9}" for m in m_values)
    )
    saved, results = CONFIGS[dtype], {}
    try:
        for candidate in setup["candidates"]:
            name = "{}x{}x{} w{} s{}".format(*candidate)
            CONFIGS[dtype] = tile(*candidate)
            try:
                ratios, why = try_candidate(b, x, inputs, baseline_ms, setup)
            except Exception as exc:  # a config that does not compile or fit: say so, go on
                ratios, why = None, f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            if ratios is None:
                print(f"{name:34} {why}")
                continue
            print(f"{name:34}" + "".join(f"{ratios[m]:8.3g}x" for m in m_values))
            big = [ratios[m] for m in m_values if m >= setup["big_m"]]
            results[name] = math.exp(sum(map(math.log, big)) / len(big))
    finally:
        CONFIGS[dtype] = saved  # the module's own choice stays in force after the run
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (runs on a CPU too)")
    args = parser.parse_args(argv)
    if not (ON_GPU or args.tiny):
        print("needs a CUDA GPU (or --tiny)")
        return 1
    setup = TINY if args.tiny else GPU
    results = tune(setup)
    if not results:
        print("no candidate was both correct and batch-invariant")
        return 1
    best = max(results, key=results.get)
    print(
        f"* best for M >= {setup['big_m']}: {best} ({results[best]:.2f}x torch.mm, geometric mean)"
    )
    print("(ratio: torch.mm time / invariant kernel time; above 1 means the kernel is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
