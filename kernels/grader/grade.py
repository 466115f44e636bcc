"""Grading notebooks: static checks first, then every task in its own child process.

Tasks run in parallel (threads that each wait on one child); timing tasks run alone at the
end. A submission whose cells crash, hang or exit while loading fails every task with that
message: once one task has seen it, the others do not wait for it again.
"""

import json
import os
import random
import secrets
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.grader import cells, runner, static
from kernels.grader.labs import LABS
from kernels.grader.tasks import Outcome, evaluate, failed
from kernels.runtime import ON_GPU


@dataclass
class Notebook:
    submission: cells.Submission
    analysis: static.Analysis
    tasks: list
    outcomes: dict = field(default_factory=dict)
    load_failure: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def precheck(task, notebook) -> Outcome | None:
    """A verdict that needs no child process, or None."""
    if task.needs_gpu and not ON_GPU:
        return Outcome("needs_gpu", 0, "checked on a GPU; this machine has none")
    found, where = notebook.analysis, notebook.submission.where
    if found.problems:
        more = f" (and {len(found.problems) - 1} more)" if len(found.problems) > 1 else ""
        return failed(found.problems[0] + more)
    if task.function not in found.defined:
        return failed(
            f"your graded cells define no function {task.function}",
            "keep the starter's function names, in cells tagged graded",
        )
    if task.function in found.stubs:
        which = f" ({task.function})" if task.function != task.name else ""
        hint = found.stubs[task.function]
        return failed(f"not implemented yet{which}" + (f": {hint}" if hint else ""))
    if task.kernel and found.kernel_problems:
        return failed(found.kernel_problems[0])
    used = sorted(name for name in task.forbidden_names if name in found.identifiers)
    if used:
        return failed(
            f"uses {used[0]} at {where(found.identifiers[used[0]])}, which this lab asks you "
            "to write yourself"
        )
    return None


def _run_task(notebook, task, workdir, seed, time_limit, command):
    with notebook.lock:
        if notebook.load_failure:
            notebook.outcomes[task.name] = failed(notebook.load_failure)
            return
    jobdir = workdir / task.name
    jobdir.mkdir(parents=True)
    module = jobdir / "submission.py"
    module.write_text(notebook.submission.source)
    cases = task.cases(random.Random(f"{seed}:{task.name}"))
    torch.save([case.for_child() for case in cases], jobdir / "inputs.pt")
    limit = time_limit or task.time_limit
    job = {
        "module": str(module),
        "function": task.function,
        "poison": task.poison,
        "hard_limit_s": runner.STARTUP_LIMIT_S + limit + 30,  # the child's own last resort
        "grader_pid": os.getpid(),
    }
    (jobdir / "job.json").write_text(json.dumps(job))
    run = runner.run_child(command(jobdir), jobdir, limit)
    outcome = evaluate(task, cases, run, notebook.submission.where)
    error = run.result.get("error") if isinstance(run.result, dict) else None
    loading_error = isinstance(error, dict) and error.get("phase") == "load"
    while_loading = loading_error or (run.failure and run.phase in ("", "start"))
    with notebook.lock:
        notebook.outcomes[task.name] = outcome
        if while_loading and outcome.status == "failed":
            notebook.load_failure = outcome.message


def _safely(run_task, notebook, task, *args):
    try:
        run_task(notebook, task, *args)
    except Exception as exc:  # a bug of the grader's own: report it, award nothing
        notebook.outcomes[task.name] = failed(f"grader error: {type(exc).__name__}: {exc}")


def report(notebook) -> dict:
    """The DESIGN's JSON object for one notebook."""
    tasks, score, max_score = [], 0, 0
    for task in notebook.tasks:
        outcome = notebook.outcomes[task.name]
        tasks.append(
            {
                "name": task.name,
                "points": outcome.points,
                "max_points": task.points,
                "status": outcome.status,
                "message": outcome.message,
            }
        )
        if outcome.status != "needs_gpu":
            score, max_score = score + outcome.points, max_score + task.points
    sub = notebook.submission
    return {
        "path": str(sub.path),
        "lab": sub.lab,
        "score": score,
        "max_score": max_score,
        "tasks": tasks,
    }


def grade(paths, only=None, seed=None, time_limit=None, jobs=None, command=runner.child_command):
    """Grade notebooks: (one report per notebook, paths that could not be graded, seed)."""
    seed = secrets.randbelow(2**31) if seed is None else seed
    notebooks, errors = [], []
    for path in paths:
        try:
            sub = cells.load(path, LABS)
        except cells.NotALab as exc:
            errors.append(str(exc))
            continue
        tasks = [t for t in LABS[sub.lab] if not only or t.name in only]
        notebooks.append(Notebook(sub, static.analyse(sub), tasks))
    with tempfile.TemporaryDirectory(prefix="kernels-grade-") as tmp:
        shared, alone = [], []
        for n, notebook in enumerate(notebooks):
            for task in notebook.tasks:
                outcome = precheck(task, notebook)
                if outcome:
                    notebook.outcomes[task.name] = outcome
                else:
                    work = (notebook, task, Path(tmp) / str(n), seed, time_limit, command)
                    (alone if task.exclusive else shared).append(work)
        workers = jobs or min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            try:
                list(pool.map(lambda work: _safely(_run_task, *work), shared))
            except KeyboardInterrupt:  # Ctrl-C: stop the children, not only the threads
                pool.shutdown(wait=False, cancel_futures=True)
                runner.kill_all()
                raise
        for work in alone:
            _safely(_run_task, *work)
    return [report(nb) for nb in notebooks], errors, seed
