import json
import math
import time

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from kernels import bench  # noqa: E402
from kernels.runtime import ON_GPU  # noqa: E402
from kernels.softmax_tuning import PATHS  # noqa: E402

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
    # on a GPU, a copy well past the L2 (60 MiB on an H200): a smaller one times the cache
    c = bench.measure_ceilings(copy_bytes=1 << 28 if ON_GPU else 1 << 24, matmul_n=128)
    assert set(c) == {"copy_gbps", "matmul_tflops", "add_gbps", "fma_tflops"}
    assert set(c["matmul_tflops"]) == {"bf16", "fp16", "fp32"}
    assert 0.1 < c["copy_gbps"] < 10_000 and 0.1 < c["add_gbps"] < 10_000
    assert all(0 < v < 2_000 for v in c["matmul_tflops"].values())
    if ON_GPU:  # an FMA loop on the GPU: far below an fp32 core's peak at this size, never above it
        assert set(c["fma_tflops"]) == {"fp32"} and 0 < c["fma_tflops"]["fp32"] < 100
    else:  # on a CPU the interpreter would run the FMA loop in Python
        assert c["fma_tflops"] == {}


def test_best_roofs_take_the_fastest_program_and_keep_the_copy():
    measured = {**H200, "matmul_tflops": {"bf16": 700.0, "fp32": 50.9}, "add_gbps": 4400.0}
    roofs = bench.best_roofs({**measured, "fma_tflops": {"fp32": 65.8}})
    assert roofs == {"copy_gbps": 4240.0, "matmul_tflops": {"bf16": 700.0, "fp32": 65.8}}
    assert bench.ridge_point(roofs, "fp32") == pytest.approx(65.8e12 / 4240e9)
    assert bench.best_roofs(measured)["matmul_tflops"]["fp32"] == 50.9  # no FMA probe: a CPU
    sheet = bench.datasheet_ceilings("h200")
    assert sheet["copy_gbps"] == 4800.0 and sheet["matmul_tflops"]["fp32"] == 67.0
    with pytest.raises(ValueError, match="no datasheet figures for 'laptop'"):
        bench.datasheet_ceilings("laptop")


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


def test_the_datasheet_is_drawn_grey_beside_the_measured_roofs():
    sheet = bench.datasheet_ceilings("h200")
    ax = bench.plot_roofline({"H200": H200}, dtypes=("fp32", "bf16"))
    measured = len(ax.get_lines())
    bench.plot_datasheet(ax, sheet, dtypes=("fp32", "bf16"), name="H200 datasheet")
    fp32, bf16 = ax.get_lines()[measured:]
    assert (fp32.get_label(), bf16.get_label()) == ("H200 datasheet fp32", "H200 datasheet bf16")
    assert fp32.get_linestyle() == "--" and bf16.get_linestyle() == ":"
    assert fp32.get_color() == bf16.get_color() == "gray"
    x, y = fp32.get_data()  # the slope at copy_gbps, then the flat fp32 peak
    assert y[0] == pytest.approx(sheet["copy_gbps"] * x[0] / 1e3) and y[-1] == 67.0
    assert bf16.get_data()[1][-1] == sheet["matmul_tflops"]["bf16"]


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
    # the course's FMA loop is the fp32 roof: at least cuBLAS's SGEMM, at most the datasheet
    sheet = bench.datasheet_ceilings(bench.gpu_slug(torch.cuda.get_device_name()))
    assert c["matmul_tflops"]["fp32"] <= c["fma_tflops"]["fp32"] <= sheet["matmul_tflops"]["fp32"]
    assert 0.9 * c["copy_gbps"] < c["add_gbps"] <= sheet["copy_gbps"]


def test_loop_us_times_each_call():
    calls = []
    us = bench.loop_us(calls.append, 1, budget_s=0.01)
    assert 0 < us < 1e4 and len(calls) >= 2 and set(calls) == {1}


def test_loop_us_and_cpu_us_per_call_see_the_time_a_call_takes():
    # a 2 ms call is 2000 us per call; other processes only ever add time
    assert 2000 <= bench.loop_us(time.sleep, 0.002, budget_s=0.02, rounds=2) < 20_000
    assert 2000 <= bench.cpu_us_per_call(lambda: time.sleep(0.002), calls=5) < 20_000


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_graph_ms_says_it_needs_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        bench.graph_ms(lambda: None)


# --- the benchmark suite: kernels.benchmarks -------------------------------------------------
RECORDED = json.loads((bench.DATA_DIR / bench.RECORDED_GPU / "bench.json").read_text())
ROW_KEYS = {"name", "ms", "unit", "rate", "pct_of_ceiling", "baselines"}
OPTIONAL_ROW_KEYS = {"dtype", "above_roof"}  # written by rows built since they were recorded


def test_the_registry_names_each_chapters_benchmarks_in_order():
    from kernels import benchmarks

    assert list(benchmarks.BENCHMARKS) == [
        "add",
        "regimes",
        "matmul",
        "fusion",
        "softmax",
        "norm_backward",
        "attention",
        "batch_invariant",
        "overhead",
        "decode",
        "shapes",
    ]
    modules = {name: fn.__module__ for name, fn in benchmarks.BENCHMARKS.items()}
    assert modules["regimes"] == "kernels.benchmarks.regimes"
    assert modules["matmul"] == "kernels.benchmarks.matmul"
    assert modules["attention"] == "kernels.benchmarks.attention"
    assert modules["batch_invariant"] == "kernels.benchmarks.batch_invariant"
    assert modules["decode"] == "kernels.benchmarks.decode"
    assert modules["overhead"] == "kernels.benchmarks.overhead"
    assert modules["shapes"] == "kernels.benchmarks.shapes"
    assert {modules[n] for n in ("add", "fusion", "softmax", "norm_backward")} == {
        "kernels.benchmarks.fusion"
    }


def test_run_measures_the_named_benchmarks_in_registry_order(monkeypatch):
    from kernels import benchmarks

    seen = []
    fake = lambda label: lambda ceilings: seen.append(ceilings) or [{"name": label}]
    monkeypatch.setattr(benchmarks, "BENCHMARKS", {"a": fake("a"), "b": fake("b")})
    result = benchmarks.run(["b", "a"], ceilings=H200)
    assert result == {"ceilings": H200, "rows": [{"name": "b"}, {"name": "a"}]}
    assert benchmarks.run(ceilings=H200)["rows"] == [{"name": "a"}, {"name": "b"}]
    assert seen == [H200] * 4
    with pytest.raises(ValueError, match=r"unknown benchmarks \['c'\]; known: \['a', 'b'\]"):
        benchmarks.run(["a", "c"], ceilings=H200)


def test_a_row_is_rated_against_the_ceiling_of_its_regime():
    from kernels.benchmarks import row

    memory = row("copy", 2.0, bytes_moved=8.48e9, ceilings=H200, baselines={"torch": 1.0})
    assert set(memory) == ROW_KEYS and memory["unit"] == "GB/s"
    assert memory["rate"] == pytest.approx(4240.0) and memory["pct_of_ceiling"] == pytest.approx(
        100
    )
    compute = row("mm", 1.0, flops=375e9, ceilings=H200, dtype="bf16")
    assert set(compute) == ROW_KEYS | {"dtype"} and compute["dtype"] == "bf16"
    assert compute["unit"] == "TFLOP/s" and compute["rate"] == pytest.approx(375.0)
    assert compute["pct_of_ceiling"] == pytest.approx(50.0) and compute["baselines"] == {}
    with pytest.raises(KeyError):
        row("mm", 1.0, flops=1e9, ceilings=H200, dtype="fp8")


def test_format_table_prints_rates_ceilings_and_ratios():
    from kernels.benchmarks import format_table, row

    rows = [
        row("add", 2.0, bytes_moved=8.48e9, ceilings=H200, baselines={"torch": 4.0}),
        {**row("serving", 10.0, bytes_moved=1, ceilings=H200), "pct_of_ceiling": None},
    ]
    lines = format_table({"ceilings": H200, "rows": rows}).splitlines()
    assert lines[0] == "copy bandwidth 4240 GB/s; matmul bf16 750.0, fp16 750.0, fp32 65.0 TFLOP/s"
    assert lines[1].split() == ["kernel", "ms", "rate", "%", "ceiling", "vs", "baselines"]
    assert lines[2].split() == ["add", "2.0000", "4240.0", "GB/s", "100.0%", "torch", "2.00x"]
    assert lines[3].split() == ["serving", "10.0000", "0.0", "GB/s"]  # no ceiling: left blank
    assert "above 1 means the kernel is faster" in lines[4] and len(lines) == 5
    assert format_table({"ceilings": H200, "rows": []}) == lines[0]


def test_the_recorded_run_is_a_whole_table():
    from kernels.benchmarks import format_table

    assert "NVIDIA" in RECORDED["meta"]["device"]
    assert {"copy_gbps", "matmul_tflops"} <= set(RECORDED["ceilings"])
    names = [r["name"] for r in RECORDED["rows"]]
    assert len(names) == len(set(names)), "a row name appears twice"
    assert all(ROW_KEYS <= set(r) <= ROW_KEYS | OPTIONAL_ROW_KEYS for r in RECORDED["rows"])
    assert all(r["ms"] > 0 for r in RECORDED["rows"])
    assert {r["unit"] for r in RECORDED["rows"]} <= {"GB/s", "TFLOP/s", "tok/s", "us/call"}
    # every row's name was written by a run listed in "runs"
    assert set(names) <= {n for run in RECORDED["runs"] for n in run["rows"]}
    table = format_table(RECORDED)
    assert all(name in table for name in names)


def test_a_new_run_merges_into_the_recorded_one_by_name():
    from kernels.benchmarks import merge

    first, *rest = RECORDED["rows"]
    later = {
        "ceilings": H200,
        "meta": {"date": "later"},
        "rows": [{**first, "ms": 2 * first["ms"]}, {**first, "name": "new row"}],
    }
    merged = merge(RECORDED, later)
    assert [r["name"] for r in merged["rows"]] == [r["name"] for r in rest] + [
        first["name"],
        "new row",
    ]
    assert merged["rows"][-2]["ms"] == 2 * first["ms"]
    assert merged["runs"][:-1] == RECORDED["runs"]
    assert merged["runs"][-1] == {
        "ceilings": H200,
        "meta": {"date": "later"},
        "rows": [
            first["name"],
            "new row",
        ],
    }
    assert merged["ceilings"] == H200 and merged["meta"] == {"date": "later"}


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_bench_on_a_cpu_prints_and_writes_the_recorded_run(tmp_path, capsys):
    from kernels import benchmarks

    out = tmp_path / "bench.json"
    assert benchmarks.main(["matmul"], json_path=str(out)) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("No GPU here") and "Recorded results from NVIDIA H200" in printed
    assert benchmarks.format_table(RECORDED) in printed
    assert json.loads(out.read_text()) == RECORDED


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_bench_on_a_cpu_without_a_recorded_run_says_so(tmp_path, monkeypatch, capsys):
    from kernels import benchmarks

    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    out = tmp_path / "bench.json"
    assert benchmarks.main(json_path=str(out)) == 0
    assert "No recorded results yet (bench.json): run `make gpu-record`" in capsys.readouterr().out
    assert not out.exists()


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


def test_rotating_copies_pass_the_bytes_asked_for():
    from kernels.bench import rotating_copies

    t = torch.arange(1000, dtype=torch.float32)  # 4000 bytes
    copies = rotating_copies(t, past_bytes=10_000)
    assert copies[0] is t and len(copies) == 4  # 16000 bytes, and no call sees its copy twice
    assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c in copies[1:])
    assert len(rotating_copies(t, past_bytes=0)) == 2
    assert len(rotating_copies(t, past_bytes=10_000, most=3)) == 3  # capped
    assert len(rotating_copies(t, past_bytes=10_000, most=1)) == 1  # t alone


def test_timed_rows_give_graph_and_call_rows_only_when_asked(monkeypatch):
    """Fake timers: [graph] rows take the graph's times (ours and each baseline's), [call] rows
    and the one plain row the call's."""
    from kernels.benchmarks import rows

    seen = []

    def graph_ms(fn, argsets):
        seen.append(len(argsets))
        return {"ours": 1.0, "base": 3.0}[fn.__name__]

    monkeypatch.setattr(bench, "rotating_graph_ms", graph_ms)
    monkeypatch.setattr(bench, "time_ms", lambda fn, *args: {"ours": 2.0, "base": 4.0}[fn.__name__])

    def ours(x):
        return x

    def base(x):
        return x

    argsets = [(torch.ones(2),), (torch.ones(2),)]
    kwargs = dict(bytes_moved=8e9, ceilings=H200)
    both = rows.timed_rows("k", ours, argsets, {"base": base}, graph=True, **kwargs)
    assert [r["name"] for r in both] == ["k [graph]", "k [call]"] and seen == [2, 2]
    assert [r["ms"] for r in both] == [1.0, 2.0]
    assert [r["baselines"] for r in both] == [{"base": 3.0}, {"base": 4.0}]
    (plain,) = rows.timed_rows("k", ours, argsets, {"base": base}, graph=False, **kwargs)
    assert plain["name"] == "k" and plain["ms"] == 2.0 and plain["baselines"] == {"base": 4.0}
    assert plain["rate"] == pytest.approx(4000.0) and seen == [2, 2]  # no graph timed


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_rotating_graph_ms_says_it_needs_a_gpu():
    from kernels.bench import rotating_graph_ms

    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        rotating_graph_ms(torch.neg, [(torch.ones(3),)])


@pytest.mark.gpu
def test_the_launch_ladder_has_every_rung_and_the_cached_launch_is_lighter():
    from kernels.benchmarks import overhead

    def ordered(rungs):
        keyed = rungs["cached launch, call-site key alone"]
        return (
            # the point of kernels.launch: the same kernel for less host time than kernel[grid]
            rungs["cached compiled-kernel launch alone"] < rungs["Triton kernel[grid] alone"]
            # the call site's own key costs less than a key over every argument; the C
            # launcher least
            and rungs["C launcher alone (arguments ready)"] < keyed
            and keyed < rungs["Triton kernel[grid] alone"]
            # the kernel operator skips custom_op's Python around the same implementation
            and rungs["kernel operator (no autograd)"] < rungs["torch.library operator"]
        )

    # Host time on a loaded machine (other tests running beside this one) can swap two close
    # rungs in one ladder: the order must hold in one of three, each the best of three rounds.
    for _ in range(3):
        result = overhead.add_ladder()
        rungs = result["rungs"]
        if ordered(rungs):
            break
    assert all(us > 0 for us in rungs.values()), rungs
    assert {"torch eager", "CUDA graph replay", "torch.compile reduce-overhead"} <= set(rungs)
    assert ordered(rungs), rungs
    assert len(overhead.rows(result)) == len(rungs)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU sizes")
def test_the_shapes_rows_small_on_a_cpu(monkeypatch):
    from kernels import benchmarks
    from kernels.benchmarks import shapes

    monkeypatch.setattr(bench, "time_ms", _one_call_ms)  # the rows' making, not their timings
    rows = benchmarks.run(["shapes"], ceilings=H200)["rows"]
    softmax_rows = [r for r in rows if r["name"].startswith("softmax sweep")]
    assert len(softmax_rows) == len(shapes.softmax_sizes())
    assert [r["name"] for r in rows[len(softmax_rows) :]] == [
        *(f"matmul shapes fp32 {m}x{n}x{k}" + " Wt" * w for m, n, k, w in shapes.MATMUL_SHAPES),
        "bias_gelu fp32 64x256",
    ]
    assert all(r["ms"] > 0 and r["rate"] > 0 for r in rows)
    assert [r["unit"] for r in rows] == ["GB/s"] * len(softmax_rows) + ["TFLOP/s"] * 3 + ["GB/s"]
    # each softmax row times every path that can hold its rows, and torch's
    assert set(softmax_rows[0]["baselines"]) == {"torch"} | {f"path {p}" for p in PATHS}
    assert set(rows[-1]["baselines"]) == {"torch", "x.clone()"}


def _one_call_ms(fn, *args, **kwargs):
    start = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1e3


@pytest.mark.skipif(ON_GPU, reason="checks the CPU path")
def test_a_two_gpu_measurement_is_read_or_noted_on_a_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    calls = []
    assert bench.measure_or_note("07_demo", "k", lambda: calls.append(1), gpus=2) is None
    assert "not recorded yet on 2 GPUs (no GPU here)" in capsys.readouterr().out
    meta = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-02"}
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "07_demo.json").write_text(json.dumps({"meta": meta, "results": {"k": 7}}))
    assert bench.measure_or_note("07_demo", "k", lambda: calls.append(1), gpus=2) == 7
    assert not calls and "recorded on NVIDIA H200" in capsys.readouterr().out
    with pytest.raises(ValueError, match="gpus must be a positive int"):
        bench.measure_or_recorded("07_demo", "k", lambda: 1, gpus=0)


@pytest.mark.gpu
def test_a_measurement_needing_more_gpus_than_the_machine_has_is_not_run(monkeypatch, capsys):
    monkeypatch.setattr(bench, "gpu_count", lambda: 1)
    result = bench.measure_or_note("07_no_such_chapter", "k", lambda: pytest.fail("ran"), gpus=2)
    assert result is None
    assert "this needs 2 GPUs and this machine has 1" in capsys.readouterr().out
