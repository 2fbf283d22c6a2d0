"""The stale-plan gate goes by epoch: an older plan is refused even when every table length it
planned still holds (a plan for other rows came after it, or its row was reused)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache

from nanolab.engine.kv_cache import KVCache
from nanolab.engine.plan import check_plan_current


def write(cache: KVCache, rows: list[int], lengths: list[int]) -> None:
    """Write `lengths[i]` random tokens into each of `rows`, through a planned varlen step."""
    view = cache.view(cache.plan_varlen(rows, lengths))
    kv = torch.randn(1, sum(lengths), 1, 4)
    view.write(0, kv, kv)


def cache_with(lengths) -> tuple[KVCache, list[int]]:
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=32, block_size=4, max_rows=4)
    rows = [cache.blocks.open_row() for _ in lengths]
    write(cache, rows, list(lengths))
    return cache, rows


def test_a_plan_for_other_rows_makes_the_older_plan_stale():
    """Planning other rows leaves this plan's rows as long as it planned them, but its buffers now
    hold the newer plan's write slots: only the epoch tells."""
    cache, (a, b, c) = cache_with([5, 9, 3])
    old = cache.plan_decode([a, b])
    assert check_plan_current(cache, old)
    new = cache.plan_decode([c])  # a and b keep the lengths `old` planned
    assert [cache.blocks.table(r).num_tokens for r in (a, b)] == list(old.planned_lens)
    gate = check_plan_current(cache, old)
    assert not gate and gate.numbers["stale_rows"] == 0 and gate.numbers["epoch"] < gate.numbers["newest"]
    assert check_plan_current(cache, new)
    with pytest.raises(RuntimeError, match="stale"):
        cache.view(old)
    cache.view(new)


def test_a_reused_row_at_the_planned_length_does_not_revive_an_old_plan():
    cache, (a, b) = cache_with([5, 7])
    old = cache.plan_decode([a, b])  # b planned at 8 tokens
    cache.blocks.free_row(b)
    d = cache.blocks.open_row()
    assert d == b  # the freed row is handed out again
    write(cache, [d], [7])
    new = cache.plan_decode([d])  # d now holds 8 tokens in b's row; a still holds 6
    assert [cache.blocks.table(r).num_tokens for r in old.rows] == list(old.planned_lens)
    assert not check_plan_current(cache, old)
    with pytest.raises(RuntimeError, match="stale"):
        cache.view(old)
    assert check_plan_current(cache, new)


def test_the_same_rows_planned_twice_leave_only_the_newest_current():
    cache, rows = cache_with([4, 6])
    plans = [cache.plan_decode(rows) for _ in range(3)]
    assert [bool(check_plan_current(cache, p)) for p in plans] == [False, False, True]
