"""Day 60's wiring on the CPU: the cache reads a planned decode through the streamed kernel
addressed by the block table (Triton's interpreter here), and the engine decodes the same greedy
tokens as with the reference read. Without a width in the read, the capture list loses an axis."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_smollm2
from test_engine import assert_all_free, ragged_prompts, run

from nanolab import Engine, SamplingParams
from nanolab.buckets import DecodeBuckets, bucket_table, padding_waste
from nanolab.cache import BatchedPagedKVCache


@pytest.mark.parametrize("block_size", [4, 16])
def test_streamed_engine_decodes_the_reference_tokens(tiny_model, block_size):
    prompts = ragged_prompts(512)
    reference = run(Engine(tiny_model, num_blocks=96, block_size=block_size), prompts, join_after=3)
    streamed = Engine(tiny_model, num_blocks=96, block_size=block_size, streamed_read=True)
    assert streamed.cache.streamed_read
    assert run(streamed, prompts, join_after=3) == reference
    assert_all_free(streamed)


def test_streamed_read_in_padded_batches_without_a_width(tiny_model):
    prompts = ragged_prompts(512)
    reference = run(Engine(tiny_model, num_blocks=96, block_size=4), prompts, join_after=3)
    buckets = DecodeBuckets((1, 2, 4, 8), None)
    engine = Engine(tiny_model, num_blocks=96, block_size=4, buckets=buckets, streamed_read=True)
    assert run(engine, prompts, join_after=3) == reference


def test_a_streamed_view_derives_nothing():
    cache = BatchedPagedKVCache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8, block_size=4,
                                streamed_read=True)
    row = cache.open_row()
    k = torch.zeros(1, 5, 2, 4)
    cache.write(0, (row,), k, k, (5,))
    plan = cache.plan_decode([row], batch_size=2)
    view = cache.view([row], plan=plan)
    assert view.slot_mapping is None and view.mask_bias is None and view.plan is plan


@needs_smollm2
def test_streamed_engine_on_smollm2(smollm2_model):
    prompts = ragged_prompts(smollm2_model.config.vocab_size)[:3]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = run(Engine(smollm2_model, num_blocks=32), prompts, params)
    assert run(Engine(smollm2_model, num_blocks=32, streamed_read=True), prompts, params) == reference


def test_without_a_width_the_seeds_list_is_six_shapes():
    buckets = DecodeBuckets.default()
    narrow = buckets.without_width()
    assert (len(buckets), len(narrow)) == (36, 6)
    assert narrow.shapes == [(32, None), (16, None), (8, None), (4, None), (2, None), (1, None)]
    assert narrow.lookup(3, 100_000) == (4, None) and narrow.lookup(33, 1) is None
    w = padding_waste(narrow, 3, 300)
    assert (w.padded_rows, w.cells, w.live_cells) == (1, 1200, 900)
    table = bucket_table(narrow)
    assert len(table) == 6 and set(table.tokens) == {"any"}


def test_graphs_without_widths_need_the_streamed_read(tiny_model):
    from nanolab.graphs import DecodeGraphs

    cache = BatchedPagedKVCache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8)
    with pytest.raises(ValueError, match="needs the streamed read"):
        DecodeGraphs(tiny_model, cache, DecodeBuckets((1, 2), None))
