import math
from types import SimpleNamespace

import pytest
import torch
from attention_checks import (
    check_every_config,
    make_inputs,
    reference,
    run_and_check,
)
from params import CPU_DTYPES, DTYPES, attached_metadata

from kernels import check
from kernels.attention import (
    attention,
    attention_forward,
    attention_fwd_kernel,
    attention_ref,
    forward_metadata,
)
from kernels.attention_backward import (
    attention_backward,
    attention_bwd_dkdv_kernel,
    attention_bwd_dq_kernel,
    dkdv_metadata,
    dq_metadata,
)
from kernels.attention_tuning import (
    visible_scores,
)
from kernels.runtime import DEVICE, ON_GPU
from kernels.validate import input_precision

GPU = pytest.mark.gpu
# (B, H, Sq, Sk, D): tiny for the interpreter; Sq = 1 and Sq < Sk are decoding against a KV cache
SHAPES = [
    (1, 2, 1, 1, 16),
    (2, 1, 17, 17, 32),
    (1, 2, 33, 47, 64),
    (1, 1, 1, 65, 64),
    (1, 2, 65, 65, 64),
    (1, 1, 40, 57, 128),
]
GPU_SHAPES = [
    pytest.param(s, marks=GPU, id=str(s))
    for s in [(2, 3, 113, 203, 64), (1, 2, 203, 203, 128), (2, 2, 1, 1000, 128),
              (1, 4, 1025, 1025, 64), (1, 2, 127, 4097, 128), (3, 1, 129, 129, 16)]
]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + GPU_SHAPES, ids=str)
def test_attention_and_gradients_match_reference(shape, dtype, causal):
    if dtype == torch.float16 and shape[-1] == 128 and not ON_GPU:
        pytest.skip("fp16 at D=128 is covered on the GPU (interpreter time)")
    q, k, v, do = make_inputs(shape, dtype, seed=sum(shape))
    run_and_check(q, k, v, do, causal, dtype, baseline=dtype != torch.float32)


def test_log_sum_exp_is_saved_per_row():
    q, k, v, _ = make_inputs((1, 2, 20, 37, 32), torch.float32, seed=3)
    out, lse = attention_forward(q, k, v, causal=True, sm_scale=0.3)
    scores = (q.double() @ k.double().transpose(-2, -1)) * 0.3
    visible = torch.ones(20, 37, dtype=torch.bool, device=DEVICE).tril(37 - 20)
    expected = torch.logsumexp(scores.masked_fill(~visible, -math.inf), dim=-1)
    check.assert_close(lse, expected, op="attention", dtype=torch.float32)
    check.assert_close(
        out, attention_ref(q.double(), k.double(), v.double(), True, 0.3), op="attention"
    )


def test_causal_row_with_a_single_key_returns_that_value():
    q, k, v, do = make_inputs((1, 2, 19, 19, 16), torch.float32, seed=5)
    out = run_and_check(q, k, v, do, True, torch.float32)
    # query 0 sees key 0 only: softmax over one score is 1, the output is v[0] exactly
    check.assert_close(out[:, :, 0], v[:, :, 0].double(), op="attention", dtype=torch.float32)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_large_logits_stay_finite(dtype):
    # scores reach +-80: exp() of them overflows fp16 (and exp(89) would overflow fp32)
    q, k, v, do = make_inputs((1, 1, 33, 49, 64), dtype, seed=7, scale=3.0)
    scores = q.double() @ k.double().transpose(-2, -1)
    sm_scale = 80.0 / scores.abs().max().item()
    for causal in (False, True):
        out = run_and_check(q.clone(), k.clone(), v.clone(), do, causal, dtype, sm_scale=sm_scale)
        assert torch.isfinite(out).all()


def test_non_contiguous_inputs_and_gradient():
    B, H, Sq, Sk, D = 2, 2, 23, 31, 32
    q = check.random_tensor((B, Sq, H, D), seed=11).transpose(1, 2)  # (B, S, H, D) layout
    k = check.random_tensor((B, H, Sk, 2 * D), seed=12)[..., :D]  # rows 2D apart
    v = check.random_tensor((B, H, D, Sk), seed=13).transpose(2, 3)  # head dim not unit-stride
    do = check.random_tensor((B, H, 1, D), seed=14).expand(B, H, Sq, D)  # stride 0 over rows
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    run_and_check(q, k, v, do, True, torch.float32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "configs",
    [((16, 16), (16, 16), (16, 16)), ((16, 32), (32, 16), (16, 32))],
    ids=["square-blocks", "swapped-blocks"],
)
def test_block_sizes_do_not_change_the_result(configs, causal):
    # the loop bounds (skipped, masked and unmasked blocks) depend on BLOCK_M vs BLOCK_N
    q, k, v, do = make_inputs((1, 1, 37, 61, 16), torch.float32, seed=17)
    fwd, dkdv, dq = ((*c, 4, 1) for c in configs)
    expected = reference(q, k, v, do, causal)
    out, lse = attention_forward(q, k, v, causal, 0.25, config=fwd)
    grads = attention_backward(do, q, k, v, out, lse, causal, 0.25, "ieee", configs=(dkdv, dq))
    for got, want in zip((out, *grads), expected, strict=True):
        check.assert_close(got, want, op="attention", dtype=torch.float32)


def test_empty_inputs():
    q, k, v, do = make_inputs((0, 2, 5, 7, 16), torch.float32)
    q.requires_grad_()
    out = attention(q, k, v)
    assert out.shape == (0, 2, 5, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape
    q, k, v, _ = make_inputs((1, 2, 0, 7, 16), torch.float32)  # no queries: zero gradients
    k.requires_grad_()
    out = attention(q, k, v, causal=True)
    out.sum().backward()
    assert out.shape == (1, 2, 0, 16) and torch.equal(k.grad, torch.zeros_like(k))


def test_bad_inputs_get_clear_errors():
    q, k, v, _ = make_inputs((1, 2, 8, 8, 16), torch.float32)
    with pytest.raises(ValueError, match="head dim 257 is not supported: head dims 1 to 256"):
        x = torch.ones(1, 2, 8, 257, device=DEVICE)
        attention(x, x, x)
    with pytest.raises(ValueError, match="head dim 0 is not supported"):
        attention(q[..., :0], k[..., :0], v[..., :0])
    with pytest.raises(TypeError, match="share a dtype"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        attention(q.int(), k.int(), v.int())
    with pytest.raises(ValueError, match="Sq=8 > Sk=4"):
        attention(q, k[:, :, :4], v[:, :, :4])
    with pytest.raises(ValueError, match=r"batch and head dim.*\(1, 2, 8, 16\).*\(1, 2, 8, 8"):
        attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match=r"batch and head dim.*\(2, 2, 8, 16\)"):
        attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="must have 4 dims"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="sm_scale must be a positive"):
        attention(q, k, v, sm_scale=-1.0)
    elsewhere = torch.empty(1, 2, 8, 16, device="meta")
    with pytest.raises(ValueError, match=f"is on meta but the kernels run on {DEVICE.type}"):
        attention(elsewhere, elsewhere, elsewhere)


def test_fp32_precision_follows_torch():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert input_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert input_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert input_precision(torch.bfloat16) == "tf32"  # ignored for 16-bit inputs


@pytest.mark.parametrize("Sq, Sk", [(1, 1), (1, 40), (5, 37), (33, 33)], ids=str)
def test_visible_scores_count_the_reference_mask(Sq, Sk):
    # the FLOPs a profiler reports count exactly the scores attention_ref's causal mask keeps
    visible = torch.ones(Sq, Sk, dtype=torch.bool).tril(diagonal=Sk - Sq)
    assert visible_scores(Sq, Sk, causal=True) == int(visible.sum())
    assert visible_scores(Sq, Sk, causal=False) == Sq * Sk


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_launch_metadata_names_shape_flops_and_bytes(dtype, causal):
    B, H, Sq, Sk, D = 3, 5, 7, 11, 64
    size = torch.empty((), dtype=dtype).element_size()
    q, do, o, dq = (torch.empty(B, H, Sq, D, dtype=dtype, device="meta") for _ in range(4))
    k, v, dk, dv = (torch.empty(B, H, Sk, D, dtype=dtype, device="meta") for _ in range(4))
    lse, delta = (torch.empty(B, H, Sq, device="meta") for _ in range(2))  # fp32
    args = dict(Q=q, K=k, V=v, O=o, LSE=lse, DO=do, DELTA=delta, DQ=dq, DK=dk, DV=dv,
                CAUSAL=causal, BLOCK_M=32, BLOCK_N=16)  # fmt: skip
    scores = B * H * (Sq * Sk - Sq * (Sq - 1) // 2 if causal else Sq * Sk)
    q_bytes, kv_bytes, row_bytes = B * H * Sq * D * size, B * H * Sk * D * size, B * H * Sq * 4
    expected = {  # (metadata, kernel, FLOPs, compulsory bytes)
        "forward": (forward_metadata, attention_fwd_kernel, 4 * D * scores,
                    2 * q_bytes + 2 * kv_bytes + row_bytes),  # Q, K, V in; O, LSE out
        "dK/dV": (dkdv_metadata, attention_bwd_dkdv_kernel, 8 * D * scores,
                  2 * q_bytes + 4 * kv_bytes + 2 * row_bytes),  # Q, dO, K, V, LSE, delta; dK, dV
        "dQ": (dq_metadata, attention_bwd_dq_kernel, 6 * D * scores,
               2 * q_bytes + 2 * kv_bytes + 2 * row_bytes + q_bytes),  # ... and dQ out
    }  # fmt: skip
    for label, (metadata, kernel, flops, nbytes) in expected.items():
        got = metadata((1, H, B), SimpleNamespace(name="kernel_name"), args)
        shape = f"B={B} H={H} Sq={Sq} Sk={Sk} D={D}" + (" causal" if causal else "")
        assert got == {"name": f"kernel_name [{shape}]", "flops": flops, "bytes": nbytes}, label
        # the kernel carries it (a JITFunction as an attribute, the interpreter among its kwargs)
        carried = attached_metadata(kernel)
        assert carried is metadata, label


@GPU
def test_profiler_hook_sees_named_launches():
    from kernels.bench import launches

    with launches() as seen:
        q, k, v, do = make_inputs((2, 3, 129, 257, 64), torch.bfloat16, seed=31)
        q.requires_grad_()
        attention(q, k, v, causal=True).backward(do)
        torch.cuda.synchronize()
    names = {m["name"]: m for m in seen}
    shape = "[B=2 H=3 Sq=129 Sk=257 D=64 causal]"
    forward = names[f"attention_fwd_kernel {shape}"]
    assert forward["flops"] == 4 * 64 * 2 * 3 * visible_scores(129, 257, True)
    assert f"attention_bwd_dkdv_kernel {shape}" in names
    assert f"attention_bwd_dq_kernel {shape}" in names


@GPU
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_is_deterministic_on_gpu(causal):
    q, k, v, do = make_inputs((2, 4, 1000, 1000, 128), torch.bfloat16, seed=23)
    runs = []
    for _ in range(2):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        attention(qq, kk, vv, causal=causal).backward(do)
        runs.append((qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), (
        "no atomics: bitwise equal runs"
    )


@GPU
def test_fp32_on_gpu_is_ieee_at_highest_precision():
    q, k, v, do = make_inputs((1, 2, 129, 257, 64), torch.float32, seed=29)
    run_and_check(q, k, v, do, True, torch.float32)


@GPU
@pytest.mark.parametrize(
    "Sq, D, causal",
    [(1024, 64, False), (1024, 64, True), (1024, 128, False), (1024, 128, True), (16, 128, True)],
    ids=str,
)
def test_every_gpu_config_matches_reference(Sq, D, causal):
    # The autotuner may pick any candidate; each one is checked here, at a benchmark-like shape.
    dtype, Sk, scale = torch.bfloat16, 1024, 1 / math.sqrt(D)
    q, k, v, do = make_inputs((1, 16, Sq, Sk, D), dtype, seed=D + Sq)
    check_every_config(q, k, v, do, causal, scale)
