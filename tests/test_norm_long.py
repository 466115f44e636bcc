"""rms_norm and layer_norm on rows past the register kernels' limit (kernels.norm_long).

On a CPU the threshold and the chunk are lowered (rows past 256 columns, chunks of 64) so small
rows walk the chunked kernels; one real row past 65536 runs with the shipped constants."""

import types

import pytest
import torch
from params import CPU_DTYPES, DTYPES, attached_metadata
from test_norm import (
    OPS,
    _check_against_fp64,
    _check_eager_autograd_against_the_operator,
    _forward_backward,
    _inputs,
)

from kernels import check, norm_long
from kernels import norm as norm_module
from kernels import norm_backward as norm_backward_module
from kernels.norm import MAX_COLS, add_rms_norm
from kernels.runtime import DEVICE

LOWERED, CHUNK = 256, 64


@pytest.fixture
def long_rows(monkeypatch):
    """Rows past LOWERED columns take the chunked kernels, in chunks of CHUNK; the register
    kernels are removed, so a row that reached one would fail."""
    monkeypatch.setattr(norm_long, "LONG_ROW_COLS", LOWERED)
    monkeypatch.setattr(norm_long, "LONG_BLOCK", CHUNK)
    for name in ("rms_norm_fwd_kernel", "layer_norm_fwd_kernel"):
        monkeypatch.setattr(norm_module, name, None)
    monkeypatch.setattr(norm_backward_module, "norm_bwd_kernel", None)


# odd lengths, one past the threshold, chunk edges +-1 (5 chunks = 320), leading dims
SHAPES = [(1, 257), (3, 300), (2, 319), (2, 320), (2, 321), (4, 383), (2, 3, 1001)]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_chunked_forward_and_backward_match_fp64_autograd(op, shape, dtype, long_rows):
    x, params, dy = _inputs(shape, dtype, OPS[op][2], seed=50)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.parametrize("op", OPS)
def test_rows_at_the_threshold_keep_the_register_kernels(op, monkeypatch):
    monkeypatch.setattr(norm_long, "LONG_ROW_COLS", LOWERED)
    for name in ("rms_norm_long_fwd_kernel", "layer_norm_long_fwd_kernel", "norm_long_bwd_kernel"):
        monkeypatch.setattr(norm_long, name, None)  # any chunked launch would fail
    x, params, dy = _inputs((3, LOWERED), torch.float32, OPS[op][2], seed=51)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows", [1, 7, 9, 20], ids=lambda n: f"rows{n}")
def test_chunked_weight_gradients_sum_over_every_row(op, n_rows, long_rows):
    # 8 programs on a CPU: 20 rows are 7 programs of 3 rows, the last one of 2
    x, params, dy = _inputs((n_rows, 300), torch.float32, OPS[op][2], seed=52)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.parametrize("op", OPS)
def test_chunked_backward_is_deterministic(op, long_rows):
    x, params, dy = _inputs((20, 333), torch.float32, OPS[op][2], seed=53)
    _, first = _forward_backward(OPS[op][0], x, params, dy)
    _, second = _forward_backward(OPS[op][0], x, params, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("op", OPS)
def test_chunked_non_contiguous_inputs(op, long_rows):
    n_params = OPS[op][2]
    base = check.random_tensor((12, 600), seed=54, scale=2.0)
    for x in (base[:, ::2], base[::3, 1:301], base.view(3, 4, 600).permute(1, 0, 2)):
        assert not x.is_contiguous() and x.shape[-1] > LOWERED
        p = [check.random_tensor(x.shape[-1:], seed=55 + i) for i in range(n_params)]
        dy = check.random_tensor(x.shape, seed=58).transpose(0, -1).contiguous().transpose(0, -1)
        _check_against_fp64(op, x, p, dy)
    # y.sum().backward() hands the backward an expanded gradient: all strides 0
    kernel, reference, _ = OPS[op]
    params = [check.random_tensor((600,), seed=62 + i) for i in range(n_params)]
    x = base.clone().requires_grad_()
    kernel(x, *params).sum().backward()
    x64 = base.double().requires_grad_()
    reference(x64, *[q.double() for q in params]).sum().backward()
    check.assert_close(x.grad, x64.grad, op="reduction")


@pytest.mark.parametrize("shape", [(3, 300), (2, 3, 321)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_chunked_eager_autograd_has_the_operators_bits(op, shape, long_rows):
    _check_eager_autograd_against_the_operator(op, shape, step=2)  # a strided weight, too


def test_layer_norm_variance_does_not_cancel(long_rows):
    # mean 300, std 1: E[x^2] - E[x]^2 in fp32 subtracts two numbers near 9e4 to get 1. The
    # saved rstd is compared (y itself carries fp32's rounding of x - mean near 300: 3e-5 ulps)
    x = (300.0 + torch.randn(4, 4099, generator=torch.Generator().manual_seed(56))).to(DEVICE)
    w, b = torch.ones(4099, device=DEVICE), torch.zeros(4099, device=DEVICE)
    rstd64 = torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5)
    one_pass = torch.rsqrt(x.square().mean(-1) - x.mean(-1).square() + 1e-5)  # what is avoided
    assert not check.compare(one_pass, rstd64, op="reduction", dtype=torch.float32).ok
    _, mean, rstd = norm_module._layer_norm_forward(x, w, b, 1e-5)
    check.assert_close(mean, x.double().mean(-1), op="reduction", dtype=torch.float32)
    check.assert_close(rstd, rstd64, op="reduction", dtype=torch.float32)


@pytest.mark.parametrize("op", OPS)
def test_a_real_row_past_65536_columns(op):
    # the shipped threshold and chunk: 70001 columns are 9 chunks of 8192, the last partial
    assert norm_long.LONG_ROW_COLS == MAX_COLS == 65536
    x, params, dy = _inputs((2, 70001), torch.float32, OPS[op][2], seed=57)
    _check_against_fp64(op, x, params, dy)


def test_the_operators_pass_opcheck_on_the_chunked_path(long_rows):
    # the same operators, their implementation branching: schema, fake kernel and autograd
    x, (w, b), dy = _inputs((3, 300), torch.float32, 2, seed=61)
    _, rstd = norm_module.rms_norm_forward(x, w, 1e-6)
    _, mean, lrstd = norm_module.layer_norm_forward(x, w, b, 1e-5)
    grad = [t.clone().requires_grad_() for t in (x, w, b)]
    cases = {
        "rms_norm_forward": (grad[0], grad[1], 1e-6),
        "layer_norm_forward": (*grad, 1e-5),
        "rms_norm_backward": (dy, x, w, rstd),
        "layer_norm_backward": (dy, x, w, mean, lrstd),
    }
    for name, args in cases.items():
        results = torch.library.opcheck(getattr(torch.ops.brrr, name).default, args)
        assert set(results.values()) == {"SUCCESS"}, (name, results)


def test_add_rms_norm_keeps_its_limit():
    x = torch.empty(1, MAX_COLS + 1, device=DEVICE)
    with pytest.raises(ValueError, match=f"add_rms_norm supports rows up to {MAX_COLS} columns"):
        add_rms_norm(x, x, torch.empty(MAX_COLS + 1, device=DEVICE))


def test_launch_metadata_of_the_chunked_kernels():
    # the same counts as the register kernels': each tensor read or written once
    rows, cols, programs = 3, 70001, 2
    x, parts = torch.empty(rows, cols), torch.empty(programs, cols)
    backward = {"dy_ptr": x, "x_ptr": x, "n_rows": rows, "n_cols": cols, "dw_part_ptr": parts}
    cases = {
        "rms_norm_long_fwd_kernel": ((rows,), {"x_ptr": x, "n_cols": cols}, 4),
        "layer_norm_long_fwd_kernel": ((rows,), {"x_ptr": x, "n_cols": cols, "b_ptr": x}, 7),
        "norm_long_bwd_kernel": ((programs,), {**backward, "db_part_ptr": parts}, 9),
    }
    for name, (grid, args, per_element) in cases.items():
        compiled = types.SimpleNamespace(name=name)
        info = attached_metadata(getattr(norm_long, name))(grid, compiled, args)
        assert info["name"] == f"{name} [rows={rows}, cols={cols}]"
        assert info["flops"] == per_element * rows * cols


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 4_194_304), (8, 131_073)], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_long_rows_bf16_on_gpu(op, shape):
    # KernelBench level 1 problem 40's rows of 4,194,304, and rows one past a power of two
    x, params, dy = _inputs(shape, torch.bfloat16, OPS[op][2], seed=59)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_long_rows_every_dtype_on_gpu(op, dtype):
    x, params, dy = _inputs((4, 3 * 65536 + 7), dtype, OPS[op][2], seed=60)
    _check_against_fp64(op, x, params, dy)
