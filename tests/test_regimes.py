import pytest
import torch
from params import DTYPES

from kernels import check, regimes
from kernels.regimes import cos_cos, cos_cos_ref, repeat_fma, repeat_fma_ref
from kernels.runtime import DEVICE

SIZES = [1, 3, 1023, 1024, 1025, 4097]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("repeat", [0, 1, 7, 64], ids=lambda r: f"repeat={r}")
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_repeat_fma_matches_reference(n, repeat, dtype):
    x = check.random_tensor((n,), dtype, seed=n + repeat, scale=2.0)
    x0 = x.clone()
    with check.poisoned_allocations():
        out = repeat_fma(x, repeat)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    check.assert_close(out, repeat_fma_ref(x.double(), repeat), op="elementwise", dtype=dtype)
    assert torch.equal(x, x0)


def test_repeat_fma_counts_its_steps():
    # one step more or less changes every element by about |x - 1| / 1024: far beyond fp32 noise
    x = check.random_tensor((1000,), seed=11, scale=4.0)
    out = repeat_fma(x, 100)
    check.assert_close(out, repeat_fma_ref(x.double(), 100), op="elementwise")
    for wrong in (99, 101):
        assert not check.compare(out, repeat_fma_ref(x.double(), wrong), op="elementwise").ok


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n={n}")
def test_cos_cos_matches_reference(n, dtype):
    x = check.random_tensor((n,), dtype, seed=100 + n, scale=3.0)
    x0 = x.clone()
    with check.poisoned_allocations():
        out = cos_cos(x)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    check.assert_close(out, cos_cos_ref(x.double()), op="elementwise", dtype=dtype)
    assert torch.equal(x, x0)


@pytest.mark.parametrize("kernel", ["repeat_fma", "cos_cos"])
def test_multi_dim_non_contiguous_and_empty_inputs(kernel):
    run, ref = {
        "repeat_fma": (lambda t: repeat_fma(t, 5), lambda t: repeat_fma_ref(t, 5)),
        "cos_cos": (cos_cos, cos_cos_ref),
    }[kernel]
    x = check.random_tensor((48, 65), seed=21).t()  # (65, 48), strides (1, 65)
    assert not x.is_contiguous()
    out = run(x)
    assert out.shape == (65, 48) and out.is_contiguous()
    check.assert_close(out, ref(x.double()), op="elementwise")
    strided = check.random_tensor((3, 129), seed=22)[:, ::2]
    check.assert_close(run(strided), ref(strided.double()), op="elementwise")
    empty = run(x[:0])
    assert empty.shape == (0, 48) and empty.dtype == x.dtype


def test_bad_inputs_get_clear_errors():
    x = check.random_tensor((8,), seed=31)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        repeat_fma(x.int(), 1)
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        cos_cos(x.to(torch.float64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        cos_cos([1.0, 2.0])
    with pytest.raises(TypeError, match="repeat must be an int"):
        repeat_fma(x, 2.0)
    with pytest.raises(TypeError, match="repeat must be an int"):
        repeat_fma(x, True)
    with pytest.raises(ValueError, match="between 0 and"):
        repeat_fma(x, -1)
    with pytest.raises(ValueError, match="between 0 and"):
        repeat_fma(x, regimes.MAX_REPEAT + 1)
    elsewhere = torch.empty(8, device="meta")
    with pytest.raises(ValueError, match=f"is on meta but the kernels run on {DEVICE.type}"):
        cos_cos(elsewhere)


def test_formulas():
    n = 1 << 20
    assert regimes.repeat_fma_flops(n, 64) == 128 * n
    assert regimes.repeat_fma_bytes(n, 4) == 8 * n  # independent of repeat
    assert regimes.cos_cos_bytes(n, 4, fused=False) == 2 * regimes.cos_cos_bytes(n, 4)
    assert regimes.cos_cos_flops(n) == 2 * n
    assert regimes.matmul_flops(2, 3, 4) == 48
    assert regimes.matmul_bytes(2, 3, 4, 2) == (8 + 12 + 6) * 2


H200_SWEEP = (  # the shape reported for the H200 in fp32: flat, then linear
    [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
    [0.507] * 6 + [0.63, 1.12, 2.18, 4.24],
)


def test_sweep_knee_meets_the_two_lines():
    repeats = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    ms = [max(0.5, r / 120) for r in repeats]  # flat 0.5 ms, then 1/120 ms per FMA
    assert regimes.sweep_knee(repeats, ms) == pytest.approx(60.0)
    assert 55 < regimes.sweep_knee(*H200_SWEEP) < 65
    assert regimes.first_repeat_above(*H200_SWEEP) == 128


def test_sweep_knee_rejects_sweeps_it_cannot_read():
    with pytest.raises(ValueError, match="extend it"):
        regimes.sweep_knee([1, 2, 4, 8, 16, 32], [1.0] * 6)
    with pytest.raises(ValueError, match="at least 6"):
        regimes.sweep_knee([1, 2, 4], [1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="increasing"):
        regimes.sweep_knee([4, 2, 1, 8, 16, 32], [1.0] * 6)
    with pytest.raises(ValueError, match="differ in length"):
        regimes.sweep_knee([1, 2], [1.0])
    with pytest.raises(ValueError, match="exceeds"):
        regimes.first_repeat_above([1, 2], [1.0, 1.1])


def test_benchmark_rows(monkeypatch):
    from kernels import benchmarks

    monkeypatch.setattr(torch, "compile", lambda fn: fn)  # a compile costs ~20 s on 2 cores
    ceilings = {"copy_gbps": 4240.0, "matmul_tflops": {"bf16": 750.0, "fp32": 60.0}}
    rows = benchmarks.run(["regimes"], ceilings=ceilings)["rows"]
    names = [r["name"] for r in rows]
    assert [n.split(" n=")[0] for n in names] == [
        "repeat_fma fp32 repeat=1",
        "repeat_fma fp32 repeat=16",
        "repeat_fma fp32 repeat=64",
        "repeat_fma fp32 repeat=256",
        "cos_cos fp32",
    ]
    # ridge 60e12 / 4240e9 = 14 FLOP/B; repeat r has r / 4 FLOP/B
    assert [r["unit"] for r in rows] == ["GB/s", "GB/s", "TFLOP/s", "TFLOP/s", "GB/s"]
    assert set(rows[-1]["baselines"]) == {"torch eager", "torch.compile"}
    assert all(r["ms"] > 0 for r in rows)


def test_sweep_lines_are_the_flat_time_and_the_cost_per_repeat():
    repeats = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    flat, slope = regimes.sweep_lines(repeats, [max(0.5, r / 100) for r in repeats])
    assert flat == pytest.approx(0.5) and slope == pytest.approx(0.01)


def test_fma_budget_is_fma_rate_over_element_rate():
    # 65.8 TFLOP/s is 32.9 T FMA/s; 4240 GB/s moves 530 G fp32 elements/s (8 bytes each)
    assert regimes.fma_budget(65.8, 4240.0, 8) == pytest.approx(32.9e12 / 530e9)
    assert regimes.fma_budget(65.8, 4240.0, 4) == pytest.approx(
        regimes.fma_budget(65.8, 4240.0, 8) / 2
    )
    with pytest.raises(ValueError, match="gbps must be positive"):
        regimes.fma_budget(65.8, 0.0, 8)
    with pytest.raises(TypeError, match="bytes_per_element must be an int"):
        regimes.fma_budget(65.8, 4240.0, 4.0)


def test_double_the_batch_threshold_is_where_the_fixed_cost_is_half():
    # t(b) = c + w b: at c == w b the doubling costs exactly 1.5x, the threshold
    c, wb = 10.0, 10.0
    assert (c + 2 * wb) / (c + wb) == regimes.OVERHEAD_GROWTH
    assert regimes.double_the_batch(1.0, 1.1) == "overhead-bound"  # He's "about 10%"
    assert regimes.double_the_batch(1.0, 1.49) == "overhead-bound"
    assert regimes.double_the_batch(1.0, 1.5) == "scales with the work"
    assert regimes.double_the_batch(1.0, 2.0) == "scales with the work"
    with pytest.raises(ValueError, match="positive"):
        regimes.double_the_batch(0.0, 1.0)
