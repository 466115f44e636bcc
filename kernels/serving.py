"""A small dynamic-batching server for `kernels.tiny_lm`, and the chapter's experiment: send
the same prompt many times among other traffic, count the distinct answers.

The server works like a real one, in miniature: requests arrive over time; a new request is
prefilled on its own and then joins the running batch; every step decodes one token for
every running request together, in one padded batch (each request's KV length is passed to
attention as `kv_lens`); a request leaves when it has its tokens. So a request's tokens are
computed in batches whose size and company change from step to step, and from run to run.
Decoding is greedy (temperature 0): the same prompt "should" always give the same answer.
"""

import random
import time
from dataclasses import dataclass, field

import torch

from kernels.runtime import DEVICE
from kernels.tiny_lm import KVCache, TinyLM, decode, encode

FILLER_WORDS = "the a of and to in is on it as at by or be an we so he if no up my do go".split()


@dataclass
class Request:
    prompt: str
    max_new_tokens: int
    arrival: int  # the decoding step at which it arrives
    tokens: list = field(default_factory=list)  # the answer's tokens
    logprobs: list = field(default_factory=list)  # log p of each answer token, as sampled

    @property
    def text(self) -> str:
        return decode(self.tokens)


def serve(model: TinyLM, requests: list, max_batch: int) -> list:
    """Run every request to completion; fills in `tokens` and `logprobs`. Returns requests."""
    too_long = [r for r in requests if len(r.prompt) + r.max_new_tokens > model.config.max_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests need more than max_len = "
                         f"{model.config.max_len} positions, e.g. {too_long[0]}")  # fmt: skip
    device = model.tok_emb.device
    cache = KVCache(model.config, max_batch, device=device)
    free_slots = list(range(max_batch))
    waiting = sorted(requests, key=lambda r: r.arrival)
    running = []  # (request, slot)
    step = 0
    while waiting or running:
        while waiting and waiting[0].arrival <= step and free_slots:  # admit and prefill
            request, slot = waiting.pop(0), free_slots.pop(0)
            prompt = torch.tensor([encode(request.prompt)], device=device)
            _sample([request], model.forward(prompt, cache, [slot], [0])[:, -1])
            running.append((request, slot))
        for request, slot in [(r, s) for r, s in running if len(r.tokens) >= r.max_new_tokens]:
            running.remove((request, slot))  # done: its slot is free for the next request
            free_slots.append(slot)
        if running:  # one decoding step for everyone running, in one padded batch
            tokens = torch.tensor([[r.tokens[-1]] for r, _ in running], device=device)
            starts = [len(r.prompt) + len(r.tokens) - 1 for r, _ in running]
            logits = model.forward(tokens, cache, [s for _, s in running], starts)[:, -1]
            _sample([r for r, _ in running], logits)
        step += 1
    return requests


def _sample(requests, logits):
    """Greedy: each request gets its most likely token (the first of equals) and its log p."""
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    tokens = torch.argmax(logprobs, dim=-1)  # (B,)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    for request, token, logprob in zip(requests, tokens.tolist(), chosen.tolist(), strict=True):
        request.tokens.append(token)
        request.logprobs.append(logprob)


def same_prompt_traffic(prompt, copies, new_tokens, fillers, spread, seed=0) -> list:
    """`copies` requests for `prompt` and `fillers` other requests of other lengths, arriving at
    random steps in [0, spread): a crowd at first, thinning out (step = spread * u**2), so that
    the copies land in batches of every size from full down to one, in different company."""
    rng = random.Random(seed)

    def arrival():
        return int(spread * rng.random() ** 2)

    requests = [Request(prompt, new_tokens, arrival()) for _ in range(copies)]
    for _ in range(fillers):
        words = " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(1, 4)))
        requests.append(Request(words, rng.randint(2, 2 * new_tokens), arrival()))
    return requests


def distinct_completions(texts) -> dict:
    """{completion: count}, most common first."""
    counts = {}
    for t in texts:
        counts[t] = counts.get(t, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def first_divergence(texts) -> int | None:
    """The index of the first token where the completions are not all equal (None if equal)."""
    for i, chars in enumerate(zip(*texts, strict=False)):  # up to the shortest
        if len(set(chars)) > 1:
            return i
    return None if len({len(t) for t in texts}) == 1 else min(len(t) for t in texts)


def score(model: TinyLM, request: Request) -> list:
    """The log-probabilities of the request's answer tokens as a trainer computes them: one
    forward pass over the whole sequence (prompt and answer), alone."""
    prompt, answer = encode(request.prompt), request.tokens
    sequence = torch.tensor([prompt + answer[:-1]], device=model.tok_emb.device)
    cache = KVCache(model.config, 1, device=model.tok_emb.device)
    logits = model.forward(sequence, cache, [0], [0])[0, len(prompt) - 1 :]  # (answer, V)
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(answer, device=logits.device)[:, None])[:, 0].tolist()


def run_experiment(model, prompt, copies, new_tokens, fillers, max_batch, spread, seed=0):
    """Serve the traffic once and summarize the copies' answers (plus the wall time)."""
    requests = same_prompt_traffic(prompt, copies, new_tokens, fillers, spread, seed)
    start = time.perf_counter()
    serve(model, requests, max_batch)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    texts = [r.text for r in requests[:copies]]
    return {
        "copies": copies,
        "distinct": len(distinct_completions(texts)),
        "first_divergence": first_divergence(texts),
        "most_common": next(iter(distinct_completions(texts).items())),
        "seconds": seconds,
        "requests": requests,
    }
