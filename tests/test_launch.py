"""kernels.launch: the cached launch path gives what kernel[grid] gives, for every
specialization Triton makes (alignment, integers equal to 1 or divisible by 16, dtypes)."""

import pytest
import torch
import triton

from kernels import launch as launch_module
from kernels.elementwise import BLOCK_SIZE, add_kernel
from kernels.launch import launch
from kernels.runtime import DEVICE, ON_GPU
from tests.params import DTYPES


def _add_through(launcher, x, y):
    out = torch.full_like(x, float("nan"))  # poisoned: an unwritten element shows
    n = x.numel()
    launcher(add_kernel, (triton.cdiv(n, BLOCK_SIZE),), x, y, out, n, BLOCK_SIZE=BLOCK_SIZE)
    return out


def _triton_path(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


# n = 1 (Triton makes it a constant), 16 and 4096 (divisible by 16), odd lengths; offset views
# (a 4-byte offset breaks the 16-byte alignment Triton assumes of fresh tensors).
CASES = [(1, 0), (16, 0), (17, 0), (4096, 0), (4097, 1), (1000, 3), (16, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_matches_triton_on_every_specialization(dtype):
    for n, offset in CASES * 2:  # twice: the second round takes the cached path
        base = torch.randn(2, n + offset, device=DEVICE).to(dtype)
        x, y = base[0, offset:], base[1, offset:]
        expected = x + y
        assert torch.equal(_add_through(_triton_path, x, y), expected), (n, offset)
        assert torch.equal(_add_through(launch, x, y), expected), (n, offset)


@pytest.mark.gpu
def test_launch_caches_one_kernel_per_specialization():
    launch_module._compiled.clear()
    for n, offset in CASES * 3:
        base = torch.randn(2, n + offset, device=DEVICE)
        _add_through(launch, base[0, offset:], base[1, offset:])
    assert len(launch_module._compiled) == len(set(CASES))


@pytest.mark.skipif(ON_GPU, reason="the interpreter's path: a CPU check")
def test_launch_under_the_interpreter_is_tritons_own_path():
    launch_module._compiled.clear()
    x, y = torch.randn(2, 129, device=DEVICE)
    assert torch.equal(_add_through(launch, x, y), x + y)
    assert not launch_module._compiled


def test_a_launch_hook_sends_launches_through_tritons_path():
    from kernels import bench

    assert not launch_module._hooked()  # Triton 3.6+ keeps an empty chain: no hook
    with bench.launches():
        assert launch_module._hooked()
    assert not launch_module._hooked()
