"""Chapter 1's kernels and the formulas its figures share: the three regimes, measured.

repeat_fma: load each element once, apply `repeat` multiply-adds in registers, store once.
  Bytes are fixed (one read, one write); FLOPs grow with `repeat`: a sweep over `repeat`
  walks one kernel from memory-bound to compute-bound, and the knee is the machine's ridge.
cos_cos: cos(cos(x)) in one pass: half the bytes of eager `x.cos().cos()` (which writes the
  intermediate to memory and reads it back).

Reading them: `sweep_knee` (where the repeat sweep bends), `fma_budget` (how many FMAs per
element a memory-bound kernel gets for free) and `double_the_batch` (the overhead test, with
the one threshold the chapter and Lab 1 share).
"""

import torch
import triton
import triton.language as tl

from kernels.validate import check_tensor

BLOCK_SIZE = 1024
MAX_REPEAT = 1 << 16  # every distinct repeat compiles its own kernel: keep them sane
# x -> x * SCALE + SHIFT has the fixed point 1 and contracts towards it slowly
# (SCALE**1024 is about 0.37): after many steps the output still depends on the input,
# stays finite, and a wrong loop count shows. Both are exact in fp32.
SCALE = 1.0 - 2.0**-10
SHIFT = 2.0**-10


# ---- formulas: FLOPs (an FMA is 2) and bytes moved (read plus written) ----


def repeat_fma_flops(n: int, repeat: int) -> int:
    return 2 * n * repeat


def repeat_fma_bytes(n: int, element_size: int) -> int:
    return 2 * n * element_size  # read x once, write out once, whatever `repeat` is


def cos_cos_flops(n: int) -> int:
    # By convention one cos counts as one FLOP. The GPU runs a full-precision fp32 cosine as a
    # range reduction and a polynomial: a few dozen instructions (see fma_budget).
    return 2 * n


def cos_cos_bytes(n: int, element_size: int, fused: bool = True) -> int:
    # fused: read x, write out. Eager: read x, write t; read t, write out.
    return (2 if fused else 4) * n * element_size


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def matmul_bytes(m: int, n: int, k: int, element_size: int) -> int:
    return (m * k + k * n + m * n) * element_size  # each operand read once, output written once


# ---- repeat_fma ----


@triton.jit
def repeat_fma_kernel(
    x_ptr, out_ptr, n_elements, scale, shift, REPEAT: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)  # the only read
    # REPEAT is a compile-time constant: the loop has no runtime bound to test, so the
    # compiler can unroll it and nearly every instruction is an FMA. scale and shift are
    # runtime values so that the chain cannot be folded away.
    for _ in range(REPEAT):
        x = x * scale + shift
    tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=mask)  # the only write


def _check_repeat(repeat):
    if isinstance(repeat, bool) or not isinstance(repeat, int):
        raise TypeError(f"repeat must be an int, got {type(repeat).__name__}")
    if not 0 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat must be between 0 and {MAX_REPEAT}, got {repeat}")


def repeat_fma(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """Apply x -> x * SCALE + SHIFT `repeat` times to every element, in fp32 registers:
    one read and one write per element whatever `repeat` is."""
    check_tensor("x", x)
    _check_repeat(repeat)
    x = x.contiguous()  # flat indexing below needs dense memory
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK_SIZE),)
        repeat_fma_kernel[grid](x, out, n, SCALE, SHIFT, REPEAT=repeat, BLOCK_SIZE=BLOCK_SIZE)
    return out


def repeat_fma_ref(x: torch.Tensor, repeat: int) -> torch.Tensor:
    _check_repeat(repeat)
    y = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64
    for _ in range(repeat):
        y = y * SCALE + SHIFT
    return y.to(x.dtype)


# ---- cos_cos ----


@triton.jit
def cos_cos_kernel(x_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    # the intermediate cos(x) stays in registers: it never goes to memory
    tl.store(out_ptr + offsets, tl.cos(tl.cos(x)).to(out_ptr.dtype.element_ty), mask=mask)


def cos_cos(x: torch.Tensor) -> torch.Tensor:
    """cos(cos(x)) in one pass (computed in fp32): 2 bytes moved per byte of x, not 4."""
    check_tensor("x", x)
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        cos_cos_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


def cos_cos_ref(x: torch.Tensor) -> torch.Tensor:
    return x.cos().cos()  # eager PyTorch: two kernels, the intermediate goes through memory


# ---- reading the measurements ----


def sweep_lines(repeats, ms, flat_points: int = 3, linear_points: int = 3):
    """The two lines of a repeat sweep, (flat_ms, ms_per_repeat): the flat one is the median
    time of the `flat_points` smallest repeats (memory-bound); the other goes through the origin,
    fitted to the `linear_points` largest (compute-bound: time proportional to repeat)."""
    if len(repeats) != len(ms):
        raise ValueError(f"repeats and ms differ in length: {len(repeats)} and {len(ms)}")
    if len(repeats) < flat_points + linear_points:
        raise ValueError(f"need at least {flat_points + linear_points} points, got {len(repeats)}")
    if list(repeats) != sorted(repeats) or min(repeats) <= 0 or min(ms) <= 0:
        raise ValueError("repeats must be positive and increasing, times positive")
    flat = sorted(ms[:flat_points])[flat_points // 2]
    r, t = repeats[-linear_points:], ms[-linear_points:]
    if min(t) < 2 * flat:
        raise ValueError(
            f"the sweep's last {linear_points} times are not clearly above the flat time "
            f"{flat:.4g} ms: extend it to larger repeats"
        )
    # least squares for t = slope * r
    slope = sum(a * b for a, b in zip(r, t, strict=True)) / sum(a * a for a in r)
    return flat, slope


def sweep_knee(repeats, ms, flat_points: int = 3, linear_points: int = 3) -> float:
    """Where the repeat sweep bends: the `repeat` at which its two lines meet."""
    flat, slope = sweep_lines(repeats, ms, flat_points, linear_points)
    return flat / slope


def first_repeat_above(repeats, ms, factor: float = 1.25) -> int:
    """The first repeat whose time exceeds `factor` times the time of the smallest repeat."""
    for r, t in zip(repeats, ms, strict=True):
        if t > factor * ms[0]:
            return r
    raise ValueError(f"no time in the sweep exceeds {factor} x the first")


def fma_budget(fma_tflops: float, gbps: float, bytes_per_element: int) -> float:
    """FMAs per element the chip can issue while memory streams one element in and out: a
    memory-bound elementwise kernel gets this many for free. (FMA/s) / (elements/s), with an FMA
    = 2 FLOPs and `bytes_per_element` read plus written (8 for fp32 in and out, 4 for bf16).
    Instructions that are not FMAs (a cosine's range reduction, an erf's polynomial, dtype
    conversions) spend the same budget, some at a fraction of the FMA's issue rate."""
    for name, value in (("fma_tflops", fma_tflops), ("gbps", gbps)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if isinstance(bytes_per_element, bool) or not isinstance(bytes_per_element, int):
        raise TypeError(f"bytes_per_element must be an int, got {type(bytes_per_element).__name__}")
    if bytes_per_element <= 0:
        raise ValueError(f"bytes_per_element must be positive, got {bytes_per_element}")
    return (fma_tflops * 1e12 / 2) / (gbps * 1e9 / bytes_per_element)


# The double-the-batch test. If a call costs t(b) = c + w * b (a fixed cost c per call, work w
# per item), doubling the batch multiplies the time by (c + 2wb) / (c + wb): below 1.5 exactly
# when c > wb, i.e. when the fixed, per-call cost is the larger part of the time. He's rule of
# thumb (a doubling that costs about 10% more) is the extreme case, c about 9x wb.
OVERHEAD_GROWTH = 1.5


def double_the_batch(ms: float, ms_doubled: float) -> str:
    """'overhead-bound' when twice the batch took less than OVERHEAD_GROWTH times as long (the
    per-call cost is most of the time), else 'scales with the work'."""
    if not (ms > 0 and ms_doubled > 0):
        raise ValueError(f"times must be positive, got {ms} and {ms_doubled}")
    return "overhead-bound" if ms_doubled < OVERHEAD_GROWTH * ms else "scales with the work"
