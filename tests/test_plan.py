"""Day 50: the DecodePlan, its wiring, its refusals, its arithmetic and its gates."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.block_manager import BlockTable
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.plan import check_plan_addressing, check_plan_current, check_plan_rows
from nanolab.lab.compilebench import decode_shape
from nanolab.lab.costs import (
    appended_cells,
    check_rebuild_bounded,
    mapping_bytes,
    mapping_cells,
    rebuild_cells,
    rebuild_ratio,
)
from nanolab.lab.history import UnplannedView, host_slot_mapping, unplanned_runner
from nanolab.lab.timing import drain

KV_HEADS, HEAD_DIM = 2, 16


def small_cache(model=None, num_blocks=32, block_size=4, max_rows=4) -> KVCache:
    layers = model.config.num_hidden_layers if model is not None else 3
    return make_cache(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, num_blocks=num_blocks,
                      block_size=block_size, max_rows=max_rows)


def prefilled(cache: KVCache, lengths) -> list[int]:
    """Open rows and write `lengths[i]` random tokens into each, through a planned varlen step."""
    rows = [cache.blocks.open_row() for _ in lengths]
    view = cache.view(cache.plan_varlen(rows, lengths))
    for layer in range(cache.num_layers):
        k = torch.randn(1, sum(lengths), KV_HEADS, HEAD_DIM)
        view.write(layer, k, torch.randn_like(k))
    return rows


def engine_at_decode(model, prompts, **kw) -> tuple[Engine, list]:
    """An engine whose requests are prefilled and about to decode."""
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4), **kw)
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in prompts]
    engine.step()
    return engine, seqs


PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 23)), [3, 4]]


def test_plan_fields():
    cache = small_cache()
    rows = prefilled(cache, [5, 13, 2])
    plan = cache.plan_decode(rows)
    assert plan.positions.tolist() == [[5], [13], [2]]  # read before the tables grew
    assert [cache.blocks.table(r).num_tokens for r in rows] == [6, 14, 3]
    assert plan.context_lens.tolist() == [6, 14, 3]
    assert (plan.min_ctx, plan.max_ctx) == (3, 14)
    assert plan.write_slots.tolist() == [cache.blocks.table(r).slot(p) for r, p in zip(rows, [5, 13, 2], strict=True)]
    assert (plan.batch_size, plan.width, plan.cells) == (3, 14, 42)
    assert (plan.real_cells, plan.padding_cells) == (23, 19)
    assert plan.padding_share == pytest.approx(19 / 42)
    assert plan.mapping_bytes == 42 * 8 == mapping_bytes(3, 14)
    assert "3 rows x 14 wide" in plan.render()
    assert check_plan_addressing(cache, plan) and check_plan_rows(plan, rows) and check_plan_current(cache, plan)


def test_slot_mapping_with_a_plan_is_derived_from_the_device_table():
    cache = small_cache()
    rows = prefilled(cache, [5, 9])
    plan = cache.plan_decode(rows)
    mapping, lens = cache.view(plan).slot_mapping, plan.context_lens
    assert torch.equal(mapping, plan.slot_mapping)
    # The host rebuild (the unplanned path) pads with slot 0; the derived mapping pads with the sink.
    rebuilt, _ = host_slot_mapping(cache.blocks, rows)
    real = torch.arange(mapping.shape[1]) < lens[:, None]
    assert torch.equal(rebuilt[real], mapping[real]) and (mapping[~real] == -1).all() and (rebuilt[~real] == 0).all()


def test_planned_write_is_one_index_put_and_needs_no_layer_zero():
    cache = small_cache()
    rows = prefilled(cache, [5, 9])
    plan = cache.plan_decode(rows)
    k = torch.randn(2, 1, KV_HEADS, HEAD_DIM)
    cache.view(plan).write(2, k, -k)  # layer 2 first: nothing to wait for
    assert torch.equal(cache.k_pools[2][plan.write_slots], k[:, 0])
    assert torch.equal(cache.v_pools[2][plan.write_slots], -k[:, 0])
    with pytest.raises(RuntimeError, match="before layer 0"):  # the unplanned write does need layer 0 first
        UnplannedView(cache.blocks, cache, tuple(rows), "cache").write(2, k, k)


def test_refuses_an_empty_row():
    cache = small_cache()
    rows = prefilled(cache, [4])
    empty = cache.blocks.open_row()
    free = cache.blocks.allocator.num_free
    with pytest.raises(ValueError, match="empty"):
        cache.plan_decode(rows + [empty])
    assert cache.blocks.table(rows[0]).num_tokens == 4 and cache.blocks.allocator.num_free == free  # nothing grew


def test_refuses_a_stale_plan_and_the_gate_sees_it():
    cache = small_cache()
    rows = prefilled(cache, [4, 7])
    old = cache.plan_decode(rows)
    new = cache.plan_decode(rows)
    gate = check_plan_current(cache, old)
    assert not gate and gate.numbers["stale_rows"] == 2
    assert check_plan_current(cache, new)
    with pytest.raises(RuntimeError, match="stale"):
        cache.view(old)
    cache.view(new)


def test_gates_fail_on_wrong_plans():
    cache = small_cache()
    rows = prefilled(cache, [4, 7])
    plan = cache.plan_decode(rows)
    assert not check_plan_rows(plan, rows[::-1])
    assert not check_plan_rows(plan, rows[:1])
    corrupted = type(plan)(**{**plan.__dict__, "write_slots": plan.write_slots + 1})
    gate = check_plan_addressing(cache, corrupted)
    assert not gate and gate.numbers["wrong"] == 2


def test_rebuild_table_is_the_seeds():
    # Four rows decoding from a 16-token prompt (Day 50's table, exactly).
    seed = {8: (656, 32), 64: (12_416, 256), 128: (41_216, 512), 512: (558_080, 2_048)}
    for steps, (rebuilt, appended) in seed.items():
        assert (rebuild_cells(4, 16, steps), appended_cells(4, steps)) == (rebuilt, appended)
    assert rebuild_ratio(4, 16, 8) == 20.5 and rebuild_ratio(4, 16, 512) == 272.5
    assert mapping_cells(4, 17) == 68
    # Brute force: the sum of every step's rectangle.
    assert rebuild_cells(3, 5, 9) == sum(3 * (5 + i) for i in range(1, 10))


def test_check_rebuild_bounded_passes_short_runs_and_fails_long_ones():
    assert check_rebuild_bounded(4, 16, 8)
    gate = check_rebuild_bounded(4, 16, 512)
    assert not gate and gate.numbers["ratio"] / gate.numbers["limit"] > 8


def test_replayed_plan_gives_identical_logits_and_an_unplanned_forward_does_not(tiny_model):
    engine, seqs = engine_at_decode(tiny_model, PROMPTS)
    rows = [s.row for s in seqs]
    ids = torch.tensor([[s.output_token_ids[-1]] for s in seqs])
    plan = engine.kv_cache.plan_decode(rows)
    with torch.inference_mode():
        first = tiny_model(ids, plan.positions, cache=engine.kv_cache.view(plan))
        again = tiny_model(ids, plan.positions, cache=engine.kv_cache.view(plan))
    assert torch.equal(first, again)  # f(x) == f(x)
    assert [engine.kv_cache.blocks.table(r).num_tokens for r in rows] == list(plan.planned_lens)  # and no state moved

    control, cseqs = engine_at_decode(tiny_model, PROMPTS)
    crows = [s.row for s in cseqs]
    kv = control.kv_cache
    before = [kv.blocks.table(r).num_tokens for r in crows]
    positions = torch.tensor([[n] for n in before])
    with torch.inference_mode():
        once = tiny_model(ids, positions, cache=UnplannedView(kv.blocks, kv, tuple(crows), "cache"))
        tiny_model(ids, positions, cache=UnplannedView(kv.blocks, kv, tuple(crows), "cache"))
    assert torch.allclose(once, first, atol=1e-5)  # the same step, addressed either way
    # The second unplanned call wrote the token again, one slot further on: the history is now
    # one token longer than the request's, and every later step attends over the duplicate.
    assert [kv.blocks.table(r).num_tokens for r in crows] == [n + 2 for n in before]


def test_planned_forward_never_reads_num_tokens(tiny_model, monkeypatch):
    engine, seqs = engine_at_decode(tiny_model, PROMPTS)
    rows = [s.row for s in seqs]
    ids = torch.tensor([[s.output_token_ids[-1]] for s in seqs])
    plan = engine.kv_cache.plan_decode(rows)
    view = engine.kv_cache.view(plan)
    positions = torch.tensor([[engine.kv_cache.blocks.table(r).num_tokens - 1] for r in rows])

    def forbidden(self):
        raise AssertionError("the forward read BlockTable.num_tokens")

    # A property is a data descriptor and beats the instance attribute.
    monkeypatch.setattr(BlockTable, "num_tokens", property(forbidden), raising=False)
    with torch.inference_mode():
        tiny_model(ids, plan.positions, cache=view)
        with pytest.raises(AssertionError, match="num_tokens"):
            kv = engine.kv_cache
            tiny_model(ids, positions, cache=UnplannedView(kv.blocks, kv, tuple(rows), "cache"))


def test_planned_and_unplanned_engines_decode_the_same_tokens(tiny_model):
    outs = []
    for runner in ({}, {"runner": unplanned_runner()}):
        engine = Engine(tiny_model, EngineConfig(num_blocks=40, block_size=4, read="reference"), **runner)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        seqs = [engine.add_request(p, params) for p in PROMPTS * 3]
        drain(engine, max_steps=500)
        outs.append([s.output_token_ids for s in seqs])
    assert outs[0] == outs[1]


def test_decode_shape_reads_the_plans_width_and_is_not_off_by_one():
    cache = small_cache()
    rows = prefilled(cache, [5, 9])
    # unplanned: the forward will grow the tables first
    predicted = decode_shape(UnplannedView(cache.blocks, cache, tuple(rows), "cache"))
    plan = cache.plan_decode(rows)
    assert decode_shape(cache.view(plan)) == predicted == (2, 10) == (plan.batch_size, plan.slot_mapping.shape[1])


def test_the_step_inputs_go_up_in_one_kernel_through_the_interpreter():
    from nanolab.kernels import INTERPRETED
    from nanolab.kernels.step_inputs import upload_step_inputs

    if not INTERPRETED:
        pytest.skip("a CPU-only machine runs the kernel in Triton's interpreter; here CUDA tests it")
    for rows in (1, 8, 130):  # 130: two programs, the second masked past its second row
        src = torch.arange(4 * rows, dtype=torch.int64).view(4, rows) * 7 - 3
        buffers = [torch.full((rows + 3,), -99, dtype=torch.int64) for _ in range(4)]  # room past the end
        upload_step_inputs(src, [b[:rows] for b in buffers])
        for i, b in enumerate(buffers):
            assert torch.equal(b[:rows], src[i]), (rows, i)
            assert (b[rows:] == -99).all(), f"the kernel wrote past row {rows} of vector {i}"


def test_the_step_inputs_upload_refuses_what_it_cannot_read():
    from nanolab.kernels.step_inputs import upload_step_inputs

    dsts = [torch.zeros(3, dtype=torch.int64) for _ in range(4)]
    with pytest.raises(ValueError, match="src must be a contiguous"):
        upload_step_inputs(torch.zeros(3, 3, dtype=torch.int64), dsts)
    with pytest.raises(ValueError, match="src must be a contiguous"):
        upload_step_inputs(torch.zeros(4, 3, dtype=torch.int32), dsts)
    with pytest.raises(ValueError, match="dsts must be four"):
        upload_step_inputs(torch.zeros(4, 3, dtype=torch.int64), dsts[:3])
    with pytest.raises(ValueError, match="dsts must be four"):
        upload_step_inputs(torch.zeros(4, 3, dtype=torch.int64), dsts[:3] + [torch.zeros(2, dtype=torch.int64)])
