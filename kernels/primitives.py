"""Triton building blocks that several ops share, each written once.

- LOG2E: exp(x) = exp2(x * log2(e)); exp2 is the GPU's native instruction (attention).
- gelu: the exact (erf) GELU, F.gelu's default; gelu_fast, its tanh form in a few cheap
  instructions; gelu_for, the one of the two a kernel storing a given dtype computes (fp32:
  exact; fp16/bf16: fast), for bias_gelu and the matmul epilogues.
- swiglu: SwiGLU's product silu(gate) * up (a decoding step's MLP).
- add_combine, max_combine: the combine functions for tl.reduce that are tl.sum's and tl.max's
  (the batch-invariant kernels and split-K's CPU path sum in an order they write out).
- grouped_tile: the order in which a matmul's programs visit output tiles (both matmuls).
- epilogue: bias and activation applied to a matmul's fp32 tile before its one store.
- matmul_launch_metadata: what a profiler shows for a launch of any of the matmul kernels.
- wait_for_previous, prefetch_l2: programmatic dependent launch (below), for the kernels of a
  decoding step.
- attention's forward and backward kernels share the grid's (batch, head) addressing
  (head_index, head_tile: grouped-query heads included), the padded head dim's mask
  (tile_mask), the causal rule (causal_sees, key_mask), the key ranges of a query
  block (key_ranges) and the key/value block load (kv_block): a mask or a range fixed in one
  place cannot desynchronize the forward from its gradients.

A kernel may read a module-level constant only if it is a `tl.constexpr`; host code reads
its `.value`.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
INV_SQRT2 = tl.constexpr(0.7071067811865476)


@triton.jit
def gelu(z):
    """Exact GELU in fp32: z * Phi(z) = 0.5 z (1 + erf(z / sqrt(2)))."""
    return 0.5 * z * (1.0 + tl.erf(z * INV_SQRT2))


# GELU's tanh form: 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3) (Hendrycks and
# Gimpel, "Gaussian Error Linear Units", 2016, section 2). 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)),
# so GELU(z) ~ z / (1 + 2^(z (GELU_C1 + GELU_C3 z^2))) with -2u log2(e) folded into constants.
GELU_C1 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)
GELU_C3 = tl.constexpr(-2.0 * 0.7978845608028654 * 0.044715 * 1.4426950408889634)


@triton.jit
def gelu_fast(z):
    """GELU in its tanh form, in fp32: two multiplies, an FMA, one exp2 (the GPU's native
    instruction, where erf is a long polynomial) and an approximate division. Off from the exact
    GELU by 4.7e-4 at most (near |z| = 2.7), under fp16's rounding step there (2e-3) and far
    under bf16's (tests/test_elementwise.py measures it over every value of both). At the ends:
    z -> +inf gives 2^-inf = 0, so z; z -> -inf gives z / inf = -0 (exact: a tiny negative)."""
    return tl.fdiv(z, 1.0 + tl.exp2(z * (GELU_C1 + GELU_C3 * z * z)), ieee_rounding=False)


@triton.jit
def gelu_for(z, out_dtype: tl.constexpr):
    """The GELU of a kernel that stores `out_dtype`: exact (erf) for fp32, where the tanh form's
    4.7e-4 would be over ten times the tolerance; gelu_fast for fp16 and bf16, whose rounding
    hides most of it."""
    if out_dtype == tl.float32:
        y = gelu(z)
    else:
        y = gelu_fast(z)
    return y


@triton.jit
def swiglu(gate, up):
    """SwiGLU's product silu(gate) * up, in fp32: kernels.decode.silu_mul and the GATED loads
    of kernels.split_k compute it with this one function, so the two paths agree bit for bit."""
    gate = gate.to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


def _triton_combine(name, fallback):
    """Triton's own combine function `tl.standard.<name>` where this Triton has one, else
    `fallback`. The one place this package touches a private Triton name."""
    combine = getattr(tl.standard, name, None)
    return combine if callable(combine) else fallback


# add_combine and max_combine: tl.reduce(x, axis, add_combine) is what tl.sum(x, axis) does for
# fp32 x (tl.max likewise), so on the GPU the code, and the order of the additions, are the
# same. They are written out because the CPU interpreter pays milliseconds for every call of a
# @jit function such as tl.sum, while it hands tl.reduce straight to numpy when the combine
# function IS Triton's own (tl.standard._sum_combine, _elementwise_max, recognized by
# identity). Those names are private, so they are looked up once here and kept out of every
# kernel (graded code may not touch private Triton); a Triton without them gets `_add` and
# `_maximum`: the same reduction on the GPU, only a slower interpreter.
add_combine = _triton_combine("_sum_combine", _add)
max_combine = _triton_combine("_elementwise_max", _maximum)


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): the tile of c this program computes, in grouped order. Consecutive
    programs walk down a column of GROUP_M tiles before moving right, so the rows of a and
    columns of b they share are still in L2 when read again. The order changes when a tile
    is computed, never how."""
    pid = tl.program_id(0)
    tiles_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // tiles_per_group) * GROUP_M
    group_height = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    in_group = pid % tiles_per_group
    return first_m + in_group % group_height, in_group // group_height


@triton.jit
def epilogue(acc, bias_ptr, cols, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(acc + bias) on the fp32 tile while it is still in registers (elementwise, so it
    cannot change a result's dependence on the batch). bias_ptr is the bias or, without one,
    the output standing in: either way it has the output's dtype, which picks the GELU."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "gelu":
        acc = gelu_for(acc, bias_ptr.dtype.element_ty)
    elif ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    return acc


@triton.jit
def head_index(H):
    """This program's (batch, head) slice, b * H + h, in 64 bits (B*H*S*D may pass 2**31).
    Attention grids are (blocks, H, B): axis 1 is the head, axis 2 the batch. `H` is the number
    of heads the grid walks: the query heads, or the key/value heads for the dK/dV kernel."""
    return tl.program_id(2).to(tl.int64) * H + tl.program_id(1).to(tl.int64)


@triton.jit
def head_tile(X, stride_b, stride_h, stride_s, stride_d, head, rows, offs_d):
    """Pointers to `rows` x `offs_d` of head `head` of this program's batch (grid axis 2) of a
    strided (B, H, S, D) tensor: a 64-bit offset to the slice, then one tile of 32-bit offsets
    inside it (the launchers' `with_32bit_head_offsets` makes sure they fit), added at once.
    With grouped-query attention a key/value head serves several query heads: the caller says
    which head (q's own, or h // GROUP for k and v), so K and V are never copied."""
    off_b = tl.program_id(2).to(tl.int64)
    base = X + off_b * stride_b + head.to(tl.int64) * stride_h
    return base + (rows[:, None] * stride_s + offs_d[None, :] * stride_d)


@triton.jit
def tile_mask(rows_in, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The elements of a (rows, BLOCK_D) tile that exist: rows in range and, when the head dim is
    padded to the power of two BLOCK_D (D = 80 runs as 128), columns below HEAD_DIM. Padded
    columns load as 0, so they add exact zeros to every dot product, and are never stored."""
    if BLOCK_D == HEAD_DIM:
        mask = rows_in[:, None]
    else:
        mask = rows_in[:, None] & (offs_d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def causal_sees(rows, cols, diagonal):
    """Whether query `rows` sees key `cols` (broadcast together) under the causal mask aligned
    to the end: j <= i + diagonal, diagonal = Sk - Sq, so the last query sees every key."""
    return cols <= rows + diagonal


@triton.jit
def key_mask(rows, cols, seq_k, diagonal, CAUSAL: tl.constexpr):
    """The (rows, cols) scores of a masked key block that count: keys inside the sequence and,
    with CAUSAL, only those each query sees."""
    keep = cols[None, :] < seq_k
    if CAUSAL:
        keep = keep & causal_sees(rows[:, None], cols[None, :], diagonal)
    return keep


@triton.jit
def key_ranges(m0, seq_k, diagonal, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr):  # fmt: skip
    """(full, end) for the query rows [m0, m0 + BLOCK_M): keys [0, full) are whole blocks that
    every row sees (no mask at all); [full, end) need masks. With CAUSAL, keys after the block's
    last row are never visited: about half the work."""
    if CAUSAL:
        end = tl.minimum(m0 + BLOCK_M + diagonal, seq_k)
        full = tl.minimum(m0 + diagonal + 1, seq_k) // BLOCK_N * BLOCK_N
    else:
        end = seq_k
        full = seq_k // BLOCK_N * BLOCK_N
    return full, end


@triton.jit
def kv_block(ptrs, start_n, stride_n, cols, seq_k, offs_d, MASKED: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Keys (or values) `cols` = start_n + arange(BLOCK_N), from a (BLOCK_N, BLOCK_D) pointer
    tile at key 0 moved by the loop index. The hot loop (MASKED=False) reads whole blocks with
    no mask when the head dim is a power of two (a padded one masks its columns alone); a masked
    block loads 0 past seq_k."""
    if MASKED:
        mask = tile_mask(cols < seq_k, offs_d, HEAD_DIM, BLOCK_D)
        block = tl.load(ptrs + start_n * stride_n, mask=mask, other=0.0)
    elif BLOCK_D == HEAD_DIM:
        block = tl.load(ptrs + start_n * stride_n)
    else:
        block = tl.load(ptrs + start_n * stride_n, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return block


def matmul_launch_metadata(grid, kernel, args) -> dict:
    """`@triton.jit(launch_metadata=...)` of every matmul kernel (its `bias_ptr` is c, standing
    in, without a bias): the launch's shape, 2*M*N*K FLOPs, and the least bytes: a, b and the
    bias read once, c written once. Read from the tensors, not the constexprs (older Triton
    passed those differently); Triton calls it only while a launch hook is set."""
    M, N, K, bias = args["M"], args["N"], args["K"], args["bias_ptr"]
    es = bias.element_size()  # the bias, or c standing in: the inputs' dtype either way
    bias_elements = N if bias.dim() == 1 else 0  # c, standing in, is 2-D
    return {
        "name": f"{kernel.name} [M={M}, N={N}, K={K}]",
        "flops": 2.0 * M * N * K,
        "bytes": es * (M * K + K * N + M * N + bias_elements),
    }


# Programmatic dependent launch (Hopper and later; CUDA's "PDL"). A kernel launched with
# `launch_pdl=True` may start while the kernel before it in the stream is still running: its
# programs are placed on the SMs and run up to `gdc_wait`, which returns once the previous
# kernel has finished and its writes are visible. What comes before the wait overlaps the
# previous kernel's tail: the launch itself, and loads of what that kernel cannot have written
# (a decode GEMV's weights). `gdc_launch_dependents` lets the next kernel start the same way.
# A decoding step is a chain of a few hundred kernels of a few microseconds each (Chapter 6),
# so what each launch costs between two kernels is a large part of the step. Measured on an
# H100 (80GB HBM3, torch 2.11, triton 3.6, 2026-12-06), in CUDA graphs: a chain of 90 GEMVs of
# 576 x 576, each reading the one before's output, 3.54 us a GEMV without and 2.42 with; a
# decoding step at SmolLM2's shapes 0.960 ms without and 0.746 with, the llama-1b shape 1.336
# and 1.229 (bits unchanged: tests/test_decode.py).
# The rule that keeps it correct: a kernel launched this way reads and writes nothing the
# previous kernel may write before its wait (prefetch_l2 reads nothing into registers: it is
# safe anywhere). Since every program waits, a kernel cannot finish before the one before it
# has: a kernel two back is finished too.


def dependent_keywords(pdl: bool) -> dict:
    """A launch's dependent-launch keywords, always the two together: the kernel's PDL (it
    waits, wait_for_previous) and Triton's launch_pdl (it may start early). A kernel started
    early that did not wait would read what the kernel before has not written yet."""
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel in the stream has finished (its writes visible),
    then let the next kernel start launching. Without: nothing (the launch itself waits)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the memory at `ptrs` (any valid addresses) to be brought into L2 (PTX
    prefetch.global.L2), and go on without waiting for it. Nothing lands in registers, so a
    write to those addresses by another kernel, later, is seen by a later load: L2 is where
    every SM's writes meet. Compiled kernels only (the interpreter has no inline assembly)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip
