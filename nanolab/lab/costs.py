"""The cost arithmetic the chapters print: host ints in, plain numbers out, no tensors (except
`weight_bytes`, which counts a model's parameters).

- Day 50: the `[rows, max_ctx]` slot mapping rebuilt every step, quadratic in the run
  (`rebuild_cells`), against the cells that change (`appended_cells`); `check_rebuild_bounded`.
- Day 52: what a live batch pays for running padded in its capture bucket (`padding_waste`).
- Day 54: the reference read's score rectangle [rows, heads, query_len, width] (`workspace_bytes`).
- Day 59: the streamed read's tile (`streamed_workspace_bytes`): rows, heads and query_len cancel,
  so the saving is `width / block`; and the tiles it walks (`streamed_work`). `streambench_table`
  is the seed's host-only table, rebuilt from this arithmetic.
- The capture bench's floor: the bytes a decode step must read (`weight_bytes`, `kv_read_bytes`);
  Day 61's from the config alone (`step_read_bytes`), so every system at these shapes meets one floor.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from nanolab.engine.block_manager import cdiv
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.kv_cache import kv_bytes_per_block
from nanolab.engine.plan import mapping_bytes  # noqa: F401  (Day 50's arithmetic, re-exported)
from nanolab.gates import Gate
from nanolab.model.config import ModelConfig

# --- Day 50: the rectangle rebuilt every step ---------------------------------------------------


def mapping_cells(rows: int, width: int) -> int:
    return rows * width


def rebuild_cells(rows: int, prompt_len: int, steps: int) -> int:
    """Cells of the [rows, max_ctx] mapping rebuilt over `steps` decode steps from a prompt of
    `prompt_len`: step i is rows * (prompt_len + i) wide, so the sum is quadratic in steps."""
    return rows * (steps * prompt_len + steps * (steps + 1) // 2)


def appended_cells(rows: int, steps: int) -> int:
    """Cells that actually change: one new token per row per step."""
    return rows * steps


def rebuild_ratio(rows: int, prompt_len: int, steps: int) -> float:
    return rebuild_cells(rows, prompt_len, steps) / appended_cells(rows, steps)


def check_rebuild_bounded(rows: int, prompt_len: int, steps: int, limit: float = 32.0,
                          rebuilt: int | None = None) -> Gate:
    """Cells rebuilt per cell appended stays under `limit` over a run of `steps`.

    `rebuilt` is a measured count, the cells a cache really wrote from the host over the run
    (`KVCache.host_cells`, Day 51). Without it the gate prices Day 50's design, which
    rebuilt the whole rectangle every step (`rebuild_cells`)."""
    cells = rebuild_cells(rows, prompt_len, steps) if rebuilt is None else rebuilt
    ratio = cells / appended_cells(rows, steps)
    return Gate("check_rebuild_bounded", ratio <= limit, {
        "rebuild_cells": cells, "appended_cells": appended_cells(rows, steps),
        "ratio": round(ratio, 2), "limit": limit})


# --- Day 52: padding up to a bucket ------------------------------------------------------------


@dataclass(frozen=True)
class PaddingWaste:
    """What running `rows` x `max_ctx` in bucket `batch` x `width` costs beyond the live batch."""

    rows: int
    max_ctx: int
    batch: int
    width: int | None  # None: no width axis, each row reads its own length

    @property
    def padded_rows(self) -> int:
        return self.batch - self.rows

    @property
    def cells(self) -> int:
        """Cells of the bucket's read rectangle [batch, width]; without a width, each of the batch's
        rows charged the live batch's longest row."""
        return self.batch * (self.max_ctx if self.width is None else self.width)

    @property
    def live_cells(self) -> int:
        """Cells the live batch's own rectangle [rows, max_ctx] would have."""
        return self.rows * self.max_ctx

    @property
    def waste_share(self) -> float:
        return 1 - self.live_cells / self.cells


def padding_waste(buckets: DecodeBuckets, rows: int, max_ctx: int) -> PaddingWaste:
    shape = buckets.lookup(rows, max_ctx)
    if shape is None:
        raise ValueError(f"{rows} rows x {max_ctx} tokens is outside the capture list")
    return PaddingWaste(rows, max_ctx, *shape)


def bucket_table(buckets: DecodeBuckets) -> pd.DataFrame:
    """One line per bucket: the live batches it serves, and the worst padding a batch in it pays
    (one row more and one token wider than the bucket below it), in rows and in read cells."""
    records = []
    for i, b in enumerate(buckets.batch_sizes):
        lo_b = buckets.batch_sizes[i - 1] + 1 if i else 1
        widths = [None] if buckets.widths is None else buckets.widths
        for j, w in enumerate(widths):
            lo_w = buckets.widths[j - 1] + 1 if j and w is not None else 1
            worst = PaddingWaste(lo_b, lo_w, b, w)
            records.append({"batch": b, "width": w, "rows": f"{lo_b}-{b}",
                            "tokens": "any" if w is None else f"{lo_w}-{w}",
                            "worst padded rows": worst.padded_rows, "worst waste": worst.waste_share})
    return pd.DataFrame.from_records(records)


# --- Day 54: the rectangle ------------------------------------------------------------------


def score_cells(rows: int, heads: int, width: int, query_len: int = 1) -> int:
    """Cells of the reference read's score rectangle [rows, heads, query_len, width]."""
    return rows * heads * query_len * width


def workspace_bytes(rows: int, heads: int, width: int, query_len: int = 1, itemsize: int = 4) -> int:
    """Bytes of that rectangle; fp32 (4) by default, the dtype the reference's softmax runs in."""
    return score_cells(rows, heads, width, query_len) * itemsize


# --- Day 59: the tile ------------------------------------------------------------------------


def streamed_score_cells(rows: int, heads: int, block: int, query_len: int = 1) -> int:
    """Score cells the streamed read holds at once: one [block] tile per (row, head, query) program."""
    return rows * heads * query_len * block


def streamed_workspace_bytes(rows: int, heads: int, block: int, query_len: int = 1, itemsize: int = 4) -> int:
    return streamed_score_cells(rows, heads, block, query_len) * itemsize


def workspace_saving(width: int, block: int) -> float:
    """Rectangle over tile. rows, heads and query_len are in both and cancel: the saving is a
    property of the width axis alone."""
    return width / block


@dataclass(frozen=True)
class StreamedWork:
    """Tiles the streamed read walks for one batch, against the tiles a rectangle of the batch's
    width implies (every row charged the widest row's history)."""

    rows: int
    width: int
    block: int
    walked: int  # sum over rows of cdiv(context_len, block): what the kernel's loop runs
    rect_tiles: int  # rows * cdiv(width, block): what the rectangle scores

    @property
    def wasted_tiles(self) -> int:
        """Tiles the rectangle scores that hold nothing but padding."""
        return self.rect_tiles - self.walked

    @property
    def ragged_saving(self) -> float:
        """Rectangle tiles over walked tiles: 1.0 for a uniform batch, the length spread otherwise."""
        return self.rect_tiles / self.walked


def streamed_work(context_lens, block: int, width: int | None = None) -> StreamedWork:
    """Count the walk for `context_lens` (ints, or anything iterable of ints: a host list, a CPU
    tensor). `width` defaults to the longest row, which is the reference's rectangle width."""
    lens = [int(n) for n in context_lens]
    if not lens or min(lens) < 1:
        raise ValueError(f"streamed_work needs at least one row and every row non-empty, got {lens}")
    width = max(lens) if width is None else width
    if width < max(lens):
        raise ValueError(f"width {width} is narrower than the longest row ({max(lens)} tokens)")
    return StreamedWork(rows=len(lens), width=width, block=block,
                        walked=sum(cdiv(n, block) for n in lens), rect_tiles=len(lens) * cdiv(width, block))


# --- the streambench table (host only, no weights) --------------------------------------------

SPREADS = ("uniform", "2x", "4x", "long tail")
# Each spread is a repeating pattern of row lengths, as fractions of the width. "2x" and "4x" are
# two and four halving levels; "long tail" is the seed's example of a batch of eight: one row at
# the full width and seven at an eighth of it (2048 and 256 at width 2048).
_PATTERNS = {
    "uniform": (1,),
    "2x": (1, 2),
    "4x": (1, 2, 4, 8),
    "long tail": (1, 8, 8, 8, 8, 8, 8, 8),
}

# The seed's printed table (Day 59), verbatim: `render_streambench(streambench_table())` must equal it.
SEED_STREAMBENCH = """\
 rows  width     spread    rectangle       tile   holds   walked  rect tiles  walks
    8   2048    uniform       2.1 MB    0.13 MB     16x      128         128  1.00x
    8   2048         2x       2.1 MB    0.13 MB     16x       96         128  1.33x
    8   2048         4x       2.1 MB    0.13 MB     16x       60         128  2.13x
    8   2048  long tail       2.1 MB    0.13 MB     16x       30         128  4.27x
    8   8192    uniform       8.4 MB    0.13 MB     64x      512         512  1.00x
    8   8192  long tail       8.4 MB    0.13 MB     64x      120         512  4.27x
   32   8192         4x      33.6 MB    0.52 MB     64x      960        2048  2.13x
   32   8192  long tail      33.6 MB    0.52 MB     64x      480        2048  4.27x
  256   2048  long tail      67.1 MB    4.19 MB     16x      960        4096  4.27x
  256   8192    uniform     268.4 MB    4.19 MB     64x    16384       16384  1.00x
  256   8192  long tail     268.4 MB    4.19 MB     64x     3840       16384  4.27x"""

# The seed's table: (rows, width, spread), 32 heads, 128-key tiles.
STREAMBENCH_SHAPES = (
    (8, 2048, "uniform"), (8, 2048, "2x"), (8, 2048, "4x"), (8, 2048, "long tail"),
    (8, 8192, "uniform"), (8, 8192, "long tail"),
    (32, 8192, "4x"), (32, 8192, "long tail"),
    (256, 2048, "long tail"),
    (256, 8192, "uniform"), (256, 8192, "long tail"),
)


def spread_lengths(rows: int, width: int, spread: str) -> list[int]:
    """Row lengths of a batch `width` wide whose lengths follow `spread` (one of SPREADS). Row i
    holds width // pattern[i % len(pattern)] tokens, so row 0 is always the widest."""
    if spread not in _PATTERNS:
        raise ValueError(f"unknown spread {spread!r}; one of {SPREADS}")
    pattern = _PATTERNS[spread]
    if width % max(pattern):
        raise ValueError(f"width {width} does not divide into the {spread!r} pattern {pattern}")
    return [width // pattern[i % len(pattern)] for i in range(rows)]


def streambench_table(heads: int = 32, block: int = 128, shapes=STREAMBENCH_SHAPES, itemsize: int = 4) -> pd.DataFrame:
    """The seed's host-only table: per shape, the rectangle's and the tile's workspace (decimal MB),
    how many times smaller the tile is, and tiles walked against rectangle tiles."""
    records = []
    for rows, width, spread in shapes:
        work = streamed_work(spread_lengths(rows, width, spread), block, width)
        records.append({
            "rows": rows,
            "width": width,
            "spread": spread,
            "rectangle MB": workspace_bytes(rows, heads, width, itemsize=itemsize) / 1e6,
            "tile MB": streamed_workspace_bytes(rows, heads, block, itemsize=itemsize) / 1e6,
            "holds": workspace_saving(width, block),
            "walked": work.walked,
            "rect tiles": work.rect_tiles,
            "walks": work.ragged_saving,
        })
    return pd.DataFrame.from_records(records)


def render_streambench(table: pd.DataFrame) -> str:
    """The table as the seed prints it."""
    widths = {"rows": 5, "width": 7, "spread": 11, "rectangle MB": 13, "tile MB": 11, "holds": 8,
              "walked": 9, "rect tiles": 12, "walks": 7}
    headers = {"rectangle MB": "rectangle", "tile MB": "tile"}
    cells = {
        "rectangle MB": lambda x: f"{x:.1f} MB",
        "tile MB": lambda x: f"{x:.2f} MB",
        "holds": lambda x: f"{x:.0f}x",
        "walks": lambda x: f"{x:.2f}x",
    }
    lines = ["".join(headers.get(c, c).rjust(w) for c, w in widths.items())]
    for _, row in table.iterrows():
        lines.append("".join(cells.get(c, str)(row[c]).rjust(w) for c, w in widths.items()))
    return "\n".join(lines)


# --- the floor of a decode step ----------------------------------------------------------------


def weight_bytes(model) -> int:
    """Bytes of every distinct parameter: what a decode step must stream at least once."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def kv_read_bytes(config: ModelConfig, batch: int, context: int, dtype) -> int:
    """Bytes of K and V a decode step reads: each row's whole history, every layer."""
    per_token = kv_bytes_per_block(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 1, dtype)
    return batch * context * per_token


def step_read_bytes(config: ModelConfig, batch: int, context: int, dtype) -> int:
    """Bytes one decode step must read at least: every weight once (a tied head once) and each of
    `batch` rows' K and V over `context` tokens, every layer."""
    return config.num_parameters() * dtype.itemsize + kv_read_bytes(config, batch, context, dtype)
