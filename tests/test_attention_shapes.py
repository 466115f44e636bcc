"""kernels.attention at the shapes real models and outside suites use: grouped-query heads
(H a multiple of H_kv) and every head dim up to 256, forward and gradients, against the fp64
reference on repeat_interleave'd k and v; the limits as clear errors before any launch."""

import pytest
import torch
from attention_checks import (
    check_every_config,
    make_inputs,
    run_and_check,
)
from params import CPU_DTYPES

from kernels import check
from kernels.attention import attention
from kernels.attention_tuning import (
    HEAD_DIM_CLASSES,
    MAX_HEAD_DIM,
    SHARED_MEMORY_PER_BLOCK,
    block_d,
    dkdv_candidates,
    dq_candidates,
    forward_candidates,
    shared_memory_estimate,
)
from kernels.runtime import DEVICE

GPU = pytest.mark.gpu
# flash-attention's test suite's head dims besides the powers of two, and the large ones
HEAD_DIMS = [40, 59, 80, 96, 111, 160, 192, 224, 256]
# (H, H_kv): plain multi-head and the ratios of SmolLM2 (9/3) and llama (32/8), with few heads
GROUPS = [(2, 2), (6, 2), (4, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("heads", GROUPS, ids=lambda h: f"H={h[0]},H_kv={h[1]}")
def test_grouped_query_attention_and_gradients(heads, dtype, causal):
    # Sq < Sk and Sq = 1 (decoding against a cache) across blocks of the CPU configs
    H, h_kv = heads
    for B, Sq, Sk in ((1, 17, 33), (2, 1, 3)):
        q, k, v, do = make_inputs((B, H, Sq, Sk, 16), dtype, seed=H + Sq, h_kv=h_kv)
        run_and_check(q, k, v, do, causal, dtype, baseline=dtype != torch.float32)


def test_grouped_query_heads_read_their_own_key_value_head():
    # each group's query heads see only their key/value head: zeroing one changes their rows
    # alone, and the gradients of a head nobody else reads stay in that head
    q, k, v, do = make_inputs((1, 6, 5, 9, 16), torch.float32, seed=3, h_kv=3)
    out = attention(q, k, v)
    v2 = v.clone()
    v2[:, 1] = 0.0
    out2 = attention(q, k, v2)
    assert torch.equal(out2[:, 2:4], torch.zeros_like(out2[:, 2:4])), "heads 2, 3 read k/v head 1"
    assert torch.equal(out2[:, :2], out[:, :2]) and torch.equal(out2[:, 4:], out[:, 4:])
    k = k.requires_grad_()
    do[:, 2:4] = 0.0  # no gradient flows into the outputs that read key/value head 1
    attention(q, k, v).backward(do)
    assert torch.equal(k.grad[:, 1], torch.zeros_like(k.grad[:, 1]))
    assert k.grad[:, 0].abs().sum() > 0 and k.grad[:, 2].abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", HEAD_DIMS, ids=lambda d: f"D={d}")
def test_every_head_dim_up_to_256(D, causal):
    # fp32 on a CPU (interpreter time); Sq < Sk; grouped-query heads at the same time
    q, k, v, do = make_inputs((1, 2, 17, 21, D), torch.float32, seed=D, h_kv=1)
    run_and_check(q, k, v, do, causal, torch.float32)


@pytest.mark.parametrize("D", [1, 3, 59, 111], ids=lambda d: f"D={d}")
def test_small_and_odd_head_dims_in_fp16(D):
    # D = 1 computes on 16 columns (tl.dot's smallest), 15 of them padding
    q, k, v, do = make_inputs((1, 2, 5, 18, D), torch.float16, seed=D)
    run_and_check(q, k, v, do, True, torch.float16, baseline=True)


def test_padded_head_dim_reads_and_writes_only_its_columns():
    # a (B, H, S, 80) view of wider rows: the 48 padded columns of each tile are never read
    # (NaN there would reach every output) and never written (the next head's values)
    wide = [check.random_tensor((1, 2, 19, 96), torch.float32, seed=s) for s in (1, 2, 3)]
    for t in wide:
        t[..., 80:] = float("nan")
    q, k, v = (t[..., :80] for t in wide)
    do = check.random_tensor((1, 2, 19, 80), torch.float32, seed=4)
    run_and_check(q, k, v, do, True, torch.float32)


def test_head_dims_past_the_limit_are_refused_before_launch():
    x = torch.ones(1, 1, 4, MAX_HEAD_DIM + 1, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 257 is not supported: head dims 1 to 256"):
        attention(x, x, x)
    big = torch.ones(1, 1, 4, 1024, device=DEVICE)  # KernelBench level 1 problem 97's head dim
    with pytest.raises(ValueError, match="head dim 1024 is not supported"):
        attention(big, big, big)


def test_heads_that_are_not_a_multiple_get_a_clear_error():
    q, k, v, _ = make_inputs((1, 6, 4, 4, 16), torch.float32, h_kv=4)
    with pytest.raises(ValueError, match=r"H=6 must be a multiple of .* H_kv=4"):
        attention(q, k, v)
    with pytest.raises(ValueError, match=r"H=2 must be a multiple of .* H_kv=4"):
        attention(q[:, :2], k, v)  # more key/value heads than query heads
    with pytest.raises(ValueError, match=r"H=6 must be a multiple of .* H_kv=0"):
        attention(q, k[:, :0], v[:, :0])


def test_head_dim_padding_rule():
    assert [block_d(d) for d in (1, 16, 17, 40, 64, 65, 111, 128, 129, 256)] == [
        16, 16, 32, 64, 64, 128, 128, 128, 256, 256
    ]  # fmt: skip


@pytest.mark.parametrize("element_size", [2, 4], ids=["16-bit", "fp32"])
def test_every_candidate_fits_hoppers_shared_memory(element_size):
    # the upper-bound estimate, for the largest head dim each candidate list serves
    dtype = torch.float16 if element_size == 2 else torch.float32
    lists = {"forward": forward_candidates, "dkdv": dkdv_candidates, "dq": dq_candidates}
    for d in HEAD_DIM_CLASSES:
        for seq_q in (1, 4096):
            for name, candidates in lists.items():
                for config in candidates(dtype, d, seq_q):
                    need = shared_memory_estimate(name, config, d, element_size)
                    assert need <= SHARED_MEMORY_PER_BLOCK, (name, config, d, need)
    # and the estimate counts what it says: Q once, K and V per stage, one P tile (D = 256)
    assert shared_memory_estimate("forward", (64, 32, 4, 2), 200, 2) == 2 * (
        64 * 256 + 2 * 2 * 32 * 256 + 64 * 32
    )


@GPU
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [1, *HEAD_DIMS], ids=lambda d: f"D={d}")
def test_every_head_dim_in_bf16_on_gpu(D, causal):
    q, k, v, do = make_inputs((2, 8, 203, 331, D), torch.bfloat16, seed=D, h_kv=2)
    run_and_check(q, k, v, do, causal, torch.bfloat16, baseline=True)


@GPU
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(9, 3), (32, 8)], ids=lambda h: f"H={h[0]},H_kv={h[1]}")
def test_grouped_query_in_bf16_on_gpu(heads, causal):
    H, h_kv = heads
    for Sq, Sk in ((1, 1000), (129, 1025), (1024, 1024)):
        q, k, v, do = make_inputs((2, H, Sq, Sk, 64), torch.bfloat16, seed=Sq, h_kv=h_kv)
        run_and_check(q, k, v, do, causal, torch.bfloat16, baseline=True)


@GPU
def test_grouped_query_gradients_are_deterministic_on_gpu():
    q, k, v, do = make_inputs((2, 32, 1000, 1000, 64), torch.bfloat16, seed=5, h_kv=8)
    runs = []
    for _ in range(2):
        kk, vv = (x.clone().requires_grad_() for x in (k, v))
        attention(q, kk, vv, causal=True).backward(do)
        runs.append((kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), "a fixed order, bitwise"


@GPU
@pytest.mark.parametrize("D", [80, 160, 256], ids=lambda d: f"D={d}")
@pytest.mark.parametrize("Sq", [16, 1024], ids=lambda s: f"Sq={s}")
def test_every_gpu_config_for_large_head_dims(Sq, D):
    # the unmeasured D > 128 lists (and D = 80 on the D = 128 ones): each compiles and is right
    dtype, Sk, causal, scale = torch.bfloat16, 1024, True, D**-0.5
    q, k, v, do = make_inputs((1, 8, Sq, Sk, D), dtype, seed=D + Sq, h_kv=2)
    check_every_config(q, k, v, do, causal, scale)


@GPU
def test_fp32_large_head_dim_on_gpu():
    q, k, v, do = make_inputs((1, 4, 129, 257, 256), torch.float32, seed=31, h_kv=2)
    run_and_check(q, k, v, do, True, torch.float32)
