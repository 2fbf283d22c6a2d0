"""No request breaks the engine: random request streams with injected failures (a sampler that
raises for some requests, forwards that raise, aborts at any time, clients that disconnect).
After every run, once the engine is idle, every block is free, and every request that survived
produced the greedy tokens it produces alone."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from unittest import mock

import pytest
import torch
from conftest import bounded
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_cache_properties import check_drained

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine import llm_engine
from nanolab.engine.async_llm import AsyncLLM
from nanolab.sampling import sample, sample_tokens

BLOCK = 4
VOCAB = 320  # the sharp models' vocabulary


class Poisoned(Exception):
    pass


def poisoned_sampler(poisoned: set[int]):
    """`sample_tokens`, except that a batch holding a poisoned request (by its params' identity) raises."""
    def sampler(logits, params, generators):
        if any(id(p) in poisoned for p in params):
            raise Poisoned("injected sampler failure")
        return sample_tokens(logits, params, generators)
    return sampler


class FlakyRunner:
    """Wraps the engine's runner: while `fail_next` is set, the next forward raises, after its plan."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.fail_next = False
        self.failed: set[int] = set()  # request ids whose forward raised

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _maybe_fail(self, seqs):
        if self.fail_next:
            self.fail_next = False
            self.failed.update(s.request_id for s in seqs)
            raise RuntimeError("injected forward failure")

    # The failure comes inside the forward: the step is planned (its tables grew, its slots are
    # taken) and its K/V never written, so a block keyed anyway would hold garbage.
    def run_varlen(self, seqs, counts, computed, sampled):
        if self.fail_next:
            self.runner.kv_cache.plan_varlen([s.row for s in seqs], counts, sampled)
            self._maybe_fail(seqs)
        return self.runner.run_varlen(seqs, counts, computed, sampled)

    def decode(self, seqs, ids=None):
        if self.fail_next:
            self.runner.plan_step(seqs, ids)
            self._maybe_fail(seqs)
        return self.runner.decode(seqs, ids)

    def verify(self, seqs, counts, **kw):
        if self.fail_next:
            self.runner.kv_cache.plan_decode([s.row for s in seqs], query_lens=counts)
            self._maybe_fail(seqs)
        return self.runner.verify(seqs, counts, **kw)


@functools.cache
def alone(model_key: int, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    model = _MODELS[model_key]
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK, max_num_seqs=1))
    seq = engine.add_request(list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    return seq.output_token_ids


_MODELS: dict[int, object] = {}

PROMPT = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24)
OP = st.one_of(
    st.tuples(st.just("add"), PROMPT, st.integers(1, 10), st.booleans()),  # prompt, max_tokens, poisoned
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("fail_forward")),
)


def run_faulty_ops(engine, flaky, ops, seqs, fated, poisoned, shared, step) -> None:
    """Apply `ops` to `engine`: adds (each prompt after `shared`; a poisoned one's params in
    `poisoned`, its fate in `fated`), steps, aborts and injected forward failures."""
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, poison = op
            prompt = shared + prompt
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            if poison:
                poisoned.add(id(params))
            seq = engine.add_request(prompt, params)
            fated[seq.request_id] = poison
            seqs.append(seq)
        elif op[0] == "step":
            step()
        elif op[0] == "abort" and seqs:
            engine.abort_request(seqs[op[1] % len(seqs)].request_id)
        elif op[0] == "fail_forward":
            flaky.fail_next = True


def greedy_continuation(model, seqs, tokens: list[int], k: int) -> list[int]:
    """Up to `k` tokens greedy decoding emits after `tokens`, when they are a request's prompt and
    a prefix of what greedy emits for it alone; none otherwise."""
    for seq in seqs:
        prompt = seq.prompt_token_ids
        if tokens[:len(prompt)] == prompt:
            out = alone(id(model), tuple(prompt), seq.params.max_tokens)
            done = tokens[len(prompt):]
            if out[:len(done)] == done:
                return out[len(done): len(done) + k]
    return []


@pytest.mark.parametrize("mode", ["sync", "async", "chained"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OP, min_size=1, max_size=40), num_blocks=st.integers(9, 24), max_num_seqs=st.integers(1, 4),
       budget=st.sampled_from([3, 7, 2048]),  # chunked prefill's budget: prompts of up to 24 tokens in chunks
       caching=st.booleans(), shared=st.lists(st.integers(3, VOCAB - 1), max_size=9))
def test_failures_stay_with_their_request(sharp_gqa24, mode, ops, num_blocks, max_num_seqs, budget, caching, shared):
    """With prefix caching on, prompts begin with one shared run of tokens, so requests share
    blocks across the failures: a block keyed by a forward that failed would show here. `mode`:
    synchronous steps, asynchronous scheduling, or that with speculation, where these greedy
    requests chain their verify steps (drafts of up to 3, never paused) and a forward fails while
    the step before it is still in flight."""
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    poisoned: set[int] = set()
    num_blocks += 3 if caching else 0  # room for the shared tokens of the longest request
    spec = {"num_speculative_tokens": 3, "max_draft_backoff": 0} if mode == "chained" else None
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=budget, async_scheduling=mode != "sync",
                                        enable_prefix_caching=caching, speculative_config=spec),
                    sampler=poisoned_sampler(poisoned))
    engine.runner = flaky = FlakyRunner(engine.runner)
    seqs, fated = [], {}
    if mode == "chained":  # drafts from greedy's own output, cut at random: verify steps keep some and lose some
        rng = random.Random(len(ops))
        proposer = mock.patch.object(llm_engine, "propose_ngram", lambda tokens, k, *args: [
            t if rng.random() < 0.7 else VOCAB - 1 - t for t in greedy_continuation(model, seqs, tokens, k)])
    else:
        proposer = contextlib.nullcontext()

    def step():
        outputs = engine.step()
        for out in outputs:
            if out.error is not None:
                assert out.token_id is None and out.seq.finish_reason == "error"

    with proposer:
        run_faulty_ops(engine, flaky, ops, seqs, fated, poisoned, shared if caching else [], step)
        flaky.fail_next = False
        for _ in bounded(engine.has_unfinished_requests):
            step()

    check_drained(engine.kv_cache, engine.scheduler)
    assert not engine.requests
    if mode == "chained":
        event(f"chained: {'drafts kept' if engine.spec_accepted_tokens else 'no draft kept'}, "
              f"{'drafts lost' if engine.spec_draft_tokens > engine.spec_accepted_tokens else 'no draft lost'}")
    for seq in seqs:
        assert seq.finished and seq.row is None
        if fated[seq.request_id] and seq.finish_reason != "abort":
            # A poisoned request ends with an error (the sampler's, or an injected forward failure
            # that came first) before its first token.
            assert seq.finish_reason == "error" and not seq.output_token_ids
        if seq.finish_reason == "error":
            # Only its own poison, or a forward it was part of, ends a request with an error.
            assert fated[seq.request_id] or seq.request_id in flaky.failed, seq.error
            event("a request failed")
        elif seq.finish_reason == "length":
            assert seq.output_token_ids == alone(id(model), tuple(seq.prompt_token_ids), seq.params.max_tokens), \
                f"request {seq.request_id} changed by the failures around it"
            event("a request survived")


def test_a_failed_forward_leaves_no_block_in_the_prefix_cache(sharp_gqa24):
    """A prompt's first forward fails after its plan (its blocks taken, their K/V never written):
    none of those blocks may be found by the next request with the same prefix, whose tokens are
    then the ones it gets alone."""
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=BLOCK, enable_prefix_caching=True))
    engine.runner = flaky = FlakyRunner(engine.runner)
    prompt = list(range(40, 53))  # three full blocks and one token
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = engine.add_request(prompt, params)
    flaky.fail_next = True
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert first.finish_reason == "error"
    second = engine.add_request(prompt + [7], params)
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert engine.scheduler.prefix_cache_hits == 0, "a block of the failed forward was found in the cache"
    assert second.output_token_ids == alone(id(model), tuple(prompt + [7]), 4)
    third = engine.add_request(prompt + [9], params)  # now the second request's blocks are cached, written
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert engine.scheduler.prefix_cache_hits == 12
    assert third.output_token_ids == alone(id(model), tuple(prompt + [9]), 4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_row_does_not_take_its_batch_down(sharp_gqa24, async_scheduling):
    """One request's sampling raises in the middle of a batch: it alone ends, with the error, and
    the others finish with the tokens they produce alone."""
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    poisoned: set[int] = set()
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK, async_scheduling=async_scheduling),
                    sampler=poisoned_sampler(poisoned))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in prompts]
    seqs = engine.add_requests(prompts, params)
    engine.step()  # the prefill
    poisoned.add(id(params[1]))
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert seqs[1].finish_reason == "error" and len(seqs[1].output_token_ids) == 1
    for i in (0, 2):
        assert seqs[i].output_token_ids == alone(id(model), tuple(prompts[i]), 6)
    check_drained(engine.kv_cache, engine.scheduler)


HOST_FAULTS = {  # what fails -> the words its request's error names
    "stop strings": "its output's handling failed",
    "logprobs": "its logprobs failed",
    "prompt logprobs": "its prompt's logprobs failed",
    "block keys": "keying its blocks failed",
    "drafts": "its draft lookup failed",
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("fault", list(HOST_FAULTS))
def test_a_request_whose_host_work_fails_ends_alone(sharp_gqa24, fault, async_scheduling):
    """One request's own host work raises after its forward: decoding its text for its stop
    strings, its tokens' or its prompt's logprobs, keying its blocks for the prefix cache, looking
    up its drafts. It alone ends, with an error naming what failed; the others finish with the
    tokens they produce alone, a request added after is served, and every block comes back."""
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    target = [8, 9, 10, 11, 12, 8, 9, 10]  # it repeats, so prompt lookup proposes drafts for it
    prompts = [[5, 6, 7], target, [13, 14]]
    kw = dict(temperature=0, max_tokens=6, ignore_eos=True)
    params = [SamplingParams(**kw) for _ in prompts]
    params[1] = SamplingParams(**kw, stop=["zzz"] if fault == "stop strings" else None,
                               logprobs=2 if fault == "logprobs" else None,
                               prompt_logprobs=1 if fault == "prompt logprobs" else None)
    config = dict(num_blocks=64, block_size=BLOCK, async_scheduling=async_scheduling,
                  enable_prefix_caching=fault == "block keys",
                  speculative_config={"num_speculative_tokens": 2} if fault == "drafts" else None)

    def poisoned(*args):
        raise Poisoned(f"injected {fault} failure")

    engine = Engine(model, EngineConfig(**config), detokenize=poisoned if fault == "stop strings" else None)
    key_blocks, propose = engine.block_manager._key_full_blocks, llm_engine.propose_ngram

    def key_full_blocks(table, prompt, output):
        if list(prompt) == target:
            poisoned()
        return key_blocks(table, prompt, output)

    def propose_ngram(tokens, *args):
        if list(tokens[:len(target)]) == target:
            poisoned()
        return propose(tokens, *args)

    with contextlib.ExitStack() as patches:
        if fault in ("logprobs", "prompt logprobs"):
            patches.enter_context(mock.patch.object(llm_engine, "compute_logprobs", poisoned))
        if fault == "block keys":
            patches.enter_context(mock.patch.object(engine.block_manager, "_key_full_blocks", key_full_blocks))
        if fault == "drafts":
            patches.enter_context(mock.patch.object(llm_engine, "propose_ngram", propose_ngram))
        seqs = engine.add_requests(prompts, params)
        for _ in bounded(engine.has_unfinished_requests):
            engine.step()
        assert seqs[1].finish_reason == "error" and HOST_FAULTS[fault] in seqs[1].error, seqs[1].error
        assert f"injected {fault} failure" in seqs[1].error
        if fault == "stop strings":  # its first token's text failed: that token went out to nobody, and is gone
            assert seqs[1].output_token_ids == []
        for i in (0, 2):
            assert seqs[i].finish_reason == "length"
            assert seqs[i].output_token_ids == alone(id(model), tuple(prompts[i]), 6)
        after = engine.add_request([15, 16, 17], SamplingParams(**kw))
        for _ in bounded(engine.has_unfinished_requests):
            engine.step()
        assert after.output_token_ids == alone(id(model), (15, 16, 17), 6)
    check_drained(engine.kv_cache, engine.scheduler)


def test_a_request_failed_after_its_preemption_stays_ended(tiny_model):
    """Under asynchronous scheduling with speculation, a sampled row's draft lookup runs before the
    step is scheduled; when it raises and the step then preempts that request, it ends from the
    queue it went back to, once: no token of it goes out after its error, and it is never
    admitted again. Whichever lookup fails, the other requests keep their tokens and every block
    comes back."""
    prompts = [[13] * 7, [22] * 7, [32] * 7, [45] * 5]
    params = [SamplingParams(temperature=t, max_tokens=30, ignore_eos=True) for t in (0, 0.8, 0, 0)]
    def run(fail_at: int):
        # The sampled request draws from torch's global generator: seeded alike, every run matches
        # the clean one up to its failure, so its fail_at-th lookup comes (unseeded, the schedule
        # could differ and the request end before it).
        torch.manual_seed(0)
        engine = Engine(tiny_model, EngineConfig(num_blocks=14, block_size=BLOCK, async_scheduling=True,
                                                 speculative_config={"num_speculative_tokens": 2,
                                                                     "max_draft_backoff": 0}))
        seqs = engine.add_requests(prompts, params)
        calls, after_error = [0], []

        def lookup(tokens, k, *args):  # every other length proposes; request 2's fail_at-th lookup raises
            if list(tokens[:7]) == prompts[2]:
                calls[0] += 1
                if calls[0] == fail_at:
                    raise Poisoned("injected lookup failure")
            return [tokens[-1]] * k if len(tokens) % 2 == 0 else []

        with mock.patch.object(llm_engine, "propose_ngram", lookup):
            for _ in bounded(engine.has_unfinished_requests):
                after_error += [o for o in engine.step() if o.seq is seqs[2] and seqs[2].error and o.error is None]
        check_drained(engine.kv_cache, engine.scheduler)
        return seqs, after_error, calls[0]

    clean, _, lookups = run(0)
    for fail_at in range(1, lookups + 1):
        seqs, after_error, _ = run(fail_at)
        assert seqs[2].finish_reason == "error" and not after_error, (fail_at, seqs[2].finish_reason)
        for i in (0, 3):
            assert seqs[i].output_token_ids == clean[i].output_token_ids, fail_at


def test_adding_a_batch_is_all_or_nothing(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=16, block_size=BLOCK))
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="request 2"):
        engine.add_requests([[5, 6], [7], [True, 8]], [good] * 3)
    with pytest.raises(ValueError, match="request 1"):
        engine.add_requests([[5, 6], [7] * 200], [good, SamplingParams(max_tokens=None)])
    assert not engine.requests and not engine.has_unfinished_requests()
    check_drained(engine.kv_cache, engine.scheduler)


def test_an_engine_takes_its_choices_as_one_config(tiny_model):
    """Every field is checked by `EngineConfig` (tests/test_validation.py); the engine takes one."""
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(tiny_model, {"num_blocks": 16})
    with pytest.raises(ValueError, match="max_model_len=1"):
        Engine(tiny_model, EngineConfig(num_blocks=16, max_model_len=1))


# The same promises online: requests arrive from asyncio while the loop thread steps, and clients
# disconnect at any time.

ARRIVAL = st.tuples(PROMPT, st.integers(1, 10), st.integers(0, 3),  # prompt, max_tokens, delay in steps
                    st.one_of(st.none(), st.integers(0, 6)), st.booleans())  # disconnect after n tokens, poisoned


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(ARRIVAL, min_size=1, max_size=8), num_blocks=st.integers(9, 24),
       max_num_seqs=st.integers(1, 4))
def test_online_engine_survives_disconnects(sharp_gqa24, arrivals, num_blocks, max_num_seqs):
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    poisoned: set[int] = set()
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs),
                    sampler=poisoned_sampler(poisoned))

    async def client(llm: AsyncLLM, prompt, max_tokens, delay, leave_after, poison):
        await asyncio.sleep(delay * 0.002)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        if poison:
            poisoned.add(id(params))
        stream = llm.add_request(prompt, params)
        try:
            async for _ in stream:
                if leave_after is not None and len(stream.output_token_ids) >= leave_after:
                    raise ConnectionResetError  # the client went away
        except ConnectionResetError:
            pass
        finally:
            llm.abort(stream)
        return stream

    async def main():
        llm = AsyncLLM(engine)
        llm.start()
        streams = await asyncio.wait_for(asyncio.gather(*(client(llm, *a) for a in arrivals)), 60)
        await llm.shutdown()
        return llm, streams

    llm, streams = asyncio.run(main())
    assert llm.dead is None
    check_drained(engine.kv_cache, engine.scheduler)
    assert not engine.requests
    for stream, (prompt, max_tokens, _, _, poison) in zip(streams, arrivals):
        assert stream.finished
        if stream.finish_reason == "length":
            assert not poison
            assert stream.output_token_ids == alone(id(model), tuple(prompt), max_tokens)
            event("a stream survived")
        elif stream.finish_reason == "error":
            assert poison
        else:
            assert stream.finish_reason == "abort"
            event("a client left")


def test_an_abort_frees_blocks_before_the_next_step(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, block_size=BLOCK))
    steps_after_abort = []

    async def main():
        llm = AsyncLLM(engine)
        llm.start()
        stream = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in stream:
            if len(stream.output_token_ids) >= 3:  # a chunk may carry several tokens on a busy machine
                (seq,) = engine.requests.values()
                seen = len(seq.output_token_ids)
                llm.abort(stream)
                break
        for _ in range(400):  # the loop thread frees the request before its next step
            if not engine.requests:
                break
            await asyncio.sleep(0.005)
        steps_after_abort.append(len(seq.output_token_ids) - seen)
        await llm.shutdown()
        return stream

    stream = asyncio.run(main())
    assert stream.finish_reason == "abort" and seq_free(engine)
    # At most the step that was running when the abort was posted.
    assert steps_after_abort[0] <= 1, f"the aborted request ran {steps_after_abort[0]} more steps"


def seq_free(engine) -> bool:
    check_drained(engine.kv_cache, engine.scheduler)
    return not engine.requests


@pytest.mark.parametrize("cleanup", ["works", "fails"])
def test_online_engine_reports_a_dead_loop(tiny_model, cleanup):
    """A failure the engine cannot pin on a request (here, in the scheduler) ends every open
    stream with the error and marks the engine dead; nothing is left holding blocks. When the
    core's cleanup fails as well, the streams still end and the death is still reported, with both
    errors."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=16, block_size=BLOCK))

    def broken():
        raise RuntimeError("scheduler bug")

    engine.scheduler.schedule = broken
    if cleanup == "fails":
        engine.close = lambda: (_ for _ in ()).throw(RuntimeError("close bug"))

    async def main():
        llm = AsyncLLM(engine)
        llm.start()
        stream = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))

        async def collect():
            return [d async for d in stream]

        deltas = await asyncio.wait_for(collect(), 30)  # a core that died silently would leave it hanging
        await llm.shutdown()
        return llm, stream, deltas

    llm, stream, deltas = asyncio.run(main())
    assert stream.finish_reason == "error" and "scheduler bug" in stream.error
    assert llm.dead is not None and "scheduler bug" in llm.dead
    assert ("close bug" in llm.dead) == (cleanup == "fails")
    assert engine.block_manager.allocator.num_free == 16
    with pytest.raises(RuntimeError, match="not running"):
        llm.add_request([5], SamplingParams())


def test_a_failed_batch_leaves_seeded_draws_alone(sharp_gqa24):
    """The batch sampler draws for every row before one row fails; the row-by-row retry must give
    the seeded request the draw it makes alone, not the next one."""
    model = sharp_gqa24.model
    poisoned: set[int] = set()

    def sampler(logits, params, generators):
        tokens = sample(logits, params, generators)  # every generator moves on
        if any(id(p) in poisoned for p in params):
            raise Poisoned("after drawing")
        return tokens

    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    solo = Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK))
    alone_seq = solo.add_request([5, 6, 7], seeded)
    for _ in bounded(solo.has_unfinished_requests):
        solo.step()

    engine = Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK), sampler=sampler)
    bad = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    poisoned.add(id(bad))
    seq, failed = engine.add_requests([[5, 6, 7], [9, 10]], [seeded, bad])
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert failed.finish_reason == "error"
    assert seq.output_token_ids == alone_seq.output_token_ids


def test_a_chained_step_that_fails_reads_back_the_step_before(sharp_gqa24):
    """Two greedy requests chain their steps (speculation under asynchronous scheduling), the
    second fed greedy's own tokens as drafts, the first none. Once the step in flight is the first
    one's last, the next step, the second's alone, fails in its
    forward: the step before is still read back, so the first ends by its length with the tokens
    it emits alone, the second ends with the forward's error, and every block comes back."""
    model = sharp_gqa24.model
    _MODELS[id(model)] = model
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=BLOCK, async_scheduling=True,
                                        speculative_config={"num_speculative_tokens": 2, "max_draft_backoff": 0}))
    engine.runner = flaky = FlakyRunner(engine.runner)
    prompts = [[7, 8, 9, 10, 11], [20, 21, 22, 23]]
    first, second = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                     for p, n in zip(prompts, (4, 12))]
    with mock.patch.object(llm_engine, "propose_ngram",
                           lambda tokens, k, *args: greedy_continuation(model, [second], tokens, k)):
        for _ in bounded(lambda: not (engine.in_flight and first in engine._inflight.seqs and not first.finished
                                      and engine._ends_by_length(first))):
            engine.step()
        flaky.fail_next = True
        outputs = engine.step()
        for _ in bounded(engine.has_unfinished_requests):
            engine.step()
    assert flaky.failed == {second.request_id}
    # the call whose launch failed returned the step before's tokens: the first's last among them
    assert any(out.seq is first and out.finished and out.error is None for out in outputs)
    assert first.finish_reason == "length" and first.output_token_ids == alone(id(model), tuple(prompts[0]), 4)
    assert second.finish_reason == "error" and second.num_accepted_tokens > 0
    check_drained(engine.kv_cache, engine.scheduler)
