import json
import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from kernels import bench  # noqa: E402
from kernels.runtime import ON_GPU  # noqa: E402

H200 = {"copy_gbps": 4240.0, "matmul_tflops": {"bf16": 750.0, "fp16": 750.0, "fp32": 65.0}}


def test_time_ms_is_a_positive_median_and_passes_arguments():
    seen = []
    ms = bench.time_ms(lambda a, b=0: seen.append(a + b), 2, b=3)
    assert ms > 0 and math.isfinite(ms)
    assert seen and set(seen) == {5}


def test_time_ms_tracks_the_work():
    small, large = torch.randn(1 << 10), torch.randn(1 << 22)
    assert bench.time_ms(torch.sort, large) > bench.time_ms(torch.sort, small)


def test_time_ms_rejects_non_callables():
    with pytest.raises(TypeError, match="callable"):
        bench.time_ms(3)


def test_rates_follow_their_formulas():
    assert bench.achieved_gbps(2e9, 1.0) == pytest.approx(2000.0)  # 2 GB in 1 ms
    assert bench.achieved_tflops(1e12, 1000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ms must be positive"):
        bench.achieved_gbps(1, 0)


def test_measure_ceilings_keys_and_magnitudes():
    c = bench.measure_ceilings(copy_bytes=1 << 24, matmul_n=128)
    assert set(c) == {"copy_gbps", "matmul_tflops"}
    assert set(c["matmul_tflops"]) == {"bf16", "fp16", "fp32"}
    assert 0.1 < c["copy_gbps"] < 10_000
    assert all(0 < v < 2_000 for v in c["matmul_tflops"].values())


def test_roofline_prediction_and_ridge():
    assert bench.ridge_point(H200, "fp32") == pytest.approx(65e12 / 4240e9)
    ms, regime = bench.predicted_ms(flops=1e9, bytes_moved=8e9, ceilings=H200)
    assert regime == "memory-bound" and ms == pytest.approx(8e9 / 4240e6)
    ms, regime = bench.predicted_ms(
        flops=2 * 8192**3, bytes_moved=6 * 8192**2, ceilings=H200, dtype="bf16"
    )
    assert regime == "compute-bound" and ms == pytest.approx(2 * 8192**3 / 750e9)
    with pytest.raises(ValueError, match="no 'fp8'"):
        bench.ridge_point(H200, "fp8")


def test_roofline_plot_draws_two_machines_side_by_side():
    cpu = {"copy_gbps": 20.0, "matmul_tflops": {"fp32": 0.15}}
    point = bench.RooflinePoint("add", flops=1e6, bytes_moved=12e6, ms=0.01)
    ax = bench.plot_roofline({"laptop": cpu, "H200": H200}, {"laptop": [point]}, dtypes=("fp32",))
    labels = [line.get_label() for line in ax.get_lines()]
    assert any(lbl.startswith("laptop fp32") for lbl in labels)
    assert any(lbl.startswith("H200 fp32") for lbl in labels)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="at least one"):
        bench.plot_roofline({})


def test_gpu_slug():
    assert bench.gpu_slug("NVIDIA H200") == "h200"
    assert bench.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"


def test_recorded_results_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-29"}
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "01_demo.json").write_text(
        json.dumps({"meta": meta, "results": {"sweep": [1, 2, 3]}})
    )
    value, got_meta = bench.recorded("01_demo", "sweep")
    assert value == [1, 2, 3] and got_meta == meta
    with pytest.raises(KeyError, match="recorded: \\['sweep'\\]"):
        bench.recorded("01_demo", "missing")
    with pytest.raises(FileNotFoundError, match="make gpu-record"):
        bench.recorded("02_other", "sweep")
    with pytest.raises(ValueError, match="chapter must be"):
        bench.recorded("../etc", "x")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_measure_or_recorded_reads_on_cpu_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-29"}
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "01_demo.json").write_text(
        json.dumps({"meta": meta, "results": {"k": 4.2}})
    )
    calls = []
    assert bench.measure_or_recorded("01_demo", "k", lambda: calls.append(1)) == 4.2
    assert not calls
    assert "recorded on NVIDIA H200" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="no GPU"):
        bench.record("01_demo", "k", 1.0)


@pytest.mark.gpu
def test_measure_or_recorded_measures_and_records_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    assert bench.measure_or_recorded("01_demo", "k", lambda: 1.5) == 1.5
    value, meta = bench.recorded("01_demo", "k", gpu=bench.gpu_slug(meta_device()))
    assert value == 1.5 and meta["device"] == meta_device()


def meta_device():
    return torch.cuda.get_device_name()


@pytest.mark.gpu
def test_gpu_ceilings_are_plausible():
    c = bench.measure_ceilings()
    assert c["copy_gbps"] > 500
    assert c["matmul_tflops"]["bf16"] > 5 * c["matmul_tflops"]["fp32"]


def test_merging_bench_runs_replaces_rows_by_name_and_keeps_each_run():
    from kernels.benchmarks import merge

    row = lambda name, ms: {"name": name, "ms": ms}
    first = {
        "ceilings": {"copy_gbps": 1.0},
        "meta": {"date": "a"},
        "rows": [row("x", 1), row("y", 2)],
    }
    second = {
        "ceilings": {"copy_gbps": 2.0},
        "meta": {"date": "b"},
        "rows": [row("y", 3), row("z", 4)],
    }
    merged = merge(first, second)
    assert [(r["name"], r["ms"]) for r in merged["rows"]] == [("x", 1), ("y", 3), ("z", 4)]
    assert merged["ceilings"] == {"copy_gbps": 2.0} and merged["meta"] == {"date": "b"}
    assert [r["ceilings"]["copy_gbps"] for r in merged["runs"]] == [1.0, 2.0]
    assert merge(merged, first)["runs"][-1]["rows"] == ["x", "y"]
