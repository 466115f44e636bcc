"""Split-K matmul: act(a @ b * scale + bias) with the K reduction cut into a fixed number of
pieces, for products whose output has too few tiles to fill the GPU (a 256 x 256 output is 4
tiles of 128 x 128 for 132 SMs) while K is long (524288), and for the decode GEMV
(kernels.gemv, kernels.int8) where M is 1 to 64 and the weight's N x K is everything.

split_k_kernel: program (tile, split) computes one BLOCK_M x BLOCK_N tile of the output over
one slice of K, accumulating in fp32, and stores it into a partial-sums buffer (splits, M, N)
in fp32. Each output element is then the sum of its partials in a fixed order (split 0, then
1, 2, ...), then the epilogue (per-column scale, bias, activation), stored in the output dtype:
done by the tile's last program to finish (kernels.arrivals: an arrival counter, no second
launch), or by split_k_reduce_kernel, the same sum in a second launch (where no counters are to
be had). No atomic touches a value: the order of every addition is fixed, so the result is the
same run to run, and the same either way. With one piece the first kernel applies the epilogue
and stores the output itself (no partials).

What a decoding step fuses into the loads of a (kernels.decode): SwiGLU's product (GATED: a
holds gate then up) and the residual add and RMSNorm before a projection (NORM 1 and 2: each
program first sums its rows' squares of a + res over all of K, then normalizes each tile it
loads; NORM 3: a is the stream already added, its rows' sums of squares come in pieces,
one from each column tile of the GEMV before, and the norm's weight is folded into b's rows
(kernels.decode.fold_norm), so a is loaded as it is and each row of the product is scaled by
its 1 / rms once, after the loop). And into the ending of a tile (`finish`,
store_output): SwiGLU's product (activation "swiglu", gate and up columns side by side), or
the residual add after the product ("add_squares": each tile stores its part of the stream
and the sum of its squares, the pieces NORM 3 adds up).
kernels.decode's rotary_gemv_kernel starts from the same tile loop (`accumulate`) and ends its
own way.
Under dependent launch (kernels.runtime.PDL) a program asks for its first weight lines in L2
before it waits for the kernel before it (kernels.primitives.wait_for_previous).

Batch invariance: the number of pieces, and the tile, are functions of (N, K), the dtypes and
the device (kernels.split_k_tuning), never of M. A row's sum is then cut at the same places
whatever the batch size, and on tensor cores a row's result does not depend on the other rows
of its tile, so row i of a batch of M rows has the bits it has alone. A split chosen from M, as
libraries choose it to fill the GPU for small batches, changes a row's bits with the batch
size: Chapter 5 shows it (kernels.batch_invariant.controls.split_k_matmul, its negative
control). The reduce kernel's tile may follow M: it adds each element's partials alone.

Bytes: a and b once (b in its own dtype: int8 for kernels.int8), the output once, plus the
partials written and read once (8 * splits * M * N); FLOPs 2 * M * N * K. Forward only.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources, PTXASError

from kernels import arrivals, runtime
from kernels import split_k_tuning as tuning
from kernels.arrivals import last_to_arrive
from kernels.bench import l2_bytes, rotating_copies, rotating_graph_ms
from kernels.launch import cdiv, launch, next_power_of_2
from kernels.matmul_reference import matmul_ref
from kernels.operators import forward_road, operator
from kernels.primitives import (
    add_combine,
    dependent_keywords,
    epilogue,
    prefetch_l2,
    swiglu,
    wait_for_previous,
)
from kernels.runtime import INTERPRET
from kernels.validate import check_matmul_inputs, input_precision


def split_k_metadata(grid, kernel, args) -> dict:
    """What a profiler shows for either kernel: its shape, FLOPs and least bytes. Partials are
    a 3-D buffer (splits, M, N); a 2-D tensor passed in a pointer's place stands in, unread."""
    M, N, parts, out = args["M"], args["N"], args["part_ptr"], args["out_ptr"]
    splits = parts.shape[0] if parts.dim() == 3 else 1
    extras = sum(args[p].numel() * args[p].element_size() for p in ("scale_ptr", "bias_ptr")
                 if args[p].dim() == 1)  # fmt: skip
    partials = 4 * splits * M * N if parts.dim() == 3 else 0
    if "a_ptr" in args:  # the main kernel: reads a and b, writes partials or the output
        K, a, b = args["K"], args["a_ptr"], args["b_ptr"]
        moved = M * a.shape[1] * a.element_size() + K * N * b.element_size() + extras
        moved += partials if partials else out.numel() * out.element_size()
        name, flops = f"{kernel.name} [M={M}, N={N}, K={K}, splits={splits}]", 2.0 * M * N * K
    else:  # the reduce: reads partials, writes the output
        moved = partials + out.numel() * out.element_size() + extras
        name, flops = f"{kernel.name} [M={M}, N={N}, splits={splits}]", float(splits * M * N)
    return {"name": name, "flops": flops, "bytes": moved}


@triton.jit
def scaled_epilogue(acc, scale_ptr, bias_ptr, cols, N, HAS_SCALE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):  # fmt: skip
    """act(acc * scale + bias): int8 weights' per-column scale, then the shared epilogue."""
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    return epilogue(acc, bias_ptr, cols, N, HAS_BIAS, ACTIVATION)


@triton.jit
def load_a(a_ptrs, mask, K, stride_ak, GATED: tl.constexpr):
    """A tile of a; GATED: silu(gate) * up from a (M, 2K) holding gate then up, rounded to a's
    dtype as the separate kernel would store it (kernels.decode.silu_mul), so that SwiGLU's
    product feeds the down projection without a launch or a round trip through memory."""
    if GATED:
        gate = tl.load(a_ptrs, mask=mask, other=0.0)
        up = tl.load(a_ptrs + K * stride_ak, mask=mask, other=0.0)
        return swiglu(gate, up).to(a_ptrs.dtype.element_ty)
    return tl.load(a_ptrs, mask=mask, other=0.0)


@triton.jit
def rms_of_sum(x_ptr, r_ptr, s_ptr, first_row, M, K, stride_m, stride_k, eps, write,
               BLOCK_M: tl.constexpr, ROW: tl.constexpr):  # fmt: skip
    """1 / rms over all K of rows first_row .. first_row + BLOCK_M - 1 (those below M) of
    s = x + r, s rounded to x's dtype as kernels.norm's add_rms_norm rounds it, and stored
    where `write`. A row at a time, whole (ROW >= K, one fp32 sum as the norm kernel's): one
    trip to memory for a decoding step's one row, where pieces of K would take one each."""
    ks = tl.arange(0, ROW)
    k_ok = ks < K
    rows = first_row + tl.arange(0, BLOCK_M)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for i in range(0, tl.minimum(BLOCK_M, M - first_row)):
        row = (first_row + i).to(tl.int64)
        offsets = row * stride_m + ks * stride_k
        x = tl.load(x_ptr + offsets, mask=k_ok, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + offsets, mask=k_ok, other=0.0).to(tl.float32)
        h = (x + r).to(x_ptr.dtype.element_ty)
        tl.store(s_ptr + offsets, h, mask=k_ok & write)
        h = h.to(tl.float32)
        rstd = tl.where(rows == row, tl.rsqrt(tl.sum(h * h, axis=0) / K + eps), rstd)
    return rstd


@triton.jit
def rms_of_squares(sq_ptr, first_row, M, K, n_squares, eps, BLOCK_M: tl.constexpr,
                   ROW: tl.constexpr):  # fmt: skip
    """1 / rms over all K of rows first_row .. first_row + BLOCK_M - 1 from their sums of
    squares in n_squares pieces (sq (M, n_squares) fp32, ROW >= n_squares): one small load
    where rms_of_sum reads whole rows."""
    rows = first_row + tl.arange(0, BLOCK_M)
    pieces = tl.arange(0, ROW)
    offsets = rows.to(tl.int64)[:, None] * n_squares + pieces[None, :]
    ok = (rows < M)[:, None] & (pieces < n_squares)[None, :]
    squares = tl.load(sq_ptr + offsets, mask=ok, other=0.0)
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def normed(x, r, g, rstd):
    """rms_norm(x + r) * g for a tile, as kernels.norm's add_rms_norm computes and rounds it."""
    h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    return (h.to(tl.float32) * rstd[:, None] * g.to(tl.float32)[None, :]).to(x.dtype)


# M is not specialized: Triton would compile other code for M == 1 or M % 16 == 0, and one
# kernel for every M is the point (kernels.batch_invariant.full_k_matmul does the same).
@triton.jit(do_not_specialize=["M"], launch_metadata=split_k_metadata)
def split_k_kernel(
    a_ptr, b_ptr, out_ptr, part_ptr, scale_ptr, bias_ptr, count_ptr, M, N, K, k_per_split,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    res_ptr, g_ptr, stream_ptr, eps, n_squares,
    # NORM 0, 1 (normalize a + res), 2 (and store it), ROW >= K; 3 (scale the product's rows
    # by 1 / rms from a's sums of squares in n_squares pieces at res), ROW >= n_squares
    NORM: tl.constexpr, ROW: tl.constexpr,
    DIRECT: tl.constexpr, LAST_SUMS: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False, PREFETCH_ROWS: tl.constexpr = 0, LINE: tl.constexpr = 64,
):  # fmt: skip
    acc, rows, cols, split, tile, pieces = accumulate(
        a_ptr, b_ptr, M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn,
        res_ptr, g_ptr, stream_ptr, eps, n_squares, NORM, ROW, EVEN_K, INPUT_PRECISION, USE_DOT,
        GATED, BLOCK_M, BLOCK_N, BLOCK_K, PDL, PREFETCH_ROWS, LINE,
    )  # fmt: skip
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if DIRECT:  # one piece: this program's tile is the output
        finish(acc, out_ptr, scale_ptr, bias_ptr, rows, cols, M, N, stride_cm, stride_cn, mask,
               res_ptr, stream_ptr, tile, HAS_SCALE, HAS_BIAS, ACTIVATION, BLOCK_M,
               BLOCK_N)  # fmt: skip
    else:  # partials (splits, M, N), contiguous fp32
        part_ptrs = store_partials(acc, part_ptr, rows, cols, mask, M, N, split)
        if LAST_SUMS:  # the tile's last piece to finish sums them all (kernels.arrivals)
            if last_to_arrive(count_ptr, tile, pieces):
                acc = sum_partials(part_ptrs, M * N, pieces, mask)
                finish(acc, out_ptr, scale_ptr, bias_ptr, rows, cols, M, N, stride_cm,
                       stride_cn, mask, res_ptr, stream_ptr, tile, HAS_SCALE, HAS_BIAS,
                       ACTIVATION, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def finish(
    acc, out_ptr, scale_ptr, bias_ptr, rows, cols, M, N, stride_cm, stride_cn, mask,
    res_ptr, squares_ptr, tile, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A finished tile's ending: store_output's; or ("add_squares", kernels.decode.linear_add)
    the residual res (M, N) added to the product (rounded to the output's dtype first, as the
    GEMV would store it) and the sum stored, rounded as kernels.norm's add_rms_norm rounds it;
    and, row by row, the sum of its squares over the tile's columns, stored in the tile's
    column of squares (M, column tiles) fp32: one piece of each row's sum of squares, which
    the next GEMV adds up to normalize the row (NORM 3), so no program waits for another."""
    if ACTIVATION == "add_squares":
        acc = scaled_epilogue(acc, scale_ptr, bias_ptr, cols, N, HAS_SCALE, HAS_BIAS, "none")
        dtype = out_ptr.dtype.element_ty
        rows_in = rows.to(tl.int64)
        r = tl.load(res_ptr + rows_in[:, None] * N + cols[None, :], mask=mask, other=0.0)
        h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        c_ptrs = out_ptr + rows_in[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, h, mask=mask)
        h = tl.where(mask, h.to(tl.float32), 0.0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tl.store(squares_ptr + rows_in * tiles_n + tile // tiles_m, tl.sum(h * h, axis=1),
                 mask=rows < M)  # fmt: skip
    else:
        store_output(acc, out_ptr, scale_ptr, bias_ptr, rows, cols, N, stride_cm, stride_cn,
                     mask, HAS_SCALE, HAS_BIAS, ACTIVATION)  # fmt: skip


@triton.jit
def accumulate(
    a_ptr, b_ptr, M, N, K, k_per_split, stride_am, stride_ak, stride_bk, stride_bn,
    res_ptr, g_ptr, stream_ptr, eps, n_squares, NORM: tl.constexpr, ROW: tl.constexpr,
    EVEN_K: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_ROWS: tl.constexpr, LINE: tl.constexpr,
):  # fmt: skip
    """This program's tile of a @ b over its piece of K, in fp32, and where it lies: (acc,
    rows, cols, which piece of K, which tile, how many pieces). Every kernel that ends a
    product its own way (split_k_kernel, kernels.decode's rotary_gemv_kernel) starts here."""
    # Row tiles vary fastest: the programs that share a slab of b (a decode weight) run together
    # and read it from DRAM once.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid % tiles_m
    pid_n = (pid // tiles_m) % tiles_n
    split = pid // (tiles_m * tiles_n)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M are masked: padding rows cost no memory traffic (M = 1 in a tile of 16 reads
    # one row of a). Columns past N wrap onto valid ones, so b's loads need no mask but along K;
    # the store drops them. 64-bit: row * stride can pass 2**31.
    row_ok = (rows < M)[:, None]
    rows_in = rows.to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    k_start = split.to(tl.int64) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + (k_start + ks)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_start + ks)[:, None] * stride_bk + cols_in[None, :] * stride_bn
    if PDL:  # dependent launch (kernels.primitives): while the kernel before (a norm, attention)
        # finishes, ask for the first PREFETCH_ROWS lines of LINE elements of this piece's
        # weight columns (K-contiguous for a decode weight) to be brought into L2
        if PREFETCH_ROWS > 0:
            lines = tl.minimum(k_start + tl.arange(0, PREFETCH_ROWS) * LINE, K - 1)
            prefetch_l2(b_ptr + lines[:, None] * stride_bk + cols_in[None, :] * stride_bn)
        wait_for_previous(PDL)
    if NORM == 3:  # the product is rms_norm(a) * g @ b with g folded into b's rows
        # (kernels.decode.squares_linear): a row's few pieces of its sum of squares, loaded
        # now and used after the loop, which runs as the plain GEMV's
        rstd = rms_of_squares(res_ptr, pid_m * BLOCK_M, M, K, n_squares, eps, BLOCK_M, ROW)
    elif NORM:  # a is rms_norm(a + res) * g (kernels.decode.norm_linear): every program needs
        # its rows' rstd over all of K first; the first column tile's first piece stores a + res
        r_ptrs = res_ptr + rows_in[:, None] * stride_am + (k_start + ks)[None, :] * stride_ak
        g_ptrs = g_ptr + k_start + ks
        rstd = rms_of_sum(a_ptr, res_ptr, stream_ptr, pid_m * BLOCK_M, M, K, stride_am,
                          stride_ak, eps, (NORM == 2) & (pid_n == 0) & (split == 0), BLOCK_M,
                          ROW)  # fmt: skip

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):  # this piece of K, in order
        if EVEN_K:  # K a multiple of BLOCK_K, so is every piece: no masks along K
            a = load_a(a_ptrs, row_ok, K, stride_ak, GATED)
            b = tl.load(b_ptrs)
            if NORM == 1 or NORM == 2:
                a = normed(a, tl.load(r_ptrs, mask=row_ok, other=0.0), tl.load(g_ptrs), rstd)
        else:
            k_ok = ks < k_end - k0
            a = load_a(a_ptrs, row_ok & k_ok[None, :], K, stride_ak, GATED)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if NORM == 1 or NORM == 2:
                r = tl.load(r_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
                a = normed(a, r, tl.load(g_ptrs, mask=k_ok, other=0.0), rstd)
        if NORM == 1 or NORM == 2:
            g_ptrs += BLOCK_K
            r_ptrs += BLOCK_K * stride_ak
        b = b.to(a.dtype)  # int8 weights: exact in fp16/bf16/fp32 (|q| <= 127)
        if USE_DOT:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:  # see DOT_ON_CPU in kernels/batch_invariant/full_k_matmul.py
            acc += tl.reduce(
                a[:, :, None].to(tl.float32) * b[None, :, :].to(tl.float32), 1, add_combine
            )
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if NORM == 3:  # each piece's partial scaled alike: their sum is the row's product scaled
        acc = acc * rstd[:, None]
    pieces = tl.num_programs(0) // (tiles_m * tiles_n)
    return acc, rows, cols, split, pid % (tiles_m * tiles_n), pieces


@triton.jit
def store_partials(acc, part_ptr, rows, cols, mask, M, N, split):
    """This piece's partial tile into the (splits, M, N) fp32 buffer; returns the pointers of
    split 0's partials of the tile, where sum_partials starts."""
    part_ptrs = part_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(part_ptrs + split.to(tl.int64) * M * N, acc, mask=mask)
    return part_ptrs


@triton.jit
def store_output(
    acc, out_ptr, scale_ptr, bias_ptr, rows, cols, N, stride_cm, stride_cn, mask,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
):  # fmt: skip
    """act(acc * scale + bias) stored in the output's dtype: the one ending of every path.
    "swiglu": the columns alternate gate and up (kernels.decode.swiglu_gemv), and column pair
    j stores silu(gate) * up at output column j, each of the two rounded to the output's dtype
    first as the GEMV would store it for kernels.decode.silu_mul."""
    if ACTIVATION == "swiglu":
        acc = scaled_epilogue(acc, scale_ptr, bias_ptr, cols, N, HAS_SCALE, HAS_BIAS, "none")
        dtype = out_ptr.dtype.element_ty
        gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
        acc = swiglu(gate.to(dtype), up.to(dtype))
        cols = tl.split(tl.reshape(cols, (cols.shape[0] // 2, 2)))[0] // 2
        mask = tl.split(tl.reshape(mask, (mask.shape[0], mask.shape[1] // 2, 2)))[0]
    else:
        acc = scaled_epilogue(acc, scale_ptr, bias_ptr, cols, N, HAS_SCALE, HAS_BIAS, ACTIVATION)
    c_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_partials(part_ptrs, split_stride, splits, mask):
    """Split 0's partials, plus split 1's, 2's, ...: one order for every element, whichever
    kernel sums them. Loaded through L2 only (.cg): another program wrote them."""
    acc = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for _ in range(1, splits):
        part_ptrs += split_stride
        acc += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit(do_not_specialize=["M"], launch_metadata=split_k_metadata)
def split_k_reduce_kernel(
    part_ptr, out_ptr, scale_ptr, bias_ptr, M, N, splits, split_stride, stride_cm, stride_cn,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_previous(PDL)  # the partials are the kernel before's
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    part_ptrs = part_ptr + rows[:, None] * N + cols[None, :]  # 64-bit: rows are int64
    acc = sum_partials(part_ptrs, split_stride, splits, mask)
    store_output(acc, out_ptr, scale_ptr, bias_ptr, rows, cols, N, stride_cm, stride_cn, mask,
                 HAS_SCALE, HAS_BIAS, ACTIVATION)  # fmt: skip


# The last piece to arrive sums all of its tile's partials alone, one split after another; the
# reduce kernel spreads the same sums over many programs. On the H200 the bf16 256x256x524288
# product (66 pieces of 128 x 128 tiles: 1.1 M partial elements a tile, summed by 4 programs)
# took 0.230 ms with the counters against 0.167 ms with the reduce kernel before them. Past
# this many partial elements a tile, the reduce kernel sums (a decode GEMV's 16 x 64 tiles in
# up to 64 pieces stay under it).
LAST_SUM_MAX_ELEMENTS = 1 << 16


def last_piece_sums(plan) -> bool:
    """Whether `plan`'s partials are summed by each tile's last piece (an arrival counter)
    rather than by a second kernel: split, and few enough partial elements a tile."""
    tile = plan.tile
    return 1 < plan.splits and plan.splits * tile.BLOCK_M * tile.BLOCK_N <= LAST_SUM_MAX_ELEMENTS


def _run(a, b, plan, scale=None, bias=None, activation=None, gated=False, norm=None, squares=None):
    """Launch `plan` for validated a (M, K), b (K, N) with M, N, K > 0; gated: a is (M, 2K),
    gate then up, and the product is silu(gate) * up @ b; norm: (res, g, eps, stream), the
    product is rms_norm(a + res) * g @ b, with a + res stored into stream (or not: None);
    squares: (sq, eps), the product's rows scaled by a's 1 / rms, sq (M, pieces) fp32
    contiguous holding a's rows' sums of squares in pieces (with a norm's weight folded into
    b's rows: rms_norm(a) * g @ b, kernels.decode.fold_norm). activation "add_squares"
    (kernels.decode.linear_add): norm is (res, sq) instead, res (M, N) contiguous and sq
    (M, column tiles of the plan) fp32: the output is res + a @ b and sq its rows' sums of
    squares by column tile; the plan's pieces must be summed in the kernel (one piece, or
    last_piece_sums with counters to be had: the caller checks)."""
    M, K, N = a.shape[0], b.shape[0], b.shape[1]
    tile = plan.tile
    after = activation == "add_squares"
    out = a.new_empty((M, N // 2 if activation == "swiglu" else N))
    parts = out  # stands in when there is one piece
    if plan.splits > 1:
        parts = a.new_empty((plan.splits, M, N), dtype=torch.float32)
    flags = dict(
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, ACTIVATION=activation or "none"
    )
    scale = out if scale is None else scale
    bias = out if bias is None else bias
    res, g, eps, stream = a, a, 0.0, out  # stand-ins, never read or written
    norm_flag, row, n_squares = 0, 1, 1
    if after:
        res, stream = norm
    elif norm is not None:
        res, g, eps, stream = norm
        norm_flag, row = (1 if stream is None else 2), next_power_of_2(K)
        stream = out if stream is None else stream
    elif squares is not None:
        res, eps = squares
        norm_flag, n_squares = 3, res.shape[1]
        row = next_power_of_2(n_squares)
    tiles = cdiv(M, tile.BLOCK_M) * cdiv(N, tile.BLOCK_N)
    meta = tile.meta()
    count = arrivals.counters(a.device, tiles) if last_piece_sums(plan) else None
    if after and plan.splits > 1 and count is None:
        raise RuntimeError("the add_squares ending needs its pieces summed in the kernel")
    pdl = runtime.PDL
    launch(split_k_kernel, (tiles * plan.splits,),
        a, b, out, parts, scale, bias, out if count is None else count, M, N, K,
        plan.k_per_split, *a.stride(), *b.stride(), *out.stride(), res, g, stream, float(eps),
        n_squares, NORM=norm_flag, ROW=row, DIRECT=plan.splits == 1,
        LAST_SUMS=plan.splits > 1 and count is not None, EVEN_K=K % tile.BLOCK_K == 0,
        INPUT_PRECISION=input_precision(a.dtype), USE_DOT=not INTERPRET, GATED=gated,
        **flags, **meta, **pdl_keywords(b, plan, pdl),
    )  # fmt: skip
    if plan.splits > 1 and count is None:  # too many partials, or no counters: a second launch sums
        block_m = min(16, next_power_of_2(M))
        block_n = min(next_power_of_2(N), max(64, 1024 // block_m))
        grid = (cdiv(N, block_n), cdiv(M, block_m))
        launch(split_k_reduce_kernel, grid,
            parts, out, scale, bias, M, N, plan.splits, parts.stride(0), *out.stride(),
            **flags, BLOCK_M=block_m, BLOCK_N=block_n, **dependent_keywords(pdl),
        )  # fmt: skip
    return out


# Bytes of weight a program asks for in L2 before the kernel before it has finished (under
# dependent launch): 64 KB, the first lines of its piece of K. SmolLM2's 576-long rows fit in
# about that at 64 columns; a longer piece streams the rest as before. 256 KB was slower on an
# H100 (2026-12-06, a decoding step in a CUDA graph): the llama-1b shape 1.417 ms a step
# against 1.229, SmolLM2's shapes 0.760 against 0.746.
PREFETCH_BYTES = 1 << 16


def pdl_keywords(b: torch.Tensor, plan, pdl: bool) -> dict:
    """split_k_kernel's dependent-launch keywords (every one passed: a defaulted keyword would
    send each launch down Triton's own path, kernels.launch). With `pdl`, the weight b (K, N)
    is prefetched in lines of 128 bytes along K, as many as the piece has up to PREFETCH_BYTES
    a program (a power of two)."""
    if not pdl:
        return dict(**dependent_keywords(False), PREFETCH_ROWS=0, LINE=64)
    line = 128 // b.element_size()
    rows = min(cdiv(plan.k_per_split, line), PREFETCH_BYTES // (128 * plan.tile.BLOCK_N))
    return dict(**dependent_keywords(True), PREFETCH_ROWS=next_power_of_2(rows) if rows else 0,
                LINE=line)  # fmt: skip


def _with_splits(plan, K: int, splits: int):
    """`plan`'s tile with K cut into at most `splits` pieces (whole BLOCK_K steps, none empty)."""
    steps = cdiv(K, plan.tile.BLOCK_K)
    per = cdiv(steps, min(splits, steps))
    return tuning.Plan(plan.tile, cdiv(steps, per), per * plan.tile.BLOCK_K)


def product(
    a, b, *, kind, scale=None, bias=None, activation=None, splits=None, gated=False, norm=None,
    squares=None,
):  # fmt: skip
    """act(a @ b * scale + bias) (activation "swiglu": see store_output) for validated operands
    through the plan that kernels.split_k_tuning picks for (kind, N, K, the dtypes, the
    device): the launcher behind matmul_split_k, kernels.gemv.linear, kernels.int8.linear,
    (gated: a is (M, 2K), the product is silu(gate) * up @ b) kernels.decode.swiglu_linear,
    (norm: see _run; a and res contiguous, stream like a) kernels.decode.norm_linear and
    (squares: see _run; a contiguous) kernels.decode.squares_linear."""
    M, K, N = a.shape[0], b.shape[0], b.shape[1]
    glu = activation == "swiglu"  # b's columns alternate gate and up: N / 2 outputs
    if M == 0 or N == 0 or (K == 0 and glu):  # silu(0) * 0 = 0
        return torch.zeros((M, N // 2 if glu else N), dtype=a.dtype, device=a.device)
    if K == 0:  # an empty sum: zeros, then the epilogue
        return matmul_ref(a[:, :0], b.to(a.dtype), bias, activation)
    plan = choose_plan(a, b, kind, scale, bias, activation, gated, splits)
    return _run(a, b, plan, scale, bias, activation, gated, norm, squares)


def choose_plan(a, b, kind, scale=None, bias=None, activation=None, gated=False, splits=None):
    """The plan of kernels.split_k_tuning for (kind, N, K, the dtypes, the device), timed (on
    its first call for the key) with this product's scale, bias and activation; `splits`: K
    cut into at most that many pieces instead of the plan's."""
    K, N = b.shape
    key = (a.dtype, b.dtype, a.device.index, input_precision(a.dtype), gated)
    copies = []  # b's rotating copies, made on the first timing

    def time_plan(candidate, rows):  # a fresh a of `rows` rows, the caller's b, scale, bias
        x = torch.randn((rows, a.shape[1]), device=a.device).to(a.dtype)
        run = lambda w: _run(x, w, candidate, scale, bias, activation, gated)
        # back to back in a CUDA graph over copies of b that outgrow the L2 (at most 256: a
        # tiny b's ranking needs no more): short runs, a ranking, not a measurement
        copies[:] = copies or rotating_copies(b, min(l2_bytes(), 255 * b.nbytes))
        try:
            return rotating_graph_ms(run, [(w,) for w in copies], rep_ms=20)
        except (OutOfResources, PTXASError):  # a tile too large for this GPU never wins
            return float("inf")

    capturing = a.is_cuda and torch.cuda.is_current_stream_capturing()  # nothing can be timed
    plan = tuning.plan(kind, N, K, key, time_plan, remember=not capturing)
    return plan if splits is None else _with_splits(plan, K, splits)


def check_splits(splits):
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)):
        raise TypeError(f"splits must be an int or None, got {type(splits).__name__}")
    if splits is not None and not 1 <= splits <= tuning.MAX_SPLITS:
        raise ValueError(f"splits must be between 1 and {tuning.MAX_SPLITS}, got {splits}")


def _matmul_split_k(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    splits: int | None,
) -> torch.Tensor:
    return product(a, b, kind="matmul", bias=bias, activation=activation, splits=splits)


def _matmul_split_k_fake(a, b, bias, activation, splits):
    return a.new_empty((a.shape[0], b.shape[1]))


# Forward only: no autograd is registered, so a backward through it raises (decode needs none).
matmul_split_k_op = operator("matmul_split_k", _matmul_split_k, fake=_matmul_split_k_fake)


def matmul_split_k(a, b, bias=None, activation=None, splits=None) -> torch.Tensor:
    """act(a @ b + bias) for a (M, K), b (K, N), bias (N,) or None, activation None, "gelu" or
    "relu", with K cut into `splits` pieces (default: kernels.split_k_tuning's choice from N, K,
    the dtype and the device, never from M) reduced in a fixed order. fp32 accumulation; the
    output has the inputs' dtype. The operator torch.ops.brrr.matmul_split_k; forward only."""
    check_matmul_inputs(a, b, bias, activation)
    check_splits(splits)
    call = forward_road(matmul_split_k_op, a, b, bias)  # the roads of kernels.operators
    if call is None:
        return _matmul_split_k(a, b, bias, activation, splits)
    return call(a, b, bias, activation, splits)


def matmul_split_k_ref(a, b, bias=None, activation=None, splits=None) -> torch.Tensor:
    """kernels.matmul's reference (PyTorch's product in fp32, fp64 for fp64): the same maths
    whatever the split."""
    return matmul_ref(a, b, bias, activation)
