"""The grader's case kit and the labs' declarations over it, in the grader's process: no child
processes, no kernels run. Strided cases are truly strided, timings are typed, checks across a
group of cases do not depend on the order they are visited in, and the child times through
the course's one timer."""

import inspect
import random

import pytest
import torch

import kernels.bench
from kernels.grader import cases, child, prefixes, ranks
from kernels.grader.labs import LABS
from kernels.grader.runner import ChildRun
from kernels.grader.tasks import Case, Task, Timing, evaluate


def dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory with no gaps, in some order of its dims (a
    transposed view is dense: flat indexing of its memory still meets every element once)."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def test_a_strided_view_holds_the_values_and_is_not_dense():
    x = torch.arange(12.0).reshape(3, 4)
    view = cases.strided(x)
    assert torch.equal(view, x) and view.stride() == (8, 2) and not dense(view)
    assert dense(x.t()) and not x.t().is_contiguous()  # what the old "non-contiguous" cases were
    assert "non-contiguous" in cases.label(view, torch.float32, 7)


def _tensors(case):
    return [a for a in (*case.args, *case.kwargs.values()) if isinstance(a, torch.Tensor)]


KERNEL_TASKS = [(lab, task) for lab, tasks in LABS.items() for task in tasks if task.kernel]


@pytest.mark.parametrize("lab, task", KERNEL_TASKS, ids=[t.name for _, t in KERNEL_TASKS])
def test_every_kernel_task_has_a_truly_strided_case(lab, task):
    drawn = task.cases(random.Random(f"0:{task.name}"))
    tensors = [t for case in drawn for t in _tensors(case)]
    if not any(t.is_floating_point() for t in tensors):
        pytest.skip(f"{task.name} takes no float tensors")
    for case in drawn:
        for t in _tensors(case):
            assert t.is_contiguous() or not dense(t), f"{case.label}: a dense view"
    strided = [case.label for case in drawn if any(not dense(t) for t in _tensors(case))]
    assert strided, f"{lab} {task.name}: no case with a truly strided input"
    assert all("non-contiguous" in label for label in strided), strided


def test_every_lab_draws_the_same_cases_from_the_same_seed():
    for tasks in LABS.values():
        for task in tasks:
            first, again = (task.cases(random.Random(f"5:{task.name}")) for _ in range(2))
            assert [c.label for c in first] == [c.label for c in again], task.name


def test_the_standard_loop_repeats_a_shape_with_fresh_data_then_strides():
    made = []

    def make(rng, spec, dtype, **options):
        x, seed = cases.draw(rng, spec, dtype)
        x = cases.strided(x) if options.pop("strided", False) else x
        made.append((spec, dtype, options))
        return Case((x,), cases.label(x, dtype, seed))

    drawn = cases.standard(
        make,
        [(3,), (5, 7)],
        (torch.float32, torch.float16),
        random.Random(0),
        again=(5, 7),
        extra=[((4, 4), {"kind": "large"})],
        strided_spec=(3, 9),
    )
    assert [spec for spec, _, _ in made] == [(3,), (5, 7), (5, 7), (4, 4), (3, 9)] * 2
    assert made[3][2] == {"kind": "large"}
    assert not torch.equal(drawn[1].args[0], drawn[2].args[0])  # the same shape, new values
    assert not drawn[4].args[0].is_contiguous() and drawn[3].args[0].is_contiguous()
    assert [c.label.split(", ")[-2] for c in drawn] == ["float32"] * 5 + ["float16"] * 5


def test_numbers_and_values_name_what_is_wrong():
    case = Case((), "c", expected=[6, 24.0, "memory-bound"])
    check = cases.numbers(("flops", "bytes", "regime"))
    assert check(case, [6, 24.0, "memory-bound"]) is None
    assert check(case, [6, 25.0, "memory-bound"]) == "returned bytes = 25, expected 24"
    assert "expected 'memory-bound'" in check(case, [6, 24.0, "compute-bound"])
    assert "expected 3 values" in check(case, (6, 24.0))
    assert cases.value("regime")(Case((), "c", expected=["x"]), "x") is None
    ref = torch.ones(3, dtype=torch.float64)
    tensor_case = Case((), "c", expected=ref, dtype=torch.float32)
    assert cases.values("elementwise")(tensor_case, torch.ones(3)) is None
    assert cases.values("elementwise")(tensor_case, torch.zeros(3)).startswith("wrong values")


def test_a_timing_is_read_only_from_its_three_keys():
    good = {"ms": 2.0, "baseline_ms": 1.0, "baseline": "copy"}
    assert Timing.read(good) == Timing(2.0, 1.0, "copy")
    for bad in (None, {}, {"ms": 2.0, "copy_ms": 1.0}, {**good, "ms": 0}, {**good, "ms": "x"}):
        assert Timing.read(bad) is None, bad


def test_one_wording_for_every_speed_check():
    check = cases.speed(0.5, "it reads and writes each element once", rate=lambda ms: "9 GB/s")
    case = Case((), "timed")
    assert check(case, Timing(1.0, 0.6, "copy")) is None
    message = check(case, Timing(2.0, 0.5, "matmul"))
    assert message == (
        "took 2.000 ms (9 GB/s), 25% of the speed of torch.matmul (cuBLAS) (0.500 ms); "
        "it reads and writes each element once, so 50% of it earns the points"
    )
    assert check(case, None) == "no timing came back"
    with pytest.raises(ValueError, match="unknown baseline"):
        cases.timed((), "t", against="sort", min_fraction=0.5, why="")


def test_a_timed_case_is_judged_by_its_own_check_on_a_typed_timing():
    task = Task("t", "f", 1, "", "hint", cases=lambda rng: [], check=lambda c, o: "not this one")
    case = cases.timed((1,), "timed", against="copy", min_fraction=0.5, why="why")
    run = ChildRun(
        {"cases": [{"timing": {"ms": 1.0, "baseline_ms": 0.1, "baseline": "copy"}}], "error": None},
        None,
        "done",
        "",
    )
    outcome = evaluate(task, [case], run, str)
    assert outcome.status == "failed" and "10% of the speed of torch copying" in outcome.message


def test_a_big_input_is_described_in_one_place_and_made_by_the_child():
    spec = cases.big_random(random.Random(0), (3, 5), torch.float16)
    assert cases.is_big_random(spec) and not cases.is_big_random({"builder": "x"})
    made = child._materialize(spec, "cpu")
    assert made.shape == (3, 5) and made.dtype == torch.float16
    assert torch.equal(made, child._materialize(spec, "cpu"))


def test_lab_6s_timed_int8_weight_is_made_by_the_child_from_its_description():
    from kernels.grader import lab06

    (timed,) = [c for c in lab06._int8_gpu_cases(random.Random(0)) if c.action == "time"]
    x, spec, scale = timed.args
    assert (spec["kwargs"]["n"], spec["kwargs"]["k"]) == lab06.TIMED[1:]
    assert timed.timed_against == "dense_weight"
    small = {**spec, "kwargs": {**spec["kwargs"], "n": 5, "k": 7}}  # the builder, at a small size
    made = child._materialize(small, "cpu")
    assert made.dtype == torch.int8 and made.shape == (5, 7) and made.abs().max() <= 127
    assert torch.equal(made, child._materialize(small, "cpu"))


def test_the_child_keeps_a_strided_input_strided_on_its_device():
    view = cases.strided(torch.randn(4, 6))
    moved = child._on_device(view, "meta")  # any other device: the copy keeps the strides
    assert moved.device.type == "meta" and moved.stride() == view.stride()
    assert child._on_device(view, "cpu") is view


def test_the_child_times_through_the_courses_timer(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels.bench, "time_ms", lambda fn, *a, **k: calls.append(fn) or 3.0)
    timing = child._time_case(torch.neg, [torch.ones(4)], {}, "copy")
    assert timing == {"ms": 3.0, "baseline_ms": 3.0, "baseline": "copy"}
    assert calls[0] is torch.neg and len(calls) == 2


def _prefix_cases():
    x = torch.arange(12.0).reshape(4, 3)
    drawn, outputs = [], []
    for group in ("g1", "g2"):
        drawn.append(prefixes.PrefixCase((x,), f"{group} full", group=group))
        outputs.append(x * 2)
        for b in (1, 3):
            drawn.append(prefixes.PrefixCase((x[:b],), f"{group} first {b}", group=group, batch=b))
            outputs.append(x[:b] * 2)
    return prefixes.check_prefixes, drawn, outputs


def test_the_prefix_check_does_not_depend_on_the_order_of_the_cases():
    check_prefixes, drawn, outputs = _prefix_cases()
    assert check_prefixes(drawn, outputs) is None
    outputs[4] = outputs[4].clone()
    outputs[4][0, 0] += 1  # g2's first row, computed alone, differs from the full batch's
    i, message = check_prefixes(drawn, outputs)
    assert drawn[i].label == "g2 first 1" and "not batch-invariant" in message
    order = [5, 3, 0, 4, 1, 2]  # the prefix before its full batch, the groups interleaved
    i, _ = check_prefixes([drawn[k] for k in order], [outputs[k] for k in order])
    assert [drawn[k] for k in order][i].label == "g2 first 1"
    for case in drawn:
        assert case.group in ("g1", "g2")  # the check read the cases and changed none


def test_a_group_check_runs_after_every_case_passed():
    check_prefixes, drawn, outputs = _prefix_cases()
    outputs[2] = outputs[2].clone()
    outputs[2][-1, -1] += 1
    task = Task(
        "t",
        "f",
        3,
        "",
        "same bits for every batch",
        cases=lambda rng: [],
        check=lambda c, o: None,
        check_group=check_prefixes,
    )
    reports = [
        {"output": out, "inputs_after": list(c.args)} for c, out in zip(drawn, outputs, strict=True)
    ]
    run = ChildRun({"cases": reports, "error": None}, None, "done", "")
    outcome = evaluate(task, drawn, run, str)
    assert outcome.status == "failed" and outcome.message.startswith("not batch-invariant")
    assert "[g1 first 3]. Hint: same bits for every batch" in outcome.message


def test_every_baseline_the_child_times_is_named_and_runs():
    # "one_gpu" is timed by the two-rank runner (kernels.grader.ranks), every other by the child
    assert set(child.TIMED_AGAINST) == set(cases.BASELINES) - {"one_gpu"}
    assert '"baseline": "one_gpu"' in inspect.getsource(ranks)
    q, k, v = (torch.randn(1, 2, n, 16) for n in (3, 5, 5))
    args = {"copy": (k,), "matmul": (k[0, 0], k[0, 0].t()), "kv": (q[:, :, 0], k, v)}
    args["attention"] = (k, k, v)
    args["dense_weight"] = (q[0, 0], torch.ones(4, 16, dtype=torch.int8), torch.ones(4))
    for name, baseline in child.TIMED_AGAINST.items():
        out = baseline(list(args[name]))()
        assert all(isinstance(t, torch.Tensor) for t in (out if isinstance(out, tuple) else [out]))
    with pytest.raises(ValueError, match="unknown baseline"):
        cases.timed((k,), "x", against="sdpa", min_fraction=1.0, why="")


def test_the_new_references_agree_with_the_course_and_autograd():
    from kernels.attention import attention_ref
    from kernels.grader import lab04, lab05_decode

    q, k, v = (torch.randn(2, 3, n, 16, dtype=torch.float64) for n in (7, 40, 40))
    # a window as long as the keys is causal attention; a window of 1 is each query's own value
    assert torch.allclose(lab04.window_ref(q, k, v, 40), attention_ref(q, k, v, causal=True))
    assert torch.allclose(lab04.window_ref(q, k, v, 1), v[:, :, -7:])
    for causal in (False, True):
        vg = v.clone().requires_grad_(True)
        do = torch.randn_like(q)
        attention_ref(q, k, vg, causal=causal).backward(do)
        assert torch.allclose(lab04.dv_ref(q, k, do, causal), vg.grad)
    # decoding: the partials, combined, are attention for one query; splits of any size agree
    q1 = q[:, :, 0]
    want = attention_ref(q1[:, :, None], k, v)[:, :, 0]
    assert torch.allclose(lab05_decode.decode_attention_ref(q1, k, v), want)
    for split in (16, 32, 64):
        m, l, acc = lab05_decode.decode_partials_ref(q1, k, v, split)
        assert m.shape == (2, 3, -(-40 // split)) and acc.shape == (*m.shape, 16)
        w = torch.exp(m - m.amax(-1, keepdim=True))
        combined = (w[..., None] * acc).sum(-2) / (w * l).sum(-1)[..., None]
        assert torch.allclose(combined, want)
