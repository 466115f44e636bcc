"""The course's ops as PyTorch operators: `torch.ops.brrr.<name>`.

Each op is registered with `torch.library.custom_op`: a schema (from the implementation's type
annotations), a fake implementation (output shapes and dtypes without running the kernel, which
is what `torch.compile` traces with) and, for the differentiable ops, autograd. The compiled
graph keeps each op as one opaque node, so Dynamo never traces into a Triton launch.

What a public function (`kernels.norm.rms_norm`, ...) does, in order:
1. It validates its inputs in Python. In eager and under `torch.compile` alike a bad input gets
   the same TypeError or ValueError; with `fullgraph=True` Dynamo reports it inside its own
   error, the message included.
2. Under `torch.compile`, or when autograd must record the call, it calls the operator.
3. Otherwise (eager, nothing to differentiate) it launches the kernel directly: the operator's
   dispatch costs microseconds of host time that a small input cannot hide (Chapter 1's overhead
   regime; `python -m kernels bench overhead` measures each rung).
"""

import torch

from kernels.validate import needs_grad

NAMESPACE = "brrr"
REGISTERED: list[str] = []  # every operator's name, in registration order


def operator(name: str, impl, fake):
    """Register `impl` (a launcher) as torch.ops.brrr.<name>, with `fake` as its fake kernel;
    return the operator (call it like the function; add autograd with `.register_autograd`).

    `impl` takes validated tensors and returns fresh ones (never an input or a view of one);
    its type annotations become the schema. The public function keeps calling `impl` itself
    on the direct path."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake)
    REGISTERED.append(name)
    return op


def through_operator(*tensors) -> bool:
    """Whether a public function must call its operator rather than launch directly: while
    torch.compile traces it, or when autograd records the call."""
    return torch.compiler.is_compiling() or needs_grad(*tensors)
