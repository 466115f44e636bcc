"""Hiding communication behind computation: split the rows (tokens) of a tensor-parallel MLP
into chunks, and start each chunk's all-reduce without waiting for it (async_op=True), so that
it travels while the next chunk computes. Only the last chunk's all-reduce is left exposed.

Rank functions (for kernels.distributed.run_ranks) take (rank, world_size, ...) first.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.distributed.collectives import DTYPES, median_s, rank_device
from kernels.distributed.tp import shard_mlp


def _partial(x, up, down):
    return F.gelu(x @ up.T) @ down.T  # (.., D): this rank's F/n terms


def sequential_mlp(x, up, down, chunks: int = 1):
    """Chunk by chunk: compute, then all-reduce and wait, then the next chunk."""
    outs = []
    for part in x.chunk(chunks, dim=0):
        y = _partial(part, up, down)
        dist.all_reduce(y)
        outs.append(y)
    return torch.cat(outs)


def overlapped_mlp(x, up, down, chunks: int = 4):
    """Chunk by chunk, each chunk's all-reduce started and left running while the next one
    computes; all of them waited for at the end."""
    outs, pending = [], []
    for part in x.chunk(chunks, dim=0):
        y = _partial(part, up, down)
        pending.append(dist.all_reduce(y, async_op=True))
        outs.append(y)
    for work in pending:
        work.wait()
    return torch.cat(outs)


def overlap_rank(rank, world_size, tokens, d_model, d_ff, chunks=4, iters=5, dtype="fp32"):
    """A rank function: times in ms of the MLP's compute alone, one all-reduce of its output
    alone, the two in sequence, and chunked with overlap; and the fraction of the all-reduce's
    time that the overlap hid. On rank 0 (the others return {})."""
    device = rank_device()
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)  # the same weights and tokens on every rank
    x = torch.randn(tokens, d_model, generator=gen).to(device, dtype)
    w_up = (torch.randn(d_ff, d_model, generator=gen) / d_model**0.5).to(device, dtype)
    w_down = (torch.randn(d_model, d_ff, generator=gen) / d_ff**0.5).to(device, dtype)
    up, down = shard_mlp(w_up, w_down, rank, world_size)
    out = torch.empty(tokens, d_model, device=device, dtype=dtype)
    ms = {
        "compute_ms": median_s(lambda: _partial(x, up, down), iters),
        "all_reduce_ms": median_s(lambda: dist.all_reduce(out), iters),
        "sequential_ms": median_s(lambda: sequential_mlp(x, up, down), iters),
        "overlapped_ms": median_s(lambda: overlapped_mlp(x, up, down, chunks), iters),
    }
    ms = {k: v * 1e3 for k, v in ms.items()}
    hidden = ms["sequential_ms"] - ms["overlapped_ms"]
    ms["hidden_fraction"] = hidden / ms["all_reduce_ms"] if ms["all_reduce_ms"] > 0 else 0.0
    ms["same_result"] = bool(torch.equal(sequential_mlp(x, up, down, chunks),
                                         overlapped_mlp(x, up, down, chunks)))  # fmt: skip
    return ms if rank == 0 else {}
