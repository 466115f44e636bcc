"""kernels.launch: a Launcher gives what kernel[grid] gives, for every specialization Triton
makes (alignment, integers equal to 1 or divisible by 16, dtypes); a call site's key that
misses one is caught under VERIFY; under the interpreter the keys are still recorded."""

import types

import pytest
import torch
import triton

from kernels import launch as launch_module
from kernels.elementwise import BLOCK_SIZE, add_kernel
from kernels.launch import Launcher, aligned, int_class, launch
from kernels.runtime import DEVICE, ON_GPU
from tests.params import DTYPES


def _add_through(launcher, x, y):
    out = torch.full_like(x, float("nan"))  # poisoned: an unwritten element shows
    n = x.numel()
    launcher(add_kernel, (triton.cdiv(n, BLOCK_SIZE),), x, y, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


def _triton_path(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def _keyed(key_of):
    """A launcher function for _add_through through a fresh Launcher and `key_of(x, y, n)`."""
    launcher = Launcher(add_kernel)

    def through(kernel, grid, x, y, out, n, **meta):
        launcher(key_of(x, y, n), grid, x, y, out, n, **meta)

    through.launcher = launcher
    return through


def _good_key(x, y, n):  # what kernels.elementwise.add keys on
    return x.dtype, aligned(x), aligned(y), int_class(n)


# n = 1 (Triton makes it a constant), 16 and 4096 (divisible by 16), odd lengths; offset views
# (a 4-byte offset breaks the 16-byte alignment Triton assumes of fresh tensors).
CASES = [(1, 0), (16, 0), (17, 0), (4096, 0), (4097, 1), (1000, 3), (16, 1)]


def _views(n, offset, dtype=torch.float32):
    base = torch.randn(2, n + offset, device=DEVICE).to(dtype)
    return base[0, offset:], base[1, offset:]


@pytest.fixture
def verify(monkeypatch):
    monkeypatch.setattr(launch_module, "VERIFY", True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_matches_triton_on_every_specialization(dtype, verify):
    keyed = _keyed(_good_key)
    for n, offset in CASES * 2:  # twice: the second round takes the cached path
        x, y = _views(n, offset, dtype)
        expected = x + y
        assert torch.equal(_add_through(_triton_path, x, y), expected), (n, offset)
        assert torch.equal(_add_through(launch, x, y), expected), (n, offset)
        assert torch.equal(_add_through(keyed, x, y), expected), (n, offset)


def test_plain_helpers_give_tritons_values():
    for n in [*range(0, 300), 4095, 4096, 4097, 2**31 + 5]:  # 0 too: both give 0
        assert launch_module.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 1024):
            assert launch_module.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_int_class_is_what_triton_specializes_integers_on():
    assert [int_class(n) for n in (1, 0, 16, 32, 17, 1000)] == [1, 16, 16, 16, 0, 0]
    assert int_class(2**31) == 64 + 16 and int_class(2**31 + 1) == 64
    assert int_class(-(2**31)) == 16 and int_class(2**63) == 128 + 16


def test_a_call_site_key_caches_one_entry_per_key():
    """On a GPU each entry holds a compiled kernel; under the interpreter, the key's first
    specialization (the same keys, the same cache)."""
    keyed = _keyed(_good_key)
    for n, offset in CASES * 3:
        _add_through(keyed, *_views(n, offset))
    keys = {_good_key(*_views(n, offset), n) for n, offset in CASES}
    assert len(keyed.launcher.entries) == len(keys) < len(CASES)


@pytest.mark.parametrize(
    "key_of, cases, missing",
    [
        (lambda x, y, n: (x.dtype, int_class(n)), [(16, 0), (16, 1)], "alignment"),
        (lambda x, y, n: (x.dtype, aligned(x), aligned(y)), [(32, 0), (36, 0)], "integer class"),
        (lambda x, y, n: (aligned(x), aligned(y), int_class(n)), [(16, 0), (16, 0)], "dtype"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_verify_catches_a_key_that_misses_a_specialization(key_of, cases, missing, verify):
    keyed = _keyed(key_of)
    dtypes = [torch.float32, torch.float16] if missing == "dtype" else [torch.float32] * 2
    (n0, offset0), (n1, offset1) = cases
    _add_through(keyed, *_views(n0, offset0, dtypes[0]))
    with pytest.raises(AssertionError, match="add_kernel: key"):
        _add_through(keyed, *_views(n1, offset1, dtypes[1]))


def test_the_public_ops_keys_pass_verify(verify):
    """Each hot call site's key, over shapes and offsets that change what Triton specializes on."""
    from kernels import elementwise, matmul, norm

    for n, offset in CASES:
        x, y = _views(n, offset)
        assert torch.equal(elementwise.add(x, y), x + y)
        bias = torch.randn(n + offset, device=DEVICE)[offset:]
        torch.testing.assert_close(
            elementwise.bias_gelu(x.reshape(1, n), bias), elementwise.bias_gelu_ref(x, bias)[None]
        )
    for rows, cols, offset in [(3, 16, 0), (3, 17, 1), (5, 64, 3), (1, 1, 0), (4, 33, 0)]:
        base = torch.randn(rows * cols + offset + cols, device=DEVICE)
        x = base[offset : offset + rows * cols].view(rows, cols)
        w, b = base[-cols:], torch.randn(cols, device=DEVICE)
        torch.testing.assert_close(norm.rms_norm(x, w), norm.rms_norm_ref(x, w))
        torch.testing.assert_close(norm.layer_norm(x, w, b), norm.layer_norm_ref(x, w, b))
        y, h = norm.add_rms_norm(x, x.flip(0), w)
        torch.testing.assert_close(y, norm.add_rms_norm_ref(x, x.flip(0), w)[0])
    for m, k, n in [(16, 16, 16), (17, 33, 5), (1, 16, 1)]:
        a, bm = torch.randn(m, k, device=DEVICE), torch.randn(k, n, device=DEVICE)
        bias = torch.randn(n, device=DEVICE)
        for _ in range(2):  # the second call takes the cached path
            out = matmul.matmul(a, bm, bias=bias, activation="gelu")
            torch.testing.assert_close(out, matmul.matmul_ref(a, bm, bias, "gelu"))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's path: a CPU check")
def test_under_the_interpreter_every_launch_is_tritons_own_path_but_keys_are_kept():
    keyed = _keyed(_good_key)
    x, y = _views(129, 0)
    for _ in range(2):
        assert torch.equal(_add_through(keyed, x, y), x + y)
    (device, key), spec = next(iter(keyed.launcher.entries.items()))
    assert device is None and key == _good_key(x, y, 129) and isinstance(spec, tuple)


@pytest.mark.gpu
def test_the_direct_path_uses_the_c_launcher_of_this_triton():
    """The GPU's Triton has a known launcher layout: the direct path is the C launcher, not
    the fallback through the compiled kernel's Python `run` (which would cost host time)."""
    keyed = _keyed(_good_key)
    x, y = _views(4096, 0)
    for _ in range(2):
        _add_through(keyed, x, y)
    (entry,) = keyed.launcher.entries.values()
    assert launch_module._layout(entry.compiled.run) in ("3.6", "3.9"), triton.__version__


def test_a_launch_hook_sends_launches_through_tritons_path():
    from kernels import bench

    assert not launch_module.hooked()  # Triton 3.6+ keeps an empty chain: no hook
    with bench.launches():
        assert launch_module.hooked()
    assert not launch_module.hooked()


# The direct path's argument layouts, checked on any machine against stand-ins for Triton's
# compiled kernel and its launcher (the C launcher's argument order read from Triton's
# nvidia/driver.py of 3.6 and 3.9): the order is where a mistake would not raise.
class _Launcher36:
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, seen):
        self.seen = seen
        self.launch = lambda *args: seen.append(("C", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.seen.append(("run", (gridX, gridY, gridZ, stream, function, *args)))


class _Launcher39(_Launcher36):
    arg_annotations, kernel_signature = "annotations", "signature"

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):  # fmt: skip
        hooks = (launch_metadata, launch_enter_hook, launch_exit_hook)
        self.seen.append(
            ("run", (gridX, gridY, gridZ, stream, function, kernel_metadata, *hooks, *args))
        )


class _LauncherUnknown(_Launcher36):
    def __call__(self, *args):
        self.seen.append(("run", args))


class _Scratch36(_Launcher36):
    global_scratch_size = 128  # needs memory per launch: the direct path leaves that to run


def _stand_in_kernel(run):
    def fn(x_ptr, n, BLOCK: "tl.constexpr"):  # noqa: F821
        pass

    compiled = types.SimpleNamespace(run=run, function=7, packed_metadata=(4, 1, 0))

    class Kernel:
        arg_names = ["x_ptr", "n", "BLOCK"]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: run.seen.append(("triton", args)) or compiled

    kernel = Kernel()
    kernel.fn = fn
    return kernel


M = (4, 1, 0)  # the packed metadata
EXPECTED = {
    _Launcher36: ("C", (5, 1, 1, 99, 7, False, True, None, None, M, None, None, None, "x", 16, 64)),
    _Launcher39: (
        "C",
        (
            5,
            1,
            1,
            99,
            7,
            False,
            True,
            M,
            None,
            None,
            None,
            None,
            None,
            "annotations",
            "signature",
            ("x", 16, 64),
        ),
    ),  # fmt: skip
    _LauncherUnknown: ("run", (5, 1, 1, 99, 7, M, None, None, None, "x", 16, 64)),
    _Scratch36: ("run", (5, 1, 1, 99, 7, M, None, None, None, "x", 16, 64)),
}


@pytest.mark.parametrize("launcher_class", EXPECTED, ids=lambda c: c.__name__.strip("_"))
def test_the_direct_path_passes_each_layout_its_arguments(launcher_class, monkeypatch):
    _off_the_interpreter(monkeypatch)
    seen = []
    keyed = Launcher(_stand_in_kernel(launcher_class(seen)))
    for _ in range(2):
        keyed(("key",), (5,), "x", 16, BLOCK=64)
    assert seen[0] == ("triton", ("x", 16))  # the first launch: Triton's own path
    assert seen[1:] == [EXPECTED[launcher_class]]


def _off_the_interpreter(monkeypatch):
    """The direct path on any machine: device 0, stream 99, against stand-in kernels."""
    monkeypatch.setattr(launch_module, "INTERPRET", False)
    monkeypatch.setattr(launch_module, "_current_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_current_stream", lambda d: 99)


def test_launch_kept_reuses_the_first_launchs_constexprs_and_declines_what_it_cannot_do(
    monkeypatch,
):
    _off_the_interpreter(monkeypatch)
    seen = []
    keyed = Launcher(_stand_in_kernel(_Launcher36(seen)))
    assert not keyed.launch_kept(("key",), (5,), "x", 16)  # nothing kept yet: launches nothing
    assert seen == []
    keyed(("key",), (5,), "x", 16, BLOCK=64)
    assert keyed.launch_kept(("key",), (5,), "y", 32)
    assert seen[-1] == EXPECTED[_Launcher36][:1] + (
        EXPECTED[_Launcher36][1][:-3] + ("y", 32, 64),  # BLOCK=64, from the first launch
    )
    assert not keyed.launch_kept(("other key",), (5,), "y", 32)
    monkeypatch.setattr(launch_module, "VERIFY", True)  # VERIFY checks every launch: full calls
    assert not keyed.launch_kept(("key",), (5,), "y", 32)
    assert len(seen) == 2


def test_launch_kept_declines_a_key_whose_keywords_are_not_all_constexprs(monkeypatch):
    _off_the_interpreter(monkeypatch)
    seen = []
    keyed = Launcher(_stand_in_kernel(_Launcher36(seen)))
    keyed(("key",), (5,), "x", n=16, BLOCK=64)  # n is a runtime argument: it changes per call
    assert keyed.entries[(0, ("key",))].constants is None
    assert not keyed.launch_kept(("key",), (5,), "x")
