"""RMSNorm and LayerNorm over the last dim, forward and backward, fused, fp32 accumulation.

RMSNorm:   y = x * rstd * w,             rstd = 1 / sqrt(mean(x^2) + eps)
LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var(x) + eps)   (biased var)

Forward: one row per program; the row stays in registers, so x is read once and y written
once (plus w, b and one or two fp32 numbers per row, kept for the backward).
Backward, with x_hat = normalized x and g = dy * w:
  RMSNorm:   dx = rstd * (g - x_hat * mean(g * x_hat))
  LayerNorm: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
  dw = sum over rows of dy * x_hat, db = sum over rows of dy.
x_hat is recomputed from x and the saved rstd (and mean), never stored. dw and db are sums
over all rows: each program takes a contiguous chunk of rows and writes its own fp32
partial sums; a second kernel adds the partials in a fixed order. No atomics: the result
is the same bits on every run.
"""

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from kernels.runtime import ON_GPU
from kernels.validate import check_row_vector, check_tensor, needs_grad

MAX_COLS = 65536  # rows are kept whole in registers; longer ones would need a loop


def _num_warps(block: int, values_per_thread: int) -> int:
    # Measured on an H200 (scripts/tune_fusion.py): the forward moves the most bytes with
    # 32 values per thread (4 warps for rows of 4096, 8 for 8192; 16 warps at 8192 cost
    # LayerNorm a fifth of its bandwidth), the backward, which holds x and dy, with 16.
    return min(16, max(2, block // (32 * values_per_thread)))


def _launch_metadata(grid, kernel, args) -> dict:
    """What a profiler trace shows for a launch of a norm kernel: rows x cols, FLOPs counted
    per element of x, bytes counting each tensor read or written once. Read from the tensors,
    not the constexprs (older Triton passed those differently)."""
    backward = "dy_ptr" in args
    if backward:  # RMSNorm's backward passes its dw partials as the unused db partials too
        layer_norm = args["db_part_ptr"] is not args["dw_part_ptr"]
    else:
        layer_norm = "b_ptr" in args
    rows = args["n_rows"] if backward else grid[0]  # the forward: one program per row
    cols, es = args["n_cols"], args["x_ptr"].element_size()
    n = 2 if layer_norm else 1  # LayerNorm's two: w and b, mean and rstd, dw and db partials
    if backward:  # x_hat, g, two row sums, dx, dw (and db); dy, x in, dx out, w, fp32 sums
        per_element = 13 if layer_norm else 9
        moved = es * (3 * rows * cols + cols) + 4 * n * (rows + grid[0] * cols)
    else:  # (mean,) square, sum, *rstd, *w (, +b); x in, y out, w (and b), fp32 stats out
        per_element = 7 if layer_norm else 4
        moved = es * (2 * rows * cols + n * cols) + 4 * n * rows
    return {
        "name": f"{kernel.name} [rows={rows}, cols={cols}]",
        "flops": float(per_element * rows * cols),
        "bytes": moved,
    }


@triton.jit(launch_metadata=_launch_metadata)
def rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * y_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(launch_metadata=_launch_metadata)
def layer_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    x_stride,
    y_stride,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)  # two passes over registers: no E[x^2] - E[x]^2
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(
        y_ptr + row * y_stride + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask
    )


@triton.jit(launch_metadata=_launch_metadata)
def norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    n_rows,
    n_cols,
    dy_stride,
    x_stride,
    dx_stride,
    rows_per_program,
    BLOCK: tl.constexpr,
    LAYER_NORM: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first_row = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, n_rows - pid * rows_per_program)):
        row = first_row + i
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if LAYER_NORM:
            x_hat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        else:
            x_hat = x * rstd
        g = dy * w
        dx = g - x_hat * (tl.sum(g * x_hat, axis=0) / n_cols)
        if LAYER_NORM:
            dx -= tl.sum(g, axis=0) / n_cols
            db += dy
        tl.store(
            dx_ptr + row * dx_stride + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=mask
        )
        dw += dy * x_hat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=mask)
    if LAYER_NORM:
        tl.store(db_part_ptr + pid * n_cols + cols, db, mask=mask)


@triton.jit
def sum_partials_kernel(
    part_ptr, out_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    # out[c] = sum over p of part[p, c], always in the same order
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < n_parts) & (cols[None, :] < n_cols)
        tile = tl.load(part_ptr + parts[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, n_cols) with unit column stride: a view when strides allow, else a copy."""
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.numel() == 0 else t2.contiguous()


def _check(x, eps, **params):
    check_tensor("x", x, min_ndim=1)
    for name, p in params.items():
        check_row_vector(name, p, x)
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"rows longer than {MAX_COLS} are not supported, got {tuple(x.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def _forward(x, weight, bias, eps):
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    mean = None if bias is None else torch.empty_like(rstd)  # RMSNorm has no mean
    if x.numel():
        n_rows, n_cols = x2.shape
        block = triton.next_power_of_2(n_cols)
        common = dict(BLOCK=block, num_warps=_num_warps(block, 32))
        y2 = y.view(n_rows, n_cols)
        if bias is None:
            rms_norm_fwd_kernel[(n_rows,)](
                x2, weight, y2, rstd, n_cols, x2.stride(0), n_cols, eps, **common
            )
        else:
            layer_norm_fwd_kernel[(n_rows,)](
                x2, weight, bias, y2, mean, rstd, n_cols, x2.stride(0), n_cols, eps, **common
            )
    return y, x2, mean, rstd


def _programs(n_rows: int, device) -> int:
    """How many programs share the rows in the backward: two per SM on a GPU (one per SM
    left a 4096 x 4096 backward at 44% of the copy bandwidth, two reached 60%)."""
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if ON_GPU else 8
    return max(1, min(n_rows, target))


def _backward(dy, x2, weight, mean, rstd, layer_norm: bool):
    n_rows, n_cols = x2.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    dw = torch.zeros_like(weight)  # zeros: a sum over no rows
    db = torch.zeros_like(weight) if layer_norm else None
    if dx.numel() == 0:
        return dx, dw, db
    dy2 = _rows(dy)
    rows_per_program = triton.cdiv(n_rows, _programs(n_rows, x2.device))
    n_programs = triton.cdiv(n_rows, rows_per_program)
    dw_part = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2.device)
    db_part = torch.empty_like(dw_part) if layer_norm else dw_part  # unused by RMSNorm
    block = triton.next_power_of_2(n_cols)
    norm_bwd_kernel[(n_programs,)](
        dy2,
        x2,
        weight,
        mean,
        rstd,
        dx,
        dw_part,
        db_part,
        n_rows,
        n_cols,
        dy2.stride(0),
        x2.stride(0),
        n_cols,
        rows_per_program,
        BLOCK=block,
        LAYER_NORM=layer_norm,
        num_warps=_num_warps(block, 16),
    )
    for part, out in ((dw_part, dw), (db_part, db)) if layer_norm else ((dw_part, dw),):
        grid = (triton.cdiv(n_cols, 128),)
        sum_partials_kernel[grid](part, out, n_programs, n_cols, BLOCK_P=32, BLOCK_N=128)
    return dx, dw, db


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x2, mean, rstd = _forward(x, weight, None, eps)
        ctx.save_for_backward(x2, weight, rstd)  # x and one fp32 per row: x_hat is recomputed
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw, _ = _backward(dy, x2, weight, rstd, rstd, layer_norm=False)
        return dx.view(ctx.x_shape), dw, None


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, x2, mean, rstd = _forward(x, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy, x2, weight, mean, rstd, layer_norm=True)
        return dx.view(ctx.x_shape), dw, db, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading dims), scaled by `weight`; fp32 inside,
    output in x's dtype. Differentiable in x and weight (backward in Triton)."""
    _check(x, eps, weight=weight)
    if needs_grad(x, weight):
        return RMSNormFunction.apply(x, weight, float(eps))
    return _forward(x, weight, None, float(eps))[0]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of `x` (any leading dims), then `* weight + bias`; fp32
    inside, output in x's dtype. Differentiable in x, weight and bias (backward in Triton)."""
    _check(x, eps, weight=weight, bias=bias)
    if needs_grad(x, weight, bias):
        return LayerNormFunction.apply(x, weight, bias, float(eps))
    return _forward(x, weight, bias, float(eps))[0]


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_ref(x, weight, eps: float = 1e-6):
    # reads x and w, writes y; in eager PyTorch each op below is its own kernel
    xc = x.to(_compute_dtype(x))
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (xc * rstd * weight.to(xc.dtype)).to(x.dtype)


def layer_norm_ref(x, weight, bias, eps: float = 1e-5):
    c = _compute_dtype(x)
    y = torch.nn.functional.layer_norm(x.to(c), x.shape[-1:], weight.to(c), bias.to(c), eps)
    return y.to(x.dtype)
