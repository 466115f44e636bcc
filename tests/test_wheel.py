"""The wheel is the course as a learner installs it without `-e`: it must hold every subpackage
and the recorded results, build without setuptools' warnings, and run `python -m kernels` from
outside the checkout.

The build runs on a copy of the checkout (setuptools writes build/ and kernels.egg-info/ into
the folder it builds), the install goes into a fresh virtual environment that reuses this
environment's packages through a plain path (so this environment's own .pth files, among them
the editable install of `kernels`, do not run there), with no index and no dependencies.
"""

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # about 15 s on 2 CPU cores: build, venv, install, doctor, grade

ROOT = Path(__file__).resolve().parents[1]
STARTER = ROOT / "labs" / "lab01_regimes.ipynb"
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "_build",
    "gpu-record",
    "test-artifacts",
)


def _env(**changes) -> dict:
    """This process's environment without what would import the checkout's kernels."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **changes)
    return env


def _run(command, cwd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(the wheel, the build's output)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, dist = tmp / "source", tmp / "dist"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    out = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--verbose", "--wheel-dir", dist, source],  # --verbose: the backend's own output
        cwd=tmp,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("kernels-*.whl")
    return wheel, out.stdout + out.stderr


def _site_folders() -> list[str]:
    """Where this environment's packages are (a venv's site-packages; a system python's
    dist-packages and the user's site too)."""
    folders = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    folders += site.getsitepackages()
    return folders + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])


def _editable_installs(folders) -> list[str]:
    return sorted(f.name for folder in folders for f in Path(folder).glob("__editable__*kernels*"))


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """(the fresh environment's python, its site-packages), with the wheel installed."""
    tmp = tmp_path_factory.mktemp("venv")
    out = _run([sys.executable, "-m", "venv", "--without-pip", tmp / "env"], cwd=tmp)
    assert out.returncode == 0, out.stderr
    python = tmp / "env" / "bin" / "python"
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([python, "-c", ask], cwd=tmp).stdout.strip())
    ours = [p for p in dict.fromkeys(_site_folders()) if Path(p).is_dir()]
    (site / "reused_test_environment.pth").write_text("\n".join(ours) + "\n")
    # torch comes from this environment; kernels (its editable finder) does not
    probe = (
        "import importlib.util, sys, torch;"
        "spec = importlib.util.find_spec('kernels');"
        "print(spec and spec.origin, [type(f).__name__ for f in sys.meta_path])"
    )
    out = _run([python, "-c", probe], cwd=tmp)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("None ") and "editable" not in out.stdout.lower(), out.stdout
    editable = _editable_installs(ours)
    install = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed"]
    out = _run(install + ["--no-compile", built[0]], cwd=tmp)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _editable_installs(ours) == editable, "the install touched this environment"
    return python, site


def test_wheel_holds_every_subpackage_and_the_recorded_data(built):
    names = set(zipfile.ZipFile(built[0]).namelist())
    packages = sorted(p.parent for p in (ROOT / "kernels").rglob("__init__.py"))
    subpackages = {p.relative_to(ROOT).as_posix() for p in packages[1:]}
    assert {"kernels/grader", "kernels/batch_invariant"} <= subpackages
    sources = [p for p in (ROOT / "kernels").rglob("*.py") if "__pycache__" not in p.parts]
    data = [p for p in (ROOT / "kernels" / "data").rglob("*") if p.suffix in (".json", ".txt")]
    assert any(p.match("data/h200/*.json") for p in data)
    missing = sorted({p.relative_to(ROOT).as_posix() for p in sources + data} - names)
    assert not missing, f"the wheel lacks {missing}"


def test_build_prints_no_setuptools_warning(built):
    log = built[1]
    assert "Created wheel for kernels" in log  # the backend's output was captured
    for sign in ("is absent from the `packages` configuration", "*" * 20, "Warning:"):
        assert sign not in log, (
            f"setuptools warned ({sign!r}):\n{log[log.find(sign) - 500 :][:2000]}"
        )


def test_installed_wheel_runs_doctor_and_grade_from_outside_the_checkout(venv, tmp_path):
    python, site = venv
    shutil.copy(STARTER, tmp_path / STARTER.name)
    where = _run([python, "-c", "import kernels.grader; print(kernels.__file__)"], cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    origin = Path(where.stdout.strip()).resolve()
    assert origin == (site / "kernels" / "__init__.py").resolve(), origin
    assert not origin.is_relative_to(ROOT)

    doctor = _run([python, "-m", "kernels", "doctor"], cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.strip().splitlines()[-1].startswith("OK"), doctor.stdout

    report = tmp_path / "report.json"
    grade = _run([python, "-m", "kernels", "grade", STARTER.name, "--json", report], cwd=tmp_path)
    assert grade.returncode in (0, 1), grade.stdout + grade.stderr  # 2: it could not grade
    assert "lab01_regimes" in grade.stdout and "score 0/" in grade.stdout, grade.stdout
    (lab,) = json.loads(report.read_text())
    assert lab["tasks"] and all(t["status"] in ("failed", "needs_gpu") for t in lab["tasks"])
