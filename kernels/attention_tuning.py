"""Attention's measured choices and launch plumbing, shared by the forward and backward kernels.

Configurations are (BLOCK_M, BLOCK_N, num_warps, num_stages): BLOCK_M query rows, BLOCK_N keys.
The GPU candidate lists come from `scripts/tune_attention.py` on the H200 (bf16, D = 64 and 128,
causal or not, B*H*S = 16*32768 tokens): rerun it and update them together. The lists for head
dims above 128 are NOT yet measured: they are chosen to fit Hopper's shared memory (see
`shared_memory_estimate`). Grids are (blocks, H, B): grid axis 1 is the head and axis 2 the
batch, as `kernels.primitives.head_tile` reads them (the dK/dV grid walks key/value heads).

Head dims: any D from 1 to MAX_HEAD_DIM. The kernels run on BLOCK_D = block_d(D) columns, the
next power of two (16 at least, tl.dot's smallest), and mask the padding: D = 80 costs what
D = 128 costs in FLOPs and registers, but reads and writes only 80 columns.
"""

import torch
import triton

from kernels.launch import cdiv, next_power_of_2
from kernels.launch import launch as launch_kernel
from kernels.runtime import ON_GPU

MAX_HEAD_DIM = 256  # one (BLOCK_N, D) tile of K and one of V per stage must fit shared memory
# What the candidate lists are chosen from: padded head dims <= 64, <= 128, <= 256.
HEAD_DIM_CLASSES = (64, 128, 256)
# Hopper: 228 KB of shared memory per SM, at most 227 KB for one block.
SHARED_MEMORY_PER_BLOCK = 227 * 1024


def block_d(head_dim: int) -> int:
    """The head dim the kernels compute on: the next power of two, at least 16."""
    return max(16, next_power_of_2(head_dim))


# The interpreter runs programs one after another in Python: on a CPU small blocks keep the
# tests fast and still cross many block boundaries.
CPU_CONFIG = (32, 16, 4, 1)  # forward
CPU_DKDV_CONFIG = (16, 32, 4, 1)
CPU_DQ_CONFIG = (32, 16, 4, 1)


def forward_candidates(dtype, head_dim: int, seq_q: int) -> list:
    """The configurations the GPU autotuner times for the forward kernel. Compiled for the H200
    with triton 3.6, none of the 16-bit ones for D <= 128 spills registers."""
    d = block_d(head_dim)
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and need small tiles
        return [(32, 16, 4, 2)]
    if d > 128:  # not yet measured: a (64, 256) fp32 accumulator is 128 registers a thread
        return [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)]
    if seq_q <= 64:  # decoding: a few query rows against a long KV cache
        return [(64, 64, 4, 3), (64, 32, 4, 4)]
    if d <= 64:
        return [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4)]
    return [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (128, 128, 8, 2)]


def dkdv_candidates(dtype, head_dim: int, seq_q: int) -> list:
    """Configurations the GPU autotuner times for the dK/dV kernel (BLOCK_N keys per program).
    Compiled for the H200 with triton 3.6, none of the 16-bit ones for D <= 128 spills."""
    d = block_d(head_dim)
    if dtype == torch.float32:
        return [(16, 32, 4, 2)]
    if d > 128:  # not yet measured: dK and dV accumulate (BLOCK_N, 256) fp32 tiles each
        return [(16, 32, 4, 2), (32, 32, 4, 2), (16, 64, 8, 2), (32, 64, 8, 2)]
    if seq_q <= 64:
        return [(32, 64, 4, 3), (32, 64, 8, 3)]
    if d <= 64:
        return [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3)]
    return [(32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3)]


def dq_candidates(dtype, head_dim: int, seq_q: int) -> list:
    """Configurations the GPU autotuner times for the dQ kernel (BLOCK_M queries per program)."""
    d = block_d(head_dim)
    if dtype == torch.float32:
        return [(32, 16, 4, 2)]
    if d > 128:  # not yet measured: Q, dO and the dQ accumulator stay resident
        return [(32, 32, 4, 2), (64, 32, 4, 2), (64, 32, 8, 2), (32, 64, 4, 2)]
    if seq_q <= 64:
        return [(64, 64, 4, 3)]
    if d <= 64:
        return [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)]
    return [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)]


def shared_memory_estimate(kernel: str, config: tuple, head_dim: int, element_size: int) -> int:
    """Bytes of shared memory a configuration needs, at most: the tiles a program keeps (its
    own rows: Q; K and V for dK/dV; Q and dO for dQ) once, the tiles it streams (K and V, or Q
    and dO) once per pipeline stage, and one (BLOCK_M, BLOCK_N) probability tile on its way to
    the second dot. Meant as an upper bound (Triton may keep fewer buffers, or keep some tiles in
    registers). Every candidate, the measured ones for D <= 128 and the unmeasured ones above,
    is under SHARED_MEMORY_PER_BLOCK by it; the GPU tests compile and check each of them."""
    bm, bn, _, stages = config
    d = block_d(head_dim)
    kept, streamed = {"forward": (bm, bn), "dkdv": (bn, bm), "dq": (bm, bn)}[kernel]
    tiles = 2 * kept * d if kernel != "forward" else kept * d  # Q; K and V; Q and dO
    tiles += stages * 2 * streamed * d + bm * bn
    return element_size * tiles


def autotuned(kernel, candidates):
    """`kernel` under triton.autotune: times `candidates(dtype, head_dim, seq_q)` once per
    (power-of-two length buckets, head dim, query heads per key/value head, causal, dtype), and
    keeps the timings on disk for later processes. Used on a GPU only."""
    every = {c for dt in (torch.float32, torch.float16) for d in HEAD_DIM_CLASSES
             for sq in (1, 4096) for c in candidates(dt, d, sq)}  # fmt: skip
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in sorted(every)
    ]

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        wanted = candidates(args["Q"].dtype, args["HEAD_DIM"], args["SEQ_Q_BUCKET"])
        return [c for c in configs if config_tuple(c) in wanted]

    return triton.autotune(
        configs=configs,
        key=["SEQ_Q_BUCKET", "SEQ_K_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL"],
        prune_configs_by={"early_config_prune": prune},
        cache_results=True,
    )(kernel)


def config_tuple(config) -> tuple:
    """A triton.Config as (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)


# Below this many scores (B*H*Sq*Sk) launch overhead dominates: timing configurations would
# cost more than it saves, so a GPU runs the first candidate untimed.
TUNE_MIN_SCORES = 2**24


def choose_config(config, cpu_config, candidates, q, k):
    """The (BLOCK_M, BLOCK_N, num_warps, num_stages) to launch with, or None to autotune:
    `config` if given, `cpu_config` in the interpreter, else by problem size on a GPU."""
    if config is not None:
        return config
    if not ON_GPU:
        return cpu_config
    B, H, Sq, D = q.shape
    if B * H * Sq * k.shape[2] >= TUNE_MIN_SCORES:
        return None
    return candidates(q.dtype, D, length_buckets(Sq, k.shape[2])[0])[0]


def launch(kernel, tuned, args, meta, *, rows, block, config, B, H):
    """Run `kernel` on a (cdiv(rows, block), H, B) grid, `block` ("BLOCK_M" or "BLOCK_N") being
    the tile that splits `rows`, with `config`, or through the autotuned `tuned` if None."""
    if config is None:
        tuned[lambda conf: (cdiv(rows, conf[block]), H, B)](*args, **meta)
        return
    bm, bn, warps, stages = config
    grid = (cdiv(rows, bm if block == "BLOCK_M" else bn), H, B)
    tiles = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    launch_kernel(kernel, grid, *args, **meta, **tiles)


def with_32bit_head_offsets(t):
    """`t`, or a contiguous copy where offsets inside one (batch, head) slice would need 64 bits
    (a view of a (B, S, H, D) tensor with S*H*D >= 2**31, say): the copy needs only S*D."""
    if t.shape[2] * t.stride(2) + t.shape[3] * t.stride(3) < 2**31:
        return t
    if t.shape[2] * t.shape[3] >= 2**31:
        raise ValueError(f"one head of shape {tuple(t.shape)} has 2**31 elements or more")
    return t.contiguous()


def length_buckets(sq: int, sk: int) -> tuple:
    """The autotuner's key for the sequence lengths: the next powers of two."""
    return next_power_of_2(max(sq, 1)), next_power_of_2(max(sk, 1))


def visible_scores(sq: int, sk: int, causal: bool) -> int:
    """The (query, key) pairs of one head whose score counts. With the causal mask aligned to
    the end, query i of Sq sees Sk - Sq + i + 1 keys: Sq*Sk - Sq*(Sq - 1)/2 in all (about half
    when Sq = Sk, all of them when decoding one query)."""
    return sq * sk - sq * (sq - 1) // 2 if causal else sq * sk


def profiler_metadata(flops_per_score: int, tensors: tuple):
    """A `launch_metadata` function for an attention kernel, `@triton.jit(launch_metadata=...)`:
    a profiler (proton, for one) names each launch `kernel [B H Sq Sk D causal]` and counts its
    FLOPs, `flops_per_score` * D per visible score, and its compulsory bytes, each of the named
    tensor arguments read or written once (the kernels re-read K and V, mostly from L2)."""

    def metadata(grid, kernel, args) -> dict:
        B, H, Sq, D = args["Q"].shape
        Sk = args["K"].shape[2]
        causal = bool(args["CAUSAL"])
        shape = f"B={B} H={H} Sq={Sq} Sk={Sk} D={D}" + (" causal" if causal else "")
        return {
            "name": f"{kernel.name} [{shape}]",
            "flops": flops_per_score * D * B * H * visible_scores(Sq, Sk, causal),
            "bytes": sum(args[t].numel() * args[t].element_size() for t in tensors),
        }

    return metadata
