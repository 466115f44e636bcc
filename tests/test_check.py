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


def test_compare_needs_the_same_inf_or_nan_where_the_reference_is_not_finite():
    ref = torch.tensor([1.0, math.inf, -math.inf, math.nan], dtype=torch.float64)
    assert check.compare(ref.float(), ref, op="elementwise").ok
    for wrong in ([1.0, 3e38, -math.inf, math.nan], [1.0, math.inf, math.inf, math.nan]):
        result = check.compare(torch.tensor(wrong), ref, op="elementwise")
        assert not result.ok and "not finite" in result.message
    result = check.compare(torch.tensor([1.0, math.inf, -math.inf, 0.0]), ref, op="elementwise")
    assert not result.ok and "index (3,)" in result.message  # a NaN row must stay NaN


# against_fp64 with plain torch ops standing in for kernels: each fault must be caught.


def _xy(dtype=torch.float32, shape=(33, 65)):
    return (
        check.random_tensor(shape, dtype, seed=20, device="cpu"),
        check.random_tensor(shape, dtype, seed=21, device="cpu"),
    )


def _add_leaving_the_last_element_unwritten(x, y):
    out = torch.empty_like(x)
    out.view(-1)[:-1] = (x + y).view(-1)[:-1]
    return out


def _add_then_scale_the_input(x, y):
    out = x + y
    x.mul_(2)
    return out


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x, y: x + y + 1e-2, "max abs error"),
        (_add_leaving_the_last_element_unwritten, "1 output elements never written"),
        (_add_then_scale_the_input, "tensor argument 0 (shape (33, 65)) was modified"),
        (lambda x, y: (x + y).double(), "output dtype torch.float64"),
        (lambda x, y: (x + y).t().contiguous().t(), "not contiguous"),
        (lambda x, y: x.add_(y), "shares memory"),
        (lambda x, y: (x + y)[:, :-1].contiguous(), "shape (33, 64)"),
        (lambda x, y: [x + y], "expected a tensor, got list"),
    ],
    ids=[
        "wrong value",
        "unwritten",
        "modified input",
        "dtype",
        "strided",
        "in place",
        "shape",
        "list",
    ],
)
def test_against_fp64_catches(fn, message):
    result = check.against_fp64(fn, *_xy(), ref=torch.add, op="elementwise")
    assert not result.ok and message in result.message, result.message


def test_against_fp64_finds_unwritten_elements_where_the_reference_is_not_finite():
    x, y = _xy()
    x.view(-1)[-1] = math.inf  # the reference is inf there: compare alone would not look
    result = check.against_fp64(
        _add_leaving_the_last_element_unwritten, x, y, ref=torch.add, op="elementwise"
    )
    assert not result.ok and "never written" in result.message


def test_against_fp64_checks_keyword_tensors_and_keeps_integer_arguments():
    x, bias = _xy()
    index = torch.tensor([4, 0, 32, 4])

    def gather_rows(index, x, *, bias):
        bias.add_(1.0)
        return x[index] + bias[index]

    def gather_rows_ref(index, x, *, bias):
        assert index.dtype == torch.int64 and x.dtype == torch.float64  # only floats widened
        return x[index] + bias[index]

    result = check.against_fp64(
        gather_rows, index, x, bias=bias, ref=gather_rows_ref, op="elementwise"
    )
    assert not result.ok and "tensor argument 2" in result.message
    correct = lambda index, x, *, bias: x[index] + bias[index]
    result = check.against_fp64(correct, index, x, bias=bias, ref=gather_rows_ref, op="elementwise")
    assert result.ok, result.message  # the dtype is x's, the first floating-point argument's
    with pytest.raises(TypeError, match="floating-point tensor"):
        check.against_fp64(lambda i: i + 1, index, ref=lambda i: i + 1, op="elementwise")


def _matmul_via_fp32(a, b):
    return (a.float() @ b.float()).to(a.dtype)  # more accurate than torch's 16-bit op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_against_fp64_passes_a_correct_op_with_and_without_a_baseline(dtype):
    a = check.random_tensor((65, 129), dtype, seed=22, device="cpu")
    b = check.random_tensor((129, 33), dtype, seed=23, device="cpu")
    for fn in (torch.matmul, _matmul_via_fp32):
        result = check.against_fp64(fn, a, b, ref=torch.matmul, op="matmul")
        assert result.ok, result.message
        result = check.against_fp64(fn, a, b, ref=torch.matmul, op="matmul", baseline=torch.matmul)
        assert result.ok, result.message
        assert ("torch's" in result.message) == (dtype != torch.float32)  # the 2x rule ran


def test_against_fp64_baseline_does_not_excuse_a_wrong_op():
    a = check.random_tensor((65, 129), torch.float16, seed=24, device="cpu")
    b = check.random_tensor((129, 33), torch.float16, seed=25, device="cpu")
    wrong = lambda a, b: a @ b * 1.05
    result = check.against_fp64(wrong, a, b, ref=torch.matmul, op="matmul", baseline=torch.matmul)
    assert not result.ok and "2 x torch's" in result.message, result.message
