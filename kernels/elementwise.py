"""Elementwise kernels: vector add and fused bias + GELU.

Both are memory-bound: add reads 2N and writes N elements; bias_gelu reads N (plus the
bias, once per row block) and writes N. One program handles BLOCK_SIZE elements.
"""

import torch
import triton
import triton.language as tl

from kernels.operators import operator, through_operator
from kernels.primitives import gelu
from kernels.validate import check_row_vector, check_same, check_tensor

BLOCK_SIZE = 1024


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()  # flat indexing below needs dense memory
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        add_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, y, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


add_op = operator(
    "add", _add, fake=lambda x, y: torch.empty_like(x, memory_format=torch.contiguous_format)
)
add_op.register_autograd(lambda ctx, grad: (grad, grad))  # d(x + y)/dx = d(x + y)/dy = 1


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two tensors of one shape and dtype (the operator torch.ops.brrr.add)."""
    check_tensor("x", x)
    check_tensor("y", y)
    check_same("x and y", x, y)
    return add_op(x, y) if through_operator(x, y) else _add(x, y)


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_elements, n_cols, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    out = gelu(x + b)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x + bias), bias broadcast over the last dim; exact (erf) GELU, computed in fp32."""
    check_tensor("x", x, min_ndim=1)
    check_row_vector("bias", bias, x)
    x, bias = x.contiguous(), bias.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK_SIZE),)
        bias_gelu_kernel[grid](x, bias, out, n, x.shape[-1], BLOCK_SIZE=BLOCK_SIZE)
    return out


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() + bias.float()).to(x.dtype)
