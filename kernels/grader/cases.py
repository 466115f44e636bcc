"""The case kit every lab draws from: inputs, labels, value and speed checks, the standard loop.

A lab declares its tasks with these pieces instead of writing them again:
- `draw`, `tensor`, `strided`: fresh values on the CPU (the grader's process), and a truly
  strided view of them;
- `label`, `dtype_name`: how a failure names its case ("shape (33, 65), non-contiguous,
  float16, seed 123");
- `numbers`, `value`, `values`: checks of returned numbers, or of tensors through
  `kernels.check`'s tolerance table;
- `timed`, `big_random`, `speed`: a case the child times against torch, on an input
  it makes itself from a small description, and the one check of its speed;
- `standard`: odd shapes x dtypes, the same shape again with fresh data, then a strided view.
"""

import math
from collections.abc import Callable

import torch

from kernels import check
from kernels.grader.tasks import Case, Timing


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_seed(rng) -> int:
    return rng.randrange(2**31)


def log_uniform(rng, lo: float, hi: float) -> float:
    """A positive number spread evenly over the decades from lo to hi."""
    return 10 ** rng.uniform(math.log10(lo), math.log10(hi))


def tensor(shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """`check.random_tensor` in the grader's process (the child moves inputs to its device)."""
    return check.random_tensor(shape, dtype, seed=seed, device="cpu", scale=scale)


def draw(rng, shape, dtype=torch.float32, scale: float = 1.0) -> tuple[torch.Tensor, int]:
    """Fresh values of `shape` and the seed that draws them again."""
    seed = new_seed(rng)
    return tensor(shape, seed, dtype, scale), seed


def strided(x: torch.Tensor) -> torch.Tensor:
    """x's values in a truly strided view: every other element along the last dim of a tensor
    twice as wide, zeros in between. A transposed view is still dense (flat indexing of its
    memory meets every element once); this one is not: flat indexing reads the zeros."""
    base = x.new_zeros((*x.shape[:-1], 2 * x.shape[-1]))
    base[..., ::2] = x
    return base[..., ::2]


def label(x: torch.Tensor, dtype: torch.dtype, seed: int, extra: str = "") -> str:
    """'shape (33, 65), non-contiguous, float16, repeat 8, seed 123' (`extra` after the dtype)."""
    kind = ", non-contiguous" if not x.is_contiguous() else ""
    return f"shape {tuple(x.shape)}{kind}, {dtype_name(dtype)}{extra}, seed {seed}"


def _number_problem(got, want, name: str) -> str | None:
    if isinstance(want, str):
        return None if got == want else f"returned {name} {got!r:.40}, expected {want!r}"
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"returned {name} = {got!r:.40}, expected a number"
    if not math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0):
        return f"returned {name} = {got:.6g}, expected {want:.6g}"
    return None


def numbers(names) -> Callable:
    """A check of a returned list of numbers (or words) against `case.expected`, by name."""

    def check_numbers(case: Case, out) -> str | None:
        expected = case.expected
        if not isinstance(out, list) or len(out) != len(expected):
            return f"returned {out!r:.80}, expected {len(expected)} values: {', '.join(names)}"
        for got, want, name in zip(out, expected, names, strict=True):
            problem = _number_problem(got, want, name)
            if problem:
                return problem
        return None

    return check_numbers


def value(name: str) -> Callable:
    """A check of one returned number (or word) against `case.expected[0]`."""
    one = numbers((name,))
    return lambda case, out: one(case, [out])


def values(op: str) -> Callable:
    """A check of a returned tensor against `case.expected` with the tolerance of `op` in
    `kernels.check`, and the "at most twice torch's error" rule where the case has a baseline."""

    def check_values(case: Case, out) -> str | None:
        result = check.compare(out, case.expected, op=op, dtype=case.dtype, baseline=case.baseline)
        return None if result.ok else f"wrong values: {result.message}"

    return check_values


# What the child times a call against: torch doing the same job, or the least of it.
BASELINES = {
    "copy": "torch copying the same tensor",
    "matmul": "torch.matmul (cuBLAS)",
    "kv": "torch copying k and v",
    "attention": "torch's causal scaled_dot_product_attention",
    "dense_weight": "torch's linear (cuBLAS) with the weight in x's dtype",
    "one_gpu": "the whole MLP on one GPU",
}


def speed(min_fraction: float, why: str, rate: Callable[[float], str] | None = None) -> Callable:
    """The check of a timed case: at least `min_fraction` of torch's speed, `why` saying why
    that is within reach; `rate(ms)` adds a rate to the message ("123 TFLOP/s")."""

    def check_speed(case: Case, timing: Timing | None) -> str | None:
        if timing is None:
            return "no timing came back"
        fraction = timing.baseline_ms / timing.ms
        if fraction >= min_fraction:
            return None
        shown = f" ({rate(timing.ms)})" if rate else ""
        return (
            f"took {timing.ms:.3f} ms{shown}, {fraction:.0%} of the speed of "
            f"{BASELINES[timing.baseline]} ({timing.baseline_ms:.3f} ms); {why}, so "
            f"{min_fraction:.0%} of it earns the points"
        )

    return check_speed


def big_random(rng, shape, dtype: torch.dtype) -> dict:
    """A timed input too large to send: the child makes it from this (`make_big_random`)."""
    return {"random": tuple(shape), "dtype": dtype, "seed": new_seed(rng)}


def is_big_random(value) -> bool:
    return isinstance(value, dict) and set(value) == {"random", "dtype", "seed"}


def make_big_random(spec: dict, device) -> torch.Tensor:
    return check.random_tensor(spec["random"], spec["dtype"], seed=spec["seed"], device=device)


def timed(
    args: tuple, label: str, *, against: str, min_fraction: float, why: str, rate=None
) -> Case:
    """A case the child times (its call against torch's `against`), checked by `speed`."""
    if against not in BASELINES:
        raise ValueError(f"unknown baseline {against!r}: one of {', '.join(BASELINES)}")
    return Case(
        args,
        label=label,
        action="time",
        timed_against=against,
        check=speed(min_fraction, why, rate),
    )


def standard(make: Callable, specs, dtypes, rng, *, again, strided_spec, extra=()) -> list:
    """A kernel task's standard cases, per dtype: `make(rng, spec, dtype)` for each spec; `again`
    once more with fresh data (a result cached across calls shows; None: no repeat); each
    (spec, options) of `extra` as `make(rng, spec, dtype, **options)`; and `strided_spec` as a
    truly strided view, `make(rng, spec, dtype, strided=True)`."""
    cases = []
    for dtype in dtypes:
        cases += [make(rng, spec, dtype) for spec in specs]
        if again is not None:
            cases.append(make(rng, again, dtype))
        cases += [make(rng, spec, dtype, **options) for spec, options in extra]
        cases.append(make(rng, strided_spec, dtype, strided=True))
    return cases


def tensor_form(name: str, got, shape, dtype) -> str | None:
    """What is wrong with a returned tensor's type, shape or dtype (None: nothing), for a task
    that returns more than one tensor, each named in the message (fp32_tuple_problem's
    tensors, Lab 1's persistent and Lab 3's split-K pairs)."""
    if not isinstance(got, torch.Tensor):
        return f"returned {name} as {type(got).__name__}, expected a tensor"
    if tuple(got.shape) != tuple(shape):
        return f"returned {name} of shape {tuple(got.shape)}, expected {tuple(shape)}"
    if got.dtype != dtype:
        return f"returned {name} as {got.dtype}, expected {dtype}"
    return None


def fp32_tuple_problem(out, expected, names, op: str = "reduction") -> str | None:
    """What is wrong with `out`, a task's tuple of fp32 tensors named `names` (an online
    softmax's running state, say), against `expected`: its form, each tensor's shape and
    dtype, then its values (the fp32 tolerance of the op class `op`). None when it is right."""
    if not isinstance(out, (list, tuple)) or len(out) != len(names):
        return f"returned {type(out).__name__}, expected a tuple ({', '.join(names)})"
    for got, want, name in zip(out, expected, names, strict=True):
        problem = tensor_form(name, got, want.shape, torch.float32)
        if problem:
            return problem
        result = check.compare(got, want, op=op, dtype=torch.float32)
        if not result.ok:
            return f"wrong {name}: {result.message}"
    return None
