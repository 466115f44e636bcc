import types

import pytest
import torch
import torch._dynamo.testing
from params import DTYPES, attached_metadata
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import check
from kernels import norm as norm_module
from kernels import norm_backward as norm_backward_module
from kernels.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    layer_norm,
    layer_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from kernels.runtime import DEVICE

SHAPES = [(1, 1), (4, 1), (3, 127), (5, 129), (129, 33), (2, 5, 1000), (3, 4097), (2, 3, 128)]
OPS = {
    "rms_norm": (rms_norm, rms_norm_ref, 1),  # (kernel, reference, number of parameters)
    "layer_norm": (layer_norm, layer_norm_ref, 2),
}


def _inputs(shape, dtype, n_params, seed=0):
    x = check.random_tensor(shape, dtype, seed=seed, scale=2.0)
    params = [check.random_tensor(shape[-1:], dtype, seed=seed + 1 + i) for i in range(n_params)]
    dy = check.random_tensor(shape, dtype, seed=seed + 9)
    return x, params, dy


def _forward_backward(fn, x, params, dy):
    """fn's output and the gradients of <output, dy> for x and every parameter."""
    x = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in params]
    y = fn(x, *params)
    y.backward(dy)
    return y.detach(), [x.grad] + [p.grad for p in params]


def _check_against_fp64(op, x, params, dy):
    """The forward through check.against_fp64, with autograd's backward run inside it (under
    the same poisoned allocations, dy an argument that must stay unchanged); then the gradients
    against fp64 autograd."""
    kernel, reference, _ = OPS[op]
    grads, grads_ref = [], []

    def forward_backward(fn, gradients):
        def run(x, *params, dy):
            y, gradients[:] = _forward_backward(fn, x, params, dy)
            return y

        return run

    r = check.against_fp64(
        forward_backward(kernel, grads),
        x,
        *params,
        dy=dy,
        ref=forward_backward(reference, grads_ref),
        op="reduction",
    )
    assert r.ok, f"{op} forward: {r.message}"
    for name, g in zip(["dx", "dw", "db"], grads, strict=False):
        assert g.dtype == x.dtype, f"{name} has dtype {g.dtype}"
    # dx = rstd * (terms of size |dy * w|): its rounding error grows with rstd, which reaches
    # 1/sqrt(eps) ~ 316 when a row has no spread (one column). Compare dx / rstd, per row.
    x64 = x.double()
    spread = x64.var(-1, unbiased=False) if op == "layer_norm" else x64.square().mean(-1)
    rstd = torch.rsqrt(spread + (1e-5 if op == "layer_norm" else 1e-6)).unsqueeze(-1)
    grads[0], grads_ref[0] = grads[0].double() / rstd, grads_ref[0] / rstd
    for name, g, g_ref in zip(["dx", "dw", "db"][: len(grads)], grads, grads_ref, strict=True):
        result = check.compare(g, g_ref, op="reduction", dtype=x.dtype)
        assert result.ok, f"{op} {name}: {result.message}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_forward_and_backward_match_fp64_autograd(op, shape, dtype):
    x, params, dy = _inputs(shape, dtype, OPS[op][2])
    _check_against_fp64(op, x, params, dy)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n_rows", [1, 7, 8, 9, 1000], ids=lambda n: f"rows{n}")
def test_weight_gradients_sum_over_every_row(op, n_rows):
    # rows split unevenly among the programs that write partial sums
    x, params, dy = _inputs((n_rows, 65), torch.float32, OPS[op][2], seed=3)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.parametrize("op", OPS)
def test_backward_is_deterministic(op):
    x, params, dy = _inputs((300, 257), torch.float32, OPS[op][2], seed=4)
    _, first = _forward_backward(OPS[op][0], x, params, dy)
    _, second = _forward_backward(OPS[op][0], x, params, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_inputs_and_gradients(op):
    kernel, reference, n_params = OPS[op]
    base, params, _ = _inputs((40, 130), torch.float32, n_params, seed=5)
    for x in (base.t(), base[:, 1:128], base[::3, ::2], base.view(4, 10, 130).permute(1, 0, 2)):
        assert not x.is_contiguous()
        p = [check.random_tensor(x.shape[-1:], seed=6 + i) for i in range(n_params)]
        dy = check.random_tensor(x.shape, seed=8).transpose(0, -1).contiguous().transpose(0, -1)
        _check_against_fp64(op, x, p, dy)
    # y.sum().backward() hands the backward an expanded gradient: all strides 0
    x = base.clone().requires_grad_()
    kernel(x, *params).sum().backward()
    x64 = base.double().requires_grad_()
    reference(x64, *[q.double() for q in params]).sum().backward()
    check.assert_close(x.grad, x64.grad, op="reduction")


@pytest.mark.parametrize("op", OPS)
def test_strided_weight_and_bias_forward_and_backward(op):
    """A weight or bias that is a strided view (every other element of a longer vector) is
    read at its own strides, forward and backward, with and without autograd."""
    kernel, reference, n_params = OPS[op]
    x, _, dy = _inputs((5, 129), torch.float32, 0, seed=12)
    bases = [check.random_tensor((2 * 129,), seed=13 + i) for i in range(n_params)]
    with torch.no_grad():
        y = kernel(x, *[b[::2] for b in bases])
    check.assert_close(y, reference(x.double(), *[b[::2].double() for b in bases]), op="reduction")
    xg, leaves = x.clone().requires_grad_(), [b.clone().requires_grad_() for b in bases]
    kernel(xg, *[leaf[::2] for leaf in leaves]).backward(dy)
    x64, leaves64 = x.double().requires_grad_(), [b.double().requires_grad_() for b in bases]
    reference(x64, *[leaf[::2] for leaf in leaves64]).backward(dy.double())
    for g, g64 in zip(
        [xg.grad] + [leaf.grad for leaf in leaves],
        [x64.grad] + [leaf.grad for leaf in leaves64],
        strict=True,
    ):
        check.assert_close(g, g64, op="reduction")


def test_add_rms_norm_strided_weight():
    x, residual, _ = _add_inputs((5, 129), torch.float32, seed=42)
    w = check.random_tensor((2 * 129,), seed=43)[::2]
    y, h = add_rms_norm(x, residual, w)
    check.assert_close(y, rms_norm_ref(h.double(), w.double()), op="reduction")


@pytest.mark.parametrize("op", OPS)
def test_gradient_for_x_only_and_no_grad(op):
    kernel, reference, n_params = OPS[op]
    x, params, dy = _inputs((6, 50), torch.float32, n_params, seed=10)
    xg = x.clone().requires_grad_()
    kernel(xg, *params).backward(dy)
    x64 = x.double().requires_grad_()
    reference(x64, *[p.double() for p in params]).backward(dy.double())
    check.assert_close(xg.grad, x64.grad, op="reduction")
    with torch.no_grad():
        y = kernel(x, *params)
    assert not y.requires_grad
    check.assert_close(y, reference(x.double(), *[p.double() for p in params]), op="reduction")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (2, 0, 3)], ids=str)
def test_empty_tensors_launch_nothing(op, shape, monkeypatch):
    for name in ("rms_norm_fwd_kernel", "layer_norm_fwd_kernel"):
        monkeypatch.setattr(norm_module, name, None)  # any launch would fail
    monkeypatch.setattr(norm_backward_module, "norm_bwd_kernel", None)
    kernel, _, n_params = OPS[op]
    x = torch.empty(shape, device=DEVICE).requires_grad_()
    params = [torch.randn(shape[-1], device=DEVICE).requires_grad_() for _ in range(n_params)]
    y = kernel(x, *params)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    for p in params:  # a sum over no rows is zero
        assert torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("op", OPS)
def test_bad_inputs_get_clear_errors(op):
    kernel, _, n_params = OPS[op]
    x = check.random_tensor((4, 8), seed=11)
    params = [check.random_tensor((8,), seed=12 + i) for i in range(n_params)]
    with pytest.raises(TypeError, match="supported: float32, float16, bfloat16"):
        kernel(x.int(), *params)
    with pytest.raises(TypeError, match="share a dtype"):
        kernel(x, *[p.half() for p in params])
    with pytest.raises(ValueError, match=r"must have x's last dim: x \(4, 8\), weight \(7,\)"):
        kernel(x, *[p[:7] for p in params])
    with pytest.raises(ValueError, match=r"weight must have 1 dims, got shape \(1, 8\)"):
        kernel(x, *[p[None] for p in params])
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        kernel(x, *[None for _ in params])
    with pytest.raises(ValueError, match="eps must be finite and >= 0"):
        kernel(x, *params, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        kernel(x, *params, eps="small")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_long_rows_on_gpu(op):
    # 20000 columns: a 32768-wide block, past what the registers hold (the backward spills)
    x, params, dy = _inputs((3, 20000), torch.bfloat16, OPS[op][2], seed=13)
    _check_against_fp64(op, x, params, dy)


@pytest.mark.gpu
def test_offsets_past_2_to_the_31():
    rows = 2**31 // 4096 + 2
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, w)
    tail = slice(rows - 3, rows)
    check.assert_close(out[tail], rms_norm_ref(x[tail].double(), w.double()), op="reduction")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_launch_metadata_names_shape_flops_and_bytes(dtype):
    rows, cols, programs = 300, 70, 8
    x = torch.empty(rows, cols, dtype=dtype)
    es = x.element_size()
    forward = {"x_ptr": x, "n_cols": cols}
    partials = torch.empty(programs, cols)
    backward = {"dy_ptr": x, "x_ptr": x, "n_rows": rows, "n_cols": cols, "dw_part_ptr": partials}
    cases = {  # kernel: (grid, arguments, FLOPs per element, bytes)
        "rms_norm_fwd_kernel": ((rows,), forward, 4, es * (2 * rows * cols + cols) + 4 * rows),
        "layer_norm_fwd_kernel": (
            (rows,),
            {**forward, "b_ptr": x},
            7,
            es * (2 * rows * cols + 2 * cols) + 8 * rows,
        ),
        "norm_bwd_kernel": (
            (programs,),
            {**backward, "db_part_ptr": partials},
            9,
            es * (3 * rows * cols + cols) + 4 * (rows + programs * cols),
        ),
    }
    for name, (grid, args, per_element, moved) in cases.items():
        compiled = types.SimpleNamespace(name=name)
        info = attached_metadata(getattr(norm_module, name))(grid, compiled, args)
        assert info["name"] == f"{name} [rows=300, cols=70]"
        assert info["flops"] == per_element * rows * cols
        assert info["bytes"] == moved, name
    layer_norm = attached_metadata(norm_module.norm_bwd_kernel)(
        (programs,), compiled, {**backward, "db_part_ptr": partials.clone()}
    )
    assert layer_norm["flops"] == 13 * rows * cols  # and mean, db partials: twice the fp32
    assert layer_norm["bytes"] == es * (3 * rows * cols + cols) + 8 * (rows + programs * cols)


# --- the fused residual add + RMSNorm ------------------------------------------------------


def _add_inputs(shape, dtype, seed=20):
    x = check.random_tensor(shape, dtype, seed=seed, scale=2.0)
    residual = check.random_tensor(shape, dtype, seed=seed + 1, scale=3.0)
    return x, residual, check.random_tensor(shape[-1:], dtype, seed=seed + 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (5, 129), (2, 5, 1000), (3, 4097)], ids=str)
def test_add_rms_norm_is_torchs_add_then_rms_norm(shape, dtype):
    x, residual, w = _add_inputs(shape, dtype)
    y, h = add_rms_norm(x, residual, w)
    assert torch.equal(h, x + residual)  # rounded to x's dtype exactly as torch rounds it
    y_ref, h_ref = add_rms_norm_ref(x.double(), residual.double(), w.double())
    check.assert_close(y, rms_norm_ref(h.double(), w.double()), op="reduction")
    check.assert_close(y, y_ref, op="reduction")  # the rounding of h is within the tolerance
    assert y.dtype == h.dtype == dtype and y.is_contiguous() and h.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 127), (9, 65), (2, 3, 1000)], ids=str)
def test_add_rms_norm_gradients_match_fp64_autograd(shape, dtype):
    x, residual, w = _add_inputs(shape, dtype, seed=30)
    dy, dh = (check.random_tensor(shape, dtype, seed=s) for s in (33, 34))
    leaves = [t.clone().requires_grad_() for t in (x, residual, w)]
    y, h = add_rms_norm(*leaves)
    grads = torch.autograd.grad((y, h), leaves, (dy, dh))
    # the reference normalizes h as the kernel does, rounded to x's dtype (torch's x + residual)
    h64, w64 = (x + residual).double().requires_grad_(), w.double().requires_grad_()
    y64 = rms_norm_ref(h64, w64)
    dh64, dw64 = torch.autograd.grad((y64, h64), (h64, w64), (dy.double(), dh.double()))
    for name, g, g64 in zip(["dx", "dresidual", "dweight"], grads, (dh64, dh64, dw64), strict=True):
        assert g.dtype == dtype, name
        result = check.compare(g, g64, op="reduction", dtype=dtype)
        assert result.ok, f"{name}: {result.message}"
    assert torch.equal(grads[0], grads[1])  # h = x + residual: one gradient for both


def test_add_rms_norm_non_contiguous_empty_and_bad_inputs():
    x, residual, w = _add_inputs((40, 130), torch.float32, seed=40)
    other = check.random_tensor((130, 80), seed=41)[:, ::2]  # strided rows, unlike x.t()'s
    y, h = add_rms_norm(x.t(), other, w[:40])
    assert torch.equal(h, x.t() + other)
    check.assert_close(y, rms_norm_ref(h.double(), w[:40].double()), op="reduction")
    empty = torch.empty(0, 8, device=DEVICE)
    y, h = add_rms_norm(empty, empty, torch.ones(8, device=DEVICE))
    assert y.shape == h.shape == (0, 8)
    with pytest.raises(ValueError, match=r"x and residual must have the same shape"):
        add_rms_norm(x, residual[:3], w)
    with pytest.raises(TypeError, match="x and residual must share a dtype"):
        add_rms_norm(x, residual.half(), w)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        add_rms_norm(x, 1.0, w)
    with pytest.raises(ValueError, match=r"must have x's last dim"):
        add_rms_norm(x, residual, w[:7])


# --- eager autograd without the operators (kernels.operators, road 3) ---------------------
# (public function, its operator called directly for the same outputs, fp64 reference, the
# number of row-shaped inputs first in its arguments: the rest are vectors)
ROADS = {
    "rms_norm": (
        rms_norm,
        lambda x, w: norm_module.rms_norm_forward(x, w, 1e-6)[0],
        rms_norm_ref,
        1,
    ),
    "layer_norm": (
        layer_norm,
        lambda x, w, b: norm_module.layer_norm_forward(x, w, b, 1e-5)[0],
        layer_norm_ref,
        1,
    ),
    "add_rms_norm": (
        add_rms_norm,
        lambda x, r, w: tuple(norm_module.add_rms_norm_forward(x, r, w, 1e-6)[:2]),
        add_rms_norm_ref,
        2,
    ),
}
BACKWARD_OPERATOR = {"rms_norm": "rms_norm_backward", "layer_norm": "layer_norm_backward",
                     "add_rms_norm": "rms_norm_backward"}  # fmt: skip


def _road_inputs(op, shape, step=1, seed=70):
    """(rows, vectors, step): the row-shaped inputs (x, and the residual), the vectors (weight,
    and bias) `step` times the row's length, of which the op gets every step-th element."""
    n_rows, n_vectors, n = ROADS[op][3], 1 + (op == "layer_norm"), shape[-1]
    rows = [check.random_tensor(shape, seed=seed + i, scale=2.0) for i in range(n_rows)]
    vectors = [check.random_tensor((step * n,), seed=seed + 5 + i) for i in range(n_vectors)]
    return rows, vectors, step


def _strided(fn, n_rows, step):
    """fn with every step-th element of each vector (the arguments after the first n_rows)."""
    return lambda *t: fn(*t[:n_rows], *(v[::step] for v in t[n_rows:]))


# What the eager road's tests check of any op (here and in test_elementwise, test_softmax):
# `public` the public function, `operator` its operator called directly, `inputs` tensors.


def _outputs_and_grads(fn, inputs, seed=80):
    """fn's outputs (a tuple), on leaves with the values of `inputs`, and the gradients of
    <outputs, random dys> for every input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    dys = [check.random_tensor(o.shape, o.dtype, seed=seed + i) for i, o in enumerate(outs)]
    return outs, torch.autograd.grad(outs, leaves, dys)


def _check_the_operators_bits(public, operator, inputs, names):
    """The public function's outputs and gradients (eager: an autograd Function of its own) have
    the bits of its operator's, called directly; returns them (`names`: theirs, in order)."""
    outs, grads = _outputs_and_grads(public, inputs)
    op_outs, op_grads = _outputs_and_grads(operator, inputs)
    # two roads, not one taken twice: only the operator's autograd node is torch.library's
    assert "brrr" not in type(outs[0].grad_fn).__name__
    assert "brrr" in type(op_outs[0].grad_fn).__name__
    for name, got, expected in zip(names, outs + grads, op_outs + op_grads, strict=True):
        assert torch.equal(got, expected), f"{name} differs from the operator's"
    return outs, grads


class _OperatorsSeen(TorchDispatchMode):
    """The course's operators (brrr::) dispatched while the mode is on, forward and backward."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "brrr":
            self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _check_no_operator_dispatched(public, operator, inputs, dispatched):
    """Eager, forward and backward, the public function dispatches none of the course's
    operators; its operator, called directly, dispatches `dispatched` (what the mode sees)."""
    with _OperatorsSeen() as eager:
        _outputs_and_grads(public, inputs)
    with _OperatorsSeen() as through_operator:
        _outputs_and_grads(operator, inputs)
    assert eager.names == set()
    assert through_operator.names == dispatched


def _operators_called(graphs):
    return {str(n.target) for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("brrr.")}  # fmt: skip


def _check_compiled_keeps_to_the_operators(public, inputs, forward, backward):
    """torch.compile(public, fullgraph=True) records a forward graph that calls the course's
    operators `forward` and a backward graph that calls `backward` (exactly those), and gets
    eager's bits, outputs and gradients."""
    torch._dynamo.reset()
    recorded = torch._dynamo.testing.AotEagerAndRecordGraphs()
    compiled = torch.compile(public, backend=recorded, fullgraph=True)
    outs, grads = _outputs_and_grads(compiled, inputs)
    assert len(recorded.fw_graphs) == len(recorded.bw_graphs) == 1
    assert _operators_called(recorded.fw_graphs) == forward
    assert _operators_called(recorded.bw_graphs) == backward
    eager_outs, eager_grads = _outputs_and_grads(public, inputs)
    for got, expected in zip(outs + grads, eager_outs + eager_grads, strict=True):
        assert torch.equal(got, expected)


def _second_derivatives(fn, inputs, seed=90):
    """The gradients of |first gradients|^2 (taken with create_graph) for every input and
    every dy; None where there is none. backward(), not autograd.grad(): a once-differentiable
    backward's error sits on a branch that leads to none of them, and backward() walks it."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    dys = [check.random_tensor(o.shape, o.dtype, seed=seed + i).requires_grad_()
           for i, o in enumerate(outs)]  # fmt: skip
    grads = torch.autograd.grad(outs, leaves, dys, create_graph=True)
    sum((g * g).sum() for g in grads).backward()
    return [t.grad for t in leaves + dys]


def _check_eager_autograd_against_the_operator(op, shape, step=1):
    """The public function's outputs and gradients (eager: the autograd Function) have the bits
    of its operator's, called directly, and match the fp64 reference's."""
    public, operator, reference, n_rows = ROADS[op]
    rows, vectors, step = _road_inputs(op, shape, step)
    grad_names = ["dx", "dresidual"][:n_rows] + ["dw", "db"][: len(vectors)]
    names = [f"{op} {name}" for name in ["y", "h"][:n_rows] + grad_names]
    _, grads = _check_the_operators_bits(
        _strided(public, n_rows, step), _strided(operator, n_rows, step), rows + vectors, names
    )
    wide = [t.double() for t in rows + vectors]
    _, ref_grads = _outputs_and_grads(_strided(reference, n_rows, step), wide)
    for name, got, expected in zip(grad_names, grads, ref_grads, strict=True):
        result = check.compare(got, expected, op="reduction", dtype=torch.float32)
        assert result.ok, f"{op} {name}: {result.message}"


@pytest.mark.parametrize("weight", ["dense", "strided"])
@pytest.mark.parametrize("shape", [(37, 300), (2, 5, 129)], ids=str)
@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_has_the_operators_bits(op, shape, weight):
    _check_eager_autograd_against_the_operator(op, shape, step=2 if weight == "strided" else 1)


@pytest.mark.parametrize("op", ROADS)
def test_eager_autograd_dispatches_no_operator(op):
    public, operator, _, _ = ROADS[op]
    rows, vectors, _ = _road_inputs(op, (5, 33))
    dispatched = {f"brrr.{op}_forward.default", f"brrr.{BACKWARD_OPERATOR[op]}.default"}
    _check_no_operator_dispatched(public, operator, rows + vectors, dispatched)


@pytest.mark.parametrize("op", ROADS)
def test_compiled_forward_and_backward_keep_to_the_operators(op):
    rows, vectors, _ = _road_inputs(op, (5, 33))
    # forward: the kernel operator (no autograd kernel); backward: the backward's operator
    forward, backward = f"brrr._{op}_forward.default", f"brrr.{BACKWARD_OPERATOR[op]}.default"
    _check_compiled_keeps_to_the_operators(ROADS[op][0], rows + vectors, {forward}, {backward})


def test_eager_autograd_is_once_differentiable():
    # the operators have no second derivative: neither has the Function (an error, not dh alone)
    inputs = _add_inputs((3, 16), torch.float32, seed=90)
    for fn in ROADS["add_rms_norm"][:2]:
        with pytest.raises(RuntimeError, match="differentiate twice|no autograd formula"):
            _second_derivatives(fn, inputs)
