"""Softmax over the last dim: at best one read and one write of the input.

softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), m = max_j x_j. Subtracting the row max
changes nothing mathematically and keeps exp() from overflowing (exp(89) is inf in fp32).

Three kernels, four paths; kernels.softmax_tuning.plan() picks one per call from the shape:
- softmax_row_kernel: BLOCK_ROWS whole rows per program, in registers: the input is read
  once and the output written once, 2 * numel * element_size bytes. Short rows take several
  rows a program ("rows"), mid rows one ("row").
- softmax_streamed_kernel ("streamed", long rows): the online-softmax recurrence keeps a
  running max and a running sum over blocks of the row (pass 1), then writes exp(x - max) / sum
  (pass 2): the row is read twice (the second read is often served from L2) and written once.
- softmax_partials_kernel + softmax_split_kernel ("split", long rows too few to fill the SMs):
  each row cut into pieces, one program per piece in both passes; the partial maxima and sums
  go through an fp32 (rows, splits) buffer between them. Read twice, written once.
All compute in fp32 whatever the input dtype.

Backward, from the saved output y: dx = y * (dy - sum_j dy_j y_j), in fp32 (torch ops that a
compiled backward fuses: reads y and dy, writes dx).
"""

import torch
import triton
import triton.language as tl

from kernels import softmax_tuning as tuning
from kernels.launch import cdiv, launch, next_power_of_2
from kernels.norm_tuning import as_rows
from kernels.operators import dense_like, operator, register_autograd
from kernels.softmax_tuning import FUSED_MAX_COLS
from kernels.validate import check_tensor, needs_grad

__all__ = ["FUSED_MAX_COLS", "softmax", "softmax_path", "softmax_ref", "softmax_streamed"]


@triton.jit
def softmax_row_kernel(
    x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride,
    BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    # rows past the end read the last row again (in bounds, no mask) and are not stored;
    # 64-bit: row * stride may pass 2**31
    rows_in = tl.minimum(rows, n_rows - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = (cols < n_cols)[None, :]
    # masked lanes read -inf: exp(-inf - m) = 0, so they add nothing to the sum
    x_ptrs = x_ptr + rows_in[:, None] * x_row_stride + cols[None, :]  # (BLOCK_ROWS, BLOCK)
    x = tl.load(x_ptrs, mask=col_ok, other=float("-inf")).to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=1)[:, None])
    out = numerator / tl.sum(numerator, axis=1)[:, None]
    out_ptrs = out_ptr + rows_in[:, None] * out_row_stride + cols[None, :]
    mask = col_ok & (rows < n_rows)[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def online_max_sum(x_row, start, end, BLOCK: tl.constexpr):
    """(m, s) over x_row[start:end]: its max, and the sum of exp(x - m), read once in blocks.
    A running max m (a scalar) and running sums d (one per lane): when the max grows from m to
    m', the sums so far are rescaled by exp(m - m'), one exp per step, not per element. `safe`
    stands in for a max of -inf (only -inf seen so far), where exp(-inf - (-inf)) would be NaN."""
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.zeros([BLOCK], tl.float32)
    for col in range(start, end, BLOCK):
        x = tl.load(x_row + col + cols, mask=col + cols < end, other=float("-inf"))
        x = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    return m, tl.sum(d, axis=0)


@triton.jit
def normalize(x_row, out_row, start, end, m, inv_sum, BLOCK: tl.constexpr):
    """out_row[start:end] = exp(x - m) * inv_sum, in blocks: the second read of the input."""
    cols = tl.arange(0, BLOCK)
    for col in range(start, end, BLOCK):
        mask = col + cols < end
        x = tl.load(x_row + col + cols, mask=mask, other=float("-inf")).to(tl.float32)
        out = tl.exp(x - m) * inv_sum
        tl.store(out_row + col + cols, out.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def softmax_streamed_kernel(
    x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m, s = online_max_sum(x_row, 0, n_cols, BLOCK)  # pass 1
    normalize(x_row, out_ptr + row * out_row_stride, 0, n_cols, m, 1.0 / s, BLOCK)  # pass 2


@triton.jit
def softmax_partials_kernel(
    x_ptr, max_ptr, sum_ptr, n_cols, x_row_stride, cols_per_split, BLOCK: tl.constexpr
):
    # program (row, piece): the piece's max and sum of exp(x - max), to (rows, splits) fp32
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    start = piece * cols_per_split
    end = tl.minimum(start + cols_per_split, n_cols)
    m, s = online_max_sum(x_ptr + row * x_row_stride, start, end, BLOCK)
    at = row * tl.num_programs(1) + piece
    tl.store(max_ptr + at, m)
    tl.store(sum_ptr + at, s)


@triton.jit
def softmax_split_kernel(
    x_ptr, out_ptr, max_ptr, sum_ptr, n_cols, x_row_stride, out_row_stride, cols_per_split,
    BLOCK: tl.constexpr, SPLITS_BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    splits = tl.num_programs(1)
    # the row's partials, combined: m = max m_i, s = sum s_i exp(m_i - m) (every piece's
    # program computes the same m and s, in the same order)
    pieces = tl.arange(0, SPLITS_BLOCK)
    ok = pieces < splits
    maxima = tl.load(max_ptr + row * splits + pieces, mask=ok, other=float("-inf"))
    sums = tl.load(sum_ptr + row * splits + pieces, mask=ok, other=0.0)
    m = tl.max(maxima, axis=0)
    safe = tl.where(m == float("-inf"), 0.0, m)  # a row of -inf: NaN below, as torch gives
    s = tl.sum(sums * tl.exp(maxima - safe), axis=0)
    start = piece * cols_per_split
    end = tl.minimum(start + cols_per_split, n_cols)
    x_row = x_ptr + row * x_row_stride
    normalize(x_row, out_ptr + row * out_row_stride, start, end, m, 1.0 / s, BLOCK)


def _launch(x: torch.Tensor, how: tuning.Plan) -> torch.Tensor:
    x2, out = as_rows(x), dense_like(x)
    out2 = out if out.dim() == 2 else out.view(-1, x.shape[-1])
    n_rows, n_cols = x2.shape
    strides = (x2.stride(0), out2.stride(0))
    if how.path in ("rows", "row"):
        grid = (cdiv(n_rows, how.rows_per_program),)
        launch(softmax_row_kernel, grid, x2, out2, n_rows, n_cols, *strides,
               BLOCK_ROWS=how.rows_per_program, BLOCK=how.block,
               num_warps=how.num_warps)  # fmt: skip
    elif how.path == "streamed":
        launch(softmax_streamed_kernel, (n_rows,), x2, out2, n_cols, *strides,
               BLOCK=how.block, num_warps=how.num_warps)  # fmt: skip
    else:  # split: two passes through (rows, splits) partials
        grid = (n_rows, how.splits)
        maxima = torch.empty(grid, dtype=torch.float32, device=x.device)
        sums = torch.empty_like(maxima)
        launch(softmax_partials_kernel, grid, x2, maxima, sums, n_cols, strides[0],
               how.cols_per_split, BLOCK=how.block, num_warps=how.num_warps)  # fmt: skip
        launch(softmax_split_kernel, grid, x2, out2, maxima, sums, n_cols, *strides,
               how.cols_per_split, BLOCK=how.block,
               SPLITS_BLOCK=next_power_of_2(how.splits),
               num_warps=how.num_warps)  # fmt: skip
    return out


def _softmax_path(x: torch.Tensor, path: str) -> torch.Tensor:
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    return _launch(x, tuning.plan(x.numel() // n_cols, n_cols, path=path))


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return _softmax_path(x, None)


def _softmax_streamed(x: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None or x.numel() == 0:
        return _softmax_path(x, "streamed")
    return _launch(x, tuning.Plan("streamed", block, tuning.num_warps(block, 16)))


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)  # y alone: the backward needs nothing else


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    y32, dy32 = y.float(), dy.float()
    dx = y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))
    return (dx.to(y.dtype),) + (None,) * (len(ctx.needs_input_grad) - 1)


softmax_op = operator("softmax", _softmax, fake=dense_like)
softmax_streamed_op = operator("softmax_streamed", _softmax_streamed, fake=dense_like)
# the backward on each operator, and the same as autograd Functions: eager calls that autograd
# records skip the operators' dispatch (kernels.operators, road 3)
_softmax_autograd, _softmax_traced = register_autograd(
    softmax_op, _softmax, _softmax_backward, _save_output, differentiable_backward=True
)
_softmax_streamed_autograd, _softmax_streamed_traced = register_autograd(
    softmax_streamed_op,
    _softmax_streamed,
    _softmax_backward,
    _save_output,
    differentiable_backward=True,
)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of `x` (any leading dims), computed in fp32, returned in
    x's dtype. Rows up to FUSED_MAX_COLS are read once; longer rows are read twice, streamed
    row by row or, when there are too few rows to fill the GPU, several programs per row
    (kernels.softmax_tuning). Differentiable. The operator torch.ops.brrr.softmax, which
    torch.compile calls; an eager call that autograd records runs the same implementation
    and backward without its dispatch."""
    check_tensor("x", x, min_ndim=1)
    if torch.compiler.is_compiling():
        return _softmax_traced(x)
    if needs_grad(x):
        return _softmax_autograd(x)
    return _softmax(x)


def softmax_streamed(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The streamed (online-softmax) kernel at any row length, `block` columns per step
    (a power of two; default min(STREAM_BLOCK, next_power_of_2(n_cols))); differentiable.
    The operator torch.ops.brrr.softmax_streamed, called and bypassed as softmax's is."""
    check_tensor("x", x, min_ndim=1)
    if block is not None and (not isinstance(block, int) or block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block!r}")
    if torch.compiler.is_compiling():
        return _softmax_streamed_traced(x, block)
    if needs_grad(x):
        return _softmax_streamed_autograd(x, block)
    return _softmax_streamed(x, block)


def softmax_path(x: torch.Tensor, path: str) -> torch.Tensor:
    """softmax through one of kernels.softmax_tuning.PATHS ("rows", "row", "split",
    "streamed") whatever the shape, to compare them (rows and row hold a whole row in
    registers: mid-length rows at most); forward only."""
    check_tensor("x", x, min_ndim=1)
    if path not in tuning.PATHS:
        raise ValueError(f"path must be one of {tuning.PATHS}, got {path!r}")
    return _softmax_path(x, path)


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax over the last dim in fp32 (fp64 for fp64 input), returned in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.softmax(x.to(compute), dim=-1).to(x.dtype)
