"""The batch-invariant kernels: correct against references, and the mode that routes torch's
ops to them. Invariance itself is checked in test_invariance_harness.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from params import DTYPES, attached_metadata

from kernels import batch_invariant as bi
from kernels import check
from kernels.batch_invariant import full_k_matmul, rows, split_kv_attention
from kernels.batch_invariant.rows import mean, softmax
from kernels.batch_invariant.split_kv_attention import CONFIG as ATTENTION_CONFIG
from kernels.runtime import DEVICE


def _inputs(shape, dtype, seed, scale=1.0):
    return check.random_tensor(shape, dtype, seed=seed, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (129, 1000), (2, 3, 4097)], ids=str)
def test_rms_norm_matches_reference(shape, dtype):
    x = _inputs(shape, dtype, seed=1, scale=2.0)
    w = _inputs(shape[-1:], dtype, seed=2)
    r = check.against_fp64(bi.rms_norm, x, w, ref=bi.rms_norm_ref, op="reduction")
    assert r.ok, r.message


MATMUL_SHAPES = [(1, 1, 1), (3, 127, 129), (129, 65, 33), (127, 129, 1), (65, 300, 129)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("epilogue", [(False, None), (True, "gelu"), (True, "relu")], ids=str)
@pytest.mark.parametrize("mkn", MATMUL_SHAPES, ids=str)
def test_matmul_matches_reference(mkn, epilogue, dtype):
    M, K, N = mkn
    has_bias, activation = epilogue
    a, b = _inputs((M, K), dtype, seed=3), _inputs((K, N), dtype, seed=4)
    bias = _inputs((N,), dtype, seed=5) if has_bias else None
    r = check.against_fp64(
        bi.matmul, a, b, bias, activation, ref=bi.matmul_ref, op="matmul", baseline=_torch_matmul
    )
    assert r.ok, r.message


def _torch_matmul(a, b, bias, activation):
    """PyTorch's own result in the inputs' dtype: the baseline of the 'twice torch's error' rule."""
    out = a @ b if bias is None else torch.addmm(bias, a, b)
    return {None: out, "gelu": F.gelu(out), "relu": torch.relu(out)}[activation]


def test_matmul_odd_inputs():
    a, b = _inputs((48, 40), torch.float32, seed=6), _inputs((64, 48), torch.float32, seed=7)
    check.assert_close(bi.matmul(a.t(), b.t()), a.t().double() @ b.t().double(), op="matmul")
    assert bi.matmul(a[:0], b.t()[:40]).shape == (0, 64)
    bias = _inputs((64,), torch.float32, seed=8)
    empty_k = bi.matmul(a[:, :0], b.t()[:0], bias, "relu")  # no reduction: relu(bias) per row
    assert torch.equal(empty_k, torch.relu(bias).expand(48, 64))
    with pytest.raises(ValueError, match=r"a @ b needs a.s columns to match b.s rows"):
        bi.matmul(a, b)
    with pytest.raises(ValueError, match="activation"):
        bi.matmul(a, b.t()[:40], activation="tanh")
    with pytest.raises(TypeError, match="supported"):
        bi.matmul(a.int(), b.int())


ATTENTION_SHAPES = [  # B, H, Sq, Sk, D
    (1, 1, 1, 1, 16),
    (2, 3, 1, 130, 16),
    (1, 2, 37, 37, 24),
    (2, 1, 5, 2 * ATTENTION_CONFIG["SPLIT_SIZE"] + 3, 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=str)
def test_attention_matches_reference(shape, causal, dtype):
    B, H, Sq, Sk, D = shape
    q = _inputs((B, H, Sq, D), dtype, seed=9)
    k, v = _inputs((B, H, Sk, D), dtype, seed=10), _inputs((B, H, Sk, D), dtype, seed=11)
    r = check.against_fp64(
        bi.attention, q, k, v, causal=causal, ref=bi.attention_ref, op="attention"
    )
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_with_kv_lens_equals_each_sequence_alone(dtype):
    """A padded batch of sequences of different lengths, decoded together, gives each one the
    bits it gets alone and unpadded (and the reference's values)."""
    lens = [1, 64, 100, 37]
    B, H, L, D = len(lens), 2, max(lens) + 20, 16
    q = _inputs((B, H, 1, D), dtype, seed=12)
    k, v = _inputs((B, H, L, D), dtype, seed=13), _inputs((B, H, L, D), dtype, seed=14)
    r = check.against_fp64(
        bi.attention, q, k, v, causal=True, kv_lens=lens, ref=bi.attention_ref, op="attention"
    )
    assert r.ok, r.message
    k[0, :, lens[0] :] = float("nan")  # padding is never read into the result
    out = bi.attention(q, k, v, causal=True, kv_lens=torch.tensor(lens))
    for b, n in enumerate(lens):
        alone = bi.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=True)
        assert torch.equal(out[b : b + 1], alone), f"sequence {b} (length {n})"


def test_attention_edge_cases():
    q = _inputs((2, 1, 3, 16), torch.float32, seed=15)
    k = _inputs((2, 1, 8, 16), torch.float32, seed=16)
    out = bi.attention(q, k, k, causal=True, kv_lens=[0, 2])
    assert torch.equal(out[0], torch.zeros_like(out[0])), "no visible key: zeros"
    assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0])), "query before every key"
    check.assert_close(out, bi.attention_ref(q, k, k, causal=True, kv_lens=[0, 2]), op="attention")
    assert bi.attention(q[:0], k[:0], k[:0]).shape == (0, 1, 3, 16)
    with pytest.raises(ValueError, match="Sq <= Sk"):
        bi.attention(k, q, q)
    with pytest.raises(ValueError, match="kv_lens must be in"):
        bi.attention(q, k, k, kv_lens=[9, 1])
    with pytest.raises(TypeError, match="integer"):
        bi.attention(q, k, k, kv_lens=torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_grouped_query_with_kv_lens(dtype):
    """H = 6 query heads on H_kv = 2 key/value heads, decoding a padded batch: the reference's
    values, each sequence's bits alone, and the bits of k and v copied out to H heads."""
    lens, (H, h_kv, D) = [3, 70, 2], (6, 2, 16)
    B, L = len(lens), max(lens) + 5
    q = _inputs((B, H, 2, D), dtype, seed=22)
    k, v = _inputs((B, h_kv, L, D), dtype, seed=23), _inputs((B, h_kv, L, D), dtype, seed=24)
    r = check.against_fp64(
        bi.attention, q, k, v, causal=True, kv_lens=lens, ref=bi.attention_ref, op="attention"
    )
    assert r.ok, r.message
    out = bi.attention(q, k, v, causal=True, kv_lens=lens)
    copied = [t.repeat_interleave(H // h_kv, dim=1) for t in (k, v)]
    assert torch.equal(out, bi.attention(q, *copied, causal=True, kv_lens=lens))
    for b, n in enumerate(lens):
        alone = bi.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=True)
        assert torch.equal(out[b : b + 1], alone), f"sequence {b} (length {n})"


@pytest.mark.parametrize("D", [80, 256], ids=lambda d: f"D={d}")
def test_attention_head_dims_up_to_256(D):
    q = _inputs((1, 2, 3, D), torch.float32, seed=25)
    k, v = _inputs((1, 1, 70, D), torch.float32, seed=26), _inputs((1, 1, 70, D), torch.float32, 27)
    r = check.against_fp64(bi.attention, q, k, v, causal=True, ref=bi.attention_ref, op="attention")
    assert r.ok, r.message


def test_attention_limits_are_clear_errors_before_launch():
    for D in (257, 1024):  # 1024: KernelBench level 1 problem 97, which crashed inside Triton
        x = torch.ones(1, 1, 4, D, device=DEVICE)
        with pytest.raises(ValueError, match=f"head dim {D} is not supported: head dims 1 to 256"):
            bi.attention(x, x, x)
    q, k = torch.ones(1, 3, 4, 16, device=DEVICE), torch.ones(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"H=3 must be a multiple of .* H_kv=2"):
        bi.attention(q, k, k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("D", [64, 80, 256], ids=lambda d: f"D={d}")
def test_gpu_attention_grouped_query_head_dims(D, dtype):
    lens = [1, 300, 1000, 517]
    q = _inputs((4, 32, 1, D), dtype, seed=28)
    k, v = _inputs((4, 8, 1000, D), dtype, seed=29), _inputs((4, 8, 1000, D), dtype, seed=30)
    r = check.against_fp64(
        bi.attention, q, k, v, causal=True, kv_lens=lens, ref=bi.attention_ref, op="attention"
    )
    assert r.ok, r.message
    out = bi.attention(q, k, v, causal=True, kv_lens=lens)
    for b, n in enumerate(lens):
        alone = bi.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=True)
        assert torch.equal(out[b : b + 1], alone), f"sequence {b} (length {n})"


def test_row_reductions_match_torch():
    x = _inputs((5, 3, 1000), torch.float32, seed=17, scale=3.0)
    masked = x.masked_fill(x < 1.0, float("-inf"))
    cases = [
        (mean, x, dict(keepdim=True), lambda t, keepdim: t.mean(-1, keepdim=keepdim)),
        (softmax, x, {}, lambda t: torch.softmax(t, -1)),
        (softmax, x, dict(log=True), lambda t, log: torch.log_softmax(t, -1)),
        (softmax, masked, {}, lambda t: torch.softmax(t, -1)),
    ]
    for fn, t, kwargs, ref in cases:
        r = check.against_fp64(fn, t, ref=ref, op="reduction", **kwargs)
        assert r.ok, f"{fn.__name__}({kwargs}): {r.message}"


def test_launch_metadata_names_each_launch_with_its_shape_flops_and_bytes():
    """Each invariant kernel carries its metadata function, and each function's name and
    formulas, on the arguments a launch binds (by name), give these hand-counted values."""
    half, single = torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float32)
    q = torch.empty((2, 4, 3, 8), dtype=torch.float16)  # B = 2, H = 4, Sq = 3, D = 8
    cases = [  # kernel, arguments, name, FLOPs, bytes
        (rows.rms_norm_kernel, dict(n_rows=3, n_cols=5, x_ptr=half, w_ptr=half, out_ptr=half),
         "rms_norm_kernel [rows=3, cols=5]", 60, 30 + 10 + 30),
        (rows.row_mean_kernel, dict(n_rows=3, n_cols=5, x_ptr=half, out_ptr=single),
         "row_mean_kernel [rows=3, cols=5]", 15, 30 + 12),
        (rows.softmax_kernel, dict(n_rows=3, n_cols=5, x_ptr=half, out_ptr=single),
         "softmax_kernel [rows=3, cols=5]", 105, 30 + 60),
        (full_k_matmul.invariant_matmul_kernel,
         dict(M=3, N=5, K=7, bias_ptr=torch.empty((3, 5), dtype=torch.float16)),  # c stands in
         "invariant_matmul_kernel [M=3, N=5, K=7]", 210, 2 * (21 + 35 + 15)),
        (split_kv_attention.attention_split_kernel,  # k and v: H_kv = 4 // 2 heads
         dict(q_ptr=q, H=4, GROUP=2, Sq=3, Sk=10, D=8, n_splits=2),
         "attention_split_kernel [B=2, H=4, Sq=3, Sk=10, D=8, splits=2]",
         4 * 2 * 4 * 3 * 10 * 8, 2 * 8 * (24 + 2 * 40) + 4 * 24 * 2 * 10),
        (split_kv_attention.attention_combine_kernel,
         dict(n_rows=24, n_splits=2, D=8, out_ptr=half),
         "attention_combine_kernel [rows=24, splits=2, D=8]", 24 * (2 * 27 + 8), 1920 + 384),
    ]  # fmt: skip
    for kernel, args, name, flops, moved in cases:
        metadata = attached_metadata(kernel)
        assert callable(metadata), f"{name}: no launch_metadata"
        got = metadata((1,), SimpleNamespace(name=name.split()[0]), args)
        assert got == {"name": name, "flops": flops, "bytes": moved}, name


@pytest.mark.gpu
def test_gpu_profiler_hook_sees_each_launch_by_name():
    """A profiler's launch hook (what Proton sets) gets the metadata of real launches."""
    from kernels.bench import launches

    with launches() as launched:
        x = check.random_tensor((33, 64), torch.float16, seed=40, device=DEVICE)
        bi.rms_norm(x, x[0])
        bi.matmul(x, x.t())
        q = check.random_tensor((1, 2, 5, 16), torch.float16, seed=41, device=DEVICE)
        bi.attention(q, q, q, causal=True)
        torch.cuda.synchronize()
    seen = [m["name"] for m in launched]
    for name in ("rms_norm_kernel [rows=33, cols=64]", "invariant_matmul_kernel [M=33, N=33, K=64]",
                 "attention_split_kernel [B=1, H=2, Sq=5, Sk=5, D=16, splits=1]"):  # fmt: skip
        assert name in seen, (name, seen)
    # the split kernel's last piece combines (arrival counters): no second launch
    assert not any(name.startswith("attention_combine_kernel") for name in seen), seen


def test_mode_routes_torch_ops_and_restores_them():
    a = _inputs((33, 40), torch.float32, seed=18)
    w = _inputs((24, 40), torch.float32, seed=19)
    bias = _inputs((24,), torch.float32, seed=20)
    before = (torch.mm(a, w.t()), F.linear(a, w, bias), torch.log_softmax(a, -1), a.mean(-1))
    in_fp64 = torch.mm(a.double(), w.t().double())
    assert not bi.enabled()
    with bi.batch_invariant_mode():
        assert bi.enabled()
        assert torch.equal(torch.mm(a, w.t()), bi.matmul(a, w.t()))
        assert torch.equal(a @ w.t(), bi.matmul(a, w.t()))
        assert torch.equal(F.linear(a, w, bias), bi.matmul(a, w.t(), bias))
        three_d = F.linear(a.view(3, 11, 40), w, bias)
        assert torch.equal(three_d.view(33, 24), bi.matmul(a, w.t(), bias))
        assert torch.equal(torch.addmm(bias, a, w.t(), beta=0.5), bi.matmul(a, w.t()) + bias * 0.5)
        assert torch.equal(torch.log_softmax(a, -1), softmax(a, log=True))
        assert torch.equal(torch.softmax(a, -1), softmax(a))
        assert torch.equal(a.mean(-1), mean(a))
        with bi.batch_invariant_mode():  # nesting is harmless
            assert torch.equal(torch.mm(a, w.t()), bi.matmul(a, w.t()))
        assert bi.enabled()
        # what the kernels do not take still works: fp64, other dims
        fallback = torch.mm(a.double(), w.t().double())
        check.assert_close(fallback, in_fp64, op="matmul", dtype=torch.float32)
        check.assert_close(a.mean(0), a.double().mean(0), op="reduction")
        check.assert_close(torch.softmax(a, 0), torch.softmax(a.double(), 0), op="reduction")
    assert not bi.enabled()
    after = (torch.mm(a, w.t()), F.linear(a, w, bias), torch.log_softmax(a, -1), a.mean(-1))
    for op_before, op_after in zip(before, after, strict=True):
        assert torch.equal(op_before, op_after)


def test_mode_is_restored_after_an_error():
    a = _inputs((4, 8), torch.float32, seed=21)
    with pytest.raises(RuntimeError, match="inside"):
        with bi.batch_invariant_mode():
            raise RuntimeError("inside")
    assert not bi.enabled()
    assert torch.equal(torch.mm(a, a.t()), torch.mm(a, a.t()))
