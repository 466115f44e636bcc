"""The grader's commands: `grade`, `progress`, and `labs` (regenerate the starters).

A learner grades with `make grade LAB=labs/<lab>.ipynb` from the course's folder: it needs no
activated environment (JupyterLab started by `make lab` has none), and is the command the labs,
the book's lab pages and `progress` print (`grading_command`).
"""

import json
import sys
from pathlib import Path

GRADE_COMMAND = "make grade LAB={path}"


def grading_command(path) -> str:
    """The one command that grades the lab at `path`, from the course's folder."""
    return GRADE_COMMAND.format(path=path)


def add_commands(sub) -> None:
    p = sub.add_parser("grade", help="grade lab notebooks (each task in its own process)")
    p.add_argument("paths", nargs="+", help="notebooks: a learner's labs/labNN_*.ipynb, or many")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument("--task", action="append", metavar="NAME", help="grade only this task")
    p.add_argument("--seed", type=int, help="draw the same inputs as an earlier run")
    p.add_argument("--time-limit", type=float, metavar="S", help="seconds per task")
    p.add_argument("--jobs", type=int, help="tasks run at once (default: CPU count, up to 8)")
    sub.add_parser("progress", help="every lab in labs/: score and what remains")
    p = sub.add_parser("labs", help="regenerate labs/ from solutions/")
    p.add_argument("--check", action="store_true", help="only say whether labs/ is up to date")


def grade_command(args) -> int:
    from kernels.grader import grade, report

    try:
        reports, errors, seed = grade.grade(
            args.paths, only=args.task, seed=args.seed, time_limit=args.time_limit, jobs=args.jobs
        )
    except KeyboardInterrupt:
        print("interrupted: nothing graded")
        return 130
    if reports:
        print(f"Inputs drawn with seed {seed} (--seed {seed} draws the same ones again).\n")
    for r in reports:
        print(report.table(r) + "\n")
    for error in errors:
        print(f"cannot grade {error}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1) + "\n")
        print(f"wrote {args.json}")
    if errors:
        return 2
    return 0 if all(t["status"] != "failed" for r in reports for t in r["tasks"]) else 1


def _labs_folder() -> Path:
    here = Path("labs")
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "labs"


def progress_command(_args) -> int:
    from kernels.grader import grade, report

    folder = _labs_folder()
    paths = sorted(folder.glob("lab*.ipynb"))
    if not paths:
        print(f"no labs found in {folder}")
        return 2
    reports, errors, _ = grade.grade(paths)
    print(f"Your labs ({folder}):")
    print(report.progress(reports))
    for error in errors:
        print(f"cannot grade {error}", file=sys.stderr)
    print(f"\nDetails, from the course's folder: {grading_command(f'{folder}/<lab>.ipynb')}")
    return 2 if errors else 0


def labs_command(args) -> int:
    from kernels.grader import starters

    if not Path("solutions").is_dir():
        print("run this from the course's root folder (no solutions/ here)")
        return 2
    changed = starters.generate(check_only=args.check)
    if args.check:
        for path in changed:
            print(f"{path} is out of date: run `python -m kernels labs`")
        if not changed:
            print("labs/ is up to date")
        return 1 if changed else 0
    for path in changed:
        print(f"wrote {path}")
    if not changed:
        print("labs/ is up to date")
    return 0


HANDLERS = {"grade": grade_command, "progress": progress_command, "labs": labs_command}
