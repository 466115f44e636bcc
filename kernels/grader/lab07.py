"""Lab 7, more than one GPU: its tasks, the cases the grader draws, and the references.

Task 1 counts a ring all-reduce's bytes and steps (kernels.distributed.collectives is the
reference); task 2 fits the alpha-beta model to given timings (collectives.alpha_beta_fit);
task 3 is a tensor-parallel MLP run on two ranks (two gloo processes on a CPU, kernels.grader.
ranks), checked on both ranks against the one-rank MLP in fp64, with exactly one all-reduce and
no other collective; task 4 times it on two GPUs against the whole MLP on one.
"""

import math

import torch

from kernels import check
from kernels.distributed import collectives, tp
from kernels.grader import cases
from kernels.grader.tasks import Case, Task

NAME = "lab07_multi_gpu"
# The course's own answers (the learner's functions share two of their names, so the modules and
# the other names are what is refused)
COURSE_NAMES = frozenset({"collectives", "bus_factor", "ring_bytes_sent", "tp", "mlp_ref",
                          "layer_rank", "sequential_mlp", "overlapped_mlp", "overlap"})  # fmt: skip


# Task 1: a ring all-reduce's bytes and steps


def ring_bytes_ref(nbytes, world_size):
    """[bytes each rank sends, ring steps] of a ring all-reduce of an `nbytes` tensor."""
    return [collectives.ring_bytes_sent(nbytes, world_size), 2 * (world_size - 1)]


def _ring_cases(rng):
    drawn = []
    for world in (1, 2, 3, 4, 8, 16, 7, 2):
        nbytes = rng.choice((1, 1000, 4096, 2**20, 3 * 2**30, rng.randrange(1, 10**9)))
        drawn.append(Case((nbytes, world), label=f"ring_bytes({nbytes}, {world})",
                          expected=ring_bytes_ref(nbytes, world)))  # fmt: skip
    return drawn


# Task 2: the alpha-beta fit


def _fit_cases(rng):
    drawn = []
    for i in range(6):
        alpha = cases.log_uniform(rng, 1e-6, 1e-3)
        gbps = cases.log_uniform(rng, 0.5, 500)
        sizes = collectives.sizes_between(2**10, 2 ** rng.choice((20, 26, 30)))
        if i % 2:
            sizes = rng.sample(sizes, len(sizes))  # any order
        noise = 0.0 if i == 0 else 0.1
        times = [(alpha + s / (gbps * 1e9)) * (1 + noise * (2 * rng.random() - 1)) for s in sizes]
        label = f"{len(sizes)} sizes up to {max(sizes)} bytes, alpha {alpha:.3g} s, {gbps:.3g} GB/s"
        ref = list(collectives.alpha_beta_fit(sizes, times))
        drawn.append(Case((sizes, times), label=label + (", no noise" if not noise else ", noisy"),
                          expected=ref))  # fmt: skip
    return drawn


def _check_fit(case, out):
    if not isinstance(out, list) or len(out) != 2:
        return f"returned {out!r:.80}, expected [alpha, beta]"
    for got, want, name in zip(out, case.expected, ("alpha", "beta"), strict=True):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"returned {name} = {got!r:.40}, expected a number"
        if not math.isclose(got, want, rel_tol=1e-5):
            return f"returned {name} = {got:.6g}, expected {want:.6g}"
    return None


# Task 3: a tensor-parallel MLP on two ranks


def _mlp_cases(rng):
    drawn = []
    for shape, d, f in (((3, 7), 64, 96), ((1,), 32, 128), ((5,), 48, 64), ((2, 3), 16, 2)):
        x, seed = cases.draw(rng, (*shape, d))
        w_up = cases.tensor((f, d), seed + 1, scale=d**-0.5)
        w_down = cases.tensor((d, f), seed + 2, scale=f**-0.5)
        ref = tp.mlp_ref(x.double(), w_up.double(), w_down.double())
        label = f"x {tuple(x.shape)}, D {d}, F {f}, float32, seed {seed}, 2 ranks"
        # a list: the child reports each rank's output, not one tensor
        drawn.append(Case((x, w_up, w_down), label=label, expected=[ref], dtype=torch.float32,
                          action="ranks"))  # fmt: skip
    return drawn


def _check_tp(case, out):
    if not isinstance(out, list) or len(out) != 4:
        return f"returned {out!r:.80}, expected one output from each rank"
    (ref,) = case.expected
    for rank in (0, 1):
        y = out[rank]
        if not isinstance(y, torch.Tensor):
            return f"rank {rank} returned {type(y).__name__}, expected a tensor"
        if tuple(y.shape) != tuple(ref.shape) or y.dtype != case.dtype:
            return (f"rank {rank} returned {y.dtype} {tuple(y.shape)}, expected {case.dtype} "
                    f"{tuple(ref.shape)}")  # fmt: skip
        result = check.compare(y, ref, op="matmul", dtype=case.dtype)
        if not result.ok:
            return f"rank {rank}: wrong values: {result.message}"
        calls = dict(tuple(pair) for pair in out[2 + rank])
        if calls != {"all_reduce": 1}:
            seen = ", ".join(f"{n} x{c}" for n, c in sorted(calls.items())) or "none"
            return (f"rank {rank} called these collectives: {seen}; a column-then-row parallel "
                    "MLP needs exactly one all_reduce")  # fmt: skip
    return None


# Task 4: faster on two GPUs than on one


def _speed_cases(rng):
    d, f = 4096, 14336
    args = (cases.big_random(rng, (16, d), torch.bfloat16),
            cases.big_random(rng, (f, d), torch.bfloat16),
            cases.big_random(rng, (d, f), torch.bfloat16))  # fmt: skip
    label = f"x (16, {d}), F {f}, bfloat16, 2 GPUs"
    why = "each GPU reads half the weights, and one all-reduce of 16 rows costs microseconds"
    return [Case(args, label=label, action="ranks_time", check=cases.speed(1.2, why))]


TASKS = [
    Task(
        name="ring_bytes",
        function="ring_bytes",
        points=2,
        summary="bytes each rank sends in a ring all-reduce, and the ring's steps",
        hint="reduce-scatter then all-gather: n - 1 steps each, nbytes / n a step",
        cases=_ring_cases,
        check=cases.numbers(("bytes", "steps")),
        forbidden_names=COURSE_NAMES,
    ),
    Task(
        name="alpha_beta_fit",
        function="alpha_beta_fit",
        points=2,
        summary="alpha and beta of t = alpha + S * beta, least squares on the relative error",
        hint="divide each row of [1, S] and each t by t: then an ordinary least-squares solve",
        cases=_fit_cases,
        check=_check_fit,
        forbidden_names=COURSE_NAMES,
    ),
    Task(
        name="tp_mlp",
        function="tp_mlp",
        points=4,
        summary="a column-then-row parallel MLP on two ranks, one all-reduce",
        hint="gelu(x @ w_up_shard.T) @ w_down_shard.T is this rank's partial sum; add the others'",
        cases=_mlp_cases,
        check=_check_tp,
        forbidden_names=COURSE_NAMES,
        time_limit=120.0,  # two ranks start, each loading the submission
    ),
    Task(
        name="tp_mlp_speed",
        function="tp_mlp",
        points=2,
        summary="on two GPUs, the MLP at 16 tokens at least 1.2x faster than on one",
        hint="no copies of the weights inside the call; one all_reduce of the (16, D) output",
        cases=_speed_cases,
        check=cases.speed(1.2, "each GPU reads half the weights"),
        gpus=2,
        exclusive=True,
        time_limit=300.0,
    ),
]
