"""Matrix multiplication with a fused epilogue: act(a @ b + bias), differentiable.

a (M, K) @ b (K, N) does 2*M*N*K FLOPs and must move at least (M*K + K*N + M*N) elements,
so for large sizes it is compute-bound. Each program computes one BLOCK_M x BLOCK_N tile of
the output, accumulating in fp32 over K in steps of BLOCK_K; each element it loads is used
BLOCK_N (for a) or BLOCK_M (for b) times. Bias and activation are applied to the fp32 tile
before its one store, which saves a round trip of the M x N output through memory.

Two kernels compute the same tiles: matmul_kernel loads them through pointers, any layout;
matmul_tma_kernel has Hopper's TMA copy them from tensor descriptors. Which one, and which
copies come first, is kernels.matmul_tuning.plan()'s decision, made once per call.
The backward is more matmuls through the same kernels (see matmul_grads), as operators.
"""

import torch
import triton
import triton.language as tl

from kernels import matmul_tuning as tuning
from kernels import split_k
from kernels.elementwise import activation_grad
from kernels.launch import Launcher, aligned, launch
from kernels.matmul_reference import matmul_ref
from kernels.operators import operator, register_autograd
from kernels.primitives import epilogue, grouped_tile, matmul_launch_metadata
from kernels.runtime import INTERPRET
from kernels.validate import check_matmul_inputs, needs_grad


@triton.jit(launch_metadata=matmul_launch_metadata)
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap onto valid ones, so loads need a mask only along K;
    # the store drops them. 64-bit: row * stride can pass 2**31 for large operands.
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + ks[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols_in[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = epilogue(acc, bias_ptr, cols, N, HAS_BIAS, ACTIVATION)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(launch_metadata=matmul_launch_metadata)
def matmul_tma_kernel(
    a_desc, b_desc, c_desc, bias_ptr, M, N, K,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    B_IS_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # The same tiles in the same order, but each slab arrives by one TMA copy (Hopper's tensor
    # memory accelerator): no address arithmetic in the threads, and the hardware zero-fills
    # what lies past the edges, so there are no masks. B_IS_W: b_desc describes W (N, K), the
    # layout of an nn.Linear weight, and the product is a @ W.t(); its slabs are K-contiguous.
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        if B_IS_W:
            b = b_desc.load([pid_n * BLOCK_N, k0]).T
        else:
            b = b_desc.load([k0, pid_n * BLOCK_N])
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = epilogue(acc, bias_ptr, cols, N, HAS_BIAS, ACTIVATION)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))  # clipped at the edges


matmul_kernel_autotuned = triton.autotune(
    configs=tuning.CONFIGS,
    key=["M", "N", "K", "INPUT_PRECISION"],  # the autotuner adds the dtypes itself
    prune_configs_by={"early_config_prune": tuning.prune_configs},
)(matmul_kernel)
matmul_tma_autotuned = triton.autotune(
    configs=tuning.TMA_CONFIGS,
    # descriptors carry no dtype the autotuner sees; bias_ptr (c itself without a bias) does
    key=["M", "N", "K", "INPUT_PRECISION", "B_IS_W"],
    prune_configs_by={"early_config_prune": tuning.prune_configs},
)(matmul_tma_kernel)


def _matmul(a, b, bias, activation, kernel):
    """act(a @ b + bias) for validated operands. A repeat call (same shapes, strides,
    alignment, dtype, flags) finds everything decided in _calls and only allocates and
    launches; the first plans, and on a GPU autotunes."""
    if bias is not None:
        bias = bias.contiguous()  # read as dense: a strided one is copied
    key = call_key(a, b, bias, activation, kernel)
    call = _calls.get(key)
    if call is None:
        return _first_call(key, a, b, bias, activation, kernel)
    (M, K), stride_a, (_, N), stride_b = key[:4]
    c = a.new_empty((M, N))  # a's dtype and device, for less host time than torch.empty's
    meta, grid = call
    args = (a, b, c, c if bias is None else bias, M, N, K, *stride_a, *stride_b, N, 1)
    if not _launch_matmul.launch_kept(key, grid, *args):  # the config's 10 keywords unbuilt
        _launch_matmul(key, grid, *args, **meta)
    return c


def call_key(a, b, bias, activation, kernel) -> tuple:
    """_calls' key, and the pointer kernel's launch key (kernels.launch): everything plan()
    and the kernel's specialization read (c is a fresh allocation, so aligned). It starts with
    a's shape and strides, then b's, which the launch reads back from it."""
    precision = a.dtype == torch.float32 and torch.get_float32_matmul_precision()
    return (a.shape, a.stride(), b.shape, b.stride(), a.dtype, aligned(a), aligned(b), precision,
            kernel, bias is not None and aligned(bias), bias is None, activation)  # fmt: skip


# What each call seen so far needs (its plan's kernel flags and the chosen config, with the
# grid), by the key above: everything plan() and the kernel's specialization read. A repeat
# call does no planning, no autotuner lookup and no key over every argument. Only plans that
# launch the pointer kernel on the operands as they are (no copies, no descriptors) are kept.
_calls = {}
_launch_matmul = Launcher(matmul_kernel)


def _first_call(key, a, b, bias, activation, kernel):
    (M, K), N = a.shape, b.shape[1]
    how = tuning.plan(a, b, kernel)
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=a.dtype, device=a.device)
    if K == 0:  # an empty sum: zeros, then the epilogue
        return matmul_ref(a, b, bias, activation)
    if how.split_k:  # few output tiles, a long K
        return split_k.product(a, b, kind="matmul", bias=bias, activation=activation)
    if how.pad:
        a, b, bias = tuning.pad_operands(a, b, bias)
    if how.k_major_b:
        b = b.t().contiguous().t()
    c = _launch(a, b, bias, activation, how)
    if not (how.pad or how.k_major_b or how.tma):
        meta = _config(a, b, bias, activation, how)
        if meta is not None:
            if len(_calls) >= 4096:  # a bound on shapes seen, not a tuning
                _calls.clear()
            meta = {**_flags(how, bias, activation), **meta}
            _calls[key] = (meta, (tuning.tile_count(M, N, meta),))
    return c[:, :N].contiguous() if how.pad else c


def _config(a, b, bias, activation, how) -> dict | None:
    """The pointer kernel's tile config for these operands: the interpreter's one, or the one
    the autotuner chose (None before it has)."""
    if INTERPRET:
        return tuning.INTERPRETER_CONFIG.kwargs
    chosen = _chosen.get(_plan_key(a, b, _flags(how, bias, activation), how.tma))
    return None if chosen is None else chosen[1]


def _launch(a, b, bias, activation, how):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    flags = _flags(how, bias, activation)
    bias = c if bias is None else bias  # without a bias, c stands in, never read
    if how.tma:
        args = (*tuning.tma_descriptors(a, b, c, how.b_is_w), bias, M, N, K)
        kernel, autotuned = matmul_tma_kernel, matmul_tma_autotuned
    else:
        args = (a, b, c, bias, M, N, K, *a.stride(), *b.stride(), *c.stride())
        kernel, autotuned = matmul_kernel, matmul_kernel_autotuned
    if INTERPRET:
        meta = tuning.INTERPRETER_CONFIG.kwargs
        launch(kernel, (tuning.tile_count(M, N, meta),), *args, **flags, **meta)
        return c
    key = _plan_key(a, b, flags, how.tma)
    chosen = _chosen.get(key)
    if chosen is None:  # first time: the autotuner times the configs and keeps the fastest
        autotuned[lambda meta: (tuning.tile_count(M, N, meta),)](*args, **flags)
        _chosen[key] = (autotuned.best_config, autotuned.best_config.all_kwargs())
        return c
    meta = chosen[1]
    if how.tma:
        descriptors = {"a_desc": args[0], "b_desc": args[1], "c_desc": args[2]}
        tuning.set_tma_blocks({**descriptors, **flags, **meta})
    launch(kernel, (tuning.tile_count(M, N, meta),), *args, **flags, **meta)
    return c


def _flags(how, bias, activation) -> dict:
    """The kernels' constexpr flags for this plan (B_IS_W only for the TMA kernel)."""
    flags = {
        "HAS_BIAS": bias is not None,
        "ACTIVATION": activation or "none",
        "INPUT_PRECISION": how.input_precision,
    }
    if how.tma:
        flags["B_IS_W"] = how.b_is_w
    return flags


def _plan_key(a, b, flags, tma: bool) -> tuple:
    return (tma, *a.shape, b.shape[1], a.dtype, *flags.values())


# The config the autotuner chose for each problem seen so far, by path, shape, dtype and flags
# (with its launch keywords, built once).
# Later calls launch the kernel with it directly: the autotuner's own Python cost about 12 us
# per call on an H200's host (38 us against 26 us for a launch), when a 1024^3 bf16 matmul
# runs for 11 us on the GPU (scripts/tune_matmul.py --paths).
_chosen = {}


def chosen_config(a, b, bias=None, activation=None):
    """The config kernels.matmul launches for these operands (after a first call has tuned
    it; None before, and for operands it copies first, padded), and whether it uses the TMA."""
    if INTERPRET:
        return tuning.INTERPRETER_CONFIG, False
    how = tuning.plan(a, b)
    if how.pad:
        return None, how.tma
    chosen = _chosen.get(_plan_key(a, b, _flags(how, bias, activation), how.tma))
    return (chosen and chosen[0]), how.tma


def _matmul_op_impl(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    kernel: str | None,
) -> torch.Tensor:
    return _matmul(a, b, bias, activation, kernel)


def matmul_fake(a, b, bias=None, activation=None, kernel=None):
    return a.new_empty((a.shape[0], b.shape[1]))


def save_operands(ctx, inputs, output):
    """What matmul_grads needs: the operands (z is recomputed) and the flags."""
    a, b, bias, activation, *kernel = inputs
    ctx.save_for_backward(a, b, bias)
    ctx.activation, ctx.kernel = activation, kernel


def matmul_grads(op, ctx, dout):
    """The backward of out = act(a @ b + bias), through `op` (a matmul operator with the
    schema (a, b, bias, activation, *kernel)). With dz = dout * act'(z), z = a @ b + bias:
    da = dz @ b.T, db = a.T @ dz, dbias = dz summed over rows; each a matmul (2*M*N*K FLOPs),
    computed only when asked for. z is recomputed (one more matmul) rather than stored, and
    only when there is an activation."""
    a, b, bias = ctx.saved_tensors
    needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
    dz = dout
    if ctx.activation is not None:
        z = op(a, b, bias, None, *ctx.kernel)  # (M, N), in a's dtype
        dz = (dout.float() * activation_grad(z, ctx.activation)).to(a.dtype)
    plan = (None,) * len(ctx.kernel)  # the gradients' matmuls: the plan's choice of kernel
    da = op(dz, b.t(), None, None, *plan) if needs_a else None  # (M, N) @ (N, K)
    db = op(a.t(), dz, None, None, *plan) if needs_b else None  # (K, M) @ (M, N)
    dbias = dz.sum(0, dtype=torch.float32).to(a.dtype) if needs_bias else None
    return da, db, dbias, None, *(None for _ in ctx.kernel)


def _matmul_backward(ctx, dout):
    return matmul_grads(matmul_op, ctx, dout)  # the backward's matmuls: differentiable too


matmul_op = operator("matmul", _matmul_op_impl, matmul_fake)
# the backward on the operator, and the same as autograd Functions (kernels.operators)
_matmul_autograd, _matmul_traced = register_autograd(
    matmul_op, _matmul_op_impl, _matmul_backward, save_operands, differentiable_backward=True
)


def _checked(a, b, bias, activation, kernel):
    check_matmul_inputs(a, b, bias, activation)
    if torch.compiler.is_compiling():
        return _matmul_traced(a, b, bias, activation, kernel)
    if needs_grad(a, b, bias):
        return _matmul_autograd(a, b, bias, activation, kernel)
    return _matmul(a, b, bias, activation, kernel)


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """act(a @ b + bias) for a (M, K), b (K, N), bias (N,) or None, activation None, "gelu"
    (exact, erf; its tanh form for fp16/bf16 outputs) or "relu". Accumulates in fp32; the
    output has the inputs' dtype. On Hopper, large fp16/bf16 problems go through the TMA
    kernel, outputs too small to fill the GPU with a long K through kernels.split_k, the rest
    through pointers (plan()).
    Differentiable in a, b and bias (the backward's matmuls run on these kernels too)."""
    return _checked(a, b, bias, activation, kernel=None)


def matmul_tma(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """matmul through the TMA kernel, whatever the size: a and b row-major with 16-byte
    aligned rows, or b = W.t() for a row-major W (N, K). Hopper and later, or the interpreter."""
    return _checked(a, b, bias, activation, kernel="tma")


def matmul_pointers(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """matmul through the pointer kernel (matmul_kernel), whatever the size."""
    return _checked(a, b, bias, activation, kernel="pointers")
