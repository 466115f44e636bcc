import zlib

import pytest
import torch

import kernels  # noqa: F401  (fixes the mode before any kernel module is imported)
from kernels.runtime import ON_GPU


@pytest.fixture(autouse=True)
def seeded(request):
    """Torch's global generator seeded from the test's name: a test's unseeded random inputs
    are the same whichever tests ran before it (alone, in the suite, or in another order), so
    a failure seen once is seen again."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def untuned_split_k(monkeypatch):
    """The split-K, GEMV and int8 kernels take each tile list's first candidate, untimed
    (kernels.split_k_tuning.AUTOTUNE, already off on a CPU): tests check results, which every
    plan must get right (tests/test_split_k.py runs every candidate on the GPU), and timing each
    new shape's candidates would cost seconds a shape. Tests of the tuner turn it back on."""
    from kernels import split_k_tuning

    monkeypatch.setattr(split_k_tuning, "AUTOTUNE", False)


def pytest_configure(config):
    config.addinivalue_line("markers", "two_gpus: needs 2 CUDA GPUs (NCCL); skipped on fewer")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: checked on GPU (make gpu-record)")
    gpus = torch.cuda.device_count() if ON_GPU else 0
    skip_two = pytest.mark.skip(
        reason=f"needs 2 CUDA GPUs, this machine has {gpus}: checked on a 2-GPU machine "
        "(make gpu-record)"
    )
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        if "two_gpus" in item.keywords and gpus < 2:
            item.add_marker(skip_two)
