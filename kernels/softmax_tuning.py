"""The choices behind kernels.softmax: for a (rows, n_cols) input, which kernel, how many rows
or how much of a row each program takes, and how many warps. plan() makes the decision once
per call from the shape, the element size and the SM count.

Four paths, by row length and row count (n = n_cols, e = bytes per element):
- "rows", short rows (n <= SHORT_MAX_COLS): several rows per program, so that a program loads
  a tile of about TILE_ELEMENTS values, not a few hundred: one read, one write (2 n e a row).
- "row", mid rows (n <= FUSED_MAX_COLS): one row per program, held whole in registers: one
  read, one write.
- "split", long rows and few of them (fewer than SPLIT_BELOW_ROWS_PER_SM rows per SM): one
  row per program would leave SMs idle (512 rows of 393216 are under 4 waves of 132 programs),
  so each row is cut into `splits` pieces. Pass 1, one program per piece: the piece's max and
  sum of exp(x - max) (online softmax), into a small fp32 buffer of (rows, splits). Pass 2, one
  program per piece again: combine the row's partials (m = max m_i, s = sum s_i exp(m_i - m)),
  then read the piece again and write exp(x - m) / s. The input is read twice: 3 units of
  traffic (read, read, write) instead of the fused path's 2, so it can reach at most 2/3 of the
  copy rate, and it pays when the alternative leaves the SMs idle.
- "streamed", long rows and many of them: one program per row, the online recurrence over
  blocks of STREAM_BLOCK (pass 1), then the row again (pass 2): also 3 units, but the second
  read of a row is often served from L2 while other rows are in flight.

Measured on an H200 (`python -m kernels bench shapes`, its "softmax sweep" rows of 2^25
elements, 2026-12-03): FUSED_MAX_COLS, the warp rule and SHORT_MAX_COLS. At 1024 and 2048
columns "row" beat "rows" (bf16 0.0372 ms against 0.0417 and 0.0419; fp32 0.0369 against 0.0375,
0.0377 against 0.0420), so "rows" keeps only rows shorter than the sweep measured. The other
thresholds were chosen on a CPU, where the interpreter's timings mean nothing: guesses for an
H200, to be set from the same sweep.
"""

from dataclasses import dataclass

from kernels.launch import cdiv, next_power_of_2
from kernels.runtime import processors

PATHS = ("rows", "row", "split", "streamed")

FUSED_MAX_COLS = 32768  # longest row kept whole in registers (fp32: 32 values per thread)
STREAM_BLOCK = 8192  # columns per step of the streamed and split kernels
SHORT_MAX_COLS = 512  # rows up to this long share a program with other rows
# Not yet measured on a GPU (guesses, see the module docstring):
TILE_ELEMENTS = 8192  # values one program of the "rows" path loads (rows x padded row)
SPLIT_BELOW_ROWS_PER_SM = 4  # long rows, fewer rows than this per SM: split each row
SPLIT_PROGRAMS_PER_SM = 4  # the split path aims at this many programs per SM
SPLIT_MIN_COLS = 16384  # the shortest piece of a row worth its own program
MAX_SPLITS = 1024  # pieces of one row at most (pass 2 loads a row's partials at once)


@dataclass(frozen=True)
class Plan:
    path: str  # one of PATHS
    block: int  # columns one load covers (a power of two): the whole padded row for rows/row
    num_warps: int
    rows_per_program: int = 1  # "rows" only
    splits: int = 1  # "split" only: programs per row
    cols_per_split: int = 0  # "split" only: a multiple of block


def num_warps(elements: int, most: int) -> int:
    """16 values per thread: 4 warps for 2048 values, 8 for 4096, 16 for 8192, up to `most`.
    Measured on an H200 (scripts/tune_fusion.py): 16 warps at 4096 lost a fifth of the
    bandwidth to 8; a row of 2048 wanted 4."""
    return min(most, max(1, elements // 512))


_plans: dict = {}  # what plan() decided, by its arguments: one lookup per call after the first


def plan(n_rows: int, n_cols: int, path: str | None = None, sms: int | None = None) -> Plan:
    """How to compute softmax over (n_rows, n_cols), n_rows and n_cols > 0: the rules above,
    or with `path` one of PATHS that path whatever the shape (for tests and comparisons).
    Deciding costs microseconds of host time, more than a small softmax runs: each decision
    is kept (a test that changes the thresholds empties `_plans`)."""
    key = (n_rows, n_cols, path, sms)
    how = _plans.get(key)
    if how is None:
        if len(_plans) >= 4096:  # a bound on shapes seen, not a tuning
            _plans.clear()
        how = _plans[key] = _decide(n_rows, n_cols, path, sms)
    return how


def _decide(n_rows: int, n_cols: int, path: str | None, sms: int | None) -> Plan:
    if path is None:
        path = _choose(n_rows, n_cols, sms or processors())
    elif path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    padded = next_power_of_2(n_cols)
    if path in ("rows", "row"):
        rows = 1
        if path == "rows":  # never more rows than exist
            rows = min(max(1, TILE_ELEMENTS // padded), next_power_of_2(n_rows))
        return Plan(path, padded, num_warps(rows * padded, 32), rows_per_program=rows)
    block = min(STREAM_BLOCK, padded)
    if path == "streamed":
        return Plan(path, block, num_warps(block, 16))
    splits, cols_per_split = split_rule(n_rows, n_cols, block, sms or processors())
    return Plan(path, block, num_warps(block, 16), splits=splits, cols_per_split=cols_per_split)


def _choose(n_rows: int, n_cols: int, sms: int) -> str:
    if n_cols <= SHORT_MAX_COLS:
        return "rows"
    if n_cols <= FUSED_MAX_COLS:
        return "row"
    if n_rows < SPLIT_BELOW_ROWS_PER_SM * sms:
        return "split"
    return "streamed"


def split_rule(n_rows: int, n_cols: int, block: int, sms: int) -> tuple[int, int]:
    """(splits, cols_per_split): enough pieces per row that n_rows x splits programs reach
    SPLIT_PROGRAMS_PER_SM per SM, each piece whole blocks and at least SPLIT_MIN_COLS long
    (shorter rows are not cut), none empty."""
    want = cdiv(SPLIT_PROGRAMS_PER_SM * sms, n_rows)
    splits = max(1, min(want, n_cols // SPLIT_MIN_COLS, MAX_SPLITS))
    cols_per_split = cdiv(cdiv(n_cols, splits), block) * block
    return cdiv(n_cols, cols_per_split), cols_per_split
