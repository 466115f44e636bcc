"""Timing the collectives, and the two numbers that describe each: algbw and busbw.

A collective on n ranks over a message of S bytes (the size of each rank's full tensor:
the all-reduce's input, the all-gather's output, the reduce-scatter's input) takes t seconds.

- algbw = S / t: what the caller sees.
- busbw = algbw * factor: the bytes each rank's link must carry, for comparing with the link's
  speed whatever n is. A ring all-reduce sends 2(n-1)/n of the data through every link
  (reduce-scatter then all-gather); all-gather and reduce-scatter send (n-1)/n. These are the
  factors of NCCL's own tests (nccl-tests, doc/PERFORMANCE.md).

The alpha-beta model: t(S) = alpha + S * beta, alpha the fixed cost (launch, synchronization,
link latency), 1/beta the bandwidth the large messages reach. `alpha_beta_fit` finds both by
least squares; below S = alpha / beta a collective is latency-bound.
"""

import statistics
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (nccl-tests' PERFORMANCE.md)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    n = world_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def ring_bytes_sent(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of an `nbytes` tensor: 2(n-1) steps of
    nbytes / n (n-1 of reduce-scatter, n-1 of all-gather)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return bus_factor("all_reduce", world_size) * nbytes


def algbw_gbps(nbytes: float, seconds: float) -> float:
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return nbytes / seconds / 1e9


def alpha_beta_fit(sizes_bytes, seconds) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) minimizing the squared relative error of
    alpha + S * beta against the measured times (relative: small messages count as much as
    large ones, whose times are a million times longer)."""
    sizes = torch.as_tensor(sizes_bytes, dtype=torch.float64).flatten()
    times = torch.as_tensor(seconds, dtype=torch.float64).flatten()
    if sizes.numel() != times.numel():
        raise ValueError(f"{sizes.numel()} sizes but {times.numel()} times")
    if sizes.numel() < 2 or len(set(sizes.tolist())) < 2:
        raise ValueError("the fit needs at least two different message sizes")
    if not bool((times > 0).all()) or not bool((sizes >= 0).all()):
        raise ValueError("times must be positive and sizes non-negative")
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1) / times[:, None]  # (m, 2)
    solution = torch.linalg.lstsq(design, torch.ones_like(times)[:, None]).solution
    alpha, beta = solution.flatten().tolist()
    return alpha, beta


def sizes_between(smallest: int, largest: int) -> list[int]:
    """Powers of 4 bytes from `smallest` to `largest` (1 KB, 4 KB, ... 1 GB)."""
    sizes, s = [], smallest
    while s <= largest:
        sizes.append(s)
        s *= 4
    return sizes


# torch 2.13 renamed the single-tensor forms; the GPU machine's torch 2.11 has the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _call(op, tensors):
    src, dst = tensors
    if op == "all_reduce":
        dist.all_reduce(src)
    elif op == "all_gather":
        _ALL_GATHER(dst, src)
    else:
        _REDUCE_SCATTER(dst, src)


def _buffers(op, nbytes, dtype, world_size, device):
    numel = max(world_size, nbytes // dtype.itemsize // world_size * world_size)
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.empty(numel // world_size, dtype=dtype, device=device)
    if op == "all_gather":
        return (part, full), full.nbytes
    if op == "reduce_scatter":
        return (full, part), full.nbytes
    return (full, None), full.nbytes


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rank_device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def median_s(fn, iters: int, warmup: int = 1) -> float:
    """Median seconds of fn() over `iters` runs after `warmup` more, on this rank's clock, with
    a barrier before each run so that every rank starts together: call it on every rank."""
    device, samples = rank_device(), []
    for i in range(warmup + iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def time_collective(op, nbytes, dtype=torch.float32, warmup=2, iters=5) -> tuple[int, float]:
    """(bytes, median seconds) of `op` on this rank's group (median_s: every rank starts each
    run together). Call it on every rank."""
    tensors, size = _buffers(op, nbytes, dtype, dist.get_world_size(), rank_device())
    return size, median_s(lambda: _call(op, tensors), iters, warmup)


def sweep_rank(rank, world_size, ops, sizes, dtype_name="fp32", iters=5) -> list[dict]:
    """A rank function (for run_ranks): every op at every size; rows on rank 0, [] elsewhere."""
    dtype = DTYPES[dtype_name]
    rows = []
    for op in ops:
        for nbytes in sizes:
            size, seconds = time_collective(op, nbytes, dtype, iters=iters)
            algbw = algbw_gbps(size, seconds)
            rows.append({"op": op, "bytes": size, "seconds": seconds, "algbw_gbps": algbw,
                         "busbw_gbps": algbw * bus_factor(op, world_size)})  # fmt: skip
    return rows if rank == 0 else []


def fits(rows) -> dict:
    """{op: {"alpha_us", "beta_gbps" (1 / beta), "knee_bytes" (alpha / beta)}} from sweep rows."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        alpha, beta = alpha_beta_fit([r["bytes"] for r in mine], [r["seconds"] for r in mine])
        beta = max(beta, 1e-15)  # a flat curve (all latency) has no bandwidth to speak of
        out[op] = {"alpha_us": alpha * 1e6, "beta_gbps": 1 / beta / 1e9, "knee_bytes": alpha / beta}
    return out
