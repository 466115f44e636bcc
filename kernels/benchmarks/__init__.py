"""`python -m kernels bench`: the machine's ceilings, then every kernel against its baselines,
on the same inputs in the same run. Chapters add their kernels to BENCHMARKS.

A benchmark is a function (ceilings) -> list of rows:
{"name", "ms", "unit": "GB/s" | "TFLOP/s", "rate", "pct_of_ceiling", "baselines": {name: ms}}.
"""

import contextlib

import torch

from kernels import bench
from kernels.runtime import DEVICE, pick


def _row(name, ms, *, bytes_moved=None, flops=None, ceilings, dtype="fp32", baselines=None):
    if bytes_moved is not None:
        unit, rate = "GB/s", bench.achieved_gbps(bytes_moved, ms)
        ceiling = ceilings["copy_gbps"]
    else:
        unit, rate = "TFLOP/s", bench.achieved_tflops(flops, ms)
        ceiling = ceilings["matmul_tflops"][dtype]
    return {
        "name": name,
        "ms": ms,
        "unit": unit,
        "rate": rate,
        "pct_of_ceiling": 100 * rate / ceiling,
        "baselines": baselines or {},
    }


def bench_add(ceilings):
    from kernels.elementwise import add

    rows = []
    for n in (1 << 20, 1 << 24, 1 << 28):
        x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
        ms = bench.time_ms(add, x, y)
        eager = bench.time_ms(torch.add, x, y)
        rows.append(
            _row(
                f"add fp32 n=2^{n.bit_length() - 1}",
                ms,
                bytes_moved=3 * 4 * n,
                ceilings=ceilings,
                baselines={"torch": eager},
            )
        )
    return rows


def bench_regimes(ceilings):
    """Chapter 1: points of the repeat-the-op sweep (each rated by its own regime on this
    machine's roofline) and fused cos(cos(x)) against eager PyTorch and torch.compile."""
    from kernels import regimes

    n = pick(cpu=1 << 12, gpu=1 << 27)  # 512 MiB of fp32 on a GPU: far past the L2
    x = torch.randn(n, device=DEVICE)
    rows = []
    for repeat in (1, 16, 64, 256):
        ms = bench.time_ms(regimes.repeat_fma, x, repeat)
        flops, nbytes = regimes.repeat_fma_flops(n, repeat), regimes.repeat_fma_bytes(n, 4)
        _, regime = bench.predicted_ms(flops, nbytes, ceilings, "fp32")
        rate = {"bytes_moved": nbytes} if regime == "memory-bound" else {"flops": flops}
        name = f"repeat_fma fp32 repeat={repeat} n=2^{n.bit_length() - 1}"
        rows.append(_row(name, ms, ceilings=ceilings, **rate))
    compiled = torch.compile(regimes.cos_cos_ref)
    compiled(x)  # compile outside the timing
    baselines = {
        "torch eager": bench.time_ms(regimes.cos_cos_ref, x),
        "torch.compile": bench.time_ms(compiled, x),
    }
    rows.append(
        _row(
            f"cos_cos fp32 n=2^{n.bit_length() - 1}",
            bench.time_ms(regimes.cos_cos, x),
            bytes_moved=regimes.cos_cos_bytes(n, 4, fused=True),
            ceilings=ceilings,
            baselines=baselines,
        )
    )
    return rows


MATMUL_LAYERS = ((4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336))  # (M, N, K)
MATMUL_DECODE = tuple((m, 4096, 4096) for m in (1, 16, 64))  # reported, no target
MATMUL_IRREGULAR = (8205, 5921, 2949)


def _epilogue_rows(ceilings, randn):
    """bias + exact GELU fused into the matmul, against cuBLAS then PyTorch's bias-GELU (two
    more kernels) and against the course's matmul then its fused bias_gelu (one more)."""
    from kernels.elementwise import bias_gelu
    from kernels.matmul import matmul

    eager = lambda x, w, bias: torch.nn.functional.gelu(torch.matmul(x, w) + bias)
    unfused = lambda x, w, bias: bias_gelu(matmul(x, w), bias)
    rows = []
    for m, n, k in ((4096, 14336, 1024), (4096, 14336, 4096)):
        x, weight = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16)
        args = (x, weight.t(), randn(n, dtype=torch.bfloat16))
        baselines = {
            "torch.matmul + bias-GELU": bench.time_ms(eager, *args),
            "matmul + bias_gelu": bench.time_ms(unfused, *args),
        }
        ms = bench.time_ms(matmul, *args, "gelu")
        name = f"matmul+bias+gelu bf16 {m}x{n}x{k} Wt"
        rows.append(
            _row(
                name, ms, flops=2 * m * n * k, ceilings=ceilings, dtype="bf16", baselines=baselines
            )
        )
    return rows


def bench_matmul(ceilings):
    """Squares in bf16 and fp16, LLM layer shapes (x @ W.t() with W an (N, K) nn.Linear weight),
    and fp32 both as IEEE (torch's default "highest") and with TF32 allowed: 2*M*N*K FLOPs."""
    from kernels.matmul import matmul

    def row(label, a, b, dtype, ceilings=ceilings):
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        torch_ms = bench.time_ms(torch.matmul, a, b)
        ms = bench.time_ms(matmul, a, b)
        baselines = {"torch.matmul": torch_ms}
        return _row(
            f"matmul {label}", ms, flops=flops, ceilings=ceilings, dtype=dtype, baselines=baselines
        )

    randn = lambda *shape, dtype=torch.float32: torch.randn(*shape, device=DEVICE, dtype=dtype)
    rows = []
    for name in ("bf16", "fp16"):
        dtype = bench.DTYPE_NAMES[name]
        for n in (1024, 2048, 4096, 8192):
            a, b = randn(n, n, dtype=dtype), randn(n, n, dtype=dtype)
            rows.append(row(f"{name} {n}^3", a, b, name))
    for m, n, k in MATMUL_LAYERS + MATMUL_DECODE:
        x, weight = randn(m, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16)
        rows.append(row(f"bf16 {m}x{n}x{k} Wt", x, weight.t(), "bf16"))
    m, n, k = MATMUL_IRREGULAR
    a, b = randn(m, k, dtype=torch.bfloat16), randn(k, n, dtype=torch.bfloat16)
    rows.append(row(f"bf16 {m}x{n}x{k}", a, b, "bf16"))
    rows.extend(_epilogue_rows(ceilings, randn))
    a, b = randn(4096, 4096), randn(4096, 4096)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        rows.append(row("fp32 ieee 4096^3", a, b, "fp32"))
        torch.set_float32_matmul_precision("high")
        # The TF32 ceiling, measured like the others (8192 cubed through torch)
        big = randn(8192, 8192)
        tf32 = bench.achieved_tflops(2 * 8192**3, bench.time_ms(torch.matmul, big, big))
        tf32_ceilings = {**ceilings, "matmul_tflops": {**ceilings["matmul_tflops"], "tf32": tf32}}
        rows.append(row("fp32 tf32 4096^3", a, b, "tf32", tf32_ceilings))
    finally:
        torch.set_float32_matmul_precision(previous)
    return rows


# Fusion (chapter 2): memory-bound ops at LLM-like shapes, against eager PyTorch and
# torch.compile (default mode, specialised to each shape; compile time excluded).
FUSION_SHAPES = ((4096, 4096), (16384, 8192))
FUSION_DTYPES = ("bf16", "fp32")


# Eager PyTorch baselines; all take (x, w, b) and use what they need.
def _bias_gelu_eager(x, w, b):
    return torch.nn.functional.gelu(x + b)


def _softmax_eager(x, w, b):
    return torch.softmax(x, dim=-1)


def _rms_norm_eager(x, w, b):
    return torch.nn.functional.rms_norm(x, x.shape[-1:], w, eps=1e-6)


def _layer_norm_eager(x, w, b):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps=1e-5)


def bench_fusion(ceilings, shapes=FUSION_SHAPES, dtypes=FUSION_DTYPES):
    from kernels.elementwise import bias_gelu
    from kernels.norm import layer_norm, rms_norm
    from kernels.softmax import softmax

    # op: (our kernel, eager PyTorch, how many length-n vectors it reads besides x)
    ops = {
        "bias_gelu": (lambda x, w, b: bias_gelu(x, b), _bias_gelu_eager, 1),
        "softmax": (lambda x, w, b: softmax(x), _softmax_eager, 0),
        "rms_norm": (lambda x, w, b: rms_norm(x, w), _rms_norm_eager, 1),
        "layer_norm": (layer_norm, _layer_norm_eager, 2),
    }
    rows = []
    for m, n in shapes:
        for dtype_name in dtypes:
            dtype = bench.DTYPE_NAMES[dtype_name]
            x = torch.randn(m, n, device=DEVICE, dtype=dtype)
            w = torch.randn(n, device=DEVICE, dtype=dtype)
            b = torch.randn(n, device=DEVICE, dtype=dtype)
            for op, (kernel, eager, n_vectors) in ops.items():
                compiled = torch.compile(eager, dynamic=False)
                compiled(x, w, b)  # compile now: compile time stays out of the timing
                bytes_moved = (2 * m * n + n_vectors * n) * x.element_size()  # read x, write y
                rows.append(
                    _row(
                        f"{op} {dtype_name} {m}x{n}",
                        bench.time_ms(kernel, x, w, b),
                        bytes_moved=bytes_moved,
                        ceilings=ceilings,
                        baselines={
                            "torch": bench.time_ms(eager, x, w, b),
                            "torch.compile": bench.time_ms(compiled, x, w, b),
                        },
                    )
                )
            del x, w, b
    return rows


SOFTMAX_ROWS = (2048, 4096, 8192, 16384, 32768, 131072)  # row lengths, bf16, 2^26 elements


def bench_softmax(ceilings):
    """Softmax at row lengths 2k to 131072 (bf16, 2^26 elements each), against eager
    PyTorch and torch.compile."""
    from kernels.softmax import softmax

    rows = []
    for n in SOFTMAX_ROWS:
        x = torch.randn(pick(cpu=2, gpu=(1 << 26) // n), n, device=DEVICE, dtype=torch.bfloat16)
        eager = lambda x: torch.softmax(x, dim=-1)
        compiled = torch.compile(eager, dynamic=False)
        compiled(x)
        baselines = {"torch": bench.time_ms(eager, x), "torch.compile": bench.time_ms(compiled, x)}
        ms = bench.time_ms(softmax, x)
        name = f"softmax bf16 {x.shape[0]}x{n}"
        rows.append(
            _row(name, ms, bytes_moved=2 * x.numel() * 2, ceilings=ceilings, baselines=baselines)
        )
    return rows


def bench_norm_backward(ceilings, shapes=FUSION_SHAPES):
    """The backward alone (dx, dw and db from dy): it reads x and dy and writes dx, so
    3 * numel elements at least; timed as autograd.grad on a kept graph."""
    from kernels.norm import layer_norm, rms_norm

    # op: (the course's kernel, eager PyTorch, how many of (x, w, b) it takes)
    ops = {
        "rms_norm": (lambda x, w, b: rms_norm(x, w), _rms_norm_eager, 2),
        "layer_norm": (layer_norm, _layer_norm_eager, 3),
    }
    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device=DEVICE, dtype=x.dtype, requires_grad=True)
        b = torch.randn(n, device=DEVICE, dtype=x.dtype, requires_grad=True)
        dy = torch.randn_like(x)
        for op, (ours, eager, n_inputs) in ops.items():
            inputs = (x, w, b)[:n_inputs]
            fns = {
                "ours": ours,
                "torch": eager,
                "torch.compile": torch.compile(eager, dynamic=False),
            }
            ms = {}
            for label, fn in fns.items():
                y = fn(x, w, b)  # one forward; the backward is timed on its graph
                ms[label] = bench.time_ms(torch.autograd.grad, y, inputs, dy, retain_graph=True)
            name = f"{op} bwd bf16 {m}x{n}"
            nbytes = 3 * x.numel() * x.element_size()
            rows.append(
                _row(name, ms.pop("ours"), bytes_moved=nbytes, ceilings=ceilings, baselines=ms)
            )
    return rows


# torch's scaled_dot_product_attention restricted to one backend: name -> SDPBackend member
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
ATTENTION_TOKENS = 16 * 32768  # B * H * S: enough programs to fill the GPU at every length


def attention_flops(B, H, Sq, Sk, D, causal, backward=False) -> float:
    """4*B*H*Sq*Sk*D for the two matmuls of the forward pass, halved with the causal mask;
    the backward pass counts 2.5x (five matmuls of the same size)."""
    flops = 4 * B * H * Sq * Sk * D / (2 if causal else 1)
    return 2.5 * flops if backward else flops


def attention_impls() -> dict:
    """name -> fn(q, k, v, causal): the course's kernel, and SDPA (its backend set by the name)."""
    import torch.nn.functional as F

    from kernels.attention import attention

    sdpa = lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return {"triton": attention, **{name: sdpa for name in SDPA_BACKENDS}}


def time_attention(B, H, S, D, causal, impls=None, dtype=torch.bfloat16) -> dict:
    """{name: (forward ms, backward ms)} for each of `impls` (default: attention_impls()) on the
    same (B, H, S, D) inputs. An SDPA backend that refuses the inputs is left out, saying so."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, do = (torch.randn(B, H, S, D, device=DEVICE, dtype=dtype) for _ in range(4))
    results = {}
    for name, fn in (impls or attention_impls()).items():
        backend = SDPA_BACKENDS.get(name)
        context = sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext()
        try:
            with context:
                results[name] = _forward_backward_ms(fn, q, k, v, do, causal)
        except RuntimeError as exc:  # this backend does not take these inputs on this GPU
            print(f"  {name} skipped at B={B} H={H} S={S} D={D}: {str(exc).splitlines()[0][:90]}")
    return results


def _forward_backward_ms(fn, q, k, v, do, causal):
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(qq, kk, vv, causal)  # the first call compiles and autotunes: untimed
    grads = lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)
    grads()
    with torch.no_grad():
        forward_ms = bench.time_ms(fn, q, k, v, causal)
    return forward_ms, bench.time_ms(grads)


def bench_attention(ceilings):
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            for S in (1024, 4096, 16384):
                H = 16
                B = max(1, ATTENTION_TOKENS // (H * S))
                times = time_attention(B, H, S, D, causal)
                fwd, bwd = times.pop("triton")
                tag = f"bf16 D={D} S={S // 1024}k{' causal' if causal else ''}"
                for direction, ms, backward in (("fwd", fwd, False), ("bwd", bwd, True)):
                    rows.append(
                        _row(
                            f"attn {direction} {tag}",
                            ms,
                            flops=attention_flops(B, H, S, S, D, causal, backward),
                            ceilings=ceilings,
                            dtype="bf16",
                            baselines={name: pair[backward] for name, pair in times.items()},
                        )
                    )
    return rows


def bench_batch_invariant(ceilings):
    """Chapter 5: each batch-invariant kernel against its ordinary counterpart, in bf16: matmul
    (M x 4096 @ 4096 x 4096) against cuBLAS, RMSNorm (rows of 4096) against the course's
    rms_norm and PyTorch, decoding attention (one query, 32 heads of 128) against the course's
    attention and SDPA; and serving the tiny LM with and without batch_invariant_mode()."""
    import torch.nn.functional as F

    from kernels import batch_invariant as bi
    from kernels.attention import attention
    from kernels.norm import rms_norm

    rows = []
    n = k = 4096
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    for m in (1, 16, 64, 256, 1024, 2048, 4096, 8192):
        a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        cublas = {"cuBLAS": bench.time_ms(torch.mm, a, b)}
        ms = bench.time_ms(bi.matmul, a, b)
        name = f"invariant matmul M={m}"  # bf16, N = K = 4096
        rows.append(
            _row(name, ms, flops=2 * m * n * k, ceilings=ceilings, dtype="bf16", baselines=cublas)
        )
    w = torch.randn(4096, device=DEVICE, dtype=torch.bfloat16)
    for m in (1, 64, 4096, 16384):
        x = torch.randn(m, 4096, device=DEVICE, dtype=torch.bfloat16)
        baselines = {
            "kernels.norm.rms_norm": bench.time_ms(rms_norm, x, w),
            "torch fp32 math": bench.time_ms(bi.rms_norm_ref, x, w),
            "F.rms_norm": bench.time_ms(F.rms_norm, x, (4096,), w, 1e-6),
        }
        ms = bench.time_ms(bi.rms_norm, x, w)
        name = f"invariant rms_norm {m}x4096"  # bf16
        rows.append(
            _row(name, ms, bytes_moved=2 * x.numel() * 2, ceilings=ceilings, baselines=baselines)
        )
    for batch, keys in ((1, 4096), (8, 4096), (64, 1024), (32, 8192)):
        q = torch.randn(batch, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
        k, v = (torch.randn(batch, 32, keys, 128, device=DEVICE, dtype=q.dtype) for _ in "kv")
        baselines = {
            "kernels.attention": bench.time_ms(attention, q, k, v),
            "SDPA": bench.time_ms(F.scaled_dot_product_attention, q, k, v),
        }
        ms = bench.time_ms(bi.attention, q, k, v)
        name = f"invariant attention B={batch} Sk={keys}"  # bf16, Sq=1, H=32, D=128
        rows.append(
            _row(name, ms, bytes_moved=2 * k.numel() * 2, ceilings=ceilings, baselines=baselines)
        )
    rows.append(_serving_row())
    return rows


def _serving_row():
    """Serving the same traffic to the tiny LM, default kernels against batch_invariant_mode()."""
    from kernels.batch_invariant import batch_invariant_mode
    from kernels.serving import run_experiment
    from kernels.tiny_lm import TinyLM

    model = TinyLM()
    traffic = dict(
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
    return {
        "name": f"tiny LM serving {tokens} tokens",
        "ms": 1e3 * seconds["invariant"],
        "unit": "tok/s",
        "rate": tokens / seconds["invariant"],
        "pct_of_ceiling": None,
        "baselines": {"default kernels": 1e3 * seconds["default"]},
    }


BENCHMARKS = {
    "add": bench_add,
    "regimes": bench_regimes,
    "matmul": bench_matmul,
    "fusion": bench_fusion,
    "softmax": bench_softmax,
    "norm_backward": bench_norm_backward,
    "attention": bench_attention,
    "batch_invariant": bench_batch_invariant,
}


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
