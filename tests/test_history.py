"""The decode the engine replaced (`nanolab.lab.history`): layer 0 grows the tables and picks the
slots, later layers reuse them (the handshake), the read rebuilds its rectangle on the host; and an
Engine given that runner decodes the same tokens as its own planned decode."""

import pytest
import torch
from conftest import make_cache

from nanolab import Engine, EngineConfig
from nanolab.lab.history import UnplannedView, context_bounds, host_slot_mapping, unplanned_runner
from nanolab.lab.reference import engine_greedy
from nanolab.lab.timing import prefill

KV_HEADS, HEAD_DIM, BLOCK = 2, 8, 4


def kv(rows: int, gen: torch.Generator):
    shape = (rows, 1, KV_HEADS, HEAD_DIM)  # [rows, 1, kv_heads, head_dim]
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def history_cache(num_layers: int = 2):
    cache = make_cache(num_layers=num_layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=16,
                       block_size=BLOCK, max_rows=4)
    rows = (cache.blocks.open_row(), cache.blocks.open_row())
    cache.plan_varlen(rows, (4, 2))
    return cache, rows


def test_layer0_grows_the_tables_and_later_layers_reuse_its_slots() -> None:
    cache, rows = history_cache()
    gen = torch.Generator().manual_seed(0)
    view = UnplannedView(cache.blocks, cache, rows, "cache")
    written = []
    for layer in range(cache.num_layers):
        k, v = kv(2, gen)
        view.write(layer, k, v)
        written.append((k, v))
    assert [cache.blocks.table(r).num_tokens for r in rows] == [5, 3]
    slots = [cache.blocks.table(rows[0]).slot(4), cache.blocks.table(rows[1]).slot(2)]
    assert view._step.slots.tolist() == slots and view._step.next_layer == cache.num_layers
    for layer, (k, v) in enumerate(written):
        torch.testing.assert_close(cache.k_pools[layer][slots], k[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(cache.v_pools[layer][slots], v[:, 0], rtol=0, atol=0)


def test_the_handshake_refuses_a_layer_out_of_order() -> None:
    cache, rows = history_cache(num_layers=3)
    gen = torch.Generator().manual_seed(1)
    view = UnplannedView(cache.blocks, cache, rows, "cache")
    with pytest.raises(RuntimeError, match="before layer 0"):
        view.write(1, *kv(2, gen))
    q = torch.randn((2, 1, 4, HEAD_DIM), generator=gen)
    with pytest.raises(RuntimeError, match="read before writing"):
        view.read(0, q, torch.zeros((2, 1), dtype=torch.int64))
    view.write(0, *kv(2, gen))
    with pytest.raises(RuntimeError, match="before layer 0"):
        view.write(2, *kv(2, gen))


def test_the_host_rectangle_pads_with_slot_0() -> None:
    cache, rows = history_cache()
    mapping, lens = host_slot_mapping(cache.blocks, rows)
    t0, t1 = (cache.blocks.table(r) for r in rows)
    assert lens.tolist() == [4, 2] and context_bounds(cache.blocks, rows) == (2, 4)
    assert mapping.tolist() == [[t0.slot(p) for p in range(4)], [t1.slot(0), t1.slot(1), 0, 0]]


@pytest.mark.parametrize("bounds", ["cache", "device"])
def test_an_unplanned_engine_decodes_the_planned_tokens(tiny_model, bounds) -> None:
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 11, 6)]
    config = EngineConfig(num_blocks=48, block_size=4, read="reference")
    planned = Engine(tiny_model, config)
    unplanned = Engine(tiny_model, config, runner=unplanned_runner(bounds))
    assert engine_greedy(unplanned, prompts, 9) == engine_greedy(planned, prompts, 9)
    # The logits too: one decode step of each, from the same prefilled state.
    outs = []
    for engine in (planned, unplanned):
        prefill(engine, prompts, 3)
        outs.append(torch.stack([o.logits.clone() for o in engine.step()]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert unplanned.block_manager.allocator.num_free < unplanned.block_manager.num_blocks


def test_the_unplanned_runner_refuses_buckets_and_an_unknown_bound(tiny_model) -> None:
    from nanolab.engine.buckets import DecodeBuckets

    with pytest.raises(ValueError, match="pad a DecodePlan"):
        Engine(tiny_model, EngineConfig(num_blocks=16), runner=unplanned_runner(), buckets=DecodeBuckets.default())
    with pytest.raises(ValueError, match="bounds"):
        Engine(tiny_model, EngineConfig(num_blocks=16), runner=unplanned_runner("host"))
