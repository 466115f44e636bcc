"""`batch_invariant_mode()`: torch's own ops routed to the batch-invariant kernels through
`torch.library`, for the CPU and the CUDA dispatch keys alike, so that an unmodified PyTorch
model runs on them:

    with batch_invariant_mode():
        logits = model(tokens)     # nn.Linear -> aten::addmm -> the invariant matmul, ...

Inside the block, `enabled()` is True; code that calls attention itself (as `kernels.llm.ops`
does) asks it which attention to use. Everything is restored on exit.
"""

import contextlib
import math
import warnings

import torch

from kernels.batch_invariant.full_k_matmul import matmul
from kernels.batch_invariant.rows import mean, softmax
from kernels.runtime import DEVICE
from kernels.validate import FLOAT_DTYPES

_active = 0


def enabled() -> bool:
    """True inside `batch_invariant_mode()`."""
    return _active > 0


def _ours(*tensors) -> bool:
    """Tensors the Triton kernels take: on the kernels' device, in a float dtype they support.
    Anything else (fp64, integers, CPU tensors on a GPU machine) goes the ordinary way."""
    return all(t.device.type == DEVICE.type and t.dtype in FLOAT_DTYPES for t in tensors) and (
        len({t.dtype for t in tensors}) == 1
    )


# The replacements. Their fallbacks call ops that are not routed (bmm, baddbmm, sum,
# logsumexp), since calling a routed op from inside its replacement would come straight back.


def _mm(a, b):
    if _ours(a, b):
        return matmul(a, b)
    return torch.bmm(a[None], b[None])[0]


def _addmm(bias, a, b, *, beta=1, alpha=1):
    if not _ours(bias, a, b):
        return torch.baddbmm(bias, a[None], b[None], beta=beta, alpha=alpha)[0]
    if beta == 1 and alpha == 1 and bias.dim() == 1:
        return matmul(a, b, bias=bias)  # nn.Linear: the bias is added in the epilogue
    out = matmul(a, b)
    out = out if alpha == 1 else out * alpha
    return out if beta == 0 else out + (bias if beta == 1 else bias * beta)


def _last_dim(x, dim) -> bool:
    return x.dim() > 0 and dim % x.dim() == x.dim() - 1


def _softmax(x, dim, half_to_float):
    dtype = torch.float32 if half_to_float else None
    if _ours(x) and _last_dim(x, dim):
        return softmax(x, dtype=dtype)
    x = x.to(dtype) if dtype else x
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def _log_softmax(x, dim, half_to_float):
    dtype = torch.float32 if half_to_float else None
    if _ours(x) and _last_dim(x, dim):
        return softmax(x, log=True, dtype=dtype)
    x = x.to(dtype) if dtype else x
    return x - torch.logsumexp(x, dim, keepdim=True)


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    dims = list(range(x.dim())) if not dim else [d % x.dim() for d in dim]
    if _ours(x) and dims == [x.dim() - 1] and (dtype is None or dtype in FLOAT_DTYPES):
        return mean(x, keepdim=keepdim, dtype=dtype)
    count = math.prod(x.shape[d] for d in dims)
    return torch.sum(x, dims, keepdim=keepdim, dtype=dtype) / count


ROUTED_OPS = {
    "mm": _mm,
    "addmm": _addmm,
    "_softmax": _softmax,
    "_log_softmax": _log_softmax,
    "mean.dim": _mean_dim,
}


@contextlib.contextmanager
def batch_invariant_mode():
    """Within the block, aten::mm, aten::addmm, aten::_softmax, aten::_log_softmax and
    aten::mean.dim run on the batch-invariant kernels (CPU and CUDA dispatch keys). Nested
    uses are fine; the ordinary kernels come back when the outermost block exits."""
    global _active
    if _active:
        _active += 1
        try:
            yield
        finally:
            _active -= 1
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns once that it overrides a registered kernel
        warnings.simplefilter("ignore")
        for op, fn in ROUTED_OPS.items():
            for key in ("CPU", "CUDA"):
                library.impl(op, fn, key)
    _active = 1
    try:
        yield
    finally:
        _active = 0
        library._destroy()  # unregisters ours: torch's own kernels are back
