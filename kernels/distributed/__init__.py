"""Chapter 7, more than one GPU, on torch.distributed (NCCL on GPUs, gloo on a CPU).

    run_ranks(fn, world_size, *args)   # fn(rank, world_size, *args) in one process per rank
    collectives.sweep(...)             # timed all-reduce / all-gather / reduce-scatter
    tp.tp_mlp(...), tp.tp_attention(...), tp.shard_block(...)   # Megatron-style tensor parallelism
    overlap.overlapped_mlp(...)        # one chunk's all-reduce while the next computes
    invariance.*                       # what an all-reduce does to the bits

The rank functions live in these files, not in a notebook: a spawned process imports the
function it runs by name, and a notebook's own functions have no module to import them from.
"""

from kernels.distributed.launch import RankError, backend_for, run_ranks

__all__ = ["run_ranks", "RankError", "backend_for"]
