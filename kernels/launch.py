"""A lighter launch path: `launch(kernel, grid, *args, **kwargs)` does what
`kernel[grid](*args, **kwargs)` does, for less host time once a kernel has been compiled.

`kernel[grid](...)` is a Python function in Triton that binds the arguments, computes their
specialization, looks the compiled kernel up and only then calls the C launcher: about 18 us
of host time per call on an H200's host (triton 3.6), against 8 us for the C launcher alone and
10 us for torch's own `x + y` with its allocation. A call from Python whose kernel runs for
a few microseconds is overhead-bound (Chapter 1), so the course remembers, per kernel and per
specialization, the compiled kernel that Triton's own first call returned, and calls its
launcher directly afterwards.

The key holds everything Triton specializes a kernel on, and more, so a cached kernel is only
reused for arguments Triton would have compiled the same way: per tensor its dtype and whether
its address is 16-byte aligned; every other argument by value (integers, whose being 1 or a
multiple of 16 Triton specializes on, constexprs, launch options); the device. So each new
shape pays for one call through Triton's path first. Anything but tensors, numbers, strings
and None (a tensor descriptor, say), the interpreter, a grid given as a function, or a launch
hook being set (kernels.bench.launches() reads each launch's metadata) takes Triton's path.
"""

import torch
import triton
from triton import knobs

from kernels.runtime import INTERPRET


def _hooked() -> bool:
    """Whether a launch hook is set: then Triton's own path, which calls it. Triton 3.6 and later
    keep a chain of hooks that is never None: an empty chain is no hook."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


_PLAIN = (int, float, bool, str, type(None))
_compiled = {}  # (kernel, device, argument keys) -> (compiled kernel, keyword argument names)
_MAX_ENTRIES = 4096  # shapes seen; past this the cache starts again (a bound, not a tuning)


def _key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) in _PLAIN:
        return type(value), value  # the type: True == 1, but Triton treats them apart
    raise _Unsupported


class _Unsupported(Exception):
    pass


def launch(kernel: triton.JITFunction, grid: tuple, *args, **kwargs):
    """kernel[grid](*args, **kwargs), through a cached compiled kernel when it is safe."""
    if INTERPRET or callable(grid) or _hooked():
        return kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    try:
        key = (kernel, device, *map(_key, args), *((k, _key(v)) for k, v in kwargs.items()))
    except _Unsupported:
        return kernel[grid](*args, **kwargs)
    entry = _compiled.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        names = kernel.arg_names[len(args) :]
        if all(n in kwargs for n in names):  # else a default fills in: keep Triton's path
            if len(_compiled) >= _MAX_ENTRIES:
                _compiled.clear()
            _compiled[key] = (compiled, names)
        return compiled
    compiled, names = entry
    values = (*args, *(kwargs[n] for n in names))
    grid = (*grid, 1, 1)
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(
        grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
        None, None, None, *values,
    )  # fmt: skip
    return compiled
