"""What an all-reduce does to the bits, and what tensor parallelism does to batch invariance.

- Two ranks: each element of the all-reduced tensor is one addition, a + b, which is
  commutative in floating point: every rank gets the same bits, whatever the order.
- Three or more: (a + b) + c and a + (b + c) differ in the last bits; a library may pick its
  order (ring, tree) by size and world: a reproducible result needs a fixed order.
- Tensor parallelism over two ranks splits the K reduction of the row-parallel matmul: rank 0
  sums the first F/2 terms, rank 1 the rest, and the all-reduce adds the two sums. With
  batch-invariant matmuls on each rank (Chapter 5) the result is invariant to the batch size,
  but it is a different summation order from one rank's, so not bitwise equal to it.

Rank functions (for kernels.distributed.run_ranks) take (rank, world_size, ...) first.
"""

import torch.distributed as dist
import torch.nn.functional as F

from kernels import batch_invariant
from kernels.batch_invariant.harness import check_batch_invariance, differing
from kernels.distributed.tp import shard_mlp


def all_reduce_rank(rank, world_size, parts):
    """A rank function: rank r contributes parts[r]; returns the all-reduced sum it got."""
    t = parts[rank].clone()
    dist.all_reduce(t)
    return t


def orders_differ(parts) -> int:
    """Elements where summing `parts` left to right and right to left give different bits."""
    left, right = parts[0].clone(), parts[-1].clone()
    for p in parts[1:]:
        left = left + p
    for p in reversed(parts[:-1]):
        right = p + right
    return int(differing(left, right).sum())


def invariant_mlp(x, up, down):
    """The MLP's share on this rank with Chapter 5's batch-invariant matmul (no all-reduce)."""
    return batch_invariant.matmul(F.gelu(batch_invariant.matmul(x, up.T)), down.T)


def tp_invariance_rank(rank, world_size, x, w_up, w_down, sizes=(1, 2, 3, 5, 8), needles=3):
    """A rank function: Chapter 5's harness on the tensor-parallel MLP (batch-invariant matmuls
    on each rank, then one all-reduce), and its output against one rank's. Every rank runs the
    same calls in the same order (the harness draws its needles from a fixed seed). On rank 0:
    {"report", "invariant", "checks", "differing_from_one_rank", "elements", "max_abs_diff"}."""
    up, down = shard_mlp(w_up, w_down, rank, world_size)

    def tp(rows):
        y = invariant_mlp(rows, up, down)
        dist.all_reduce(y)
        return y

    report = check_batch_invariance(tp, x, sizes=list(sizes), needles=needles, repeats=2)
    split = tp(x)  # every rank takes part in each all-reduce
    if rank:
        return {}
    whole = invariant_mlp(x, w_up, w_down)
    return {
        "report": str(report),
        "invariant": report.ok,
        "checks": report.checks,
        "differing_from_one_rank": int(differing(split, whole).sum()),
        "elements": whole.numel(),
        "max_abs_diff": (split.double() - whole.double()).abs().max().item(),
    }
