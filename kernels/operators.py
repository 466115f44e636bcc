"""The course's ops as PyTorch operators: `torch.ops.brrr.<name>`.

Each op is registered with `torch.library.custom_op`: a schema (from the implementation's type
annotations), a fake implementation (output shapes and dtypes without running the kernel, which
is what `torch.compile` traces with) and, for the differentiable ops, autograd. The compiled
graph keeps each op as one opaque node, so Dynamo never traces into a Triton launch. Each
operator also has a kernel operator, torch.ops.brrr._<name>, with no autograd: what compiled
graphs call where they can (2 below).

What a public function (`kernels.norm.rms_norm`, ...) does, in order:
1. It validates its inputs in Python. In eager and under `torch.compile` alike a bad input gets
   the same TypeError or ValueError; with `fullgraph=True` Dynamo reports it inside its own
   error, the message included.
2. Under `torch.compile` it calls the operator; so does an eager call that autograd must
   record, except for the ops of 3. For the ops of 3 but attention, torch.compile calls their
   `traced` Function instead, which Dynamo traces: the compiled graph calls the op's kernel
   operator torch.ops.brrr._<name> forward (the same implementation and fake, registered with
   torch.library.Library: torch's dispatcher calls the implementation with nothing between)
   and the backward's ops backward. The ops with no backward (linear, linear_int8,
   matmul_split_k, invariant_rms_norm, invariant_attention) call their kernel operator under
   torch.compile when nothing needs a gradient (`forward_road`), else their operator, which
   raises torch's error when a gradient reaches it. The operator itself would run custom_op's
   Python autograd kernel and wrappers on every call of the graph, gradient or not: on a CPU
   (torch 2.13) six calls of a trivial op in a compiled function cost 136 us through custom_op
   operators, 64 us through kernel operators in a traced Function.
3. rms_norm, layer_norm, add_rms_norm, add, bias_gelu, softmax, softmax_streamed, matmul and
   attention, in an eager call that autograd must record, call `eager_autograd`'s
   torch.autograd.Function instead: the operator's own implementation, setup_context and
   backward, with no dispatch in the forward or the backward. torch.library's wrappers around
   each call (its autograd Function, the redispatch, Dynamo's disable around the
   implementation) cost about as much host time as the course's own Python in a step.
4. Otherwise (eager, nothing to differentiate) it launches the kernel directly: the operator's
   dispatch costs microseconds of host time that a small input cannot hide (Chapter 1's overhead
   regime; `python -m kernels bench overhead` measures each rung). After a shape's first call
   the launch skips Triton's own Python too: kernels.launch's Launcher, under a key the call
   site makes from what it already has (dtype, alignment, sizes' classes, constexprs).

Autograd. The simple ops register a backward on their one operator: add (two identity
gradients), bias_gelu and softmax (a few torch ops on the saved input or output, which
torch.compile traces with the rest of the backward), matmul (three more matmuls through
torch.ops.brrr.matmul itself, so the backward runs on the course's kernel too). The ops whose
backward needs statistics of the forward (RMSNorm's rstd, LayerNorm's mean and rstd,
attention's log-sum-exp) are three operators each:

- `<name>_forward` returns the output AND the statistics (one fp32 per row): they are outputs
  of the operator, so autograd saves them and torch.compile sees them in its graph; its
  registered backward calls
- `<name>_backward`, the Triton backward as an operator of its own, so that a compiled
  backward graph holds it as one node too (no graph break, nothing traced into Triton);
- `<name>` returns the first output alone (`one_output`): a CompositeImplicitAutograd op over
  `<name>_forward`, which autograd and torch.compile see through. It is what a user calls as
  torch.ops.brrr.rms_norm(x, w, eps); the public function calls `<name>_forward` directly
  (one dispatch fewer).

The eager road (3) and the traced one (2) reuse the functions registered on the operator (on
the simple ops' one operator, on the norms' `<name>_forward`): `register_autograd` registers
them and builds both Functions in one call, so there is one autograd formula per op.
`backward_operator` registers `<name>_backward` and returns what the backward calls: the
operator, except inside an `eager_autograd` Function's backward, where the implementation
itself runs. A backward of torch ops alone (add, bias_gelu, softmax) is recorded by autograd
on either road, so a second derivative is the same on both; the norms' is once differentiable.

Why save rather than recompute: the statistics cost 4 bytes a row. A norm's backward kernel
could recompute rstd from the row it loads anyway, but attention's log-sum-exp would cost a
whole forward pass again; one design serves all three, and the backward uses the forward's
exact statistics. The fused add_rms_norm is built the same way (add_rms_norm_forward; its
backward is rms_norm_backward at h plus the residual's identity gradient); the invariant
matmul reuses matmul's backward through its own operator. Ops with no backward (the
batch-invariant rms_norm and attention) raise torch's "no autograd formula was registered"
error when a gradient reaches them, rather than returning an output cut out of the graph.
"""

import threading

import torch
from torch.autograd.function import once_differentiable

from kernels.validate import needs_grad

NAMESPACE = "brrr"
REGISTERED: list[str] = []  # every operator's name, in registration order
# .active: True while an eager_autograd Function's backward runs in this thread
_eager_backward = threading.local()


def operator(name: str, impl, fake):
    """Register `impl` (a launcher) as torch.ops.brrr.<name>, with `fake` as its fake kernel;
    return the operator (call it like the function; add autograd with `register_autograd`),
    with its kernel operator (`kernel_operator`) as its `kernel` attribute.

    `impl` takes validated tensors and returns fresh ones (never an input or a view of one);
    its type annotations become the schema. The public function keeps calling `impl` itself
    on the direct path."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=())
    op.register_fake(fake)
    REGISTERED.append(name)
    op.kernel = kernel_operator(name, impl, fake)  # what compiled graphs call (road 2)
    return op


_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def kernel_operator(name: str, impl, fake):
    """Register `impl` as torch.ops.brrr._<name>: the same schema, implementation and fake as
    <name>, with nothing between torch's dispatcher and `impl` (custom_op's wrappers: its
    autograd kernel, a redispatch, an aliasing check, Dynamo's disable) and no autograd. What
    compiled graphs call: inside a `traced` Function, or through `forward_road` (the module's
    road 2)."""
    schema = torch.library.infer_schema(impl, mutates_args=())
    _library.define(f"_{name}{schema}")
    for key in ("CPU", "CUDA"):
        _library.impl(f"_{name}", impl, key)
    torch.library.register_fake(f"{NAMESPACE}::_{name}", fake, lib=_library)
    REGISTERED.append(f"_{name}")
    return getattr(getattr(torch.ops, NAMESPACE), f"_{name}").default


def dense_like(t: torch.Tensor, *_) -> torch.Tensor:
    """A fresh contiguous tensor of t's shape, dtype and device: the output of an op shaped
    like its input, and what its fake kernel returns (other arguments ignored). A contiguous t
    skips the keyword, whose parsing costs the host more than the check."""
    if t.is_contiguous():  # then empty_like's default (t's own strides) is contiguous too
        return torch.empty_like(t)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def one_output(name: str, forward_op, n_outputs: int = 1):
    """Register torch.ops.brrr.<name>: `forward_op`'s first `n_outputs` outputs, with its
    arguments (the rest of its outputs are statistics for its backward). Composite: autograd,
    fake tensors and torch.compile see `forward_op` inside it, so it needs nothing else."""
    schema = forward_op._opoverload._schema
    arguments = str(schema).removeprefix(schema.name).split(" -> ")[0]
    returns = "Tensor" if n_outputs == 1 else "(" + ", ".join(["Tensor"] * n_outputs) + ")"
    qualname = f"{NAMESPACE}::{name}"
    torch.library.define(qualname, f"{arguments} -> {returns}")

    def first_outputs(*args):
        out = forward_op(*args)
        return out[0] if n_outputs == 1 else tuple(out[:n_outputs])

    torch.library.impl(qualname, "CompositeImplicitAutograd")(first_outputs)
    REGISTERED.append(name)
    return getattr(getattr(torch.ops, NAMESPACE), name)


def forward_road(op, *tensors):
    """What the public function of `op`, an operator with no backward, calls instead of launching
    directly, or None: under torch.compile its kernel operator when nothing needs a gradient;
    whenever a gradient is wanted, the operator, which raises torch's "no autograd formula"
    error when one reaches it (a kernel operator has no autograd kernel at all, and torch would
    only warn). Dynamo reads requires_grad at trace time and guards on it."""
    if needs_grad(*tensors):
        return op
    return op.kernel if torch.compiler.is_compiling() else None


def through_operator(*tensors) -> bool:
    """Whether a public function must call its operator rather than launch directly: while
    torch.compile traces it, or when autograd records the call."""
    return torch.compiler.is_compiling() or needs_grad(*tensors)


def backward_operator(name: str, impl, fake):
    """Register `impl`, a backward's launcher, as torch.ops.brrr.<name> (`operator`); return
    the function a registered backward calls: the operator (what torch.compile and opcheck
    trace), or `impl` itself inside an eager_autograd Function's backward (no dispatch)."""
    op = operator(name, impl, fake)

    def call(*args):
        return impl(*args) if getattr(_eager_backward, "active", False) else op(*args)

    return call


def register_autograd(op, impl, backward, setup_context=None, differentiable_backward=False):
    """Register `backward` (and `setup_context`) on the operator `op`, whose implementation is
    `impl`, and return the same formula twice as torch.autograd.Function applies: (eager, for
    road 3: `impl` itself, no dispatch; traced, for road 2: op's kernel operator, which
    torch.compile puts in its graph). One call, so that no road gets another formula."""
    op.register_autograd(backward, setup_context=setup_context)
    eager = eager_autograd(impl, setup_context, backward, differentiable_backward)
    return eager, traced_autograd(op.kernel, setup_context, backward)


def traced_autograd(kernel_op, setup_context, backward):
    """`kernel_op` (a kernel_operator) with `backward` as a torch.autograd.Function's apply, for
    torch.compile's road: Dynamo traces the Function, so its graph calls kernel_op forward and
    the backward's ops backward, where the operator would call custom_op's autograd kernel on
    every call, gradient or not (about 10 us of host time each, measured on a CPU)."""

    # forward(ctx, *args) would do in eager, but Dynamo (torch 2.13) passes a Function's
    # variadic arguments on as one: the forward is written out with the schema's names
    names = ", ".join(argument.name for argument in kernel_op._schema.arguments)
    source = (
        f"def forward(ctx, {names}):\n"
        f"    output = kernel_op({names})\n"
        f"    if setup_context is not None:\n"
        f"        setup_context(ctx, ({names},), output)\n"
        f"    return output\n"
    )
    scope = {"kernel_op": kernel_op, "setup_context": setup_context}
    exec(source, scope)
    forward = scope["forward"]
    name = str(kernel_op.name()).split("::")[-1].strip("_") + "_traced"
    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods).apply


def eager_autograd(impl, setup_context, backward, differentiable_backward=False):
    """`impl` (an operator's implementation) as a torch.autograd.Function's apply, for eager
    calls that autograd records; torch.compile calls the operator instead. `setup_context`
    (None: nothing saved) and `backward` are those registered on the operator, called as
    torch.library calls them; the backward operators they reach run their implementations.
    Once differentiable, as the backward operators have no backward either; unless
    `differentiable_backward`: a backward of torch ops alone, which autograd records under
    create_graph as it does through the operator (a second derivative)."""

    def forward(ctx, *args):
        output = impl(*args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        return output

    @once_differentiable
    def eager_backward(ctx, *grads):
        _eager_backward.active = True
        try:
            return backward(ctx, *grads)
        finally:
            _eager_backward.active = False

    if differentiable_backward:  # it reaches no backward operator: nothing to switch
        eager_backward = backward
    name = impl.__name__.strip("_")  # the grad_fn of _rms_norm_forward: rms_norm_forwardBackward
    methods = {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)}
    return type(name, (torch.autograd.Function,), methods).apply
