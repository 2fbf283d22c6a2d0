"""Day 60's wiring on the CPU: the cache reads a planned decode through the streamed kernel
addressed by the block table (Triton's interpreter here), and the engine decodes the same greedy
tokens as with the reference read. Without a width in the read, the capture list loses an axis."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache, needs_cuda, needs_smollm2
from test_engine import GREEDY, assert_all_free, ragged_prompts

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import DecodeGraphs
from nanolab.kernels import INTERPRETED
from nanolab.lab.costs import bucket_table, padding_waste
from nanolab.lab.timing import drain

# CPU caches read through Triton's interpreter, which is on only where there is no CUDA (or when
# TRITON_INTERPRET=1 is set by hand); the CUDA tests at the end run the compiled kernels instead.
interpreted = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter is off on a CUDA machine")


def run(engine: Engine, prompts, params=GREEDY, join_after: int | None = None, max_steps: int = 1000
        ) -> list[list[int]]:
    """Greedy outputs in prompt order, as test_engine's `run` but in a bounded number of steps. With
    `join_after`, the second half of the prompts joins after that many steps of the first half."""
    first = prompts if join_after is None else prompts[: len(prompts) // 2]
    seqs = [engine.add_request(p, params) for p in first]
    for _ in range(join_after or 0):
        engine.step()
    seqs += [engine.add_request(p, params) for p in prompts[len(first):]]
    drain(engine, max_steps=max_steps)
    return [s.output_token_ids for s in seqs]


def test_the_cpu_default_is_the_reference_read(tiny_model):
    """A model on the CPU reads the rectangle unless told otherwise, CUDA on the machine or not (the
    H200 run found this test expecting the streamed read there). The streamed read's engine-level
    logits are checked in tests/test_cache_reads.py and test_batch_rows.py."""
    assert next(tiny_model.parameters()).device.type == "cpu"
    assert Engine(tiny_model, EngineConfig(num_blocks=8)).kv_cache.read == "reference"


@interpreted
def test_a_streamed_view_derives_nothing():
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8, block_size=4, read="streamed")
    row = cache.blocks.open_row()
    k = torch.zeros(1, 5, 2, 4)
    cache.view(cache.plan_varlen([row], [5])).write(0, k, k)
    plan = cache.plan_decode([row], batch_size=2)
    view = cache.view(plan)
    assert view.slot_mapping is None and view.mask_bias is None and view.plan is plan


@interpreted
@needs_smollm2
def test_streamed_engine_on_smollm2(smollm2_model):
    # A real model that reads its cache; two ragged prompts keep the interpreter's walk affordable.
    prompts = ragged_prompts(smollm2_model.config.vocab_size)[1:3]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = run(Engine(smollm2_model, EngineConfig(num_blocks=32)), prompts, params)
    assert run(Engine(smollm2_model, EngineConfig(num_blocks=32, read="streamed")), prompts, params) == reference


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
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8)
    with pytest.raises(ValueError, match="needs the streamed read"):
        DecodeGraphs(tiny_model, cache, DecodeBuckets((1, 2), None))


# On a GPU: the compiled kernels (not the interpreter), graphs over the widthless list, and the
# acceptance at Llama-3.2-1B shapes. fp32 keeps the two reads' rounding apart from the question.
# The engines are eager, or graphs over the model's own forward, one step at a time.
EAGER = EngineConfig(enforce_eager=True)
GRAPHS = EngineConfig(compile=False, async_scheduling=False)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_graphs_decode_the_reference_tokens(tiny_path, dtype):
    from nanolab import load_model

    model = load_model(tiny_path, dtype=dtype, device="cuda")
    prompts = ragged_prompts(model.config.vocab_size)
    kw = dict(num_blocks=96, block_size=4, max_num_seqs=8)
    narrow = DecodeBuckets((1, 2, 4, 8), None)
    graphed = Engine(model, GRAPHS.replace(read="streamed", **kw), buckets=narrow, progress=False)
    assert graphed.runner.graphs is not None and len(graphed.runner.graphs.graphs) == 4
    out = run(graphed, prompts, join_after=3)
    assert out == run(Engine(model, EAGER.replace(read="streamed", **kw), buckets=narrow), prompts, join_after=3)
    if dtype == torch.float32:  # the reference, unpadded
        assert out == run(Engine(model, EAGER.replace(read="reference", **kw)), prompts, join_after=3)
    assert_all_free(graphed)


@pytest.mark.skipif(INTERPRETED, reason="with the interpreter on, a CPU cache can use the streamed read")
def test_a_cpu_cache_without_the_interpreter_refuses_the_streamed_read():
    with pytest.raises(ValueError, match="needs a CUDA cache"):
        make_cache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=8, read="streamed")


@needs_cuda
def test_streamed_read_at_llama_1b_shapes(tmp_path):
    from nanolab import load_model
    from nanolab.model.config import PRESETS
    from nanolab.model.weights import synthesize_weights

    path = synthesize_weights(PRESETS["llama-3.2-1b"], tmp_path / "llama-1b-shapes", progress=False)
    model = load_model(path, dtype=torch.float32, device="cuda")
    prompts = ragged_prompts(model.config.vocab_size, lengths=(5, 17, 100, 300, 700, 1000))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(num_blocks=512, block_size=16, max_num_seqs=8)
    reference = run(Engine(model, EAGER.replace(read="reference", **kw)), prompts, params, join_after=4)
    streamed = Engine(model, GRAPHS.replace(read="streamed", **kw), buckets=DecodeBuckets((1, 2, 4, 8), None),
                      progress=False)
    assert run(streamed, prompts, params, join_after=4) == reference


@needs_cuda
def test_on_cuda_the_engine_defaults_to_the_streamed_read_and_a_batch_only_list(tiny_path):
    from nanolab import load_model

    model = load_model(tiny_path, device="cuda")  # fp32: the two reads' tokens must agree exactly
    kw = dict(num_blocks=96, block_size=4, max_num_seqs=8)
    engine = Engine(model, GRAPHS.replace(**kw), progress=False)
    assert engine.kv_cache.read == "streamed"
    assert engine.runner.buckets.widths is None
    assert sorted(engine.runner.graphs.graphs) == [(1, None), (2, None), (4, None), (8, None)]
    prompts = ragged_prompts(model.config.vocab_size)
    assert run(engine, prompts, join_after=3) == run(Engine(model, EAGER.replace(read="reference", **kw)), prompts,
                                                     join_after=3)
