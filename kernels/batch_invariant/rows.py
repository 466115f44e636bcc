"""Batch-invariant row reductions over the last dim: RMSNorm, mean, softmax and log-softmax.

Each row is reduced on its own, always in the same order: BLOCK_C columns per step (BLOCK_C
depends only on the row length), partial sums kept per column lane, then one reduction across
the lanes. A library may instead split a row across several programs when the batch is too
small to fill the GPU, which changes the order of the additions with the batch size; here
the number of rows decides only how many programs run. On the GPU a program takes one row;
under the CPU interpreter, which pays for every operation in Python, it takes 16 rows side
by side (each still reduced on its own, in the same order).

Bytes: read the rows once for the statistics and once more to write (2 reads + 1 write).
"""

import math

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, launch, next_power_of_2
from kernels.norm import rms_norm_ref as rms_norm_ref  # the course's reference: the same maths
from kernels.operators import forward_road, operator
from kernels.primitives import add_combine, max_combine
from kernels.runtime import pick
from kernels.validate import check_row_vector, check_tensor

# add_combine and max_combine (kernels.primitives): tl.reduce with them is tl.sum and tl.max on
# the GPU, and a fast tl.reduce in the CPU interpreter.

BLOCK_R = pick(cpu=16, gpu=1)  # rows per program
MAX_BLOCK_C = 4096  # columns per step: the whole row up to 4096, else chunks of 4096


def _block_c(n_cols: int) -> int:
    return min(next_power_of_2(n_cols), MAX_BLOCK_C)


# Profiler metadata, one function per kernel: (grid, compiled kernel, its arguments by name) ->
# the launch's name with its shape, its FLOPs and its bytes (the least traffic: each tensor
# read or written once, so that bytes / time compares with the memory's peak). Triton calls
# them only while a profiler hook is set; the interpreter never does.


def _rows_name(kernel, args) -> str:
    return f"{kernel.name} [rows={args['n_rows']}, cols={args['n_cols']}]"


def rms_norm_metadata(grid, kernel, args) -> dict:
    """4 FLOPs an element (square, add; two multiplies); x and w read, out written."""
    rows, cols = args["n_rows"], args["n_cols"]
    x, w, out = args["x_ptr"], args["w_ptr"], args["out_ptr"]
    moved = rows * cols * (x.element_size() + out.element_size()) + cols * w.element_size()
    return {"name": _rows_name(kernel, args), "flops": 4 * rows * cols, "bytes": moved}


def row_mean_metadata(grid, kernel, args) -> dict:
    """1 FLOP an element (add); x read, one value a row written."""
    rows, cols = args["n_rows"], args["n_cols"]
    moved = rows * cols * args["x_ptr"].element_size() + rows * args["out_ptr"].element_size()
    return {"name": _rows_name(kernel, args), "flops": rows * cols, "bytes": moved}


def softmax_metadata(grid, kernel, args) -> dict:
    """7 FLOPs an element (max; subtract, exp, add; subtract, exp, divide), an exp counted as
    one; x read, out written."""
    rows, cols = args["n_rows"], args["n_cols"]
    moved = rows * cols * (args["x_ptr"].element_size() + args["out_ptr"].element_size())
    return {"name": _rows_name(kernel, args), "flops": 7 * rows * cols, "bytes": moved}


@triton.jit(do_not_specialize=["n_rows"], launch_metadata=rms_norm_metadata)
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, n_rows, n_cols, stride_x, stride_out, eps,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < n_rows
    x_rows = x_ptr + rows[:, None] * stride_x
    sum_sq = tl.full((BLOCK_R, BLOCK_C), 0.0, dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        x = tl.load(x_rows + cols, mask=row_ok & (cols < n_cols), other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.reduce(sum_sq, 1, add_combine) / n_cols + eps)
    out_rows = out_ptr + rows[:, None] * stride_out
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        mask = row_ok & (cols < n_cols)
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        tl.store(out_rows + cols, (x * rstd[:, None] * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"], launch_metadata=row_mean_metadata)
def row_mean_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_x,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    x_rows = x_ptr + rows[:, None] * stride_x
    total = tl.full((BLOCK_R, BLOCK_C), 0.0, dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        mask = (rows[:, None] < n_rows) & (cols < n_cols)
        total += tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.reduce(total, 1, add_combine) / n_cols
    tl.store(out_ptr + rows, mean.to(out_ptr.dtype.element_ty), mask=rows < n_rows)


@triton.jit(do_not_specialize=["n_rows"], launch_metadata=softmax_metadata)
def softmax_kernel(
    x_ptr, out_ptr, n_rows, n_cols, stride_x, stride_out,
    LOG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows[:, None] < n_rows
    x_rows = x_ptr + rows[:, None] * stride_x
    # pass 1: the row max (max is exact in any order); pass 2: sum of exp; pass 3: write
    row_max = tl.full((BLOCK_R, BLOCK_C), float("-inf"), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        x = tl.load(x_rows + cols, mask=row_ok & (cols < n_cols), other=float("-inf"))
        row_max = tl.maximum(row_max, x.to(tl.float32))
    m = tl.reduce(row_max, 1, max_combine)
    m = tl.where(m == float("-inf"), 0.0, m)[:, None]  # a row of -inf: exp gives 0, not NaN
    total = tl.full((BLOCK_R, BLOCK_C), 0.0, dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        x = tl.load(x_rows + cols, mask=row_ok & (cols < n_cols), other=float("-inf"))
        total += tl.exp(x.to(tl.float32) - m)
    denom = tl.where(row_ok, tl.reduce(total, 1, add_combine)[:, None], 1.0)
    out_rows = out_ptr + rows[:, None] * stride_out
    for start in range(0, n_cols, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
        mask = row_ok & (cols < n_cols)
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            y = (x - m) - tl.log(denom)
        else:
            y = tl.exp(x - m) / denom
        tl.store(out_rows + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x):
    """x (..., n) as a contiguous (rows, n) tensor."""
    return x.contiguous().reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _launch(kernel, n_rows, n_cols, *args, **constants):
    # Everything here depends on the row length only, never on the number of rows.
    block_c = _block_c(n_cols)
    launch(
        kernel,
        (cdiv(n_rows, BLOCK_R),),
        *args,
        BLOCK_R=BLOCK_R,
        BLOCK_C=block_c,
        num_warps=min(max(block_c // 512, 1), 8),
        **constants,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _as_rows(x)
    out = torch.empty_like(x2)
    n_rows, n_cols = x2.shape
    if x2.numel():
        _launch(rms_norm_kernel, n_rows, n_cols, x2, weight.contiguous(), out,
                n_rows, n_cols, x2.stride(0), out.stride(0), eps)  # fmt: skip
    return out.reshape(x.shape)


# torch.ops.brrr.invariant_rms_norm: forward only (a gradient reaching it raises torch's error)
invariant_rms_norm = operator(
    "invariant_rms_norm",
    _rms_norm,
    lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format),
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32. The operator
    torch.ops.brrr.invariant_rms_norm (no backward)."""
    check_tensor("x", x, min_ndim=1)
    check_row_vector("weight", weight, x)
    call = forward_road(invariant_rms_norm, x, weight)  # the roads of kernels.operators
    return _rms_norm(x, weight, eps) if call is None else call(x, weight, float(eps))


def mean(x: torch.Tensor, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """The mean over the last dim, accumulated in fp32; output in `dtype` (default: x's)."""
    check_tensor("x", x, min_ndim=1)
    out_dtype = dtype or x.dtype
    x2 = _as_rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(n_rows, dtype=out_dtype, device=x.device)
    if n_rows and n_cols:
        _launch(row_mean_kernel, n_rows, n_cols, x2, out, n_rows, n_cols, x2.stride(0))
    elif n_rows:
        out.fill_(float("nan"))  # the mean of nothing, as torch says
    shape = x.shape[:-1] + ((1,) if keepdim else ())
    return out.reshape(shape)


def softmax(x: torch.Tensor, log: bool = False, dtype=None) -> torch.Tensor:
    """softmax (or log_softmax) over the last dim, computed in fp32; output in `dtype`."""
    check_tensor("x", x, min_ndim=1)
    x2 = _as_rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty((n_rows, n_cols), dtype=dtype or x.dtype, device=x.device)
    if x2.numel():
        _launch(softmax_kernel, n_rows, n_cols,
                x2, out, n_rows, n_cols, x2.stride(0), out.stride(0), LOG=log)  # fmt: skip
    return out.reshape(x.shape)
