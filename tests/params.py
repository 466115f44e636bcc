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


def assert_rows_invariant(fn, x, batches):
    """Batch invariance, bitwise: row i of fn(x[:B]) has the bits of fn(x[i:i+1]), row i
    computed alone, for every B in `batches` (NaN equal to NaN)."""
    from kernels.batch_invariant.harness import differing

    alone = torch.cat([fn(x[i : i + 1]) for i in range(max(batches))])
    for b in batches:
        bad = differing(fn(x[:b]), alone[:b]).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"batch of {b}: rows {bad[:8]} differ from the same rows computed alone"
