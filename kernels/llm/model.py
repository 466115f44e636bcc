"""A llama in plain PyTorch (gpt-fast style): RMSNorm, rotary, grouped-query attention,
SwiGLU MLP, tied head, and a static KV cache.

Shapes: B batch, S new positions, T cache length, D d_model, H query heads, Hkv key/value
heads, hd head_dim, F d_ff, V vocab.

`forward(tokens)` is the full-sequence causal pass. `forward(tokens, cache, input_pos)` writes
the new keys and values at positions input_pos[b] .. input_pos[b] + S - 1 of each row's cache
and attends over the whole static cache with a mask: every step has the same shapes (what CUDA
graphs need), and rows may sit at different positions (what a dynamic-batching server needs).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.llm.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """(hd/2,) fp32 frequencies f_i = base^(-2i/hd): pair i turns by p * f_i at position p."""
    hd = config.head_dim
    return 1.0 / config.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)


class KVCache:
    """Keys and values of every layer for B sequences of up to T positions."""

    def __init__(self, config: ModelConfig, batch: int, length: int, dtype, device):
        shape = (config.n_layers, batch, config.n_kv_heads, length, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, T, hd)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.length = batch, length


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., D), the statistics in fp32 whatever x's dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary(x, cos, sin):
    """x (B, nh, S, hd) rotated by position: dimension i pairs with i + hd/2 (rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, S, hd/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
        self.w_gate = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_up = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.w_down = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x, cos, sin, kv=None, pos=None, mask=None):
        c = self.c
        B, S, _ = x.shape
        h = self.attn_norm(x)  # (B, S, D)
        q = self.wq(h).view(B, S, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = self.wk(h).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        v = self.wv(h).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if kv is None:  # full sequence: causal over the S positions given
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_cache, v_cache = kv  # (B, Hkv, T, hd) views of this layer's cache
            rows = torch.arange(B, device=x.device)[:, None]  # (B, 1)
            # advanced indices around a slice put their dims first: (B, S, Hkv, hd)
            k_cache[rows, :, pos] = k.transpose(1, 2)
            v_cache[rows, :, pos] = v.transpose(1, 2)
            y = F.scaled_dot_product_attention(
                q, k_cache, v_cache, attn_mask=mask, enable_gqa=True
            )  # (B, H, S, hd), over all T positions, the later ones masked
        y = y.transpose(1, 2).reshape(B, S, c.n_heads * c.head_dim)  # (B, S, H * hd)
        x = x + self.wo(y)
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))  # (B, S, D), SwiGLU


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        if not config.tied_embeddings:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)

    def new_cache(self, batch: int = 1, length: int | None = None) -> KVCache:
        """An empty static cache for `batch` sequences of up to `length` positions."""
        length = length or self.config.max_seq_len
        return KVCache(
            self.config, batch, length, self.embed.weight.dtype, self.embed.weight.device
        )

    def forward(self, tokens, cache: KVCache | None = None, input_pos=None):
        """tokens (B, S) int64 -> logits (B, S, V). With a cache, input_pos (an int, or a (B,)
        tensor: each row's first new position) says where the S new tokens go."""
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"tokens must be a (B, S) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        B, S = tokens.shape
        device = tokens.device
        if cache is None:
            if input_pos is not None:
                raise ValueError("input_pos needs a cache")
            pos = torch.arange(S, device=device).expand(B, S)  # (B, S)
        else:
            input_pos = 0 if input_pos is None else input_pos
            if isinstance(input_pos, int):  # one position for every row: checked on the host
                first, last = input_pos, input_pos + S
                start = torch.full((B,), input_pos, device=device)  # (B,)
            else:  # a (B,) tensor: the check reads it back, one host sync a step
                start = input_pos.to(device)
                first, last = (int(start.min()), int(start.max()) + S) if start.numel() else (0, 0)
            if B != cache.batch or start.shape != (B,):
                raise ValueError(
                    f"a batch of {B} rows with input_pos of shape {tuple(start.shape)} "
                    f"for a cache of {cache.batch} rows"
                )
            if first < 0 or last > cache.length:
                raise ValueError(
                    f"the request would overflow the KV cache: positions up to {last - 1} "
                    f"for a cache of {cache.length} (make a longer one with new_cache)"
                )
            pos = start[:, None] + torch.arange(S, device=device)  # (B, S)
            keys = torch.arange(cache.length, device=device)  # (T,)
            mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, S, T)

        freqs = pos[..., None].float() * self.inv_freq  # (B, S, hd/2)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, S, hd)
        dtype = self.embed.weight.dtype
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)

        x = self.embed(tokens)  # (B, S, D)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, cos, sin)
            else:
                x = layer(x, cos, sin, (cache.k[i], cache.v[i]), pos, mask)
        x = self.norm(x)
        head = self.embed.weight if self.config.tied_embeddings else self.head.weight
        return F.linear(x, head)  # (B, S, V)
