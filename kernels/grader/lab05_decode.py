"""Lab 5, tasks 3 to 5: split-KV decoding attention, its references and the cases drawn.

One decoding step: a single query per (batch, head), q (B, H, D), against a KV cache k, v
(B, H, S, D). The keys are cut into splits of a fixed size at fixed absolute positions; each
split's partial result (m, l, acc) is computed on its own, then the splits are combined in
order. References are float64, from the formulas; invariance is bitwise across batch prefixes,
with `prefixes.check_prefixes`, as for the matmul.
"""

import math

import torch

from kernels.grader import cases
from kernels.grader.prefixes import PrefixCase, prefix_sizes
from kernels.grader.tasks import Case

# On an H200 (torch 2.11, triton 3.6) the solution's step runs 1.6x the speed of copying k and v.
MIN_KV_COPY_FRACTION = 0.5


def decode_partials_ref(q, k, v, split_size: int):
    """(m, l, acc) in float64: m, l (B, H, n_splits), acc (B, H, n_splits, D), split s holding
    keys [s * split_size, min((s + 1) * split_size, S))."""
    q, k, v = q.double(), k.double(), v.double()
    S, D = k.shape[-2], k.shape[-1]
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(D)
    ms, ls, accs = [], [], []
    for lo in range(0, S, split_size):
        s = scores[..., lo : lo + split_size]
        m = s.amax(dim=-1)
        p = torch.exp(s - m[..., None])
        ms.append(m)
        ls.append(p.sum(dim=-1))
        accs.append(torch.einsum("bhs,bhsd->bhd", p, v[..., lo : lo + split_size, :]))
    return torch.stack(ms, -1), torch.stack(ls, -1), torch.stack(accs, -2)


def decode_attention_ref(q, k, v):
    """softmax(q k^T / sqrt(D)) v for one query per (batch, head), in float64: (B, H, D)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("bhd,bhsd->bhs", q, k) / math.sqrt(k.shape[-1])
    return torch.einsum("bhs,bhsd->bhd", torch.softmax(scores, dim=-1), v)


def _inputs(rng, B, H, S, D, dtype, scale=1.0, strided=False):
    """q, k, v and their seed; strided: each a view of every other element of its head dim."""
    seed = cases.new_seed(rng)
    q = cases.tensor((B, H, D), seed, dtype, scale=scale)
    k = cases.tensor((B, H, S, D), seed + 1, dtype, scale=scale)
    v = cases.tensor((B, H, S, D), seed + 2, dtype)
    if strided:
        q, k, v = cases.strided(q), cases.strided(k), cases.strided(v)
    return q, k, v, seed


# Task 3: the partials. (B, H, S, D, split_size): one key, a split of one key, S at split
# edges +-1, splits longer than the cache, and a short last split.
PARTIAL_SHAPES = (
    (1, 1, 1, 16, 16),
    (2, 3, 17, 16, 16),
    (1, 2, 63, 32, 64),
    (1, 2, 64, 32, 64),
    (2, 1, 65, 32, 64),
    (1, 1, 200, 16, 256),
    (3, 2, 300, 16, 128),
)


def _partials_case(rng, shape, dtype, scale=1.0, strided=False):
    B, H, S, D, split = shape
    q, k, v, seed = _inputs(rng, B, H, S, D, dtype, scale, strided)
    extra = f", scores of scale {scale:g}" if scale != 1.0 else ""
    kind = ", non-contiguous" if strided else ""
    label = (
        f"q {tuple(q.shape)}, k and v {tuple(k.shape)}{kind}, split_size {split}, "
        f"{cases.dtype_name(dtype)}{extra}, seed {seed}"
    )
    return Case((q, k, v, split), label, expected=decode_partials_ref(q, k, v, split))


def decode_partials_cases(rng):
    drawn = []
    for dtype in (torch.float32, torch.float16):
        drawn += [_partials_case(rng, shape, dtype) for shape in PARTIAL_SHAPES]
        drawn.append(_partials_case(rng, PARTIAL_SHAPES[-1], dtype))  # fresh data
        drawn.append(_partials_case(rng, PARTIAL_SHAPES[4], dtype, strided=True))
    # scores of scale ~100: exp() of a raw score overflows float32; only m saves it
    drawn.append(_partials_case(rng, (2, 2, 150, 32, 64), torch.float32, scale=10.0))
    return drawn


def check_partials(case: Case, out) -> str | None:
    # attention's fp32 tolerance: the scores reach about 100 in one case, where an fp32 dot
    # product's rounding (about 1e-4 of a score) moves exp(s - m) by as much, relatively
    return cases.fp32_tuple_problem(out, case.expected, ("m", "l", "acc"), op="attention")


# Tasks 4 and 5: the whole step, values, then bitwise across batch prefixes.


def _decode_group(rng, rows, H, S, D, split, dtype, extra_sizes=(), strided=False):
    q, k, v, seed = _inputs(rng, rows, H, S, D, dtype, strided=strided)
    kind = " non-contiguous" if strided else ""
    label = (
        f"q ({rows}, {H}, {D}), k and v ({rows}, {H}, {S}, {D}){kind}, split_size {split}, "
        f"{cases.dtype_name(dtype)}, seed {seed}"
    )

    def case(b):
        qb, kb, vb = (q, k, v) if b is None else (q[:b], k[:b], v[:b])
        shown = f"full batch of {rows}" if b is None else f"first {b} rows"
        return PrefixCase(
            (qb, kb, vb, split),
            label=f"{label}, {shown}",
            expected=decode_attention_ref(qb, kb, vb),
            dtype=dtype,
            group=label,
            batch=b,
        )

    return [case(None)] + [case(b) for b in prefix_sizes(rows, rng, extra_sizes)]


# (B, H, S, D, split_size): S on either side of a split edge, one split, many splits.
DECODE_SHAPES = ((9, 2, 129, 16, 64), (7, 1, 64, 32, 64), (11, 2, 300, 16, 32))


def decode_attention_cases(rng):
    drawn = []
    for dtype in (torch.float32, torch.float16):
        for B, H, S, D, split in DECODE_SHAPES:
            drawn += _decode_group(rng, B, H, S, D, split, dtype)
    return drawn + _decode_group(rng, *DECODE_SHAPES[0], torch.float32, strided=True)


TIMED = (32, 8, 8192, 128)  # (B, H, S, D), bf16: 1 GiB of K and V, read once per step


def decode_gpu_cases(rng):
    drawn = []
    for dtype in (torch.bfloat16, torch.float16):
        # kept small: every call's inputs travel to the child and back (under 400 MB in all)
        drawn += _decode_group(rng, 48, 1, 1000, 128, 256, dtype, (8, 16, 17, 31, 32, 33))
        drawn += _decode_group(rng, 12, 1, 4097, 64, 256, dtype)
    drawn += _decode_group(rng, 12, 2, 1000, 64, 256, torch.bfloat16, strided=True)
    B, H, S, D = TIMED
    bf16 = torch.bfloat16
    q = cases.big_random(rng, (B, H, D), bf16)
    k, v = (cases.big_random(rng, (B, H, S, D), bf16) for _ in range(2))
    bytes_read = 2 * B * H * S * D * 2
    timed = cases.timed(
        (q, k, v, 256),
        f"q ({B}, {H}, {D}), k and v ({B}, {H}, {S}, {D}), bfloat16, split_size 256, timed",
        against="kv",
        min_fraction=MIN_KV_COPY_FRACTION,
        why="decoding reads k and v once, half the bytes their copy moves (it writes them too)",
        rate=lambda ms: f"{bytes_read / (ms * 1e6):.0f} GB/s of k and v read",
    )
    return drawn + [timed]
