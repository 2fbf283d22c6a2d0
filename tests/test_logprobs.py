"""Log-probabilities and parallel sampling in the engine, against a one-shot forward of HF
transformers on a sharp model (whose logits move by whole units when a step reads the wrong key).

Logprobs are the log-softmax of the raw logits in fp32: the sampled token's and the top k, for
every output token (`logprobs`) and every prompt token after the first (`prompt_logprobs`), in
chunks, beside other requests, after a preemption, and with prefix caching on. A request's n
samples compute their prompt once and share its blocks."""

from __future__ import annotations

import pytest
import torch
from conftest import bounded, needs_cuda, run_until_done
from test_cache_properties import check_drained

from nanolab import LLM, Engine, EngineConfig, SamplingParams
from nanolab.sampling import MAX_LOGPROBS, compute_logprobs

BS = 4


def engine_for(sharp, **kw) -> Engine:
    config = EngineConfig(**{"block_size": BS, "max_num_batched_tokens": 7, "num_blocks": 64, **kw})
    return Engine(sharp.model, config)


def reference(sharp, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab]: the log-softmax of a one-shot forward's logits, position p scoring token p + 1."""
    return torch.log_softmax(sharp.reference_logits(tokens), dim=-1)


def assert_positions(entries, ref_rows: torch.Tensor, token_ids: list[int], k: int, what: str,
                     atol: float = 1e-4) -> None:
    """Each entry (logprob, top k) against a reference row: the token's log-probability and the top
    k (ids in order where their values are apart, values everywhere), within `atol`."""
    assert len(entries) == len(token_ids) == len(ref_rows), f"{what}: {len(entries)} entries for {len(token_ids)}"
    for p, ((lp, top), row, token) in enumerate(zip(entries, ref_rows, token_ids)):
        assert abs(lp - float(row[token])) < atol, f"{what} {p}: logprob {lp} against {float(row[token])}"
        assert len(top) == k
        values, ids = row.topk(k)
        assert torch.allclose(torch.tensor([v for _, v in top]), values, atol=atol), f"{what} {p}: top values"
        gaps = (values[:-1] - values[1:]).abs() > 1e-3  # ties may come in either order
        assert all(a == int(b) for (a, _), b, apart in zip(top, ids, [*gaps.tolist(), True]) if apart)


def test_compute_logprobs_is_the_fp32_log_softmax():
    logits = torch.randn(3, 50, dtype=torch.bfloat16)
    (lp, top), *_ = compute_logprobs(logits, [7, 8, 9], 3)
    ref = torch.log_softmax(logits.float(), -1)[0]
    assert lp == pytest.approx(float(ref[7]), abs=1e-6)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert compute_logprobs(logits, [1, 2, 3], 0)[2][1] == ()


def test_output_and_prompt_logprobs_match_the_reference_in_chunks(sharp_gqa24):
    """Sampled at temperature 0.7 (the logprobs stay the raw distribution's), one request with
    output and prompt logprobs beside one without, a prompt in chunks of 7: every position's
    logprob and top 5 are the one-shot forward's, and the other request is unchanged."""
    sharp = sharp_gqa24
    g = torch.Generator().manual_seed(0)
    prompt, other = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (17, 9))
    want = SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = engine_for(sharp)
    seq, beside = engine.add_requests([prompt, other], [want, plain])
    run_until_done(engine)
    full = seq.prompt_token_ids + seq.output_token_ids
    ref = reference(sharp, full)
    assert_positions(seq.prompt_logprobs, ref[:len(prompt) - 1], prompt[1:], 5, "prompt token")
    assert_positions(seq.output_logprobs, ref[len(prompt) - 1:-1], seq.output_token_ids, 5, "output token")
    assert beside.output_logprobs is None and beside.prompt_logprobs is None

    alone = engine_for(sharp)  # the plain request alone: the same tokens
    (again,) = alone.add_requests([other], [plain])
    run_until_done(alone)
    assert again.output_token_ids == beside.output_token_ids


def test_prompt_logprobs_bypass_the_prefix_cache_and_survive_preemption(sharp_gqa24):
    """With prefix caching on and the prompt already cached, a request that wants its prompt's
    logprobs still scores every prompt token; under a pool too small for two, the preempted
    request's recompute scores none twice."""
    sharp = sharp_gqa24
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 320, (14,), generator=g).tolist()
    engine = engine_for(sharp, enable_prefix_caching=True, num_blocks=9, max_num_seqs=2)
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2))
    run_until_done(engine)
    assert engine.scheduler.prefix_cache_hits == 0
    want = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0, prompt_logprobs=2)
    seqs = engine.add_requests([prompt, prompt[:5] + [9] * 9], [want, want])
    run_until_done(engine)
    assert engine.scheduler.num_preemptions > 0
    for seq in seqs:
        ref = reference(sharp, seq.prompt_token_ids + seq.output_token_ids)
        n = len(seq.prompt_token_ids)
        assert_positions(seq.prompt_logprobs, ref[:n - 1], seq.prompt_token_ids[1:], 2, "prompt token")
        assert_positions(seq.output_logprobs, ref[n - 1:-1], seq.output_token_ids, 0, "output token")
    check_drained(engine.kv_cache, engine.scheduler)


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_arrive_for_every_token_with_asynchronous_scheduling(sharp_gqa24, overlap):
    """A decode step holding a row that wants logprobs is read back before the next launches (the
    logits are gone after): every token has its entry, and the tokens are the synchronous ones."""
    sharp = sharp_gqa24
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 8)]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    engine = engine_for(sharp, async_scheduling=overlap)
    seqs = engine.add_requests(prompts, params)
    run_until_done(engine)
    seq = seqs[0]
    ref = reference(sharp, seq.prompt_token_ids + seq.output_token_ids)
    assert_positions(seq.output_logprobs, ref[len(seq.prompt_token_ids) - 1:-1], seq.output_token_ids, 1, "output")


def test_n_samples_share_the_prompt_and_differ_by_seed(sharp_gqa24):
    """n=3 with a seed: the later samples wait for the first to run the prompt and then share its
    full blocks (hits counted, nothing recomputed); the samples differ, and the same seed gives
    the same three again. Without prefix caching nothing is shared and the tokens are the same.
    `Engine.add_requests` expands a request of n samples itself, as the samples given one by one;
    `add_request`, which returns one sequence, refuses n > 1."""
    sharp = sharp_gqa24
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 320, (18,), generator=g).tolist()
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=8, ignore_eos=True)
    runs = []
    for run, caching in enumerate((True, True, False)):
        engine = engine_for(sharp, enable_prefix_caching=caching)
        samples = params.samples()
        assert [p.seed for p in samples] == [11, 12, 13] and all(p.n == 1 for p in samples)
        seqs = engine.add_requests([prompt], [params]) if run == 0 else engine.add_requests([prompt] * 3, samples)
        assert [s.params for s in seqs] == samples
        fed = []
        for _ in bounded(engine.has_unfinished_requests):
            engine.step()
            fed.append(engine.last_step.tokens if engine.last_step else 0)
        runs.append([s.output_token_ids for s in seqs])
        if caching:
            assert seqs[1].parent is seqs[0] and seqs[2].parent is seqs[0]
            assert engine.scheduler.prefix_cache_hits == 2 * (len(prompt) // BS) * BS
            assert sum(fed) == len(prompt) + 2 * (len(prompt) % BS) + 3 * 7  # the prompt once, then two tails
        check_drained(engine.kv_cache, engine.scheduler)
    assert len({tuple(t) for t in runs[0]}) == 3, "the samples are the same"
    assert runs[0] == runs[1] == runs[2]
    with pytest.raises(ValueError, match="SamplingParams.n=3"):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt_len,prompt_logprobs", [(18, 1), (BS, None)])
def test_samples_that_would_share_nothing_start_together(sharp_gqa24, prompt_len, prompt_logprobs):
    """With prefix caching, n=3 samples that could share no block do not wait for the first: ones
    that want their prompt's logprobs (each computes every prompt token), and ones whose prompt
    fills no block before its last token. All three run from the first step."""
    engine = engine_for(sharp_gqa24, enable_prefix_caching=True, max_num_batched_tokens=64)
    prompt = torch.randint(3, 320, (prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=3, ignore_eos=True,
                            prompt_logprobs=prompt_logprobs)
    seqs = engine.add_requests([prompt], [params])
    engine.step()
    assert all(s.output_token_ids for s in seqs), "a sample waited for the first"
    run_until_done(engine)
    check_drained(engine.kv_cache, engine.scheduler)


def test_bad_logprobs_and_n_name_the_field():
    for field, value in (("logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", -1), ("n", 0), ("logprobs", True)):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
            SamplingParams(**{field: value})
    assert SamplingParams(seed=2**64 - 1, n=2).samples()[1].seed == -(2**63)


@needs_cuda
@pytest.mark.cuda
def test_logprobs_and_samples_under_the_cuda_defaults(sharp_gqa24, monkeypatch):
    """On CUDA with every step graphed, the decode compiled, asynchronous scheduling and prefix
    caching: a prompt's and its tokens' logprobs within 1e-3 of the reference (its steps ran
    eagerly where a graph has no room for a prompt's logits, and were read back before the next
    launch), beside three seeded samples that share their prompt."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator().manual_seed(6)
    prompt, shared = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 50))
    llm = LLM(str(sharp_gqa24.path), device="cuda", dtype="float32", max_num_batched_tokens=24, max_num_seqs=8,
              num_blocks=128, enable_prefix_caching=True)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.varlen_graphs is not None
    want = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4, prompt_logprobs=4)
    samples = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=10, ignore_eos=True).samples()
    seq, *others = engine.add_requests([prompt] + [shared] * 3, [want, *samples])
    run_until_done(engine)
    ref = reference(sharp_gqa24, prompt + seq.output_token_ids)
    n = len(prompt)
    assert_positions(seq.prompt_logprobs, ref[:n - 1], prompt[1:], 4, "prompt token", atol=1e-3)
    assert_positions(seq.output_logprobs, ref[n - 1:-1], seq.output_token_ids, 4, "output token", atol=1e-3)
    assert engine.scheduler.prefix_cache_hits == 2 * 48
    assert len({tuple(s.output_token_ids) for s in others}) == 3
    assert engine.block_manager.allocator.num_free == engine.num_blocks
