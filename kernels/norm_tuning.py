"""RMSNorm and LayerNorm: the measured launch choices and the profiler's metadata, which the
forward (kernels.norm) and the backward (kernels.norm_backward) share."""

import math

import torch

from kernels.runtime import ON_GPU


def num_warps(block: int, values_per_thread: int) -> int:
    # Measured on an H200 (scripts/tune_fusion.py): the forward moves the most bytes with
    # 32 values per thread (4 warps for rows of 4096, 8 for 8192; 16 warps at 8192 cost
    # LayerNorm a fifth of its bandwidth), the backward, which holds x and dy, with 16.
    return min(16, max(2, block // (32 * values_per_thread)))


def programs(n_rows: int, device) -> int:
    """How many programs share the rows in the backward: two per SM on a GPU (one per SM
    left a 4096 x 4096 backward at 44% of the copy bandwidth, two reached 60%)."""
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if ON_GPU else 8
    return max(1, min(n_rows, target))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, n_cols) with unit column stride: a view when strides allow, else a copy."""
    if t.dim() == 2 and t.stride(1) == 1:  # already rows: skip reshape's host time
        return t
    t2 = t.reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.numel() == 0 else t2.contiguous()


def launch_metadata(grid, kernel, args) -> dict:
    """What a profiler trace shows for a launch of a norm kernel: rows x cols, FLOPs counted
    per element of x, bytes counting each tensor read or written once. Read from the tensors,
    not the constexprs (older Triton passed those differently)."""
    backward = "dy_ptr" in args
    if backward:  # RMSNorm's backward passes its dw partials as the unused db partials too
        layer_norm = args["db_part_ptr"] is not args["dw_part_ptr"]
    else:
        layer_norm = "b_ptr" in args
    r = args.get("residual_ptr")  # the fused residual add; without one, x stands in for it
    residual = not backward and r is not None and r is not args["x_ptr"]
    rows = args["n_rows"] if backward else grid[0]  # the forward: one program per row
    cols, es = args["n_cols"], args["x_ptr"].element_size()
    n = 2 if layer_norm else 1  # LayerNorm's two: w and b, mean and rstd, dw and db partials
    if backward:  # x_hat, g, two row sums, dx, dw (and db); dy, x in, dx out, w, fp32 sums
        per_element = 13 if layer_norm else 9
        moved = es * (3 * rows * cols + cols) + 4 * n * (rows + grid[0] * cols)
    else:  # (mean,) square, sum, *rstd, *w (, +b); x in, y out, w (and b), fp32 stats out
        per_element = 7 if layer_norm else 4 + residual  # (+ the residual add)
        moved = es * ((2 + 2 * residual) * rows * cols + n * cols) + 4 * n * rows
    return {
        "name": f"{kernel.name} [rows={rows}, cols={cols}]",
        "flops": float(per_element * rows * cols),
        "bytes": moved,
    }
