"""Each tuning script in scripts/ run once, `python scripts/<name>.py --tiny`, on a CPU: its real
logic at tiny sizes under the interpreter, so that a change to a kernel module cannot break a
script unseen.

The script runs as __main__ with its own argv, in a fresh interpreter with the checkout on
PYTHONPATH and no GPU visible. A few lines run first (RUNNER) and count the calls to the
course's timers (`kernels.bench`) and checker (`kernels.check`), whatever the script prints:
a run that exits 0 having timed or checked nothing (a --help, an early return) fails here.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["tune_fusion", "tune_matmul", "tune_attention", "tune_invariant_matmul"]

RUNNER = """
import atexit, runpy, sys
import kernels
from kernels import bench, check

calls = {"timed": 0, "checked": 0}

def counted(module, name, kind):
    original = getattr(module, name)
    def call(*args, **kwargs):
        calls[kind] += 1
        return original(*args, **kwargs)
    setattr(module, name, call)

for name in ("time_ms", "graph_ms", "cpu_us_per_call", "loop_us"):
    counted(bench, name, "timed")
for name in ("compare", "against_fp64", "relative_error"):
    counted(check, name, "checked")
atexit.register(lambda: print(f"[course calls] timed={calls['timed']} checked={calls['checked']}"))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_every_script_is_run_here():
    assert sorted(SCRIPTS) == sorted(p.stem for p in (REPO / "scripts").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_tiny_on_a_cpu(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    script = REPO / "scripts" / f"{name}.py"
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), "--tiny"],
        cwd=tmp_path,  # the scripts run from anywhere
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    shown = f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, shown
    assert "usage:" not in out.stdout, shown
    counts = re.search(r"\[course calls\] timed=(\d+) checked=(\d+)", out.stdout)
    assert counts, shown
    timed, checked = map(int, counts.groups())
    assert checked > 0, f"{name} --tiny checked nothing against a reference\n{shown}"
    assert timed > 0, f"{name} --tiny timed nothing through kernels.bench\n{shown}"
