import pytest

import kernels  # noqa: F401  (fixes the mode before any kernel module is imported)
from kernels.runtime import ON_GPU


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: checked on GPU (make gpu-record)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
