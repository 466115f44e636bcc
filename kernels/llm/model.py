"""A llama in plain PyTorch (gpt-fast style): RMSNorm, rotary, grouped-query attention,
SwiGLU MLP, tied head, and a static KV cache. Its matmuls, norms and attention run on torch's
ops or on the course's (`backend`, see kernels.llm.ops).

Shapes: B batch, S new positions, T cache length, D d_model, H query heads, Hkv key/value
heads, hd head_dim, F d_ff, V vocab.

`forward(tokens)` is the full-sequence causal pass. `forward(tokens, cache, input_pos)` writes
the new keys and values at positions input_pos[b] .. input_pos[b] + S - 1 of each row's cache.
With one int position for every row, keys are written and read as slices of the static cache
(positions 0 .. input_pos + S - 1, no mask, nothing read back to the host: a step at a given
position can be captured in a CUDA graph and replayed). With a position per row (a list or a
tensor), attention reads the cache with a mask: rows may sit at different positions (what a
dynamic-batching server needs).

The residual adds are fused into the norms that follow them (ops.add_rms_norm): a block hands
the next one its stream x and the delta it has not added yet (or, with Block.norm_in_epilogue,
the stream formed in its last GEMV's epilogue and its rows' sums of squares in pieces:
Squares, by which the next GEMV, its weight folded with the norm's, scales its product's rows).
"""

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels import batch_invariant, decode, gemv
from kernels.llm import ops
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

    def forward(self, x, backend="torch"):  # (..., D), the statistics in fp32
        return ops.rms_norm(x, self.weight, self.eps, backend)


def rotary_cos_sin(pos, inv_freq, dtype):
    """cos and sin (B, 1, S, hd) in `dtype` of the angles pos * f_i for positions pos (B, S):
    each frequency twice (pair i is dimensions i and i + hd/2), the angles in fp32."""
    freqs = pos[..., None].float() * inv_freq  # (B, S, hd/2)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, S, hd)
    return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rotary(x, cos, sin):
    """x (B, nh, S, hd) rotated by position: dimension i pairs with i + hd/2 (rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, S, hd/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def project(x, linear: nn.Linear, backend):
    """x @ linear.weight.T; an int8 weight carries its per-channel scale (kernels.llm.quant)."""
    return ops.linear(x, linear.weight, backend, getattr(linear, "scale", None))


def fused_weight(block: nn.Module, names: tuple[str, ...], half: int = 0, fold=None):
    """The weights (and int8 scales) of `names` stacked along their output rows: one GEMV
    reads them all (q, k and v; gate and up); `half` > 0: with rows i and i + half of every
    2 half rows side by side (decode.pair_halves: gate beside up for decode.swiglu_gemv, each
    head's rotary pairs for decode.rotary_gemv); `fold`: the weight of the norm before them
    folded into the columns (decode.fold_norm, for a GEMV that normalizes by sums of
    squares). Built on first use and kept on the block, rebuilt when a weight is replaced
    (kernels.llm.quant) or changed in place (load_state_dict: its version counter moves;
    tensors made under inference_mode have none)."""
    linears = [getattr(block, n) for n in names]
    key = tuple(
        (t.data_ptr(), t.dtype, 0 if t.is_inference() else t._version)
        for t in [lin.weight for lin in linears] + [fold]
        if t is not None
    )
    kept = block.__dict__.setdefault("_fused", {})
    which = (names, half, fold is not None)
    if kept.get(which, (None,))[0] != key:
        stack = lambda *ts: decode.pair_halves(torch.cat(ts), half) if half else torch.cat(ts)
        weight = stack(*[lin.weight.detach() for lin in linears])
        scales = [getattr(lin, "scale", None) for lin in linears]
        scale = None if scales[0] is None else stack(*scales)
        if fold is not None:
            weight, scale = decode.fold_norm(weight, fold.detach(), scale)
        kept[which] = (key, weight, scale)
    return kept[which][1:]


def fused_project(x, block, names):
    weight, scale = fused_weight(block, names)
    return ops.linear(x, weight, "kernels", scale)


class Squares(NamedTuple):
    """Passed where the residual's delta would be: the residual add was formed in the epilogue
    of the GEMV before (decode.linear_add), so x is the whole stream, and `squares` holds its
    rows' sums of squares in pieces (B * S, pieces), by which the GEMV after the norm, its
    weight folded with the norm's, scales its product's rows (decode.check_norm's `norm`)."""

    squares: torch.Tensor


class Block(nn.Module):
    # The course's backend: a decoding step's norms inside the GEMVs after them; SwiGLU's
    # product inside the down GEMV. Both save launches and both lost, measured on an H100
    # (80GB HBM3, torch 2.11, triton 3.6, 2026-12-06; batch 1 at 512 positions, CUDA graph,
    # dependent launch): SmolLM2's shapes 0.746 ms a step with neither, 0.808 with the norms in
    # the GEMVs, 0.871 with SwiGLU in the down GEMV; the llama-1b shape 1.229 ms against 1.439
    # with the norms in. Each of a GEMV's programs redoes the work of the kernel it replaces,
    # on its own critical path, where dependent launch had already hidden most of that
    # kernel's launch. Off, kept to be measured again (the fused path's test runs both).
    norm_in_gemv = False
    swiglu_in_gemv = False
    # SwiGLU's product in the gate-and-up GEMV's epilogue (decode.swiglu_gemv: gate and up rows
    # interleaved, so a tile holds both; nothing recomputed): on. The same logits, bit for bit,
    # one kernel fewer a layer. Three runs on H100s (same versions, 2026-12-06/07), epilogue
    # against silu_mul: SmolLM2's shapes 0.712-0.716 ms against 0.728-0.764 (3 rounds), 0.686
    # against 0.748, 0.714 against 0.721: faster in every run; the llama-1b shape 1.263 against
    # 1.292, 1.274 against 1.229, 1.265 against 1.215: faster once, 4% slower twice, where the
    # silu_mul path alone spread over 6% between processes (both paths share one tuned plan in
    # a process: the tuner's key has no activation). With every other fusion on, `bench decode`
    # on an H100 (the same versions, 2026-12-07, speed.fusion_ladder): SmolLM2's shapes 0.583
    # ms against 0.630 with silu_mul, the llama-1b shape 1.218 against 1.187, slower a third
    # time. On for the chapter's model; the 1B shape's loss not explained. Where it is on, the
    # MLP's norm is not inside the gate-and-up GEMV, whatever norm_in_gemv says
    # (norm_in_epilogue may put it in wo's).
    swiglu_in_epilogue = True
    # Rotary, and the new keys and values written into the cache, in the q/k/v GEMV's epilogue
    # (decode.rotary_gemv: each head's rows i and i + hd/2 side by side, so a tile holds both
    # members of every rotary pair; nothing recomputed), for a decoding step's rows of one
    # token each: the rotary_kv launch removed, one kernel fewer a layer again. On: the same
    # logits, bit for bit, and on an H100 (torch 2.11, triton 3.6, 2026-12-07; a step at T=512
    # in a CUDA graph, three interleaved rounds) SmolLM2's shapes took 0.691-0.695 ms against
    # 0.713-0.721 with rotary_kv; the llama-1b shape 1.258-1.259 against 1.256-1.272, the same.
    # Where it is on, the attention's norm runs in its own kernel, whatever norm_in_gemv says.
    rotary_in_epilogue = True
    # The residual add and RMSNorm after wo and after w_down split between two GEMVs, for a
    # decoding step's rows: the one before adds the residual in its epilogue and stores each
    # column tile's sum of squares of its part of the row (decode.linear_add); the one after
    # (the MLP's gate and up, or the next block's q/k/v) reads a weight with the norm's weight
    # folded into its columns (decode.fold_norm), loads its input as it is and scales each row
    # of its product by the row's 1 / rms, from the row's few pieces (`norm`). Both add_rms_norm
    # launches of a layer removed, nothing recomputed, no program waiting for another; the final
    # norm stays a kernel (a head folded with it would copy the tied embedding). A first
    # version, the whole norm done by the last column tile of a row to finish (an arrival
    # counter), was slower than the norm's own kernel on an H100 (torch 2.11, triton 3.6,
    # 2026-12-07; a step in a CUDA graph): SmolLM2's shapes 0.717-0.718 ms against 0.691-0.695,
    # the llama-1b shape 1.322-1.323 against 1.258-1.259. The second, which normalized each tile
    # of its input as it loaded it (its weight not folded), lost too (H100, the same versions,
    # 2026-12-07, two rounds): SmolLM2's shapes 0.706-0.709 ms against 0.654-0.681, the llama-1b
    # shape 2.268-2.271 against 1.224-1.226. Timed alone at SmolLM2's shapes, that GEMV took
    # 4.31-4.33 us where the plain one took 2.73-2.79 (the norm kernel it replaces, 1.26-1.30):
    # hence the folded weight, which leaves the plain GEMV's loop. At the 1B shape's w_down
    # (2048 x 8192) linear_add took 42.0 us against the GEMV's 10.8: the plain plan's nine
    # pieces of K were too many to sum in the kernel, so it ran in one piece, 16 programs for 32
    # MB; now in eight. This one, the third, is on: on an H100 (the same versions, 2026-12-07,
    # three interleaved rounds of 300 steps) SmolLM2's shapes took 0.604-0.615 ms a step against
    # 0.666-0.683 with the norms' kernels, and the llama-1b shape 1.226-1.231 against
    # 1.228-1.229, the same; alone, the GEMV after took 3.53-3.54 us where the plain one took
    # 3.02-3.32; in `bench decode` on an H100 (2026-12-07) SmolLM2's step took 0.596 ms (15.6%
    # of its line at that GPU's copy bandwidth) against 0.678 with the norms' kernels, the 1B
    # shape 1.219 against 1.240. Five of the course's kernels a layer. The logits are not the
    # same bits (g rounded into the weights, the normalized input never rounded): with random
    # weights in bf16, at most 0.077 apart where they reach 2.1 (SmolLM2's shapes), the same
    # argmax. The real SmolLM2 on an H100, against torch's ops in fp32, three prompts of 48
    # greedy tokens: in fp32 the same tokens, logits within 2e-4; in bf16 its last step's logits
    # off by at most 0.22-0.40 (they reach 20-41), where the norms' kernels gave 0.24-0.38, and
    # the tokens the same for one prompt with both, parted at the first token (at none with the
    # norms' kernels) and at the 25th (the 45th) for the others: bf16's near-ties, which either
    # path can tip. Not with tensor parallelism (the partial outputs are summed across ranks
    # before the add).
    norm_in_epilogue = True

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
        # Tensor parallelism (kernels.distributed.tp): a rank holding some of the heads and
        # some of the MLP's width sums its partial outputs of wo and w_down with the others'
        self.reduce = None

    def forward(self, x, delta, cos, sin, backend, cache=None):
        """(x, delta) (B, S, D) each -> the next (x, delta): the residual stream is x + delta,
        whose add is left to the next norm so that one kernel adds and normalizes
        (ops.add_rms_norm); delta None: x is the whole stream; delta Squares: x is the whole
        stream, formed in the epilogue of the GEMV before, with its rows' sums of squares
        (norm_in_epilogue). `cache`: (k_cache, v_cache, rows, gather, pos, kv_lens, length,
        start): this layer's (Bc, Hkv, T, hd) cache, the (B,) cache rows used (gathered when
        `gather`, else rows 0..B-1 in order), the (B, S) new positions, each row's keys after
        the write (B,), how many cache positions attention reads, and `start`, an int when every
        row starts at the same position (known on the host: the keys are written and read as
        slices, with no mask and nothing read back)."""
        c = self.c
        B, S, _ = x.shape
        # The course's backend fuses what it can (kernels.decode): one GEMV for q, k and v, one
        # kernel that rotates q and k and writes k and v into the cache, one GEMV for gate and
        # up that forms SwiGLU's product as it stores (swiglu_in_epilogue); for a decoding
        # step's rows (norm_in_gemv) the residual add and RMSNorm inside the GEMV after them,
        # or (norm_in_epilogue) in the epilogue of the GEMV before them.
        # Not in batch_invariant_mode: its ops are the Chapter 5 kernels, called one by one.
        fused = backend == "kernels" and not batch_invariant.enabled()
        in_gemv = norms_in_gemvs(backend, B * S, c.d_model)
        if fused and cache is not None:  # the new keys and values go into the cache directly
            k_cache, v_cache, rows, gather, pos, kv_lens, length, start = cache
            names, half = ("wq", "wk", "wv"), c.head_dim // 2
            if not self.rotary_in_epilogue:
                qkv, x = self._normed_project(x, delta, self.attn_norm, names, in_gemv, backend)
                q = decode.rotary_kv(qkv, cos, sin, k_cache, v_cache, rows, pos,
                                     c.n_heads, c.n_kv_heads)  # (B, H, S, hd) # fmt: skip
            else:  # one stack of q/k/v, its rotary pairs side by side
                h, x, norm_in = self._norm_input(x, delta, self.attn_norm, backend)
                weight, scale = fused_weight(self, names, half, folded(self.attn_norm, norm_in))
                if S == 1 and B <= gemv.MAX_ROWS:  # a decoding step: rotary in the epilogue
                    q = decode.rotary_gemv(h.reshape(B, -1), weight, cos, sin, k_cache, v_cache,
                                           rows, pos, c.n_heads, c.n_kv_heads, scale,
                                           norm=norm_in)  # fmt: skip
                else:  # a prefill's rows: the same stack, its columns unpaired for rotary_kv
                    qkv = normed_linear(h.reshape(B * S, -1), weight, scale, norm_in, backend)
                    qkv = decode.unpair_halves(qkv, half).view(B, S, -1)
                    q = decode.rotary_kv(qkv, cos, sin, k_cache, v_cache, rows, pos,
                                         c.n_heads, c.n_kv_heads)  # fmt: skip
            y = self.attend(q, cache, backend)
        else:
            h, x = self._norm(x, delta, self.attn_norm, backend)  # (B, S, D)
            q = project(h, self.wq, backend).view(B, S, c.n_heads, c.head_dim)
            k = project(h, self.wk, backend).view(B, S, c.n_kv_heads, c.head_dim)
            v = project(h, self.wv, backend).view(B, S, c.n_kv_heads, c.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, S, hd)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            if cache is None:  # full sequence: causal over the S positions given
                y = ops.attention(q, k, v, None, backend)
            else:  # write the new keys first, then attend over the cache: (B, H, S, hd)
                k_cache, v_cache, rows, gather, pos, kv_lens, length, start = cache
                if start is not None:  # rows 0..B-1 at one position: slices, no index tensors
                    k_cache[:, :, start : start + S] = k
                    v_cache[:, :, start : start + S] = v
                else:  # advanced indices around a slice put their dims first: (B, S, Hkv, hd)
                    k_cache[rows[:, None], :, pos] = k.transpose(1, 2)
                    v_cache[rows[:, None], :, pos] = v.transpose(1, 2)
                y = self.attend(q, cache, backend)
        y = y.transpose(1, 2).reshape(B, S, c.n_heads * c.head_dim)  # (B, S, H * hd)
        x, attended = self._project_out(y, self.wo, x, fused, backend)
        if not fused:
            h, x = ops.add_rms_norm(attended, x, self.mlp_norm.weight, c.norm_eps, backend)
            act = F.silu(project(h, self.w_gate, backend)) * project(h, self.w_up, backend)
            return x, self._reduced(project(act, self.w_down, backend))  # SwiGLU
        # SwiGLU's product in the gate-and-up GEMV's epilogue (swiglu_in_epilogue), in a kernel
        # of its own, or (swiglu_in_gemv) formed inside the down GEMV's loads
        # (decode.swiglu_linear): one launch fewer, but every column tile of the GEMV recomputes
        # it (speed.down_projection_ms times the last two, the chapter the whole step).
        names = ("w_gate", "w_up")
        if self.swiglu_in_epilogue:
            h, x, norm_in = self._norm_input(x, attended, self.mlp_norm, backend)
            weight, scale = fused_weight(self, names, c.d_ff, folded(self.mlp_norm, norm_in))
            h2 = h.reshape(B * S, -1)
            if B * S <= gemv.MAX_ROWS:
                act = decode.swiglu_gemv(h2, weight, scale, norm=norm_in)
            else:  # a prefill's rows: the same interleaved stack (no second copy of the
                # weights), its gate and up columns taken apart for silu_mul
                gate_up = normed_linear(h2, weight, scale, norm_in, backend)
                act = decode.silu_mul(decode.gate_then_up(gate_up))
            return self._project_out(act.view(B, S, -1), self.w_down, x, True, backend)
        gate_up, x = self._normed_project(x, attended, self.mlp_norm, names, in_gemv, backend)
        if self.swiglu_in_gemv and B * S <= gemv.MAX_ROWS:
            scale = getattr(self.w_down, "scale", None)
            down = decode.swiglu_linear(gate_up.view(B * S, -1), self.w_down.weight, scale)
            return x, self._reduced(down.view(B, S, -1))
        return self._project_out(decode.silu_mul(gate_up), self.w_down, x, True, backend)

    def _project_out(self, y, linear, x, fused, backend):
        """(x, delta) after `linear`, the projection that ends a sub-block: delta its output,
        whose add is left to the norm after it; or, where `fused` and norm_in_epilogue, the
        stream x + y @ W.T formed in the GEMV's epilogue and Squares, its rows' sums of squares
        (decode.linear_add). Not with tensor parallelism: the partial outputs are summed
        across ranks (self.reduce) before the add."""
        B, S, D = x.shape
        if not fused or self.reduce is not None or not norm_after_fits(self, B * S):
            return x, self._reduced(project(y, linear, backend))
        rows = (y.reshape(B * S, -1), linear.weight, x.reshape(B * S, D))
        x, squares = decode.linear_add(*rows, getattr(linear, "scale", None))
        return x.view(B, S, D), Squares(squares)

    def _norm(self, x, delta, norm, backend):
        """(rms_norm(x + delta), x + delta); delta None or Squares: x is the whole stream."""
        if delta is None or isinstance(delta, Squares):
            return norm(x, backend), x
        return ops.add_rms_norm(delta, x, norm.weight, self.c.norm_eps, backend)

    def _norm_input(self, x, delta, norm, backend):
        """(h, x + delta, norm_in): the input of the GEMV after `norm`, and the stream. Where
        delta is Squares, h is the stream itself and norm_in the (squares, eps) by which that
        GEMV, its weight folded with the norm's (`folded`), normalizes its product
        (decode.check_norm); else h is normalized here and norm_in is None."""
        if isinstance(delta, Squares):
            return x, x, (delta.squares, self.c.norm_eps)
        h, x = self._norm(x, delta, norm, backend)
        return h, x, None

    def _normed_project(self, x, delta, norm, names, in_gemv, backend):
        """(the fused projection `names` of rms_norm(x + delta), x + delta) (B, S, .): in one
        kernel (kernels.decode.norm_linear) where `in_gemv` and there is a delta to add, or
        (Squares) the GEMV scaling its rows by their 1 / rms, else the norm's kernel, then the
        GEMV."""
        B, S, D = x.shape
        if isinstance(delta, Squares):
            h, x, norm_in = self._norm_input(x, delta, norm, backend)
            weight, scale = fused_weight(self, names, fold=norm.weight)
            y = normed_linear(h.reshape(B * S, D), weight, scale, norm_in, backend)
            return y.view(B, S, -1), x
        if not in_gemv or delta is None:
            h, x = self._norm(x, delta, norm, backend)
            return fused_project(h, self, names), x
        weight, scale = fused_weight(self, names)
        rows = (delta.reshape(B * S, D), x.reshape(B * S, D))
        y, h = decode.norm_linear(*rows, norm.weight, self.c.norm_eps, weight, scale)
        return y.view(B, S, -1), h.view(B, S, D)

    def _reduced(self, partial):
        return partial if self.reduce is None else self.reduce(partial)

    @staticmethod
    def attend(q, cache, backend):
        """q (B, H, S, hd) over the cache, its new keys written: (B, H, S, hd)."""
        k_cache, v_cache, rows, gather, pos, kv_lens, length, start = cache
        S = q.shape[2]
        if start is not None:  # rows 0..B-1 at one position: slices, no index tensors
            keys, values = k_cache[:, :, : start + S], v_cache[:, :, : start + S]
            return ops.attention(q, keys, values, None, backend)  # causal, aligned to the end
        if gather:  # a server's running rows: a copy, (B, Hkv, length, hd)
            keys, values = k_cache[rows, :, :length], v_cache[rows, :, :length]
        else:  # every row in order: a view, no copy
            keys, values = k_cache[:, :, :length], v_cache[:, :, :length]
        return ops.attention(q, keys, values, kv_lens, backend)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, backend: str = "torch"):
        super().__init__()
        self.config = config
        self.backend = ops.check_backend(backend)  # "torch" or "kernels": see kernels.llm.ops
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        if not config.tied_embeddings:
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)
        self._rotary_table = None  # (inv_freq, dtype, (2, T, hd) cos and sin): _cos_sin

    def new_cache(self, batch: int = 1, length: int | None = None) -> KVCache:
        """An empty static cache for `batch` sequences of up to `length` positions."""
        length = length or self.config.max_seq_len
        return KVCache(
            self.config, batch, length, self.embed.weight.dtype, self.embed.weight.device
        )

    def forward(self, tokens, cache: KVCache | None = None, input_pos=None, slots=None):
        """tokens (B, S) int64 -> logits (B, S, V). With a cache, the S new tokens of row b go
        to positions input_pos[b] .. input_pos[b] + S - 1 (input_pos: an int for every row, or
        B ints as a list or a tensor) of cache row slots[b] (slots: B distinct rows, as a list
        or a tensor; default: rows 0..B-1 of a cache of B rows, attending over all its T
        positions, masked, so that every step has the same shapes, which CUDA graphs need).
        With slots, attention reads the B rows up to the longest one's last position."""
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"tokens must be a (B, S) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        B, S = tokens.shape
        device = tokens.device
        if cache is None:
            if input_pos is not None or slots is not None:
                raise ValueError("input_pos and slots need a cache")
            pos = torch.arange(S, device=device).expand(B, S)  # (B, S)
        else:
            rows = _cache_rows(slots, B, cache.batch, device)  # (B,)
            # (B, S) new positions, (B,) each row's keys once they are written, ints
            pos, kv_lens, first, last = _new_positions(input_pos, B, S, device)
            if first < 0 or last > cache.length:
                raise ValueError(
                    f"the request would overflow the KV cache: positions up to {last - 1} "
                    f"for a cache of {cache.length} (make a longer one with new_cache)"
                )
            length = cache.length if slots is None else last

        shared_start = None
        if (
            cache is not None
            and slots is None
            and (input_pos is None or isinstance(input_pos, int))
        ):
            shared_start = input_pos or 0
        layer_cache = None if cache is None else (rows, slots is not None, pos, kv_lens, length)
        positions = S if cache is None else cache.length
        return self._layers(tokens, pos, positions, cache, layer_cache, shared_start)

    def decode_rows(self, tokens, cache: KVCache, positions, slots):
        """One new token for each of B cache rows, with nothing read back to the host on
        torch's ops or in batch_invariant_mode (a server can capture it in a CUDA graph and
        replay it; the course's own attention without the mode reads kv_lens on the host):
        tokens (B, 1) int64; positions (B,) and slots (B,) int64 tensors on the model's
        device: row b's token goes to position positions[b] of cache row slots[b] (distinct
        rows). Attention reads all T positions of the cache, each row masked to its own keys.
        The values are not checked here (that would read them back): the caller checks them,
        as kernels.llm.serve does. -> logits (B, 1, V)."""
        B = tokens.shape[0]
        if (
            tokens.dim() != 2
            or tokens.shape[1] != 1
            or (positions.shape, slots.shape) != ((B,),) * 2
        ):
            raise ValueError(
                f"decode_rows takes tokens (B, 1) with positions and slots (B,), got "
                f"{tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(slots.shape)}"
            )
        pos = positions[:, None]  # (B, 1)
        layer_cache = (slots, True, pos, positions + 1, cache.length)
        return self._layers(tokens, pos, cache.length, cache, layer_cache, None)

    def _cos_sin(self, pos, positions: int):
        """Rotary's cos and sin (B, 1, S, hd) for positions pos (B, S), each below `positions`:
        gathered from a table of every position (built on the first pass that needs it, or a
        longer one, by rotary_cos_sin: the same bits), one kernel where computing them from
        the positions takes seven, each a launch of a decoding step. Under torch.compile,
        computed: the compiler fuses those seven itself."""
        dtype = self.embed.weight.dtype
        if torch.compiler.is_compiling():
            return rotary_cos_sin(pos, self.inv_freq, dtype)
        kept = self._rotary_table  # built again for new frequencies, a dtype or more positions
        if (kept is None or kept[0] is not self.inv_freq or kept[1] != dtype
                or kept[2].shape[1] < positions):  # fmt: skip
            every = torch.arange(max(positions, self.config.max_seq_len), device=pos.device)
            cos, sin = rotary_cos_sin(every[None], self.inv_freq, dtype)  # (1, 1, T, hd)
            kept = self.inv_freq, dtype, torch.stack([cos[0, 0], sin[0, 0]])
            self._rotary_table = kept
        both = kept[2][:, pos]  # (2, B, S, hd)
        return both[0][:, None], both[1][:, None]

    def _layers(self, tokens, pos, positions, cache, layer_cache, shared_start):
        """The embedding, the blocks and the head, for new positions `pos` (B, S), each below
        `positions`; layer_cache: (rows, gather, pos, kv_lens, length) as Block.forward takes
        them, or None."""
        cos, sin = self._cos_sin(pos, positions)

        x, delta = self.embed(tokens), None  # (B, S, D): the residual stream is x + delta
        for i, layer in enumerate(self.layers):
            if cache is None:
                x, delta = layer(x, delta, cos, sin, self.backend)
            else:
                kv = (cache.k[i], cache.v[i], *layer_cache, shared_start)
                x, delta = layer(x, delta, cos, sin, self.backend, kv)
        head, scale = self.embed.weight, None
        if not self.config.tied_embeddings:
            head = self.head.weight
        if hasattr(self, "head_int8"):  # kernels.llm.quant: the head's own int8 copy
            head, scale = self.head_int8, self.head_scale
        B, S, D = x.shape
        eps = self.config.norm_eps
        if isinstance(delta, Squares):  # x is the stream: the last norm in its own kernel (a
            # head folded with its weight would be a copy of the tied embedding)
            return ops.linear(self.norm(x, self.backend), head, self.backend, scale)
        if delta is not None and norms_in_gemvs(self.backend, B * S, D):
            rows = (delta.reshape(B * S, D), x.reshape(B * S, D))
            logits, _ = decode.norm_linear(*rows, self.norm.weight, eps, head, scale, False)
            return logits.view(B, S, -1)
        x, _ = ops.add_rms_norm(delta, x, self.norm.weight, eps, self.backend)
        return ops.linear(x, head, self.backend, scale)  # (B, S, V)


@contextlib.contextmanager
def fusions(norm_in_gemv=False, swiglu_in_gemv=False, swiglu_in_epilogue=False,
            rotary_in_epilogue=False, norm_in_epilogue=False):  # fmt: skip
    """Block's fusions set for the block, each off unless named (fusions() is the step with
    none of them; to time a step with some: a CUDA graph keeps what its capture ran), then as
    they were."""
    switches = {
        "norm_in_gemv": norm_in_gemv,
        "swiglu_in_gemv": swiglu_in_gemv,
        "swiglu_in_epilogue": swiglu_in_epilogue,
        "rotary_in_epilogue": rotary_in_epilogue,
        "norm_in_epilogue": norm_in_epilogue,
    }
    saved = {name: getattr(Block, name) for name in switches}
    for name, on in switches.items():
        setattr(Block, name, bool(on))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(Block, name, value)


def norm_after_fits(block: Block, rows: int) -> bool:
    """Whether wo's and w_down's GEMVs add the residual in their epilogues (decode.linear_add):
    Block's norm_in_epilogue, for a decoding step's rows."""
    return block.norm_in_epilogue and rows <= gemv.MAX_ROWS


def folded(norm, norm_in):
    """The norm's weight where the GEMV after it takes its input's sums of squares (norm_in,
    Block._norm_input's): its weights are folded with it (fused_weight's `fold`); else None."""
    return None if norm_in is None else norm.weight


def normed_linear(h, weight, scale, norm_in, backend):
    """h (rows, K) @ weight.T on `backend`; where norm_in (Block._norm_input's), the rows of
    the product scaled by h's 1 / rms from its sums of squares, the weight folded with the
    norm's (decode.squares_linear)."""
    if norm_in is None:
        return ops.linear(h, weight, backend, scale)
    return decode.squares_linear(h, *norm_in, weight, scale)


def norms_in_gemvs(backend: str, rows: int, d_model: int) -> bool:
    """Whether a pass's residual adds and norms go inside the GEMVs after them
    (kernels.decode.norm_linear): Block.norm_in_gemv, on the course's backend outside
    batch_invariant_mode, for a decoding step's rows of a width norm_linear holds."""
    return (Block.norm_in_gemv and backend == "kernels" and not batch_invariant.enabled()
            and rows <= gemv.MAX_ROWS and d_model <= decode.NORM_MAX_K)  # fmt: skip


def _cache_rows(slots, B, cache_batch, device) -> torch.Tensor:
    """slots as a (B,) int64 tensor of distinct cache rows, checked on the host."""
    if slots is None:
        if B != cache_batch:
            raise ValueError(f"a batch of {B} rows for a cache of {cache_batch} rows (pass slots)")
        return torch.arange(B, device=device)
    ids = slots.tolist() if isinstance(slots, torch.Tensor) else [int(s) for s in slots]
    if len(ids) != B or len(set(ids)) != B or not all(0 <= s < cache_batch for s in ids):
        raise ValueError(f"slots must be {B} distinct rows of the cache's {cache_batch}, got {ids}")
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _new_positions(input_pos, B, S, device):
    """(pos, kv_lens, first, last): the (B, S) positions of each row's S new tokens, each row's
    keys once they are written (B,), the lowest start and the highest end. The starts are on
    the host for an int or a list, read back from a tensor (one sync a step). An int (a
    decoding step's usual case) takes two kernels, not four: one range for every row."""
    if input_pos is None:
        input_pos = 0
    if isinstance(input_pos, int):
        pos = torch.arange(input_pos, input_pos + S, device=device).expand(B, S).contiguous()
        return pos, torch.full((B,), input_pos + S, device=device), input_pos, input_pos + S
    if isinstance(input_pos, torch.Tensor):
        start = input_pos.to(device=device, dtype=torch.int64)
        starts = start.tolist() if start.dim() == 1 else None
    else:
        starts = [int(p) for p in input_pos]
        start = torch.tensor(starts, dtype=torch.int64, device=device)
    if starts is None or len(starts) != B:
        raise ValueError(f"input_pos must give one position for each of the {B} rows, "
                         f"got shape {tuple(start.shape)}")  # fmt: skip
    pos = start[:, None] + torch.arange(S, device=device)
    return pos, start + S, min(starts, default=0), max(starts, default=-S) + S
