import pytest
import torch
import triton
import triton.language as tl
from params import DTYPES
from test_norm import (
    _check_compiled_keeps_to_the_operators,
    _check_no_operator_dispatched,
    _check_the_operators_bits,
    _outputs_and_grads,
    _second_derivatives,
)

from kernels import check, elementwise
from kernels.elementwise import BLOCK_SIZE, add, add_ref, bias_gelu, bias_gelu_ref
from kernels.primitives import gelu_fast
from kernels.runtime import DEVICE, ON_GPU

# the odd sizes, one block plus and minus one, and leading dims
SHAPES = [(n,) for n in sorted({*check.ODD_SIZES, BLOCK_SIZE - 1, BLOCK_SIZE + 1})]
SHAPES += [(3, 127), (2, 3, 129)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_matches_reference(shape, dtype):
    x = check.random_tensor(shape, dtype, seed=1)
    y = check.random_tensor(shape, dtype, seed=2)
    r = check.against_fp64(add, x, y, ref=add_ref, op="elementwise")
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (129, 33), (2, 5, 1000)], ids=str)
def test_bias_gelu_matches_reference(shape, dtype):
    x = check.random_tensor(shape, dtype, seed=3, scale=2.0)
    bias = check.random_tensor(shape[-1:], dtype, seed=4)
    r = check.against_fp64(bias_gelu, x, bias, ref=bias_gelu_ref, op="elementwise")
    assert r.ok, r.message


def test_non_contiguous_and_empty_inputs():
    transposed = check.random_tensor((64, 48), seed=5).t()
    strided = check.random_tensor((48, 128), seed=7)[:, ::2]  # not dense: flat indexing fails
    y = check.random_tensor((48, 64), seed=6)
    bias = check.random_tensor((64,), seed=8)
    for x in (transposed, strided):
        assert not x.is_contiguous()
        r = check.against_fp64(add, x, y, ref=add_ref, op="elementwise")
        assert r.ok, r.message
        r = check.against_fp64(add, y, x, ref=add_ref, op="elementwise")
        assert r.ok, r.message
        r = check.against_fp64(bias_gelu, x, bias, ref=bias_gelu_ref, op="elementwise")
        assert r.ok, r.message
    strided_bias = check.random_tensor((128,), seed=9)[::2]  # read at its strides, not as dense
    r = check.against_fp64(bias_gelu, y, strided_bias, ref=bias_gelu_ref, op="elementwise")
    assert r.ok, r.message
    assert add(transposed[:0], y[:0]).shape == (0, 64)
    assert bias_gelu(transposed[:0], y[0, :64]).shape == (0, 64)


def test_bad_inputs_get_clear_errors():
    x = check.random_tensor((4, 8), seed=7)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        add(x.int(), x.int())
    with pytest.raises(TypeError, match="share a dtype"):
        add(x, x.half())
    with pytest.raises(ValueError, match=r"same shape.*\(4, 8\).*\(8, 4\)"):
        add(x, x.t())
    with pytest.raises(ValueError, match="last dim"):
        bias_gelu(x, x[0, :4].contiguous())
    with pytest.raises(TypeError, match="torch.Tensor"):
        add(x, [1.0])
    elsewhere = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match=f"is on meta but the kernels run on {DEVICE.type}"):
        add(elsewhere, elsewhere)


# --- the GELU of fp16 and bf16 outputs: the tanh form, over every value of the dtype ---------
def _bias_gelu_alone(x):
    return bias_gelu(x.view(-1, 1), torch.zeros(1, dtype=x.dtype, device=x.device)).view(-1)


@triton.jit
def _gelu_fast_fp32_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, gelu_fast(x), mask=offsets < n)


def _gelu_fast_rounded(x):
    """gelu_fast in fp32 (stored as fp32), rounded to x's dtype by torch, to nearest even, as
    the GPU's store rounds: the interpreter's own bf16 conversion truncates."""
    x32 = x.float()
    out = torch.empty_like(x32)
    _gelu_fast_fp32_kernel[(triton.cdiv(x32.numel(), 1024),)](x32, out, x32.numel(), BLOCK=1024)
    return out.to(x.dtype)


def _gelu_in_dtype(x):
    return torch.nn.functional.gelu(x)


GELU_CASES = [
    pytest.param(torch.float16, _bias_gelu_alone, id="fp16-bias_gelu"),
    pytest.param(torch.bfloat16, _gelu_fast_rounded, id="bf16-gelu_fast-rounded"),
    pytest.param(torch.bfloat16, _bias_gelu_alone, id="bf16-bias_gelu", marks=pytest.mark.gpu),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's exp2 overflows to inf, as wanted
@pytest.mark.parametrize("dtype, fn", GELU_CASES)
def test_fast_gelu_over_every_value_is_within_tolerance_and_twice_torchs_error(dtype, fn):
    if fn is _gelu_fast_rounded and ON_GPU:
        pytest.skip("the CPU's stand-in for the bf16 kernel: the GPU case runs the kernel")
    exact = torch.nn.functional.gelu  # fp64: the reference
    err = check.every_value_error(fn, _gelu_in_dtype, exact, dtype, op="elementwise")
    assert err["ours"] < 1, err  # within the tolerance table
    assert err["ours"] <= 2 * err["torch"], err


def test_fp32_keeps_the_exact_gelu():
    x = torch.linspace(-8, 8, 4001, device=DEVICE).view(-1, 1)
    out = bias_gelu(x, torch.zeros(1, device=DEVICE))
    exact = torch.nn.functional.gelu(x.double())
    assert (out.double() - exact).abs().max() < 1e-6  # the tanh form is off by up to 4.7e-4


def test_tolerance_units_and_every_value():
    ref = torch.tensor([1.0, 100.0, float("inf")], dtype=torch.float64)
    out = ref + torch.tensor([2e-5, 0.0, 0.0], dtype=torch.float64)
    units = check.tolerance_units(out, ref, op="elementwise", dtype=torch.float32)
    assert units == pytest.approx(1.0)  # 2e-5 against fp32's 1e-5 + 1e-5 * |1|
    nan_where_finite = torch.tensor([float("nan"), 100.0, 1.0])
    assert check.tolerance_units(nan_where_finite, ref, op="elementwise") == float("inf")
    assert check.every_value(torch.float16).unique().numel() == 63488 - 1  # +0 and -0 equal
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        check.every_value(torch.float32)


# --- eager autograd without the operator (kernels.operators, road 3) ----------------------
# (public function, its operator, the shapes of its inputs from x's, fp64 reference)
ROADS = {
    "add": (add, elementwise.add_op, lambda shape: [shape, shape], add_ref),
    "bias_gelu": (
        bias_gelu,
        elementwise.bias_gelu_op,
        lambda shape: [shape, shape[-1:]],
        lambda x, bias: torch.nn.functional.gelu(x + bias),  # bias_gelu_ref computes in fp32
    ),
}


def _road_inputs(op, shape, seed=70):
    return [check.random_tensor(s, seed=seed + i, scale=2.0)
            for i, s in enumerate(ROADS[op][2](shape))]  # fmt: skip


@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 129)], ids=str)
@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_has_the_operators_bits(op, shape):
    public, operator, _, reference = ROADS[op]
    inputs = _road_inputs(op, shape)
    names = ["out", "dx", "dy" if op == "add" else "dbias"]
    _, grads = _check_the_operators_bits(public, operator, inputs, [f"{op} {n}" for n in names])
    _, ref_grads = _outputs_and_grads(reference, [t.double() for t in inputs])
    for name, got, expected in zip(names[1:], grads, ref_grads, strict=True):
        result = check.compare(got, expected, op="reduction", dtype=torch.float32)
        assert result.ok, f"{op} {name}: {result.message}"


@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_dispatches_no_operator(op):
    public, operator, _, _ = ROADS[op]
    _check_no_operator_dispatched(
        public, operator, _road_inputs(op, (5, 33)), {f"brrr.{op}.default"}
    )


@pytest.mark.parametrize("op", ROADS)
def test_compiled_forward_and_backward_keep_to_the_operators(op):
    # forward: the kernel operator (no autograd kernel); the backward is torch ops (no operator
    # of its own), traced into the backward graph
    inputs = _road_inputs(op, (5, 33))
    _check_compiled_keeps_to_the_operators(ROADS[op][0], inputs, {f"brrr._{op}.default"}, set())


@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_is_twice_differentiable_like_the_operator(op):
    # a backward of torch ops: autograd records it on both roads, so a second derivative exists
    public, operator, _, reference = ROADS[op]
    inputs = _road_inputs(op, (3, 40))
    eager, through_operator = (_second_derivatives(fn, inputs) for fn in (public, operator))
    expected = _second_derivatives(reference, [t.double() for t in inputs])
    for got, other, ref in zip(eager, through_operator, expected, strict=True):
        assert (got is None) == (other is None) == (ref is None)
        if got is not None:
            assert torch.equal(got, other)
            check.assert_close(got, ref, op="reduction")
