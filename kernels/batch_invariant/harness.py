"""The invariance harness: does an op give a row the same bits whatever else is in the batch?

For an op f that maps a batch of rows to a batch of rows (a matmul against fixed weights, a
norm, a softmax), and an input X of `bmax` rows:

1. every row of f(X[:B]) against f(X)[:B], bitwise, for B over primes, powers of two and
   their neighbours, and the processor count (the GPU's SMs) plus and minus one;
2. needles: random rows of X in random order in batches of random size, each output row
   against that row's output in f(X);
3. repeats: f(X) run again gives the same bits (run-to-run determinism).

For attention, `check_attention_invariance` compares one query's output across a full
prefill, one decoding step over the KV cache (plain and padded), chunked prefills, KV lengths
around the split boundaries, and a padded batch in the company of other sequences.

Bitwise means equal values (+0 equals -0) with NaN equal to NaN in the same place. A report
gives the first case that differs, the largest difference and the largest distance in ULPs
(units in the last place: how many representable numbers lie between the two values).
"""

import random
from dataclasses import dataclass, field

import torch

from kernels.runtime import processors

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16, torch.float64: torch.int64}  # fmt: skip


@dataclass
class InvarianceReport:
    ok: bool = True
    checks: int = 0  # comparisons made
    first_bad: str | None = None  # the first case that differed, in words
    first_bad_batch: int | None = None  # the smallest batch size that differed in the sweep
    max_abs_diff: float = 0.0
    max_ulp: int = 0
    cases: list = field(default_factory=list, repr=False)  # (case, differing elements)

    def __str__(self):
        if self.ok:
            return f"invariant: {self.checks} comparisons, all bitwise equal"
        return (
            f"NOT invariant: first difference at {self.first_bad}; "
            f"{sum(1 for _, n in self.cases if n)} of {self.checks} comparisons differ, "
            f"max |diff| {self.max_abs_diff:.3g}, max {self.max_ulp} ULP"
        )

    def compare(self, case: str, out: torch.Tensor, ref: torch.Tensor, batch: int | None = None):
        """Record one bitwise comparison of `out` against `ref`."""
        self.checks += 1
        differ = differing(out, ref)
        n = int(differ.sum())
        self.cases.append((case, n))
        if n == 0:
            return
        if self.ok:
            self.ok, self.first_bad = False, case
        if batch is not None and (self.first_bad_batch is None or batch < self.first_bad_batch):
            self.first_bad_batch = batch
        both_finite = differ & torch.isfinite(out) & torch.isfinite(ref)
        if both_finite.any():
            diff = (out[both_finite].double() - ref[both_finite].double()).abs().max().item()
            self.max_abs_diff = max(self.max_abs_diff, diff)
        self.max_ulp = max(self.max_ulp, int(ulp_distance(out[differ], ref[differ]).max()))


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements that are not bitwise the same value (NaN = NaN, +0 = -0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {a.dtype} {tuple(a.shape)} with {b.dtype} "
                         f"{tuple(b.shape)}")  # fmt: skip
    return ~((a == b) | (torch.isnan(a) & torch.isnan(b)))


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| counted in representable floats of their dtype (int64; 0 where equal)."""
    view = _INT_VIEW[a.dtype]
    bits = torch.iinfo(view).bits

    def ordered(t):  # floats as integers on one monotone line; -0 and +0 both map to 0
        i = t.contiguous().view(view).to(torch.int64)
        magnitude = i & ((1 << (bits - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def _primes(n):
    return [p for p in range(2, n + 1) if all(p % d for d in range(2, int(p**0.5) + 1))]


def batch_sizes(bmax: int, sm_count: int | None = None, max_prime: int = 128) -> list[int]:
    """Batch sizes where a library's choice tends to switch: primes up to `max_prime`, powers
    of two and their neighbours, the processor count and its neighbours, and bmax."""
    sm_count = sm_count or processors()
    sizes = {1, bmax, sm_count - 1, sm_count, sm_count + 1, *_primes(min(bmax, max_prime))}
    p = 2
    while p <= bmax + 1:
        sizes |= {p - 1, p, p + 1}
        p *= 2
    return sorted(b for b in sizes if 1 <= b <= bmax)


def check_batch_invariance(
    f, x: torch.Tensor, *, sizes=None, needles: int = 8, repeats: int = 3, seed: int = 0
) -> InvarianceReport:
    """Is f (rows -> rows) batch-invariant on x (bmax, ...)? Sweep, needles, repeats."""
    bmax = x.shape[0]
    report = InvarianceReport()
    full = f(x)
    for b in batch_sizes(bmax) if sizes is None else sizes:
        report.compare(f"B={b}", f(x[:b]), full[:b], batch=b)
    rng = random.Random(seed)
    for _ in range(needles):
        b = rng.randint(1, bmax)
        rows = torch.tensor([rng.randrange(bmax) for _ in range(b)], device=x.device)
        needle = rng.randrange(bmax)
        at = rng.randrange(b)
        rows[at] = needle
        report.compare(f"row {needle} at {at} of a random batch of {b}", f(x[rows]), full[rows])
    for r in range(repeats):
        report.compare(f"repeat {r + 1} of f(X)", f(x), full)
    return report


def first_row_drift(f, x: torch.Tensor, sizes) -> list:
    """[(B, max |f(x[:B])[0] - f(x[:1])[0]|)]: how far the first row's result moves as the batch
    grows (0.0 where its bits do not move)."""
    alone = f(x[:1])[0].double()
    return [(b, (f(x[:b])[0].double() - alone).abs().max().item()) for b in sizes]


def split_boundary_lengths(split_size: int, max_len: int, block: int = 0) -> list[int]:
    """KV lengths 1, 2, each split boundary and (when given) inner block boundary plus and
    minus one, and max_len."""
    lengths = {1, 2, max_len}
    for step in (split_size, block):
        for edge in range(step, max_len + 1, step) if step else ():
            lengths |= {edge - 1, edge, edge + 1}
    return sorted(n for n in lengths if 1 <= n <= max_len)


def check_attention_invariance(
    attn, q, k, v, *, split_size: int, block: int = 0, lengths=None, chunks=(1, 3, 16),
    company: int = 3, seed: int = 0,
) -> InvarianceReport:  # fmt: skip
    """Is attn(q, k, v, causal=True, kv_lens=None) invariant for the query at each position?

    q, k, v: (B, H, L, D), one full sequence per batch row. `split_size` and `block`: where
    the kernel under test cuts the keys (its splits, its inner key blocks), so that the KV
    lengths tried sit on either side of every cut (`lengths` overrides them). For each length
    n, the query at position n - 1 is compared (against the full causal prefill over all L
    positions) when computed as: a prefill of the first n positions, one decoding step over n
    keys, one decoding step over a padded cache of L keys with kv_lens = n, chunked prefills
    ending at n, and a decoding step in a padded batch with `company` other sequences of
    other lengths.
    """
    B, H, L, D = q.shape
    report = InvarianceReport()
    full = attn(q, k, v, causal=True)
    lengths = lengths or split_boundary_lengths(split_size, L, block)
    rng = random.Random(seed)
    for n in lengths:
        want = full[:, :, n - 1 : n]
        prefix = attn(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True)
        report.compare(f"prefill of {n}", prefix, full[:, :, :n])
        step = attn(q[:, :, n - 1 : n], k[:, :, :n], v[:, :, :n], causal=True)
        report.compare(f"decode at length {n}", step, want)
        padded = attn(q[:, :, n - 1 : n], k, v, causal=True, kv_lens=[n] * B)
        report.compare(f"decode at length {n} in a cache padded to {L}", padded, want)
        for c in chunks:
            if c <= n:
                part = attn(q[:, :, n - c : n], k[:, :, :n], v[:, :, :n], causal=True)
                report.compare(f"chunk of {c} ending at {n}", part, full[:, :, n - c : n])
        if company:
            lens = [rng.randint(1, L) for _ in range(company + 1)]
            at = rng.randrange(company + 1)
            lens[at] = n
            seqs = [rng.randrange(B) for _ in range(company + 1)]
            seqs[at] = 0
            pick = torch.tensor(seqs, device=q.device)
            qs = torch.stack([q[s, :, m - 1] for s, m in zip(seqs, lens, strict=True)])[:, :, None]
            batch = attn(qs, k[pick], v[pick], causal=True, kv_lens=lens)
            report.compare(
                f"decode at length {n} in a padded batch of {company + 1} (lengths {lens})",
                batch[at : at + 1],
                want[:1],
            )
    return report
