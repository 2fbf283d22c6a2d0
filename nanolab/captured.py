"""What a decode step holds: the score rectangle the reference read builds, and the tile that replaces it.

Day 54 priced the read's workspace: `paged_attention_batched_reference` scores every row against
the batch's widest history, a [rows, heads, query_len, width] rectangle (`score_cells`,
`workspace_bytes`), and that rectangle is what the shared capture pool is sized by.

Day 59's streamed read (`nanolab.kernels.paged_attention`) holds one [block] score tile per
(row, head) program instead (`streamed_score_cells`, `streamed_workspace_bytes`). rows, heads and
query_len appear in both terms and cancel, so the saving is `width / block` and nothing else
(`workspace_saving`). The kernel also walks only each row's own tiles: `streamed_work` counts
them against the tiles a rectangle of the same width implies. `streambench_table` is the seed's
host-only table, rebuilt from this arithmetic.

Host arithmetic only: plain ints in, plain numbers out, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from nanolab.cache import cdiv

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
