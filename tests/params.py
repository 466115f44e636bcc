"""What every kernel test shares: the dtypes (bf16 marked as a GPU-only check), and how to find
the launch_metadata function a kernel was declared with."""

import pytest
import torch

# bf16 is wrong without an error under Triton's interpreter: checked on the GPU only.
CPU_DTYPES = [torch.float32, torch.float16]
DTYPES = CPU_DTYPES + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="torch.bfloat16")]


def attached_metadata(kernel):
    """The `launch_metadata` function of a @triton.jit kernel: a compiled kernel keeps it as an
    attribute, the interpreter among its options (None when it has none)."""
    return getattr(kernel, "launch_metadata", None) or kernel.kwargs.get("launch_metadata")
