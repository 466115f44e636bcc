"""A tiny transformer language model over characters, made from a seed (nothing downloaded,
nothing stored): the model the chapter serves to show nondeterminism and its cure.

Plain PyTorch: token + position embeddings, pre-norm blocks (RMSNorm written with
`mean`, attention, GELU MLP), a final RMSNorm and an output layer. Inside
`batch_invariant_mode()` its matmuls, means and softmaxes run on the batch-invariant kernels
and its attention calls `kernels.batch_invariant.attention`; outside, it runs on torch's own
kernels and `scaled_dot_product_attention`.

Its weights are random, so its text is gibberish, and it is built to sit on the fence the
way a real LLM does between near-synonyms: every lower-case letter has an upper-case twin
whose output row differs by a tiny random vector (`twin_gap` relative to the row), so the two
logits differ by about a rounding error, while the twins' input embeddings are unrelated.
When the rounding of the forward pass changes, greedy decoding may pick the other twin, and
from there the continuation is different.
"""

import math
import string
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import batch_invariant
from kernels.runtime import DEVICE, pick

VOCAB = " .,!?'" + string.ascii_lowercase + string.ascii_uppercase
TWINS = {c: c.upper() for c in string.ascii_lowercase}


@dataclass(frozen=True)
class TinyConfig:
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 2
    d_ff: int = 64
    max_len: int = 64
    twin_gap: float = 3e-7  # |output row of a twin - its pair's| / |row|: about 2 fp32 ulps
    seed: int = 0


CONFIG = pick(
    cpu=TinyConfig(),
    gpu=TinyConfig(d_model=256, n_heads=4, n_layers=4, d_ff=1024, max_len=128),
)


def encode(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def decode(tokens) -> str:
    return "".join(VOCAB[t] for t in tokens)


class KVCache:
    """Keys and values of every layer for `slots` sequences of up to max_len positions."""

    def __init__(self, config: TinyConfig, slots: int, device=DEVICE, dtype=torch.float32):
        head_dim = config.d_model // config.n_heads
        shape = (config.n_layers, slots, config.n_heads, config.max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def write(self, layer, slots, starts, k, v):
        """k, v (B, H, S, hd) of new positions starts[b] .. starts[b] + S - 1."""
        S = k.shape[2]
        if S == 1:  # decoding: one position per sequence, in one indexed copy
            slot_idx = torch.tensor(slots, device=k.device)
            pos_idx = torch.tensor(starts, device=k.device)
            self.k[layer, slot_idx, :, pos_idx] = k[:, :, 0]
            self.v[layer, slot_idx, :, pos_idx] = v[:, :, 0]
            return
        for b, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            self.k[layer, slot, :, start : start + S] = k[b]
            self.v[layer, slot, :, start : start + S] = v[b]

    def read(self, layer, slots, length):
        """(B, H, length, hd) keys and values of `slots`, padded with whatever the slot held."""
        slot_idx = torch.tensor(slots, device=self.k.device)
        return self.k[layer, slot_idx, :, :length], self.v[layer, slot_idx, :, :length]


class TinyLM:
    def __init__(self, config: TinyConfig = CONFIG, device=DEVICE):
        self.config = c = config
        gen = torch.Generator().manual_seed(c.seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen) * scale).to(device)

        d, V = c.d_model, len(VOCAB)
        self.tok_emb = randn(V, d)
        self.pos_emb = randn(c.max_len, d, scale=0.5)
        self.layers = [
            dict(
                norm1=1 + randn(d, scale=0.1),
                w_qkv=randn(3 * d, d, scale=1 / math.sqrt(d)),
                b_qkv=randn(3 * d, scale=0.1),
                w_out=randn(d, d, scale=1 / math.sqrt(d)),
                b_out=randn(d, scale=0.1),
                norm2=1 + randn(d, scale=0.1),
                w_up=randn(c.d_ff, d, scale=1 / math.sqrt(d)),
                b_up=randn(c.d_ff, scale=0.1),
                w_down=randn(d, c.d_ff, scale=1 / math.sqrt(c.d_ff)),
                b_down=randn(d, scale=0.1),
            )
            for _ in range(c.n_layers)
        ]
        self.norm_f = 1 + randn(d, scale=0.1)
        out = randn(V, d, scale=2 / math.sqrt(d))
        for lower, upper in TWINS.items():  # the twins: the same row up to a tiny random vector
            row = out[VOCAB.index(lower)]
            nudge = randn(d)
            out[VOCAB.index(upper)] = row + nudge * (c.twin_gap * row.norm() / nudge.norm())
        self.w_vocab = out

    def forward(self, tokens, cache: KVCache, slots, starts):
        """Logits (B, S, V) for tokens (B, S) at positions starts[b] .. starts[b] + S - 1 of the
        sequences held in cache `slots`; their keys and values go into the cache first."""
        c = self.config
        B, S = tokens.shape
        H, hd = c.n_heads, c.d_model // c.n_heads
        positions = torch.tensor(starts, device=tokens.device)[:, None] + torch.arange(
            S, device=tokens.device
        )
        kv_lens = [start + S for start in starts]
        x = self.tok_emb[tokens] + self.pos_emb[positions]  # (B, S, d)
        for i, layer in enumerate(self.layers):
            qkv = F.linear(rms_norm(x, layer["norm1"]), layer["w_qkv"], layer["b_qkv"])
            q, k, v = qkv.view(B, S, 3, H, hd).permute(2, 0, 3, 1, 4)  # 3 x (B, H, S, hd)
            cache.write(i, slots, starts, k, v)  # the KV cache is updated before attention
            keys, values = cache.read(i, slots, max(kv_lens))  # (B, H, L, hd), padded
            a = attend(q, keys, values, kv_lens)  # (B, H, S, hd)
            a = a.transpose(1, 2).reshape(B, S, c.d_model)
            x = x + F.linear(a, layer["w_out"], layer["b_out"])
            h = F.gelu(F.linear(rms_norm(x, layer["norm2"]), layer["w_up"], layer["b_up"]))
            x = x + F.linear(h, layer["w_down"], layer["b_down"])
        return F.linear(rms_norm(x, self.norm_f), self.w_vocab)


def rms_norm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attend(q, k, v, kv_lens):
    """Causal attention of q (B, H, S, hd) over the first kv_lens[b] keys of k, v (B, H, L, hd):
    the batch-invariant kernel inside `batch_invariant_mode()`, torch's SDPA otherwise."""
    if batch_invariant.enabled():
        return batch_invariant.attention(q, k, v, causal=True, kv_lens=kv_lens)
    return sdpa_attention(q, k, v, causal=True, kv_lens=kv_lens)


def sdpa_attention(q, k, v, causal=False, kv_lens=None):
    """torch's scaled_dot_product_attention behind the interface of the invariant attention:
    the padding (kv_lens) and causal alignment become a boolean mask."""
    B, S, L = q.shape[0], q.shape[2], k.shape[2]
    lens = torch.tensor([L] * B if kv_lens is None else list(kv_lens), device=q.device)
    lens = lens[:, None, None]  # (B, 1, 1)
    key_pos = torch.arange(L, device=q.device)[None, None, :]
    visible = key_pos < lens  # (B, 1, L)
    if causal:
        query_pos = lens - S + torch.arange(S, device=q.device)[None, :, None]  # (B, S, 1)
        visible = visible & (key_pos <= query_pos)  # (B, S, L)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None])
