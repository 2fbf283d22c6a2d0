"""The paged KV cache and its reference read: block tables, the allocator, the block manager, the
plans that grow the tables, the derived `slot_mapping` rectangle, and `reference_read` against
naive attention."""

import math

import pytest
import torch
from conftest import make_cache

from nanolab.engine.block_manager import BlockAllocator, BlockTable, CacheFull
from nanolab.engine.kv_cache import KVCache, kv_bytes_per_block
from nanolab.engine.plan import VarlenPlan, derive_slot_mapping
from nanolab.kernels.reference import reference_read

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def small_cache(num_blocks: int = 16, num_layers: int = 2, max_rows: int = 4) -> KVCache:
    return make_cache(num_layers=num_layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=num_blocks,
                      block_size=BLOCK, max_rows=max_rows)


def kv(rows: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    # [rows, T, kv_heads, head_dim] each
    shape = (rows, t, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def write_all_layers(cache: KVCache, rows, lengths, gen: torch.Generator) -> list:
    """One planned varlen forward's writes of lengths[i] new tokens to row i; returns the (k, v)
    written per layer, [1, sum(lengths), kv_heads, head_dim] each."""
    view = cache.view(cache.plan_varlen(rows, lengths))
    written = []
    for layer in range(cache.num_layers):
        k, v = kv(1, sum(lengths), gen)
        view.write(layer, k, v)
        written.append((k, v))
    return written


def snapshot(cache: KVCache):
    return ([None if t is None else (list(t.blocks), t.num_tokens) for t in cache.blocks.tables],
            cache.blocks.allocator.num_free, cache.blocks.allocator.num_used)


# BlockTable and BlockAllocator.

def test_block_table_slot_arithmetic() -> None:
    table = BlockTable(block_size=4)
    table.blocks = [7, 2, 5]
    table.num_tokens = 10
    assert [table.slot(p) for p in range(10)] == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]


@pytest.mark.parametrize("p", [-1, 10, 12, 100])
def test_block_table_slot_outside_the_table_raises(p: int) -> None:
    table = BlockTable(block_size=4)
    table.blocks = [7, 2, 5]
    table.num_tokens = 10  # slots 10 and 11 exist in block 5 but hold no token yet
    with pytest.raises(IndexError, match=f"token {p} is outside"):
        table.slot(p)


def test_empty_block_table_has_no_slots() -> None:
    with pytest.raises(IndexError):
        BlockTable(block_size=4).slot(0)


@pytest.mark.parametrize("num_tokens,new,needed",
                         [(0, 1, 1), (0, 4, 1), (0, 5, 2), (3, 1, 0), (4, 1, 1), (5, 8, 2)])
def test_blocks_needed(num_tokens: int, new: int, needed: int) -> None:
    table = BlockTable(block_size=4)
    table.blocks = list(range(-(-num_tokens // 4)))
    table.num_tokens = num_tokens
    assert table.blocks_needed(new) == needed


def test_allocator_never_hands_out_a_block_twice_and_refuses_when_empty() -> None:
    allocator = BlockAllocator(5)
    got = [allocator.allocate() for _ in range(5)]
    assert sorted(got) == list(range(5))
    assert (allocator.num_free, allocator.num_used) == (0, 5)
    with pytest.raises(CacheFull):
        allocator.allocate()
    allocator.release([got[1], got[3]])
    again = [allocator.allocate(), allocator.allocate()]
    assert sorted(again) == sorted([got[1], got[3]])
    with pytest.raises(CacheFull):
        allocator.allocate()
    assert allocator.num_used == 5


def test_allocator_refuses_a_double_release() -> None:
    allocator = BlockAllocator(3)
    block = allocator.allocate()
    allocator.release([block])
    with pytest.raises(AssertionError):
        allocator.release([block])


def test_allocator_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)


# Plans: the host tables grow before the forward, and the forward writes where the plan says.

def test_varlen_plan_grows_tables_and_every_layer_writes_its_slots() -> None:
    cache, gen = small_cache(), torch.Generator().manual_seed(0)
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    plan = cache.plan_varlen(rows, (3, 6))
    t0, t1 = cache.blocks.table(rows[0]), cache.blocks.table(rows[1])
    assert (t0.num_tokens, len(t0.blocks), t1.num_tokens, len(t1.blocks)) == (3, 1, 6, 2)
    assert cache.blocks.allocator.num_used == 3
    # Flattened, no padding: row 0's three tokens, then row 1's six.
    assert plan.write_slots.tolist() == [t0.slot(p) for p in range(3)] + [t1.slot(p) for p in range(6)]
    assert plan.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert plan.query_start_loc.tolist() == [0, 3, 9] and plan.query_lens == (3, 6)
    assert plan.context_lens.tolist() == [3, 6] and plan.logits_index.tolist() == [2, 8]
    # The device block table holds the new blocks; the padding row is untouched.
    assert cache.block_table[rows[0], :1].tolist() == t0.blocks and cache.block_table[rows[1], :2].tolist() == t1.blocks
    assert (cache.block_table[cache.pad_row] == -1).all()
    view = cache.view(plan)
    sink = cache.k_pools[0][-1].clone()
    for layer in range(cache.num_layers):
        k, v = kv(1, 9, gen)
        view.write(layer, k, v)
        for row, a, n in zip(rows, (0, 3), (3, 6)):
            slots = [cache.blocks.table(row).slot(p) for p in range(n)]
            torch.testing.assert_close(cache.k_pools[layer][slots], k[0, a:a + n], rtol=0, atol=0)
            torch.testing.assert_close(cache.v_pools[layer][slots], v[0, a:a + n], rtol=0, atol=0)
    assert torch.equal(cache.k_pools[0][-1], sink), "a varlen plan has no padding: nothing goes to the sink"


def test_a_chunk_continues_its_row_and_only_sampled_rows_give_logits() -> None:
    cache = small_cache()
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    cache.plan_varlen(rows[:1], (6,), sampled=(False,))  # the first chunk of row 0's prompt
    plan = cache.plan_varlen(rows, (3, 1), sampled=(True, False))  # its last chunk, and row 1's first token
    assert plan.positions.tolist() == [[6, 7, 8, 0]] and plan.context_lens.tolist() == [9, 1]
    assert plan.write_slots.tolist() == [cache.blocks.table(rows[0]).slot(p) for p in (6, 7, 8)] + [
        cache.blocks.table(rows[1]).slot(0)]
    assert plan.logits_index.tolist() == [2]
    with pytest.raises(ValueError, match="twice"):
        cache.plan_varlen((rows[0], rows[0]), (1, 1))


@pytest.mark.parametrize("starts", [(0, 0, 0, 0, 0), (3, 5, 3, 0, 2), (4, 7, 2, 9, 1)])
def test_varlen_slots_and_positions_follow_each_table_long_segments_and_short(starts) -> None:
    # A long segment (more than a block) is sliced from its blocks in tensor ops, a short one (a
    # decode row, up to a block) token by token; either may start mid-block and cross into the
    # next. Every slot must be the table's own, in segment order, whatever the mix.
    cache = small_cache(num_blocks=96, max_rows=5)
    rows = tuple(cache.blocks.open_row() for _ in range(5))
    for row, a in zip(rows, starts):
        if a:
            cache.plan_varlen((row,), (a,))
    counts = (1, 9, 2, 14, BLOCK)  # short, long, short (from 3: crosses a block), long, exactly a block
    plan = cache.plan_varlen(rows, counts)
    tables = [cache.blocks.table(row) for row in rows]
    assert plan.write_slots.tolist() == [t.slot(p) for t, a, n in zip(tables, starts, counts) for p in range(a, a + n)]
    assert plan.positions.tolist() == [[p for a, n in zip(starts, counts) for p in range(a, a + n)]]
    assert plan.table_rows.tolist() == list(rows)
    assert plan.context_lens.tolist() == [a + n for a, n in zip(starts, counts)]
    assert plan.query_start_loc.tolist() == [0, 1, 10, 12, 26, 30]
    assert plan.logits_index.tolist() == [0, 9, 11, 25, 29]
    storages = {t.untyped_storage().data_ptr() for t in (plan.table_rows, plan.write_slots, plan.query_start_loc,
                                                          plan.context_lens, plan.positions, plan.logits_index)}
    assert len(storages) == 1  # on the CPU, views of the one host buffer (on a GPU, six copies of it)


def test_host_int64_makes_int64_tensors_from_ints() -> None:
    from nanolab.engine.kv_cache import host_int64

    assert host_int64([3, -1, 2**40]).tolist() == [3, -1, 2**40] and host_int64([]).shape == (0,)
    assert host_int64((1, 2)).dtype == torch.int64


def test_decode_plan_appends_one_token_per_row() -> None:
    cache, gen = small_cache(), torch.Generator().manual_seed(1)
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    write_all_layers(cache, rows, (4, 2), gen)
    plan = cache.plan_decode(rows)
    assert [cache.blocks.table(r).num_tokens for r in rows] == [5, 3]
    assert [len(cache.blocks.table(r).blocks) for r in rows] == [2, 1]
    assert plan.write_slots.tolist() == [cache.blocks.table(rows[0]).slot(4), cache.blocks.table(rows[1]).slot(2)]
    assert plan.positions.tolist() == [[4], [2]] and plan.planned_lens == (5, 3)


def test_plans_refuse_rows_that_are_not_open() -> None:
    cache = small_cache()
    row = cache.blocks.open_row()
    with pytest.raises(ValueError, match="not open"):
        cache.plan_varlen((row, row + 1), (2, 2))
    with pytest.raises(ValueError, match="not open"):
        cache.plan_decode((row + 1,))
    with pytest.raises(ValueError, match="at least one token"):
        cache.plan_varlen((row,), (0,))
    assert cache.blocks.table(row).num_tokens == 0 and cache.blocks.allocator.num_used == 0


def test_a_plan_needing_more_blocks_than_free_changes_nothing() -> None:
    cache, gen = small_cache(num_blocks=5), torch.Generator().manual_seed(4)
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    write_all_layers(cache, rows, (4, 3), gen)  # 2 blocks used, 3 free
    before, table, cells = snapshot(cache), cache.block_table.clone(), cache.host_cells
    with pytest.raises(CacheFull):
        cache.plan_varlen(rows, (8, 6))  # 4 + 8 and 3 + 6 tokens need 2 + 2 blocks
    assert snapshot(cache) == before and torch.equal(cache.block_table, table) and cache.host_cells == cells
    cache.plan_varlen(rows, (8, 2))  # exactly enough still succeeds: 2 + 1 blocks
    assert cache.blocks.allocator.num_free == 0


def test_a_row_cannot_outgrow_its_block_table_row() -> None:
    cache = make_cache(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=16, block_size=BLOCK,
                       max_rows=2, max_model_len=8)
    row = cache.blocks.open_row()
    cache.plan_varlen((row,), (8,))
    with pytest.raises(ValueError, match="block-table row"):
        cache.plan_varlen((row,), (1,))
    assert cache.blocks.table(row).num_tokens == 8


def test_free_row_returns_blocks_and_refuses_a_closed_row() -> None:
    cache, gen = small_cache(num_blocks=6), torch.Generator().manual_seed(5)
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    write_all_layers(cache, rows, (5, 9), gen)
    assert cache.blocks.allocator.num_used == 5
    cache.blocks.free_row(rows[1])
    assert (cache.blocks.allocator.num_used, cache.blocks.free_row_count()) == (2, 3)
    with pytest.raises(ValueError, match="not open"):
        cache.blocks.free_row(rows[1])
    with pytest.raises(ValueError, match="not open"):
        cache.blocks.table(rows[1])


def test_open_row_refuses_when_every_row_is_taken() -> None:
    cache = small_cache(max_rows=2)
    cache.blocks.open_row(), cache.blocks.open_row()
    with pytest.raises(CacheFull):
        cache.blocks.open_row()


# slot_mapping: derived on the device from the persistent block table.

def fragmented_cache(gen: torch.Generator) -> tuple[KVCache, tuple[int, ...]]:
    """Three rows of 3, 9 and 6 tokens whose blocks interleave in the pool and cross block
    boundaries, written in one ragged prefill, a decode step and a ragged chunk on top."""
    cache = small_cache(num_blocks=16, max_rows=4)
    spare = cache.blocks.open_row()
    write_all_layers(cache, (spare,), (6,), gen)  # take blocks 0, 1 ...
    rows = (cache.blocks.open_row(), cache.blocks.open_row(), cache.blocks.open_row())
    cache.blocks.free_row(spare)  # ... and put them at the back of the free list
    write_all_layers(cache, rows, (1, 3, 2), gen)
    view = cache.view(cache.plan_decode(rows))
    for layer in range(cache.num_layers):
        view.write(layer, *kv(3, 1, gen))
    write_all_layers(cache, rows, (1, 5, 3), gen)
    return cache, rows


def table_mapping(cache: KVCache, rows) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([cache.blocks.table(r).num_tokens for r in rows])
    return derive_slot_mapping(cache.block_table, torch.tensor(rows), lens, int(lens.max()), cache.block_size), lens


def test_slot_mapping_is_the_rectangle_of_table_slots() -> None:
    cache, rows = fragmented_cache(torch.Generator().manual_seed(6))
    mapping, lens = table_mapping(cache, rows)
    assert lens.tolist() == [3, 9, 6] and mapping.dtype == torch.int64
    expected = [[cache.blocks.table(r).slot(p) for p in range(n)] + [-1] * (9 - n) for r, n in zip(rows, lens.tolist())]
    assert mapping.tolist() == expected
    # Any subset and order of rows gets its own rectangle: batch row i reads table row rows[i].
    mapping, _ = table_mapping(cache, (rows[2], rows[0]))
    assert mapping.tolist() == [[cache.blocks.table(rows[2]).slot(p) for p in range(6)],
                                [cache.blocks.table(rows[0]).slot(p) for p in range(3)] + [-1, -1, -1]]


def test_slot_mapping_has_no_slot_twice() -> None:
    cache, rows = fragmented_cache(torch.Generator().manual_seed(7))
    mapping, lens = table_mapping(cache, rows)
    real = [s for row, n in zip(mapping.tolist(), lens.tolist()) for s in row[:n]]
    assert len(real) == len(set(real)) == sum(lens.tolist())


# reference_read against naive attention in float64.

def naive_attention(cache: KVCache, layer: int, rows, q: torch.Tensor, positions: torch.Tensor,
                    lengths) -> list[list[torch.Tensor]]:
    """Per row, per real query, per head: softmax(q.k / sqrt(d)) v over keys p <= position, in float64.
    Returns out[i][t] of shape [heads, head_dim]."""
    k_pool, v_pool = cache.k_pools[layer].double(), cache.v_pools[layer].double()
    group = HEADS // KV_HEADS
    out = []
    for i, row in enumerate(rows):
        table = cache.blocks.table(row)
        per_query = []
        for t in range(lengths[i]):
            pos = int(positions[i, t])
            slots = [table.slot(p) for p in range(min(pos + 1, table.num_tokens))]
            heads = []
            for h in range(HEADS):
                kh, vh = k_pool[slots, h // group], v_pool[slots, h // group]  # [ctx, d]
                scores = kh @ q[i, t, h].double() / math.sqrt(HEAD_DIM)
                heads.append(torch.softmax(scores, dim=0) @ vh)
            per_query.append(torch.stack(heads))
        out.append(per_query)
    return out


def forward_and_check(cache, plan, q, gen: torch.Generator) -> None:
    """Write the planned forward's K/V and read it back layer by layer, as the model does, then
    compare every layer with naive attention. A varlen plan's q [1, num_tokens, ...] is compared
    segment by segment."""
    if isinstance(plan, VarlenPlan):
        view = cache.view(plan)
        got = []
        for layer in range(cache.num_layers):
            k, v = kv(1, plan.num_tokens, gen)
            view.write(layer, k, v)
            got.append(view.read(layer, q, plan.positions))
        loc = plan.host_query_start_loc
        for layer, out in enumerate(got):
            assert out.shape == q.shape
            for i, row in enumerate(plan.rows):
                a, b = loc[i], loc[i + 1]
                want = naive_attention(cache, layer, (row,), q[:, a:b], plan.positions[:, a:b], [b - a])
                for t in range(b - a):
                    torch.testing.assert_close(out[0, a + t].double(), want[0][t], rtol=1e-5, atol=1e-5)
        return
    rows, lengths = plan.rows, (plan.write_slots >= 0).reshape(len(plan.rows), -1).sum(1).tolist()
    view = cache.view(plan)
    got = []
    for layer in range(cache.num_layers):
        k, v = kv(len(rows), q.shape[1], gen)
        view.write(layer, k, v)
        got.append(view.read(layer, q, plan.positions))
    for layer, out in enumerate(got):
        assert out.shape == q.shape
        want = naive_attention(cache, layer, rows, q, plan.positions, lengths)
        for i in range(len(rows)):
            for t in range(lengths[i]):
                torch.testing.assert_close(out[i, t].double(), want[i][t], rtol=1e-5, atol=1e-5)


def test_reference_matches_naive_in_decode() -> None:
    gen = torch.Generator().manual_seed(8)
    cache, rows = fragmented_cache(gen)
    plan = cache.plan_decode(rows)  # contexts 4, 10, 7
    forward_and_check(cache, plan, torch.randn((len(rows), 1, HEADS, HEAD_DIM), generator=gen), gen)


def test_reference_matches_naive_in_decode_with_rows_in_another_order() -> None:
    """Batch row i is not table row i: the read must follow the plan's table rows."""
    gen = torch.Generator().manual_seed(19)
    cache, rows = fragmented_cache(gen)
    plan = cache.plan_decode(rows[::-1])
    forward_and_check(cache, plan, torch.randn((len(rows), 1, HEADS, HEAD_DIM), generator=gen), gen)


def test_reference_matches_naive_in_causal_prefill() -> None:
    gen = torch.Generator().manual_seed(9)
    cache = small_cache(num_blocks=16, max_rows=3)
    rows = (cache.blocks.open_row(), cache.blocks.open_row(), cache.blocks.open_row())
    plan = cache.plan_varlen(rows, (5, 9, 2))  # ragged, crossing block boundaries, no padding
    forward_and_check(cache, plan, torch.randn((1, 16, HEADS, HEAD_DIM), generator=gen), gen)


def test_reference_matches_naive_for_a_chunk_on_top_of_history() -> None:
    """T > 1 new tokens on rows that already hold some: each query sees the history and the
    new tokens up to its own position."""
    gen = torch.Generator().manual_seed(10)
    cache, rows = fragmented_cache(gen)
    before = [cache.blocks.table(r).num_tokens for r in rows]
    plan = cache.plan_varlen(rows, (4, 2, 3))
    assert plan.positions[0, plan.query_start_loc[:-1]].tolist() == before
    forward_and_check(cache, plan, torch.randn((1, 9, HEADS, HEAD_DIM), generator=gen), gen)


def reference_inputs(gen: torch.Generator):
    """q, pools, mapping, lens and positions of a 2-row decode read over a hand-built pool."""
    k_pool = torch.randn((8 * BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    v_pool = torch.randn((8 * BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    lens = torch.tensor([3, 6])
    mapping = torch.tensor([[9, 10, 11, 0, 0, 0], [4, 5, 6, 7, 20, 21]])  # row 0 padded with slot 0
    positions = (lens - 1)[:, None]
    q = torch.randn((2, 1, HEADS, HEAD_DIM), generator=gen)
    return q, k_pool, v_pool, mapping, lens, positions


def test_reference_refuses_a_row_with_no_context() -> None:
    q, k_pool, v_pool, mapping, _, positions = reference_inputs(torch.Generator().manual_seed(11))
    with pytest.raises(ValueError, match="no context"):
        reference_read(q, k_pool, v_pool, mapping, torch.tensor([0, 6]), positions)
    with pytest.raises(ValueError, match="no context"):
        reference_read(q, k_pool, v_pool, mapping, torch.tensor([3, 6]), positions,
                                          context_bounds=(0, 6))


@pytest.mark.parametrize("width", [5, 7])
def test_reference_refuses_a_mapping_not_max_ctx_wide(width: int) -> None:
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(12))
    mapping = torch.nn.functional.pad(mapping, (0, 1))[:, :width]
    with pytest.raises(ValueError, match=f"{width} wide but the longest row holds 6"):
        reference_read(q, k_pool, v_pool, mapping, lens, positions)
    with pytest.raises(ValueError, match="wide"):
        reference_read(q, k_pool, v_pool, mapping, lens, positions, context_bounds=(3, 6))


def test_reference_refuses_context_bounds_with_validated() -> None:
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match="not both"):
        reference_read(q, k_pool, v_pool, mapping, lens, positions,
                                          context_bounds=(3, 6), validated=True)


@pytest.mark.parametrize("what", ["mapping rows", "mapping 1-d", "lens rows", "lens 2-d"])
def test_reference_refuses_mismatched_shapes(what: str) -> None:
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(14))
    if what == "mapping rows":
        mapping = mapping[:1]
    elif what == "mapping 1-d":
        mapping = mapping[1]
    elif what == "lens rows":
        lens = torch.tensor([3, 6, 6])
    else:
        lens = lens[:, None]
    for validated in (False, True):
        with pytest.raises(ValueError, match="must describe the 2 rows of q"):
            reference_read(q, k_pool, v_pool, mapping, lens, positions,
                                              validated=validated)


def test_validated_skips_the_bounds_checks() -> None:
    """A validated read trusts its caller: a mapping wider than max_ctx is read and masked, and
    gives the same answer as the exact rectangle."""
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(15))
    exact = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    wide = torch.nn.functional.pad(mapping, (0, 3))
    got = reference_read(q, k_pool, v_pool, wide, lens, positions, validated=True)
    torch.testing.assert_close(got, exact)
    with pytest.raises(ValueError):
        reference_read(q, k_pool, v_pool, wide, lens, positions)


def test_context_bounds_are_trusted_over_context_lens() -> None:
    """Given context_bounds, the read takes them as the truth and never looks at context_lens'
    values (Day 49: no device sync)."""
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(16))
    exact = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    got = reference_read(q, k_pool, v_pool, mapping, lens, positions,
                                            context_bounds=(3, 6))
    torch.testing.assert_close(got, exact)


def test_reference_propagates_nan_from_the_padding_slot() -> None:
    """KNOWN LIMITATION of the reference, documented rather than fixed: every padding cell of a
    mapping is really loaded and only masked afterwards, so a NaN in the slot the padding names
    poisons every padded row (0 * NaN and -inf + NaN are NaN). Here the hand-built mapping pads
    with slot 0; the engine's plans pad with the sink (-1), and the cache zeroes its pools so the
    sink starts finite. The Triton read never loads padding cells (tests/test_paged_attention.py)."""
    q, k_pool, v_pool, mapping, lens, positions = reference_inputs(torch.Generator().manual_seed(17))
    assert 0 not in mapping[1].tolist() and mapping[0, 3:].tolist() == [0, 0, 0]
    clean = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    k_pool[0], v_pool[0] = float("nan"), float("nan")
    got = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    assert torch.isnan(got[0]).all(), "the padded row no longer sees the NaN: update this test"
    torch.testing.assert_close(got[1], clean[1])  # the unpadded row never reads slot 0


def test_kv_bytes_per_block_is_what_the_pools_hold():
    cache = make_cache(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=5, block_size=4,
                                dtype=torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in cache.k_pools + cache.v_pools)
    sink = 2 * 3 * 2 * 8 * 2  # one slot per pool past the last block
    assert held == 5 * kv_bytes_per_block(3, 2, 8, 4, torch.bfloat16) + sink
