import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from params import DTYPES, assert_rows_invariant

from kernels import check
from kernels.gemv import linear, linear_op, linear_ref
from kernels.runtime import DEVICE

# (M, N, K): M over 1, 3, 16, 17, 64 (the CPU tile has 16 rows); N and K over 1, 33, 127,
# 255, 1000 (tiles of 64 columns, K steps of 32, tails everywhere)
SHAPES = [
    (1, 1, 1),
    (1, 1000, 127),
    (3, 33, 255),
    (16, 127, 33),
    (17, 255, 1000),
    (64, 33, 127),
    (64, 1000, 1),
]


def operands(m, n, k, dtype, seed=0):
    x = check.random_tensor((m, k), dtype, seed=seed, scale=k**-0.25)
    weight = check.random_tensor((n, k), dtype, seed=seed + 1, scale=k**-0.25)
    return x, weight


def check_linear(x, weight, bias=None):
    r = check.against_fp64(linear, x, weight, bias, ref=linear_ref, op="matmul", baseline=F.linear)
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_reference(shape, dtype):
    check_linear(*operands(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 17])
def test_bias(m, dtype):
    x, weight = operands(m, 127, 255, dtype, seed=2)
    check_linear(x, weight, check.random_tensor((127,), dtype, seed=4))


def test_non_contiguous_x_and_weight():
    x = check.random_tensor((40, 3), seed=5, scale=0.3).t()  # (3, 40), column-major
    weight = check.random_tensor((33, 80), seed=6, scale=0.3)[:, ::2]  # (33, 40), strided
    assert not x.is_contiguous() and not weight.is_contiguous()
    check_linear(x, weight, check.random_tensor((33,), seed=7))


def test_rows_do_not_depend_on_the_batch():
    # N = 33, K = 200: one column tile, so K is cut into 7 pieces; batches around 16 rows
    x, weight = operands(33, 33, 200, torch.float32, seed=8)
    assert_rows_invariant(lambda t: linear(t, weight), x, (1, 2, 3, 15, 16, 17, 32, 33))


@pytest.mark.parametrize("m, n, k", [(0, 5, 7), (3, 0, 7), (3, 5, 0)])
def test_empty_dims(m, n, k):
    x, weight = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    out = linear(x, weight, bias)
    assert out.shape == (m, n) and torch.equal(out, bias.expand(m, n))


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.ones(4), torch.ones(2, 4)), ValueError, "x must have 2 dims"),
        ((torch.ones(3, 4), torch.ones(4)), ValueError, "weight must have 2 dims"),
        ((torch.ones(3, 4), torch.ones(4, 2)), ValueError, "out_features, in_features"),
        ((torch.ones(3, 4), torch.ones(2, 4, dtype=torch.float16)), TypeError, "share a dtype"),
        ((torch.ones(3, 4, dtype=torch.int8), torch.ones(2, 4)), TypeError, "supported"),
        ((torch.ones(3, 4), torch.ones(2, 4), torch.ones(4)), ValueError, r"bias must have"),
        ((torch.ones(3, 4), torch.ones(2, 4), torch.ones(2, 1)), ValueError, "bias must have"),
    ],
)
def test_bad_inputs_raise_before_launch(args, error, match):
    with pytest.raises(error, match=match):
        linear(*[t.to(DEVICE) for t in args])


def test_the_operator_passes_opcheck_and_compiles_without_a_graph_break():
    x, weight = operands(3, 33, 70, torch.float32, seed=9)
    bias = check.random_tensor((33,), seed=10)
    torch.library.opcheck(linear_op, (x, weight, bias))
    torch.library.opcheck(linear_op, (x, weight, None))
    compiled = torch.compile(lambda t: linear(t, weight, bias), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), linear(x, weight, bias))


def test_forward_only_a_backward_raises():
    x, weight = operands(3, 5, 7, torch.float32)
    out = linear(x, weight.requires_grad_())
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


def test_compiled_calls_the_kernel_operator_and_with_a_gradient_the_operator():
    # kernels.operators.forward_road: no autograd kernel where nothing needs one; the operator
    # (whose backward raises) where a gradient is wanted, so that it is never silently cut
    x, weight = operands(3, 5, 7, torch.float32, seed=11)
    for grad, called in ((False, "brrr._linear.default"), (True, "brrr.linear.default")):
        torch._dynamo.reset()
        recorded = torch._dynamo.testing.EagerAndRecordGraphs()
        compiled = torch.compile(linear, backend=recorded, fullgraph=True)
        out = compiled(x, weight.detach().requires_grad_(grad))
        nodes = [n for g in recorded.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert {str(n.target) for n in nodes if str(n.target).startswith("brrr.")} == {called}
        assert torch.equal(out.detach(), linear(x, weight))
        if grad:
            with pytest.raises(RuntimeError, match="no autograd formula"):
                out.sum().backward()


# The decode shapes the benchmark times (issue 16), checked in bf16 against fp64.
@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_decode_shapes_on_the_gpu(m, n, k):
    x, weight = operands(m, n, k, torch.bfloat16, seed=11)
    check_linear(x, weight, check.random_tensor((n,), torch.bfloat16, seed=12))


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(14336, 4096), (4096, 14336)])
def test_decode_rows_do_not_depend_on_the_batch_on_the_gpu(n, k):
    x, weight = operands(64, n, k, torch.bfloat16, seed=13)
    assert_rows_invariant(lambda t: linear(t, weight), x, range(1, 65))
