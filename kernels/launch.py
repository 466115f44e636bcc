"""A lighter launch path: a `Launcher` does what `kernel[grid](*args, **kwargs)` does, for less
host time once the kernel has been compiled.

`kernel[grid](...)` is Python in Triton that binds the arguments, computes their
specialization, looks the compiled kernel up and only then calls the C launcher: 18.6 us
of host time per call on an H200's host (triton 3.6, Chapter 1's recording of 2026-12-03),
against 13.2 us for torch's own `x + y` with its allocation. A call whose kernel runs for a
few microseconds is overhead-bound (Chapter 1), so a Launcher keeps, per key, the compiled
kernel that Triton's own first call returned, and launches it directly afterwards.

The key comes from the call site: a short tuple of values it has at hand anyway. It must
hold everything Triton specializes the kernel on, so that one key never stands for two
compiled kernels:
- per tensor argument, its dtype and whether its address is a multiple of 16 (`aligned`;
  tensors the call site allocated itself always are);
- per integer argument, whether it is 1, a multiple of 16 or wider than 32 bits (`int_class`);
- every constexpr and launch option (num_warps, ...) by value.
`launch(kernel, grid, *args, **kwargs)` builds such a key from every argument, for call sites
that do not care about the last microsecond.

Which path a launch takes:
1. Triton's own, `kernel[grid](...)`: the first launch under a key; every launch while a
   launch hook is set (kernels.bench.launches() reads each launch's metadata); a grid given as
   a function. Under the interpreter there is no compiled kernel, so every launch takes it,
   but the keys are still recorded (and checked under VERIFY), as on a GPU.
2. The compiled kernel's C launcher, called with the argument layout of the installed Triton
   (3.6 and 3.9 are known; `_direct` reads which from the launcher's own signature).
3. The compiled kernel's `run` (Triton's Python wrapper around its C launcher), when the
   layout is not one of those, or the kernel needs scratch memory per launch.

VERIFY (the environment variable KERNELS_VERIFY_LAUNCH=1, or `kernels.launch.VERIFY = True`)
checks every launch under a known key: that Triton specializes its arguments as it did the
first time (a Python mirror, `specialization`), and on a GPU that Triton's own lookup finds
the very kernel the Launcher kept. A key that misses something raises, naming the kernel.
"""

import inspect
import os

import torch
from triton import knobs

from kernels.runtime import INTERPRET

VERIFY: bool = os.environ.get("KERNELS_VERIFY_LAUNCH", "0") not in ("", "0")
MAX_KEYS = 4096  # keys kept per kernel; past this its cache starts again (a bound, not a tuning)
# torch's current device and stream, looked up once (a CPU build of torch has neither)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b): triton.cdiv's value, in plain Python. Triton's helpers can also be called
    inside kernels, and from Python each call goes through a wrapper that unwraps every
    argument: several function calls per launch that a hot path does not need."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, and 0 for 0: triton.next_power_of_2's value,
    in plain Python (see cdiv)."""
    return 1 << (n - 1).bit_length() if n else 0


def aligned(t: torch.Tensor) -> bool:
    """Whether t's address is a multiple of 16 bytes, which Triton specializes pointers on."""
    return t.data_ptr() % 16 == 0


def int_class(n: int) -> int:
    """What Triton specializes an integer argument on, as one small int: 1 for the value 1
    (compiled in as a constant), 16 for a multiple of 16, 0 otherwise; plus 64 for a value
    that needs 64 bits (128 past 2**63, unsigned)."""
    width = 0 if -(2**31) <= n < 2**31 else 64 if n < 2**63 else 128
    return width + (1 if n == 1 else 16 if n % 16 == 0 else 0)


def hooked() -> bool:
    """Whether a launch hook is set: then Triton's own path, which calls it. Triton 3.6 and
    later keep a chain of hooks that is never None: an empty chain is no hook."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """One kernel's launches: `launcher(key, grid, *args, **kwargs)` is
    `kernel[grid](*args, **kwargs)` for a key that the call site makes (see the module)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.constexprs = _constexpr_names(kernel)
        self.entries = {}  # (device, key) -> _Entry; under the interpreter (None, key) -> its spec

    def __call__(self, key, grid, *args, **kwargs):
        if INTERPRET:
            return self._interpret(key, grid, args, kwargs)
        device = _current_device()
        entry = self.entries.get((device, key))
        if entry is None or hooked() or callable(grid):
            return self._first(device, key, grid, args, kwargs)
        if VERIFY:
            self._verify(entry, key, grid, args, kwargs)
        values = args + tuple([kwargs[name] for name in entry.names]) if entry.names else args
        entry.launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     _current_stream(device), values)  # fmt: skip
        return entry.compiled

    def launch_kept(self, key, grid, *args) -> bool:
        """Launch under `key` with no keywords to pass: those of the key's first launch, when
        every one of them was a constexpr or a launch option (which the key fixes, by the
        module's rule). True when launched; False, having launched nothing, where the full
        call is needed: no kernel kept under the key, a launch hook, VERIFY, the interpreter.
        For call sites whose keywords cost more to build than the launch's lookup."""
        if INTERPRET or VERIFY:
            return False
        device = _current_device()
        entry = self.entries.get((device, key))
        if entry is None or entry.constants is None or hooked() or callable(grid):
            return False
        entry.launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     _current_stream(device), args + entry.constants)  # fmt: skip
        return True

    def _first(self, device, key, grid, args, kwargs):
        """Triton's own path; keep what it compiled when it may be launched directly later."""
        compiled = self.kernel[grid](*args, **kwargs)
        names = self.kernel.arg_names[len(args) :]
        if compiled is None or hooked() or callable(grid):
            return compiled
        if not all(name in kwargs for name in names):  # a default fills in: Triton's path
            return compiled
        try:
            launch = _direct(compiled)
        except AttributeError:  # a compiled kernel unlike 3.6's and 3.9's: Triton's path
            return compiled
        if len(self.entries) >= MAX_KEYS:
            self.entries.clear()
        spec = specialization(self, args, kwargs)
        constants = tuple(kwargs[n] for n in names) if self.constexprs.issuperset(names) else None
        self.entries[(device, key)] = _Entry(compiled, tuple(names), launch, spec, constants)
        return compiled

    def _interpret(self, key, grid, args, kwargs):
        """The interpreter has no compiled kernel: Triton's path, with the key recorded (and
        checked under VERIFY) as on a GPU."""
        spec = self.entries.get((None, key))
        if spec is None:
            if len(self.entries) >= MAX_KEYS:
                self.entries.clear()
            self.entries[(None, key)] = specialization(self, args, kwargs)
        elif VERIFY:
            _check_same(self, key, spec, specialization(self, args, kwargs))
        return self.kernel[grid](*args, **kwargs)

    def _verify(self, entry, key, grid, args, kwargs):
        _check_same(self, key, entry.spec, specialization(self, args, kwargs))
        expected = self.kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if expected is not entry.compiled:
            raise AssertionError(
                f"{self.name}: key {key!r} launches a kernel that Triton did not choose for "
                "these arguments"
            )

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__


class _Entry:
    """A kept kernel: what Triton compiled, the names of the arguments passed by keyword, its
    launch function, the specialization (for VERIFY) and, when every keyword was a constexpr,
    their values (for launch_kept)."""

    __slots__ = ("compiled", "names", "launch", "spec", "constants")

    def __init__(self, compiled, names, launch, spec, constants=None):
        self.compiled, self.names, self.launch, self.spec = compiled, names, launch, spec
        self.constants = constants


def _check_same(launcher, key, first, now):
    if now != first:
        raise AssertionError(
            f"{launcher.name}: key {key!r} was first made for arguments Triton specializes as "
            f"{first}, now for {now}: the key misses something Triton compiles for"
        )


def _constexpr_names(kernel) -> frozenset:
    parameters = inspect.signature(kernel.fn).parameters.values()
    return frozenset(p.name for p in parameters if "constexpr" in str(p.annotation))


def specialization(launcher: Launcher, args, kwargs) -> tuple:
    """A Python mirror of what Triton compiles a launch for: per tensor its dtype and
    alignment, per integer its int_class, floats by type, constexprs, strings, None and launch
    options by value. VERIFY compares it between launches under one key."""
    names = launcher.kernel.arg_names
    out = []
    for name, value in (*zip(names, args, strict=False), *sorted(kwargs.items())):
        if isinstance(value, torch.Tensor):
            out.append((value.dtype, aligned(value)))
        elif name in launcher.constexprs or name not in names:
            out.append(value if _plain(value) else type(value))
        elif type(value) is int:
            out.append(int_class(value))
        else:
            out.append(type(value))
    return tuple(out)


def _plain(value) -> bool:
    return isinstance(value, (*_PLAIN, torch.dtype))


def _direct(compiled):
    """A function (grid x, y, z, stream, argument values) that launches `compiled` through
    its C launcher, with the layout of the installed Triton; else through its `run`."""
    run = compiled.run
    function, metadata = compiled.function, compiled.packed_metadata
    scratch = getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
    c_launch = getattr(run, "launch", None)
    layout = _layout(run)
    if layout and not scratch and not getattr(run, "gsan_enabled", False) and c_launch:
        cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
        if layout == "3.6":  # scratch buffers, then metadata, then the arguments, flat

            def launch(x, y, z, stream, values):
                c_launch(x, y, z, stream, function, cooperative, pdl, None, None, metadata,
                         None, None, None, *values)  # fmt: skip

            return launch
        annotations, signature = run.arg_annotations, run.kernel_signature

        def launch(x, y, z, stream, values):  # 3.9: metadata, then scratch, then a tuple
            c_launch(x, y, z, stream, function, cooperative, pdl, metadata, None, None, None,
                     None, None, annotations, signature, values)  # fmt: skip

        return launch

    def launch(x, y, z, stream, values):
        run(x, y, z, stream, function, metadata, None, None, None, *values)

    return launch


# The parameters of Triton's CudaLauncher.__call__, which passes them on to its C launcher
# in the layout named; the C launcher's own arguments are checked by reading those lines of
# triton/backends/nvidia/driver.py in each version.
_LAYOUTS = {
    ("gridX", "gridY", "gridZ", "stream", "function", "args"): "3.6",
    ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
     "launch_enter_hook", "launch_exit_hook", "args"): "3.9",
}  # fmt: skip


def _layout(run) -> str | None:
    try:
        parameters = tuple(inspect.signature(type(run).__call__).parameters)[1:]
    except (TypeError, ValueError):
        return None
    layout = _LAYOUTS.get(parameters)
    if layout == "3.9" and not hasattr(run, "arg_annotations"):
        return None
    return layout


_launchers: dict = {}


def launcher(kernel) -> Launcher:
    """The one Launcher of `kernel`."""
    found = _launchers.get(kernel)
    if found is None:
        found = _launchers[kernel] = Launcher(kernel)
    return found


def _key(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, aligned(value)
    if type(value) in _PLAIN:
        return type(value), value  # the type: True == 1, but Triton treats them apart
    raise _Unsupported


_PLAIN = (int, float, bool, str, type(None))


class _Unsupported(Exception):
    pass


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs) through the kernel's Launcher, keyed on every argument
    (integers by value): for call sites that have no cheaper key. Anything but tensors,
    numbers, strings and None (a tensor descriptor, say) takes Triton's path, and so does an
    object that only stands in for a kernel (a test's wrapper that records launches)."""
    if getattr(kernel, "fn", None) is None:
        return kernel[grid](*args, **kwargs)
    try:
        key = (*map(_key, args), *((k, _key(v)) for k, v in kwargs.items()))
    except _Unsupported:
        return kernel[grid](*args, **kwargs)
    return launcher(kernel)(key, grid, *args, **kwargs)
