"""kernels.distributed on a CPU: two gloo processes per test, each ending by itself; the
NCCL runs are marked two_gpus and skipped, with the reason, on fewer GPUs."""

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from kernels import check
from kernels.distributed import RankError, collectives, invariance, launch, overlap, run_ranks, tp
from kernels.llm import load_model

TIMEOUT = 20  # seconds: a test that spawns ranks stays within it


# Rank functions: at the top level of a module, so that a spawned process can import them.


def sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": t.item()}


def fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one's own error")
    return rank


def hangs_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def mode_of_rank(rank, world_size):
    from kernels import runtime

    return (os.environ.get("CUDA_VISIBLE_DEVICES"), runtime.ON_GPU, runtime.INTERPRET)


def no_process_left():
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not multiprocessing.active_children()


def test_run_ranks_returns_what_each_rank_returns_in_rank_order():
    got = run_ranks(sum_of_ranks, 2, 10, timeout_s=TIMEOUT)
    assert got == [{"rank": r, "world_size": 2, "sum": 21.0} for r in (0, 1)]
    assert no_process_left()


def test_cpu_ranks_run_in_the_cpu_mode_on_any_machine():
    """On a GPU machine too: the course's kernels then take the ranks' CPU tensors."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert run_ranks(mode_of_rank, 2, timeout_s=TIMEOUT) == [("", False, True)] * 2
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(RankError, match="rank 1 failed") as info:
        run_ranks(fails_on_rank_one, 2, timeout_s=TIMEOUT)
    assert info.value.rank == 1
    assert "ValueError: rank one's own error" in info.value.details
    assert no_process_left()


def test_a_rank_past_its_time_is_named_and_ended():
    start = time.monotonic()
    with pytest.raises(RankError, match="still running after 3 s") as info:
        run_ranks(hangs_on_rank_one, 2, timeout_s=3)
    assert info.value.rank == 1 and time.monotonic() - start < TIMEOUT
    assert no_process_left()


def test_fork_runs_a_function_defined_anywhere():
    def local(rank, world_size):
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)
        return t

    got = run_ranks(local, 2, start_method="fork", timeout_s=TIMEOUT)
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in got)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: run_ranks(42, 2), TypeError, "needs a function"),
        (lambda: run_ranks(sum_of_ranks, 0, 1), ValueError, "world_size must be a positive"),
        (lambda: run_ranks(sum_of_ranks, 2, 1, device="tpu"), ValueError, "'cpu' or 'cuda'"),
        (lambda: run_ranks(lambda r, w: r, 2), ValueError, "cannot be imported by a rank"),
    ],
    ids=["not-callable", "world-0", "device", "lambda-spawn"],
)
def test_bad_launches_fail_before_starting_anything(call, error, match):
    with pytest.raises(error, match=match):
        call()
    assert not multiprocessing.active_children()


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer GPUs")
def test_cuda_ranks_need_as_many_gpus():
    with pytest.raises(ValueError, match="2 CUDA ranks need 2 GPUs"):
        run_ranks(sum_of_ranks, 2, 0, device="cuda")


# --- collectives: the formulas, the fit, and a small sweep on two gloo processes


def test_bus_factors_are_nccl_tests():
    assert collectives.bus_factor("all_reduce", 2) == 1.0
    assert collectives.bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert collectives.bus_factor("all_gather", 4) == 3 / 4
    assert collectives.bus_factor("reduce_scatter", 1) == 0.0
    assert collectives.ring_bytes_sent(1000, 4) == 1500
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.bus_factor("broadcast", 2)


def test_alpha_beta_fit_recovers_the_line():
    sizes = collectives.sizes_between(1024, 1 << 30)
    assert sizes[0] == 1024 and sizes[-1] == 1 << 30
    times = [20e-6 + s / 400e9 for s in sizes]
    alpha, beta = collectives.alpha_beta_fit(sizes, times)
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(1 / 400e9, rel=1e-6)
    with pytest.raises(ValueError, match="two different message sizes"):
        collectives.alpha_beta_fit([8, 8], [1.0, 2.0])
    with pytest.raises(ValueError, match="3 sizes but 2 times"):
        collectives.alpha_beta_fit([1, 2, 3], [1.0, 2.0])


def test_a_sweep_on_two_gloo_ranks_reports_algbw_and_busbw():
    sizes = [1024, 16384]
    rows = run_ranks(collectives.sweep_rank, 2, collectives.OPS, sizes, "fp32", 2,
                     timeout_s=TIMEOUT)[0]  # fmt: skip
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, s) for op in collectives.OPS for s in sizes
    ]
    for r in rows:
        assert r["seconds"] > 0
        factor = collectives.bus_factor(r["op"], 2)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor)
    assert set(collectives.fits(rows)) == set(collectives.OPS)


# --- tensor parallelism against one rank


def _weights(seed=0, d=64, f=96, heads=4, kv_heads=2, hd=16):
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    x = torch.randn(3, 7, d, generator=g)  # (B, S, D)
    mlp = (w(f, d), w(d, f))
    attention = (w(heads * hd, d), w(kv_heads * hd, d), w(kv_heads * hd, d), w(d, heads * hd))
    return x, mlp, attention, hd


def test_tensor_parallel_mlp_and_gqa_attention_match_one_rank():
    x, mlp, attention, hd = _weights()
    got = run_ranks(tp.layer_rank, 2, x, mlp, attention, hd, timeout_s=TIMEOUT)
    mlp_ref = tp.mlp_ref(x.double(), *(w.double() for w in mlp))
    attention_ref = tp.attention_ref(x.double(), *(w.double() for w in attention), hd)
    for rank_out in got:
        check.assert_close(rank_out[0], mlp_ref, op="matmul", dtype=torch.float32)
        check.assert_close(rank_out[1], attention_ref, op="attention", dtype=torch.float32)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_shards_split_heads_and_features_or_say_why_not():
    _, (up, down), attention, hd = _weights()
    a, b = tp.shard_mlp(up, down, 1, 2)
    assert torch.equal(a, up[48:]) and torch.equal(b, down[:, 48:])
    wq, wk, wv, wo = tp.shard_attention(*attention, hd, 0, 2)
    assert wq.shape == (32, 64) and wk.shape == (16, 64) and wo.shape == (64, 32)
    with pytest.raises(ValueError, match="n_kv_heads=2 does not split over 4 ranks"):
        tp.shard_attention(*attention, hd, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        tp.shard_mlp(up, down, 2, 2)
    with pytest.raises(ValueError, match="w_up .F, D. and w_down .D, F. expected"):
        tp.shard_mlp(up, up, 0, 2)


def test_a_whole_model_split_over_two_ranks_gives_one_ranks_logits():
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    got = run_ranks(tp.logits_rank, 2, "tiny", tokens, timeout_s=TIMEOUT)
    with torch.no_grad():
        ref = load_model("tiny", device="cpu").double()(tokens)
    for logits in got:
        check.assert_close(logits, ref, op="matmul", dtype=torch.float32)


def test_decode_bytes_per_rank_splits_the_layers_not_the_head():
    one = tp.decode_bytes_per_rank("llama-1b-shape", 1)
    two = tp.decode_bytes_per_rank("llama-1b-shape", 2)
    whole = 128256 * 2048 * 2 + 33 * 2048 * 2  # the head and the norms, on every rank
    assert two - whole == pytest.approx((one - whole) / 2)


# --- overlap and invariance


def test_overlap_gives_the_same_bits_and_reports_its_times():
    got = run_ranks(overlap.overlap_rank, 2, 64, 32, 64, 4, 2, timeout_s=TIMEOUT)
    assert got[1] == {} and got[0]["same_result"]
    assert all(got[0][k] > 0 for k in ("compute_ms", "all_reduce_ms", "overlapped_ms"))


def test_two_rank_all_reduce_is_one_addition_and_tp_is_batch_invariant():
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(1000, generator=g) * 10 ** torch.randint(-3, 4, (1000,), generator=g)
             for _ in range(3)]  # fmt: skip
    got = run_ranks(invariance.all_reduce_rank, 2, parts[:2], timeout_s=TIMEOUT)
    assert torch.equal(got[0], parts[0] + parts[1]) and torch.equal(got[1], parts[1] + parts[0])
    assert invariance.orders_differ(parts) > 0  # three ranks: the order shows
    x, (up, down), _, _ = _weights(3)
    report = run_ranks(invariance.tp_invariance_rank, 2, x[:2].reshape(14, -1)[:8], up, down,
                       timeout_s=TIMEOUT)[0]  # fmt: skip
    assert report["invariant"], report["report"]
    assert report["max_abs_diff"] < 1e-4


# --- on two GPUs (NCCL)


@pytest.mark.two_gpus
def test_nccl_all_reduce_reaches_nvlink_bandwidth():
    rows = run_ranks(collectives.sweep_rank, 2, ("all_reduce",), [1 << 30], "bf16", 5,
                     device="cuda", timeout_s=120)[0]  # fmt: skip
    assert rows[0]["busbw_gbps"] > 300, rows


@pytest.mark.two_gpus
def test_nccl_tensor_parallel_matches_one_gpu():
    x, mlp, attention, hd = _weights()
    mlp, attention = tuple(w.cuda() for w in mlp), tuple(w.cuda() for w in attention)
    got = run_ranks(tp.layer_rank, 2, x.cuda(), mlp, attention, hd, device="cuda", timeout_s=120)
    ref = tp.mlp_ref(x.double(), *(w.cpu().double() for w in mlp))
    check.assert_close(got[0][0].cpu(), ref, op="matmul", dtype=torch.float32)


def test_cuda_ranks_are_spawned_and_cpu_ranks_forked_from_a_server():
    assert launch.default_start_method("cuda") == "spawn"
    assert launch.default_start_method("cpu") in ("forkserver", "spawn")
