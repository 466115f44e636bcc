"""What a task is, and how the grader judges one child's report on it.

A lab module lists its tasks. The grader draws each task's cases (inputs and references,
in its own process), the child runs the learner's function on the inputs, and `evaluate`
decides, case by case, in this order: did the child report at all; were forbidden torch
ops called; were the inputs left alone; is the output a stale result from an earlier call;
was a kernel launched where one is asked for, and did torch compute nothing beside it; is
the output memory a kernel was given, in the right shape and dtype, with every element
written; are the values right (`Task.check`, or the case's own check, through
`kernels.check`); and last, when every case passed, do the cases agree with each other
(`Task.check_group`, for checks across the cases of a group).
"""

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import check
from kernels.runtime import DEVICE

# Torch calls a launcher needs to check, allocate and launch, and nothing that computes.
LAUNCHER_OPS = frozenset(
    {
        "__format__", "__len__", "__repr__", "__str__", "contiguous", "data_ptr", "detach",
        "device", "dim", "dtype", "element_size", "empty", "empty_like", "empty_strided",
        "fill_", "flatten", "is_contiguous", "is_cpu", "is_cuda", "is_floating_point", "layout",
        "ndim", "ndimension", "new_empty", "new_zeros", "numel", "requires_grad", "reshape",
        "shape", "size", "storage_offset", "stride", "view", "view_as", "zeros", "zeros_like",
    }
)  # fmt: skip

# The defences of a task whose answer is a Triton kernel and its launcher: a kernel of the
# learner's own must run, the launcher may only allocate and launch, new memory is NaN-filled.
KERNEL_DEFENCES = {"kernel": True, "launcher_ops": LAUNCHER_OPS, "poison": True}


@dataclass
class Case:
    args: tuple
    label: str  # how a failure names the case: "shape (4097,), float16, seed 123"
    expected: object = None  # the reference, computed by the grader; never sent to the child
    dtype: torch.dtype | None = None  # the output's expected dtype
    kwargs: dict = field(default_factory=dict)
    action: str = "call"  # or "time": the child times the call, and torch's `timed_against`;
    # "ranks" / "ranks_time": the call on each of two ranks (kernels.grader.ranks)
    timed_against: str = "copy"  # torch's op timed beside it: "copy" (of args[0]) or "matmul"
    baseline: torch.Tensor | None = None  # torch's own result in the inputs' dtype, if compared
    check: Callable | None = None  # this case's own check (a timed case's), else the task's
    group: object = None  # the key of the cases that `Task.check_group` checks together

    def for_child(self) -> dict:
        return {
            "args": list(self.args),
            "kwargs": self.kwargs,
            "action": self.action,
            "timed_against": self.timed_against,
        }


@dataclass(frozen=True)
class Timing:
    """What the child measured for a timed case: the call, and torch's `baseline` op beside it
    (the child reports these three keys; `read` takes nothing else)."""

    ms: float
    baseline_ms: float
    baseline: str  # "copy" or "matmul"

    @classmethod
    def read(cls, report) -> "Timing | None":
        """The child's report as a Timing, or None when it is not one (missing, malformed)."""
        try:
            timing = cls(float(report["ms"]), float(report["baseline_ms"]), report["baseline"])
        except (KeyError, TypeError, ValueError):
            return None
        ok = timing.ms > 0 and timing.baseline_ms > 0 and isinstance(timing.baseline, str)
        return timing if ok else None


@dataclass(frozen=True)
class Task:
    name: str
    function: str  # the learner's function that the task calls
    points: int
    summary: str  # what is checked, in a line
    hint: str  # shown with a wrong value
    cases: Callable[[random.Random], list]
    check: Callable[[Case, object], str | None]  # None when the output is right
    # After every case passed: (index of a case, problem) for checks across cases, or None
    check_group: Callable[[list, list], tuple | None] | None = None
    kernel: bool = False  # must launch a Triton kernel, written by the learner
    launcher_ops: frozenset | None = None  # torch ops allowed outside kernels (None: any)
    forbidden_ops: frozenset = frozenset()  # torch ops that are the task itself
    forbidden_names: frozenset = frozenset()  # names the source may not use
    # why a forbidden name earns nothing, where not "this lab asks you to write it yourself"
    forbidden_reasons: dict = field(default_factory=dict, hash=False, compare=False)
    poison: bool = False  # allocations are NaN-filled during the call
    needs_gpu: bool = False
    gpus: int = 0  # GPUs the task needs (2 for a tensor-parallel timing); fewer: not graded here
    exclusive: bool = False  # runs alone (timing)
    time_limit: float = 60.0


def kernel_task(**fields) -> Task:
    """A task whose answer is a Triton kernel and its launcher: KERNEL_DEFENCES apply."""
    return Task(**KERNEL_DEFENCES, **fields)


@dataclass
class Outcome:
    status: str  # "passed", "failed", "needs_gpu"
    points: int
    message: str


def failed(message: str, hint: str = "") -> Outcome:
    return Outcome("failed", 0, f"{message}. Hint: {hint}" if hint else message)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"its shape changed from {tuple(a.shape)} to {tuple(b.shape)}"
    diff = (a != b) & ~(a.isnan() & b.isnan()) if a.is_floating_point() else a != b
    index = tuple(int(i) for i in diff.nonzero()[0])
    return f"index {index} changed from {a[index].item():.6g} to {b[index].item():.6g}"


def _modified_input(case: Case, after) -> str | None:
    before = [*case.args, *case.kwargs.values()]
    if not isinstance(after, list) or len(after) != len(before):
        return "the call's inputs did not come back"
    for position, (old, new) in enumerate(zip(before, after, strict=True), start=1):
        if isinstance(old, torch.Tensor):
            if not isinstance(new, torch.Tensor) or new.dtype != old.dtype:
                return f"modified its input {position}: it is no longer a {old.dtype} tensor"
            if new.shape != old.shape or not torch.equal(new, old):
                return f"modified its input {position}: {_first_difference(old, new)}"
    return None


def _cached(cases, outputs, i) -> tuple | None:
    """An output equal, bit for bit, to an earlier call's, though the references differ."""
    out, ref = outputs[i], cases[i].expected
    for j in range(i):
        earlier, earlier_ref = outputs[j], cases[j].expected
        if (
            isinstance(earlier, torch.Tensor)
            and earlier.shape == out.shape
            and earlier.dtype == out.dtype
            and torch.equal(earlier, out)
            and not torch.equal(earlier_ref, ref)
        ):
            return (
                f"returned exactly what the call on other data [{cases[j].label}] returned: "
                "a result cached across calls",
                "compute from the inputs on every call",
            )
    return None


def _tensor_problem(task: Task, case: Case, out) -> tuple | None:
    ref = case.expected
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, expected a tensor", "return the output tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return f"returned shape {tuple(out.shape)}, expected {tuple(ref.shape)}", task.hint
    dtype = case.dtype or ref.dtype
    if out.dtype != dtype:
        return f"returned {out.dtype} for {dtype} input", "return a tensor of the input's dtype"
    if task.poison and out.is_floating_point():
        unwritten = check.unwritten(out) & ref.isfinite()
        if unwritten.any():
            index = tuple(int(k) for k in unwritten.nonzero()[0])
            return (
                f"{int(unwritten.sum())} of {out.numel()} output elements were never written: "
                f"they still hold the NaN the grader filled new memory with (first at index "
                f"{index})",
                "launch enough programs to cover every element and mask the last block",
            )
    return None


def _case_problem(task: Task, cases, reports, outputs, i) -> tuple | None:
    case, got, out = cases[i], reports[i], outputs[i]
    check_case = case.check or task.check
    if case.action in ("time", "ranks_time"):
        problem = check_case(case, Timing.read(got.get("timing")))
        return (problem, task.hint) if problem else None
    ops = set(got.get("ops", []))
    forbidden = sorted(ops & task.forbidden_ops)
    if forbidden:
        return (
            f"called torch's {', '.join(forbidden)}, the op this task asks you to write",
            "compute it in your own kernel",
        )
    modified = _modified_input(case, got.get("inputs_after"))
    if modified:
        return modified, "write the result to a new tensor; never store into an input"
    tensor_task = isinstance(case.expected, torch.Tensor)
    cached = _cached(cases, outputs, i) if tensor_task and isinstance(out, torch.Tensor) else None
    if cached:
        return cached
    if task.kernel and not got.get("launches"):
        return (
            "launched no Triton kernel of your own: this task asks for one (the course's "
            "kernels do not count)",
            "launch your @triton.jit kernel from the function: kernel[grid](...)",
        )
    if task.launcher_ops is not None and ops - task.launcher_ops:
        return (
            f"computed with torch outside a kernel ({', '.join(sorted(ops - task.launcher_ops))})",
            "do the arithmetic in your @triton.jit kernel; the launcher only checks, allocates "
            "and launches",
        )
    if tensor_task:
        if task.kernel and isinstance(out, torch.Tensor) and not got.get("from_kernel"):
            return (
                "returned a tensor that was not given to any kernel launch",
                "return the output tensor your kernel wrote",
            )
        if got.get("device") not in (None, DEVICE.type):
            return f"returned a tensor on {got.get('device')}", f"return it on {DEVICE.type}"
        problem = _tensor_problem(task, case, out)
        if problem:
            return problem
    problem = check_case(case, out)
    return (problem, task.hint) if problem else None


def _context(phase, cases) -> str:
    """Where a child stopped, from its last progress line: loading, or which case."""
    if phase in ("", "start", "load"):
        return "while loading your graded cells"
    match = re.fullmatch(r"case (\d+)", str(phase))
    if match and int(match.group(1)) < len(cases):
        return f"[{cases[int(match.group(1))].label}]"
    return "after the last case"


def error_message(error: dict, cases, where) -> str:
    """One line for an exception the child caught, pointing at the learner's own line."""
    context = _context(error.get("phase", ""), cases)
    line = error.get("line")
    line = f" at {where(line)}" if isinstance(line, int) else ""
    kind, kind_name = error.get("kind"), error.get("type", "an exception")
    message = str(error.get("message", ""))
    if kind == "not_implemented":
        detail = f": {message}" if message else ""
        return f"not implemented yet{detail}{line}"
    if kind == "exit":
        return f"your code called exit() ({kind_name}){line} {context}: an exit is not a pass"
    text = f"{kind_name}: {message}{line} {context}"
    if "illegal memory access" in message:
        text += ". Hint: an out-of-bounds load or store; check your masks"
    return text


def run_problem(run, cases, where) -> str | None:
    """Why a child's run leaves nothing to judge case by case (a crash, a hang, an exit, an
    exception, no result), or None; `where(line)` names a learner's line."""
    if run.failure:
        line = f" at {where(run.crash_line)}" if run.crash_line else ""
        return f"{run.failure}{line} {_context(run.phase, cases)}"
    result = run.result
    if not isinstance(result, dict) or not isinstance(result.get("cases"), list):
        return "returned no result"
    if result.get("error"):
        error = result["error"]
        return error_message(error, cases, where) if isinstance(error, dict) else "failed"
    return None


def evaluate(task: Task, cases, run, where) -> Outcome:
    """The verdict on one task from the child's run; `where(line)` names a learner's line."""
    problem = run_problem(run, cases, where)
    if problem:
        return failed(problem)
    result = run.result
    reports = result["cases"]
    if len(reports) != len(cases) or not all(isinstance(r, dict) for r in reports):
        return failed(f"returned results for {len(reports)} of {len(cases)} cases")
    outputs = [r.get("output") for r in reports]
    for i, case in enumerate(cases):
        problem = _case_problem(task, cases, reports, outputs, i)
        if problem:
            message, hint = problem
            return failed(f"{message} [{case.label}]", hint)
    if task.check_group:
        across = task.check_group(cases, outputs)
        if across:
            i, message = across
            return failed(f"{message} [{cases[i].label}]", task.hint)
    return Outcome("passed", task.points, f"{len(cases)} cases")
