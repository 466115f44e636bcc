"""The course's ops as PyTorch operators (kernels.operators): opcheck on every registered
operator, each public function eager against torch.compile(fullgraph=True), a transformer
block built from the course's ops alone compiled without a graph break, and bad inputs that
get the same errors under torch.compile as in eager."""

import math

import pytest
import torch
import torch._dynamo.testing
from params import DTYPES

import kernels.attention
import kernels.batch_invariant as invariant
import kernels.elementwise
import kernels.gemv
import kernels.int8
import kernels.matmul
import kernels.norm
import kernels.softmax
import kernels.split_k
from kernels import check
from kernels.operators import REGISTERED
from kernels.runtime import DEVICE


def _t(shape, dtype, seed, grad=False, scale=1.0):
    return check.random_tensor(shape, dtype, seed=seed, scale=scale).requires_grad_(grad)


# --- opcheck: one case list per registered operator ---------------------------------------
# Each builder takes a dtype and returns the operator's arguments. Float inputs of a
# differentiable operator require grad, so that opcheck also checks its autograd.


def _norm_inputs(dtype, grad, bias=False):
    x = _t((3, 129), dtype, 1, grad, scale=2.0)
    params = [_t((129,), dtype, 2 + i, grad) for i in range(1 + bias)]
    return x, params


def _rms_backward(dtype):
    x, (w,) = _norm_inputs(dtype, False)
    _, rstd = kernels.norm.rms_norm_forward(x, w, 1e-6)
    return (_t(x.shape, dtype, 9), x, w, rstd)


def _layer_backward(dtype):
    x, (w, b) = _norm_inputs(dtype, False, bias=True)
    _, mean, rstd = kernels.norm.layer_norm_forward(x, w, b, 1e-5)
    return (_t(x.shape, dtype, 9), x, w, mean, rstd)


def _qkv(dtype, grad, sq=5, sk=7, d=16):
    return tuple(_t((1, 2, s, d), dtype, 20 + i, grad) for i, s in enumerate((sq, sk, sk)))


def _attention_backward(dtype):
    q, k, v = _qkv(dtype, False)
    o, lse = kernels.attention.attention_forward(q, k, v, True, 0.25)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return (_t(o.shape, dtype, 29), q, k, v, o, lse, True, 0.25, precision)


def _int8_inputs(dtype):
    qweight, scale = kernels.int8.quantize(_t((9, 33), torch.float32, 2))
    return (_t((3, 33), dtype, 1), qweight, scale, _t((9,), dtype, 3))


def _kv_lens(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


OPCHECK_CASES = {
    "add": lambda d: [(_t((3, 129), d, 1, True), _t((3, 129), d, 2, True))],
    "bias_gelu": lambda d: [(_t((3, 129), d, 1, True), _t((129,), d, 2, True))],
    "softmax": lambda d: [(_t((3, 129), d, 1, True, scale=3.0),)],
    "softmax_streamed": lambda d: [(_t((3, 129), d, 1, True), 32)],
    "rms_norm_forward": lambda d: [(*_flat(_norm_inputs(d, True)), 1e-6)],
    "rms_norm": lambda d: [(*_flat(_norm_inputs(d, True)), 1e-6)],
    "rms_norm_backward": lambda d: [_rms_backward(d)],
    "layer_norm_forward": lambda d: [(*_flat(_norm_inputs(d, True, bias=True)), 1e-5)],
    "layer_norm": lambda d: [(*_flat(_norm_inputs(d, True, bias=True)), 1e-5)],
    "layer_norm_backward": lambda d: [_layer_backward(d)],
    "add_rms_norm_forward": lambda d: [
        (_t((3, 129), d, 1, True), _t((3, 129), d, 3, True), _t((129,), d, 2, True), 1e-6)
    ],
    "add_rms_norm": lambda d: [
        (_t((3, 129), d, 1, True), _t((3, 129), d, 3, True), _t((129,), d, 2, True), 1e-6)
    ],
    "matmul": lambda d: [
        (_t((5, 7), d, 1, True), _t((7, 3), d, 2, True), _t((3,), d, 3, True), "gelu", None),
        (_t((5, 8), d, 1, True), _t((8, 4), d, 2, True), None, None, "pointers"),
    ],
    "attention_forward": lambda d: [(*_qkv(d, True), True, 0.25)],
    "attention": lambda d: [(*_qkv(d, True), False, 0.25)],
    "attention_backward": lambda d: [_attention_backward(d)],
    "linear": lambda d: [
        (_t((3, 33), d, 1), _t((9, 33), d, 2), _t((9,), d, 3)),
        (_t((1, 33), d, 1), _t((9, 33), d, 2), None),
    ],
    "linear_int8": lambda d: [_int8_inputs(d)],
    "matmul_split_k": lambda d: [(_t((5, 70), d, 1), _t((70, 3), d, 2), _t((3,), d, 3), "gelu", 3)],
    "invariant_rms_norm": lambda d: [(*_flat(_norm_inputs(d, False)), 1e-6)],
    "invariant_matmul": lambda d: [
        (_t((5, 7), d, 1, True), _t((7, 3), d, 2, True), _t((3,), d, 3, True), "relu")
    ],
    "invariant_attention": lambda d: [
        (*_qkv(d, False, sq=3, sk=70), True, 0.25, _kv_lens([66])),
        (*_qkv(d, False, sq=1, sk=70), False, 0.25, None),
    ],
}


def _flat(inputs):
    x, params = inputs
    return (x, *params)


def _without_grad(public_cases):
    """A kernel operator's cases (torch.ops.brrr._<name>, no autograd): its public operator's,
    with no input requiring grad."""
    detach = lambda a: a.detach() if isinstance(a, torch.Tensor) else a
    return lambda d: [tuple(map(detach, args)) for args in public_cases(d)]


KERNEL_OPERATORS = [name for name in REGISTERED if name.startswith("_")]
OPCHECK_CASES.update({name: _without_grad(OPCHECK_CASES[name[1:]]) for name in KERNEL_OPERATORS})


def test_every_registered_operator_has_an_opcheck_case():
    missing = sorted(set(REGISTERED) - set(OPCHECK_CASES))
    assert not missing, f"operators without an opcheck case in OPCHECK_CASES: {missing}"
    assert len(REGISTERED) == len(set(REGISTERED)), "an operator was registered twice"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(name, dtype):
    op = getattr(torch.ops.brrr, name).default
    for args in OPCHECK_CASES[name](dtype):
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, results


# --- eager against torch.compile(fullgraph=True), the same cases ----------------------------
# (public function, inputs, op class for the tolerance, differentiable)


def _public_cases(dtype):
    x, (w, b) = _norm_inputs(dtype, True, bias=True)
    a, bm, bias = _t((5, 7), dtype, 1, True), _t((7, 3), dtype, 2, True), _t((3,), dtype, 3, True)
    rows = _t((3, 129), dtype, 4, True)
    return {
        "add": (kernels.elementwise.add, (x, rows), "elementwise", True),
        "bias_gelu": (kernels.elementwise.bias_gelu, (x, w), "elementwise", True),
        "softmax": (kernels.softmax.softmax, (x,), "reduction", True),
        "softmax_streamed": (
            lambda x: kernels.softmax.softmax_streamed(x, block=32),
            (x,),
            "reduction",
            True,
        ),
        "rms_norm": (kernels.norm.rms_norm, (x, w), "reduction", True),
        "layer_norm": (kernels.norm.layer_norm, (x, w, b), "reduction", True),
        "add_rms_norm": (kernels.norm.add_rms_norm, (x, rows, w), "reduction", True),
        "matmul": (
            lambda a, b, bias: kernels.matmul.matmul(a, b, bias, activation="gelu"),
            (a, bm, bias),
            "matmul",
            True,
        ),
        "matmul_pointers": (kernels.matmul.matmul_pointers, (a, bm), "matmul", True),
        "attention": (
            lambda q, k, v: kernels.attention.attention(q, k, v, causal=True),
            _qkv(dtype, True),
            "attention",
            True,
        ),
        "invariant_rms_norm": (invariant.rms_norm, (x.detach(), w.detach()), "reduction", False),
        "invariant_matmul": (invariant.matmul, (a, bm, bias), "matmul", True),
        "invariant_attention": (
            lambda q, k, v: invariant.attention(q, k, v, causal=True, kv_lens=[66]),
            _qkv(dtype, False, sq=3, sk=70),
            "attention",
            False,
        ),
    }


PUBLIC = sorted(_public_cases(torch.float32))
INDUCTOR = ["rms_norm", "matmul"]  # a first inductor compile costs ~20 s on 2 CPU cores


def _outputs_and_grads(fn, args, differentiable):
    for t in args:
        t.grad = None
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    if not differentiable:
        return outs, ()
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return outs, tuple(t.grad for t in args if t.requires_grad)


def _eager_vs_compiled(name, dtype, backend):
    torch._dynamo.reset()
    fn, args, op_class, differentiable = _public_cases(dtype)[name]
    expected, expected_grads = _outputs_and_grads(fn, args, differentiable)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got, grads = _outputs_and_grads(compiled, args, differentiable)
    assert len(got) == len(expected) and len(grads) == len(expected_grads)
    for out, ref in zip(got + grads, expected + expected_grads, strict=True):
        check.assert_close(out, ref, op=op_class)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", PUBLIC)
def test_eager_matches_compiled(name, backend):
    _eager_vs_compiled(name, torch.float32, backend)


@pytest.mark.parametrize("name", INDUCTOR)
def test_eager_matches_compiled_inductor(name):
    _eager_vs_compiled(name, torch.float32, "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("name", PUBLIC)
def test_eager_matches_compiled_bf16_inductor(name):
    _eager_vs_compiled(name, torch.bfloat16, "inductor")


# --- a transformer block from the course's ops alone ----------------------------------------

D_MODEL, N_HEADS, D_MLP = 32, 2, 64


def _block_params(dtype=torch.float32, grad=False):
    shapes = {
        "norm1": (D_MODEL,),
        "w_qkv": (D_MODEL, 3 * D_MODEL),
        "w_o": (D_MODEL, D_MODEL),
        "norm2": (D_MODEL,),
        "w_up": (D_MODEL, D_MLP),
        "b_up": (D_MLP,),
        "w_down": (D_MLP, D_MODEL),
    }
    scale = {"norm1": 1.0, "norm2": 1.0}
    return {
        name: _t(shape, dtype, 40 + i, grad, scale=scale.get(name, 1 / math.sqrt(shape[0])))
        for i, (name, shape) in enumerate(shapes.items())
    }


def block(x, p):
    """A pre-norm transformer block: rms_norm, matmul (bias + GELU epilogue in the MLP),
    causal attention, residual adds, each one of the course's operators."""
    B, S, D = x.shape
    dh = D // N_HEADS
    h = kernels.norm.rms_norm(x, p["norm1"]).view(B * S, D)
    qkv = kernels.matmul.matmul(h, p["w_qkv"]).view(B, S, 3, N_HEADS, dh)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, S, dh)
    a = kernels.attention.attention(q, k, v, causal=True).transpose(1, 2).reshape(B * S, D)
    x = kernels.elementwise.add(x, kernels.matmul.matmul(a, p["w_o"]).view(B, S, D))
    h = kernels.norm.rms_norm(x, p["norm2"]).view(B * S, D)
    m = kernels.matmul.matmul(h, p["w_up"], p["b_up"], activation="gelu")
    return kernels.elementwise.add(x, kernels.matmul.matmul(m, p["w_down"]).view(B, S, D))


def _block_input(batch, dtype=torch.float32, seq=8, grad=False):
    return _t((batch, seq, D_MODEL), dtype, 30 + batch, grad)


@pytest.fixture(scope="module")
def inductor_block():
    """The block compiled once with inductor (~30 s on 2 CPU cores), and its counter."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    return torch.compile(block, fullgraph=True, backend=counter), counter


def test_block_compiles_with_inductor_without_graph_breaks_or_recompiles(inductor_block):
    compiled, counter = inductor_block
    p, x = _block_params(), _block_input(2)
    expected = block(x, p)
    check.assert_close(compiled(x, p), expected, op="matmul")
    check.assert_close(compiled(x, p), expected, op="matmul")  # the same shape again
    assert counter.frame_count == 1, "a graph break or a recompilation"
    assert counter.op_count > 0
    explained = torch._dynamo.explain(block)(x, p)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_block_recompiles_at_most_once_for_a_new_batch_with_dynamic_shapes():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    p = _block_params()
    for batch in (2, 3, 5):
        check.assert_close(compiled(_block_input(batch), p), block(_block_input(batch), p),
                           op="matmul")  # fmt: skip
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for three batch sizes"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_block_gradients_compiled_match_eager(backend):
    torch._dynamo.reset()
    p, x = _block_params(grad=True), _block_input(2, grad=True)
    leaves = [x, *p.values()]
    dy = _t((2, 8, D_MODEL), torch.float32, 99)
    expected = torch.autograd.grad(block(x, p), leaves, dy)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = torch.autograd.grad(compiled(x, p), leaves, dy)
    for name, g, ref in zip(["x", *p], got, expected, strict=True):
        assert g.shape == ref.shape, name
        check.assert_close(g, ref, op="matmul")


@pytest.mark.gpu
def test_block_in_a_cuda_graph_replays_the_same_output():
    p, x = _block_params(torch.bfloat16), _block_input(4, torch.bfloat16, seq=64)
    expected = block(x, p)  # also the warm-up: every kernel compiled and tuned before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x, p)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x, p)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    x.copy_(_block_input(4, torch.bfloat16, seq=64) * 0.5)  # new values, the same buffer
    graph.replay()
    check.assert_close(out, block(x, p), op="matmul")


@pytest.mark.gpu
def test_block_under_reduce_overhead():
    torch._dynamo.reset()
    p = _block_params(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for seed in range(3):  # warm-up, recording, replays
        x = _block_input(4, torch.bfloat16, seq=64) * (seed + 1)
        check.assert_close(compiled(x, p).clone(), block(x, p), op="matmul")


# --- bad inputs: the same errors under torch.compile as in eager ----------------------------


def _bad_calls():
    x, w = _t((4, 8), torch.float32, 1), _t((8,), torch.float32, 2)
    q, k, v = _qkv(torch.float32, False)
    return {
        "rms_norm dtype": (lambda: kernels.norm.rms_norm(x.int(), w), TypeError),
        "rms_norm weight": (lambda: kernels.norm.rms_norm(x, w[:7]), ValueError),
        "rms_norm eps": (lambda: kernels.norm.rms_norm(x, w, eps=-1.0), ValueError),
        "add shapes": (lambda: kernels.elementwise.add(x, x[:3]), ValueError),
        "add_rms_norm residual": (lambda: kernels.norm.add_rms_norm(x, x.half(), w), TypeError),
        "matmul shapes": (lambda: kernels.matmul.matmul(x, x), ValueError),
        "matmul activation": (
            lambda: kernels.matmul.matmul(x, x.t(), activation="tanh"),
            ValueError,
        ),  # fmt: skip
        "softmax block": (lambda: kernels.softmax.softmax_streamed(x, block=3), ValueError),
        "attention head dim": (lambda: kernels.attention.attention(q, k[..., :8], v), ValueError),
        "invariant attention kv_lens": (
            lambda: invariant.attention(q, k, v, kv_lens=[1, 2]),
            ValueError,
        ),
        "invariant attention kv_lens values": (
            lambda: invariant.attention(q, k, v, kv_lens=_kv_lens([9])),
            ValueError,
        ),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_bad_inputs_get_the_same_errors_under_compile(case):
    call, error = _bad_calls()[case]
    with pytest.raises(error) as eager:
        call()
    message = str(eager.value)
    torch._dynamo.reset()
    with pytest.raises(error) as compiled:
        torch.compile(call, backend="eager")()
    assert str(compiled.value) == message
    torch._dynamo.reset()
    with pytest.raises(Exception) as full:  # Dynamo's own error, the message inside it
        torch.compile(call, backend="eager", fullgraph=True)()
    assert message in str(full.value)
