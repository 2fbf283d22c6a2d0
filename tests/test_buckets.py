"""Day 51's persistent block table and Day 52's capture buckets, on the CPU: the host writes one
table entry per new block, padded rows touch only the sink, and a bucketed engine decodes the
same tokens as an unbucketed one."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache, needs_smollm2
from test_engine import assert_all_free, ragged_prompts, run

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.plan import check_plan_addressing, check_plan_rows
from nanolab.lab.compilebench import decode_shape
from nanolab.lab.costs import appended_cells, bucket_table, check_rebuild_bounded, padding_waste, rebuild_cells
from nanolab.lab.history import unplanned_runner


def small_cache(**kw) -> KVCache:
    args = dict(num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=64, block_size=4, max_rows=8)
    return make_cache(**{**args, **kw})


def prefilled(cache: KVCache, lengths) -> list[int]:
    rows = []
    for n in lengths:
        row = cache.blocks.open_row()
        view = cache.view(cache.plan_varlen((row,), (n,)))
        k = torch.randn(1, n, 2, 4)
        for layer in range(cache.num_layers):
            view.write(layer, k, k)
        rows.append(row)
    return rows


# Day 51: the persistent table.

def test_the_block_table_is_one_buffer_written_an_entry_per_new_block():
    cache = small_cache()
    rows = prefilled(cache, [5, 9, 2])
    assert cache.host_cells == 2 + 3 + 1  # each prefill plan writes its row's blocks
    address = cache.block_table.data_ptr()
    before = cache.host_cells
    for _ in range(12):
        plan = cache.plan_decode(rows)
        assert plan.block_table is cache.block_table
        assert plan.write_slots.data_ptr() == cache.step_inputs["write_slots"].data_ptr()
        assert check_plan_addressing(cache, plan)
    # 12 steps from lengths 5, 9 and 2 at block 4 end at 17, 21 and 14 tokens, gaining 3 blocks each.
    assert cache.host_cells - before == 9 and cache.block_table.data_ptr() == address
    table = cache.block_table.cpu()
    for row in rows:
        assert table[row, : len(cache.blocks.table(row).blocks)].tolist() == cache.blocks.table(row).blocks


@pytest.mark.parametrize("steps", [512, 4096])
def test_rebuild_is_bounded_at_any_run_length_when_measured(steps):
    cache = small_cache(num_blocks=4 * 4096 // 4 + 16, max_rows=4)
    rows = prefilled(cache, [16] * 4)
    before = cache.host_cells
    for _ in range(steps):
        cache.plan_decode(rows)
    measured = cache.host_cells - before
    assert measured == 4 * (steps // 4)  # one entry per row per new block
    assert measured < appended_cells(4, steps) < rebuild_cells(4, 16, steps)
    assert check_rebuild_bounded(4, 16, steps, rebuilt=measured)
    assert not check_rebuild_bounded(4, 16, steps)  # Day 50's host rebuild, priced, fails


def test_the_measured_gate_fails_for_a_cache_that_rebuilds_its_table():
    # A cache that wrote every row's whole table every step is caught: it is Day 50's cost again.
    rows, prompt, steps = 4, 16, 512
    rewritten = sum(rows * (prompt + i) for i in range(1, steps + 1))
    assert not check_rebuild_bounded(rows, prompt, steps, rebuilt=rewritten)


def test_staging_keeps_only_the_newest_entry_of_a_reused_row():
    cache = small_cache()
    blocks = cache.blocks
    row = blocks.open_row()
    blocks.grow([row], [3])  # staged, not yet on the device
    first = blocks.table(row).blocks[0]
    blocks.free_row(row)
    blocks.open_row()  # the same row again, and a second row that takes the freed block
    other = blocks.open_row()
    blocks.grow([other, row], [3, 3])
    assert blocks.table(other).blocks[0] == first
    new = blocks.take_new_entries()
    assert new == {(row, 0): blocks.table(row).blocks[0], (other, 0): first}
    assert blocks.take_new_entries() == {}


# Padding up to a bucket.

def test_padded_rows_write_only_the_sink_and_read_only_the_sink():
    cache = small_cache()
    rows = prefilled(cache, [5, 9, 2])
    plan = cache.plan_decode(rows, batch_size=8, width=32)
    assert (plan.batch_size, plan.width, plan.padding_rows) == (8, 32, 5)
    assert check_plan_addressing(cache, plan) and check_plan_rows(plan, rows)
    assert plan.write_slots[3:].eq(-1).all() and plan.slot_mapping[3:].eq(-1).all()
    pools = [p.clone() for p in cache.k_pools]
    k = torch.randn(8, 1, 2, 4)
    cache.view(plan).write(0, k, k)
    changed = (cache.k_pools[0] != pools[0]).any(dim=(1, 2)).nonzero().flatten().tolist()
    live = sorted(plan.write_slots[:3].tolist())
    assert changed == live + [cache.k_pools[0].shape[0] - 1]  # the live rows' slots, and the sink


def test_plan_refuses_a_bucket_that_cannot_hold_the_batch():
    cache = small_cache()
    rows = prefilled(cache, [5, 9])
    with pytest.raises(ValueError, match="batch_size 1"):
        cache.plan_decode(rows, batch_size=1)
    with pytest.raises(ValueError, match="width 8"):
        cache.plan_decode(rows, width=8)
    with pytest.raises(ValueError, match="width 4096"):
        cache.plan_decode(rows, width=4096)
    with pytest.raises(ValueError, match="batch_size 9"):
        cache.plan_decode(rows, batch_size=9)


# Day 52: DecodeBuckets.

def test_the_default_list_is_the_seeds_36_shapes_largest_first():
    buckets = DecodeBuckets.default()
    assert buckets.batch_sizes == (1, 2, 4, 8, 16, 32) and buckets.widths == (256, 512, 1024, 2048, 4096, 8192)
    assert len(buckets) == len(buckets.shapes) == 36
    assert buckets.shapes[0] == (32, 8192) and buckets.shapes[-1] == (1, 256)
    areas = [b * w for b, w in buckets.shapes]
    assert areas == sorted(areas, reverse=True)


def test_lookup_is_the_smallest_bucket_that_holds_the_batch():
    buckets = DecodeBuckets((1, 2, 4, 8), (64, 128))
    assert buckets.lookup(1, 1) == (1, 64)
    assert buckets.lookup(3, 64) == (4, 64)
    assert buckets.lookup(3, 65) == (4, 128)
    assert buckets.lookup(8, 128) == (8, 128)
    assert buckets.lookup(9, 10) is None and buckets.lookup(1, 129) is None


def test_padding_waste_arithmetic():
    buckets = DecodeBuckets((1, 2, 4, 8), (64, 128))
    w = padding_waste(buckets, 5, 65)
    assert (w.batch, w.width, w.padded_rows, w.cells, w.live_cells) == (8, 128, 3, 1024, 325)
    assert w.waste_share == pytest.approx(1 - 325 / 1024)
    with pytest.raises(ValueError, match="outside"):
        padding_waste(buckets, 9, 1)
    table = bucket_table(buckets)
    assert len(table) == 8
    worst = table.set_index(["batch", "width"]).loc[(8, 128)]
    assert worst["rows"] == "5-8" and worst["worst padded rows"] == 3
    assert worst["worst waste"] == pytest.approx(1 - 5 * 65 / 1024)


def test_buckets_refuse_an_unsorted_axis():
    with pytest.raises(ValueError, match="batch_sizes"):
        DecodeBuckets((2, 1), (64,))
    with pytest.raises(ValueError, match="widths"):
        DecodeBuckets((1,), ())


# The engine with buckets on the CPU (graphs off): same tokens as without.

@pytest.mark.parametrize("block_size", [4, 16])
def test_bucketed_engine_decodes_the_same_tokens(tiny_model, block_size):
    prompts = ragged_prompts(512)
    plain = run(Engine(tiny_model, EngineConfig(num_blocks=96, block_size=block_size)), prompts, join_after=3)
    engine = Engine(tiny_model, EngineConfig(num_blocks=96, block_size=block_size), buckets=DecodeBuckets((1, 2, 4, 8),
                                                                                                          (32, 64,
                                                                                                           128)))
    assert run(engine, prompts, join_after=3) == plain
    assert_all_free(engine)


def test_a_batch_outside_the_list_runs_unpadded(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=96, block_size=4), buckets=DecodeBuckets((1, 2), (16,)))
    prompts = ragged_prompts(512)[:4]
    plain = run(Engine(tiny_model, EngineConfig(num_blocks=96, block_size=4)), prompts)
    assert run(engine, prompts) == plain


@needs_smollm2
def test_bucketed_engine_on_smollm2(smollm2_model):
    prompts = ragged_prompts(smollm2_model.config.vocab_size)[:5]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = run(Engine(smollm2_model, EngineConfig(num_blocks=64)), prompts, params)
    bucketed = run(Engine(smollm2_model, EngineConfig(num_blocks=64), buckets=DecodeBuckets.default(8, 256, 64)),
                   prompts, params)
    assert bucketed == plain


def test_graphs_are_cuda_only(tiny_model):
    """Graphs are the config's default, and follow the model: an engine on the CPU has none."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=16))
    assert engine.runner.graphs is None and not engine.async_scheduling
    with pytest.raises(ValueError, match="pad a DecodePlan"):
        Engine(tiny_model, EngineConfig(num_blocks=16), runner=unplanned_runner(), buckets=DecodeBuckets.default())


def test_decode_shape_reports_the_buckets_a_run_really_used(tiny_model):
    # Day 52: with buckets, the shape set of a run is the buckets it landed in, read off its plans.
    buckets = DecodeBuckets((1, 2, 4, 8), (32, 64))
    shapes = []

    def probe(ids, positions, cache):
        shapes.append(decode_shape(cache))
        assert tuple(ids.shape) == (shapes[-1][0], 1)
        return tiny_model(ids, positions, cache=cache)

    engine = Engine(tiny_model, EngineConfig(num_blocks=96, block_size=4, read="reference"), buckets=buckets,
                    forward=probe)
    run(engine, ragged_prompts(512)[:5], join_after=2)
    assert set(shapes) <= set(buckets.shapes) and len(set(shapes)) < len(shapes)
    # Two rows alone, then all five padded to 8, then the three that joined late, padded to 4.
    assert {s[0] for s in shapes} == {2, 4, 8}
