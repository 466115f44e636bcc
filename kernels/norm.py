"""RMSNorm and LayerNorm over the last dim, forward and backward, fused, fp32 accumulation.

RMSNorm:   y = x * rstd * w,             rstd = 1 / sqrt(mean(x^2) + eps)
LayerNorm: y = (x - mean) * rstd * w + b, rstd = 1 / sqrt(var(x) + eps)   (biased var)

Forward: one row per program; the row stays in registers, so x is read once and y written
once (plus w, b and one or two fp32 numbers per row, kept for the backward). add_rms_norm
fuses a transformer's residual add into the same kernel: h = x + residual, y = rms_norm(h).
Backward (kernels.norm_backward): x_hat is recomputed from x and the saved rstd (and mean),
never stored. Launch choices and profiler metadata: kernels.norm_tuning.
Rows longer than MAX_COLS (65536) do not fit in registers: rms_norm and layer_norm send them,
forward and backward, to kernels.norm_long, which walks each row in chunks, in two passes.
"""

import math

import torch
import triton
import triton.language as tl

from kernels import norm_long, runtime
from kernels.launch import Launcher, aligned, int_class, next_power_of_2
from kernels.norm_backward import layer_norm_backward, rms_norm_backward
from kernels.norm_backward import norm_bwd_kernel as norm_bwd_kernel  # where tests look for it
from kernels.norm_tuning import as_rows, launch_metadata, num_warps
from kernels.operators import dense_like, one_output, operator, register_autograd
from kernels.primitives import dependent_keywords, wait_for_previous
from kernels.validate import check_row_vector, check_same, check_tensor, needs_grad

# Rows up to MAX_COLS are kept whole in registers (the kernels below); longer rows take
# kernels.norm_long's chunked kernels (rms_norm, layer_norm; add_rms_norm refuses them).
MAX_COLS = norm_long.LONG_ROW_COLS


@triton.jit(launch_metadata=launch_metadata)
def rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, x_stride, y_stride, eps,
    residual_ptr, h_ptr, r_stride, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr = False,
    SAVE_STATS: tl.constexpr = True, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(PDL)  # dependent launch (kernels.primitives): x is the kernel before's
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # h = x + residual, rounded to x's dtype as torch rounds it, then stored
        r = tl.load(residual_ptr + row * r_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * y_stride + cols, x, mask=mask)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    if SAVE_STATS:  # for the backward; without a gradient to compute, nothing is allocated
        tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * y_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(launch_metadata=launch_metadata)
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
    SAVE_STATS: tl.constexpr = True,
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
    if SAVE_STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    tl.store(
        y_ptr + row * y_stride + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask
    )


def _check(x, eps, **params):
    check_tensor("x", x, min_ndim=1)
    for name, p in params.items():
        check_row_vector(name, p, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float, torch.SymFloat)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) eps may be symbolic
    if not 0 <= eps < math.inf:  # False for NaN too
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def _forward(x, weight, bias, eps, residual=None, save_stats=True):
    """(y, x2, mean, rstd, h): x2 = x as rows, mean None for RMSNorm; with `residual`
    (RMSNorm only), h = x + residual is what is normalized, else h is None. Without
    `save_stats` (nothing to differentiate) mean and rstd are None: neither is allocated."""
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    long_rows = residual is None and n_cols > norm_long.LONG_ROW_COLS
    # the kernels read weight and bias as dense vectors: a strided one (w[::2]) is copied
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = dense_like(x)  # empty_like costs the host less than torch.empty(shape, dtype, device)
    h = None if residual is None else torch.empty_like(y)
    mean = rstd = None
    if save_stats or long_rows:  # the long-row kernels always write them
        rstd = x.new_empty(n_rows, dtype=torch.float32)
        mean = None if bias is None else torch.empty_like(rstd)  # RMSNorm has no mean
    if x.numel() == 0:
        return y, x2, mean, rstd, h
    y2 = y if y.dim() == 2 else y.view(n_rows, n_cols)
    if long_rows:
        norm_long.forward(x2, weight, bias, eps, y2, mean, rstd)
        return y, x2, mean, rstd, h
    block = next_power_of_2(n_cols)
    # the key fixes the keywords (BLOCK, SAVE_STATS, HAS_RESIDUAL and num_warps follow from
    # it): after a key's first launch, launch_kept needs none of them built
    key = forward_key(x2, weight, block, save_stats)
    pdl = runtime.PDL
    if bias is None:
        r2 = x2 if residual is None else as_rows(residual)  # x2 stands in, never read
        h2 = y2 if h is None else h.view(n_rows, n_cols)
        stats = y2 if rstd is None else rstd  # stands in, never written
        key += (pdl,)
        if residual is not None:
            key += (aligned(r2), int_class(r2.stride(0)))
        args = (x2, weight, y2, stats, n_cols, x2.stride(0), n_cols, eps, r2, h2, r2.stride(0))
        if not _launch_rms_norm.launch_kept(key, (n_rows,), *args):
            _launch_rms_norm(
                key, (n_rows,), *args, HAS_RESIDUAL=residual is not None, BLOCK=block,
                SAVE_STATS=save_stats, num_warps=num_warps(block, 32), **dependent_keywords(pdl),
            )  # fmt: skip
    else:
        key += (aligned(bias),)
        mean2, rstd2 = (y2, y2) if rstd is None else (mean, rstd)  # stand-ins, never written
        args = (x2, weight, bias, y2, mean2, rstd2, n_cols, x2.stride(0), n_cols, eps)
        if not _launch_layer_norm.launch_kept(key, (n_rows,), *args):
            _launch_layer_norm(key, (n_rows,), *args, BLOCK=block, SAVE_STATS=save_stats,
                               num_warps=num_warps(block, 32))  # fmt: skip
    return y, x2, mean, rstd, h


def forward_key(x2, weight, block, save_stats) -> tuple:
    """The forward kernels' launch key (kernels.launch) for rows x2: what Triton specializes
    on. y, h and the statistics are fresh allocations (aligned), eps a float; BLOCK and
    num_warps follow from the row length."""
    n_cols = x2.shape[1]
    return (x2.dtype, block, int_class(n_cols), int_class(x2.stride(0)), aligned(x2),
            aligned(weight), save_stats)  # fmt: skip


_launch_rms_norm = Launcher(rms_norm_fwd_kernel)
_launch_layer_norm = Launcher(layer_norm_fwd_kernel)


# The operators (see kernels.operators): <name>_forward returns the output and the fp32
# statistics, one number a row, that <name>_backward reads; x is saved, x_hat recomputed.


def _rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, _, rstd, _ = _forward(x, weight, None, eps)
    return y, rstd


def _layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, _, mean, rstd, _ = _forward(x, weight, bias, eps)
    return y, mean, rstd


def _add_rms_norm_forward(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, _, _, rstd, h = _forward(x, weight, None, eps, residual)
    return y, h, rstd


def _row_stats(x):  # one fp32 per row of x
    return x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


rms_norm_forward = operator(
    "rms_norm_forward", _rms_norm_forward, lambda x, w, eps: (dense_like(x), _row_stats(x))
)
layer_norm_forward = operator(
    "layer_norm_forward",
    _layer_norm_forward,
    lambda x, w, b, eps: (dense_like(x), _row_stats(x), _row_stats(x)),
)
add_rms_norm_forward = operator(
    "add_rms_norm_forward",
    _add_rms_norm_forward,
    lambda x, r, w, eps: (dense_like(x), dense_like(x), _row_stats(x)),
)


def _save_stats(ctx, inputs, output):
    """Save x, the weight and the statistics (the forward's outputs after y): all the
    backward reads. The statistics get no gradient."""
    stats = output[1:]
    ctx.mark_non_differentiable(*stats)
    ctx.save_for_backward(*inputs[:2], *stats)


def _rms_norm_grads(ctx, dy, _drstd):
    return *rms_norm_backward(dy, *ctx.saved_tensors), None


def _layer_norm_grads(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    return *layer_norm_backward(dy, x, weight, mean, rstd), None


def _add_rms_norm_setup(ctx, inputs, output):
    _, h, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(h, inputs[2], rstd)  # h, not x and residual: what was normalized


def _add_rms_norm_grads(ctx, dy, dh, _drstd):
    # y = rms_norm(h), h = x + residual: dx = dresidual = dh + (the norm's dx at h)
    dnorm, dw = rms_norm_backward(dy, *ctx.saved_tensors)
    dx = dnorm + dh
    return dx, dx, dw, None


# The backward on each <name>_forward operator, and the same implementation, setup and backward
# as autograd Functions: eager calls that autograd records skip the operators' dispatch
# (kernels.operators, road 3)
_rms_norm_autograd, _rms_norm_traced = register_autograd(
    rms_norm_forward, _rms_norm_forward, _rms_norm_grads, _save_stats
)
_layer_norm_autograd, _layer_norm_traced = register_autograd(
    layer_norm_forward, _layer_norm_forward, _layer_norm_grads, _save_stats
)
_add_rms_norm_autograd, _add_rms_norm_traced = register_autograd(
    add_rms_norm_forward, _add_rms_norm_forward, _add_rms_norm_grads, _add_rms_norm_setup
)
one_output("rms_norm", rms_norm_forward)
one_output("layer_norm", layer_norm_forward)
one_output("add_rms_norm", add_rms_norm_forward, n_outputs=2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading dims), scaled by `weight`; fp32 inside,
    output in x's dtype. Differentiable in x and weight (backward in Triton). Rows of any
    length: past MAX_COLS columns the chunked kernels of kernels.norm_long, which read x
    twice. The operator torch.ops.brrr.rms_norm, which torch.compile calls; an eager call
    that autograd records runs the same implementation without its dispatch."""
    _check(x, eps, weight=weight)
    if torch.compiler.is_compiling():
        return _rms_norm_traced(x, weight, float(eps))[0]
    if needs_grad(x, weight):
        return _rms_norm_autograd(x, weight, float(eps))[0]
    return _forward(x, weight, None, float(eps), save_stats=False)[0]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of `x` (any leading dims), then `* weight + bias`; fp32
    inside, output in x's dtype. Differentiable in x, weight and bias (backward in Triton).
    Rows of any length: past MAX_COLS columns the chunked kernels of kernels.norm_long
    (Welford's variance), which read x twice. The operator torch.ops.brrr.layer_norm, which
    torch.compile calls; an eager call that autograd records runs the same implementation
    without its dispatch."""
    _check(x, eps, weight=weight, bias=bias)
    if torch.compiler.is_compiling():
        return _layer_norm_traced(x, weight, bias, float(eps))[0]
    if needs_grad(x, weight, bias):
        return _layer_norm_autograd(x, weight, bias, float(eps))[0]
    return _forward(x, weight, bias, float(eps), save_stats=False)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h): h = x + residual (in x's dtype, rounded as torch rounds it) and y =
    rms_norm(h, weight, eps), from one kernel: it reads x and residual once and writes h and
    y: 4 passes over the rows, where add then rms_norm take 3 + 2. The residual stream
    of a transformer: h goes on to the next block, y into this one's attention or MLP.
    Differentiable in x, residual and weight. Rows up to MAX_COLS columns (a ValueError
    past it). The operator torch.ops.brrr.add_rms_norm, which torch.compile calls; an eager
    call that autograd records runs the same implementation without its dispatch."""
    _check(x, eps, weight=weight)
    check_tensor("residual", residual)
    check_same("x and residual", x, residual)
    if x.shape[-1] > MAX_COLS:  # its kernel holds h, x and the residual's row in registers
        raise ValueError(
            f"add_rms_norm supports rows up to {MAX_COLS} columns, got {tuple(x.shape)}: "
            "call rms_norm(x + residual, weight, eps), which has a long-row path"
        )
    if torch.compiler.is_compiling():
        y, h, _ = _add_rms_norm_traced(x, residual, weight, float(eps))
        return y, h
    if needs_grad(x, residual, weight):
        y, h, _ = _add_rms_norm_autograd(x, residual, weight, float(eps))
        return y, h
    y, _, _, _, h = _forward(x, weight, None, float(eps), residual, save_stats=False)
    return y, h


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


def add_rms_norm_ref(x, residual, weight, eps: float = 1e-6):
    """torch's x + residual (rounded to x's dtype), then rms_norm_ref: (y, h)."""
    h = x + residual
    return rms_norm_ref(h, weight, eps), h
