"""Parameters every kernel test shares: the dtypes, with bf16 marked as a GPU-only check."""

import pytest
import torch

# bf16 is wrong without an error under Triton's interpreter: checked on the GPU only.
CPU_DTYPES = [torch.float32, torch.float16]
DTYPES = CPU_DTYPES + [pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="torch.bfloat16")]
