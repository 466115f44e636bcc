"""The child's side of a task whose function runs on several ranks (Lab 7).

The child starts WORLD ranks with kernels.distributed.run_ranks (gloo on a CPU, NCCL on GPUs);
each loads the learner's module from its file (a spawned process cannot be handed the child's
function), takes its shards of the MLP's weights (kernels.distributed.tp.shard_mlp), calls the
learner's function on them, and reports its output and the collectives it called. A timed case
times the call on every rank (a fixed number of calls, so that every rank makes the same
collectives) and, on rank 0, the whole MLP on one GPU beside it.
"""

import time

import torch
import torch.distributed as dist

WORLD = 2
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce",
    "scatter", "gather", "send", "recv", "isend", "irecv",
)  # fmt: skip
TIMED_CALLS = 50


def _count_collectives(counts: dict) -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _device(rank):
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _inputs(args, device):
    from kernels.grader import cases

    made = [cases.make_big_random(a, device) if cases.is_big_random(a) else a for a in args]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in made]


def _ms(fn, args, device, together=True) -> float:
    """ms per call of fn(*args), TIMED_CALLS calls; `together`: every rank starts at once (a
    barrier: call it on every rank), else this rank alone."""
    for _ in range(3):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    if together:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(TIMED_CALLS):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / TIMED_CALLS


def mlp_rank(rank, world_size, module_path, function, argsets, timed, load, plain):
    """A rank function: the learner's `function(x, w_up_shard, w_down_shard)` on this rank's
    shards, for each set of (x, w_up, w_down) in turn; per set [output, [[collective, calls],
    ...]], or with `timed` {"ms", "baseline_ms", "baseline"}. `load` and `plain` are the
    child's (how it loads the submission, and what it reports of a value)."""
    from kernels.distributed.tp import mlp_ref, shard_mlp

    fn = getattr(load(module_path), function)
    device = _device(rank)
    counts = {}
    _count_collectives(counts)
    reports = []
    for args in argsets:
        x, w_up, w_down = _inputs(args, device)
        up, down = shard_mlp(w_up, w_down, rank, world_size)
        if timed:
            alone = _ms(mlp_ref, (x, w_up, w_down), device, together=False) if rank == 0 else 0.0
            ms = _ms(fn, (x, up, down), device)
            reports.append({"ms": ms, "baseline_ms": alone, "baseline": "one_gpu"})
            continue
        counts.clear()
        out = fn(x, up, down)
        reports.append([plain(out), [[name, n] for name, n in sorted(counts.items())]])
    return reports


_DONE = {}  # id of the child's case list -> every case's report: all cases run in one launch


def run_case(job, case, timeout_s, load, plain) -> dict:
    """What the child reports for `case`, one of job["cases"]: the ranks' outputs and the
    collectives each called, or a timing. The first call runs every case of the job on one
    launch of the ranks (each rank loads the submission once)."""
    from kernels.distributed import run_ranks
    from kernels.runtime import ON_GPU

    batch = [c for c in job["cases"] if c.get("action") == case["action"]]
    key = (id(job["cases"]), case["action"])
    if key not in _DONE:
        timed = case["action"] == "ranks_time"
        device = "cuda" if ON_GPU and torch.cuda.device_count() >= WORLD else "cpu"
        results = run_ranks(mlp_rank, WORLD, job["module"], job["function"],
                            [c["args"] for c in batch], timed, load, plain, device=device,
                            timeout_s=timeout_s)  # fmt: skip
        _DONE[key] = [[rank[i] for rank in results] for i in range(len(batch))]
    per_rank = _DONE[key][next(i for i, c in enumerate(batch) if c is case)]
    if case["action"] == "ranks_time":
        return {"timing": per_rank[0]}
    return {
        "output": [*(r[0] for r in per_rank), *(r[1] for r in per_rank)],
        "device": None,
        "inputs_after": list(case["args"]),
        "launches": 0,
        "ops": [],
        "from_kernel": False,
    }
