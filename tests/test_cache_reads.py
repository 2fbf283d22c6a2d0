"""Logits, not only tokens: every step of an engine run against a one-shot forward of the same tokens.

The models (`sharp_model` in conftest) read their cache for real: a wrong decode read moves the
logits by whole units, where the comparison's tolerance is 1e-4 (fp32). The reference is
transformers' `LlamaForCausalLM` on the same weights folder: it shares no code with the engine's
cache, plan, reads or kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, needs_cuda, run_until_done

from nanolab import Engine, EngineConfig, SamplingParams, load_model
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.kv_cache import CacheView
from nanolab.engine.plan import DecodePlan
from nanolab.kernels import INTERPRETED
from nanolab.lab.history import unplanned_runner

pytestmark = pytest.mark.usefixtures("one_thread")
interpreted = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter is off on a CUDA machine")

LENGTHS = (3, 4, 5, 15, 16, 17, 31)  # both sides of 4- and 16-token block boundaries


def prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_recorded(engine: Engine, prompt_list, params):
    logits, on_step = logit_recorder()
    seqs = [engine.add_request(p, params) for p in prompt_list]
    run_until_done(engine, on_step=on_step)
    return seqs, logits


def test_the_sharp_model_depends_on_what_the_decode_step_reads(sharp_model, monkeypatch):
    """The premise of every logits test here: a decode read that returns zeros changes most greedy
    tokens and moves the logits by far more than the tolerance."""
    params = greedy(12)
    good_seqs, good = run_recorded(Engine(sharp_model.model, EngineConfig(num_blocks=64, block_size=4)),
                                   prompts(320), params)
    real = CacheView.read

    def zero_decode_read(self, layer, q, positions, *own_kv):
        out = real(self, layer, q, positions, *own_kv)
        return torch.zeros_like(out) if isinstance(self.plan, DecodePlan) else out

    monkeypatch.setattr(CacheView, "read", zero_decode_read)
    bad_seqs, bad = run_recorded(Engine(sharp_model.model, EngineConfig(num_blocks=64, block_size=4)), prompts(320),
                                 params)
    tokens = [(a, b) for s, t in zip(good_seqs, bad_seqs) for a, b in zip(s.output_token_ids[1:],
                                                                           t.output_token_ids[1:])]
    same = sum(a == b for a, b in tokens)
    assert same < len(tokens) // 2, f"{same} of {len(tokens)} greedy tokens survive a zeroed read"
    # the first decode step (output 1) has the same input either way: its logits alone measure the read
    moved = min(float((good[s.request_id][1] - bad[t.request_id][1]).abs().max())
                for s, t in zip(good_seqs, bad_seqs))
    assert moved > 0.1, f"a zeroed read moves some row's logits by only {moved:.3g}"


def test_the_reference_agrees_with_a_one_shot_engine_prefill(sharp_model):
    """The reference itself: transformers' last-position logits equal nanolab's prefill's."""
    for p in prompts(320):
        engine = Engine(sharp_model.model, EngineConfig(num_blocks=16, block_size=4))
        seqs, logits = run_recorded(engine, [p], greedy(1))
        assert_logits_match_reference(sharp_model, seqs, logits)


BUCKETS = {
    "eager": None,
    "buckets": DecodeBuckets((1, 2, 4, 8), (16, 32, 64)),  # the reference read pads width too
}


@pytest.mark.parametrize("buckets", BUCKETS.values(), ids=BUCKETS.keys())
def test_reference_read_logits_match_a_one_shot_forward(sharp_model, buckets):
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=64, block_size=4, read="reference"), buckets=buckets)
    seqs, logits = run_recorded(engine, prompts(320), greedy(16))
    assert_logits_match_reference(sharp_model, seqs, logits)


@interpreted
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("buckets", [None, DecodeBuckets((1, 2, 4, 8), None)], ids=["eager", "buckets"])
def test_streamed_read_logits_match_a_one_shot_forward(sharp_model, buckets, block_size):
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=256 // block_size, block_size=block_size,
                                                    read="streamed"), buckets=buckets)
    seqs, logits = run_recorded(engine, prompts(320), greedy(12))
    assert_logits_match_reference(sharp_model, seqs, logits)


@pytest.mark.parametrize("read", ["reference", pytest.param("streamed", marks=interpreted)])
def test_logits_at_a_head_dim_that_is_not_a_power_of_two(sharp_gqa24, read):
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=64, block_size=4, read=read))
    seqs, logits = run_recorded(engine, prompts(320, lengths=(5, 16, 11)), greedy(8))
    assert_logits_match_reference(sharp_gqa24, seqs, logits)


def test_unplanned_decode_logits_match_a_one_shot_forward(sharp_model):
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=64, block_size=4), runner=unplanned_runner())
    seqs, logits = run_recorded(engine, prompts(320), greedy(12))
    assert_logits_match_reference(sharp_model, seqs, logits)


@needs_cuda
@pytest.mark.parametrize("read", ["reference", "streamed"])
def test_graphed_cuda_logits_match_a_one_shot_forward(sharp_model, read):
    """The engine as `LLM` runs it on a GPU: compiled Triton (not its interpreter) and every decode
    step a CUDA graph replay, in fp32, against transformers on the CPU."""
    model = load_model(sharp_model.path, dtype=torch.float32, device="cuda")
    buckets = DecodeBuckets((1, 2, 4, 8), (16, 32, 64) if read == "reference" else None)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read=read, compile=False, async_scheduling=False),
                    buckets=buckets, progress=False)
    assert engine.kv_cache.read == read and len(engine.runner.graphs.graphs) == len(buckets)
    seqs, logits = run_recorded(engine, prompts(320), greedy(12))
    assert_logits_match_reference(sharp_model, seqs, {k: [row.cpu() for row in v] for k, v in logits.items()})
