"""Softmax over the last dim, fused: one read and one write of the input.

softmax(x)_i = exp(x_i - m) / sum_j exp(x_j - m), m = max_j x_j. Subtracting the row max
changes nothing mathematically and keeps exp() from overflowing (exp(89) is inf in fp32).

Two kernels, chosen by row length:
- one row per program (rows up to FUSED_MAX_COLS): the row sits in registers, so the input
  is read once and the output written once: 2 * numel * element_size bytes.
- streamed (longer rows): the online-softmax recurrence keeps a running max and a running
  sum over blocks of the row (pass 1), then writes exp(x - max) / sum (pass 2): the row is
  read twice (the second read is often served from L2) and written once.
Both compute in fp32 whatever the input dtype.

Backward, from the saved output y: dx = y * (dy - sum_j dy_j y_j), in fp32 (torch ops that a
compiled backward fuses: reads y and dy, writes dx).
"""

import torch
import triton
import triton.language as tl

from kernels.launch import launch
from kernels.operators import operator, through_operator
from kernels.validate import check_tensor

FUSED_MAX_COLS = 32768  # longest row kept whole in registers (fp32: 32 values per thread)
STREAM_BLOCK = 8192  # columns per step of the streamed kernel


def _num_warps(block: int, most: int) -> int:
    # 16 values per thread: 4 warps for rows of 2048, 8 for 4096, 16 for 8192, up to `most`.
    # Measured on an H200 (scripts/tune_fusion.py): 16 warps at 4096 lost a fifth of the
    # bandwidth to 8; a row of 2048 wanted 4.
    return min(most, max(1, block // 512))


@triton.jit
def softmax_row_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * stride may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # masked lanes read -inf: exp(-inf - m) = 0, so they add nothing to the sum
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    numerator = tl.exp(x - tl.max(x, axis=0))
    out = numerator / tl.sum(numerator, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_streamed_kernel(
    x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK)
    # Pass 1, online softmax: a running max m (a scalar) and running sums d (one per lane)
    # of exp(x - m). When the max grows from m to m', the sums so far are rescaled by
    # exp(m - m'): one exp per step, not per element. `safe` stands in for a max of -inf
    # (only -inf seen so far), where exp(-inf - (-inf)) would be NaN.
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    inv_sum = 1.0 / tl.sum(d, axis=0)
    # Pass 2: read the row again and write the normalized values.
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        out = tl.exp(x - m) * inv_sum
        tl.store(out_row + start + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, n_cols) with unit column stride: a view when strides allow, else a copy."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x: torch.Tensor, streamed: bool, block: int | None = None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2, out2 = _rows(x), out.view(-1, x.shape[-1])
    n_rows, n_cols = x2.shape
    args = (x2, out2, n_cols, x2.stride(0), out2.stride(0))
    if streamed:
        block = block or min(STREAM_BLOCK, triton.next_power_of_2(n_cols))
        launch(
            softmax_streamed_kernel, (n_rows,), *args, BLOCK=block, num_warps=_num_warps(block, 16)
        )
    else:
        block = triton.next_power_of_2(n_cols)
        launch(softmax_row_kernel, (n_rows,), *args, BLOCK=block, num_warps=_num_warps(block, 32))
    return out


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, streamed=x.shape[-1] > FUSED_MAX_COLS)


def _softmax_streamed(x: torch.Tensor, block: int | None) -> torch.Tensor:
    return _launch(x, streamed=True, block=block)


def _save_output(ctx, inputs, output):
    ctx.save_for_backward(output)  # y alone: the backward needs nothing else


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    y32, dy32 = y.float(), dy.float()
    dx = y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))
    return (dx.to(y.dtype),) + (None,) * (len(ctx.needs_input_grad) - 1)


def _like_x(x, *_):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


softmax_op = operator("softmax", _softmax, fake=_like_x)
softmax_op.register_autograd(_softmax_backward, setup_context=_save_output)
softmax_streamed_op = operator("softmax_streamed", _softmax_streamed, fake=_like_x)
softmax_streamed_op.register_autograd(_softmax_backward, setup_context=_save_output)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of `x` (any leading dims), computed in fp32, returned in
    x's dtype. Rows up to FUSED_MAX_COLS are read once; longer rows are streamed. The
    operator torch.ops.brrr.softmax; differentiable."""
    check_tensor("x", x, min_ndim=1)
    return softmax_op(x) if through_operator(x) else _softmax(x)


def softmax_streamed(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The streamed (online-softmax) kernel at any row length, `block` columns per step
    (a power of two; default min(STREAM_BLOCK, next_power_of_2(n_cols))); differentiable."""
    check_tensor("x", x, min_ndim=1)
    if block is not None and (not isinstance(block, int) or block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block!r}")
    if through_operator(x):
        return softmax_streamed_op(x, block)
    return _softmax_streamed(x, block)


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """torch.softmax over the last dim in fp32 (fp64 for fp64 input), returned in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.softmax(x.to(compute), dim=-1).to(x.dtype)
