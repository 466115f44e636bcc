import pytest
import torch
from params import DTYPES

from kernels import check
from kernels.elementwise import BLOCK_SIZE, add, add_ref, bias_gelu, bias_gelu_ref
from kernels.runtime import DEVICE

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
