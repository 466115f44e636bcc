"""kernels.llm.speed and kernels.llm.quant: the napkin math against counts done by hand and
against the model's own tensors, and every timer of Chapter 6 at tiny sizes on the CPU (the GPU
branch of each runs on the H200: tests marked gpu)."""

import pytest
import torch

from kernels import int8
from kernels.llm import load_model, quant, speed
from kernels.llm.config import get_config
from kernels.runtime import DEVICE

CPU = torch.device("cpu")


@pytest.fixture()
def tiny():
    return load_model("tiny", device=CPU)


@pytest.fixture()
def tiny_here():
    """On the kernels' device: quantize_int8 and the kernels backend run the course's kernels."""
    return load_model("tiny", device=DEVICE)


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-1b-shape"])
def test_matmul_params_are_the_parameters_but_norms_and_the_lookup(name):
    c = get_config(name)
    norms = (2 * c.n_layers + 1) * c.d_model
    untied_lookup = 0 if c.tied_embeddings else c.vocab_size * c.d_model
    assert speed.matmul_params(c) == c.n_params() - norms - untied_lookup


def test_smollm2_bytes_by_hand():
    # 30 layers of 576x576 (q, o), 2 x 192x576 (k, v), 3 x 576x1536, and the 49152x576 head
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536
    params = 30 * layer + 49152 * 576
    assert speed.matmul_params("smollm2-135m") == params
    assert speed.weight_bytes("smollm2-135m", 2) == 2 * params + 2 * 61 * 576
    assert speed.kv_bytes_per_position("smollm2-135m", 2) == 30 * 2 * 3 * 64 * 2
    kv = 4 * 512 * 30 * 2 * 3 * 64 * 2
    assert speed.step_bytes("smollm2-135m", 2, 512, 4) == 2 * params + 2 * 61 * 576 + kv
    flops = 4 * (2 * params + 30 * 4 * 9 * 64 * 512)
    assert speed.step_flops("smollm2-135m", 512, 4) == flops


def test_int8_bytes_equal_the_quantized_models_tensors(tiny_here):
    float_bytes = speed.weight_bytes("tiny", 4)
    assert quant.weight_bytes(tiny_here) == float_bytes - 0  # the untied lookup is not read
    quant.quantize_int8(tiny_here)
    assert quant.weight_bytes(tiny_here) == speed.weight_bytes("tiny", 4, int8=True)
    assert speed.weight_bytes("llama-1b-shape", 2, int8=True) < 0.51 * speed.weight_bytes(
        "llama-1b-shape", 2
    )


def test_roofline_prediction_and_its_crossover():
    args = ("llama-1b-shape", 2, 64)
    bw, peak = 4000.0, 800.0
    b = speed.compute_bound_batch(*args, bw, peak)
    assert 200 < b < 400  # the ridge, 200 FLOPs a byte, 1 FLOP a weight byte a row; plus KV
    # at 512 a row's 16.8 MB of KV take longer than its 2.5 GFLOP: never compute-bound
    assert speed.compute_bound_batch("llama-1b-shape", 2, 512, bw, peak) is None
    below, above = int(b) - 1, int(b) + 2
    memory = lambda batch: speed.step_bytes(*args, batch) / (bw * 1e9) * 1e3
    assert speed.predicted_step_ms(*args, below, bw, peak) == pytest.approx(memory(below))
    assert speed.predicted_step_ms(*args, above, bw, peak) > memory(above)
    # at a context where a row's KV bytes outweigh its FLOPs, no batch is compute-bound
    assert speed.compute_bound_batch("llama-1b-shape", 2, 10**6, bw, peak) is None
    ctx = speed.kv_equals_weights_context("smollm2-135m", 2, 16)
    kv = 16 * ctx * speed.kv_bytes_per_position("smollm2-135m", 2)
    assert kv == pytest.approx(speed.weight_bytes("smollm2-135m", 2))
    assert speed.speed_of_light(1000.0, 1e9) == pytest.approx(1000.0)


def test_decode_step_equals_the_full_pass_at_its_position(tiny):
    step, tokens, cache = speed.decode_step(tiny, batch=3, context=9)
    with torch.no_grad():
        logits = step()
    assert logits.shape == (3, 1, 256)
    assert cache.k.shape[3] == 9
    # the cache holds zeros before the position: the same as attending over zero keys
    assert torch.isfinite(logits).all()


def test_cpu_timers_run_and_return_positive_times(tiny):
    with torch.no_grad():
        step, _, _ = speed.decode_step(tiny, 2, 8)
        assert speed.step_ms(step, 3, CPU) > 0
        assert speed.eager_decode_ms(tiny, [1, 2, 3], 4) > 0
    rows = speed.batch_sweep(tiny, [1, 4], context=8, steps=2)
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(1e3 * r["batch"] / r["ms"])
               for r in rows)  # fmt: skip


def test_kernels_per_step_counts_and_fusion_removes_ops(tiny):
    with torch.no_grad():
        step, _, _ = speed.decode_step(tiny, 1, 8)
        count = speed.kernels_per_step(step, CPU)
        again = speed.kernels_per_step(step, CPU)
        busy = speed.gpu_busy(step, 2, CPU)
    assert count["kernels"] > 10 * tiny.config.n_layers
    assert count == again
    assert sum(count["names"].values()) == count["kernels"]
    assert busy["wall_us"] > 0 and 0 < busy["busy"] <= 1.5


def test_compiled_step_runs_on_the_cpu(tiny):
    ms, first_s = speed.compiled_step_ms(tiny, 1, 8, steps=2, mode="default")
    assert ms > 0 and first_s > 0


def test_int8_model_close_to_float_and_the_kernels_backend_agrees(tiny_here):
    tokens = torch.randint(0, 256, (2, 7), device=DEVICE)
    with torch.no_grad():
        ref = tiny_here(tokens)
        quant.quantize_int8(tiny_here)
        q = tiny_here(tokens)
        tiny_here.backend = "kernels"
        qk = tiny_here(tokens[:, :3])
    assert (q - ref).abs().max() < 0.05 * ref.abs().max()
    assert (qk - q[:, :3]).abs().max() < 1e-4
    head = tiny_here.head.weight
    assert torch.equal(tiny_here.head_int8, int8.quantize(head)[0])
    with pytest.raises(ValueError, match="int8 already"):
        quant.quantize_int8(tiny_here)


def test_time_linears_with_a_stand_in_timer():
    calls = []

    def timer(fn, argsets):
        for args in argsets:
            calls.append(fn(*args).shape)
        return 0.5

    shapes = speed.linear_shapes("tiny")
    fns = {"torch": (torch.nn.functional.linear, lambda x, w: [(x, w)])}
    rows = speed.time_linears(shapes, fns, torch.float32, CPU, timer, rows=2)
    assert [r["name"] for r in rows] == list(shapes)
    assert calls[0] == (2, shapes["wq"][0])
    assert rows[0]["torch"]["gbps"] == pytest.approx(rows[0]["bytes"] / 0.5 / 1e6)


def test_down_projection_times_both_paths_and_they_agree():
    """The two paths the chapter times compute the same thing, for float and int8 weights."""
    outs = []

    def timer(fn, argsets):
        outs.append(fn(*argsets[0]))
        return float(len(outs))

    found = speed.down_projection_ms("tiny", torch.float32, DEVICE, timer, copies=lambda w: [w])
    assert set(found) == {"float", "int8"} and set(found["int8"]) == {"separate", "fused"}
    c = get_config("tiny")
    assert found["int8"] == {"separate": 3.0, "fused": 4.0}  # separate, then fused
    for separate, fused in (outs[:2], outs[2:]):
        assert separate.shape == fused.shape == (1, c.d_model)
        torch.testing.assert_close(separate, fused, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: checked on GPU")
def test_graph_and_compiled_steps_on_the_gpu():
    model = load_model("tiny", device="cuda", dtype=torch.bfloat16, backend="kernels")
    step, _, _ = speed.decode_step(model, 2, 16)
    with torch.no_grad():
        eager = step().clone()
        replay, out = speed.capture(step)
        replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert speed.graph_step_ms(model, 2, 16, 5) > 0
    assert speed.kernels_per_step(step, "cuda")["kernels"] > 0
    model.backend = "torch"
    ms, _ = speed.compiled_step_ms(model, 2, 16, 5)
    assert ms > 0


def test_random_model_has_the_configs_shapes_and_no_file():
    from kernels.llm import random_model

    model = random_model("smollm2-135m", torch.float32, "meta", backend="torch")
    assert model.backend == "torch"
    assert sum(p.numel() for p in model.parameters()) == get_config("smollm2-135m").n_params()
    tiny = random_model("tiny", torch.float32, CPU)
    assert tiny.backend == "kernels" and not tiny.training
    assert all(torch.isfinite(p).all() for p in tiny.parameters())


@pytest.mark.gpu
def test_decode_step_rows_rate_a_step_against_its_speed_of_light(monkeypatch):
    """bench decode's step rows at the tiny config: GB/s of the step's bytes (so % of copy is %
    of the speed-of-light line), torch's ops, the kernels without dependent launch, with
    SwiGLU's product in a kernel of its own, with rotary in a kernel of its own and with the
    norms in kernels of their own as baselines of bf16, bf16 as int8's."""
    from kernels import bench, runtime
    from kernels.benchmarks import decode

    monkeypatch.setattr(decode, "STEP_MODELS", ("tiny",))
    monkeypatch.setattr(decode, "STEP_CALLS", 5)
    pdl = runtime.PDL
    rows = decode.bench_decode_steps(bench.measure_ceilings())
    assert runtime.PDL == pdl  # put back
    bf16, q8 = rows
    assert bf16["name"] == "decode step tiny B=1 T=512 [graph] bf16" and bf16["unit"] == "GB/s"
    assert set(bf16["baselines"]) == {
        "torch's ops",
        "without dependent launch",
        "SwiGLU in a kernel of its own",
        "rotary in a kernel of its own",
        "the norms in kernels of their own",
    }
    assert set(q8["baselines"]) == {"bf16", "torch's ops bf16"}
    expected = speed.step_bytes("tiny", 2, 512) / bf16["ms"] / 1e6
    assert bf16["rate"] == pytest.approx(expected)


@pytest.mark.gpu
def test_the_fusion_ladder_times_and_counts_every_rung_and_puts_the_model_back(tiny_here):
    """speed.fusion_ladder at the tiny config: one entry per rung, in FUSION_LADDER's order,
    each a positive time and a kernel count; the course's step launches fewer kernels than
    torch's, and taking any of the three epilogues out launches more than the step as it is;
    the model's backend and dependent launch as they were."""
    from kernels import runtime
    from kernels.llm.model import Block

    tiny_here.backend = "torch"
    pdl = runtime.PDL
    switches = {
        name: getattr(Block, name)
        for name in ("swiglu_in_epilogue", "rotary_in_epilogue", "norm_in_epilogue")
    }
    ladder = speed.fusion_ladder(tiny_here, 1, 64, 3, counted=True)
    assert list(ladder) == [label for label, *_ in speed.FUSION_LADDER]
    assert all(r["ms"] > 0 and r["kernels"] > 0 for r in ladder.values())
    fused = ladder["kernels"]["kernels"]
    assert fused < ladder["torch's ops"]["kernels"]
    assert ladder["without dependent launch"]["kernels"] == fused
    for label in (
        "SwiGLU in a kernel of its own",
        "rotary in a kernel of its own",
        "the norms in kernels of their own",
    ):
        assert ladder[label]["kernels"] > fused, label
    assert tiny_here.backend == "torch" and runtime.PDL == pdl
    assert {name: getattr(Block, name) for name in switches} == switches
