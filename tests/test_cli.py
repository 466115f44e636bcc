import json
import subprocess
import sys

import pytest

from kernels.runtime import ON_GPU


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "kernels", *args], capture_output=True, text=True, timeout=600
    )


def test_doctor_gives_a_verdict():
    out = run("doctor")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "triton" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("OK")


@pytest.mark.skipif(ON_GPU, reason="on a GPU, bench measures (make gpu-record runs it)")
def test_bench_on_cpu_explains_and_shows_recorded_results(tmp_path):
    target = tmp_path / "bench.json"
    out = run("bench", "--json", str(target))
    assert out.returncode == 0, out.stderr
    assert "No GPU here" in out.stdout and "Recorded results from NVIDIA" in out.stdout
    data = json.loads(target.read_text())  # the course ships its recorded run: written out too
    assert "NVIDIA" in data["meta"]["device"]
    assert {"copy_gbps", "matmul_tflops"} <= set(data["ceilings"])


def test_unknown_command_is_a_usage_error():
    out = run("frobnicate")
    assert out.returncode == 2 and "invalid choice" in out.stderr
