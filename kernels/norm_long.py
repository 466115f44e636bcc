"""RMSNorm and LayerNorm for rows longer than LONG_ROW_COLS, forward and backward.

The kernels of kernels.norm hold a whole row in registers, one row per program: past 65536
columns a row no longer fits. These kernels walk the row in chunks of BLOCK columns, one row
per program, in two passes:
- forward: pass 1 reads the row and keeps fp32 statistics per lane; pass 2 reads it again,
  normalizes and stores y. The row is read twice and written once: 3 * n_cols * element_size
  bytes per row, where the register kernels move 2 (a row of 4,194,304 bf16 is 8 MB: the
  second read is mostly served from the H200's 60 MiB L2).
- backward: pass 1 reads x and dy and sums g * x_hat (and g for LayerNorm) over the row;
  pass 2 reads them again and stores dx. dw and db stay fp32 partial sums, one row of
  n_cols per program (too long for registers, so they live in global memory: each program
  owns its row of partials and adds its rows into it in order); kernels.norm_backward's
  sum_partials_kernel then adds the partials in a fixed order. No atomics: same bits each run.

LayerNorm's variance: Welford's recurrence per lane, merged across lanes at the end (Chan et
al.'s pairwise formula), not sum(x) and sum(x^2). E[x^2] - E[x]^2 cancels when the mean is
large against the spread: a row of mean 300 and std 1 has E[x^2] ~ 9e4, whose fp32 rounding
(~6e-8 relative per add, over thousands of adds per lane) leaves an error near 1e-2 in a
variance of 1: 100x the fp32 tolerance. Welford keeps each lane's running mean and its sum of
squared deviations from it, so nothing large is subtracted. It costs a division per element,
which a memory-bound kernel hides. RMSNorm needs only sum(x^2): no subtraction, no cancellation.
"""

import torch
import triton
import triton.language as tl

from kernels.launch import launch, next_power_of_2
from kernels.norm_tuning import launch_metadata, num_warps

LONG_ROW_COLS = 65536  # rows longer than this take these kernels (tests lower it)
LONG_BLOCK = 8192  # columns per chunk: 16 values per thread at 16 warps (softmax's streamed size)


@triton.jit(launch_metadata=launch_metadata)
def rms_norm_long_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * x_stride, y_ptr + row * y_stride
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)  # pass 1: sum of x^2, per lane, fp32
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        squares += x * x
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):  # pass 2: y = x * rstd * w
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(launch_metadata=launch_metadata)
def layer_norm_long_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row, y_row = x_ptr + row * x_stride, y_ptr + row * y_stride
    cols = tl.arange(0, BLOCK)
    # pass 1, Welford per lane: count, running mean, sum of squared deviations from it
    count = tl.zeros([BLOCK], tl.float32)
    mean_lane = tl.zeros([BLOCK], tl.float32)
    m2 = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        count += tl.where(mask, 1.0, 0.0)
        delta = tl.where(mask, x - mean_lane, 0.0)
        mean_lane += delta / tl.maximum(count, 1.0)
        m2 += delta * tl.where(mask, x - mean_lane, 0.0)
    # merge the lanes: mean = sum(n_i mean_i) / n, M2 = sum(M2_i + n_i (mean_i - mean)^2)
    mean = tl.sum(count * mean_lane, axis=0) / n_cols
    spread = mean_lane - mean
    var = tl.sum(m2 + count * spread * spread, axis=0) / n_cols
    rstd = tl.rsqrt(var + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):  # pass 2: y = (x - mean) * rstd * w + b
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(launch_metadata=launch_metadata)
def norm_long_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr, n_rows, n_cols,
    dy_stride, x_stride, dx_stride, rows_per_program, BLOCK: tl.constexpr,
    LAYER_NORM: tl.constexpr,
):  # fmt: skip
    # dx = rstd * (g - x_hat * mean(g * x_hat) [- mean(g)]), g = dy * w; the partials
    # dw_part[pid] (and db_part[pid]) start at zero and gain dy * x_hat (and dy) row by row
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    first_row = pid.to(tl.int64) * rows_per_program
    part = pid.to(tl.int64) * n_cols
    for i in range(0, tl.minimum(rows_per_program, n_rows - pid * rows_per_program)):
        row = first_row + i
        x_row, dy_row = x_ptr + row * x_stride, dy_ptr + row * dy_stride
        dx_row = dx_ptr + row * dx_stride
        rstd = tl.load(rstd_ptr + row)
        mean = tl.load(mean_ptr + row) if LAYER_NORM else 0.0
        gx = tl.zeros([BLOCK], tl.float32)  # pass 1: sums of g * x_hat and g, per lane
        gs = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            g = dy * w
            gx += g * tl.where(mask, (x - mean) * rstd, 0.0)
            gs += g
        mean_gx = tl.sum(gx, axis=0) / n_cols
        mean_g = tl.sum(gs, axis=0) / n_cols if LAYER_NORM else 0.0
        for start in range(0, n_cols, BLOCK):  # pass 2: dx, and the partials
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
            dx = (dy * w - x_hat * mean_gx - mean_g) * rstd
            tl.store(dx_row + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw_at = dw_part_ptr + part + start + cols
            tl.store(dw_at, tl.load(dw_at, mask=mask, other=0.0) + dy * x_hat, mask=mask)
            if LAYER_NORM:
                db_at = db_part_ptr + part + start + cols
                tl.store(db_at, tl.load(db_at, mask=mask, other=0.0) + dy, mask=mask)


def _block(n_cols: int) -> int:
    return min(LONG_BLOCK, next_power_of_2(n_cols))


def forward(x2, weight, bias, eps, y2, mean, rstd):
    """Launch the long-row forward on rows x2 (unit column stride) into y2, mean, rstd."""
    n_rows, n_cols = x2.shape
    block = _block(n_cols)
    common = dict(BLOCK=block, num_warps=num_warps(block, 16))
    if bias is None:
        launch(rms_norm_long_fwd_kernel, (n_rows,),
            x2, weight, y2, rstd, n_cols, x2.stride(0), y2.stride(0), eps, **common,
        )  # fmt: skip
    else:
        launch(layer_norm_long_fwd_kernel, (n_rows,),
            x2, weight, bias, y2, mean, rstd, n_cols, x2.stride(0), y2.stride(0), eps, **common,
        )  # fmt: skip


def backward(dy2, x2, weight, mean, rstd, dx, n_programs, rows_per_program, layer_norm: bool):
    """Launch the long-row backward; return its fp32 partials (dw_part, db_part), each
    (n_programs, n_cols), for kernels.norm_backward to sum in its fixed order (RMSNorm's
    db_part is dw_part itself, as in the register kernel)."""
    n_rows, n_cols = x2.shape
    dw_part = torch.zeros((n_programs, n_cols), dtype=torch.float32, device=x2.device)
    db_part = torch.zeros_like(dw_part) if layer_norm else dw_part  # unused by RMSNorm
    block = _block(n_cols)
    launch(norm_long_bwd_kernel, (n_programs,),
        dy2, x2, weight, mean, rstd, dx, dw_part, db_part, n_rows, n_cols,
        dy2.stride(0), x2.stride(0), dx.stride(0), rows_per_program,
        BLOCK=block, LAYER_NORM=layer_norm, num_warps=num_warps(block, 16),
    )  # fmt: skip
    return dw_part, db_part
