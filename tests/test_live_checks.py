"""Live numbers that break the model say so: CPU ceilings no CPU is that slow at, a point above
its roofline, a CPU timing whose runs spread too far (kernels.roofline, kernels.bench); and CPU
mode pins torch to one thread (kernels.notebook.banner)."""

import pytest
import torch

from kernels import bench, roofline
from kernels.notebook import banner
from kernels.roofline import RooflinePoint
from kernels.runtime import ON_GPU

CPU = {"copy_gbps": 20.0, "matmul_tflops": {"fp32": 0.05, "bf16": 0.4}}  # ridge fp32 2.5 FLOP/B


def test_plausible_cpu_ceilings_pass():
    assert roofline.implausible_cpu_ceilings(CPU) == []


@pytest.mark.parametrize(
    "ceilings, names",
    [
        ({**CPU, "copy_gbps": 0.9}, ["copy ran at 0.9 GB/s"]),
        ({**CPU, "matmul_tflops": {"fp32": 5e-4}}, ["fp32 matmul ran at 0.5 GFLOP/s"]),
        ({"copy_gbps": 0.5, "matmul_tflops": {"fp32": 1e-4}}, ["copy", "fp32 matmul"]),
    ],
)
def test_implausible_cpu_ceilings_name_the_number_and_why(ceilings, names):
    problems = roofline.implausible_cpu_ceilings(ceilings)
    assert len(problems) == len(names)
    for problem, name in zip(problems, names, strict=True):
        assert name in problem and "busy" in problem


def _point(tflops, intensity, name="p"):
    flops = 1e9
    return RooflinePoint(name, flops, flops / intensity, flops / (tflops * 1e9))


def test_a_point_on_or_under_its_roof_is_fine():
    assert roofline.above_roof(_point(0.05, 100.0), CPU) is None  # on the compute roof
    assert roofline.above_roof(_point(0.0199, 1.0), CPU) is None  # on the bandwidth slope
    assert roofline.above_roof(_point(0.052, 100.0), CPU) is None  # within 5%


def test_a_point_above_its_roof_says_by_how_much_and_why():
    problem = roofline.above_roof(_point(0.1, 100.0, "fma x512"), CPU)
    assert problem.startswith("fma x512: 0.1 TFLOP/s at 100 FLOP/B is 2.00x above")
    assert "compute-bound" in problem and "ceilings were measured low" in problem
    problem = roofline.above_roof(_point(0.04, 1.0), CPU)  # twice the 20 GB/s slope
    assert "2.00x above" in problem and "memory-bound" in problem


def test_above_roof_takes_the_highest_roof_drawn():
    point = _point(0.1, 100.0)
    assert roofline.above_roof(point, CPU, dtypes=("fp32", "bf16")) is None  # under bf16's 0.4
    assert roofline.above_roof(point, CPU, dtypes=("fp16",)) is None  # no such roof: no claim


def test_plot_roofline_warns_about_a_point_above_its_roof(capsys):
    import matplotlib

    matplotlib.use("Agg")
    roofline.plot_roofline({"cpu": CPU}, [_point(0.1, 100.0, "too fast")])
    err = capsys.readouterr().err
    assert "warning: cpu: too fast: 0.1 TFLOP/s" in err
    roofline.plot_roofline({"cpu": CPU}, [_point(0.01, 100.0, "fine")])
    assert capsys.readouterr().err == ""


def test_unsteady_timings_are_those_whose_median_waited():
    assert not bench.unsteady_timing([1.0, 1.1, 1.2, 3.0, 3.9])
    assert bench.unsteady_timing([1.0, 4.5, 5.0, 5.0, 6.0])


@pytest.mark.skipif(ON_GPU, reason="CPU mode only: a GPU run keeps torch's threads")
def test_banner_pins_one_thread_in_cpu_mode_and_says_so(capsys):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        banner()
        assert torch.get_num_threads() == 1
        assert "torch on 1 CPU thread" in capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
