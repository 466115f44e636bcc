"""Decoding: one prefill of the prompt, then one token a step from a static KV cache."""

import contextlib

import torch


@contextlib.contextmanager
def one_cpu_thread():
    """On a CPU, run torch on one thread for the duration. On a busy 2-core machine two OpenMP
    threads were 10-50x slower than one (each spins waiting for the other); a 135M model at
    batch 1 gains little from a second thread anyway. No effect on a GPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def generate(
    model, prompt_ids, max_new_tokens, temperature=0.0, seed=None, stop_ids=(), progress=False
) -> list[int]:
    """The new token ids after `prompt_ids` (a list of ints): greedy when temperature is 0,
    else sampled from softmax(logits / temperature), reproducibly when `seed` is given.
    Stops early after a token in `stop_ids` (which is returned); `progress` shows a bar."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: the model needs at least one token to continue")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = model.embed.weight.device
    threads = one_cpu_thread() if device.type == "cpu" else contextlib.nullcontext()
    generator = None
    if temperature > 0 and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)

    def pick(logits):  # (V,) -> the next token id
        if temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    with threads:
        cache = model.new_cache(batch=1, length=len(prompt_ids) + max_new_tokens)
        tokens = torch.tensor([prompt_ids], dtype=torch.int64, device=device)  # (1, S)
        logits = model(tokens, cache, input_pos=0)  # prefill: (1, S, V)
        out, pos = [], len(prompt_ids)
        steps = range(max_new_tokens)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="tokens", leave=False)
        for _ in steps:
            out.append(pick(logits[0, -1]))
            if out[-1] in stop_ids or len(out) == max_new_tokens:
                break
            tokens = torch.tensor([[out[-1]]], dtype=torch.int64, device=device)  # (1, 1)
            logits = model(tokens, cache, input_pos=pos)  # decode: (1, 1, V)
            pos += 1
    return out
