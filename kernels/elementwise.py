"""Elementwise kernels: vector add and fused bias + GELU.

Both are memory-bound: add reads 2N and writes N elements; bias_gelu reads N (plus the
bias, once per row block) and writes N. One program handles BLOCK_SIZE elements.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.launch import Launcher, aligned, cdiv, int_class
from kernels.operators import dense_like, operator, register_autograd
from kernels.primitives import gelu_for
from kernels.validate import check_row_vector, check_same, check_tensor, needs_grad

BLOCK_SIZE = 1024


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: tensors may pass 2**31 elements
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


_launch_add = Launcher(add_kernel)


def add_key(x: torch.Tensor, y: torch.Tensor, n: int) -> tuple:
    """add_kernel's launch key (kernels.launch): out is a fresh allocation, so aligned."""
    return x.dtype, aligned(x), aligned(y), int_class(n)


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x, y = x.contiguous(), y.contiguous()  # flat indexing below needs dense memory
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        key = add_key(x, y, n)
        grid = (cdiv(n, BLOCK_SIZE),)
        if not _launch_add.launch_kept(key, grid, x, y, out, n):  # BLOCK_SIZE: the first's
            _launch_add(key, grid, x, y, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


def _add_backward(ctx, grad):
    return grad, grad  # d(x + y)/dx = d(x + y)/dy = 1


add_op = operator("add", _add, fake=dense_like)
# the backward on the operator, and the same as an autograd Function: eager calls that
# autograd records skip the operator's dispatch (kernels.operators, road 3)
_add_autograd, _add_traced = register_autograd(
    add_op, _add, _add_backward, differentiable_backward=True
)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two tensors of one shape and dtype. The operator torch.ops.brrr.add, which
    torch.compile calls; an eager call that autograd records runs the same implementation
    and backward without its dispatch."""
    check_tensor("x", x)
    check_tensor("y", y)
    check_same("x and y", x, y)
    if torch.compiler.is_compiling():
        return _add_traced(x, y)
    if needs_grad(x, y):
        return _add_autograd(x, y)
    return _add(x, y)


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, n_elements, n_cols, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    b = tl.load(bias_ptr + offsets % n_cols, mask=mask).to(tl.float32)
    out = gelu_for(x + b, out_ptr.dtype.element_ty)  # fp16/bf16: the tanh form
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


_launch_bias_gelu = Launcher(bias_gelu_kernel)


def _bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x, bias = x.contiguous(), bias.contiguous()  # a strided bias is read as dense: copy it
    out = torch.empty_like(x)
    n, n_cols = x.numel(), x.shape[-1]
    if n:
        key = (x.dtype, aligned(x), aligned(bias), int_class(n), int_class(n_cols))
        grid = (cdiv(n, BLOCK_SIZE),)
        if not _launch_bias_gelu.launch_kept(key, grid, x, bias, out, n, n_cols):
            _launch_bias_gelu(key, grid, x, bias, out, n, n_cols, BLOCK_SIZE=BLOCK_SIZE)
    return out


def activation_grad(z: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(z) / dz in fp32: exact GELU's Phi(z) + z * phi(z), ReLU's step (0 at z = 0).
    Plain torch ops: inside a backward, torch.compile fuses them with their neighbours."""
    z = z.float()
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * math.sqrt(0.5)))
        pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return cdf + z * pdf
    return (z > 0).float()


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x and bias: z = x + bias is recomputed, never stored


def _bias_gelu_backward(ctx, dy):
    # dz = dy * GELU'(x + b): dx = dz, dbias = dz summed over every leading dim. Reads dy and
    # x, writes dx: a memory-bound chain that the compiled backward fuses.
    x, bias = ctx.saved_tensors
    dz = dy.float() * activation_grad(x.float() + bias.float(), "gelu")
    rows = math.prod(x.shape[:-1])
    dbias = dz.reshape(rows, x.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
    return dz.to(x.dtype), None if dbias is None else dbias.to(bias.dtype)


bias_gelu_op = operator(
    "bias_gelu",
    _bias_gelu,
    fake=dense_like,
)
_bias_gelu_autograd, _bias_gelu_traced = register_autograd(  # both roads, as add's
    bias_gelu_op, _bias_gelu, _bias_gelu_backward, _bias_gelu_setup, differentiable_backward=True
)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(x + bias), bias broadcast over the last dim, computed in fp32: the exact (erf) GELU
    for fp32, its tanh form for fp16/bf16 (primitives.gelu_fast: within their rounding).
    Differentiable in x and bias. The operator torch.ops.brrr.bias_gelu, which torch.compile
    calls; an eager call that autograd records runs the same implementation and backward
    without its dispatch."""
    check_tensor("x", x, min_ndim=1)
    check_row_vector("bias", bias, x)
    if torch.compiler.is_compiling():
        return _bias_gelu_traced(x, bias)
    if needs_grad(x, bias):
        return _bias_gelu_autograd(x, bias)
    return _bias_gelu(x, bias)


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() + bias.float()).to(x.dtype)
