"""The choices behind kernels.split_k (and the decode GEMV and int8 GEMV built on it): which
tile, and how many pieces K is cut into, for a product with an N x K right-hand side.

Every choice here is a function of (N, K, the dtypes, the device), never of M, the number of
rows: a row's bits then cannot depend on how many rows are batched with it (Chapter 5). On a
GPU the tile comes from a small list, timed once per (kind, N, K, dtypes) at fixed row counts
(TUNE_ROWS, not the caller's M, in a CUDA graph: see below) and kept for the rest of the
process; the interpreter takes one small tile, untimed. Set AUTOTUNE = False to take each list's
first entry without timing (the same choice in every process, where timing noise could pick
differently). The first call of a shape does that timing: make it before any CUDA graph
capture (a warm-up call, as torch.compile's "reduce-overhead" mode and bench.rotating_graph_ms
make); a call inside a capture takes the plan chosen before, else the first, unremembered.

Not yet measured: these lists are what a Hopper GPU should like, to be confirmed by
`python -m kernels bench decode` on an H200 and pruned to what wins.
"""

from dataclasses import dataclass

from kernels.launch import cdiv
from kernels.runtime import ON_GPU, pick, processors


@dataclass(frozen=True)
class Tile:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 3

    def meta(self) -> dict:
        return {"BLOCK_M": self.BLOCK_M, "BLOCK_N": self.BLOCK_N, "BLOCK_K": self.BLOCK_K,
                "num_warps": self.num_warps, "num_stages": self.num_stages}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    tile: Tile
    splits: int  # pieces of K; 1: one kernel writes the output, no partial sums
    k_per_split: int  # a multiple of BLOCK_K


# Large K, small M x N (256 x 256 x 524288, KernelBench's "large K"): compute-bound tiles as in
# kernels.matmul_tuning, each on a slice of K; the split then fills the SMs.
MATMUL_TILES = pick(
    cpu=[Tile(16, 64, 32, num_stages=1)],
    gpu=[
        Tile(128, 128, 64, num_warps=8, num_stages=3),
        Tile(128, 128, 64, num_warps=4, num_stages=4),
        Tile(128, 256, 64, num_warps=8, num_stages=3),
        Tile(64, 128, 64, num_warps=4, num_stages=4),
        Tile(64, 64, 128, num_warps=4, num_stages=3),
    ],
)
# Decode, x (M <= 64, K) @ W.t(): memory-bound, each weight byte read once. tl.dot needs 16
# rows, so BLOCK_M >= 16 and rows past M are padding (free on tensor cores: M = 1 at
# BLOCK_M = 64 does 64x the FLOPs, about 12 us of a 28 us, 117 MB read on an H200, in the
# shadow of the loads). Narrow BLOCK_N puts many programs in flight; deep BLOCK_K makes each
# load long and contiguous (a weight row is K-contiguous). One tile serves every M, so a tile
# that wins at M = 1 but re-reads W from L2 at M = 64 loses to one that does well at both.
GEMV_TILES = pick(
    cpu=[Tile(16, 64, 32, num_stages=1)],
    gpu=[
        Tile(16, 64, 128, num_warps=4, num_stages=4),
        Tile(16, 32, 256, num_warps=4, num_stages=4),
        Tile(16, 128, 128, num_warps=4, num_stages=3),
        Tile(32, 64, 128, num_warps=4, num_stages=4),
        Tile(64, 64, 128, num_warps=4, num_stages=3),
        Tile(64, 128, 64, num_warps=4, num_stages=4),
        # a small model's narrow weights (576 x 576: 9 programs at BLOCK_N = 64): more programs
        Tile(16, 16, 256, num_warps=2, num_stages=3),
        Tile(16, 16, 128, num_warps=2, num_stages=4),
    ],
)
# int8 weights: half the bytes per element, so twice the K per load for the same bytes, and
# tuned for the rows where weight-only int8 pays: a decoding step's few rows (TUNE_ROWS). At
# 64 rows each 16-row tile converts the same weight to bf16 again, and the tiles that win there
# (64 rows a tile) take 1.4x to 1.7x as long at one row as the best. On an H100 (2026-12-08,
# 14336 x 4096 and 4096 x 14336, in a CUDA graph) the least regret over 1, 16 and 64 rows took
# 1.49x and 1.31x the bf16 GEMV's speed at one row; over 1 and 16 rows, 1.75x and 1.75x (16 x
# 128 x 512, and 16 x 64 x 256 with 6 stages), and 0.60x and 0.57x at 64 rows, where bf16
# weights are the better choice.
INT8_TILES = pick(
    cpu=[Tile(16, 64, 32, num_stages=1)],
    gpu=[
        Tile(16, 64, 256, num_warps=4, num_stages=4),
        Tile(16, 64, 256, num_warps=4, num_stages=6),
        Tile(16, 128, 512, num_warps=8, num_stages=3),
        Tile(16, 128, 256, num_warps=8, num_stages=3),
        Tile(16, 32, 512, num_warps=4, num_stages=4),
        Tile(16, 128, 128, num_warps=4, num_stages=3),
        Tile(16, 16, 256, num_warps=2, num_stages=3),
    ],
)
TILES = {"matmul": MATMUL_TILES, "gemv": GEMV_TILES, "int8": INT8_TILES}
# The row counts a kind is timed at: a config must do well at each (decode runs 1 to 64).
TUNE_ROWS = {"matmul": (256,), "gemv": (1, 16, 64), "int8": (1, 16)}

AUTOTUNE = ON_GPU
# How a plan is timed: back to back in a CUDA graph, over copies of the weight that together
# outgrow the L2 (bench.rotating_graph_ms), as a model's decode step runs its layers and as the
# chapters measure the GEMVs. One call at a time, do_bench's fixed ~4.6 us a call made a small
# weight's ranking noise (on an H200, such choices gave a SmolLM2 decode step of 1.0 ms in one
# run and 1.5 ms in another), and a large weight's choice could disagree with the graph.
MAX_SPLITS = 128
# Each piece keeps at least this many BLOCK_K steps, so its loads can pipeline. The CPU value
# lets small test shapes split too.
MIN_STEPS_PER_SPLIT = pick(cpu=1, gpu=4)


def split_rule(N: int, K: int, tile: Tile, sms: int | None = None, waves: int | None = None):
    """(splits, k_per_split) from the shape's N and K and the device's SM count, never M.

    With N / BLOCK_N column tiles already covering the SMs, K is not split. Otherwise K is cut
    into enough pieces that the column tiles times the pieces cover the SMs once (for M up to
    one BLOCK_M; a larger M adds row tiles on top), each piece a whole number of BLOCK_K steps
    and at least MIN_STEPS_PER_SPLIT of them. For 256 x 256 x 524288 with 128-wide tiles on 132
    SMs: 2 column tiles, 66 pieces of 8000 (125 steps of 64, the last shorter); with M = 256,
    264 programs: two waves. With `waves`, instead as many pieces as keep the programs within
    that many programs an SM, none left over for a partial wave (4096 x 14336 with 64-wide
    tiles: 2 pieces for one wave, 4 for two, where the rule above takes 3: 192 programs)."""
    sms = sms or processors()
    tiles_n = cdiv(N, tile.BLOCK_N)
    steps = cdiv(max(K, 1), tile.BLOCK_K)
    if waves is None:
        want = 1 if tiles_n >= sms else cdiv(sms, tiles_n)
    else:
        want = waves * sms // tiles_n
    splits = max(1, min(want, steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
    steps_per_split = cdiv(steps, splits)
    splits = cdiv(steps, steps_per_split)  # rounding may leave fewer, none empty
    return splits, steps_per_split * tile.BLOCK_K


def candidates(kind: str, N: int, K: int) -> list[Plan]:
    """The plans worth timing: each tile with the split rule's pieces, and for decode kinds,
    where the rule split K, the same tile split to fill one and two whole waves, and unsplit.
    Whole waves: on an H200, bf16 N = 4096, K = 14336 in 64 x 64 x 128 tiles, the rule's 3
    pieces (192 programs, 1.45 an SM) read the weight at 3435 GB/s at one row and 4 pieces
    (256, 1.94 an SM) at 3656 (in a CUDA graph; 3295 against 3189 at 64 rows)."""
    plans = []
    for tile in TILES[kind]:
        rule = Plan(tile, *split_rule(N, K, tile))
        plans.append(rule)
        if kind != "matmul" and rule.splits > 1:
            waves = [Plan(tile, *split_rule(N, K, tile, waves=w)) for w in (1, 2)]
            whole = Plan(tile, 1, cdiv(max(K, 1), tile.BLOCK_K) * tile.BLOCK_K)
            plans += [p for p in dict.fromkeys([*waves, whole]) if p != rule]
    return plans


_chosen: dict = {}  # (kind, N, K, dtypes, device) -> Plan, for the life of the process


def plan(kind: str, N: int, K: int, key: tuple, time_plan=None, remember=True) -> Plan:
    """The plan for (kind, N, K) with `key` (dtypes, device): the first candidate, or on a GPU
    with AUTOTUNE the one with the least worst-case slowdown over TUNE_ROWS[kind], as timed by
    `time_plan(plan, rows) -> ms` once and remembered. remember=False (inside a CUDA graph
    capture, where nothing can be timed): the plan chosen before, else the first, untimed and
    not remembered."""
    cache_key = (kind, N, K, *key)
    chosen = _chosen.get(cache_key)
    if chosen is not None:
        return chosen
    plans = candidates(kind, N, K)
    chosen = plans[0]
    if not remember:
        return chosen
    if AUTOTUNE and time_plan is not None and len(plans) > 1:
        chosen = least_regret(plans, TUNE_ROWS[kind], time_plan)
    _chosen[cache_key] = chosen
    return chosen


def least_regret(plans, rows, time_plan):
    """The plan whose time at its worst row count is closest to that row count's best."""
    times = {(p, m): time_plan(p, m) for p in plans for m in rows}  # inf: did not run
    best = {m: min(times[p, m] for p in plans) for m in rows}
    ran = [m for m in rows if best[m] < float("inf")]  # a row count no plan ran at says nothing
    if not ran:
        return plans[0]
    return min(plans, key=lambda p: max(times[p, m] / best[m] for m in ran))


def chosen_plans() -> dict:
    """Every plan chosen so far in this process: after a benchmark run, the tiles that won."""
    return dict(_chosen)
