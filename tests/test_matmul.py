import pytest
import torch
from params import CPU_DTYPES, DTYPES

from kernels import check
from kernels.matmul import (
    CONFIGS,
    TMA_MIN_WORK,
    chosen_config,
    configs_to_try,
    input_precision,
    matmul,
    matmul_ref,
    matmul_tma,
    pad_operands,
    shared_memory_bytes,
    tma_problem,
    uses_tma,
)
from kernels.runtime import DEVICE

# (M, N, K) around 1 and the 32-wide CPU blocks; the GPU's blocks are 64 to 256 wide.
SHAPES = [
    (1, 1, 1),
    (3, 5, 7),
    (31, 33, 17),
    (33, 31, 65),
    (1, 128, 129),
    (128, 1, 31),
    (127, 129, 64),
    (129, 127, 3),
]
H200_SHARED_MEMORY = 232448  # bytes per block (opt-in) on Hopper


def operands(m, n, k, dtype, seed=0):
    # k**-0.25 on each side keeps outputs near 1 whatever k is: one tolerance fits all shapes
    a = check.random_tensor((m, k), dtype, seed=seed, scale=k**-0.25)
    b = check.random_tensor((k, n), dtype, seed=seed + 1, scale=k**-0.25)
    return a, b


def torch_same_dtype(a, b, bias=None, activation=None):
    """What eager PyTorch computes in the inputs' dtype: the yardstick for 16-bit errors."""
    out = a @ b if bias is None else a @ b + bias
    return getattr(torch.nn.functional, activation)(out) if activation else out


def check_matmul(a, b, bias=None, activation=None, fn=matmul):
    """The kernel against fp64; 16-bit results may also be within 2x torch's own error."""
    a0, b0 = a.clone(), b.clone()
    with check.poisoned_allocations():
        out = fn(a, b, bias, activation)
    bias64 = None if bias is None else bias.double()
    ref = matmul_ref(a.double(), b.double(), bias64, activation)
    baseline = None if a.dtype == torch.float32 else torch_same_dtype(a, b, bias, activation)
    assert out.dtype == a.dtype and out.is_contiguous()
    check.assert_close(out, ref, op="matmul", dtype=a.dtype, baseline=baseline)
    assert torch.equal(a, a0) and torch.equal(b, b0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_matches_fp64_reference(shape, dtype):
    check_matmul(*operands(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", [None, "gelu", "relu"], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_fused_epilogue(with_bias, activation, dtype):
    a, b = operands(33, 65, 47, dtype, seed=2)
    bias = check.random_tensor((65,), dtype, seed=4, scale=-1.0) if with_bias else None
    check_matmul(a, b, bias, activation)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_non_contiguous_inputs(dtype):
    a, b = operands(40, 48, 72, dtype, seed=5)
    check_matmul(a.t().contiguous().t(), b)  # a column-major
    check_matmul(a, b.t().contiguous().t())  # b as an nn.Linear weight's transpose
    check_matmul(a[::2, 1::3], b[1::3, ::2])  # strided slices
    bias = check.random_tensor((48, 2), dtype, seed=6)[:, 1]  # a bias with stride 2
    check_matmul(a, b, bias, "gelu")


@pytest.mark.parametrize("activation", [None, "gelu"], ids=str)
def test_empty_dims(activation):
    a, b = operands(5, 6, 7, torch.float32)
    bias = check.random_tensor((6,), seed=7)
    with check.poisoned_allocations():
        assert matmul(a[:0], b, bias, activation).shape == (0, 6)
        assert matmul(a, b[:, :0], None, activation).shape == (5, 0)
        out = matmul(a[:, :0], b[:0], bias, activation)  # K == 0: an empty sum is 0
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=DEVICE)
    expected = matmul_ref(zeros(5, 1), zeros(1, 6), bias, activation)
    check.assert_close(out, expected, op="matmul")


def test_bad_inputs_get_clear_errors():
    a, b = operands(4, 6, 8, torch.float32)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        matmul(a.int(), b.int())
    with pytest.raises(TypeError, match="share a dtype"):
        matmul(a, b.half())
    with pytest.raises(ValueError, match="must have 2 dims"):
        matmul(a[None], b)
    with pytest.raises(ValueError, match=r"columns to match b's rows: a \(4, 8\), b \(6, 8\)"):
        matmul(a, b.t())
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\), got \(8,\)"):
        matmul(a, b, a[0])
    with pytest.raises(ValueError, match="activation must be one of"):
        matmul(a, b, activation="tanh")
    elsewhere = torch.empty(4, 8, device="meta")
    with pytest.raises(ValueError, match=f"kernels run on {DEVICE.type}"):
        matmul(elsewhere, b)


def test_fp32_follows_torch_matmul_precision():
    previous = torch.get_float32_matmul_precision()
    try:
        assert input_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert input_precision(torch.float32) == "tf32"
        assert input_precision(torch.float16) == "tf32"  # ignored for 16-bit inputs
    finally:
        torch.set_float32_matmul_precision(previous)


def test_configs_fit_hopper_shared_memory():
    assert all(shared_memory_bytes(c, 2) <= H200_SHARED_MEMORY for c in CONFIGS)
    assert sum(shared_memory_bytes(c, 4) <= H200_SHARED_MEMORY for c in CONFIGS) >= 2


def test_autotuning_tries_configs_that_fit_and_pay_off():
    assert configs_to_try(CONFIGS, 4096, 4096, 2, H200_SHARED_MEMORY) == CONFIGS
    fp32 = configs_to_try(CONFIGS, 4096, 4096, 4, H200_SHARED_MEMORY)
    assert 2 <= len(fp32) < len(CONFIGS)
    assert all(shared_memory_bytes(c, 4) <= H200_SHARED_MEMORY for c in fp32)
    (small,) = configs_to_try(CONFIGS, 1, 4096, 2, H200_SHARED_MEMORY)  # a decode step
    area = lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]
    assert area(small) == min(area(c) for c in CONFIGS)
    assert len(configs_to_try(CONFIGS, 4096, 4096, 2, limit=1)) == 1  # nothing fits: the smallest


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1000, 4097, 129), (257, 3, 4096)], ids=str)
def test_gpu_sizes_that_are_not_multiples_of_anything(shape, dtype):
    a, b = operands(*shape, dtype, seed=8)
    check_matmul(a, b)  # the autotuner picks a config
    check_matmul(a, b)  # the chosen config, launched directly


def test_padded_operands_hold_the_same_product():
    a, b = operands(5, 3, 7, torch.float64, seed=10)
    bias = check.random_tensor((3,), torch.float64, seed=12)
    a_p, b_p, bias_p = pad_operands(a, b, bias, multiple=4)
    assert (a_p.shape, b_p.shape, bias_p.shape) == ((5, 8), (8, 4), (4,))
    assert a_p.is_contiguous() and b_p.is_contiguous()
    assert not a_p[:, 7:].any() and not b_p[7:].any() and not b_p[:, 3:].any() and bias_p[3] == 0
    torch.testing.assert_close((a_p @ b_p + bias_p)[:, :3], a @ b + bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_misaligned_large_problems_go_through_padded_copies(dtype):
    from kernels.matmul import PAD_MIN_WORK, _aligned

    m, n, k = 1031, 1043, 1009  # odd strides and M*N*K over PAD_MIN_WORK
    a, b = operands(m, n, k, dtype, seed=13)
    assert m * n * k >= PAD_MIN_WORK and not _aligned(a, b)
    bias = check.random_tensor((n,), dtype, seed=14)
    check_matmul(a, b, bias, "gelu")
    check_matmul(a, b[:, : n - 1])  # a column view: b's rows stay odd, its N too


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(512, 512, 1024), (1024, 1040, 1024)], ids=str
)  # 2nd: K-major copy
def test_gpu_fp32_is_ieee_unless_tf32_is_allowed(shape):
    a, b = operands(*shape, torch.float32, seed=9)
    ref = matmul_ref(a.double(), b.double())
    previous = torch.get_float32_matmul_precision()
    try:
        ieee_error = check.relative_error(matmul(a, b), ref)
        torch.set_float32_matmul_precision("high")
        tf32_error = check.relative_error(matmul(a, b), ref)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert ieee_error < 1e-5, ieee_error
    assert tf32_error > 10 * ieee_error, (tf32_error, ieee_error)  # tf32 has a 10-bit mantissa


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)  # TMA, pointers
def test_gpu_64_bit_offsets(dtype):
    m, n, k = (1 << 21) + 64, 16, 1024  # a has more than 2**31 elements
    a = torch.randn(m, k, device=DEVICE, dtype=dtype)
    b = torch.randn(k, n, device=DEVICE, dtype=dtype)
    out = matmul(a, b)
    tail = slice(m - 64, m)
    ref = matmul_ref(a[tail].double(), b.double())
    check.assert_close(out[tail], ref, op="matmul", baseline=torch_same_dtype(a[tail], b))


# The TMA kernel: shapes whose rows are 16-byte multiples (the TMA's rule), K and M not
# multiples of the block (the TMA zero-fills past the edges), b row-major or W.t().
TMA_SHAPES = [(1, 8, 8), (37, 40, 72), (70, 104, 40), (129, 8, 264)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b_is_w", [False, True], ids=["b", "W.t()"])
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tma_kernel_matches_fp64_reference(shape, b_is_w, dtype):
    m, n, k = shape
    a, b = operands(m, n, k, dtype, seed=20)
    if b_is_w:
        b = b.t().contiguous().t()  # the same values, stored as W (N, K)
    bias = check.random_tensor((n,), dtype, seed=21)
    assert not tma_problem(a, b)
    check_matmul(a, b, fn=matmul_tma)
    check_matmul(a, b, bias, "gelu", fn=matmul_tma)


def test_tma_refuses_operands_it_cannot_load():
    a, b = operands(8, 8, 8, torch.float32, seed=22)
    wide, _ = operands(8, 16, 9, torch.float32, seed=23)  # views into rows of 9 and 16 floats
    cases = {
        "a needs contiguous rows of 16-byte multiples": (wide[:, :8], b),
        "b must be row-major or W.t()": (a, b.new_ones(8, 16)[:, ::2]),
        "the output's rows of 7 elements": (a, b[:, :7]),
    }
    for message, (x, y) in cases.items():
        with pytest.raises(ValueError, match=message):
            matmul_tma(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("b_is_w", [False, True], ids=["b", "W.t()"])
def test_gpu_large_16_bit_problems_go_through_tma_on_hopper(b_is_w):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA needs Hopper (sm_90) or later")
    m, n, k = 4100, 4096, 1040  # M*N*K over TMA_MIN_WORK; M, K not multiples of a tile
    a, b = operands(m, n, k, torch.bfloat16, seed=23)
    if b_is_w:
        b = b.t().contiguous().t()
    assert m * n * k >= TMA_MIN_WORK and uses_tma(a, b)
    assert not uses_tma(a.float(), b.float())  # fp32 stays on the pointer kernel
    bias = check.random_tensor((n,), torch.bfloat16, seed=24)
    assert chosen_config(a, b, bias, "gelu") == (None, True)  # not tuned yet
    check_matmul(a, b, bias, "gelu")  # tunes, then launches through the autotuner
    config, tma = chosen_config(a, b, bias, "gelu")
    assert tma and config is not None
    check_matmul(a, b, bias, "gelu")  # launches with the chosen config directly
