"""RMSNorm and LayerNorm, backward: one kernel for both, and its operators.

With x_hat = normalized x (recomputed from x and the forward's saved rstd, and mean) and
g = dy * w:
  RMSNorm:   dx = rstd * (g - x_hat * mean(g * x_hat))
  LayerNorm: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
  dw = sum over rows of dy * x_hat, db = sum over rows of dy.
dw and db are sums over all rows: each program takes a contiguous chunk of rows and writes
its own fp32 partial sums; a second kernel adds the partials in a fixed order. No atomics:
the result is the same bits on every run. Rows longer than norm_long.LONG_ROW_COLS take
kernels.norm_long's chunked backward, whose partials the same second kernel adds.
"""

import torch
import triton
import triton.language as tl

from kernels import norm_long
from kernels.launch import Launcher, aligned, cdiv, int_class, next_power_of_2
from kernels.norm_tuning import as_rows, launch_metadata, num_warps, programs
from kernels.operators import backward_operator, dense_like


@triton.jit(launch_metadata=launch_metadata)
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


def norm_backward(dy, x2, weight, mean, rstd, layer_norm: bool):
    n_rows, n_cols = x2.shape
    weight = weight.contiguous()  # read as a dense vector: a strided one (w[::2]) is copied
    dx = x2.new_empty((n_rows, n_cols))
    dw = torch.zeros_like(weight)  # zeros: a sum over no rows
    db = torch.zeros_like(weight) if layer_norm else None
    if dx.numel() == 0:
        return dx, dw, db
    dy2 = as_rows(dy)
    rows_per_program = cdiv(n_rows, programs(n_rows, x2.device))
    n_programs = cdiv(n_rows, rows_per_program)
    if n_cols > norm_long.LONG_ROW_COLS:
        dw_part, db_part = norm_long.backward(
            dy2, x2, weight, mean, rstd, dx, n_programs, rows_per_program, layer_norm
        )
        _sum_partials(dw_part, dw, db_part, db, n_programs, n_cols, layer_norm)
        return dx, dw, db
    dw_part = x2.new_empty((n_programs, n_cols), dtype=torch.float32)
    db_part = torch.empty_like(dw_part) if layer_norm else dw_part  # unused by RMSNorm
    block = next_power_of_2(n_cols)
    # The launch's key (kernels.launch): what Triton specializes on. dx and the partials are
    # fresh allocations (aligned); BLOCK and num_warps follow from n_cols.
    key = (dy2.dtype, x2.dtype, weight.dtype, mean.dtype, rstd.dtype, block, layer_norm,
           aligned(dy2), aligned(x2), aligned(weight), aligned(mean), aligned(rstd),
           int_class(n_rows), int_class(n_cols), int_class(dy2.stride(0)),
           int_class(x2.stride(0)), int_class(rows_per_program))  # fmt: skip
    _launch_norm_bwd(key, (n_programs,),
        dy2, x2, weight, mean, rstd, dx, dw_part, db_part, n_rows, n_cols, dy2.stride(0),
        x2.stride(0), n_cols, rows_per_program,
        BLOCK=block, LAYER_NORM=layer_norm, num_warps=num_warps(block, 16),
    )  # fmt: skip
    _sum_partials(dw_part, dw, db_part, db, n_programs, n_cols, layer_norm)
    return dx, dw, db


_launch_norm_bwd = Launcher(norm_bwd_kernel)
_launch_sum_partials = Launcher(sum_partials_kernel)


def _sum_partials(dw_part, dw, db_part, db, n_programs, n_cols, layer_norm):
    """dw (and db) = the fp32 partials summed over programs, in a fixed order. The partials
    are fresh allocations (aligned); dw and db may be anything zeros_like returns."""
    grid = (cdiv(n_cols, 128),)
    for part, out in ((dw_part, dw), (db_part, db)) if layer_norm else ((dw_part, dw),):
        key = (out.dtype, aligned(out), int_class(n_programs), int_class(n_cols))
        _launch_sum_partials(key, grid, part, out, n_programs, n_cols, BLOCK_P=32, BLOCK_N=128)


def _rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw, _ = norm_backward(dy, as_rows(x), weight, rstd, rstd, layer_norm=False)
    return dx.view(x.shape), dw


def _layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    dx, dw, db = norm_backward(dy, as_rows(x), weight, mean, rstd, layer_norm=True)
    return dx.view(x.shape), dw, db


# What the norms' backward formulas call (kernels.operators.backward_operator): the operator,
# or in an eager autograd Function's backward, the implementation itself.
rms_norm_backward = backward_operator(
    "rms_norm_backward", _rms_norm_backward, lambda dy, x, w, rstd: (dense_like(x), dense_like(w))
)
layer_norm_backward = backward_operator(
    "layer_norm_backward",
    _layer_norm_backward,
    lambda dy, x, w, mean, rstd: (dense_like(x), dense_like(w), dense_like(w)),
)
