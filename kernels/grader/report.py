"""What the learner reads: one table per notebook, and the progress summary."""

SHORT = 110


def _points(task) -> str:
    if task["status"] == "needs_gpu":
        return f"-/{task['max_points']}"
    return f"{task['points']}/{task['max_points']}"


def gpu_points(report) -> int:
    return sum(t["max_points"] for t in report["tasks"] if t["status"] == "needs_gpu")


def table(report) -> str:
    """Task, points, status and, for anything not passed, the one line that says why."""
    width = max([len("task")] + [len(t["name"]) for t in report["tasks"]])
    lines = [
        f"{report['lab']}: {report['path']}",
        f"  {'task':<{width}}  {'points':>6}  {'status':<9}  details",
    ]
    for task in report["tasks"]:
        details = task["message"]
        if task["status"] == "passed":
            details = f"checked on {details}" if details else ""
        lines.append(
            f"  {task['name']:<{width}}  {_points(task):>6}  {task['status']:<9}  {details}"
        )
    score = f"  score {report['score']}/{report['max_score']}"
    if gpu_points(report):
        score += f" on this machine; {gpu_points(report)} more points are checked on a GPU"
    lines.append(score)
    return "\n".join(lines)


def progress(reports) -> str:
    """Every lab at a glance: a bar of points, and what remains, in a line per task."""
    lines = []
    width = max([len(r["lab"]) for r in reports] + [4])
    for r in reports:
        total = max(r["max_score"], 1)
        bar = "#" * round(20 * r["score"] / total)
        passed = sum(t["status"] == "passed" for t in r["tasks"])
        ran = sum(t["status"] != "needs_gpu" for t in r["tasks"])
        lines.append(
            f"{r['lab']:<{width}}  [{bar:<20}] {r['score']:>2}/{r['max_score']:<2} points, "
            f"{passed}/{ran} tasks passed"
        )
        for task in r["tasks"]:
            if task["status"] == "passed":
                continue
            mark = "~" if task["status"] == "needs_gpu" else "-"
            message = task["message"]
            if len(message) > SHORT:
                message = message[: SHORT - 3] + "..."
            lines.append(f"  {mark} {task['name']} ({_points(task)}): {message}")
    return "\n".join(lines)
