"""Matrix multiplication with a fused epilogue: act(a @ b + bias).

a (M, K) @ b (K, N) does 2*M*N*K FLOPs and must move at least (M*K + K*N + M*N) elements,
so for large sizes it is compute-bound. Each program computes one BLOCK_M x BLOCK_N tile of
the output, accumulating in fp32 over K in steps of BLOCK_K; each element it loads is used
BLOCK_N (for a) or BLOCK_M (for b) times. Bias and activation are applied to the fp32 tile
before its one store, which saves a round trip of the M x N output through memory.

Two kernels compute the same tiles: matmul_kernel loads them through pointers, any layout;
matmul_tma_kernel has Hopper's TMA copy them from tensor descriptors. matmul() picks one.
"""

import torch
import triton
import triton.language as tl

from kernels.primitives import epilogue, grouped_tile
from kernels.runtime import INTERPRET, ON_GPU
from kernels.validate import check_matmul_inputs, input_precision


@triton.jit
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


@triton.jit
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


def tile_config(block_m, block_n, block_k, num_warps, num_stages, group_m=8):
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m}
    return triton.Config(meta, num_warps=num_warps, num_stages=num_stages)


# Hopper (H100/H200) candidates, chosen with scripts/tune_matmul.py on an H200: a 128x256 tile
# with BLOCK_K=64 was within a few percent of cuBLAS at 2048-8192 in bf16 and fp16; 256x128
# and a 128-deep K step did best on x @ W.t() layer shapes; 64x128 spreads a 1024^2 output
# over the 132 SMs (0.92x cuBLAS there, against 0.53x for the best larger tile); BLOCK_K=32
# leaves room in shared memory for fp32's larger elements. Few configs: each one costs a
# compile and a timing per new shape.
CONFIGS = [
    tile_config(128, 256, 64, num_warps=8, num_stages=3),
    tile_config(128, 256, 64, num_warps=8, num_stages=4),
    tile_config(256, 128, 64, num_warps=8, num_stages=4),
    tile_config(128, 128, 128, num_warps=8, num_stages=3),
    tile_config(128, 128, 64, num_warps=8, num_stages=4),
    tile_config(128, 128, 32, num_warps=8, num_stages=3),
    tile_config(64, 128, 64, num_warps=4, num_stages=4),
    tile_config(64, 128, 32, num_warps=4, num_stages=4),
]
# The interpreter runs programs one after another in Python: one small config, no tuning.
INTERPRETER_CONFIG = tile_config(32, 32, 32, num_warps=4, num_stages=1)


def shared_memory_bytes(config, element_size: int) -> int:
    """Shared memory the software pipeline needs: num_stages copies of an A and a B tile."""
    m, n, k = (config.kwargs[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    return config.num_stages * (m * k + k * n) * element_size


def shared_memory_limit(device_index: int = 0) -> int:
    """Bytes of shared memory one program may use on this GPU (227 KiB on Hopper)."""
    from triton.runtime import driver

    return driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def configs_to_try(configs, m: int, n: int, element_size: int, limit: int):
    """The configs worth timing for an m x n output: those whose slabs fit in `limit` bytes of
    shared memory; and when the output is no bigger than the largest tile, only the smallest
    tile (bigger ones only add masked work and leave SMs idle), which needs no timing at all."""
    size = lambda c: shared_memory_bytes(c, element_size)
    fitting = [c for c in configs if size(c) <= limit] or [min(configs, key=size)]
    area = lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]
    if m * n <= max(area(c) for c in fitting):
        return [min(fitting, key=area)]
    return fitting


def _prune(configs, named_args, **kwargs):
    a = named_args["a_ptr"] if "a_ptr" in named_args else named_args["a_desc"].base
    limit = shared_memory_limit(a.device.index)
    return configs_to_try(configs, named_args["M"], named_args["N"], a.element_size(), limit)


matmul_kernel_autotuned = triton.autotune(
    configs=CONFIGS,
    key=["M", "N", "K", "INPUT_PRECISION"],  # the autotuner adds the dtypes itself
    prune_configs_by={"early_config_prune": _prune},
)(matmul_kernel)


def set_tma_blocks(nargs):
    """Before each launch: the descriptors' block shapes are the config's tile and slabs."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_IS_W"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


TMA_CONFIGS = [
    triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=set_tma_blocks)
    for c in CONFIGS
]
matmul_tma_autotuned = triton.autotune(
    configs=TMA_CONFIGS,
    # descriptors carry no dtype the autotuner sees; bias_ptr (c itself without a bias) does
    key=["M", "N", "K", "INPUT_PRECISION", "B_IS_W"],
    prune_configs_by={"early_config_prune": _prune},
)(matmul_tma_kernel)


def matmul(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """act(a @ b + bias) for a (M, K), b (K, N), bias (N,) or None, activation None, "gelu"
    (exact, erf) or "relu". Accumulates in fp32; the output has the inputs' dtype. On Hopper,
    large fp16/bf16 problems go through the TMA kernel (uses_tma), the rest through pointers."""
    return _matmul(a, b, bias, activation, kernel=None)


def matmul_tma(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """matmul through the TMA kernel, whatever the size: a and b row-major with 16-byte
    aligned rows, or b = W.t() for a row-major W (N, K). Hopper and later, or the interpreter."""
    return _matmul(a, b, bias, activation, kernel="tma")


def matmul_pointers(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """matmul through the pointer kernel (matmul_kernel), whatever the size."""
    return _matmul(a, b, bias, activation, kernel="pointers")


def _matmul(a, b, bias, activation, kernel):
    check_matmul_inputs(a, b, bias, activation)
    (M, K), N = a.shape, b.shape[1]
    if kernel == "tma" and (problem := tma_problem(a, b)):
        raise ValueError(f"the TMA kernel cannot load these operands: {problem}")
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=a.dtype, device=a.device)
    if K == 0:  # an empty sum: zeros, then the epilogue
        acc = torch.zeros((M, N), dtype=torch.float32, device=a.device)
        return _epilogue_ref(acc, bias, activation).to(a.dtype)
    if kernel is None and not INTERPRET and M * N * K >= PAD_MIN_WORK:
        if not _aligned(a, b):
            a, b, bias = pad_operands(a, b, bias)
            return matmul(a, b, bias, activation)[:, :N].contiguous()
        # Hopper's tensor cores read TF32 operands from shared memory only K-major; b (K, N)
        # row-major is N-major, and TF32 ran at 0.21x cuBLAS at 4096^3 on an H200, against
        # 0.75x for the same values stored as W.t(). The transposing copy is one pass over b.
        if a.dtype == torch.float32 and input_precision(a.dtype) == "tf32" and b.stride(1) == 1:
            b = b.t().contiguous().t()
    tma = uses_tma(a, b) if kernel is None else kernel == "tma"
    return _launch(a, b, bias, activation, tma)


def _tiles(M, N, meta) -> int:
    return triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])


def _launch(a, b, bias, activation, tma: bool):
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    flags = _flags(a, b, bias, activation, tma)
    bias = c if bias is None else bias.contiguous()  # without a bias, c stands in, never read
    if tma:
        args = (*tma_descriptors(a, b, c, flags["B_IS_W"]), bias, M, N, K)
        kernel, autotuned = matmul_tma_kernel, matmul_tma_autotuned
    else:
        args = (a, b, c, bias, M, N, K, *a.stride(), *b.stride(), *c.stride())
        kernel, autotuned = matmul_kernel, matmul_kernel_autotuned
    if INTERPRET:
        meta = INTERPRETER_CONFIG.kwargs
        kernel[(_tiles(M, N, meta),)](*args, **flags, **meta)
        return c
    key = _plan_key(a, b, flags, tma)
    config = _chosen.get(key)
    if config is None:  # first time: the autotuner times the configs and keeps the fastest
        autotuned[lambda meta: (_tiles(M, N, meta),)](*args, **flags)
        _chosen[key] = autotuned.best_config
        return c
    meta = config.all_kwargs()
    if tma:
        set_tma_blocks({"a_desc": args[0], "b_desc": args[1], "c_desc": args[2], **flags, **meta})
    kernel[(_tiles(M, N, meta),)](*args, **flags, **meta)
    return c


def _flags(a, b, bias, activation, tma: bool) -> dict:
    """The kernels' constexpr flags for these operands (B_IS_W only for the TMA kernel)."""
    flags = {
        "HAS_BIAS": bias is not None,
        "ACTIVATION": activation or "none",
        "INPUT_PRECISION": input_precision(a.dtype),
    }
    if tma:
        flags["B_IS_W"] = b.stride(1) != 1
    return flags


def _plan_key(a, b, flags, tma: bool) -> tuple:
    return (tma, *a.shape, b.shape[1], a.dtype, *flags.values())


# The config the autotuner chose for each problem seen so far, by path, shape, dtype and flags.
# Later calls launch the kernel with it directly: the autotuner's own Python cost about 12 us
# per call on an H200's host (38 us against 26 us for a launch), when a 1024^3 bf16 matmul
# runs for 11 us on the GPU (scripts/tune_matmul.py --paths).
_chosen = {}


def chosen_config(a, b, bias=None, activation=None):
    """The config kernels.matmul launches for these operands (after a first call has tuned
    it; None before, and for operands it copies first, padded), and whether it uses the TMA."""
    if INTERPRET:
        return INTERPRETER_CONFIG, False
    tma = uses_tma(a, b)
    return _chosen.get(_plan_key(a, b, _flags(a, b, bias, activation, tma), tma)), tma


# The TMA copies whole tiles between global and shared memory given a descriptor: the base
# address, the shape, the strides and the tile's shape. It needs 16-byte aligned base and row
# strides and a contiguous last dim. On an H200 it raised x @ W.t() on LLM layer shapes from
# 0.79-0.84x cuBLAS (pointer loads) to 0.88-0.89x, and bf16 4096^3 from 0.97x to 1.04x.
TMA_DTYPES = (torch.float16, torch.bfloat16)
# Below 2**34 (4096 x 4096 x 1024) the pointer kernel was as fast or faster (2048^3: 1.00x
# against 0.63x cuBLAS), and the three descriptors cost host time (scripts/tune_matmul.py --paths).
TMA_MIN_WORK = 1 << 34
TMA_GPU = ON_GPU and not INTERPRET and torch.cuda.get_device_capability()[0] >= 9


def tma_problem(a, b) -> str:
    """Why the TMA kernel cannot take a @ b, or "" when it can."""
    es = a.element_size()
    rows_ok = lambda t, dim: t.stride(1 - dim) == 1 and (t.stride(dim) * es) % 16 == 0
    if not rows_ok(a, 0):
        return f"a needs contiguous rows of 16-byte multiples, got strides {a.stride()}"
    if not (rows_ok(b, 0) or rows_ok(b, 1)):  # b (K, N) row-major, or b = W.t()
        return f"b must be row-major or W.t() with 16-byte aligned rows, got strides {b.stride()}"
    if (b.shape[1] * es) % 16:
        return f"the output's rows of {b.shape[1]} elements are not a multiple of 16 bytes"
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return "a and b must start at 16-byte aligned addresses"
    return ""


def uses_tma(a, b) -> bool:
    """Whether kernels.matmul sends a @ b to the TMA kernel: fp16/bf16 on Hopper or later,
    problems big enough to be compute-bound, operands the TMA can read."""
    M, K, N = *a.shape, b.shape[1]
    return TMA_GPU and a.dtype in TMA_DTYPES and M * N * K >= TMA_MIN_WORK and not tma_problem(a, b)


def tma_descriptors(a, b, c, b_is_w: bool):
    """Host-side descriptors of a, b (or W = b.t()) and c, with the interpreter's tile shape:
    on a GPU each config's pre-hook (set_tma_blocks) resets it before launching."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    meta = INTERPRETER_CONFIG.kwargs
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    b_desc = (
        TensorDescriptor.from_tensor(b.t(), [bn, bk])
        if b_is_w
        else TensorDescriptor.from_tensor(b, [bk, bn])
    )
    return (
        TensorDescriptor.from_tensor(a, [bm, bk]),
        b_desc,
        TensorDescriptor.from_tensor(c, [bm, bn]),
    )


# Triton specializes an integer argument divisible by 16 and vectorizes loads along rows whose
# strides it knows are; with odd K or N (8205 x 5921 x 2949, say) every load is one element
# and the kernel ran at 0.57x cuBLAS on an H200. Copying the operands into zero-padded,
# aligned tensors costs one pass over them (about 2% there) and made it 3.3x cuBLAS.
PAD_MULTIPLE = 64
PAD_MIN_WORK = 1 << 30  # M*N*K below this: the copies would cost more than they save


def _aligned(a, b) -> bool:
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.shape[1])
    return all(s % 16 == 0 or s == 1 for s in strides)


def pad_operands(a, b, bias=None, multiple: int = PAD_MULTIPLE):
    """Contiguous copies of a (M, K), b (K, N) and bias (N,) with K and N rounded up to a
    multiple of `multiple`, zeros in the padding: a_p @ b_p + bias_p holds a @ b + bias in its
    first N columns (padded K terms are 0 * 0)."""
    (m, k), n = a.shape, b.shape[1]
    kp, np_ = (triton.cdiv(d, multiple) * multiple for d in (k, n))
    a_p = a.new_zeros((m, kp))
    a_p[:, :k] = a
    b_p = b.new_zeros((kp, np_))
    b_p[:k, :n] = b
    if bias is not None:
        bias_p = bias.new_zeros(np_)
        bias_p[:n] = bias
        bias = bias_p
    return a_p, b_p, bias


def _epilogue_ref(acc, bias, activation):
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    if activation == "gelu":
        return torch.nn.functional.gelu(acc)
    if activation == "relu":
        return torch.relu(acc)
    return acc


def matmul_ref(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """PyTorch's act(a @ b + bias), computed in fp32 (fp64 for fp64 inputs), output in a's dtype.
    Reads M*K + K*N elements, writes M*N (plus a round trip of M*N for each of bias and act)."""
    compute = torch.promote_types(a.dtype, torch.float32)
    acc = a.to(compute) @ b.to(compute)
    return _epilogue_ref(acc, bias, activation).to(a.dtype)
