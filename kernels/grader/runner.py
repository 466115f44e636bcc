"""Running one child process: a time limit, a cap on its output, and nothing taken on trust.

The child (`kernels.grader.child`) runs in its own session so that a hang, a crash or a
flood of output is killed with everything it started. Its time limit counts from the moment
it reports "start" (after torch and triton are imported, before the learner's code loads),
so a slow machine does not eat the learner's time. What comes back is the result file,
loaded with `weights_only=True`; no file means no result, whatever the exit status.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

STARTUP_LIMIT_S = 300.0  # importing torch and triton, before any learner code runs
OUTPUT_CAP_BYTES = 1_000_000
RESULT_CAP_BYTES = 512 * 2**20
_KEEP = 4000  # characters of output kept from the start and from the end


@dataclass
class ChildRun:
    result: dict | None  # the child's report, loaded safely; None when there is none
    failure: str | None  # why there is no usable result
    phase: str  # the last progress line: "start", "case 3", "done", or "" (never started)
    output: str  # the beginning and the end of what it printed
    crash_line: int | None = None  # the learner's line in a crash's Python stack, if printed


def child_command(jobdir) -> list:
    return [sys.executable, "-m", "kernels.grader.child", str(jobdir)]


class _Capture(threading.Thread):
    """Reads the child's output as it comes: keeps its head and tail, notes a flood."""

    def __init__(self, stream, cap):
        super().__init__(daemon=True)
        self.stream, self.cap = stream, cap
        self.head, self.tail, self.total = b"", b"", 0

    def run(self):
        for chunk in iter(lambda: self.stream.read1(65536), b""):
            self.total += len(chunk)
            if len(self.head) < _KEEP:
                self.head += chunk[: _KEEP - len(self.head)]
            self.tail = (self.tail + chunk)[-_KEEP:]

    @property
    def flooded(self) -> bool:
        return self.total > self.cap

    def text(self) -> str:
        if self.total <= _KEEP:
            return self.head.decode(errors="replace")
        if self.total <= 2 * _KEEP:
            return (self.head + self.tail[len(self.head) - self.total :]).decode(errors="replace")
        return (self.head + b"\n[...]\n" + self.tail).decode(errors="replace")


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


_ACTIVE, _ACTIVE_LOCK = set(), threading.Lock()


def _kill_group(proc):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def kill_all():
    """Stop every child still running (the grader was interrupted)."""
    with _ACTIVE_LOCK:
        for proc in _ACTIVE:
            _kill_group(proc)


def _environment() -> dict:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # so the child imports this kernels
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_child(
    command,
    jobdir,
    time_limit: float,
    startup_limit: float = STARTUP_LIMIT_S,
    output_cap: int = OUTPUT_CAP_BYTES,
) -> ChildRun:
    """Run `command` in `jobdir`, kill it past the limits, and read back its result file."""
    jobdir = Path(jobdir)
    progress, result_path = jobdir / "progress", jobdir / "result.pt"
    proc = subprocess.Popen(
        command,
        cwd=jobdir,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=_environment(),
    )
    with _ACTIVE_LOCK:
        _ACTIVE.add(proc)
    capture = _Capture(proc.stdout, output_cap)
    capture.start()
    begun, started, why = time.monotonic(), None, None
    while proc.poll() is None:
        now = time.monotonic()
        if started is None and progress.exists():
            started = now
        if capture.flooded:
            why = (
                f"printed more than {output_cap / 1e6:g} MB of output, so the grader stopped it "
                "(a print in a loop?)"
            )
        elif started is None and now - begun > startup_limit:
            why = f"the grader's child process did not start within {startup_limit:g} s"
        elif started is not None and now - started > time_limit:
            why = f"did not finish within {time_limit:g} s (an endless loop, or far too slow)"
        if why:
            break
        time.sleep(0.05)
    _kill_group(proc)  # also ends anything the learner's code left running
    proc.wait()
    with _ACTIVE_LOCK:
        _ACTIVE.discard(proc)
    capture.join(timeout=5)
    proc.stdout.close()
    output = capture.text()
    if capture.flooded and why is None:
        why = f"printed more than {output_cap / 1e6:g} MB of output (a print in a loop?)"
    phase = _last_line(progress)
    crash_line = _crash_line(output, jobdir / "submission.py")
    if why:
        return ChildRun(None, why, phase, output, crash_line)
    if not result_path.is_file():
        rc = proc.returncode
        if rc < 0:
            try:
                name = signal.Signals(-rc).name
            except ValueError:
                name = str(-rc)
            # not an out-of-bounds access: the interpreter stops those first (kernels.bounds),
            # and on a GPU they are CUDA errors; SIGKILL from outside is most often the OOM killer
            hint = "; out of memory?" if name == "SIGKILL" else ""
            why = f"crashed (signal {name}{hint})"
        else:
            why = f"exited with status {rc} before returning a result (exit() or os._exit?)"
        return ChildRun(None, why, phase, output, crash_line)
    if result_path.stat().st_size > RESULT_CAP_BYTES:
        return ChildRun(None, "returned a result too large to read", phase, output)
    try:
        result = torch.load(result_path, weights_only=True)
    except Exception as exc:  # whatever the child wrote, the grader only reads safe types
        return ChildRun(None, f"returned a result the grader cannot read ({exc})", phase, output)
    return ChildRun(result, None, phase, output)


def _crash_line(output: str, module: Path):
    """The learner's innermost line in a faulthandler stack (it lists the newest frame first)."""
    pattern = re.compile(r'File "' + re.escape(str(module)) + r'", line (\d+)')
    match = pattern.search(output)
    return int(match.group(1)) if match else None
