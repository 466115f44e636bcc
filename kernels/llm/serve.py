"""A dynamic-batching server for kernels.llm's model, and the Thinking Machines experiment: send
the same prompt many times among other traffic, count the distinct answers.

The server works like a real one, in miniature: requests arrive over time; the requests that
arrive at one step are prefilled together (one batch per prompt length) into free rows (slots)
of one static KV cache and join the running batch; every step decodes one token for every
running request together, in one batch (each row's position goes to the model, and each row's
KV length to attention as `kv_lens`); a request leaves when it has its tokens, and its slot
serves the next one. So a request's tokens are computed in batches whose size and company
change from step to step and from run to run. Decoding is greedy: the same prompt "should"
always give the same answer.

As in production servers, a decoding step is padded to the next of a few batch sizes (powers
of two up to max_batch; the padding rows write into free slots, which a later prefill
overwrites), and on a GPU each size's step is captured once in a CUDA graph and replayed: the
decode steps pay no launch overhead, on torch's kernels as in batch_invariant_mode.

    with batch_invariant_mode():        # or not: torch's default kernels
        result = run_experiment(model, tokenizer, "Tell me about Richard Feynman.", copies=...)
"""

import random
import time
from dataclasses import dataclass, field

import torch

from kernels.llm.speed import capture

FILLER_WORDS = "the a of and to in is on it as at by or be an we so he if no up my do go".split()


@dataclass
class Request:
    prompt_ids: list  # the prompt's token ids
    max_new_tokens: int
    arrival: int = 0  # the decoding step at which it arrives
    tokens: list = field(default_factory=list)  # the answer's token ids
    logprobs: list = field(default_factory=list)  # log p of each answer token, as sampled


@torch.no_grad()
def serve(
    model, requests, max_batch, cache_length=None, stop_ids=(), progress=False, graphs=None
) -> list:  # fmt: skip
    """Run every request to completion, at most `max_batch` at a time; fills in `tokens` and
    `logprobs` (a request stops after max_new_tokens or a token in `stop_ids`). The static
    cache has max_batch rows of `cache_length` positions (default: the longest request's).
    `graphs`: replay each padded batch size's decoding step from a CUDA graph (default: on a
    GPU). Returns `requests`. A request that would overflow the cache is refused before any
    work (so no position a step writes is ever out of the cache: nothing is checked on the GPU)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    needs = [_positions_needed(i, r) for i, r in enumerate(requests)]
    limit = model.config.max_seq_len if cache_length is None else cache_length
    length = max(needs, default=1) if cache_length is None else cache_length
    for i, (need, r) in enumerate(zip(needs, requests, strict=True)):
        if need > limit:
            raise ValueError(
                f"request {i} would overflow the KV cache: {len(r.prompt_ids)} prompt tokens + "
                f"{r.max_new_tokens} new need {need} positions, the cache holds {limit}"
            )
    device = model.embed.weight.device
    cache = model.new_cache(batch=max_batch, length=length)
    decoder = Decoder(model, cache, device.type == "cuda" if graphs is None else graphs)
    free_slots = list(range(max_batch))
    waiting = sorted(requests, key=lambda r: r.arrival)  # stable: ties keep their order
    running = []  # (request, slot)
    bar = _progress_bar(sum(r.max_new_tokens for r in requests), progress)
    step = 0
    while waiting or running:
        admitted = []
        while waiting and waiting[0].arrival <= step and free_slots:
            admitted.append((waiting.pop(0), free_slots.pop(0)))
        for group in _by_prompt_length(admitted):  # prefill: one batch per prompt length
            prompts = torch.tensor([r.prompt_ids for r, _ in group], device=device)  # (n, S)
            logits = model(prompts, cache, input_pos=0, slots=[s for _, s in group])[:, -1]
            _sample([r for r, _ in group], logits, bar)
        running += admitted
        for request, slot in [(r, s) for r, s in running if _done(r, stop_ids)]:
            running.remove((request, slot))  # done: its slot is free for the next request
            free_slots.append(slot)
            bar.update(request.max_new_tokens - len(request.tokens))  # stopped early
        if running:  # one decoding step for everyone running, in one padded batch
            positions = [len(r.prompt_ids) + len(r.tokens) - 1 for r, _ in running]
            logits = decoder(
                [r.tokens[-1] for r, _ in running], positions, [s for _, s in running], free_slots
            )
            _sample([r for r, _ in running], logits, bar)
        step += 1
    bar.close()
    return requests


def _by_prompt_length(admitted) -> list:
    groups = {}
    for request, slot in admitted:
        groups.setdefault(len(request.prompt_ids), []).append((request, slot))
    return list(groups.values())


def padded_batch(n: int, max_batch: int) -> int:
    """The batch size a step of n running rows is padded to: the next power of two, at most
    max_batch (so 1, 2, 4, ..., max_batch: a handful of shapes, each captured once)."""
    return min(max_batch, 1 << (n - 1).bit_length())


class Decoder:
    """decoder(tokens, positions, slots, free_slots) -> (n, V) logits: one decoding step for n
    running rows (token, position and cache slot each), padded to padded_batch(n) rows with
    free slots at position 0, through model.decode_rows. With graphs, each padded size is
    captured in a CUDA graph on first use (its inputs copied into fixed buffers before each
    replay); without, it runs eagerly, padded the same way."""

    def __init__(self, model, cache, graphs: bool):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = model.embed.weight.device
        if graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA GPU, it is on {self.device}")
        self.steps = {}  # padded size -> (inputs (tokens, positions, slots), replay, logits)

    def __call__(self, tokens, positions, slots, free_slots) -> torch.Tensor:
        n = len(tokens)
        size = padded_batch(n, self.cache.batch)
        pad = size - n
        values = (
            [[t] for t in tokens] + [[0]] * pad,  # (size, 1)
            list(positions) + [0] * pad,
            list(slots) + list(free_slots[:pad]),
        )
        if not self.graphs:
            return self._step(self._tensors(values))()[:n, -1]
        if size not in self.steps:
            inputs = self._tensors(values)
            # the warm-up runs compute this very step (writing the same keys at the same
            # positions), and the replay below computes it once more: the same values
            self.steps[size] = (inputs, *capture(self._step(inputs)))
        inputs, replay, logits = self.steps[size]
        for buffer, v in zip(inputs, values, strict=True):
            buffer.copy_(torch.tensor(v, dtype=torch.int64), non_blocking=False)
        replay()
        return logits[:n, -1]

    def _tensors(self, values):
        return [torch.tensor(v, dtype=torch.int64, device=self.device) for v in values]

    def _step(self, inputs):
        tokens, positions, slots = inputs
        return lambda: self.model.decode_rows(tokens, self.cache, positions, slots)


def _positions_needed(i, request) -> int:
    if not request.prompt_ids or request.max_new_tokens < 1:
        raise ValueError(
            f"request {i} needs a prompt and max_new_tokens >= 1, got "
            f"{len(request.prompt_ids)} tokens and {request.max_new_tokens}"
        )
    # the last token is sampled but never fed back: it needs no position of its own
    return len(request.prompt_ids) + request.max_new_tokens - 1


def _done(request, stop_ids) -> bool:
    return len(request.tokens) >= request.max_new_tokens or request.tokens[-1] in stop_ids


def _sample(requests, logits, bar):
    """Greedy: each request gets its most likely token (the first of equals) and its log p."""
    tokens = torch.argmax(logits, dim=-1)  # (B,)
    # log p in fp32, as an RL trainer keeps them: in bf16 they would round away the small
    # differences that the sampler-vs-trainer check is there to see
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    for request, token, logprob in zip(requests, tokens.tolist(), chosen.tolist(), strict=True):
        request.tokens.append(token)
        request.logprobs.append(logprob)
    bar.update(len(requests))


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total, progress):
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="tokens served", leave=False)


def score(model, request: Request) -> list:
    """The log-probabilities of the request's answer tokens as a trainer computes them: one
    forward pass over the whole sequence (prompt and answer), alone, with no cache."""
    prompt, answer = request.prompt_ids, request.tokens
    sequence = torch.tensor([prompt + answer[:-1]], device=model.embed.weight.device)
    with torch.no_grad():
        logits = model(sequence)[0, len(prompt) - 1 :]  # (answer, V)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # fp32, as the sampler's
    return logprobs.gather(1, torch.tensor(answer, device=logits.device)[:, None])[:, 0].tolist()


def same_prompt_traffic(prompt_ids, copies, new_tokens, fillers, spread, encode, seed=0) -> list:
    """`copies` requests for `prompt_ids` and `fillers` requests of random words (made into ids
    by `encode`) and random lengths, arriving at random steps in [0, spread): a crowd at first,
    thinning out (step = spread * u**2), so that the copies land in batches of every size from
    full down to one, in different company. The copies come first in the list."""
    rng = random.Random(seed)

    def arrival():
        return int(spread * rng.random() ** 2)

    requests = [Request(list(prompt_ids), new_tokens, arrival()) for _ in range(copies)]
    for _ in range(fillers):
        words = " ".join(rng.choice(FILLER_WORDS) for _ in range(rng.randint(1, 4)))
        requests.append(Request(encode(words), rng.randint(2, 2 * new_tokens), arrival()))
    return requests


def distinct_completions(completions) -> dict:
    """{completion: count}, most common first (completions: token id lists or texts)."""
    counts = {}
    for c in completions:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def first_divergence(completions) -> int | None:
    """The index of the first token where the completions are not all equal (None if equal)."""
    for i, column in enumerate(zip(*completions, strict=False)):  # up to the shortest
        if len(set(column)) > 1:
            return i
    lengths = {len(c) for c in completions}
    return None if len(lengths) <= 1 else min(lengths)


@torch.no_grad()
def run_experiment(
    model, tokenizer, prompt, copies, new_tokens, fillers, max_batch, spread, seed=0,
    progress=False, graphs=None,
):  # fmt: skip
    """Serve `copies` greedy completions of the chat prompt `prompt` among `fillers` other
    requests (seeded traffic) and summarize the copies' answers, with the wall time."""
    stop = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    traffic = same_prompt_traffic(
        tokenizer.chat(prompt), copies, new_tokens, fillers, spread, tokenizer.chat, seed
    )
    if model.embed.weight.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    serve(model, traffic, max_batch, stop_ids=stop, progress=progress, graphs=graphs)
    if model.embed.weight.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    answers = [r.tokens for r in traffic[:copies]]
    counts = distinct_completions(answers)
    common, count = next(iter(counts.items()))
    return {
        "copies": copies,
        "distinct": len(counts),
        "first_divergence": first_divergence(answers),
        "most_common": (tokenizer.decode(common), count),
        "texts": [tokenizer.decode(a) for a in answers],
        "seconds": seconds,
        "requests": traffic,
    }
