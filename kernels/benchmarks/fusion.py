"""Chapter 2's benchmarks: memory-bound ops at LLM-like shapes (the vector add, bias + GELU,
softmax, the norms forward and backward), against eager PyTorch and torch.compile (default
mode, specialised to each shape; compile time excluded). Rated in GB/s of the bytes each op
must move at least. The forward ops at 4096 x 4096 (16 to 32 us of bytes at the H200's copy
bandwidth) are timed both ways, "[graph]" and "[call]" (see kernels.benchmarks.rows)."""

import torch

from kernels import bench
from kernels.benchmarks.rows import row, timed_rows
from kernels.runtime import DEVICE, pick

FUSION_SHAPES = ((4096, 4096), (16384, 8192))
FUSION_DTYPES = ("bf16", "fp32")
SOFTMAX_ROWS = (2048, 4096, 8192, 16384, 32768, 131072)  # row lengths, bf16, 2^26 elements

ADD_READS_TWICE = (
    "a 2:1 read:write stream turns the DRAM bus around less often than the 1:1 copy that sets "
    "the ceiling, so it moves a few percent more bytes per second"
)
# Rows that may pass their measured ceiling, and why: (name pattern, unit, reason). Each row
# built now carries its reason as "above_roof"; this table gives it to rows recorded before.
ABOVE_ROOF = ((r"add fp32 n=2\^\d+", "GB/s", ADD_READS_TWICE),)


def bench_add(ceilings):
    from kernels.elementwise import add

    rows = []
    for n in (1 << 20, 1 << 24, 1 << 28):
        x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
        ms = bench.time_ms(add, x, y)
        eager = bench.time_ms(torch.add, x, y)
        rows.append(
            row(
                f"add fp32 n=2^{n.bit_length() - 1}",
                ms,
                bytes_moved=3 * 4 * n,  # read x and y, write out
                ceilings=ceilings,
                baselines={"torch": eager},
                above_roof=ADD_READS_TWICE,
            )
        )
    return rows


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
            argsets = [(c, w, b) for c in bench.rotating_copies(x)]
            for op, (kernel, eager, n_vectors) in ops.items():
                compiled = torch.compile(eager, dynamic=False)
                compiled(x, w, b)  # compile now: compile time stays out of the timing
                rows += timed_rows(
                    f"{op} {dtype_name} {m}x{n}",
                    kernel,
                    argsets,
                    {"torch": eager, "torch.compile": compiled},
                    graph=m * n <= 4096 * 4096,
                    bytes_moved=(2 * m * n + n_vectors * n) * x.element_size(),  # read x, write y
                    ceilings=ceilings,
                )
            del x, w, b, argsets
    return rows


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
            row(name, ms, bytes_moved=2 * x.numel() * 2, ceilings=ceilings, baselines=baselines)
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
                row(name, ms.pop("ours"), bytes_moved=nbytes, ceilings=ceilings, baselines=ms)
            )
    return rows
