"""Input checks every public kernel runs before launching anything, and the dtype policy ops share.

Bad input raises TypeError (unsupported dtype, naming the supported ones) or ValueError
(shapes, devices), never a traceback from deep inside Triton.
"""

import torch

from kernels.runtime import DEVICE, ON_GPU

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "gelu", "relu")  # the epilogues a matmul can fuse


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, dtypes=FLOAT_DTYPES, ndim: int | None = None, min_ndim: int = 0):
    """A tensor on the kernels' device, with a supported dtype and rank. Every call of every op
    runs this, so the common case is a few attribute reads (`is_cuda` or `is_cpu`, not
    `t.device`, which builds an object): a fraction of a microsecond of host time per tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {_names(dtypes)}")
    if not (t.is_cuda if ON_GPU else t.is_cpu):
        raise ValueError(
            f"{name} is on {t.device} but the kernels run on {DEVICE}: "
            f"move it with {name}.to('{DEVICE.type}')"
        )
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if min_ndim and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")


def check_same(names: str, *tensors, shape: bool = True):
    """Tensors that must agree in dtype and device (and shape, unless shape=False)."""
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype is not first.dtype:
            raise TypeError(f"{names} must share a dtype, got {[str(x.dtype) for x in tensors]}")
        if t.get_device() != first.get_device():  # -1 on a CPU, else the GPU's index
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


def needs_grad(*tensors) -> bool:
    """Whether autograd must record this call. Without a gradient to compute, the ops skip
    autograd's bookkeeping: on a small input the host's time per call, not the GPU's, sets the
    pace (Chapter 1's overhead regime)."""
    if torch.is_grad_enabled():  # a loop, not any() over a generator: 0.3 us less a call
        for t in tensors:
            if t is not None and t.requires_grad:
                return True
    return False


def input_precision(dtype: torch.dtype) -> str:
    """fp32 follows torch: "highest" (the default) means IEEE fp32, otherwise TF32 is allowed.
    fp16 and bf16 go to the tensor cores as they are."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def check_matmul_inputs(a, b, bias=None, activation=None):
    """Validation shared by every matmul in the course: 2-D a (M, K) and b (K, N) of one
    dtype and device, bias (N,) or None, a known activation."""
    check_tensor("a", a, ndim=2)
    check_tensor("b", b, ndim=2)
    check_same("a and b", a, b, shape=False)
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a @ b needs a's columns to match b's rows: a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1)
        check_same("a and bias", a, bias, shape=False)
        if bias.shape[0] != b.shape[1]:
            raise ValueError(f"bias must have shape ({b.shape[1]},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
