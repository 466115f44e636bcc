import pytest
import torch
from params import DTYPES

from kernels import check
from kernels import softmax as softmax_module
from kernels.runtime import DEVICE
from kernels.softmax import FUSED_MAX_COLS, softmax, softmax_ref, softmax_streamed

SHAPES = [(1, 1), (3, 1), (1, 3), (5, 127), (5, 128), (5, 129), (3, 1000), (2, 4097), (2, 3, 129)]


def _check_softmax(fn, x, **kwargs):
    r = check.against_fp64(lambda x: fn(x, **kwargs), x, ref=softmax_ref, op="reduction")
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_softmax_matches_fp64_reference(shape, dtype):
    _check_softmax(softmax, check.random_tensor(shape, dtype, seed=1, scale=4.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_cols", sorted({*check.ODD_SIZES, 128}), ids=lambda n: f"n{n}")
def test_streamed_kernel_over_many_blocks(n_cols, dtype):
    # block=128: long rows take many steps of the online recurrence, and a ragged last step
    x = check.random_tensor((3, n_cols), dtype, seed=2, scale=4.0)
    _check_softmax(softmax_streamed, x, block=128)
    _check_softmax(softmax_streamed, x)


@pytest.mark.parametrize("n_cols", [FUSED_MAX_COLS, FUSED_MAX_COLS + 1], ids=lambda n: f"n{n}")
def test_both_sides_of_the_row_length_switch(n_cols, monkeypatch):
    launched = []
    for name in ("softmax_row_kernel", "softmax_streamed_kernel"):
        kernel = getattr(softmax_module, name)
        monkeypatch.setattr(
            softmax_module, name, _Recording(kernel, lambda name=name: launched.append(name))
        )
    _check_softmax(softmax, check.random_tensor((2, n_cols), seed=3, scale=4.0))
    expected = "softmax_row_kernel" if n_cols <= FUSED_MAX_COLS else "softmax_streamed_kernel"
    assert launched == [expected]


class _Recording:
    """Stands in for a kernel: records each launch, then launches the real one."""

    def __init__(self, kernel, on_launch):
        self.kernel, self.on_launch = kernel, on_launch

    def __getitem__(self, grid):
        self.on_launch()
        return self.kernel[grid]


@pytest.mark.parametrize("fn", [softmax, softmax_streamed], ids=["row", "streamed"])
def test_large_values_do_not_overflow(fn):
    # exp(1000) is inf: without subtracting the row max this would be NaN
    _check_softmax(fn, check.random_tensor((4, 300), seed=4) * 100 + 1000)
    _check_softmax(fn, (check.random_tensor((4, 300), seed=5) * 1000).half())  # exp(12) > fp16


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf - -inf
@pytest.mark.parametrize("fn", [softmax, softmax_streamed], ids=["row", "streamed"])
def test_minus_infinity_is_masked_out_like_torch(fn):
    x = check.random_tensor((3, 9), seed=6)
    x[0, :5] = float("-inf")  # masked positions, as in causal attention
    x[1, 0] = float("-inf")
    x[2, :] = float("-inf")  # nothing left: torch gives NaN, and so must we
    assert softmax_ref(x.double())[2].isnan().all()
    _check_softmax(fn, x)  # NaN where the reference is NaN, and only there


def test_non_contiguous_inputs():
    base = check.random_tensor((40, 130), seed=7, scale=3.0)
    for x in (base.t(), base[:, 1:128], base[::3, ::2], base.view(4, 10, 130).permute(1, 0, 2)):
        assert not x.is_contiguous()
        _check_softmax(softmax, x)
        _check_softmax(softmax_streamed, x, block=32)


def test_any_number_of_leading_dims():
    x = check.random_tensor((2, 3, 4, 33), seed=8)
    _check_softmax(softmax, x)
    _check_softmax(softmax, x[0, 0, 0])  # 1-d: a single row


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3), (0,)], ids=str)
def test_empty_tensors_launch_nothing(shape, monkeypatch):
    for name in ("softmax_row_kernel", "softmax_streamed_kernel"):
        monkeypatch.setattr(softmax_module, name, None)  # any launch would fail
    x = torch.empty(shape, device=DEVICE)
    for fn in (softmax, softmax_streamed):
        out = fn(x)
        assert out.shape == x.shape and out.dtype == x.dtype


def test_bad_inputs_get_clear_errors():
    x = check.random_tensor((4, 8), seed=9)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        softmax(x.int())
    with pytest.raises(TypeError, match="torch.Tensor"):
        softmax([1.0, 2.0])
    with pytest.raises(ValueError, match=r"at least 1 dims, got shape \(\)"):
        softmax(x[0, 0])
    with pytest.raises(ValueError, match="power of two, got 100"):
        softmax_streamed(x, block=100)
    with pytest.raises(ValueError, match="is on meta"):
        softmax(torch.empty(4, 8, device="meta"))


@pytest.mark.gpu
def test_offsets_past_2_to_the_31():
    # 2**31 / 4096 rows and two more: the last rows start beyond a 32-bit offset
    rows = 2**31 // 4096 + 2
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    out = softmax(x)
    tail = slice(rows - 3, rows)
    check.assert_close(out[tail], softmax_ref(x[tail].double()), op="reduction")
