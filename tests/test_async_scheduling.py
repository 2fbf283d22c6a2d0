"""Asynchronous scheduling: a decode step is launched before the previous one is read back, its
input ids gathered on the device from the previous step's sampled tokens. It must decode exactly
what the synchronous engine decodes, whatever joins, leaves, stops or fails around it."""

from __future__ import annotations

import pytest
import torch
from conftest import bounded
from test_cache_properties import check_drained

from nanolab import Engine, EngineConfig, SamplingParams

BLOCK = 4


def run(engine: Engine, prompts, params, joins=()) -> list:
    """Queue `prompts`, step to the end; `joins` [(after_step, prompt, params)] arrive later."""
    seqs = engine.add_requests(prompts, params)
    pending = sorted(joins, key=lambda j: j[0])
    n = 0
    for _ in bounded(lambda: engine.has_unfinished_requests() or pending):
        while pending and pending[0][0] <= n:
            _, prompt, p = pending.pop(0)
            seqs.append(engine.add_request(prompt, p))
        engine.step()
        n += 1
    check_drained(engine.kv_cache, engine.scheduler)
    return seqs


def outcome(seqs) -> list:
    return [(s.output_token_ids, s.finish_reason) for s in seqs]


class Spy:
    """Counts decode calls that fed the device's tokens instead of the host's."""

    def __init__(self, runner) -> None:
        self.runner, self.device_fed, self.rows = runner, 0, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, seqs, ids=None):
        self.device_fed += ids is not None
        self.rows += len(seqs)
        return self.runner.decode(seqs, ids)


def engines(model, **fields) -> tuple[Engine, Engine, Spy]:
    sync = Engine(model, EngineConfig(block_size=BLOCK, **fields))
    fast = Engine(model, EngineConfig(block_size=BLOCK, async_scheduling=True, **fields))
    sync.runner, fast.runner = Spy(sync.runner), Spy(fast.runner)
    return sync, fast, fast.runner


def test_same_tokens_as_the_synchronous_engine(sharp_gqa24):
    """Requests leave the batch at different steps (the first one earliest, so the survivors' rows
    shift and their ids must be gathered), two are sampled with seeds, and two join mid-run."""
    sync, fast, spy = engines(sharp_gqa24.model, num_blocks=64, max_num_seqs=6)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [40, 41, 42, 43]]
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=11, ignore_eos=True)]
    joins = [(4, [50, 51, 52], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
             (6, [60, 61], SamplingParams(temperature=0.7, seed=1, max_tokens=4, ignore_eos=True))]
    expected = outcome(run(sync, prompts, params, joins))
    assert outcome(run(fast, prompts, params, joins)) == expected
    assert spy.device_fed > 5, "the async path never fed a step from the device's tokens"
    # Length limits are known ahead: no row is decoded past one.
    assert spy.rows == sync.runner.rows


def test_a_stop_token_in_flight_is_dropped(sharp_gqa24):
    """A request that samples EOS has one more step launched before the engine sees it; that step's
    token is dropped, and the request ends exactly as the synchronous engine ends it."""
    model = sharp_gqa24.model
    probe = run(Engine(model, EngineConfig(num_blocks=64, block_size=BLOCK)), [[8, 9, 10, 11, 12]],
                [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])[0].output_token_ids
    assert probe[0] != probe[1]
    sync, fast, spy = engines(model, num_blocks=64)
    for engine in (sync, fast):
        engine.eos_token_ids = frozenset({probe[1]})  # the first decoded token is now EOS
    prompts = [[8, 9, 10, 11, 12], [5, 6, 7]]
    params = [SamplingParams(temperature=0, max_tokens=8), SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True)]
    expected = outcome(run(sync, prompts, params))
    assert expected[0] == (probe[:2], "stop")
    assert outcome(run(fast, prompts, params)) == expected
    assert spy.device_fed > 0


def test_abort_while_in_flight(sharp_gqa24):
    """An abort lands between a launch and its read-back: the request ends, its blocks come back,
    and the others are untouched."""
    sync, fast, _ = engines(sharp_gqa24.model, num_blocks=64)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in prompts]
    expected = outcome(run(sync, prompts, params))
    seqs = fast.add_requests(prompts, params)
    fast.step()  # the prefill
    fast.step()  # decode launched, nothing read back yet
    assert fast.in_flight
    fast.abort_request(seqs[1].request_id)
    for _ in bounded(fast.has_unfinished_requests):
        fast.step()
    check_drained(fast.kv_cache, fast.scheduler)
    assert seqs[1].finish_reason == "abort"
    assert [outcome([s])[0] for s in (seqs[0], seqs[2])] == [expected[0], expected[2]]


def test_the_context_limit_is_never_overrun(sharp_gqa24):
    """A request that runs to max_model_len is left out of the step that would pass it: no plan
    ever grows a row past its block-table row."""
    sync, fast, _ = engines(sharp_gqa24.model, num_blocks=64, max_model_len=24)
    prompts = [list(range(5, 25)), [5, 6]]
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    expected = outcome(run(sync, prompts, params))
    assert expected[0][1] == "length" and len(expected[0][0]) == 4
    assert outcome(run(fast, prompts, params)) == expected
    assert fast.runner.rows == sync.runner.rows  # not one row decoded past the context


def test_preemption_falls_back_to_the_scheduler(sharp_gqa24):
    """A pool too small for every row's next block: the engine reads the step back and lets the
    scheduler preempt, and every request still ends with its synchronous tokens."""
    sync, fast, _ = engines(sharp_gqa24.model, num_blocks=7, max_num_seqs=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in prompts]
    expected = outcome(run(sync, prompts, params))
    assert sync.scheduler.num_preemptions > 0
    assert outcome(run(fast, prompts, params)) == expected


def test_async_scheduling_is_checked(tiny_model):
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine(tiny_model, EngineConfig(num_blocks=8, async_scheduling=1))


def test_logits_are_not_kept_in_flight(sharp_gqa24):
    """Under asynchronous scheduling a decode step's logits are overwritten before its tokens are
    read, so its outputs carry none; prefill outputs still do."""
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=32, block_size=BLOCK, async_scheduling=True))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    first = engine.step()
    assert isinstance(first[0].logits, torch.Tensor)
    later = [out for _ in bounded(engine.has_unfinished_requests) for out in engine.step()]
    assert len(later) == 3 and all(out.logits is None for out in later)


def test_a_failure_after_an_overlapped_step_reports_each_output_as_it_was(sharp_gqa24):
    """Step t + 1's forward raises while step t is in flight: one call returns t's token (the request
    still running) and then the failure. Each output carries the state it was made in, so a
    consumer that retires a request on `finished` (the server's engine core) sees it end once."""
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=32, block_size=BLOCK, async_scheduling=True))
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a decode launched, in flight
    decode = engine.runner.decode

    def broken(seqs, ids=None):
        raise RuntimeError("injected forward failure")

    engine.runner.decode = broken
    outputs = engine.step()
    engine.runner.decode = decode
    assert [(o.seq is seq, o.token_id is not None, o.finished, o.error is not None) for o in outputs] == [
        (True, True, False, False), (True, False, True, True)]
    assert not engine.has_unfinished_requests()
    check_drained(engine.kv_cache, engine.scheduler)


def test_turning_async_off_mid_flight_reads_the_step_back(sharp_gqa24):
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=32, block_size=BLOCK, async_scheduling=True))
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.in_flight
    engine.async_scheduling = False
    for _ in bounded(engine.has_unfinished_requests):
        engine.step()
    assert len(seq.output_token_ids) == 6 and seq.finish_reason == "length"
    check_drained(engine.kv_cache, engine.scheduler)


def test_a_full_engine_keeps_overlapping_while_requests_wait(sharp_gqa24):
    """Every row taken and more requests queued: nothing can be admitted until a row frees, so the
    engine keeps launching each step before reading the last back, and still decodes exactly what
    the synchronous engine does."""
    sync, fast, spy = engines(sharp_gqa24.model, num_blocks=64, max_num_seqs=2)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 12, 6, 5)]
    assert outcome(run(fast, prompts, params)) == outcome(run(sync, prompts, params))
    assert spy.device_fed >= 10, f"only {spy.device_fed} steps overlapped while requests waited for a row"


def test_blocks_filled_by_overlapped_steps_are_cached_for_the_next_request(tiny_model):
    """Under asynchronous scheduling a decode step's tokens are committed as it is launched, so a
    block its output fills is keyed like any other: a follow-up over the finished request's
    tokens finds every full block before its last, prompt and output alike. (The block that the
    final step in flight fills is not keyed: that step's tokens arrive after the request ends.)"""
    engine = Engine(tiny_model, EngineConfig(num_blocks=32, block_size=4, async_scheduling=True,
                                             enable_prefix_caching=True))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (first,) = run(engine, [[3, 4, 5, 6, 7]], [params])
    hits = engine.scheduler.prefix_cache_hits
    run(engine, [first.token_ids + [9]], [params])
    # 18 tokens: blocks 0 to 2 (the prompt and output up to position 11) are keyed; block 3, whose
    # last slot the final step in flight wrote, is not
    assert engine.scheduler.prefix_cache_hits - hits == 12
