"""kernels.llm's backends and its dynamic-batching server, on the "tiny" config: the course's
kernels (Triton's interpreter on a CPU) against torch's ops, prefill + decode against the full
pass, and the server's batch invariance, bit for bit, with a negative control that must differ."""

import contextlib

import pytest
import torch

from kernels import batch_invariant as bi
from kernels import llm
from kernels.llm import serve
from kernels.llm.tokenizer import ByteTokenizer
from kernels.runtime import DEVICE, ON_GPU

PROMPT = "Tell me about Richard Feynman."
TOK = ByteTokenizer()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with llm.one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def tiny():
    return llm.load_model("tiny", device=DEVICE)


@pytest.fixture(scope="module")
def tiny_kernels():
    return llm.load_model("tiny", device=DEVICE, backend="kernels")


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64, device=DEVICE)


# --- the backends --------------------------------------------------------------------------


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "invariant"])
def test_kernels_backend_matches_torch_ops(tiny, tiny_kernels, invariant):
    tokens = _ids(TOK.encode("Feynman diagrams!"), TOK.encode("QED, the strange!"))  # (2, 17)
    with torch.no_grad():
        expected = tiny(tokens)  # torch's ops, outside the mode
        with bi.batch_invariant_mode() if invariant else contextlib.nullcontext():
            got = tiny_kernels(tokens)
    assert got.shape == expected.shape == (2, 17, 256)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # the same next token, up to a letter's twin ("A" for "a"): the twins tie to a rounding
    assert torch.equal(_fold_case(got.argmax(-1)), _fold_case(expected.argmax(-1)))


def _fold_case(ids):
    return torch.where((ids >= ord("A")) & (ids <= ord("Z")), ids + 32, ids)


def test_kernels_backend_prefill_and_decode_equal_its_full_pass(tiny_kernels):
    """Two rows at different positions of a cache of three, decoded in one step (slots)."""
    a, b = TOK.encode("Richard Feynman"), TOK.encode("Los Alamos")  # 15 and 10 tokens
    with torch.no_grad():
        full_a, full_b = tiny_kernels(_ids(a)), tiny_kernels(_ids(b))
        cache = tiny_kernels.new_cache(batch=3, length=20)
        tiny_kernels(_ids(a[:13]), cache, input_pos=0, slots=[2])
        tiny_kernels(_ids(b[:9]), cache, input_pos=0, slots=[0])
        step = tiny_kernels(_ids(a[13:14], b[9:10]), cache, input_pos=[13, 9], slots=[2, 0])
    torch.testing.assert_close(step[0, 0], full_a[0, 13], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step[1, 0], full_b[0, 9], rtol=1e-4, atol=1e-5)


def test_unknown_backend_and_bad_slots_are_refused(tiny):
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        llm.load_model("tiny", device="meta", backend="triton")
    cache = tiny.new_cache(batch=2, length=8)
    tokens = _ids([1, 2], [3, 4])
    with torch.no_grad():
        for slots in ([0, 0], [0, 2], [1]):
            with pytest.raises(ValueError, match="slots must be 2 distinct rows"):
                tiny(tokens, cache, input_pos=0, slots=slots)
        with pytest.raises(ValueError, match="one position for each of the 2 rows"):
            tiny(tokens, cache, input_pos=[0, 1, 2])
        with pytest.raises(ValueError, match="need a cache"):
            tiny(tokens, slots=[0, 1])


# --- the server ----------------------------------------------------------------------------


def _traffic(copies, fillers, seed):
    return serve.same_prompt_traffic(
        TOK.chat(PROMPT), copies, 5, fillers, spread=6, encode=TOK.chat, seed=seed
    )


def test_the_server_finishes_every_request_and_reuses_its_slots(tiny):
    requests = _traffic(copies=2, fillers=5, seed=1)  # 7 requests, 3 slots
    serve.serve(tiny, requests, max_batch=3)
    for r in requests:
        assert len(r.tokens) == len(r.logprobs) == r.max_new_tokens
        assert all(lp <= 0 for lp in r.logprobs)
    stopped = _traffic(copies=1, fillers=0, seed=1)
    first = list(requests[0].tokens)
    serve.serve(tiny, stopped, max_batch=1, stop_ids=(first[1],))  # stops after 2 tokens
    assert stopped[0].tokens == first[: first.index(first[1]) + 1]


def test_served_in_the_mode_the_same_request_gets_the_same_bits_whatever_the_traffic(tiny):
    """The copies of one prompt, alone and among other requests in batches of up to 3: the
    same tokens and log-probs, bit for bit, equal to the trainer's full pass and to generate."""
    with bi.batch_invariant_mode():
        alone = serve.serve(tiny, _traffic(copies=1, fillers=0, seed=0), max_batch=1)[0]
        crowded = serve.serve(tiny, _traffic(copies=3, fillers=3, seed=0), max_batch=3)[:3]
        for r in crowded:
            assert r.tokens == alone.tokens and r.logprobs == alone.logprobs
        assert serve.score(tiny, alone) == alone.logprobs  # sampler == trainer: KL exactly 0
        assert llm.generate(tiny, alone.prompt_ids, 5) == alone.tokens


@pytest.mark.skipif(ON_GPU or not torch.backends.mkl.is_available(), reason="CPU build with MKL")
def test_negative_control_torchs_default_kernels_give_different_answers():
    """The same traffic outside the mode: MKL's matmul rounds a row differently at batch sizes
    1, 2 and 4 (the padded sizes of a step) and the letter twins flip (the harness must be able
    to fail)."""
    model = llm.load_model("tiny", device="cpu")
    result = serve.run_experiment(
        model, TOK, PROMPT, 12, new_tokens=8, fillers=4, max_batch=4, spread=40, seed=0
    )
    assert result["distinct"] > 1 and result["first_divergence"] is not None
    assert len(result["texts"]) == 12 and result["most_common"][1] < 12


def test_a_request_that_would_overflow_the_cache_is_refused_before_any_work(tiny):
    requests = _traffic(copies=1, fillers=1, seed=0)
    need = len(requests[0].prompt_ids) + 5 - 1
    serve.serve(tiny, _traffic(copies=1, fillers=0, seed=0), max_batch=1, cache_length=need)
    with pytest.raises(ValueError, match="request 0 would overflow the KV cache"):
        serve.serve(tiny, requests, max_batch=2, cache_length=need - 1)
    assert requests[1].tokens == []  # nothing was served
    too_long = [serve.Request(TOK.encode("x" * 250), 10)]  # past the config's 256 positions
    with pytest.raises(ValueError, match="259 positions, the cache holds 256"):
        serve.serve(tiny, too_long, max_batch=1)
    with pytest.raises(ValueError, match="max_new_tokens >= 1"):
        serve.serve(tiny, [serve.Request([1, 2], 0)], max_batch=1)


def test_a_padded_decoding_step_gives_the_running_rows_their_unpadded_bits(tiny):
    """A step of 3 rows runs padded to 4 (the 4th row a free slot at position 0), through
    decode_rows over the whole cache; in the mode each running row gets the bits that the
    unpadded forward with slots gives it."""
    assert [serve.padded_batch(n, 6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    prompts = {3: TOK.encode("Feynman"), 1: TOK.encode("QED"), 0: TOK.encode("Los Alamos")}
    with bi.batch_invariant_mode(), torch.no_grad():
        cache = tiny.new_cache(batch=4, length=16)
        for slot, ids in prompts.items():
            tiny(_ids(ids[:-1]), cache, input_pos=0, slots=[slot])
        last = [ids[-1] for ids in prompts.values()]
        positions = [len(ids) - 1 for ids in prompts.values()]
        padded = serve.Decoder(tiny, cache, graphs=False)(last, positions, [3, 1, 0], [2])
        expected = tiny(_ids(*([t] for t in last)), cache, input_pos=positions, slots=[3, 1, 0])
    assert padded.shape == (3, 256) and torch.equal(padded, expected[:, -1])
    with pytest.raises(ValueError, match="decode_rows takes tokens"):
        tiny.decode_rows(_ids([1], [2]), cache, torch.tensor([0]), torch.tensor([0, 1]))
    if not ON_GPU:
        with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA GPU"):
            serve.Decoder(tiny, cache, graphs=True)


def test_first_divergence_and_distinct_completions():
    assert serve.first_divergence([[1, 2, 3], [1, 2, 4]]) == 2
    assert serve.first_divergence([[1, 2], [1, 2]]) is None
    assert serve.first_divergence([[1, 2], [1, 2, 3]]) == 2
    assert serve.distinct_completions([[1], [2], [1]]) == {(1,): 2, (2,): 1}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_on_the_gpu_the_mode_gives_one_answer_and_cublas_more(dtype):
    """Chapter 5's traffic at a tenth of its size: with cuBLAS and SDPA the copies disagree (in
    fp32: bf16 rounds the twins' 3e-7 apart to a tie), with batch_invariant_mode() (on either
    backend) they agree, bit for bit, and the CUDA graphs' answers are the eager steps'."""
    traffic = dict(copies=100, new_tokens=32, fillers=20, max_batch=64, spread=150)
    model = llm.load_model("tiny", dtype=dtype)
    default = serve.run_experiment(model, TOK, PROMPT, **traffic)
    if dtype == torch.float32:
        assert default["distinct"] > 1, "the negative control: torch's kernels should disagree"
    for backend in llm.BACKENDS:
        model.backend = backend
        with bi.batch_invariant_mode():
            result = serve.run_experiment(model, TOK, PROMPT, **traffic)
        assert result["distinct"] == 1 and result["first_divergence"] is None, backend
        logprobs = {tuple(r.logprobs) for r in result["requests"][: traffic["copies"]]}
        assert len(logprobs) == 1, backend
    with bi.batch_invariant_mode():  # the steps replayed from CUDA graphs, or run eagerly
        eager = serve.run_experiment(model, TOK, PROMPT, **traffic, graphs=False)
    assert eager["texts"] == result["texts"]
