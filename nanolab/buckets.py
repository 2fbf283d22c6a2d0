"""The capture list: which decode shapes get a CUDA graph, and how a live batch finds its own.

Introduced on Day 52. A CUDA graph replays fixed shapes at fixed addresses, and the planned decode
step has two shape axes: the batch (rows) and the read rectangle's width. `DecodeBuckets` is the
grid of both; a live batch of `rows` whose longest row holds `max_ctx` tokens runs in the smallest
bucket that holds it, padded up (`lookup`). Padding is the price: padded rows run the whole model
and padded width is gathered and scored by the reference read (`padding_waste`).

vLLM calls the batch axis its cudagraph capture sizes and keeps a lookup from batch size to padded
size; its read has no width axis to bucket. Day 60's streamed read removes ours: `without_width()`
keeps the batch axis alone (`widths` None), and a bucket is then (batch, None).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... up to hi, and hi itself when it is not a power of two times lo."""
    sizes = []
    n = lo
    while n < hi:
        sizes.append(n)
        n *= 2
    sizes.append(hi)
    return tuple(sizes)


@dataclass(frozen=True)
class DecodeBuckets:
    batch_sizes: tuple[int, ...]  # ascending
    widths: tuple[int, ...] | None  # ascending; None when the read has no width axis (Day 60)

    def __post_init__(self) -> None:
        for name, axis in (("batch_sizes", self.batch_sizes), ("widths", self.widths)):
            if axis is None and name == "widths":
                continue
            if not axis or list(axis) != sorted(set(axis)) or axis[0] < 1:
                raise ValueError(f"{name} must be distinct positive sizes in ascending order, got {axis}")

    @classmethod
    def default(cls, max_batch_size: int = 32, max_width: int = 8192, min_width: int = 256) -> DecodeBuckets:
        """Powers of two on both axes: batch 1 .. max_batch_size, width min_width .. max_width.
        The defaults give the seed's list of 36 shapes (6 batch sizes x 6 widths)."""
        if max_width < min_width:
            min_width = max_width
        return cls(_powers_of_two(1, max_batch_size), _powers_of_two(min_width, max_width))

    def without_width(self) -> DecodeBuckets:
        """The same batch axis and no width axis: the list a read with no rectangle needs."""
        return DecodeBuckets(self.batch_sizes, None)

    @property
    def shapes(self) -> list[tuple[int, int | None]]:
        """Every (batch, width), largest first: the order to capture in, so the first graph sizes the
        shared pool and every later one fits inside it."""
        if self.widths is None:
            return [(b, None) for b in reversed(self.batch_sizes)]
        return sorted(((b, w) for b in self.batch_sizes for w in self.widths), key=lambda s: (-s[0] * s[1], -s[0]))

    def __len__(self) -> int:
        return len(self.batch_sizes) * (1 if self.widths is None else len(self.widths))

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_width(self) -> int | None:
        return None if self.widths is None else self.widths[-1]

    def lookup(self, rows: int, max_ctx: int) -> tuple[int, int | None] | None:
        """The smallest bucket (batch, width) holding `rows` rows of at most `max_ctx` tokens, or
        None when the batch is outside the list (it then runs eagerly). Without a width axis any
        length fits, and the width is None."""
        batch = next((b for b in self.batch_sizes if b >= rows), None)
        if batch is None:
            return None
        if self.widths is None:
            return batch, None
        width = next((w for w in self.widths if w >= max_ctx), None)
        return None if width is None else (batch, width)


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
