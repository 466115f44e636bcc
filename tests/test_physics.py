"""Physics checks (kernels.roofs): no recorded benchmark row above its roof without a reason,
and none above the datasheet's peak at all."""

import copy
import json
import re

import pytest

from kernels import bench, benchmarks, notebook, roofs

RECORDED_FILES = sorted(bench.DATA_DIR.glob("*/*.json"))
H200_DIR = bench.DATA_DIR / "h200"


def load(name):
    return json.loads((H200_DIR / name).read_text())


def named(data, name):
    """The one benchmark row called `name` inside `data`."""
    (found,) = [r for _, r in roofs.benchmark_rows(data) if r["name"] == name]
    return found


DECLARED = benchmarks.ABOVE_ROOF  # the reasons of rows recorded before rows carried their own


def check_recorded(data, source):
    """roofs.check as the callers that read recorded files run it: with the declared reasons."""
    return roofs.check(data, source, "h200", DECLARED)


def only(problems, *words):
    assert len(problems) == 1, problems
    assert all(w in problems[0] for w in words), problems[0]
    return problems[0]


@pytest.mark.parametrize("path", RECORDED_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_recorded_file_passes(path):
    assert roofs.check_file(path, benchmarks.ABOVE_ROOF) == []


def test_the_checks_see_the_rows_of_each_recorded_shape():
    # bench.json's rows, a chapter's list of rows, a chapter's run inside a result
    counts = {n: len(list(roofs.benchmark_rows(load(n)))) for n in ("bench.json", "02_fusion.json")}
    fusion = load("02_fusion.json")["results"]["fusion_bench"]
    assert counts["bench.json"] >= 90 and counts["02_fusion.json"] == len(fusion) >= 8
    cost = [w for w, _ in roofs.benchmark_rows(load("05_batch_invariance.json"))]
    assert cost and all(w.startswith("results.cost.rows[") for w in cost)
    assert all(r["unit"] in roofs.RATE_UNITS for _, r in roofs.benchmark_rows(load("bench.json")))


def test_todays_rows_above_their_measured_roof_pass_only_by_their_reasons():
    data = load("bench.json")
    problems = roofs.check(data, "bench.json", "h200")  # each row's own reason only
    assert all("no reason" in p for p in problems)
    rows = [r for _, r in roofs.benchmark_rows(data)]
    excused = {r["name"] for r in rows if not roofs.reason(r) and roofs.reason(r, DECLARED)}
    assert {p.split("'")[1] for p in problems} <= excused  # the declared table covers each


def test_each_declared_reason_names_recorded_rows_and_says_something():
    rows = [r for _, r in roofs.benchmark_rows(load("bench.json"))]
    for pattern, unit, why in benchmarks.ABOVE_ROOF:
        assert unit in roofs.RATE_UNITS and len(why) > 40
        matched = [r for r in rows if r["unit"] == unit and roofs.reason(r, DECLARED) == why]
        assert matched, f"{pattern!r} ({unit}) matches no recorded row"


def test_a_gbps_row_above_copy_without_a_reason_fails():
    data = load("bench.json")
    r = named(data, "softmax bf16 16384x8192")
    r["pct_of_ceiling"] = 101.0  # the rate stays: the ceiling it implies is rate / 1.01
    message = only(check_recorded(data, "bench.json"), "softmax bf16 16384x8192")
    assert "bench.json rows[" in message and f"{r['rate']:.1f} GB/s is 101.0%" in message
    assert f"copy ceiling ({r['rate'] / 1.01:.1f} GB/s)" in message and "no reason" in message
    r["above_roof"] = "a planted reason"
    assert check_recorded(data, "bench.json") == []


def test_a_row_inside_a_chapters_result_is_checked_and_named():
    data = load("05_batch_invariance.json")  # a row with no reason to pass its ceiling
    named(data, "invariant rms_norm 16384x4096 [call]")["pct_of_ceiling"] = 100.5
    message = only(check_recorded(data, "05.json"), "'invariant rms_norm 16384x4096 [call]'")
    assert message.startswith("05.json results.cost.rows[") and "100.5%" in message


def test_a_tflops_row_above_its_ceiling_without_a_reason_fails():
    data = load("bench.json")
    attn = named(data, "attn fwd bf16 D=128 S=16k")
    attn["pct_of_ceiling"] = 110.0  # the rate stays: the ceiling it implies is rate / 1.1
    message = only(check_recorded(data, "bench.json"), "attn fwd bf16 D=128 S=16k")
    assert f"{attn['rate']:.1f} TFLOP/s is 110.0%" in message
    assert f"matmul ceiling ({attn['rate'] / 1.1:.1f} TFLOP/s)" in message
    assert "no reason" in message


def test_a_row_above_the_datasheet_fails_even_with_a_reason():
    data = load("bench.json")
    add = named(data, "add fp32 n=2^28")  # excused above copy by its declared reason
    add["rate"] = 4900.0
    message = only(check_recorded(data, "bench.json"), "add fp32 n=2^28")
    assert "4900.0 GB/s is above the datasheet's HBM bandwidth (4800.0 GB/s)" in message
    add["rate"], add["above_roof"] = 4700.0, "its own reason"
    assert check_recorded(data, "bench.json") == []
    fma = named(data, "repeat_fma fp32 repeat=256 n=2^27")
    fma["rate"], fma["above_roof"] = 68.0, "a planted reason"
    only(check_recorded(data, "bench.json"), "repeat_fma", "fp32 peak (67.0 TFLOP/s)")


def test_the_datasheet_peak_is_the_one_for_the_rows_dtype():
    data = load("bench.json")
    tf32 = named(data, "matmul fp32 tf32 4096^3")
    tf32["rate"] = 500.0  # under bf16's 989.5, above TF32's 494.5
    tf32["pct_of_ceiling"] = 100 * 500.0 / 360.3
    problems = check_recorded(data, "bench.json")
    assert len(problems) == 2 and all("matmul fp32 tf32 4096^3" in p for p in problems)
    assert any("tf32 peak (494.5 TFLOP/s)" in p for p in problems)
    r = {"name": "mm", "unit": "TFLOP/s", "rate": 500.0, "pct_of_ceiling": 50.0}
    assert roofs.check([r], "x", "h200") == []  # no dtype: held to the highest peak
    assert only(roofs.check([{**r, "dtype": "tf32"}], "x", "h200"), "tf32 peak")
    assert only(roofs.check([{**r, "dtype": "fp8"}], "x", "h200"), "no fp8 peak")


def test_a_measured_ceiling_above_the_datasheet_fails():
    data = load("02_fusion.json")
    data["results"]["ceilings"]["matmul_tflops"]["fp32"] = 70.0
    only(check_recorded(data, "02.json"), "results.ceilings", "fp32 matmul 70.0")


def test_a_gpu_without_a_datasheet_gets_the_measured_check_only():
    r = {"name": "x", "unit": "GB/s", "rate": 1e6, "pct_of_ceiling": 99.0}
    assert roofs.check([r], "x", "some-gpu") == []
    only(roofs.check([{**r, "pct_of_ceiling": 101.0}], "x", "some-gpu"), "no reason")
    assert "measured ceilings only" in roofs.describe("some-gpu")
    assert "datasheet" in roofs.describe("h200") and bench.RECORDED_GPU in roofs.DATASHEET


def test_a_built_row_carries_its_reason_and_dtype():
    ceilings = {"copy_gbps": 1000.0, "matmul_tflops": {"bf16": 100.0}}
    r = benchmarks.row("mm", 1.0, flops=2e11, ceilings=ceilings, dtype="bf16", above_roof="why")
    assert r["pct_of_ceiling"] == pytest.approx(200.0) and r["dtype"] == "bf16"
    assert roofs.reason(r) == "why" and roofs.check([r], "x", "h200") == []
    del r["above_roof"]
    only(roofs.check([r], "x", "h200"), "'mm'", "200.0%")


# --- the recorder refuses: bench --json, bench.record, python -m kernels record --------------
@pytest.fixture
def on_h200(monkeypatch):
    """This machine seen as an H200 (the runs are faked: nothing is measured)."""
    import torch

    from kernels import runtime

    device = {**runtime.versions(), "device": "NVIDIA H200"}
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(runtime, "versions", lambda: device)
    monkeypatch.setattr(bench, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")


def planted_run(monkeypatch, pct):
    ceilings = {"copy_gbps": 4000.0, "matmul_tflops": {"bf16": 700.0, "fp16": 700.0, "fp32": 50.0}}
    good = benchmarks.row("good", 1.0, bytes_moved=2e9, ceilings=ceilings)  # 50% of copy
    bad = {**good, "name": "planted", "pct_of_ceiling": pct}
    run = lambda names=None: {"ceilings": ceilings, "rows": [good, bad]}
    monkeypatch.setattr(benchmarks, "run", run)


def test_bench_json_refuses_a_run_that_breaks_physics(on_h200, monkeypatch, tmp_path, capsys):
    out = tmp_path / "bench.json"
    planted_run(monkeypatch, pct=103.0)
    assert benchmarks.main(json_path=str(out)) == 1
    err = capsys.readouterr().err
    assert "NOT written" in err and "'planted'" in err and "103.0%" in err
    assert not out.exists()
    planted_run(monkeypatch, pct=60.0)
    assert benchmarks.main(json_path=str(out)) == 0
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == ["good", "planted"]


def test_bench_update_merges_and_still_refuses(on_h200, monkeypatch, tmp_path, capsys):
    out = tmp_path / "bench.json"
    out.write_text((H200_DIR / "bench.json").read_text())
    planted_run(monkeypatch, pct=60.0)
    assert benchmarks.main(json_path=str(out), update=True) == 0
    merged = json.loads(out.read_text())
    assert len(merged["rows"]) == len(load("bench.json")["rows"]) + 2
    assert len(merged["runs"]) == len(load("bench.json")["runs"]) + 1
    planted_run(monkeypatch, pct=130.0)
    assert benchmarks.main(json_path=str(out), update=True) == 1
    assert json.loads(out.read_text()) == merged
    assert "'planted'" in capsys.readouterr().err


def test_bench_record_refuses_a_value_with_a_row_above_its_roof(on_h200, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    fusion = load("02_fusion.json")["results"]["fusion_bench"]
    bad = copy.deepcopy(fusion)
    bad[3]["pct_of_ceiling"] = 100.1
    name = re.escape(fusion[3]["name"])
    expected = rf"(?s)not recorded: 1 physics.*\['fusion_bench'\]\[3\] '{name}'"
    with pytest.raises(ValueError, match=expected):
        bench.record("02_demo", "fusion_bench", bad)
    assert not (tmp_path / "h200" / "02_demo.json").exists()
    bench.record("02_demo", "fusion_bench", fusion)
    assert bench.recorded("02_demo", "fusion_bench")[0] == fusion


def test_the_notebook_recorder_checks_the_chapters_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "DATA_DIR", tmp_path)
    (tmp_path / "h200").mkdir()
    data = load("05_batch_invariance.json")
    (tmp_path / "h200" / "05_batch_invariance.json").write_text(json.dumps(data))
    assert notebook.check_physics("chapters/05_batch_invariance.ipynb", "NVIDIA H200") == []
    assert notebook.check_physics("labs/05_batch_invariance_lab.ipynb", "NVIDIA H200") == []
    named(data, "invariant matmul M=4096")["rate"] = 1000.0  # above bf16's 989.5
    (tmp_path / "h200" / "05_batch_invariance.json").write_text(json.dumps(data))
    meta = {"device": "NVIDIA H200", "torch": "t", "triton": "t"}
    monkeypatch.setattr(notebook, "record", lambda path: meta)
    assert notebook.main(["chapters/05_batch_invariance.ipynb"]) == 1
    err = capsys.readouterr().err
    assert "PHYSICS" in err and "'invariant matmul M=4096'" in err and "bf16 peak" in err
