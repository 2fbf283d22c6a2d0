"""`DecodeBuckets`: which decode shapes get a CUDA graph, and how a live batch finds its own.

A graph replays fixed shapes. The planned step has two shape axes, the batch and the reference
read's width; a live batch runs in the smallest bucket that holds it, padded up (`lookup`). vLLM
calls the batch axis its cudagraph capture sizes. The streamed read has no width:
`without_width()` keeps the batch axis alone, and a bucket is then (batch, None).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    widths: tuple[int, ...] | None  # ascending; None when the read has no width axis

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
