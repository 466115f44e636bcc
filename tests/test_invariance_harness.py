"""The invariance harness: it passes invariant ops and catches variant ones (negative controls).

On a CPU the Triton kernels run in the interpreter, one program after another: a logic check.
The gpu-marked tests are the real bitwise checks on compiled kernels.
"""

import pytest
import torch
from params import CPU_DTYPES

from kernels import batch_invariant as bi
from kernels import check
from kernels.batch_invariant.controls import atomic_row_sum, split_k_for, split_k_matmul
from kernels.batch_invariant.harness import (
    batch_sizes,
    check_attention_invariance,
    check_batch_invariance,
    differing,
    first_row_drift,
    split_boundary_lengths,
    ulp_distance,
)
from kernels.batch_invariant.split_kv_attention import CONFIG as ATTENTION_CONFIG
from kernels.llm.ops import sdpa_attention
from kernels.runtime import DEVICE, ON_GPU, pick

# where the split-KV kernel cuts the keys: the harness tries KV lengths on both sides of each cut
SPLITS = dict(split_size=ATTENTION_CONFIG["SPLIT_SIZE"], block=ATTENTION_CONFIG["BLOCK_N"])


def test_ulp_distance_counts_representable_floats():
    one = torch.tensor([1.0, -1.0, 0.0, 2.0**-149])
    up = torch.nextafter(one, torch.full_like(one, 10.0))
    assert ulp_distance(one, up).tolist() == [1, 1, 1, 1]
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0])).item() == 0
    assert ulp_distance(torch.tensor([-(2.0**-149)]), torch.tensor([2.0**-149])).item() == 2
    half = torch.tensor([1.0], dtype=torch.float16)
    assert ulp_distance(half, half + 2.0**-10).item() == 1
    nan = torch.tensor([float("nan"), 1.0, -0.0])
    assert differing(nan, torch.tensor([float("nan"), 1.0, 0.0])).tolist() == [False] * 3


def test_batch_sizes_cover_primes_powers_of_two_and_the_processor_count():
    sizes = batch_sizes(300, sm_count=132)
    for b in (1, 2, 3, 5, 7, 31, 63, 64, 65, 127, 128, 129, 131, 132, 133, 255, 256, 257, 300):
        assert b in sizes, b
    assert sizes == sorted(set(sizes)) and max(sizes) == 300
    assert batch_sizes(1) == [1]
    assert split_boundary_lengths(64, 140) == [1, 2, 63, 64, 65, 127, 128, 129, 140]


def _rows(n, cols, seed, dtype=torch.float32):
    return check.random_tensor((n, cols), dtype, seed=seed)


def test_harness_passes_an_invariant_op_and_reports_what_varies():
    x = _rows(40, 16, seed=1)
    assert check_batch_invariance(lambda t: t * 2 + 1, x).ok
    # the batch leaks into every row: caught by the sweep, first at B = 1
    report = check_batch_invariance(lambda t: t - t.mean(0), x)
    assert not report.ok and report.first_bad_batch == 1 and report.first_bad == "B=1"
    assert report.max_abs_diff > 0 and report.max_ulp > 0
    assert "NOT invariant" in str(report)
    # a row's position leaks in: the sweep cannot see it, the needles can
    report = check_batch_invariance(
        lambda t: t + 1e-3 * torch.arange(len(t), device=t.device)[:, None], x
    )
    assert not report.ok and report.first_bad_batch is None and "random batch" in report.first_bad
    # run-to-run noise: caught by the repeats
    report = check_batch_invariance(lambda t: t + 1e-3 * torch.rand_like(t), x, needles=0)
    assert not report.ok and report.first_bad == "B=1"


def test_first_row_drift():
    x = _rows(8, 4, seed=2)
    drift = first_row_drift(lambda t: t - t.sum(0), x, [1, 2, 8])
    assert drift[0] == (1, 0.0) and drift[1][1] > 0


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_invariant_kernels_pass_the_harness(dtype):
    x = _rows(40, 300, seed=3, dtype=dtype)
    w = check.random_tensor((300,), dtype, seed=4)
    assert check_batch_invariance(lambda t: bi.rms_norm(t, w), x).ok
    b = check.random_tensor((300, 70), dtype, seed=5)
    bias = check.random_tensor((70,), dtype, seed=6)
    assert check_batch_invariance(lambda t: bi.matmul(t, b, bias, "gelu"), x).ok
    with bi.batch_invariant_mode():
        assert check_batch_invariance(lambda t: torch.mm(t, b), x, needles=2).ok


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_invariant_attention_passes_the_harness(dtype):
    q, k, v = (check.random_tensor((2, 1, 140, 16), dtype, seed=s) for s in (7, 8, 9))
    report = check_attention_invariance(bi.attention, q, k, v, **SPLITS)
    assert report.ok, str(report)
    assert report.checks > 50


def test_attention_harness_tries_lengths_around_the_splits_it_is_given():
    q, k, v = (check.random_tensor((1, 1, 120, 8), seed=s) for s in (17, 18, 19))
    report = check_attention_invariance(
        bi.attention_ref, q, k, v, split_size=50, block=0, chunks=(), company=0
    )
    tried = [case for case, _ in report.cases if case.startswith("prefill of")]
    assert tried == [f"prefill of {n}" for n in (1, 2, 49, 50, 51, 99, 100, 101, 120)]


@pytest.mark.skipif(ON_GPU, reason="a CPU negative control")
def test_torch_attention_fails_the_attention_harness_on_this_cpu():
    """What kernels.llm uses by default: scaled_dot_product_attention with a padding mask."""
    q, k, v = (check.random_tensor((2, 1, 140, 16), seed=s) for s in (14, 15, 16))
    report = check_attention_invariance(sdpa_attention, q, k, v, **SPLITS)
    assert not report.ok and report.max_ulp > 0


def test_split_k_matmul_is_batch_variant_where_its_split_changes():
    """The negative control that fails everywhere, the CPU interpreter included. The shape
    is one where the split changes with the batch under each mode's tile config and processor
    count (16 on the CPU; on a GPU of 132 SMs, at 65 and 129 rows)."""
    bmax, K, N = pick(cpu=(40, 512, 64), gpu=(160, 1024, 2048))
    x = _rows(bmax, K, seed=10)
    b = _rows(K, N, seed=11)
    assert split_k_for(1, N, K) != split_k_for(bmax, N, K)
    check.assert_close(split_k_matmul(x, b), x.double() @ b.double(), op="matmul")
    report = check_batch_invariance(lambda t: split_k_matmul(t, b), x, needles=2, repeats=1)
    first_switch = min(
        m for m in range(1, bmax + 1) if split_k_for(m, N, K) != split_k_for(bmax, N, K)
    )
    assert not report.ok and report.first_bad_batch == first_switch
    # with the split fixed by hand, the same kernel is invariant
    fixed = check_batch_invariance(lambda t: split_k_matmul(t, b, split_k=4), x, needles=2)
    assert fixed.ok, str(fixed)


@pytest.mark.skipif(ON_GPU or not torch.backends.mkl.is_available(), reason="CPU build with MKL")
def test_torch_mm_is_batch_variant_on_this_cpu():
    x = _rows(40, 64, seed=12)
    b = _rows(64, 64, seed=13)
    report = check_batch_invariance(lambda t: torch.mm(t, b), x, needles=0)
    assert not report.ok and report.first_bad_batch == 1


# The real checks: compiled kernels on the GPU, bitwise.

GPU_DTYPES = [torch.float32, torch.bfloat16]


def _gpu_rows(n, cols, dtype, seed):
    return check.random_tensor((n, cols), dtype, seed=seed, device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_invariant_kernels_are_bitwise_invariant(dtype):
    x = _gpu_rows(1024, 4096, dtype, seed=20)
    w = check.random_tensor((4096,), dtype, seed=21, device=DEVICE)
    report = check_batch_invariance(lambda t: bi.rms_norm(t, w), x, needles=16)
    assert report.ok, str(report)
    b = _gpu_rows(4096, 1024, dtype, seed=22)
    report = check_batch_invariance(lambda t: bi.matmul(t, b), x, needles=16)
    assert report.ok, str(report)
    with bi.batch_invariant_mode():
        report = check_batch_invariance(lambda t: torch.mm(t, b), x, needles=16)
    assert report.ok, str(report)
    q, k, v = (
        check.random_tensor((2, 4, 600, 128), dtype, seed=s, device=DEVICE) for s in (23, 24, 25)
    )
    report = check_attention_invariance(bi.attention, q, k, v, **SPLITS)
    assert report.ok, str(report)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_torch_mm_is_batch_variant(dtype):
    """The post's demonstration: 2048x4096 @ 4096x4096 of linspace(-1000, 1000)."""
    a = torch.linspace(-1000, 1000, 2048 * 4096, device=DEVICE).reshape(2048, 4096).to(dtype)
    b = torch.linspace(-1000, 1000, 4096 * 4096, device=DEVICE).reshape(4096, 4096).to(dtype)
    report = check_batch_invariance(lambda t: torch.mm(t, b), a, needles=4)
    assert not report.ok, "torch.mm on the GPU was expected to be batch-variant"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_split_k_matmul_is_batch_variant(dtype):
    x = _gpu_rows(512, 4096, dtype, seed=26)
    b = _gpu_rows(4096, 512, dtype, seed=27)
    assert split_k_for(1, 512, 4096) != split_k_for(512, 512, 4096)
    assert not check_batch_invariance(lambda t: split_k_matmul(t, b), x).ok


@pytest.mark.gpu
def test_gpu_atomic_add_reduction_is_not_even_deterministic():
    x = _gpu_rows(64, 1 << 20, torch.float32, seed=28)
    report = check_batch_invariance(atomic_row_sum, x, sizes=[], needles=0, repeats=20)
    assert not report.ok and report.first_bad.startswith("repeat")
