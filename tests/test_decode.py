"""kernels.decode: the rotary + KV-cache write and SwiGLU's product, against fp64 torch ops, and
the model's fused path (one GEMV for q, k, v and one for gate, up) against its unfused one."""

import collections

import pytest
import torch
from params import DTYPES

from kernels import check, decode
from kernels import norm as course_norm
from kernels.runtime import DEVICE

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rotary_case(B, S, H, Hkv, hd, T, dtype, shuffled, seed=0):
    """Inputs for rotary_kv: a cache of B + 2 rows, rows shuffled or in order, each row at its
    own positions; cos and sin of real rotary angles."""
    g = torch.Generator().manual_seed(seed)
    qkv = check.random_tensor((B, S, (H + 2 * Hkv) * hd), dtype, seed=seed)
    starts = torch.randint(0, T - S + 1, (B,), generator=g)
    pos = starts[:, None] + torch.arange(S)  # (B, S)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = pos[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, S, hd)
    rows = torch.randperm(B + 2, generator=g)[:B] if shuffled else torch.arange(B)
    cache = check.random_tensor((B + 2, Hkv, T, hd), dtype, seed=seed + 1)
    to = dict(device=DEVICE)
    return (qkv, angles.cos().to(dtype).to(**to), angles.sin().to(dtype).to(**to), cache,
            cache.clone() + 1, rows.to(**to), pos.to(**to), H, Hkv)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 1, 3, 1, 64, 9), (3, 5, 4, 2, 6, 11), (2, 1, 9, 3, 34, 5)], ids=str
)
@pytest.mark.parametrize("shuffled", [False, True], ids=["rows-in-order", "rows-shuffled"])
def test_rotary_kv_matches_fp64_and_writes_only_the_new_positions(shape, dtype, shuffled):
    args = rotary_case(*shape, dtype, shuffled)
    qkv, cos, sin, k_cache, v_cache, rows, pos, H, Hkv = args
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = decode.rotary_kv_ref(qkv, cos, sin, k_ref, v_ref, rows, pos, H, Hkv)
    q = decode.rotary_kv(*args)
    tol = TOL[dtype]
    assert q.shape == q_ref.shape and q.dtype == dtype
    torch.testing.assert_close(q.double(), q_ref.double(), atol=tol, rtol=tol)
    # every cache element: the new ones rotated (keys) or copied (values), the rest untouched
    torch.testing.assert_close(k_cache.double(), k_ref.double(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, v_ref)  # values are copied, bit for bit


def test_rotary_kv_rejects_mismatched_shapes_clearly():
    args = list(rotary_case(2, 1, 4, 2, 8, 6, torch.float32, False))
    args[-2] = 3  # query heads that do not match qkv's width
    with pytest.raises(ValueError, match="does not match 3 query heads"):
        decode.rotary_kv(*args)
    args = list(rotary_case(2, 1, 4, 2, 8, 6, torch.float32, False))
    args[6] = args[6].int()  # int32 positions
    with pytest.raises(ValueError, match="int64"):
        decode.rotary_kv(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (3, 1538), (2, 5, 70)], ids=str)
def test_silu_mul_matches_fp64(shape, dtype):
    gate_up = check.random_tensor(shape, dtype, seed=3, scale=3.0)
    out = decode.silu_mul(gate_up)
    ref = decode.silu_mul_ref(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


def test_silu_mul_rejects_an_odd_last_dim():
    with pytest.raises(ValueError, match="2F"):
        decode.silu_mul(torch.zeros((2, 3), device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
@pytest.mark.parametrize("splits", [None, 3, "no counters"], ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 3, 1, 64, 40), (3, 4, 2, 6, 33), (17, 9, 3, 34, 200)], ids=str
)  # (B, H, Hkv, hd, K)
def test_rotary_gemv_matches_fp64_and_the_gemv_then_rotary_kv(shape, splits, weights, dtype,
                                                              monkeypatch):  # fmt: skip
    """The q/k/v GEMV with rotary_kv in its epilogue, against the GEMV's fp64 reference then
    rotary_kv's, on odd shapes, K whole or cut into 3 pieces (summed by each tile's last
    piece; or, with no arrival counters to be had, the GEMV then rotary_kv); on the
    interpreter bit for bit what the GEMV then rotary_kv give."""
    from kernels import arrivals, int8

    B, H, Hkv, hd, K = shape
    if splits == "no counters":
        monkeypatch.setattr(arrivals, "counters", lambda device, tiles: None)
        splits = 3
    x = check.random_tensor((B, K), dtype, seed=11, scale=2.0)
    w = check.random_tensor(((H + 2 * Hkv) * hd, K), dtype, seed=12, scale=K**-0.5)
    weight, scale = decode.pair_halves(w, hd // 2), None
    if weights == "int8":
        weight, scale = int8.quantize(weight.float())
    _, cos, sin, k_cache, v_cache, rows, pos, _, _ = rotary_case(B, 1, H, Hkv, hd, 7, dtype, True)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = decode.rotary_gemv_ref(x, weight, cos, sin, k_ref, v_ref, rows, pos, H, Hkv, scale)
    k_two, v_two = k_cache.clone(), v_cache.clone()
    q = decode.rotary_gemv(x, weight, cos, sin, k_cache, v_cache, rows, pos, H, Hkv, scale,
                           splits=splits)  # fmt: skip
    assert q.shape == (B, H, 1, hd) and q.dtype == dtype
    tol = 2 * TOL[dtype]
    for out, ref in ((q, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    if DEVICE.type == "cpu" and splits is None:  # one piece on the interpreter: the same bits
        y = decode.weight_gemv(x, weight, scale)
        qkv = decode.unpair_halves(y, hd // 2).view(B, 1, -1)
        two = decode.rotary_kv(qkv, cos, sin, k_two, v_two, rows, pos, H, Hkv)
        assert torch.equal(q, two) and torch.equal(k_cache, k_two)
        assert torch.equal(v_cache, v_two)


def test_rotary_gemv_rejects_bad_inputs_clearly():
    case = rotary_case(2, 1, 4, 2, 8, 6, torch.float32, False)
    _, cos, sin, k_cache, v_cache, rows, pos, H, Hkv = case
    x = torch.zeros((2, 5), device=DEVICE)
    weight = torch.zeros(((H + 2 * Hkv) * 8, 5), device=DEVICE)
    with pytest.raises(ValueError, match=r"qkv_weight must be \(\(H \+ 2 Hkv\) \* hd, K\)"):
        decode.rotary_gemv(x, weight, cos, sin, k_cache, v_cache, rows, pos, 3, Hkv)
    with pytest.raises(ValueError, match=r"= \(64, K\), got \(63, 5\)"):
        decode.rotary_gemv(x, weight[1:], cos, sin, k_cache, v_cache, rows, pos, H, Hkv)
    with pytest.raises(ValueError, match="columns to match"):
        decode.rotary_gemv(x, weight[:, 1:], cos, sin, k_cache, v_cache, rows, pos, H, Hkv)
    with pytest.raises(ValueError, match="pos"):
        decode.rotary_gemv(x, weight, cos, sin, k_cache, v_cache, rows, pos[:, :0], H, Hkv)
    with pytest.raises(ValueError, match="blocks of 2"):
        decode.pair_halves(weight[:5], 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
@pytest.mark.parametrize("splits", [None, 3, "no counters"], ids=str)
@pytest.mark.parametrize("shape", [(1, 70, 40), (3, 129, 33), (17, 64, 200)], ids=str)  # M, N, K
def test_linear_add_matches_fp64_and_stores_each_column_tiles_squares(
    shape, splits, weights, dtype, monkeypatch
):
    """The GEMV with the residual add in its epilogue: the stream h against the GEMV's fp64
    reference then torch's add, on odd shapes (N across one to three column tiles), K whole,
    cut into 3 pieces (summed by each tile's last piece) or, with no arrival counters to be
    had, one; piece j of each row's squares is the sum of squares of h's columns in column
    tile j; on the interpreter h is bit for bit the stream of the GEMV then add_rms_norm."""
    from kernels import arrivals, int8, split_k
    from kernels import norm as course_norm

    M, N, K = shape
    if splits == "no counters":
        monkeypatch.setattr(arrivals, "counters", lambda device, tiles: None)
        splits = 3
    x = check.random_tensor((M, K), dtype, seed=13, scale=2.0)
    weight = check.random_tensor((N, K), dtype, seed=14, scale=K**-0.5)
    residual = check.random_tensor((M, N), dtype, seed=15)
    scale = None
    if weights == "int8":
        weight, scale = int8.quantize(weight.float())
    h, squares = decode.linear_add(x, weight, residual, scale, splits=splits)
    h_ref = decode.linear_add_ref(x, weight, residual, scale)
    assert h.shape == (M, N) and h.dtype == dtype and squares.dtype == torch.float32
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(h.double(), h_ref.double(), atol=tol, rtol=tol)
    kind = "gemv" if scale is None else "int8"
    width = split_k.choose_plan(x, weight.t(), kind, scale).tile.BLOCK_N
    assert squares.shape == (M, -(N // -width))
    for j in range(squares.shape[1]):
        piece = h[:, j * width : (j + 1) * width].double().pow(2).sum(-1)
        torch.testing.assert_close(squares[:, j].double(), piece, rtol=1e-5, atol=1e-5)
    if DEVICE.type == "cpu" and splits is None:  # the same sums on the interpreter: the same bits
        product = decode.weight_gemv(x, weight, scale)
        _, h_two = course_norm.add_rms_norm(product, residual, torch.ones_like(residual[0]))
        assert torch.equal(h, h_two)


def test_linear_add_rejects_bad_inputs_clearly():
    x, w = torch.zeros((2, 5), device=DEVICE), torch.zeros((6, 5), device=DEVICE)
    r = torch.zeros((2, 6), device=DEVICE)
    with pytest.raises(ValueError, match=r"residual must be \(M, N\) = \(2, 6\)"):
        decode.linear_add(x, w, r[:, :5])
    with pytest.raises(ValueError, match="M <= 64"):
        big = torch.zeros((65, 5), device=DEVICE)
        decode.linear_add(big, w, torch.zeros((65, 6), device=DEVICE))
    h, squares = decode.linear_add(x[:, :0], w[:, :0], r + 2)  # an empty sum: the residual
    torch.testing.assert_close(h, r + 2)
    torch.testing.assert_close(squares, torch.full((2, 1), 24.0, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
@pytest.mark.parametrize("splits", [None, 3], ids=str)
@pytest.mark.parametrize("shape", [(1, 70, 40), (3, 129, 33), (17, 64, 200)], ids=str)  # M, D, K
def test_the_gemvs_after_linear_add_normalize_the_stream_by_its_squares(shape, splits, weights,
                                                                        dtype):  # fmt: skip
    """What comes after linear_add: squares_linear, swiglu_gemv and rotary_gemv with `norm`
    take the stream h (M, D) it formed and its squares in pieces, and a weight with the norm's
    folded in (fold_norm), and scale each row of the product by its 1 / rms (each program
    adds the row's pieces), against each GEMV's reference of rms_norm(h) * g (fp64), K of
    linear_add whole or cut into 3 pieces."""
    from kernels import int8

    M, D, K = shape
    x = check.random_tensor((M, K), dtype, seed=21, scale=2.0)
    w_out = check.random_tensor((D, K), dtype, seed=22, scale=K**-0.5)
    h, squares = decode.linear_add(x, w_out, check.random_tensor((M, D), dtype, seed=23),
                                   splits=splits)  # fmt: skip
    g = check.random_tensor((D,), dtype, seed=24) + 1
    norm = (squares, 1e-5)
    tol = 2 * TOL[dtype]

    def folded(w):  # the weight with g folded in (int8: quantized first, then folded)
        scale = None
        if weights == "int8":
            w, scale = int8.quantize(w.float())
        return decode.fold_norm(w, g, scale)

    # against the unfolded weight: rms_norm(h) * g, then the GEMV (fp64)
    w = check.random_tensor((37, D), dtype, seed=25, scale=D**-0.5)
    weight, scale = folded(w)
    y = decode.squares_linear(h, squares, 1e-5, weight, scale)
    assert y.shape == (M, 37) and y.dtype == dtype
    unfolded = course_norm.rms_norm_ref(h.double(), g, 1e-5)  # fp64, never rounded
    if weights == "float":
        torch.testing.assert_close(y.double(), unfolded @ w.double().T, atol=tol, rtol=tol)
    ref = decode.squares_linear_ref(h, 1e-5, weight, scale)
    torch.testing.assert_close(y.double(), ref.double(), atol=tol, rtol=tol)
    gate_up, scale = folded(decode.interleave_rows(
        check.random_tensor((19, D), dtype, seed=26, scale=D**-0.5),
        check.random_tensor((19, D), dtype, seed=27, scale=D**-0.5)))  # fmt: skip
    act = decode.swiglu_gemv(h, gate_up, scale, norm=norm)
    ref = decode.swiglu_gemv_ref(h, gate_up, scale, norm=norm)
    torch.testing.assert_close(act.double(), ref.double(), atol=tol, rtol=tol)
    _, cos, sin, k_cache, v_cache, rows, pos, H, Hkv = rotary_case(M, 1, 3, 1, 6, 5, dtype, True)
    w, scale = folded(check.random_tensor((30, D), dtype, seed=28, scale=D**-0.5))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = decode.rotary_gemv(h, w, cos, sin, k_cache, v_cache, rows, pos, H, Hkv, scale, norm=norm)
    q_ref = decode.rotary_gemv_ref(h, w, cos, sin, k_ref, v_ref, rows, pos, H, Hkv, scale, norm)
    for out, ref in ((q, q_ref), (k_cache, k_ref), (v_cache, v_ref)):
        torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


def test_a_norm_by_squares_rejects_bad_inputs_clearly():
    h, w = torch.ones((2, 8), device=DEVICE), torch.ones((3, 8), device=DEVICE)
    g, squares = torch.ones(8, device=DEVICE), torch.ones((2, 2), device=DEVICE)
    with pytest.raises(ValueError, match=r"contiguous fp32 \(M, pieces\).*2 rows, got \(3, 2\)"):
        decode.squares_linear(h, torch.ones((3, 2), device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="fp32"):
        decode.squares_linear(h, squares.half(), 1e-5, w)
    with pytest.raises(TypeError, match=r"norm must be \(squares, eps\)"):
        decode.swiglu_gemv(h, torch.ones((6, 8), device=DEVICE), norm=(squares, g, 1e-5))
    with pytest.raises(ValueError, match="M <= 64"):
        big = torch.ones((65, 8), device=DEVICE)
        decode.squares_linear(big, torch.ones((65, 1), device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="norm_weight must have the weight's 8 columns"):
        decode.fold_norm(w, g[:7])
    with pytest.raises(ValueError, match="int8 weight needs its scale"):
        decode.fold_norm(w.to(torch.int8), g)
    # folded: the weight's columns times g, rounded to its dtype; int8 quantized again
    torch.testing.assert_close(decode.fold_norm(w.half(), g * 3)[0], torch.full((3, 8), 3.0,
                               device=DEVICE, dtype=torch.float16))  # fmt: skip
    q, scale = decode.fold_norm(w.to(torch.int8) * 127, g * 2, torch.full((3,), 0.5, device=DEVICE))
    assert (
        q.dtype == torch.int8
        and bool((q == 127).all())
        and torch.equal(scale, torch.ones(3, device=DEVICE))
    )
    y = decode.squares_linear(h, squares, 1e-12, w)  # squares 2 over 8 columns: 1 / rms = 2
    torch.testing.assert_close(y, torch.full((2, 3), 16.0, device=DEVICE))


@pytest.mark.parametrize(
    "fusion",
    ["as it is", "separate", "norm_in_gemv", "swiglu_in_gemv", "swiglu_in_epilogue",
     "rotary_in_epilogue", "norm_in_epilogue", "all epilogues"],
)  # fmt: skip
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_the_fused_model_path_matches_the_unfused_one(weights, fusion, monkeypatch):
    """The tiny model on the course's backend with a cache: the fused q/k/v and gate/up path
    (the norms in their own kernels or inside the GEMVs after them; SwiGLU's product in its
    own kernel, inside the down GEMV or in the gate-and-up GEMV's epilogue; rotary and the
    cache writes in the q/k/v GEMV's epilogue; the residual adds in wo's and w_down's
    epilogues, with the sums of squares by which the GEMVs after them normalize; "all
    epilogues": the last three at once; "as it is": the model's own choice, the three
    epilogues) gives the logits of the layer-by-layer path
    (torch's backend, same weights), token by token over a prefill and two decode steps, with
    rows at different positions too."""
    from kernels import llm
    from kernels.llm.model import Block

    model = llm.load_model("tiny", device=DEVICE, backend="kernels")
    names = ("norm_in_gemv", "swiglu_in_gemv", "swiglu_in_epilogue", "rotary_in_epilogue",
             "norm_in_epilogue")  # fmt: skip
    defaults = [getattr(Block, name) for name in names]
    if fusion == "as it is":
        assert defaults == [False, False, True, True, True]
        _tiny_model_both_ways(model, weights, monkeypatch)
        return
    switches = {"separate": {}, "all epilogues": dict.fromkeys(names[2:], True)}
    with llm.fusions(**switches.get(fusion, {fusion: True})):
        _tiny_model_both_ways(model, weights, monkeypatch)
    assert [getattr(Block, name) for name in names] == defaults


@pytest.mark.parametrize("weights", ["float", "int8"])
def test_a_long_prefill_takes_the_paired_stacks_too(weights):
    """With SwiGLU in the gate-and-up epilogue and rotary in the q/k/v one, a prefill of more
    rows than the GEMV takes computes gate and up, and q, k and v, from the same paired stacks
    (their columns unpaired for silu_mul and rotary_kv): one stack of each kept on the block,
    and torch's backend's logits."""
    from kernels import gemv, llm
    from kernels.llm import quant

    model = llm.load_model("tiny", device=DEVICE, backend="kernels")
    reference = llm.load_model("tiny", device=DEVICE, backend="torch")
    reference.load_state_dict(model.state_dict())
    if weights == "int8":
        quant.quantize_int8(model), quant.quantize_int8(reference)
    tokens = torch.randint(0, model.config.vocab_size, (2, gemv.MAX_ROWS), device=DEVICE)
    with torch.no_grad(), llm.fusions(swiglu_in_epilogue=True, rotary_in_epilogue=True):
        out = model(tokens, model.new_cache(2, gemv.MAX_ROWS), input_pos=0)
    ref = reference(tokens, reference.new_cache(2, gemv.MAX_ROWS), input_pos=0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    c = model.config
    for layer in model.layers:  # the paired stacks alone (neither folded with a norm)
        assert list(layer.__dict__["_fused"]) == [
            (("wq", "wk", "wv"), c.head_dim // 2, False),
            (("w_gate", "w_up"), c.d_ff, False),
        ]


def test_the_three_epilogues_remove_three_launches_a_layer(monkeypatch):
    """A decoding step of the tiny model on the course's backend, its launches counted by
    kernel, SwiGLU in the gate-and-up GEMV's epilogue in both: with rotary in the q/k/v GEMV's
    epilogue and the norms in the epilogues of wo and w_down, rotary_kv's launch and both
    norms of every layer are gone, the rotary GEMV stands in for the q/k/v GEMV, and two
    norms are left: the embedding's, which no GEMV comes before, and the final one (a head
    folded with its weight would copy the tied embedding): three launches fewer a layer, one
    more a step. The logits: within rounding (a norm's sum of squares is added in other
    pieces, its weight rounded into the next weights)."""
    from kernels import launch as course_launch
    from kernels import llm
    from kernels.llm import speed

    counted = []
    call, kept = course_launch.Launcher.__call__, course_launch.Launcher.launch_kept

    def counting_call(self, *args, **kwargs):
        counted.append(self.name)
        return call(self, *args, **kwargs)

    def counting_kept(self, *args):
        launched = kept(self, *args)
        if launched:
            counted.append(self.name)
        return launched

    monkeypatch.setattr(course_launch.Launcher, "__call__", counting_call)
    monkeypatch.setattr(course_launch.Launcher, "launch_kept", counting_kept)
    model = llm.load_model("tiny", device=DEVICE, backend="kernels")
    layers = model.config.n_layers
    launches, logits = {}, {}
    for name, switches in (("SwiGLU's alone", {"swiglu_in_epilogue": True}), ("epilogues", {
                           "rotary_in_epilogue": True, "norm_in_epilogue": True,
                           "swiglu_in_epilogue": True})):  # fmt: skip
        with torch.no_grad(), llm.fusions(**switches):
            step, _, _ = speed.decode_step(model, 1, 8)
            step()  # the first call's plans and stacks
            counted.clear()
            logits[name] = step()
        launches[name] = collections.Counter(counted)
    before, after = launches["SwiGLU's alone"], launches["epilogues"]
    assert before["rotary_kv_kernel"] == layers and after["rotary_kv_kernel"] == 0
    assert after["rotary_gemv_kernel"] == layers
    assert before["rms_norm_fwd_kernel"] == 2 * layers + 1 and after["rms_norm_fwd_kernel"] == 2
    assert after.total() == before.total() - 3 * layers + 1
    torch.testing.assert_close(logits["epilogues"], logits["SwiGLU's alone"], atol=1e-4, rtol=1e-4)


def _tiny_model_both_ways(model, weights, monkeypatch):
    """The checks of the fused model path with Block's fusions as they are set now."""
    from kernels import llm
    from kernels.llm import quant
    from kernels.llm.model import Block

    if Block.swiglu_in_gemv or Block.swiglu_in_epilogue:  # no silu_mul kernel

        def refuse(*args):
            raise AssertionError("silu_mul ran: SwiGLU's product was not inside the GEMV")

        monkeypatch.setattr(decode, "silu_mul", refuse)
    calls, rotated, after = [], [], []  # which fused kernels ran (or did not)
    norm_linear, rotary_gemv, linear_add = (
        decode.norm_linear,
        decode.rotary_gemv,
        decode.linear_add,
    )
    monkeypatch.setattr(decode, "norm_linear", lambda *a: calls.append(1) or norm_linear(*a))
    monkeypatch.setattr(
        decode, "rotary_gemv", lambda *a, **k: rotated.append(1) or rotary_gemv(*a, **k)
    )
    monkeypatch.setattr(decode, "linear_add", lambda *a: after.append(1) or linear_add(*a))
    reference = llm.load_model("tiny", device=DEVICE, backend="torch")
    reference.load_state_dict(model.state_dict())
    if weights == "int8":
        quant.quantize_int8(model), quant.quantize_int8(reference)
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), device=DEVICE)
    caches = model.new_cache(2, 16), reference.new_cache(2, 16)
    with torch.no_grad():
        outs = [m(tokens, c, input_pos=0) for m, c in zip((model, reference), caches, strict=True)]
        for step in range(2):  # one shared position, then one per row (the server's path)
            pos = 5 + step if step == 0 else [6, 6]
            nxt = outs[0][:, -1:].argmax(-1)
            outs = [
                m(nxt, c, input_pos=pos) for m, c in zip((model, reference), caches, strict=True)
            ]
            torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=1e-5, rtol=1e-5)
    assert "_fused" in model.layers[0].__dict__  # the fused path ran
    in_gemv = 3 * (2 * model.config.n_layers - 1 + 1)  # every norm but layer 0's first
    alone = not (Block.swiglu_in_epilogue or Block.rotary_in_epilogue)  # norm_in_gemv's cases
    assert len(calls) == (in_gemv if Block.norm_in_gemv and alone else 0)
    layers = model.config.n_layers
    assert len(rotated) == (2 * layers if Block.rotary_in_epilogue else 0)
    assert len(after) == (6 * layers if Block.norm_in_epilogue else 0)


def test_the_stacked_weights_follow_weights_changed_in_place():
    """The fused path's stacks (norm weights folded in) are rebuilt when a weight they were
    built from changes in place, as load_state_dict changes it: the tiny model's decoding
    step then matches torch's backend with the new weights, not the stacks of the old."""
    from kernels import llm

    model = llm.load_model("tiny", device=DEVICE, backend="kernels")
    reference = llm.load_model("tiny", device=DEVICE, backend="torch")
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen).to(DEVICE)

    def step(m):  # a prefill, then one decoding step (the fused GEMVs' rows) of a given token:
        cache = m.new_cache(1, 8)  # no argmax, whose near-ties could part the two models
        m(tokens[:, :4], cache, input_pos=0)
        return m(tokens[:, 4:], cache, input_pos=4)

    with torch.no_grad():
        step(model)  # the stacks built from the first weights
        changed = {k: v * 1.5 if "norm" in k or "wq" in k else v
                   for k, v in model.state_dict().items()}  # fmt: skip
        model.load_state_dict(changed)  # in place: the same storage
        reference.load_state_dict(changed)
        torch.testing.assert_close(step(model), step(reference), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 33, 70), (3, 64, 200), (17, 5, 31)], ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_swiglu_linear_matches_fp64_and_the_two_kernel_path(shape, dtype, weights):
    from kernels import int8

    M, N, F = shape
    gate_up = check.random_tensor((M, 2 * F), dtype, seed=5, scale=2.0)
    weight = check.random_tensor((N, F), dtype, seed=6, scale=F**-0.5)
    scale = None
    if weights == "int8":
        weight, scale = int8.quantize(weight.float())
    out = decode.swiglu_linear(gate_up, weight, scale)
    ref = decode.swiglu_linear_ref(gate_up, weight, scale)
    assert out.shape == (M, N) and out.dtype == dtype
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    if DEVICE.type == "cpu":  # one tile on the interpreter: the same sums, the same bits
        act = decode.silu_mul(gate_up)
        two = decode.weight_gemv(act, weight, scale)
        assert torch.equal(out, two)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 33, 70), (3, 64, 200), (17, 5, 31)], ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
def test_norm_linear_matches_fp64_and_the_two_kernel_path(shape, dtype, weights):
    """rms_norm(x + residual) * g @ W.T in the GEMV's loads: against fp64, against
    add_rms_norm then the GEMV (the squares summed in other pieces: within rounding), and the
    residual stream x + residual stored bit for bit as add_rms_norm stores it."""
    from kernels import int8, norm

    M, N, K = shape
    x = check.random_tensor((M, K), dtype, seed=7, scale=2.0)
    residual = check.random_tensor((M, K), dtype, seed=8)
    g = check.random_tensor((K,), dtype, seed=9)
    weight = check.random_tensor((N, K), dtype, seed=10, scale=K**-0.5)
    scale = None
    if weights == "int8":
        weight, scale = int8.quantize(weight.float())
    y, h = decode.norm_linear(x, residual, g, 1e-5, weight, scale)
    y_ref, h_ref = decode.norm_linear_ref(x, residual, g, 1e-5, weight, scale)
    assert y.shape == (M, N) and y.dtype == dtype and torch.equal(h, h_ref)
    tol = 4 * TOL[dtype]
    torch.testing.assert_close(y.double(), y_ref.double(), atol=tol, rtol=tol)
    normed, h_two = norm.add_rms_norm(x, residual, g, 1e-5)
    two = decode.weight_gemv(normed, weight, scale)
    assert torch.equal(h, h_two)
    torch.testing.assert_close(y, two, atol=tol, rtol=tol)
    y_only, none = decode.norm_linear(x, residual, g, 1e-5, weight, scale, keep_sum=False)
    assert none is None and torch.equal(y_only, y)


def test_norm_linear_refuses_bad_inputs_clearly():
    x = torch.zeros((2, 8), device=DEVICE)
    w = torch.zeros((4, 8), device=DEVICE)
    with pytest.raises(ValueError, match="shape"):
        decode.norm_linear(
            x, torch.zeros((2, 7), device=DEVICE), torch.ones(8, device=DEVICE), 1e-5, w
        )
    with pytest.raises(ValueError, match="last dim"):
        decode.norm_linear(x, x, torch.ones(7, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="M <= 64"):
        big = torch.zeros((65, 8), device=DEVICE)
        decode.norm_linear(big, big, torch.ones(8, device=DEVICE), 1e-5, w)
    with pytest.raises(ValueError, match="contiguous"):
        decode.norm_linear(x.t().contiguous().t(), x, torch.ones(8, device=DEVICE), 1e-5, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 37, 40), (3, 24, 200), (17, 5, 33)], ids=str)
@pytest.mark.parametrize("weights", ["float", "int8"])
@pytest.mark.parametrize("splits", [None, 3, "reduce"], ids=["planned", "splits=3", "reduce"])
def test_swiglu_gemv_matches_fp64_and_the_two_kernel_path(
    shape, dtype, weights, splits, monkeypatch
):
    """SwiGLU's product in the gate-and-up GEMV's epilogue (interleaved rows): against fp64,
    and on the interpreter bit for bit against the GEMV then silu_mul, with K whole and cut
    into pieces summed by the tile's last piece or by the reduce kernel (the product is formed
    after the sum)."""
    from kernels import int8, split_k

    if splits == "reduce":  # no tile's partials are few enough for its last piece to sum
        monkeypatch.setattr(split_k, "LAST_SUM_MAX_ELEMENTS", 0)
        splits = 3

    M, F, K = shape
    x = check.random_tensor((M, K), dtype, seed=8, scale=2.0)
    gate = check.random_tensor((F, K), dtype, seed=9, scale=K**-0.5)
    up = check.random_tensor((F, K), dtype, seed=10, scale=K**-0.5) - 0.5 * K**-0.5
    weight, scale = decode.interleave_rows(gate, up), None
    assert torch.equal(weight[0::2], gate) and torch.equal(weight[1::2], up)
    if weights == "int8":
        weight, scale = int8.quantize(weight.float())
    if splits is None:
        out = decode.swiglu_gemv(x, weight, scale)
    else:
        kind = "gemv" if scale is None else "int8"
        out = split_k.product(x, weight.t(), kind=kind, scale=scale, activation="swiglu",
                              splits=splits)  # fmt: skip
    ref = decode.swiglu_gemv_ref(x, weight, scale)
    assert out.shape == (M, F) and out.dtype == dtype
    tol = 2 * TOL[dtype]
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    if DEVICE.type == "cpu" and splits is None:  # one tile on the interpreter: the same bits
        y = decode.weight_gemv(x, weight, scale)
        two = decode.silu_mul(decode.gate_then_up(y))
        assert torch.equal(out, two)


def test_swiglu_gemv_rejects_bad_inputs_clearly():
    x = torch.zeros((2, 8), device=DEVICE)
    with pytest.raises(ValueError, match="interleaved"):
        decode.swiglu_gemv(x, torch.zeros((5, 8), device=DEVICE))
    with pytest.raises(ValueError, match="columns to match"):
        decode.swiglu_gemv(x, torch.zeros((6, 7), device=DEVICE))
    with pytest.raises(ValueError, match="one shape"):
        decode.interleave_rows(torch.zeros(3, 4), torch.zeros(3, 5))
    assert decode.swiglu_gemv(x[:0], torch.zeros((6, 8), device=DEVICE)).shape == (0, 3)


def test_swiglu_linear_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match="twice weight's F columns"):
        decode.swiglu_linear(
            torch.zeros((2, 10), device=DEVICE), torch.zeros((4, 4), device=DEVICE)
        )


# --- decode attention: one query a row, the group's heads in one tile, keys split finely ----


def _lens_ref(q, k, v, kv_lens=None):
    from kernels.batch_invariant.split_kv_attention import attention_ref

    return attention_ref(q, k, v, causal=False, kv_lens=kv_lens)


def _sdpa_same_dtype(q, k, v, kv_lens=None):
    from kernels.llm.ops import sdpa_attention

    return sdpa_attention(q, k, v, causal=True, kv_lens=kv_lens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 6, 2, 77, 40), (1, 9, 3, 513, 64), (3, 4, 4, 5, 16), (2, 8, 1, 130, 128)],
    ids=lambda s: "B{}-H{}-Hkv{}-Sk{}-D{}".format(*s),
)  # fmt: skip
@pytest.mark.parametrize("with_lens", [False, True], ids=["all-keys", "kv_lens"])
def test_decode_attention_matches_fp64(shape, dtype, with_lens):
    B, H, Hkv, Sk, D = shape
    q = check.random_tensor((B, H, 1, D), dtype, seed=1)
    k = check.random_tensor((B, Hkv, Sk, D), dtype, seed=2)
    v = check.random_tensor((B, Hkv, Sk, D), dtype, seed=3)
    lens = [max(1, Sk - 7 * b) for b in range(B)] if with_lens else None
    lens = None if lens is None else torch.tensor(lens, device=DEVICE)
    r = check.against_fp64(
        decode.attention, q, k, v, lens, ref=_lens_ref, op="attention", baseline=_sdpa_same_dtype
    )
    assert r.ok, r.message


def test_decode_attention_splits_from_the_shape_alone():
    assert decode.decode_split(512, 3, sms=132) == 64  # 8 splits a head: 24 programs a row
    assert decode.decode_split(512, 8, sms=132) == 64  # cdiv(264, 8) = 33 wanted, 8 possible
    assert decode.decode_split(100_000, 8, sms=132) == 3072  # 33 splits of 48 blocks (or less)
    assert decode.decode_split(1, 3, sms=132) == 64  # at least one block
    params = list(__import__("inspect").signature(decode.decode_split).parameters)
    assert params == ["Sk", "kv_heads", "sms"]  # never the batch


def test_decode_attention_rejects_more_than_one_query_clearly():
    q = torch.zeros((1, 4, 2, 16), device=DEVICE)
    kv = torch.zeros((1, 2, 8, 16), device=DEVICE)
    with pytest.raises(ValueError, match="decode attention takes one query a row"):
        decode.attention(q, kv, kv)
    with pytest.raises(ValueError, match="kv_lens must be in"):
        decode.attention(q[:, :, :1], kv, kv, torch.tensor([9], device=DEVICE))


@pytest.mark.parametrize("case", ["prefill-causal", "decode-kv_lens"])
def test_split_kv_attention_combines_in_its_last_split_as_the_combine_kernel_does(
    monkeypatch, case
):
    """The tile's last split program to finish combines the splits (an arrival counter) with
    the combine kernel's arithmetic in its order: bit for bit its result, counters back at 0."""
    from kernels import arrivals
    from kernels import batch_invariant as bi

    Sq, lens = (37, None) if case == "prefill-causal" else (1, [300, 131, 64])
    q = check.random_tensor((3, 4, Sq, 40), seed=5)
    k = check.random_tensor((3, 2, 300, 40), seed=6)  # 5 splits of 64 keys on a CPU
    v = check.random_tensor((3, 2, 300, 40), seed=7)
    lens = None if lens is None else torch.tensor(lens, device=DEVICE)
    with check.poisoned_allocations():  # a partial read before it is written shows
        one_launch = bi.attention(q, k, v, causal=True, kv_lens=lens)
    assert not arrivals.counters(q.device, 1).any()
    monkeypatch.setattr(arrivals, "counters", lambda device, tiles: None)
    assert torch.equal(one_launch, bi.attention(q, k, v, causal=True, kv_lens=lens))


@pytest.mark.gpu
def test_dependent_launch_changes_no_bit_of_a_decoding_step(monkeypatch):
    """The tiny model's decoding step on the course's kernels, replayed from a CUDA graph with
    dependent launch (kernels.runtime.PDL: kernels overlap the tail of the one before) and
    without: the same logits and the same cache, bit for bit; and a chain of GEMVs each
    reading the one before's output, where a kernel that read too early would differ."""
    from kernels import gemv, llm, runtime
    from kernels.llm import speed

    if not runtime.PDL:
        pytest.skip("dependent launch needs Hopper or later (and KERNELS_PDL not 0)")
    model = llm.load_model("tiny", device=DEVICE, dtype=torch.bfloat16, backend="kernels")
    weights = [check.random_tensor((96, 96), torch.bfloat16, seed=s, scale=0.1) for s in range(40)]
    x0 = check.random_tensor((1, 96), torch.bfloat16, seed=99)

    def chain():
        x = x0
        for w in weights:
            x = gemv.linear(x, w)
        return x

    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(runtime, "PDL", pdl)
        with torch.no_grad():
            step, _, cache = speed.decode_step(model, 2, 24)
            replay, logits = speed.capture(step)
            replay()
            chain_replay, chained = speed.capture(chain)
            chain_replay()
            torch.cuda.synchronize()
        results[pdl] = (logits.clone(), cache.k.clone(), chained.clone())
    for off, on in zip(results[False], results[True], strict=True):
        assert torch.equal(off, on)
