"""The child process: runs one task's cases on the learner's code and reports what it saw.

    python -m kernels.grader.child JOBDIR

JOBDIR holds job.json (the learner's module file, the function to call, the options) and
inputs.pt (the cases' inputs, drawn by the grader; never the expected outputs). A job with no
function and no cases only loads the module: the grader runs one per submission before its
tasks. The child writes progress lines ("start", "case 3", "done") and, at the end,
result.pt: per case the output, the inputs as they were after the call, the Triton kernels
launched and the torch ops called. The grader loads it with `weights_only=True`, compares
the outputs with its own references, and counts a missing result, an exit status or printed
text as nothing.
"""

import contextlib
import dataclasses
import faulthandler
import functools
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

MAX_OPS = 100


def op_name(func) -> str:
    """'matmul' for torch.matmul, Tensor.matmul and `@`; 'shape' for the property."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def learners(kernel) -> bool:
    """Whether a launched kernel was defined in the graded cells, not imported from kernels."""
    return getattr(getattr(kernel, "fn", None), "__module__", None) == "submission"


class Observer:
    """Counts launches of the learner's Triton kernels (wrapping the JIT launch path before the
    learner's code loads) and records the torch ops called outside kernel launches."""

    def __init__(self):
        self.launches, self.depth = 0, 0
        self.pointers, self.ops = set(), set()

    def reset(self):
        self.launches, self.pointers, self.ops = 0, set(), set()

    def install(self):
        from triton.runtime.jit import JITFunction

        classes = [JITFunction]
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        for cls in classes:
            cls.run = self._counting(cls.run)

    def _counting(self, run):
        observer = self

        def counted_run(kernel, *args, **kwargs):
            if kwargs.get("warmup"):
                return run(kernel, *args, **kwargs)
            observer.depth += 1  # torch calls made by Triton itself are not the learner's
            try:
                if learners(kernel):
                    observer.launches += 1
                    for value in (*args, *kwargs.values()):
                        if isinstance(value, torch.Tensor):
                            observer.pointers.add(value.untyped_storage().data_ptr())
                return run(kernel, *args, **kwargs)
            finally:
                observer.depth -= 1

        return counted_run

    def wrote(self, out) -> bool:
        """Whether `out`'s memory was handed to a kernel launch."""
        return isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in self.pointers

    def recording(self):
        return _OpLog(self)


class _OpLog(TorchFunctionMode):
    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.observer.depth == 0 and len(self.observer.ops) < MAX_OPS:
            self.observer.ops.add(op_name(func))
        return func(*args, **(kwargs or {}))


def plain(value, depth=0):
    """The learner's return value as types the grader can load safely (weights_only)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if type(tensor) is not torch.Tensor:
            tensor = tensor.as_subclass(torch.Tensor)
        return tensor.cpu()
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (list, tuple)) and depth < 3 and len(value) <= 10_000:
        return [plain(v, depth + 1) for v in value]
    try:
        import numbers

        if isinstance(value, numbers.Number):
            return float(value)
    except Exception:  # a number that cannot be a float is reported as unsupported
        pass
    return {"unsupported": type(value).__name__}


def describe(exc: BaseException, module_path: str, phase: str) -> dict:
    """An exception as the grader reports it: the learner's own line, not Triton's."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    line = None
    for e in reversed(chain):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == module_path]
        if frames:
            line = frames[-1].lineno
            break
    not_implemented = [e for e in chain if isinstance(e, NotImplementedError)]
    shown = not_implemented[0] if not_implemented else chain[-1]
    if isinstance(exc, SystemExit):
        kind = "exit"
    elif not_implemented:
        kind = "not_implemented"
    else:
        kind = "exception"
    message = " ".join(str(shown).split())
    return {
        "kind": kind,
        "type": type(shown).__name__,
        "message": message[:400],
        "line": line,
        "phase": phase,
    }


def _on_device(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device` with its strides kept: `Tensor.to` would make a strided view contiguous."""
    if t.device == torch.device(device):
        return t
    moved = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return moved.copy_(t)


def _materialize(value, device):
    from kernels.grader import cases

    if cases.is_big_random(value):  # a large input made here, for timing
        return cases.make_big_random(value, device)
    if isinstance(value, dict) and str(value.get("builder", "")).startswith("kernels.grader."):
        module, name = value["builder"].split(":")  # an object the grader describes, made here
        return vars(importlib.import_module(module))[name](**value["kwargs"])
    if isinstance(value, torch.Tensor):
        return _on_device(value, device)
    return value


# What a timed call is measured against: torch doing the same job (or the least of it). Each
# maps the case's inputs to the call that is timed; what it needs first (a weight in another
# dtype) is made before the clock starts.
TIMED_AGAINST = {
    "copy": lambda args: args[0].clone,
    "matmul": lambda args: functools.partial(torch.matmul, args[0], args[1]),
    "kv": lambda args: lambda: (args[1].clone(), args[2].clone()),
    "attention": lambda args: functools.partial(
        torch.nn.functional.scaled_dot_product_attention, *args[:3], is_causal=True
    ),
    "dense_weight": lambda args: functools.partial(
        torch.nn.functional.linear, args[0], args[1].to(args[0].dtype)
    ),
}


def _time_case(fn, args, kwargs, against="copy") -> dict:
    from kernels.bench import time_ms
    from kernels.grader.tasks import Timing

    ms = time_ms(fn, *args, **kwargs)
    baseline_ms = time_ms(TIMED_AGAINST[against](args))
    return dataclasses.asdict(Timing(ms, baseline_ms, against))


_OPERATORS = {}  # what each learner's make_<op>() returned: an operator registers once


def _operator_case(make, args) -> dict:
    """make() (the learner's, called once) must return a registered operator: torch.library.
    opcheck on the case's inputs (schema, fake kernel, dispatch), then one call under
    torch.compile(fullgraph=True), whose output the grader checks. A failure raises, with
    opcheck's or Dynamo's own message."""
    if id(make) not in _OPERATORS:
        _OPERATORS[id(make)] = make()
    fn = _OPERATORS[id(make)]
    if not isinstance(fn, (torch._library.custom_ops.CustomOpDef, torch._ops.OpOverloadPacket,
                           torch._ops.OpOverload)):  # fmt: skip
        raise TypeError(
            f"expected an operator registered with torch.library.custom_op, got a "
            f"{type(fn).__name__}: decorate the function with @torch.library.custom_op"
        )
    torch.library.opcheck(fn, tuple(args))
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True, backend="aot_eager")
    return compiled(*args)


def run_case(fn, case, job, observer) -> dict:
    from kernels.check import poisoned_allocations
    from kernels.runtime import DEVICE, ON_GPU

    if case.get("action") in ("ranks", "ranks_time"):  # the learner's function on each rank
        from kernels.grader import ranks

        return ranks.run_case(job, case, job.get("hard_limit_s", 600), _load, plain)
    args = [_materialize(a, DEVICE) for a in case["args"]]
    kwargs = {k: _materialize(v, DEVICE) for k, v in case.get("kwargs", {}).items()}
    if case.get("action") == "time":
        return {"timing": _time_case(fn, args, kwargs, case.get("timed_against", "copy"))}
    observer.reset()
    poison = poisoned_allocations() if job.get("poison") else contextlib.nullcontext()
    if case.get("action") == "operator":  # outside the op log: Dynamo traces under no mode
        out = _operator_case(fn, args)
    else:
        with poison, observer.recording():
            out = fn(*args, **kwargs)
    if ON_GPU:
        torch.cuda.synchronize()  # asynchronous errors (illegal addresses) belong to this case
    return {
        "output": plain(out),
        "device": out.device.type if isinstance(out, torch.Tensor) else None,
        "inputs_after": [plain(a) for a in args] + [plain(v) for v in kwargs.values()],
        "launches": observer.launches,
        "ops": sorted(observer.ops),
        "from_kernel": observer.wrote(out),
    }


def _load(module_path: str):
    spec = importlib.util.spec_from_file_location("submission", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["submission"] = module
    spec.loader.exec_module(module)
    return module


def _watchdog(hard_limit_s: float, grader_pid: int | None) -> None:
    """End this process when the grader is gone (killed, interrupted) or far past its limit,
    whatever the learner's code is doing: no orphan outlives the grader."""
    import signal
    import threading
    import time

    if hasattr(signal, "alarm"):
        signal.alarm(max(1, int(hard_limit_s)))  # SIGALRM's default action ends the process
    parent = grader_pid or os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main(jobdir: Path) -> None:
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file
    faulthandler.enable()  # a crash prints the Python stack: the grader finds the line in it
    job = json.loads((jobdir / "job.json").read_text())
    _watchdog(job.get("hard_limit_s", 3600), job.get("grader_pid"))
    progress = os.open(jobdir / "progress", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    mark = lambda text: os.write(progress, (text + "\n").encode())

    import kernels  # noqa: F401  (fixes the mode before the learner's kernels are defined)

    observer = Observer()
    observer.install()
    cases = torch.load(jobdir / "inputs.pt", weights_only=True)
    result = {"cases": [], "error": None}
    mark("start")  # the learner's time limit counts from here
    try:
        module = _load(job["module"])
        fn = vars(module).get(job["function"]) if job["function"] else None
        if job["function"] and not callable(fn):
            raise NameError(f"your graded cells define no function {job['function']}")
    except BaseException as exc:  # anything the learner's module does while loading
        result["error"] = describe(exc, job["module"], "load")
        cases = []
    job["cases"] = cases  # a task run on several ranks runs all its cases at once
    for i, case in enumerate(cases):
        mark(f"case {i}")
        try:
            result["cases"].append(run_case(fn, case, job, observer))
        except BaseException as exc:  # SystemExit included: an exit is a failure, not a pass
            result["error"] = describe(exc, job["module"], f"case {i}")
            break
    tmp = jobdir / "result.tmp"
    torch.save(result, tmp)
    os.replace(tmp, jobdir / "result.pt")
    mark("done")
    sys.stdout.flush()
    os._exit(0)  # no atexit handlers, no waiting on threads the learner may have left behind


if __name__ == "__main__":
    main(Path(sys.argv[1]))
