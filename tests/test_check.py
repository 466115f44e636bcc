import math

import pytest
import torch

from kernels import check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", check.OP_CLASSES)
def test_every_dtype_and_op_class_has_a_tolerance(dtype, op):
    tol = check.tolerance(dtype, op)
    assert 0 < tol.atol <= 2e-2 and 0 < tol.rtol <= 2e-2


def test_tolerance_rejects_unknown_dtype_and_op():
    with pytest.raises(TypeError, match="supported"):
        check.tolerance(torch.int32, "elementwise")
    with pytest.raises(ValueError, match="op class"):
        check.tolerance(torch.float32, "convolution")


def test_compare_passes_within_and_fails_beyond_tolerance():
    ref = check.random_tensor((64, 33), torch.float64, seed=0, device="cpu")
    assert check.compare(ref.float(), ref, op="elementwise").ok
    bumped = ref.float().clone()
    bumped[5, 7] += 1e-2
    result = check.compare(bumped, ref, op="elementwise")
    assert not result.ok and "(5, 7)" in result.message


def test_nan_where_reference_is_finite_always_fails():
    ref = torch.ones(10, dtype=torch.float64)
    out = torch.ones(10)
    out[3] = math.nan
    result = check.compare(out, ref, op="attention", baseline=out)
    assert not result.ok and "non-finite" in result.message


def test_shape_mismatch_fails():
    assert not check.compare(torch.ones(3), torch.ones(4, dtype=torch.float64), op="reduction").ok


def test_baseline_rule_allows_twice_torchs_error():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen)
    b = torch.randn(64, 64, generator=gen)
    ref = a.double() @ b.double()
    torch_half = (
        (a.half() @ b.half())
        if check.DEVICE.type == "cuda"
        else (a.half().float() @ b.half().float()).half()
    )
    noisy = (ref + 1.5 * (torch_half.double() - ref)).half()
    assert check.compare(noisy, ref, op="matmul", baseline=torch_half).ok
    far = (ref * 1.05).half()
    assert not check.compare(far, ref, op="matmul", baseline=torch_half).ok


def test_random_tensor_is_fresh_and_nonzero():
    a = check.random_tensor((1000,), seed=1, device="cpu")
    b = check.random_tensor((1000,), seed=2, device="cpu")
    assert not torch.equal(a, b)
    assert a.abs().mean() > 0.3
    assert torch.equal(a, check.random_tensor((1000,), seed=1, device="cpu"))


def test_poisoned_allocations_expose_unwritten_elements():
    originals = torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty
    with check.poisoned_allocations():
        f = torch.empty(8)
        i = torch.empty_like(torch.zeros(4, dtype=torch.int32))
        m = f.new_empty((2, 3))
        assert torch.Tensor.new_empty.__name__ == "new_empty"  # the grader allows it by name
    assert torch.isnan(f).all() and check.unwritten(f).all()
    assert m.shape == (2, 3) and torch.isnan(m).all()
    assert (i == torch.iinfo(torch.int32).max).all()
    assert not torch.isnan(torch.empty(8).fill_(1.0)).any()  # patches removed afterwards
    restored = torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty
    assert all(a is b for a, b in zip(originals, restored, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_unwritten_tells_the_poison_from_a_computed_nan(dtype):
    with check.poisoned_allocations():
        out = torch.empty(6, dtype=dtype)
    out[:2] = torch.tensor([float("inf"), 0.0]) * torch.tensor([0.0, float("inf")])  # NaNs
    out[2:4] = torch.tensor([float("inf")] * 2) - torch.tensor([float("inf")] * 2)
    assert out.isnan().all()
    assert check.unwritten(out).tolist() == [False] * 4 + [True] * 2
