import pytest
import torch
from params import DTYPES
from test_norm import (
    _check_compiled_keeps_to_the_operators,
    _check_no_operator_dispatched,
    _check_the_operators_bits,
    _outputs_and_grads,
    _second_derivatives,
)

from kernels import check
from kernels import softmax as softmax_module
from kernels import softmax_tuning as tuning
from kernels.runtime import DEVICE
from kernels.softmax import FUSED_MAX_COLS, softmax, softmax_path, softmax_ref, softmax_streamed


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """plan() keeps its decisions: a test that changes the thresholds starts from none."""
    monkeypatch.setattr(tuning, "_plans", {})


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


KERNELS = {
    "rows": ["softmax_row_kernel"],
    "row": ["softmax_row_kernel"],
    "split": ["softmax_partials_kernel", "softmax_split_kernel"],
    "streamed": ["softmax_streamed_kernel"],
}


def _record_launches(monkeypatch):
    launched = []
    for name in {n for names in KERNELS.values() for n in names}:
        kernel = getattr(softmax_module, name)
        monkeypatch.setattr(
            softmax_module, name, _Recording(kernel, lambda name=name: launched.append(name))
        )
    return launched


# (rows, n_cols) on each side of the switches, with the CPU's 16 "SMs": 2 long rows are too
# few to fill them (split); 64 and more are not (streamed).
@pytest.mark.parametrize(
    "shape, path",
    [
        ((3, tuning.SHORT_MAX_COLS), "rows"),
        ((3, tuning.SHORT_MAX_COLS + 1), "row"),
        ((2, FUSED_MAX_COLS), "row"),
        ((2, FUSED_MAX_COLS + 1), "split"),
        ((4 * 16, FUSED_MAX_COLS + 1), "streamed"),
    ],
    ids=str,
)
def test_each_side_of_the_switches_launches_its_path(shape, path, monkeypatch):
    if path == "streamed":  # 64 long rows are slow in the interpreter: fewer, same decision
        monkeypatch.setattr(tuning, "SPLIT_BELOW_ROWS_PER_SM", 0)
        shape = (2, shape[1])
    launched = _record_launches(monkeypatch)
    _check_softmax(softmax, check.random_tensor(shape, seed=3, scale=4.0))
    assert launched == KERNELS[path]


def test_the_plan_at_the_h200s_shapes():
    plan = lambda rows, cols: tuning.plan(rows, cols, sms=132)
    short = plan(8192, 512)
    assert short.path == "rows" and short.rows_per_program == tuning.TILE_ELEMENTS // 512
    assert plan(3, 512).rows_per_program == 4  # never more rows than exist (padded to 2^k)
    assert plan(32768, 2048).path == "row"  # measured faster than "rows" (kernels.softmax_tuning)
    assert plan(2048, 32768) == tuning.Plan("row", 32768, num_warps=32)
    long = plan(512, 393216)  # 3.9 rows per SM: each row in pieces
    assert long.path == "split" and long.cols_per_split % long.block == 0
    assert long.splits * 512 >= tuning.SPLIT_PROGRAMS_PER_SM * 132
    assert (long.splits - 1) * long.cols_per_split < 393216 <= long.splits * long.cols_per_split
    assert plan(4096, 65536).path == "streamed"  # enough rows to fill the SMs
    assert plan(1, 40000).splits == 40000 // tuning.SPLIT_MIN_COLS  # pieces no shorter


def _small_split_pieces(monkeypatch):
    # pieces of 4 blocks of 32 columns, so that small rows are cut in several
    monkeypatch.setattr(tuning, "STREAM_BLOCK", 32)
    monkeypatch.setattr(tuning, "SPLIT_MIN_COLS", 128)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", tuning.PATHS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (5, 129), (2, 1000), (1, 4097), (7, 3, 33)],
                         ids=str)  # fmt: skip
def test_every_path_matches_fp64_reference(shape, path, dtype, monkeypatch):
    _small_split_pieces(monkeypatch)
    _check_softmax(softmax_path, check.random_tensor(shape, dtype, seed=11, scale=4.0), path=path)


def test_a_split_row_has_every_piece_and_a_ragged_last_one(monkeypatch):
    _small_split_pieces(monkeypatch)
    how = tuning.plan(2, 1000, path="split", sms=16)
    # 1000 // 128 = 7 pieces of 143 columns rounded up to whole blocks: 6 of 160, the last 40
    assert (how.splits, how.cols_per_split) == (7, 160)
    x = check.random_tensor((2, 1000), seed=12, scale=4.0)
    x[0, 990] = 40.0  # the row's max in the last piece: every other piece is rescaled by it
    x[1, :300] = float("-inf")  # whole pieces of -inf: their partial sums are 0
    _check_softmax(softmax_path, x, path="split")


@pytest.mark.parametrize("path", tuning.PATHS)
def test_gradients_through_every_path(path, monkeypatch):
    _small_split_pieces(monkeypatch)
    monkeypatch.setattr(tuning, "_choose", lambda *args: path)  # softmax() takes this path
    launched = _record_launches(monkeypatch)
    x = check.random_tensor((3, 300), seed=13, scale=3.0).requires_grad_()
    dy = check.random_tensor((3, 300), seed=14)
    (dx,) = torch.autograd.grad(softmax(x), x, dy)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(torch.softmax(x64, -1), x64, dy.double())
    check.assert_close(dx, dx64, op="reduction")
    assert launched == KERNELS[path]


def test_a_path_must_be_named():
    with pytest.raises(ValueError, match=r"path must be one of \('rows', 'row', 'split', "):
        softmax_path(check.random_tensor((2, 8), seed=15), "fast")
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        softmax_path(torch.ones(2, 8, dtype=torch.int32), "row")


class _Recording:
    """Stands in for a kernel: records each launch, then launches the real one."""

    def __init__(self, kernel, on_launch):
        self.kernel, self.on_launch = kernel, on_launch

    def __getitem__(self, grid):
        self.on_launch()
        return self.kernel[grid]


def _path(name):
    return lambda x: softmax_path(x, name)


ALL_PATHS = [softmax, softmax_streamed, *map(_path, tuning.PATHS)]
ALL_PATH_IDS = ["softmax", "streamed_fn", *tuning.PATHS]


@pytest.mark.parametrize("fn", ALL_PATHS, ids=ALL_PATH_IDS)
def test_large_values_do_not_overflow(fn):
    # exp(1000) is inf: without subtracting the row max this would be NaN
    _check_softmax(fn, check.random_tensor((4, 300), seed=4) * 100 + 1000)
    _check_softmax(fn, (check.random_tensor((4, 300), seed=5) * 1000).half())  # exp(12) > fp16


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on -inf - -inf
@pytest.mark.parametrize("fn", ALL_PATHS, ids=ALL_PATH_IDS)
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
        for path in tuning.PATHS:
            _check_softmax(softmax_path, x, path=path)


def test_any_number_of_leading_dims():
    x = check.random_tensor((2, 3, 4, 33), seed=8)
    _check_softmax(softmax, x)
    _check_softmax(softmax, x[0, 0, 0])  # 1-d: a single row


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (2, 0, 3), (0,)], ids=str)
def test_empty_tensors_launch_nothing(shape, monkeypatch):
    for name in {n for names in KERNELS.values() for n in names}:
        monkeypatch.setattr(softmax_module, name, None)  # any launch would fail
    x = torch.empty(shape, device=DEVICE)
    for fn in ALL_PATHS:
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(8192, 1024), (64, 32768), (16, 393216), (1024, 65537)], ids=str)
def test_the_chosen_path_at_the_benchmarks_row_lengths(shape, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 4
    check.assert_close(softmax(x), softmax_ref(x.double()), op="reduction")


# --- eager autograd without the operators (kernels.operators, road 3) ---------------------
# (public function, its operator called directly for the same output)
ROADS = {
    "softmax": (softmax, softmax_module.softmax_op),
    "softmax_streamed": (
        lambda x: softmax_streamed(x, block=32),
        lambda x: softmax_module.softmax_streamed_op(x, 32),
    ),
}


@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 129)], ids=str)
@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_has_the_operators_bits(op, shape):
    public, operator = ROADS[op]
    x = check.random_tensor(shape, seed=16, scale=3.0)
    _, (dx,) = _check_the_operators_bits(public, operator, [x], [f"{op} y", f"{op} dx"])
    _, (dx64,) = _outputs_and_grads(softmax_ref, [x.double()])
    check.assert_close(dx, dx64, op="reduction")


@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_dispatches_no_operator(op):
    x = check.random_tensor((5, 33), seed=17)
    _check_no_operator_dispatched(*ROADS[op], [x], {f"brrr.{op}.default"})


@pytest.mark.parametrize("op", ROADS)
def test_compiled_forward_and_backward_keep_to_the_operators(op):
    # the backward is torch ops (no operator of its own), traced into the backward graph
    x = check.random_tensor((5, 33), seed=18)
    _check_compiled_keeps_to_the_operators(ROADS[op][0], [x], {f"brrr._{op}.default"}, set())


@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_is_twice_differentiable_like_the_operator(op):
    # the backward reads the saved output: its second derivative goes back through softmax
    x = check.random_tensor((3, 40), seed=19, scale=3.0)
    eager, through_operator = (_second_derivatives(fn, [x]) for fn in ROADS[op])
    expected = _second_derivatives(softmax_ref, [x.double()])
    for got, other, ref in zip(eager, through_operator, expected, strict=True):
        assert torch.equal(got, other)
        check.assert_close(got, ref, op="reduction")
