"""Chapter 5's benchmark: what batch invariance costs. Each batch-invariant kernel against its
ordinary counterpart, in bf16, and kernels.llm's "tiny" model served with and without
batch_invariant_mode() (kernels.llm.serve)."""

import contextlib

import torch

from kernels import bench
from kernels.benchmarks.rows import CUBLAS_IS_NOT_A_ROOF, READS_ONLY, row, timed_rows
from kernels.runtime import DEVICE

# Rows that may pass their measured ceiling, and why: (name pattern, unit, reason). Each row
# built now carries its reason as "above_roof"; this table gives it to rows recorded before.
ABOVE_ROOF = (
    (r"invariant matmul M=\d+", "TFLOP/s", CUBLAS_IS_NOT_A_ROOF),
    (r"invariant attention B=\d+ Sk=\d+", "GB/s", READS_ONLY),
)


def bench_batch_invariant(ceilings):
    """Matmul (M x 4096 @ 4096 x 4096) against cuBLAS, RMSNorm (rows of 4096) against the
    course's rms_norm and PyTorch, decoding attention (one query, 32 heads of 128) and one causal
    prefill against the course's attention and SDPA; and serving the tiny LM with and without
    the mode."""
    import torch.nn.functional as F

    from kernels import batch_invariant as bi
    from kernels.attention import attention
    from kernels.norm import rms_norm

    rows = []
    n = k = 4096
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    weights = bench.rotating_copies(b)
    for m in (1, 16, 64, 256, 1024, 2048, 4096, 8192):
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        rows += timed_rows(
            f"invariant matmul M={m}",  # bf16, N = K = 4096
            bi.matmul,
            [(a, w) for w in weights],
            {"cuBLAS": torch.mm},
            graph=m <= 2048,  # up to about 100 us of FLOPs at cuBLAS's rate
            flops=2 * m * n * k,
            ceilings=ceilings,
            dtype="bf16",
            above_roof=CUBLAS_IS_NOT_A_ROOF,
        )
    del weights
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    for m in (1, 64, 4096, 16384):  # at most 256 MB: 64 us of bytes
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        baselines = {
            "kernels.norm.rms_norm": rms_norm,
            "torch fp32 math": bi.rms_norm_ref,
            "F.rms_norm": lambda x, w: F.rms_norm(x, (4096,), w, 1e-6),
        }
        rows += timed_rows(
            f"invariant rms_norm {m}x4096",  # bf16
            bi.rms_norm,
            [(c, w) for c in bench.rotating_copies(x, most=8)],  # small x: in L2, as in a model
            baselines,
            graph=True,
            bytes_moved=2 * x.numel() * 2,
            ceilings=ceilings,
        )
    for batch, keys in ((1, 4096), (8, 4096), (64, 1024), (32, 8192)):
        q = torch.randn(batch, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 32, keys, 128, device=DEVICE, dtype=q.dtype) for _ in "kv")
        rows += timed_rows(
            f"invariant attention B={batch} Sk={keys}",  # bf16, Sq=1, H=32, D=128
            bi.attention,
            [
                (q, *kv)
                for kv in zip(bench.rotating_copies(k), bench.rotating_copies(v), strict=True)
            ],
            {"kernels.attention": attention, "SDPA": F.scaled_dot_product_attention},
            graph=batch * keys <= 4096,  # 67 MB of keys and values: 16 us; the next is 8x that
            bytes_moved=2 * k.numel() * 2,  # decoding reads the keys and values
            ceilings=ceilings,
            above_roof=READS_ONLY,
        )
    rows.append(_prefill_row(ceilings))
    rows.append(_serving_row())
    return rows


def _prefill_row(ceilings):
    """A causal prefill of one 4096-token prompt, 32 heads of 128: the invariant kernel keeps its
    16-query tile for every Sq, where kernels.attention picks taller tiles for long prompts."""
    import torch.nn.functional as F

    from kernels import batch_invariant as bi
    from kernels.attention import attention

    q, k, v = (torch.randn(1, 32, 4096, 128, device=DEVICE, dtype=torch.bfloat16) for _ in "qkv")
    baselines = {
        "kernels.attention": bench.time_ms(attention, q, k, v, causal=True),
        "SDPA": bench.time_ms(F.scaled_dot_product_attention, q, k, v, is_causal=True),
    }
    ms = bench.time_ms(bi.attention, q, k, v, causal=True)
    flops = 2 * q.numel() * k.shape[2]  # 4 * B * H * S * S * D, half of it under the causal mask
    name = "invariant attention prefill S=4096"  # bf16, B=1, H=32, D=128, causal
    return row(name, ms, flops=flops, ceilings=ceilings, dtype="bf16", baselines=baselines)


def _serving_row():
    """Serving the same traffic to kernels.llm's "tiny" model (torch's ops), default kernels
    against batch_invariant_mode()."""
    from kernels import llm
    from kernels.batch_invariant import batch_invariant_mode
    from kernels.llm.serve import run_experiment
    from kernels.llm.tokenizer import ByteTokenizer

    model = llm.load_model("tiny", device=DEVICE)
    traffic = dict(
        tokenizer=ByteTokenizer(),
        prompt="Tell me about Richard Feynman.",
        copies=200,
        new_tokens=32,
        fillers=50,
        max_batch=64,
        spread=200,
    )
    seconds = {}
    for mode in ("default", "invariant"):
        with batch_invariant_mode() if mode == "invariant" else contextlib.nullcontext():
            run_experiment(model, **dict(traffic, copies=8, fillers=2))  # warm-up, compiles
            result = run_experiment(model, **traffic)
        seconds[mode] = result["seconds"]
    tokens = sum(len(r.tokens) for r in result["requests"])
    return {  # no ceiling applies to tokens per second
        "name": f"tiny LM serving {tokens} tokens",
        "ms": 1e3 * seconds["invariant"],
        "unit": "tok/s",
        "rate": tokens / seconds["invariant"],
        "pct_of_ceiling": None,
        "baselines": {"default kernels": 1e3 * seconds["default"]},
    }
