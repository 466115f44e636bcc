"""Tensor parallelism, Megatron style (Shoeybi et al., 2019): one layer's weights split across
ranks so that each rank reads only its share of them, with one all-reduce per layer half.

MLP, y = gelu(x @ w_up.T) @ w_down.T with w_up (F, D), w_down (D, F):
- w_up split by rows (column-parallel: each rank computes F/n of the hidden features, and
  gelu acts on each feature alone, so no communication is needed before it);
- w_down split by columns (row-parallel: each rank sums over its F/n features only, giving a
  partial (.., D) output);
- one all-reduce adds the n partial outputs.
Attention: the heads split across ranks (H/n query heads and Hkv/n key/value heads each, so a
query head keeps its grouped key/value head), then wo split by columns and one all-reduce.

Rank functions (for kernels.distributed.run_ranks) take (rank, world_size, ...) first.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.llm import load_model, speed
from kernels.llm.config import get_config
from kernels.llm.model import Transformer, rope_frequencies


def _check_split(what: str, size: int, world_size: int):
    if size % world_size:
        raise ValueError(f"{what}={size} does not split over {world_size} ranks")


def shard(w: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size of `w` along `dim` (a copy)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    _check_split(f"dim {dim} of size", w.shape[dim], world_size)
    return w.chunk(world_size, dim=dim)[rank].contiguous()


# --- MLP


def mlp_ref(x, w_up, w_down):
    """gelu(x @ w_up.T) @ w_down.T on one rank: x (.., D), w_up (F, D), w_down (D, F)."""
    return F.gelu(x @ w_up.T) @ w_down.T


def shard_mlp(w_up, w_down, rank: int, world_size: int):
    """(w_up rows, w_down columns) of rank `rank`: F/n hidden features each."""
    if w_up.dim() != 2 or w_down.dim() != 2 or w_up.shape[0] != w_down.shape[1]:
        raise ValueError(f"w_up (F, D) and w_down (D, F) expected, got {tuple(w_up.shape)} "
                         f"and {tuple(w_down.shape)}")  # fmt: skip
    return shard(w_up, 0, rank, world_size), shard(w_down, 1, rank, world_size)


def tp_mlp(x, w_up_shard, w_down_shard, matmul=torch.matmul):
    """This rank's share of the MLP, then the all-reduce that sums the shares: (.., D)."""
    partial = matmul(F.gelu(matmul(x, w_up_shard.T)), w_down_shard.T)  # (.., D), F/n terms
    dist.all_reduce(partial)  # + the other ranks' F/n terms
    return partial


# --- attention split by heads


def attention_ref(x, wq, wk, wv, wo, head_dim: int):
    """Causal grouped-query self-attention of x (B, S, D): wq (H*hd, D), wk and wv (Hkv*hd, D),
    wo (D, H*hd). Query head h reads key/value head h // (H // Hkv)."""
    B, S, _ = x.shape
    heads, kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    q = (x @ wq.T).view(B, S, heads, head_dim).transpose(1, 2)  # (B, H, S, hd)
    k = (x @ wk.T).view(B, S, kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
    v = (x @ wv.T).view(B, S, kv_heads, head_dim).transpose(1, 2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # (B, H, S, hd)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
    return y.transpose(1, 2).reshape(B, S, heads * head_dim) @ wo.T  # (B, S, D)


def shard_attention(wq, wk, wv, wo, head_dim: int, rank: int, world_size: int):
    """Rank `rank`'s heads: H/n query heads and the Hkv/n key/value heads they read."""
    heads, kv_heads = wq.shape[0] // head_dim, wk.shape[0] // head_dim
    _check_split("n_heads", heads, world_size)
    _check_split("n_kv_heads", kv_heads, world_size)
    return (shard(wq, 0, rank, world_size), shard(wk, 0, rank, world_size),
            shard(wv, 0, rank, world_size), shard(wo, 1, rank, world_size))  # fmt: skip


def tp_attention(x, wq_shard, wk_shard, wv_shard, wo_shard, head_dim: int):
    """This rank's heads of attention_ref, then the all-reduce over wo's partial sums."""
    partial = attention_ref(x, wq_shard, wk_shard, wv_shard, wo_shard, head_dim)
    dist.all_reduce(partial)
    return partial


def layer_rank(rank, world_size, x, mlp_weights, attention_weights, head_dim):
    """A rank function: [tp_mlp(x), tp_attention(x)] with this rank's shards."""
    up, down = shard_mlp(*mlp_weights, rank, world_size)
    attention = shard_attention(*attention_weights, head_dim, rank, world_size)
    return [tp_mlp(x, up, down), tp_attention(x, *attention, head_dim)]


# --- a whole model


SHARDED = {"wq": 0, "wk": 0, "wv": 0, "w_gate": 0, "w_up": 0, "wo": 1, "w_down": 1}


def shard_model(model: Transformer, rank: int, world_size: int) -> Transformer:
    """A copy of `model` holding rank `rank`'s heads and MLP features in every block, whose
    blocks all-reduce their attention and MLP outputs (Block.reduce). Embedding, norms and
    head stay whole on every rank."""
    c = model.config
    for what, size in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads), ("d_ff", c.d_ff)):
        _check_split(what, size, world_size)
    config = dataclasses.replace(c, n_heads=c.n_heads // world_size,
                                 n_kv_heads=c.n_kv_heads // world_size,
                                 d_ff=c.d_ff // world_size)  # fmt: skip
    state = {}
    for name, w in model.state_dict().items():
        dim = SHARDED.get(name.split(".")[-2]) if name.startswith("layers.") else None
        state[name] = w if dim is None else shard(w, dim, rank, world_size)
    with torch.device("meta"):
        sharded = Transformer(config, model.backend)
    sharded.load_state_dict(state, assign=True, strict=True)
    sharded.inv_freq = rope_frequencies(config).to(model.embed.weight.device)
    for block in sharded.layers:
        block.reduce = _all_reduce
    return sharded.eval()


def _all_reduce(partial):
    dist.all_reduce(partial)
    return partial


def logits_rank(rank, world_size, config, tokens, seed=0):
    """A rank function: the logits of a full pass of the random-weight `config` model, split
    over the world (the one-rank model when world_size is 1)."""
    model = load_model(config, device="cpu", seed=seed)
    if world_size > 1:
        model = shard_model(model, rank, world_size)
    with torch.no_grad():
        return model(tokens)


def decode_rank(rank, world_size, config, batch=1, context=512, prefill=2048, steps=50):
    """A rank function, on GPUs (NCCL): {"decode_ms", "tokens_per_s", "prefill_ms",
    "graph"} of the bf16 random-weight `config` model split over the world, a decode step
    replayed from a CUDA graph where capture works (eager otherwise, and "graph" False)."""
    device = torch.device("cuda", rank)
    model = load_model(config, dtype=torch.bfloat16, device=device)
    if world_size > 1:
        model = shard_model(model, rank, world_size)
    with torch.no_grad():
        step, _, _ = speed.decode_step(model, batch, context)
        try:
            replay, _ = speed.capture(step)
            graph = True
        except RuntimeError:  # a collective that cannot be captured: time it eagerly
            replay, graph = step, False
        decode_ms = speed.step_ms(replay, steps, device)
        tokens = torch.ones((1, prefill), dtype=torch.int64, device=device)
        prefill_ms = speed.step_ms(lambda: model(tokens), 5, device)
    return {"decode_ms": decode_ms, "tokens_per_s": 1e3 * batch / decode_ms,
            "prefill_ms": prefill_ms, "graph": graph}  # fmt: skip


def decode_bytes_per_rank(config, world_size: int, dtype_bytes: int = 2, context: int = 512):
    """Bytes one rank reads in a decode step at batch 1: its share of the layers' weights and
    of the KV cache, plus the whole head and the norms (kept on every rank)."""
    c = get_config(config)
    head = c.vocab_size * c.d_model * dtype_bytes
    norms = (2 * c.n_layers + 1) * c.d_model * dtype_bytes
    split = speed.step_bytes(c, dtype_bytes, context) - head - norms
    return head + norms + split / world_size
