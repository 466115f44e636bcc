"""Grading notebooks: static checks first, then one load of the submission, then every task in
its own child process.

The submission is loaded once in a child of its own before any task runs: if its cells crash,
hang or exit while loading, every task fails at once with that one message, and the load's
time limit (`LOAD_LIMIT_S`, not a task's) is all it costs. Tasks run in parallel (threads that
each wait on one child); timing tasks run alone at the end.
"""

import json
import os
import random
import secrets
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels.bench import gpu_count
from kernels.grader import runner, static_checks, submission
from kernels.grader.labs import LABS
from kernels.grader.tasks import Outcome, evaluate, failed, run_problem
from kernels.runtime import ON_GPU

LOAD_LIMIT_S = 30.0  # loading graded cells defines functions: anything slower is a hang


@dataclass
class Notebook:
    submission: submission.Submission
    analysis: static_checks.Analysis
    tasks: list
    outcomes: dict = field(default_factory=dict)


class UnknownTask(Exception):
    """--task names a task this notebook's lab does not have."""


def tasks_to_grade(lab: str, only) -> list:
    """The lab's tasks, or those of them named in `only`; UnknownTask names the lab's tasks."""
    tasks = LABS[lab]
    unknown = sorted(set(only or ()) - {task.name for task in tasks})
    if unknown:
        raise UnknownTask(
            f"{lab} has no task named {', '.join(unknown)}; its tasks: "
            f"{', '.join(task.name for task in tasks)}"
        )
    return [task for task in tasks if not only or task.name in only]


def precheck(task, notebook) -> Outcome | None:
    """A verdict that needs no child process, or None."""
    if task.needs_gpu and not ON_GPU:
        return Outcome("needs_gpu", 0, "checked on a GPU; this machine has none")
    if task.gpus > gpu_count():
        return Outcome("needs_gpu", 0, f"checked on {task.gpus} GPUs; this machine has "
                       f"{gpu_count()}")  # fmt: skip
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
        why = task.forbidden_reasons.get(used[0], "which this lab asks you to write yourself")
        return failed(f"uses {used[0]} at {where(found.identifiers[used[0]])}, {why}")
    return None


def _start_job(notebook, jobdir: Path, function: str | None, cases, poison: bool, limit: float):
    """Write what the child reads: the learner's module, the inputs, and job.json."""
    jobdir.mkdir(parents=True)
    module = jobdir / "submission.py"
    module.write_text(notebook.submission.source)
    torch.save([case.for_child() for case in cases], jobdir / "inputs.pt")
    job = {
        "module": str(module),
        "function": function,
        "poison": poison,
        "hard_limit_s": runner.STARTUP_LIMIT_S + limit + 30,  # the child's own last resort
        "grader_pid": os.getpid(),
    }
    (jobdir / "job.json").write_text(json.dumps(job))


def load_problem(notebook, workdir: Path, time_limit, command) -> str | None:
    """Why the submission cannot even be loaded (a crash, a hang, an exit), or None."""
    limit = min(LOAD_LIMIT_S, time_limit or LOAD_LIMIT_S)
    jobdir = workdir / "_load"  # no task name starts with _
    _start_job(notebook, jobdir, None, [], False, limit)
    return run_problem(
        runner.run_child(command(jobdir), jobdir, limit), [], notebook.submission.where
    )


def _run_task(notebook, task, workdir, seed, time_limit, command):
    cases = task.cases(random.Random(f"{seed}:{task.name}"))
    limit = time_limit or task.time_limit
    jobdir = workdir / task.name
    _start_job(notebook, jobdir, task.function, cases, task.poison, limit)
    run = runner.run_child(command(jobdir), jobdir, limit)
    notebook.outcomes[task.name] = evaluate(task, cases, run, notebook.submission.where)


def _safely(work, notebook, tasks, *args):
    """`work(notebook, *args)`; a bug of the grader's own fails `tasks` and awards nothing."""
    try:
        return work(notebook, *args)
    except Exception as exc:
        message = f"grader error: {type(exc).__name__}: {exc}"
        for task in tasks:
            notebook.outcomes[task.name] = failed(message)
        return message


def summary(notebook) -> dict:
    """What `--json` writes for one notebook: its path and lab, the score and the most it
    could be here (tasks that need a GPU count in neither on a CPU), and per task its name,
    points, most points, status ("passed", "failed" or "needs_gpu") and message."""
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


def _read(paths, only):
    """(the notebooks to grade, one line per path that cannot be graded)."""
    notebooks, errors = [], []
    for path in paths:
        try:
            sub = submission.load(path, LABS)
            tasks = tasks_to_grade(sub.lab, only)
        except submission.NotALab as exc:
            errors.append(str(exc))
            continue
        except UnknownTask as exc:
            errors.append(f"{sub.path}: {exc}")
            continue
        notebooks.append(Notebook(sub, static_checks.analyse(sub), tasks))
    return notebooks, errors


def _in_parallel(work, items, workers) -> list:
    """`_safely(work, *item)` for each item, `workers` at a time."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            return list(pool.map(lambda item: _safely(work, *item), items))
        except KeyboardInterrupt:  # Ctrl-C: stop the children, not only the threads
            pool.shutdown(wait=False, cancel_futures=True)
            runner.kill_all()
            raise


def grade(paths, only=None, seed=None, time_limit=None, jobs=None, command=runner.child_command):
    """Grade notebooks: (one summary per notebook, lines on paths that could not be graded,
    seed). `only` names tasks; a notebook whose lab lacks one of them is not graded."""
    seed = secrets.randbelow(2**31) if seed is None else seed
    notebooks, errors = _read(paths, only)
    workers = jobs or min(8, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="kernels-grade-") as tmp:
        to_run = []  # (notebook, its folder, the tasks that need a child)
        for n, notebook in enumerate(notebooks):
            tasks = []
            for task in notebook.tasks:
                outcome = precheck(task, notebook)
                if outcome:
                    notebook.outcomes[task.name] = outcome
                else:
                    tasks.append(task)
            if tasks:
                to_run.append((notebook, Path(tmp) / str(n), tasks))
        loads = [(nb, tasks, folder, time_limit, command) for nb, folder, tasks in to_run]
        problems = _in_parallel(load_problem, loads, workers)
        shared, alone = [], []
        for (notebook, folder, tasks), problem in zip(to_run, problems, strict=True):
            for task in tasks:
                if problem:  # one message for every task, found once
                    notebook.outcomes.setdefault(task.name, failed(problem))
                    continue
                work = (notebook, [task], task, folder, seed, time_limit, command)
                (alone if task.exclusive else shared).append(work)
        _in_parallel(_run_task, shared, workers)
        for work in alone:
            _safely(_run_task, *work)
    return [summary(nb) for nb in notebooks], errors, seed
