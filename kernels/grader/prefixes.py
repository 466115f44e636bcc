"""Batch invariance as the grader checks it: a group of calls on the full batch X and on its
prefixes X[:B], each later output equal to the full one's first B rows bit for bit (Chapter 5's
harness compares them). Labs 5's matmul and decoding tasks draw their cases as such groups."""

from dataclasses import dataclass

from kernels.batch_invariant.harness import InvarianceReport
from kernels.grader.tasks import Case


@dataclass
class PrefixCase(Case):
    """One call in a group (`Case.group`): the group's first case is the full batch X; each
    later one is X[:batch], whose output must equal the first one's [:batch] bit for bit."""

    batch: int | None = None  # None for the full batch


def prefix_group(x, rest, label, expected_fn, dtype, sizes):
    """The full batch x, then x[:b] for each b in sizes; the label is the group's key (it names
    the seed, so two groups with one label hold the same data)."""
    full = PrefixCase(
        (x, *rest),
        label=f"{label}, full batch of {x.shape[0]}",
        expected=expected_fn(x),
        dtype=dtype,
        group=label,
    )
    return [full] + [
        PrefixCase(
            (x[:b], *rest),
            label=f"{label}, first {b} rows",
            expected=expected_fn(x[:b]),
            dtype=dtype,
            group=label,
            batch=b,
        )
        for b in sizes
    ]


def prefix_sizes(bmax, rng, extra=()):
    sizes = {1, 2, 3, bmax - 1, rng.randint(4, bmax - 2), *extra}
    return sorted(b for b in sizes if 1 <= b < bmax)


def check_prefixes(drawn, outputs) -> tuple | None:
    """(index, problem) of the first f(X[:B]) that is not f(X)[:B] bit for bit, or None. Runs
    once every output is right, so each is a tensor of the expected shape and dtype."""
    full = {}
    for case, out in zip(drawn, outputs, strict=True):
        if isinstance(case, PrefixCase) and case.batch is None:
            full[case.group] = out
    for i, (case, out) in enumerate(zip(drawn, outputs, strict=True)):
        if not isinstance(case, PrefixCase) or case.batch is None:
            continue  # a full batch, or a timed case
        report = InvarianceReport()
        report.compare(f"B={case.batch}", out, full[case.group][: case.batch])
        if not report.ok:
            return i, (
                f"not batch-invariant: f(X[:{case.batch}]) differs from f(X)[:{case.batch}] "
                f"(max |diff| {report.max_abs_diff:.3g}, {report.max_ulp} ULP)"
            )
    return None
