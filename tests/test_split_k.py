import inspect

import pytest
import torch
from params import DTYPES, assert_rows_invariant

from kernels import arrivals, check, split_k
from kernels import split_k_tuning as tuning
from kernels.runtime import DEVICE
from kernels.split_k import matmul_split_k, matmul_split_k_op, matmul_split_k_ref, product

# (M, N, K) around 1 and the CPU tile (16 x 64, K steps of 32): with 16 "SMs" on a CPU, N <= 64
# is one column tile and K is cut into up to 16 pieces; N = 1000 is 16 tiles, never split.
SHAPES = [(1, 1, 1), (3, 33, 127), (17, 65, 1000), (16, 127, 255), (64, 1, 33), (2, 1000, 65)]


def operands(m, n, k, dtype, seed=0):
    a = check.random_tensor((m, k), dtype, seed=seed, scale=k**-0.25)
    b = check.random_tensor((k, n), dtype, seed=seed + 1, scale=k**-0.25)
    return a, b


def torch_same_dtype(a, b, bias=None, activation=None, splits=None):
    out = a @ b if bias is None else a @ b + bias
    return getattr(torch.nn.functional, activation)(out) if activation else out


def check_split_k(a, b, bias=None, activation=None, splits=None):
    r = check.against_fp64(
        matmul_split_k, a, b, bias, activation, splits,
        ref=matmul_split_k_ref, op="matmul", baseline=torch_same_dtype,
    )  # fmt: skip
    assert r.ok, r.message


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_fp64_reference(shape, dtype):
    check_split_k(*operands(*shape, dtype))


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("activation", [None, "gelu", "relu"], ids=str)
def test_every_split_and_epilogue_with_k_tails(splits, activation):
    # K = 300: 10 steps of 32 with a 12-wide tail; 40 asks for more pieces than steps (10 made)
    a, b = operands(5, 40, 300, torch.float32, seed=3)
    bias = check.random_tensor((40,), seed=5)
    check_split_k(a, b, bias, activation, splits)


def test_the_default_split_cuts_k_on_a_narrow_output():
    K = 4000  # long enough for pieces of MIN_STEPS_PER_SPLIT steps on a GPU too
    plan = tuning.plan("matmul", 40, K, (torch.float32, torch.float32, None, "ieee"))
    assert plan.splits > 1 and plan.k_per_split % plan.tile.BLOCK_K == 0
    assert (plan.splits - 1) * plan.k_per_split < K <= plan.splits * plan.k_per_split


def test_the_split_rule_never_sees_m():
    params = ["N", "K", "tile", "sms", "waves"]
    assert list(inspect.signature(tuning.split_rule).parameters) == params
    tile = tuning.Tile(128, 128, 64)
    assert tuning.split_rule(256, 524288, tile, sms=132) == (66, 8000)  # 2 tiles x 66 pieces
    assert tuning.split_rule(14336, 4096, tuning.Tile(16, 64, 128), sms=132) == (1, 4096)
    assert tuning.split_rule(4096, 14336, tuning.Tile(16, 64, 128), sms=132) == (3, 4864)
    assert tuning.split_rule(256, 64, tile, sms=132)[0] == 1  # too short a K to cut


def test_decode_candidates_include_whole_waves(monkeypatch):
    monkeypatch.setattr(tuning, "processors", lambda: 132)
    monkeypatch.setattr(tuning, "TILES", {"gemv": [tuning.Tile(16, 64, 128)]})
    plans = tuning.candidates("gemv", 4096, 14336)  # 64 column tiles on 132 SMs
    assert [p.splits for p in plans] == [3, 2, 4, 1]  # the rule's, one and two whole waves, unsplit
    assert all(p.splits * p.k_per_split >= 14336 > (p.splits - 1) * p.k_per_split for p in plans)
    assert [p.splits for p in tuning.candidates("gemv", 14336, 4096)] == [1]  # 224 tiles: no split


def test_the_tuner_times_fixed_row_counts_and_keeps_its_choice(monkeypatch):
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    monkeypatch.setattr(tuning, "_chosen", {})
    seen = []
    fake_ms = lambda plan, rows: seen.append(rows) or (1.0 if plan.splits == 1 else 2.0)
    chosen = tuning.plan("gemv", 33, 200, ("a dtype",), fake_ms)  # split 7 ways, or not
    assert chosen.splits == 1 and sorted(set(seen)) == sorted(tuning.TUNE_ROWS["gemv"])
    timed = len(seen)
    assert tuning.plan("gemv", 33, 200, ("a dtype",), fake_ms) is chosen and len(seen) == timed


def test_plans_are_timed_in_a_cuda_graph_over_rotating_copies(monkeypatch):
    """The tuner ranks each plan back to back in a CUDA graph over copies of the weight (as
    a decode step runs it), every candidate at every row count of TUNE_ROWS."""
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    monkeypatch.setattr(tuning, "_chosen", {})
    used = []

    def graph(fn, argsets, rep_ms):  # runs the plan once (it must work), then a fake time
        used.append(len(argsets))
        fn(*argsets[0])
        return 1.0

    monkeypatch.setattr(split_k, "rotating_graph_ms", graph)
    monkeypatch.setattr(split_k, "rotating_copies", lambda t, past: [t, t.clone(), t.clone()])
    monkeypatch.setattr(split_k, "l2_bytes", lambda: 1 << 20)
    x = torch.randn(2, 200, device=DEVICE)
    b = torch.randn(200, 33, device=DEVICE)
    torch.testing.assert_close(product(x, b, kind="gemv"), x @ b, rtol=1e-4, atol=1e-4)
    plans = len(tuning.candidates("gemv", 33, 200))
    assert used == [3] * plans * len(tuning.TUNE_ROWS["gemv"])


def test_inside_a_capture_the_tuner_times_nothing_and_keeps_nothing(monkeypatch):
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    monkeypatch.setattr(tuning, "_chosen", {})
    never = lambda plan, rows: pytest.fail("timed inside a capture")
    first = tuning.plan("gemv", 33, 200, ("a dtype",), never, remember=False)
    assert first == tuning.candidates("gemv", 33, 200)[0] and not tuning.chosen_plans()


def test_the_tuner_minds_the_worst_row_count():
    fast_at_1, even = tuning.Plan(None, 1, 32), tuning.Plan(None, 2, 32)
    times = {(fast_at_1, 1): 1.0, (fast_at_1, 64): 3.0, (even, 1): 1.2, (even, 64): 2.0}
    assert tuning.least_regret([fast_at_1, even], (1, 64), lambda p, m: times[p, m]) is even
    # a row count where no plan ran (inf everywhere) is left out, not a NaN in the ranking
    failed = {**times, (fast_at_1, 64): float("inf"), (even, 64): float("inf")}
    assert tuning.least_regret([even, fast_at_1], (1, 64), lambda p, m: failed[p, m]) is fast_at_1
    nothing = lambda p, m: float("inf")
    assert tuning.least_regret([even, fast_at_1], (1, 64), nothing) is even


# Batch sizes around the CPU tile's 16 rows; every row up to 33 also computed alone.
BATCHES = (1, 2, 3, 15, 16, 17, 31, 32, 33)


@pytest.mark.parametrize("splits", [None, 1], ids=["default_split", "unsplit"])
def test_rows_do_not_depend_on_the_batch(splits):
    a, b = operands(33, 33, 200, torch.float32, seed=7)  # the default cuts K into 7 pieces
    assert_rows_invariant(lambda t: matmul_split_k(t, b, splits=splits), a, BATCHES)


def test_a_split_chosen_from_m_would_change_the_bits():
    # the negative control: the same product with the split following M is not invariant
    a, b = operands(24, 33, 200, torch.float32, seed=8)
    with pytest.raises(AssertionError, match="differ from the same rows computed alone"):
        assert_rows_invariant(lambda t: matmul_split_k(t, b, splits=len(t) % 5 + 1), a, [24])


def test_run_to_run_bitwise_identical():
    a, b = operands(17, 33, 500, torch.float32, seed=9)
    assert torch.equal(matmul_split_k(a, b), matmul_split_k(a, b))


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("activation", [None, "gelu"], ids=str)
def test_the_last_piece_sums_as_the_second_kernel_does(monkeypatch, splits, activation):
    """The tile's last program to finish (an arrival counter) sums the partials in the reduce
    kernel's order: bit for bit its result; and it leaves every counter at 0 for the next
    launch."""
    a, b = operands(19, 70, 300, torch.float32, seed=13)
    bias = check.random_tensor((70,), seed=14)
    with check.poisoned_allocations():  # a partial summed before it is written shows
        one_launch = matmul_split_k(a, b, bias, activation, splits)
    counts = arrivals.counters(a.device, 1)
    assert counts is not None and not counts.any()
    monkeypatch.setattr(arrivals, "counters", lambda device, tiles: None)
    two_launches = matmul_split_k(a, b, bias, activation, splits)
    assert torch.equal(one_launch, two_launches)


def test_large_partial_sets_go_to_the_reduce_kernel():
    """KernelBench's 256 x 256 x 524288 in 128 x 128 tiles: 66 pieces of 16384 partials a tile
    are summed by the second kernel; a decode GEMV's 16 x 64 tiles in 4 pieces by the last."""
    big = tuning.Plan(tuning.Tile(128, 128, 64), 66, 8000)
    assert not split_k.last_piece_sums(big)
    assert split_k.last_piece_sums(tuning.Plan(tuning.Tile(16, 64, 128), 4, 3584))
    assert not split_k.last_piece_sums(tuning.Plan(tuning.Tile(16, 64, 128), 1, 14336))


def test_non_contiguous_operands():
    a = check.random_tensor((30, 14), seed=11, scale=0.5).t()  # (14, 30), column-major
    b = check.random_tensor((30, 80), seed=12, scale=0.5)[:, ::2]  # (30, 40), every other column
    assert not a.is_contiguous() and not b.is_contiguous()
    check_split_k(a, b, splits=2)


@pytest.mark.parametrize("m, n, k", [(0, 5, 7), (3, 0, 7), (3, 5, 0)])
def test_empty_dims(m, n, k):
    a, b = torch.randn(m, k, device=DEVICE), torch.randn(k, n, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    out = matmul_split_k(a, b, bias, "relu")
    assert out.shape == (m, n)
    assert torch.equal(out, torch.relu(bias).expand(m, n))  # K = 0: act(bias) everywhere


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.ones(3), torch.ones(3, 2)), ValueError, "a must have 2 dims"),
        ((torch.ones(3, 4), torch.ones(5, 2)), ValueError, "a's columns to match b's rows"),
        ((torch.ones(3, 4), torch.ones(4, 2, dtype=torch.float16)), TypeError, "share a dtype"),
        ((torch.ones(3, 4, dtype=torch.int32), torch.ones(4, 2)), TypeError, "supported"),
        ((torch.ones(3, 4), torch.ones(4, 2), torch.ones(3)), ValueError, "bias must have"),
        ((torch.ones(3, 4), torch.ones(4, 2), None, "tanh"), ValueError, "activation"),
        ((torch.ones(3, 4), torch.ones(4, 2), None, None, 0), ValueError, "splits must be"),
        ((torch.ones(3, 4), torch.ones(4, 2), None, None, 2.0), TypeError, "splits must be"),
        ((torch.ones(3, 4), torch.ones(4, 2), None, None, True), TypeError, "splits must be"),
    ],
)
def test_bad_inputs_raise_before_launch(args, error, match):
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in args]
    with pytest.raises(error, match=match):
        matmul_split_k(*args)


def test_the_operator_passes_opcheck_and_compiles_without_a_graph_break():
    a, b = operands(3, 33, 70, torch.float32, seed=12)
    bias = check.random_tensor((33,), seed=13)
    torch.library.opcheck(matmul_split_k_op, (a, b, bias, "gelu", 2))
    compiled = torch.compile(matmul_split_k, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(a, b, bias, "gelu"), matmul_split_k(a, b, bias, "gelu"))


def test_forward_only_a_backward_raises():
    a, b = operands(3, 5, 7, torch.float32)
    out = matmul_split_k(a.requires_grad_(), b)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()


@pytest.mark.gpu
def test_large_k_on_the_gpu():
    # KernelBench's shape, smaller K: 256 x 256 x 65536 in bf16, against fp64
    a, b = operands(256, 256, 65536, torch.bfloat16, seed=14)
    check_split_k(a, b)
    assert_rows_invariant(lambda t: matmul_split_k(t, b), a[:40], batches=range(1, 41))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemv", "int8", "matmul"])
def test_every_candidate_plan_on_the_gpu(monkeypatch, kind):
    """The suite runs untuned (tests/conftest.py: each list's first candidate); here every
    candidate, split and unsplit, on one odd shape against fp64."""
    from kernels import gemv, int8

    m, n, k = (3, 1000, 3000) if kind != "matmul" else (200, 300, 20000)
    a, b = operands(m, n, k, torch.bfloat16, seed=21)
    weight = b.t().contiguous()  # (N, K), as a linear layer holds it
    qweight, scale = int8.quantize(weight)
    for candidate in tuning.candidates(kind, n, k):
        monkeypatch.setattr(tuning, "plan", lambda *args, c=candidate, **kwargs: c)
        if kind == "gemv":
            r = check.against_fp64(gemv.linear, a, weight, ref=gemv.linear_ref, op="matmul",
                                   baseline=torch.nn.functional.linear)  # fmt: skip
        elif kind == "int8":
            r = check.against_fp64(int8.linear, a, qweight, scale, ref=int8.linear_ref, op="matmul")
        else:
            r = check.against_fp64(matmul_split_k, a, b, ref=matmul_split_k_ref, op="matmul",
                                   baseline=torch_same_dtype)  # fmt: skip
        assert r.ok, f"{candidate}: {r.message}"


# --- kernels.matmul routes small outputs with a long K here (matmul_tuning.plan) -------------
@pytest.fixture
def routed(monkeypatch):
    """matmul_tuning's thresholds lowered so that small CPU shapes take split-K; records each
    product() that kernels.matmul calls."""
    from kernels import matmul_tuning
    from kernels import split_k as split_k_module

    monkeypatch.setattr(matmul_tuning, "_plans", {})
    monkeypatch.setattr(matmul_tuning, "SPLIT_K_MIN_K", 256)
    calls = []
    real = split_k_module.product
    monkeypatch.setattr(
        split_k_module, "product", lambda *a, **kw: calls.append(kw["kind"]) or real(*a, **kw)
    )
    return calls


def test_matmul_routes_a_few_tiles_with_a_long_k(monkeypatch):
    from kernels import matmul_tuning as mt

    monkeypatch.setattr(mt, "_plans", {})
    monkeypatch.setattr(mt, "processors", lambda: 132)  # an H200's SMs
    meta = lambda *shape: torch.empty(shape, dtype=torch.bfloat16, device="meta")
    routes = lambda m, n, k, kernel=None: mt.plan(meta(m, k), meta(k, n), kernel).split_k
    assert routes(256, 256, 524288)  # 4 tiles for 132 SMs (KernelBench's "large K")
    assert routes(1024, 1024, 16384)  # 64 tiles: at most half the SMs
    assert not routes(1024, 1152, 16384)  # 72 tiles: more than half
    assert not routes(256, 256, 16383)  # K too short to be worth a second kernel
    assert not routes(32768, 32768, 64) and not routes(4096, 4096, 14336)
    assert not routes(256, 256, 524288, "pointers")  # a chosen kernel is that kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 300), (33, 40, 1000), (17, 65, 257)], ids=str)
def test_routed_matmul_matches_fp64_reference(shape, dtype, routed):
    from kernels.matmul import matmul, matmul_ref

    a, b = operands(*shape, dtype, seed=15)
    bias = check.random_tensor(shape[1:2], dtype, seed=16)
    for activation in (None, "gelu"):
        r = check.against_fp64(
            matmul, a, b, bias, activation, ref=matmul_ref, op="matmul", baseline=torch_same_dtype
        )
        assert r.ok, r.message
    assert routed == ["matmul", "matmul"]


def test_routed_matmul_gradients(routed):
    from kernels.matmul import matmul

    a, b = operands(9, 20, 400, torch.float32, seed=17)
    a.requires_grad_(), b.requires_grad_()
    dy = check.random_tensor((9, 20), seed=18)
    grads = torch.autograd.grad(matmul(a, b, activation="gelu"), (a, b), dy)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    out64 = torch.nn.functional.gelu(a64 @ b64)
    for got, want in zip(grads, torch.autograd.grad(out64, (a64, b64), dy.double()), strict=True):
        check.assert_close(got, want, op="matmul")
    assert routed[0] == "matmul"  # the forward; the gradients' products have short K or wide N


def test_the_batch_invariant_matmul_never_splits_k(routed):
    from kernels import batch_invariant

    a, b = operands(33, 40, 1000, torch.float32, seed=19)
    r = check.against_fp64(batch_invariant.matmul, a, b, ref=matmul_split_k_ref, op="matmul")
    assert r.ok, r.message
    assert routed == []  # Chapter 5: a split chosen from the output's size would follow M


@pytest.mark.gpu
def test_gpu_matmul_takes_split_k_at_large_k():
    from kernels import matmul_tuning as mt
    from kernels.matmul import matmul, matmul_ref

    a, b = operands(256, 256, 131072, torch.bfloat16, seed=20)
    assert mt.plan(a, b).split_k  # 4 tiles for 132 SMs, K past SPLIT_K_MIN_K
    r = check.against_fp64(matmul, a, b, ref=matmul_ref, op="matmul", baseline=torch_same_dtype)
    assert r.ok, r.message
