"""The model's shape as a dataclass, and the course's three named shapes.

"smollm2-135m" is the real model (its weights come from the GGUF file, whose metadata must
agree with this entry); "tiny" and "llama-1b-shape" get random weights from a seed.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    n_layers: int
    d_model: int
    d_ff: int  # the SwiGLU MLP's hidden width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads: n_heads // n_kv_heads query heads share each (GQA)
    head_dim: int
    rope_base: float
    norm_eps: float
    tied_embeddings: bool = True  # the output head is the embedding matrix
    max_seq_len: int = 2048  # the longest cache `new_cache` makes by default
    # Random weights, untied head only: each upper-case ASCII letter's output row is its
    # lower-case twin's plus a random vector of this relative length (3e-7: a few fp32
    # roundings), so the twins' logits nearly tie and a change of rounding can flip greedy
    # decoding (Chapter 5); the other tokens' rows are halved, so that letters win most steps.
    twin_gap: float = 0.0

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"rotary needs an even head_dim, got {self.head_dim}")

    def n_params(self) -> int:
        """Parameters of the model this config builds (the tied head counted once)."""
        d, hd = self.d_model, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2  # wq, wo; wk, wv
        mlp = 3 * d * self.d_ff  # gate, up, down
        layer = attn + mlp + 2 * d  # two RMSNorm weights
        head = 0 if self.tied_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * layer + d + head


CONFIGS = {
    # Small enough for Triton's interpreter: a byte vocabulary, two layers, GQA with 2 groups;
    # its own head (untied), whose letter twins sit on the fence (Chapter 5's experiment).
    "tiny": ModelConfig(
        vocab_size=256, n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
        head_dim=16, rope_base=10000.0, norm_eps=1e-5, tied_embeddings=False,
        max_seq_len=256, twin_gap=3e-7,
    ),
    # SmolLM2-135M-Instruct; norm_eps is the file's float32 1e-5 read back as a double.
    "smollm2-135m": ModelConfig(
        vocab_size=49152, n_layers=30, d_model=576, d_ff=1536, n_heads=9, n_kv_heads=3,
        head_dim=64, rope_base=100000.0, norm_eps=9.999999747378752e-06, max_seq_len=8192,
    ),
    # Llama-3.2-1B's shape (1.24 B parameters, 2.5 GB in bf16): decode is bandwidth-bound.
    "llama-1b-shape": ModelConfig(
        vocab_size=128256, n_layers=16, d_model=2048, d_ff=8192, n_heads=32, n_kv_heads=8,
        head_dim=64, rope_base=500000.0, norm_eps=1e-5, max_seq_len=8192,
    ),
}  # fmt: skip


def get_config(config) -> ModelConfig:
    """A ModelConfig, or the name of one in CONFIGS."""
    if isinstance(config, ModelConfig):
        return config
    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}; the named configs are {sorted(CONFIGS)}")
    return CONFIGS[config]
