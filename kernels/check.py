"""Correctness: the one tolerance table, and the helpers that tests and the grader share.

Policy: compare against a reference computed in higher precision (fp64, or fp32 on
upcast inputs); NaN where the reference is finite always fails; batch invariance and
determinism are bitwise (`torch.equal`), never a tolerance.
"""

import contextlib
import functools
import math
from dataclasses import dataclass

import torch

from kernels.runtime import DEVICE

# Sizes that catch masking and indexing bugs: 1, odd, block boundaries plus and minus one.
ODD_SIZES = (1, 3, 127, 129, 1000, 4097)

OP_CLASSES = ("elementwise", "reduction", "matmul", "attention")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# (dtype, op class) -> tolerance. bf16 is checked on the GPU only: Triton's interpreter
# computes bf16 wrongly without an error.
TOLERANCES = {
    (torch.float32, "elementwise"): Tolerance(atol=1e-5, rtol=1e-5),
    (torch.float32, "reduction"): Tolerance(atol=1e-5, rtol=1e-4),
    (torch.float32, "matmul"): Tolerance(atol=1e-4, rtol=1e-4),
    (torch.float32, "attention"): Tolerance(atol=1e-4, rtol=1e-4),
    (torch.float16, "elementwise"): Tolerance(atol=1e-3, rtol=1e-3),
    (torch.float16, "reduction"): Tolerance(atol=1e-3, rtol=1e-3),
    (torch.float16, "matmul"): Tolerance(atol=1e-2, rtol=1e-2),
    (torch.float16, "attention"): Tolerance(atol=1e-2, rtol=1e-2),
    (torch.bfloat16, "elementwise"): Tolerance(atol=1.6e-2, rtol=1.6e-2),
    (torch.bfloat16, "reduction"): Tolerance(atol=1.6e-2, rtol=1.6e-2),
    (torch.bfloat16, "matmul"): Tolerance(atol=2e-2, rtol=2e-2),
    (torch.bfloat16, "attention"): Tolerance(atol=2e-2, rtol=2e-2),
}


def tolerance(dtype: torch.dtype, op: str) -> Tolerance:
    """The tolerance for outputs of `dtype` from an op of class `op`."""
    if op not in OP_CLASSES:
        raise ValueError(f"op class must be one of {OP_CLASSES}, got {op!r}")
    try:
        return TOLERANCES[(dtype, op)]
    except KeyError:
        supported = sorted({str(d).removeprefix("torch.") for d, _ in TOLERANCES})
        raise TypeError(f"no tolerance for dtype {dtype}; supported: {supported}") from None


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in fp64."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


@dataclass(frozen=True)
class Comparison:
    ok: bool
    message: str
    max_abs_err: float = math.nan


def compare(out, ref, *, op: str, dtype: torch.dtype | None = None, baseline=None) -> Comparison:
    """Compare a kernel's output with a high-precision reference.

    `dtype` (default: out's) and `op` pick the tolerance. With `baseline`, PyTorch's own
    same-dtype result, the rule for matmul and attention applies as well: the kernel's
    relative error may be at most twice the baseline's. Where the reference is not finite the
    output must match it: the same infinity, NaN for NaN (a fully masked softmax row).
    """
    if not isinstance(out, torch.Tensor):
        return Comparison(False, f"expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(False, f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    dtype = dtype or out.dtype
    tol = tolerance(dtype, op)
    if out.numel() == 0:
        return Comparison(True, "empty", 0.0)
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref64)
    bad_nan = ~torch.isfinite(out64) & finite
    if bad_nan.any():
        idx = tuple(int(i) for i in bad_nan.nonzero()[0])
        return Comparison(
            False,
            f"{int(bad_nan.sum())} non-finite values where the reference is "
            f"finite (first at index {idx}): unwritten or overflowing output?",
        )
    unmatched = ~finite & (out64 != ref64) & ~(out64.isnan() & ref64.isnan())
    if unmatched.any():
        idx = tuple(int(i) for i in unmatched.nonzero()[0])
        return Comparison(
            False,
            f"{int(unmatched.sum())} values differ where the reference is not finite (first at "
            f"index {idx}: got {out64[idx].item():.6g}, expected {ref64[idx].item():g})",
        )
    err = torch.where(finite, (out64 - ref64).abs(), 0.0)
    max_abs = err.max().item()
    limit = tol.atol + tol.rtol * torch.where(finite, ref64.abs(), 0.0)
    within = bool((err <= limit).all())
    if baseline is not None:
        mine, theirs = relative_error(out, ref), relative_error(baseline, ref)
        if mine <= 2 * theirs:
            return Comparison(
                True, f"relative error {mine:.2e} <= 2 x torch's {theirs:.2e}", max_abs
            )
        if not within:
            return Comparison(
                False,
                f"relative error {mine:.2e} > 2 x torch's {theirs:.2e} "
                f"and max abs error {max_abs:.2e} beyond atol={tol.atol}, "
                f"rtol={tol.rtol}",
                max_abs,
            )
    if not within:
        idx = tuple(int(i) for i in (err - limit).flatten().argmax().unsqueeze(0))
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx[0]), err.shape))
        return Comparison(
            False,
            f"max abs error {max_abs:.3g} at index {where} "
            f"(got {out64[where].item():.6g}, expected {ref64[where].item():.6g}); "
            f"tolerance atol={tol.atol}, rtol={tol.rtol} for {dtype} {op}",
            max_abs,
        )
    return Comparison(True, f"max abs error {max_abs:.2e}", max_abs)


def tolerance_units(out, ref, *, op: str, dtype: torch.dtype | None = None) -> float:
    """The largest error of `out` against `ref` in units of the tolerance table's allowance,
    |out - ref| / (atol + rtol |ref|), over the elements where `ref` is finite: below 1 is
    within tolerance; inf where `out` is not finite but `ref` is. `dtype` defaults to out's."""
    tol = tolerance(dtype or out.dtype, op)
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    finite = torch.isfinite(ref64)
    if not finite.any():
        return 0.0
    out64, ref64 = out64[finite], ref64[finite]
    if not torch.isfinite(out64).all():
        return math.inf
    return ((out64 - ref64).abs() / (tol.atol + tol.rtol * ref64.abs())).max().item()


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype (fp16: 63488 of them, bf16: 65280), in bit
    order, on the CPU: a sweep that leaves no input out."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"every_value needs float16 or bfloat16, got {dtype}")
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return values[torch.isfinite(values)]


def every_value_error(fn, baseline, ref, dtype: torch.dtype, *, op: str, device=None) -> dict:
    """The largest error, in tolerance units (tolerance_units), of `fn` and of `baseline`
    (PyTorch's own op in `dtype`) over every finite value x of `dtype` (every_value), against
    `ref` on x in fp64. Each takes a 1-D tensor of `dtype` on `device` (default DEVICE).
    Returns {"ours": float, "torch": float, "torch_non_finite": int}: torch's is over the inputs
    where it gives a finite result, and the count of the others (its bf16 GELU overflows to inf
    above 1.7e38, where the exact result is finite)."""
    x = every_value(dtype).to(device or DEVICE)
    expected = ref(x.double())
    theirs = baseline(x)
    finite = torch.isfinite(theirs)
    return {
        "ours": tolerance_units(fn(x), expected, op=op, dtype=dtype),
        "torch": tolerance_units(theirs[finite], expected[finite], op=op, dtype=dtype),
        "torch_non_finite": int((~finite & torch.isfinite(expected)).sum()),
    }


def assert_close(out, ref, *, op: str, dtype: torch.dtype | None = None, baseline=None) -> None:
    """`compare`, raising AssertionError with its message on failure."""
    result = compare(out, ref, op=op, dtype=dtype, baseline=baseline)
    if not result.ok:
        raise AssertionError(result.message)


def random_tensor(shape, dtype=torch.float32, *, seed: int, device=None, scale: float = 1.0):
    """Fresh normal(0.5 scale, scale) values: non-trivial magnitude, never zeros, new per seed."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + 0.5 * scale
    return values.to(dtype=dtype, device=device or DEVICE)


# The poison of float allocations: a NaN with a payload that no arithmetic produces (an invalid
# operation such as inf - inf gives the hardware's default NaN), so an element that still holds
# these bits was never written, and any other NaN was computed.
POISON_BITS = {
    torch.float64: (torch.int64, 0x7FF8_DEAD_DEAD_DEAD),
    torch.float32: (torch.int32, 0x7FC0_DEAD),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FDA),
}


def _poison(t: torch.Tensor) -> None:
    if t.dtype in POISON_BITS:
        bits_dtype, bits = POISON_BITS[t.dtype]
        t.view(bits_dtype).fill_(bits)
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(math.nan)
    else:
        t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)


def unwritten(t: torch.Tensor) -> torch.Tensor:
    """Where a float tensor still holds the poison of `poisoned_allocations` (a bool tensor)."""
    if t.dtype in POISON_BITS:
        bits_dtype, bits = POISON_BITS[t.dtype]
        return t.view(bits_dtype) == bits
    return t.isnan()


@contextlib.contextmanager
def poisoned_allocations():
    """Within the block, torch.empty / empty_like / empty_strided and Tensor.new_empty return
    memory filled with NaN (or the dtype's max for integers), so elements a kernel fails to
    write show up as wrong; `unwritten` tells that NaN from one a kernel computed."""
    owners = [(torch, name) for name in ("empty", "empty_like", "empty_strided")]
    owners.append((torch.Tensor, "new_empty"))
    originals = [(owner, name, getattr(owner, name)) for owner, name in owners]

    def wrap(allocate):
        @functools.wraps(allocate)  # keeps the name: the grader allows new_empty in launchers
        def poisoned(*args, **kwargs):
            t = allocate(*args, **kwargs)
            if t.numel():
                _poison(t)
            return t

        return poisoned

    for owner, name, allocate in originals:
        setattr(owner, name, wrap(allocate))
    try:
        yield
    finally:
        for owner, name, allocate in originals:
            setattr(owner, name, allocate)


def _widened(a):
    """An fp64 copy of a floating-point tensor; anything else (integer indices, lengths) as is."""
    return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def against_fp64(fn, *args, ref, op: str, baseline=None, **kwargs) -> Comparison:
    """The one kernel check that tests and chapters share: `fn(*args, **kwargs)` under poisoned
    allocations, against `ref` run on fp64 copies of the floating-point tensor arguments.

    The output must be a fresh contiguous tensor with the dtype of the first floating-point
    tensor argument, every element written, and every tensor argument (keywords too) unchanged.
    `baseline` (PyTorch's own op, run on the same 16-bit arguments) turns on the matmul/attention
    rule: within twice torch's error passes too. Returns the Comparison (`.ok`, `.message`);
    tests assert on it, chapters print it.
    """
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    floats = [t for t in inputs if t.is_floating_point()]
    if not floats:
        raise TypeError("against_fp64 needs a floating-point tensor argument")
    dtype = floats[0].dtype
    before = [t.clone() for t in inputs]
    with poisoned_allocations():
        out = fn(*args, **kwargs)
    expected = ref(*map(_widened, args), **{k: _widened(v) for k, v in kwargs.items()})
    if not isinstance(out, torch.Tensor):
        return Comparison(False, f"expected a tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        return Comparison(False, f"output dtype {out.dtype}, expected the inputs' {dtype}")
    if not out.is_contiguous():
        return Comparison(False, f"output is not contiguous (strides {out.stride()})")
    if out.numel() and any(t.numel() and _shares_memory(out, t) for t in inputs):
        return Comparison(False, "the output shares memory with an input: allocate a fresh one")
    for i, (b, t) in enumerate(zip(before, inputs, strict=True)):
        if not torch.equal(b, t):
            return Comparison(False, f"tensor argument {i} (shape {tuple(t.shape)}) was modified")
    never = unwritten(out) if out.shape == expected.shape else None
    if never is not None and never.any():  # wherever the reference is, finite or not
        first = tuple(int(i) for i in never.nonzero()[0])
        return Comparison(
            False, f"{int(never.sum())} output elements never written (first at index {first})"
        )
    theirs = None
    if baseline is not None and dtype in (torch.float16, torch.bfloat16):
        theirs = baseline(*args, **kwargs)
    return compare(out, expected, op=op, dtype=dtype, baseline=theirs)
