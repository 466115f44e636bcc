"""Which of the course's two modes this process runs in.

GPU mode: a CUDA device is present; Triton compiles kernels for it.
CPU mode: no GPU (laptops, CI); Triton's interpreter runs kernels on CPU tensors.

The interpreter is chosen by TRITON_INTERPRET, which Triton reads when `@triton.jit`
decorates a function, so this module must be imported before any kernel module is:
`import kernels` does that.
"""

import contextlib
import os
import sys
import warnings

import torch

ON_GPU: bool = torch.cuda.is_available()

if not ON_GPU:
    if "TRITON_INTERPRET" not in os.environ and "triton" in sys.modules:
        warnings.warn(
            "triton was imported before kernels, so Triton's own helpers (tl.sum, tl.max, ...) "
            "were built for a GPU and fail under the interpreter: restart, import kernels first",
            stacklevel=2,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE: torch.device = torch.device("cuda" if ON_GPU else "cpu")


def _dependent_launch() -> bool:
    """Whether the decode kernels use programmatic dependent launch (Hopper and later, compiled
    kernels; KERNELS_PDL=0 turns it off): see kernels.primitives.wait_for_previous."""
    if not ON_GPU or INTERPRET or os.environ.get("KERNELS_PDL", "1") in ("", "0"):
        return False
    return torch.cuda.get_device_capability()[0] >= 9


# Read at each launch (kernels.split_k, kernels.decode, kernels.norm, the split-KV attention):
# setting kernels.runtime.PDL = False turns it off for the launches after.
PDL: bool = _dependent_launch()


@contextlib.contextmanager
def dependent_launch(on: bool):
    """The launches inside the block with dependent launch (`on`, where this GPU and
    KERNELS_PDL allow it) or without; PDL as it was after. A CUDA graph keeps what its capture
    used, so time both by capturing inside the block."""
    global PDL
    if not isinstance(on, bool):
        raise TypeError(f"dependent_launch(on) takes True or False, got {on!r}")
    saved, PDL = PDL, on and _dependent_launch()
    try:
        yield PDL
    finally:
        PDL = saved


def _interpreter_scalars_as_index() -> None:
    """Triton's interpreter before 3.7 turns a scalar argument into a Python int (a loop bound:
    `range(0, K, BLOCK_K)`) with int() of a one-element array, which numpy 2.4 and later refuse
    ("only 0-dimensional arrays can be converted to Python scalars", triton-lang/triton#9171).
    Where the installed interpreter has that conversion, give it the one later versions use."""
    import inspect

    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    try:
        fixed = original is None or "squeeze" in inspect.getsource(original)
    except (OSError, TypeError):
        fixed = True
    if fixed:
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


if INTERPRET:
    from . import bounds

    _interpreter_scalars_as_index()
    bounds.install()  # an access past a tensor: a clear error, not a crash (kernels.bounds)


def pick(cpu, gpu):
    """Return `gpu` on a GPU machine and `cpu` otherwise: problem sizes, repeat counts."""
    return gpu if ON_GPU else cpu


def device_name() -> str:
    """The GPU's name ("NVIDIA H200"), or "cpu"."""
    return torch.cuda.get_device_name() if ON_GPU else "cpu"


def processors() -> int:
    """The number of processors a library tries to fill: the GPU's SM count (132 on an H200);
    on a CPU, a fixed 16, so that CPU results do not depend on the machine."""
    return torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 16


def versions() -> dict:
    """The versions that decide what a kernel does and how fast, written beside every number."""
    import platform

    import numpy
    import triton

    info = {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "mode": "interpret" if INTERPRET else "compile",
    }
    if ON_GPU:
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver_version()
    return info


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"
