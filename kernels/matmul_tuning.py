"""The measured choices behind kernels.matmul, each with the H200 run that chose it, and the
one decision that applies them: plan(a, b, kernel) says, once per call, which copies to make
first (padded operands, a K-major b) and which kernel to launch (TMA, pointers, or
kernels.split_k when the output is too small to fill the GPU and K is long).

scripts/tune_matmul.py produced the numbers quoted here; it imports this module to try new
candidates against the same rules.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from kernels.launch import cdiv
from kernels.runtime import INTERPRET, ON_GPU, processors
from kernels.validate import input_precision


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


def tile_count(m: int, n: int, meta) -> int:
    """Programs a config launches for an m x n output: one per BLOCK_M x BLOCK_N tile."""
    return cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"])


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


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early_config_prune: configs_to_try for the launch's operands."""
    a = named_args["a_ptr"] if "a_ptr" in named_args else named_args["a_desc"].base
    limit = shared_memory_limit(a.device.index)
    return configs_to_try(configs, named_args["M"], named_args["N"], a.element_size(), limit)


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


def _tma_pays(dtype, work: int) -> bool:
    return TMA_GPU and dtype in TMA_DTYPES and work >= TMA_MIN_WORK


def uses_tma(a, b) -> bool:
    """Whether the TMA kernel takes a @ b as given: fp16/bf16 on Hopper or later, problems
    big enough to be compute-bound, operands the TMA can read."""
    if not TMA_GPU:  # before the shapes: this runs on every call
        return False
    M, K, N = *a.shape, b.shape[1]
    return _tma_pays(a.dtype, M * N * K) and not tma_problem(a, b)


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


def aligned(a, b) -> bool:
    """Whether every stride of a and b, and b's N, allows 16-element vector loads."""
    strides = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.shape[1])
    return all(s % 16 == 0 or s == 1 for s in strides)


def padded(size: int, multiple: int = PAD_MULTIPLE) -> int:
    return cdiv(size, multiple) * multiple


def pad_operands(a, b, bias=None, multiple: int = PAD_MULTIPLE):
    """Contiguous copies of a (M, K), b (K, N) and bias (N,) with K and N rounded up to a
    multiple of `multiple`, zeros in the padding: a_p @ b_p + bias_p holds a @ b + bias in its
    first N columns (padded K terms are 0 * 0)."""
    (m, k), n = a.shape, b.shape[1]
    kp, np_ = padded(k, multiple), padded(n, multiple)
    a_p = a.new_zeros((m, kp))
    a_p[:, :k] = a
    b_p = b.new_zeros((kp, np_))
    b_p[:k, :n] = b
    if bias is not None:
        bias_p = bias.new_zeros(np_)
        bias_p[:n] = bias
        bias = bias_p
    return a_p, b_p, bias


# Split-K: an output of few tiles leaves most SMs idle however long K is (256 x 256 x 524288 is
# 4 tiles of 128 x 128 for 132 SMs: 0.068x cuBLAS on an H200 without a split). kernels.split_k
# cuts K into pieces computed in parallel and adds them in a fixed order. NOT YET MEASURED ON A
# GPU: the two thresholds are guesses, to be set from `python -m kernels bench shapes`. Never
# for the batch-invariant matmul: a split chosen from the output's size depends on M (Chapter 5).
SPLIT_K_TILE = 128  # the tile the rule counts in, whatever the kernels' configs
SPLIT_K_MAX_TILES = 0.5  # split when the output has at most this many tiles per SM
SPLIT_K_MIN_K = 16384  # and K is at least this long


def wants_split_k(M: int, N: int, K: int, sms: int) -> bool:
    """Whether a @ b goes to kernels.split_k: too few output tiles to fill `sms` SMs, long K."""
    tiles = cdiv(M, SPLIT_K_TILE) * cdiv(N, SPLIT_K_TILE)
    return K >= SPLIT_K_MIN_K and tiles <= SPLIT_K_MAX_TILES * sms


KERNELS = (None, "tma", "pointers")  # None: plan() chooses


@dataclass(frozen=True)
class Plan:
    """How kernels.matmul computes a @ b: the copies it makes first, then the kernel."""

    pad: bool  # copy a, b, bias to zero-padded tensors (pad_operands), slice the output back
    k_major_b: bool  # copy b to K-major (W.t() of a contiguous W) before launching
    tma: bool  # the TMA kernel (tensor descriptors), else the pointer kernel
    b_is_w: bool  # TMA only: b as launched is W.t() of a row-major W (N, K)
    input_precision: str  # tl.dot's for these inputs: "ieee" or "tf32"
    split_k: bool = False  # kernels.split_k instead (it copies nothing), the fields above unused


# There are few plans (five fields): each is built once and shared, so deciding costs a
# dictionary lookup (0.1 us) rather than a frozen dataclass's construction (1.5 us) per call.
_shared_plan = functools.cache(Plan)


_plans = {}  # what plan() decided, by everything it reads: one lookup per call after the first


def plan(a, b, kernel=None) -> Plan:
    """Decide how to compute a @ b for validated operands a (M, K), b (K, N). With `kernel`
    "tma" or "pointers", that kernel on the operands as they are (ValueError if the TMA cannot
    load them); with None, the measured rules above choose. Deciding reads shapes, strides,
    dtype, alignment and torch's fp32 precision, and cost about 7 us of host time per call on
    the H200's host: each decision is kept, keyed on exactly those."""
    precision = a.dtype == torch.float32 and torch.get_float32_matmul_precision()
    alignment = (a.data_ptr() % 16, b.data_ptr() % 16)
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, kernel, alignment, precision)
    how = _plans.get(key)
    if how is None:
        if len(_plans) >= 4096:  # a bound on shapes seen, not a tuning
            _plans.clear()
        how = _plans[key] = _decide(a, b, kernel)
    return how


def _decide(a, b, kernel) -> Plan:
    precision = input_precision(a.dtype)
    if kernel == "tma":
        if problem := tma_problem(a, b):
            raise ValueError(f"the TMA kernel cannot load these operands: {problem}")
        return _shared_plan(False, False, True, b.stride(1) != 1, precision)
    if kernel == "pointers":
        return _shared_plan(False, False, False, False, precision)
    if kernel is not None:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    (M, K), N = a.shape, b.shape[1]
    if wants_split_k(M, N, K, processors()):
        return _shared_plan(False, False, False, False, precision, True)
    large = not INTERPRET and M * N * K >= PAD_MIN_WORK
    pad = large and not aligned(a, b)
    if pad:  # fresh padded copies are contiguous with aligned rows: the TMA can load them
        tma, b_row_major = _tma_pays(a.dtype, M * padded(N) * padded(K)), True
    else:
        tma, b_row_major = uses_tma(a, b), b.stride(1) == 1
    # Hopper's tensor cores read TF32 operands from shared memory only K-major; b (K, N)
    # row-major is N-major, and TF32 ran at 0.21x cuBLAS at 4096^3 on an H200, against
    # 0.75x for the same values stored as W.t(). The transposing copy is one pass over b.
    # (fp32 never takes the TMA kernel: TMA_DTYPES.)
    k_major_b = large and a.dtype == torch.float32 and precision == "tf32" and b_row_major
    b_is_w = tma and not pad and b.stride(1) != 1
    return _shared_plan(pad, k_major_b, tma, b_is_w, precision)
