import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from kernels import bench, runtime

# What a fresh process reports about its mode: every name the chapters and the grader branch on.
REPORT_MODE = (
    "import json, os, kernels, kernels.runtime as r;"
    "print(json.dumps({'on_gpu': r.ON_GPU, 'interpret': r.INTERPRET, 'device': str(r.DEVICE),"
    " 'env': os.environ.get('TRITON_INTERPRET'), 'pick': r.pick(cpu='cpu', gpu='gpu'),"
    " 'name': r.device_name(), 'processors': r.processors(), 'mode': r.versions()['mode'],"
    " 'top': (kernels.ON_GPU, kernels.INTERPRET, str(kernels.DEVICE))}))"
)


def _run(code, **env_changes):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out


def _mode(**env_changes) -> dict:
    return json.loads(_run(REPORT_MODE, **env_changes).stdout.splitlines()[-1])


def test_without_a_gpu_the_process_runs_in_cpu_mode():
    # CUDA hidden (on a GPU machine too): the interpreter, CPU tensors, the CPU's values
    mode = _mode(CUDA_VISIBLE_DEVICES="")
    assert mode == {
        "on_gpu": False,
        "interpret": True,
        "device": "cpu",
        "env": "1",
        "pick": "cpu",
        "name": "cpu",
        "processors": 16,
        "mode": "interpret",
        "top": [False, True, "cpu"],  # the package's face says the same
    }


@pytest.mark.gpu
def test_with_a_gpu_the_process_compiles_for_it():
    mode = _mode()
    assert mode["on_gpu"] and not mode["interpret"] and mode["env"] is None
    assert mode["device"] == "cuda" and mode["pick"] == "gpu" and mode["mode"] == "compile"
    assert mode["name"].startswith("NVIDIA") and mode["processors"] >= 16
    # TRITON_INTERPRET set by hand on a GPU machine is honoured (doctor warns about it)
    forced = _mode(TRITON_INTERPRET="1")
    assert forced["on_gpu"] and forced["interpret"] and forced["mode"] == "interpret"


def test_interpreter_is_set_before_any_kernel_is_defined():
    # A fresh process that imports a kernel module first must still get the right mode.
    code = (
        "import torch, kernels.elementwise as e, kernels.runtime as r;"
        "x = torch.ones(5, device=r.DEVICE);"
        "print(e.add(x, x).sum().item(), r.INTERPRET)"
    )
    for hide_cuda in ({"CUDA_VISIBLE_DEVICES": ""}, {}):
        out = _run(code, **hide_cuda)
        assert out.stdout.split()[0] == "10.0"
        assert out.stdout.split()[1] == str(bool(hide_cuda) or not runtime.ON_GPU)


def test_importing_triton_first_on_a_cpu_is_flagged():
    out = _run("import triton, kernels", CUDA_VISIBLE_DEVICES="")
    assert "import kernels first" in out.stderr
    assert "import kernels first" not in _run("import kernels, triton").stderr
    as_is = _run("import triton, kernels").stderr  # a GPU compiles: the order does not matter
    assert ("import kernels first" in as_is) == (not runtime.ON_GPU)


def test_versions_has_what_the_recorders_write_and_bench_reads():
    info = runtime.versions()
    json.dumps(info)  # written beside every recorded number
    assert all(isinstance(v, str) and v for v in info.values()), info
    for library in ("torch", "triton", "numpy", "python"):
        assert re.match(r"\d+\.\d+", info[library]), (library, info[library])
    assert info["mode"] == ("interpret" if runtime.INTERPRET else "compile")
    assert ("cuda" in info and "driver" in info) == runtime.ON_GPU
    described = bench.describe({**info, "date": "today"})
    assert described == f"{info['device']}, torch {info['torch']}, triton {info['triton']}, today"


def test_recorded_results_carry_the_keys_versions_gives_on_a_gpu():
    paths = sorted(bench.DATA_DIR.glob("*/*.json"))
    assert paths, f"no recorded results in {bench.DATA_DIR}"
    on_gpu = set(runtime.versions()) | {"cuda", "driver", "date"}
    for path in paths:
        meta = json.loads(path.read_text())["meta"]
        assert set(meta) == on_gpu, f"{path.name}: {sorted(meta)} != {sorted(on_gpu)}"
        assert meta["mode"] == "compile" and meta["device"].startswith("NVIDIA"), path.name


@pytest.mark.skipif(not runtime.INTERPRET, reason="checks Triton's interpreter (CPU mode)")
def test_the_interpreter_takes_a_scalar_argument_as_a_loop_bound():
    """Older interpreters turned a scalar into an int with int() of a one-element array, which
    numpy 2.4 refuses: runtime gives them the conversion later versions use."""
    from triton.runtime import interpreter

    class Scope:  # what the interpreter's patch scope does: set attributes, remember them
        def __init__(self):
            self.set = {}

        def set_attr(self, obj, name, value):
            self.set[name] = value

    scope = Scope()
    interpreter._patch_lang_tensor(type("T", (), {}), scope)
    handle = type("Handle", (), {"data": np.array([7], dtype=np.int32)})()
    assert scope.set["__index__"](type("Scalar", (), {"handle": handle})()) == 7


def test_dependent_launch_is_off_on_a_cpu_and_with_kernels_pdl_0():
    code = "import kernels.runtime as r; print(r.PDL)"
    assert _run(code, CUDA_VISIBLE_DEVICES="").stdout.split()[-1] == "False"
    assert _run(code, KERNELS_PDL="0").stdout.split()[-1] == "False"


def test_dependent_launch_block_sets_pdl_and_puts_it_back():
    saved = runtime.PDL
    with runtime.dependent_launch(False) as on:
        assert on is False and runtime.PDL is False
    assert runtime.PDL == saved
    with pytest.raises(RuntimeError), runtime.dependent_launch(True) as on:
        assert runtime.PDL == on == runtime._dependent_launch()  # never on where it cannot be
        raise RuntimeError("inside")
    assert runtime.PDL == saved
    with pytest.raises(TypeError, match="True or False"), runtime.dependent_launch(1):
        pass


@pytest.mark.gpu
def test_dependent_launch_is_on_from_hopper():
    import torch

    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert runtime.PDL == hopper
