import pytest
import torch
from params import DTYPES, assert_rows_invariant

from kernels import check, int8
from kernels.runtime import DEVICE

SHAPES = [(1, 1, 1), (1, 1000, 127), (3, 33, 255), (17, 255, 1000), (64, 33, 127)]


def operands(m, n, k, dtype, seed=0):
    x = check.random_tensor((m, k), dtype, seed=seed, scale=k**-0.25)
    weight = check.random_tensor((n, k), torch.float32, seed=seed + 1, scale=k**-0.25)
    return x, *int8.quantize(weight)


def torch_same_dtype(x, q, scale, bias=None):
    """PyTorch's product in x's dtype with the dequantized weight: the 16-bit yardstick."""
    w = int8.dequantize(q, scale, x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def check_int8(x, q, scale, bias=None):
    r = check.against_fp64(
        int8.linear, x, q, scale, bias, ref=int8.linear_ref, op="matmul", baseline=torch_same_dtype
    )
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quantize_is_per_channel_symmetric_and_within_half_a_step(dtype):
    weight = check.random_tensor((65, 300), dtype, seed=1)
    weight[3, 7] = 40.0  # an outlier spoils its own row's resolution only
    weight[5] = 0.0  # an all-zero row: scale 0, q 0
    q, scale = int8.quantize(weight)
    assert q.dtype == torch.int8 and q.shape == (65, 300)
    assert scale.dtype == torch.float32 and scale.shape == (65,)
    w = weight.double()
    assert torch.equal(scale.double(), (w.abs().amax(dim=1) / 127).float().double())
    assert int(q.abs().max()) == 127 and torch.equal(q[5], torch.zeros_like(q[5]))
    err = (w - q.double() * scale.double()[:, None]).abs()
    assert bool((err <= scale.double()[:, None] / 2 * (1 + 1e-12)).all())  # fp64 quotients
    assert float(scale[3]) > 10 * float(scale[4])  # the outlier's row alone has a coarse step


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_with_the_dequantized_weight(shape, dtype):
    check_int8(*operands(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_and_k_tail(dtype):
    x, q, scale = operands(17, 127, 33, dtype, seed=2)
    check_int8(x, q, scale, check.random_tensor((127,), dtype, seed=3))


def test_close_to_the_full_precision_weight():
    # the quantization error itself: about 1% of the output's size for normal weights
    x = check.random_tensor((4, 512), seed=4, scale=0.1)
    weight = check.random_tensor((96, 512), seed=5, scale=0.05)
    out = int8.linear(x, *int8.quantize(weight))
    assert check.relative_error(out, x.double() @ weight.double().t()) < 0.02


def test_non_contiguous_x_and_qweight():
    x = check.random_tensor((40, 3), seed=6, scale=0.3).t()  # (3, 40), column-major
    q, scale = int8.quantize(check.random_tensor((33, 80), seed=7, scale=0.3))
    check_int8(x, q[:, ::2], scale)


def test_rows_do_not_depend_on_the_batch():
    x, q, scale = operands(33, 33, 200, torch.float32, seed=8)
    assert_rows_invariant(lambda t: int8.linear(t, q, scale), x, (1, 2, 3, 15, 16, 17, 32, 33))


@pytest.mark.parametrize("m, n, k", [(0, 5, 7), (3, 0, 7), (3, 5, 0)])
def test_empty_dims(m, n, k):
    x = torch.randn(m, k, device=DEVICE)
    q, scale = int8.quantize(torch.randn(n, k, device=DEVICE))
    bias = torch.randn(n, device=DEVICE)
    out = int8.linear(x, q, scale, bias)
    assert out.shape == (m, n) and torch.equal(out, bias.expand(m, n))


def _bad(x=(3, 4), q=(2, 4), scale=(2,), q_dtype=torch.int8, s_dtype=torch.float32, bias=None):
    tensor = lambda shape, dtype=torch.float32: torch.ones(shape, dtype=dtype, device=DEVICE)
    return (tensor(x), tensor(q, q_dtype), tensor(scale, s_dtype), bias and tensor(bias))


@pytest.mark.parametrize(
    "args, error, match",
    [
        (_bad(q_dtype=torch.float32), TypeError, "qweight has dtype"),
        (_bad(q=(2, 5)), ValueError, "match weight's"),
        (_bad(scale=(3,)), ValueError, "one per output channel"),
        (_bad(s_dtype=torch.float16), TypeError, "scale has dtype"),
        (_bad(bias=(3,)), ValueError, "bias must have"),
        (_bad(x=(4,)), ValueError, "x must have 2 dims"),
    ],
)
def test_bad_inputs_raise_before_launch(args, error, match):
    with pytest.raises(error, match=match):
        int8.linear(*args)


def test_the_operator_passes_opcheck_and_compiles_without_a_graph_break():
    x, q, scale = operands(3, 33, 70, torch.float32, seed=9)
    bias = check.random_tensor((33,), seed=10)
    torch.library.opcheck(int8.linear_int8_op, (x, q, scale, bias))
    fn = lambda t: int8.linear(t, q, scale, bias)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), fn(x))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_decode_shapes_on_the_gpu(m, n, k):
    x, q, scale = operands(m, n, k, torch.bfloat16, seed=11)
    check_int8(x, q, scale, check.random_tensor((n,), torch.bfloat16, seed=12))
    if m == 64:
        assert_rows_invariant(lambda t: int8.linear(t, q, scale), x, range(1, 65))
