"""Input checks every public kernel runs before launching anything.

Bad input raises TypeError (unsupported dtype, naming the supported ones) or ValueError
(shapes, devices), never a traceback from deep inside Triton.
"""

import torch

from kernels.runtime import DEVICE

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, dtypes=FLOAT_DTYPES, ndim: int | None = None, min_ndim: int = 0):
    """A tensor on the kernels' device, with a supported dtype and rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {_names(dtypes)}")
    if t.device.type != DEVICE.type:
        raise ValueError(
            f"{name} is on {t.device} but the kernels run on {DEVICE}: "
            f"move it with {name}.to('{DEVICE.type}')"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")


def check_same(names: str, *tensors, shape: bool = True):
    """Tensors that must agree in dtype and device (and shape, unless shape=False)."""
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{names} must share a dtype, got {[str(x.dtype) for x in tensors]}")
        if t.device != first.device:
            raise ValueError(
                f"{names} must be on one device, got {[str(x.device) for x in tensors]}"
            )
        if shape and t.shape != first.shape:
            raise ValueError(
                f"{names} must have the same shape, got {[tuple(x.shape) for x in tensors]}"
            )


def check_row_vector(name: str, p, x):
    """A 1-D tensor with x's dtype and device and one value per column of x (the last dim):
    a bias, a norm's weight."""
    check_tensor(name, p, ndim=1)
    check_same(f"x and {name}", x, p, shape=False)
    if p.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} must have x's last dim: x {tuple(x.shape)}, {name} {tuple(p.shape)}"
        )
