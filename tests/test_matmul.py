import contextlib
import types

import pytest
import torch
from params import CPU_DTYPES, DTYPES, attached_metadata

from kernels import check
from kernels import matmul as matmul_module
from kernels import matmul_tuning as tuning
from kernels.matmul import (
    chosen_config,
    matmul,
    matmul_kernel,
    matmul_pointers,
    matmul_ref,
    matmul_tma,
    matmul_tma_kernel,
)
from kernels.matmul_tuning import (
    CONFIGS,
    PAD_MIN_WORK,
    TMA_MIN_WORK,
    Plan,
    aligned,
    configs_to_try,
    pad_operands,
    plan,
    shared_memory_bytes,
    tma_problem,
    uses_tma,
)
from kernels.runtime import DEVICE
from kernels.validate import input_precision

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
ACTIVATIONS = [None, "gelu", "relu"]
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
    r = check.against_fp64(
        fn, a, b, bias, activation, ref=matmul_ref, op="matmul", baseline=torch_same_dtype
    )
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_matches_fp64_reference(shape, dtype):
    check_matmul(*operands(*shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
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
    for _ in range(2):  # the second call takes the path of a call already decided
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
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        matmul(a.tolist(), b.requires_grad_())  # checked before autograd looks at it
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


def test_padded_operands_hold_the_same_product():
    a, b = operands(5, 3, 7, torch.float64, seed=10)
    bias = check.random_tensor((3,), torch.float64, seed=12)
    a_p, b_p, bias_p = pad_operands(a, b, bias, multiple=4)
    assert (a_p.shape, b_p.shape, bias_p.shape) == ((5, 8), (8, 4), (4,))
    assert a_p.is_contiguous() and b_p.is_contiguous()
    assert not a_p[:, 7:].any() and not b_p[7:].any() and not b_p[:, 3:].any() and bias_p[3] == 0
    torch.testing.assert_close((a_p @ b_p + bias_p)[:, :3], a @ b + bias)


# plan(): the decision, on operands that only have to look right. Meta tensors have real
# shapes and strides at no cost, so the GPU's thresholds can be crossed on a CPU.
def meta(*shape, dtype=torch.bfloat16, row=None):
    """A (rows, cols) meta tensor; `row`: the row stride, as a view into wider rows."""
    rows, cols = shape
    return torch.empty(rows, row or cols, dtype=dtype, device="meta")[:, :cols]


@pytest.fixture(autouse=True)
def fresh_plans(monkeypatch):
    """plan() keeps its decisions: a test that changes what it reads starts from none."""
    monkeypatch.setattr(tuning, "_plans", {})


@pytest.fixture
def on_hopper(monkeypatch):
    """plan() as it decides on an H200: compiled Triton, the TMA available."""
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "TMA_GPU", True)


def test_plan_sends_large_16_bit_problems_to_the_tma(on_hopper):
    a, b = meta(4096, 1024), meta(1024, 4096)  # M*N*K = TMA_MIN_WORK
    assert plan(a, b) == Plan(False, False, True, False, "tf32")
    w = meta(4096, 1024)  # an nn.Linear weight (N, K): b = W.t() is K-major
    assert plan(a, w.t()) == Plan(False, False, True, True, "tf32")
    assert plan(meta(4095, 1024), b).tma is False  # one row short of TMA_MIN_WORK
    assert plan(a.float(), b.float()).tma is False  # fp32 stays on pointers
    column_major = meta(1024, 4096).t()  # aligned for loads, but the TMA needs rows
    assert plan(column_major, b) == Plan(False, False, False, False, "tf32")


def test_plan_without_the_tma_keeps_pointers(on_hopper, monkeypatch):
    monkeypatch.setattr(tuning, "TMA_GPU", False)  # before Hopper
    assert plan(meta(4096, 1024), meta(1024, 4096)) == Plan(False, False, False, False, "tf32")


def test_plan_pads_large_misaligned_operands(on_hopper):
    a, b = meta(2048, 1023), meta(1023, 1025)  # odd K and N, M*N*K over PAD_MIN_WORK
    assert not aligned(a, b) and 2048 * 1025 * 1023 >= PAD_MIN_WORK
    how = plan(a, b)
    assert how.pad and not how.k_major_b and not how.tma and not how.b_is_w
    # whether the TMA pays is decided on the padded copies: K 4095 -> 4096 reaches 2**34
    a, b = meta(4096, 4095), meta(4095, 1024)
    assert not uses_tma(a, b) and 4096 * 1024 * 4095 < TMA_MIN_WORK
    assert plan(a, b) == Plan(True, False, True, False, "tf32")
    assert plan(a, meta(1024, 4095, row=4100)).pad  # b's rows of 4100: not 16-element aligned
    assert plan(meta(512, 1023), meta(1023, 1025)).pad is False  # below PAD_MIN_WORK
    assert plan(meta(2048, 1024, row=1040), meta(1024, 1024)).pad is False  # strides of 16s


def test_plan_copies_b_k_major_for_tf32(on_hopper):
    a, b = meta(1024, 1024, dtype=torch.float32), meta(1024, 1024, dtype=torch.float32)
    previous = torch.get_float32_matmul_precision()
    try:
        assert plan(a, b) == Plan(False, False, False, False, "ieee")  # IEEE: no copy
        torch.set_float32_matmul_precision("high")
        assert plan(a, b) == Plan(False, True, False, False, "tf32")
        assert plan(a, b.t().contiguous().t()).k_major_b is False  # already K-major
        a_odd, b_odd = meta(2048, 1023, dtype=torch.float32), meta(1023, 1024, dtype=torch.float32)
        assert plan(a_odd, b_odd) == Plan(True, True, False, False, "tf32")  # padded, then copied
        assert plan(a[:512], b).k_major_b is False  # below PAD_MIN_WORK
    finally:
        torch.set_float32_matmul_precision(previous)


def test_plan_in_the_interpreter_makes_no_copies(on_hopper, monkeypatch):
    monkeypatch.setattr(tuning, "INTERPRET", True)
    monkeypatch.setattr(tuning, "TMA_GPU", False)
    assert plan(meta(2048, 1023), meta(1023, 1025)) == Plan(False, False, False, False, "tf32")


def test_plan_for_a_chosen_kernel_takes_operands_as_they_are(on_hopper):
    a, b = meta(2048, 1023), meta(1023, 1025)  # would be padded
    assert plan(a, b, "pointers") == Plan(False, False, False, False, "tf32")
    a, w = meta(8, 64), meta(16, 64)
    assert plan(a, w.t(), "tma") == Plan(False, False, True, True, "tf32")  # whatever the size
    with pytest.raises(ValueError, match="kernel must be one of"):
        plan(a, w.t(), "cublas")


def test_plan_refuses_what_the_tma_cannot_load():
    a, b = operands(8, 8, 8, torch.float32, seed=22)
    wide, _ = operands(8, 16, 9, torch.float32, seed=23)  # views into rows of 9 and 16 floats
    offset = torch.zeros(65, device=DEVICE)[1:].view(8, 8)  # starts 4 bytes past an allocation
    cases = {
        "a needs contiguous rows of 16-byte multiples": (wide[:, :8], b),
        "b must be row-major or W.t()": (a, b.new_ones(8, 16)[:, ::2]),
        "the output's rows of 7 elements": (a, b[:, :7]),
        "16-byte aligned addresses": (offset, b),
    }
    for message, (x, y) in cases.items():
        assert message in tma_problem(x, y)
        with pytest.raises(ValueError, match=message):
            plan(x, y, "tma")
        with pytest.raises(ValueError, match=message):
            matmul_tma(x, y)


FORCED_PLANS = {  # each copy the GPU makes for large problems, run here by the interpreter
    "pad": Plan(True, False, False, False, "ieee"),
    "k_major_b": Plan(False, True, False, False, "ieee"),
    "pad+k_major_b": Plan(True, True, False, False, "ieee"),
    "tma": Plan(False, False, True, False, "ieee"),
}


@pytest.mark.parametrize("name", FORCED_PLANS)
def test_launcher_carries_out_each_plan(name, monkeypatch):
    forced = FORCED_PLANS[name]
    monkeypatch.setattr(tuning, "plan", lambda a, b, kernel=None: forced)
    monkeypatch.setattr(matmul_module, "_calls", {})  # no call decided before this plan
    launched = []
    launch = matmul_module._launch

    def recorded(a, b, bias, activation, how):
        launched.append((a.shape, b.shape, b.stride(), how))
        return launch(a, b, bias, activation, how)

    monkeypatch.setattr(matmul_module, "_launch", recorded)
    n = 40 if forced.tma else 37  # the TMA needs rows of 16-byte multiples
    k = 24 if forced.tma else 35
    a, b = operands(29, n, k, torch.float32, seed=30)
    bias = check.random_tensor((n,), seed=31)
    check_matmul(a, b, bias, "gelu")
    (a_shape, b_shape, b_strides, how), *_ = launched
    assert how == forced
    kp, np_ = (64, 64) if forced.pad else (k, n)  # the padded copies' K and N
    assert (a_shape, b_shape) == ((29, kp), (kp, np_))
    assert b_strides == ((1, kp) if forced.k_major_b else (np_, 1))


# The backward: gradients of <out, dout> against fp64 autograd through matmul_ref.
GRAD_SHAPES = [(1, 1, 1), (33, 17, 40), (5, 64, 3)]


def gradients(fn, a, b, bias, activation, dout):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (a, b, bias)]
    out = fn(*leaves, activation)
    out.backward(dout)
    return [t.grad for t in leaves if t is not None]


def check_gradients(a, b, bias, activation, seed=40):
    m, n = a.shape[0], b.shape[1]
    dout = check.random_tensor((m, n), a.dtype, seed=seed, scale=-1.0)
    with check.poisoned_allocations():
        grads = gradients(matmul, a, b, bias, activation, dout)
    wide = lambda t: None if t is None else t.double()
    expected = gradients(matmul_ref, wide(a), wide(b), wide(bias), activation, dout.double())
    theirs = [None] * 3  # fp32: the tolerance; 16-bit: also within 2x torch's own error
    if a.dtype != torch.float32:
        theirs = gradients(torch_same_dtype, a, b, bias, activation, dout)
    for name, g, ref, base in zip(("da", "db", "dbias"), grads, expected, theirs, strict=False):
        assert g.dtype == a.dtype, f"{name} has dtype {g.dtype}"
        r = check.compare(g, ref, op="matmul", dtype=a.dtype, baseline=base)
        assert r.ok, f"{name}: {r.message}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gradients_match_fp64_autograd(shape, activation, with_bias, dtype):
    a, b = operands(*shape, dtype, seed=41)
    bias = check.random_tensor((shape[1],), dtype, seed=42, scale=-0.5) if with_bias else None
    check_gradients(a, b, bias, activation)


def test_gradients_of_strided_operands_and_an_expanded_dout():
    a, b = operands(40, 48, 72, torch.float32, seed=43)
    check_gradients(a[::2, 1::3], b.t().contiguous().t()[1::3, ::2], None, "relu")
    x = a.clone().requires_grad_()
    matmul(x, b).sum().backward()  # dout is expanded: strides (0, 0)
    x64 = a.double().requires_grad_()
    matmul_ref(x64, b.double()).sum().backward()
    check.assert_close(x.grad, x64.grad, op="matmul")


def counting_launcher(monkeypatch):
    calls = []
    launcher = matmul_module._matmul

    def counted(a, b, bias, activation, kernel):
        calls.append((tuple(a.shape), tuple(b.shape), activation))
        return launcher(a, b, bias, activation, kernel)

    monkeypatch.setattr(matmul_module, "_matmul", counted)
    return calls


def test_backward_runs_only_the_matmuls_it_needs(monkeypatch):
    calls = counting_launcher(monkeypatch)
    a, b = operands(6, 5, 4, torch.float32, seed=44)
    bias = check.random_tensor((5,), seed=45)
    x = a.clone().requires_grad_()
    matmul(x, b, bias).sum().backward()  # da only, and no activation to differentiate
    assert calls == [((6, 4), (4, 5), None), ((6, 5), (5, 4), None)]
    calls.clear()
    w, c = b.clone().requires_grad_(), bias.clone().requires_grad_()
    matmul(a, w, c, "gelu").sum().backward()  # z recomputed once, then db; dbias is a sum
    assert calls == [((6, 4), (4, 5), "gelu"), ((6, 4), (4, 5), None), ((4, 6), (6, 5), None)]
    assert x.grad is not None and w.grad is not None and c.grad is not None


def test_no_autograd_bookkeeping_without_a_gradient(monkeypatch):
    def refuse(*args):
        raise AssertionError("the operator (and its autograd) with no gradient to compute")

    monkeypatch.setattr(matmul_module, "matmul_op", refuse)
    a, b = operands(6, 5, 4, torch.float32, seed=46)
    assert matmul(a, b).grad_fn is None
    with torch.no_grad():
        out = matmul(a.requires_grad_(), b)
    assert not out.requires_grad
    check.assert_close(out, matmul_ref(a.double(), b.double()), op="matmul")


def test_compiled_forward_calls_the_kernel_operator_and_its_backward_the_operator():
    # forward: torch.ops.brrr._matmul (no autograd kernel); backward: z recomputed, da and db,
    # through torch.ops.brrr.matmul, which is differentiable again; eager's bits throughout
    from test_norm import _check_compiled_keeps_to_the_operators

    a, b = operands(6, 5, 4, torch.float32, seed=47)
    bias = check.random_tensor((5,), torch.float32, seed=48)
    public = lambda a, b, bias: matmul(a, b, bias, "gelu")
    forward, backward = {"brrr._matmul.default"}, {"brrr.matmul.default"}
    _check_compiled_keeps_to_the_operators(public, [a, b, bias], forward, backward)


def test_gradients_of_empty_products():
    a, b = operands(5, 6, 7, torch.float32)
    for x, y in ((a[:0], b), (a, b[:, :0]), (a[:, :0], b[:0])):
        x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
        bias = torch.zeros(y.shape[1], device=DEVICE, requires_grad=True)
        matmul(x, y, bias, "gelu").sum().backward()  # z = 0 + bias = 0 where K == 0
        assert x.grad.shape == x.shape and y.grad.shape == y.shape
        torch.testing.assert_close(bias.grad, torch.full_like(bias, 0.5 * x.shape[0]))  # gelu'(0)


# Profiler names: launch_metadata(grid, compiled kernel, arguments by name) -> dict.
@pytest.mark.parametrize("kernel", [matmul_kernel, matmul_tma_kernel], ids=lambda k: k.fn.__name__)
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_launch_metadata_names_shape_flops_and_bytes(kernel, dtype):
    m, n, k = 300, 70, 129
    c = torch.empty(m, n, dtype=dtype)
    args = {"M": m, "N": n, "K": k, "bias_ptr": c}  # without a bias, c stands in
    compiled = types.SimpleNamespace(name=kernel.fn.__name__)
    describe = attached_metadata(kernel)
    info = describe((4, 1, 1), compiled, args)
    assert info["name"] == f"{kernel.fn.__name__} [M=300, N=70, K=129]"
    assert info["flops"] == 2 * 300 * 70 * 129
    es = 4 if dtype == torch.float32 else 2
    assert info["bytes"] == es * (300 * 129 + 129 * 70 + 300 * 70)
    bias = torch.empty(n, dtype=dtype)
    with_bias = describe((4, 1, 1), compiled, {**args, "bias_ptr": bias})
    assert with_bias["bytes"] == info["bytes"] + es * n


@pytest.mark.gpu
def test_gpu_profiler_hook_sees_named_launches():
    from kernels.bench import launches

    with launches() as seen:
        a, b = operands(512, 384, 256, torch.bfloat16, seed=47)
        matmul(a, b)
        matmul(a, b)  # tuned: launched directly
        torch.cuda.synchronize()
    named = [m for m in seen if m.get("name", "").endswith("[M=512, N=384, K=256]")]
    assert named, [m.get("name") for m in seen]
    assert all(m["flops"] == 2 * 512 * 384 * 256 for m in named)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1000, 4097, 129), (257, 3, 4096)], ids=str)
def test_gpu_sizes_that_are_not_multiples_of_anything(shape, dtype):
    a, b = operands(*shape, dtype, seed=8)
    check_matmul(a, b)  # the autotuner picks a config
    check_matmul(a, b)  # the chosen config, launched directly


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_misaligned_large_problems_go_through_padded_copies(dtype):
    m, n, k = 1031, 1043, 1009  # odd strides and M*N*K over PAD_MIN_WORK
    a, b = operands(m, n, k, dtype, seed=13)
    assert m * n * k >= PAD_MIN_WORK and plan(a, b).pad
    bias = check.random_tensor((n,), dtype, seed=14)
    check_matmul(a, b, bias, "gelu")
    check_matmul(a, b[:, : n - 1])  # a column view: b's rows stay odd, its N too
    check_gradients(a, b, bias, "gelu")  # the backward's matmuls are padded too


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
    assert plan(a, b, "tma") == Plan(False, False, True, b_is_w, input_precision(dtype))
    check_matmul(a, b, fn=matmul_tma)
    check_matmul(a, b, bias, "gelu", fn=matmul_tma)
    check_matmul(a, b, bias, "relu", fn=matmul_pointers)


@pytest.mark.gpu
@pytest.mark.parametrize("b_is_w", [False, True], ids=["b", "W.t()"])
def test_gpu_large_16_bit_problems_go_through_tma_on_hopper(b_is_w):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA needs Hopper (sm_90) or later")
    m, n, k = 4100, 4096, 1040  # M*N*K over TMA_MIN_WORK; M, K not multiples of a tile
    a, b = operands(m, n, k, torch.bfloat16, seed=23)
    if b_is_w:
        b = b.t().contiguous().t()
    assert m * n * k >= TMA_MIN_WORK and uses_tma(a, b) and plan(a, b).tma
    assert not plan(a.float(), b.float()).tma  # fp32 stays on the pointer kernel
    bias = check.random_tensor((n,), torch.bfloat16, seed=24)
    assert chosen_config(a, b, bias, "gelu") == (None, True)  # not tuned yet
    check_matmul(a, b, bias, "gelu")  # tunes, then launches through the autotuner
    config, tma = chosen_config(a, b, bias, "gelu")
    assert tma and config is not None
    check_matmul(a, b, bias, "gelu")  # launches with the chosen config directly


def test_plan_decides_once_per_layout_and_precision(monkeypatch):
    decided = []
    decide = tuning._decide
    monkeypatch.setattr(tuning, "_decide", lambda *args: decided.append(args) or decide(*args))
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    for _ in range(3):
        plan(a, b)
    assert len(decided) == 1
    plan(a, b.t().contiguous().t())  # another layout of b
    with _precision("high"):
        assert plan(a, b).input_precision == "tf32"  # the fp32 setting is part of the key
    assert len(decided) == 3 and plan(a, b).input_precision == "ieee"


@contextlib.contextmanager
def _precision(value):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
