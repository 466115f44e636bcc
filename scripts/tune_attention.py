"""Check and tune the course's attention kernels on a GPU.

    python scripts/tune_attention.py            # correctness, then every candidate config timed
    python scripts/tune_attention.py --wide     # also a wider grid of configs (slower)
    python scripts/tune_attention.py --quick    # S=4096 only
    python scripts/tune_attention.py --tiny     # the same steps at tiny sizes, on a CPU too

1. Correctness: kernels.attention (forward and gradients) against the fp64 reference, with
   torch's own same-dtype SDPA error as the baseline, on odd and decoding shapes.
2. For the benchmark shapes (bf16, D=64 and 128, causal or not, B*H*S = 16*32768 tokens), each
   kernel is run with each configuration directly (no autotuner): the forward, then the dK/dV
   kernel (dQ config fixed), then the dQ kernel (dK/dV config fixed at its best). Printed: ms,
   TFLOP/s and the ratio to SDPA's flash and cuDNN backends; the best configuration per shape is
   marked with '*'. Update the `*_candidates` lists in kernels/attention_tuning.py from the result.

--tiny is a smoke test: on a CPU, Triton's interpreter runs it and its times mean nothing.
Exits 1 if a check fails or a candidate configuration does not run.
"""

import argparse
import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import bench, check  # noqa: E402
from kernels.attention import attention, attention_forward, attention_ref  # noqa: E402
from kernels.attention_backward import attention_backward  # noqa: E402
from kernels.attention_tuning import (  # noqa: E402
    dkdv_candidates,
    dq_candidates,
    forward_candidates,
)
from kernels.benchmarks.attention import ATTENTION_TOKENS, attention_flops, time_attention  # noqa: E402
from kernels.runtime import DEVICE  # noqa: E402

# (B, H, Sq, Sk, D) checked, the dtypes, and the (D, causal, S) timed with B*H*S tokens, H heads
GPU_PLAN = dict(
    shapes=[(2, 3, 113, 203, 64), (1, 4, 1025, 1025, 128), (2, 2, 1, 1000, 128),
            (3, 2, 4096, 4096, 64)],
    dtypes=(torch.bfloat16, torch.float16),
    tuned=list(itertools.product((64, 128), (False, True), (1024, 4096, 16384))),
    tuned_dtype=torch.bfloat16, heads=16, tokens=ATTENTION_TOKENS,
)  # fmt: skip
# bf16 is wrong under the interpreter: fp32 and fp16 there
TINY_PLAN = dict(
    shapes=[(1, 2, 17, 33, 16), (1, 1, 1, 20, 32)],
    dtypes=(torch.float32, torch.float16),
    tuned=[(16, False, 32), (16, True, 32)],
    tuned_dtype=torch.float16, heads=2, tokens=2 * 32,
)  # fmt: skip


def check_correctness(shapes, dtypes) -> int:
    """Print one line per output and gradient; return how many failed."""
    failures = 0
    for (B, H, Sq, Sk, D), causal, dtype in itertools.product(shapes, (False, True), dtypes):
        q, k, v, do = (
            check.random_tensor((B, H, s, D), dtype, seed=i) for i, s in enumerate((Sq, Sk, Sk, Sq))
        )
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = attention(q, k, v, causal=causal)
        out.backward(do)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = attention_ref(q64, k64, v64, causal)
        ref.backward(do.double())
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
        qb, kb, vb = (x.detach().requires_grad_() for x in (q, k, v))
        base = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask if causal else None
        )
        base.backward(do)
        for name, got, want, theirs in zip(
            ("out", "dq", "dk", "dv"),
            (out, q.grad, k.grad, v.grad),
            (ref, q64.grad, k64.grad, v64.grad),
            (base, qb.grad, kb.grad, vb.grad),
            strict=True,
        ):
            result = check.compare(got, want, op="attention", dtype=dtype, baseline=theirs)
            failures += not result.ok
            status = "ok  " if result.ok else "FAIL"
            print(f"{status} {name} {dtype} {(B, H, Sq, Sk, D)} causal={causal}: {result.message}")
    return failures


def wide_grid(kind):
    if kind == "fwd":
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    elif kind == "dkdv":
        grid = itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3))
    else:
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
    return list(grid)


def time_config(fn):
    try:
        fn()  # compile
        return bench.time_ms(fn)
    except Exception as exc:  # out of shared memory or registers: report and go on
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"


def report(label, rows, flops, sdpa):
    timed = {cfg: ms for cfg, ms in rows if isinstance(ms, float)}
    best = min(timed, key=timed.get) if timed else None
    for cfg, ms in rows:
        if not isinstance(ms, float):
            print(f"   {label:5} {cfg}: {ms}")
            continue
        ratios = "  ".join(f"{n} {sdpa[n] / ms:.2f}x" for n in sdpa)
        mark = "*" if cfg == best else " "
        print(f" {mark} {label:5} {cfg}: {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  {ratios}")
    return best


def tune(D, causal, S, wide, dtype, H, tokens) -> int:
    """Time every configuration of each kernel at (B, H, S, D); return how many of the
    candidate configurations (the wide grid's may fail) did not run."""
    B = max(1, tokens // (H * S))
    scale = 1 / math.sqrt(D)
    print(f"\n== {dtype} B={B} H={H} S={S} D={D} causal={causal}")
    sdpa = time_attention(B, H, S, D, causal, impls=None, dtype=dtype)
    for name, (f, b) in sdpa.items():
        print(f"   {name:15} fwd {f:8.3f} ms  bwd {b:8.3f} ms")
    ours = sdpa.pop("triton")
    sdpa = {n: t for n, t in sdpa.items() if n in ("sdpa-flash", "sdpa-cudnn")}
    q, k, v, do = (torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) for _ in range(4))
    fwd_flops = attention_flops(B, H, S, S, D, causal)
    failures = 0

    def configs(candidates, kind):
        extra = wide_grid(kind) if wide else []
        return list(dict.fromkeys(candidates(dtype, D, S) + extra))

    def timed(candidates, kind, run):
        nonlocal failures
        rows = [(cfg, time_config(lambda cfg=cfg: run(cfg))) for cfg in configs(candidates, kind)]
        wanted = candidates(dtype, D, S)
        failures += sum(cfg in wanted and not isinstance(ms, float) for cfg, ms in rows)
        return rows

    rows = timed(forward_candidates, "fwd",
                 lambda cfg: attention_forward(q, k, v, causal, scale, config=cfg))  # fmt: skip
    report("fwd", rows, fwd_flops, {n: t[0] for n, t in sdpa.items()})
    o, lse = attention_forward(q, k, v, causal, scale)
    bwd_flops = 2.5 * fwd_flops
    sdpa_bwd = {n: t[1] for n, t in sdpa.items()}
    dq_fixed = dq_candidates(dtype, D, S)[0]
    rows = timed(dkdv_candidates, "dkdv", lambda cfg: attention_backward(
        do, q, k, v, o, lse, causal, scale, "tf32", configs=(cfg, dq_fixed)))  # fmt: skip
    best_dkdv = report("dkdv", rows, bwd_flops, sdpa_bwd) or dkdv_candidates(dtype, D, S)[0]
    rows = timed(dq_candidates, "dq", lambda cfg: attention_backward(
        do, q, k, v, o, lse, causal, scale, "tf32", configs=(best_dkdv, cfg)))  # fmt: skip
    report("dq", rows, bwd_flops, sdpa_bwd)
    print(
        f"   autotuned kernels.attention: fwd {ours[0]:.3f} ms "
        f"({fwd_flops / ours[0] / 1e9:.1f} TFLOP/s), bwd {ours[1]:.3f} ms "
        f"({bwd_flops / ours[1] / 1e9:.1f} TFLOP/s)"
    )
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", action="store_true", help="also time a wider grid of configs")
    parser.add_argument("--quick", action="store_true", help="S=4096 only")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (runs on a CPU too)")
    args = parser.parse_args()
    if args.tiny:
        plan = TINY_PLAN
    elif torch.cuda.is_available():
        plan = GPU_PLAN
    else:
        sys.exit("needs a CUDA GPU (or --tiny)")
    if torch.cuda.is_available():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print(f"CPU, torch {torch.__version__}: Triton's interpreter, whose times mean nothing")
    failures = check_correctness(plan["shapes"], plan["dtypes"])
    for D, causal, S in plan["tuned"]:
        if args.quick and S != 4096:
            continue
        failures += tune(D, causal, S, args.wide, plan["tuned_dtype"], plan["heads"],
                         plan["tokens"])  # fmt: skip
    print(f"\n{failures} failures" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
