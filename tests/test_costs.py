"""Day 54's rectangle arithmetic and Day 59's streamed counterpart, against the seed's numbers."""

from __future__ import annotations

import pytest

from nanolab.lab.costs import (
    SEED_STREAMBENCH,
    SPREADS,
    StreamedWork,
    render_streambench,
    score_cells,
    spread_lengths,
    streambench_table,
    streamed_score_cells,
    streamed_work,
    streamed_workspace_bytes,
    workspace_bytes,
    workspace_saving,
)


def _seed_rows():
    for line in SEED_STREAMBENCH.splitlines()[1:]:
        cells = line.split()
        if cells[2] == "long":
            cells[2:4] = ["long tail"]
        yield cells


def test_rectangle_and_tile_arithmetic():
    assert score_cells(256, 32, 8192) == 256 * 32 * 8192
    assert workspace_bytes(256, 32, 8192) == 268_435_456
    assert workspace_bytes(2, 4, 10, query_len=3, itemsize=2) == 2 * 4 * 3 * 10 * 2
    assert streamed_score_cells(256, 32, 128) == 256 * 32 * 128
    assert streamed_workspace_bytes(256, 32, 128) == 4_194_304
    assert streamed_workspace_bytes(2, 4, 16, query_len=3, itemsize=2) == 2 * 4 * 3 * 16 * 2


@pytest.mark.parametrize("rows,heads,query_len", [(1, 1, 1), (8, 32, 1), (256, 9, 4)])
def test_saving_is_width_over_block_alone(rows, heads, query_len):
    for width, block in [(2048, 128), (8192, 128), (1000, 64)]:
        rect = workspace_bytes(rows, heads, width, query_len)
        tile = streamed_workspace_bytes(rows, heads, block, query_len)
        assert rect / tile == pytest.approx(workspace_saving(width, block))
    assert workspace_saving(8192, 128) == 64


def test_streamed_work_counts_the_seeds_long_tail():
    work = streamed_work([2048] + [256] * 7, 128)
    assert work == StreamedWork(rows=8, width=2048, block=128, walked=30, rect_tiles=128)
    assert work.wasted_tiles == 98
    assert work.ragged_saving == pytest.approx(128 / 30)
    uniform = streamed_work([100, 100], 16)
    assert (uniform.walked, uniform.rect_tiles, uniform.wasted_tiles, uniform.ragged_saving) == (14, 14, 0, 1.0)
    assert streamed_work([1, 17], 16, width=64).rect_tiles == 8  # an explicit width (a bucket) is charged


def test_streamed_work_refusals():
    with pytest.raises(ValueError, match="non-empty"):
        streamed_work([4, 0], 16)
    with pytest.raises(ValueError, match="non-empty"):
        streamed_work([], 16)
    with pytest.raises(ValueError, match="narrower"):
        streamed_work([40], 16, width=32)


def test_spread_lengths():
    assert spread_lengths(3, 64, "uniform") == [64, 64, 64]
    assert spread_lengths(4, 64, "2x") == [64, 32, 64, 32]
    assert spread_lengths(5, 64, "4x") == [64, 32, 16, 8, 64]
    assert spread_lengths(9, 2048, "long tail") == [2048] + [256] * 7 + [2048]
    for spread in SPREADS:
        assert max(spread_lengths(8, 2048, spread)) == 2048
    with pytest.raises(ValueError, match="unknown spread"):
        spread_lengths(2, 64, "zipf")
    with pytest.raises(ValueError, match="does not divide"):
        spread_lengths(2, 100, "long tail")


def test_streambench_table_equals_the_seed_cell_by_cell():
    table = streambench_table()
    seed = list(_seed_rows())
    assert len(table) == len(seed) == 11
    for (_, row), cells in zip(table.iterrows(), seed, strict=True):
        rows, width, spread, rect_mb, _, tile_mb, _, holds, walked, rect_tiles, walks = cells
        assert (row["rows"], row["width"], row["spread"]) == (int(rows), int(width), spread)
        assert round(row["rectangle MB"], 1) == float(rect_mb)
        assert round(row["tile MB"], 2) == float(tile_mb)
        assert row["holds"] == float(holds.rstrip("x"))
        assert (row["walked"], row["rect tiles"]) == (int(walked), int(rect_tiles))
        assert round(row["walks"], 2) == float(walks.rstrip("x"))


def test_streambench_renders_as_the_seed_prints_it():
    assert render_streambench(streambench_table()) == SEED_STREAMBENCH
