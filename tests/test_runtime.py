import os
import subprocess
import sys

import torch

from kernels import runtime


def test_mode_matches_the_machine():
    assert runtime.ON_GPU == torch.cuda.is_available()
    assert runtime.DEVICE.type == ("cuda" if runtime.ON_GPU else "cpu")
    if not runtime.ON_GPU:
        assert runtime.INTERPRET and os.environ["TRITON_INTERPRET"] == "1"


def test_pick_returns_the_value_for_this_mode():
    assert runtime.pick(cpu=1, gpu=2) == (2 if runtime.ON_GPU else 1)


def test_interpreter_is_set_before_any_kernel_is_defined():
    # A fresh process that imports a kernel module first must still get the right mode.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, kernels.elementwise as e, kernels.runtime as r;"
        "x = torch.ones(5, device=r.DEVICE);"
        "print(e.add(x, x).sum().item(), r.INTERPRET)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "10.0"
    assert out.stdout.split()[1] == str(not runtime.ON_GPU)


def test_versions_names_device_and_libraries():
    info = runtime.versions()
    assert info["device"] == runtime.device_name()
    assert info["torch"] == torch.__version__
    assert info["mode"] in ("interpret", "compile")


def test_importing_triton_first_on_a_cpu_is_flagged():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import triton, kernels"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert ("import kernels first" in out.stderr) == (not runtime.ON_GPU)
