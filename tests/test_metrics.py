"""`GET /metrics` on the tiny model with prefix caching: the token counters hold the exact counts,
each request adds one time to first token and one end-to-end latency, the gauges read the engine
(a running request while one streams, none after, every block used or free), a repeated prompt
hits the prefix cache, and an abort leaves the gauges at zero."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, run_with_client, sse

from nanolab import LLM

NUM_BLOCKS, BLOCK_SIZE = 64, 16
PROMPT = list(range(3, 43))  # 40 tokens: two full blocks and 8 tokens


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
               enable_prefix_caching=True)


async def scrape(client) -> dict[str, float]:
    """Every sample of `/metrics` by name (request_success's by name{finished_reason}), histogram
    buckets left out; fails unless each carries this server's model_name."""
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(await r.text()):
        for s in family.samples:
            if s.name.startswith("nanolab:") and not s.name.endswith("_bucket"):
                reason = s.labels.pop("finished_reason", None)
                assert s.labels == {"model_name": MODEL}, s
                samples[s.name if reason is None else f"{s.name}{{{reason}}}"] = s.value
    return samples


def test_metrics_count_tokens_and_requests_and_read_the_engine(llm):
    engine = llm.engine

    async def body(client, async_llm):
        before = await scrape(client)
        start = time.perf_counter()
        request = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        whole = await (await client.post("/v1/completions", json=request)).json()
        # The same prompt again, streamed: its first two blocks come from the prefix cache.
        streamed = await sse(await client.post("/v1/completions", json={
            **request, "stream": True, "stream_options": {"include_usage": True}}))
        # A third request, read while it runs.
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0,
                                                       "ignore_eos": True, "stream": True})
        assert r.status == 200
        await r.content.readline()
        await r.content.readline()  # a token has arrived: the core's message after that step came with it
        during = await scrape(client)
        rest = await sse(r)
        elapsed = time.perf_counter() - start
        after = await scrape(client)
        return before, whole["usage"], streamed[-2]["usage"], rest, during, after, elapsed

    before, usage_whole, usage_streamed, rest, during, after, elapsed = run_with_client(llm, body)
    assert rest[-1] == "[DONE]"
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["nanolab:prompt_tokens_total"] == usage_whole["prompt_tokens"] + usage_streamed["prompt_tokens"] + 3
    assert delta["nanolab:generation_tokens_total"] == 4 + 4 + 200
    assert delta["nanolab:time_to_first_token_seconds_count"] == 3
    assert delta["nanolab:e2e_request_latency_seconds_count"] == 3
    assert delta["nanolab:inter_token_latency_seconds_count"] == 3 + 3 + 199
    assert delta["nanolab:request_success_total{length}"] == 3
    assert delta["nanolab:request_success_total{stop}"] == delta["nanolab:request_success_total{error}"] == 0
    assert 0 < delta["nanolab:time_to_first_token_seconds_sum"] <= delta["nanolab:e2e_request_latency_seconds_sum"]
    # In seconds: the requests ran one after another (the third alone), inside `elapsed`.
    assert 0 < delta["nanolab:inter_token_latency_seconds_sum"] < delta["nanolab:e2e_request_latency_seconds_sum"]
    assert delta["nanolab:e2e_request_latency_seconds_sum"] <= elapsed

    assert during["nanolab:num_requests_running"] == 1 and during["nanolab:num_requests_waiting"] == 0
    assert during["nanolab:kv_blocks_used"] > 0
    assert during["nanolab:kv_cache_usage_perc"] == during["nanolab:kv_blocks_used"] / NUM_BLOCKS
    for gauges in (before, during, after):
        assert gauges["nanolab:kv_blocks_used"] + gauges["nanolab:kv_blocks_free"] == NUM_BLOCKS
    assert after["nanolab:num_requests_running"] == after["nanolab:num_requests_waiting"] == 0
    assert after["nanolab:kv_blocks_used"] == 0 and after["nanolab:kv_cache_usage_perc"] == 0

    # The prefix cache, in tokens, as the scheduler counts them.
    scheduler = engine.scheduler
    assert after["nanolab:prefix_cache_queries_total"] == scheduler.prefix_cache_queries
    assert after["nanolab:prefix_cache_hits_total"] == scheduler.prefix_cache_hits
    assert delta["nanolab:prefix_cache_queries_total"] == 2 * len(PROMPT) + 3
    assert delta["nanolab:prefix_cache_hits_total"] == 2 * BLOCK_SIZE


def test_an_abort_leaves_the_gauges_at_zero(llm, monkeypatch):
    """The core sends its stats once more when an abort leaves it idle, with no step to carry them.
    The abort reaches the engine: the request does not run on with no one reading it."""
    aborted_here, abort_request = [], llm.engine.abort_request
    monkeypatch.setattr(llm.engine, "abort_request", lambda rid: (aborted_here.append(rid), abort_request(rid)))

    async def body(client, async_llm):
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0,
                                                       "ignore_eos": True, "stream": True})
        assert r.status == 200
        await r.content.readline()
        await r.content.readline()
        during = await scrape(client)
        r.close()  # the client goes away mid-stream
        for _ in range(200):
            after = await scrape(client)
            if after["nanolab:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        return during, after

    during, after = run_with_client(llm, body)
    assert during["nanolab:num_requests_running"] == 1 and during["nanolab:kv_blocks_used"] > 0
    assert after["nanolab:num_requests_running"] == 0 and after["nanolab:kv_blocks_used"] == 0
    # The client's departure is counted as an abort, with its end-to-end latency.
    aborted = after["nanolab:request_success_total{abort}"] - during.get("nanolab:request_success_total{abort}", 0)
    assert aborted == 1
    assert after["nanolab:e2e_request_latency_seconds_count"] == during["nanolab:e2e_request_latency_seconds_count"] + 1
    assert len(aborted_here) == 1


def test_a_dead_core_leaves_the_gauges_at_zero_and_counts_its_requests(llm, monkeypatch):
    """When the engine core dies with requests running, each ends with the error and is counted as
    one, and the gauges say what is left: no request running or waiting, no block held."""

    async def body(client, async_llm):
        streams = [asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": [5, 6, 7 + i], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}))
            for i in range(2)]
        responses = await asyncio.gather(*streams)
        for r in responses:
            await r.content.readline()
        before = await scrape(client)
        real_step = llm.engine.step

        def dying():
            llm.engine.step = real_step
            raise RuntimeError("injected core failure")

        monkeypatch.setattr(llm.engine, "step", dying)
        ends = [await sse(r) for r in responses]
        return before, ends, await scrape(client)

    before, ends, after = run_with_client(llm, body)
    assert before["nanolab:num_requests_running"] == 2 and before["nanolab:kv_blocks_used"] > 0
    for events in ends:
        assert "injected core failure" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert after["nanolab:num_requests_running"] == after["nanolab:num_requests_waiting"] == 0
    assert after["nanolab:kv_blocks_used"] == 0 and after["nanolab:kv_blocks_free"] == NUM_BLOCKS
    errors = after["nanolab:request_success_total{error}"] - before.get("nanolab:request_success_total{error}", 0)
    assert errors == 2


def test_speculative_counters_read_the_engine():
    """With speculation on, the verify steps, drafts proposed and drafts kept that `/metrics` reports
    are the engine's own counts (vLLM's spec_decode counters), and a repeated phrase got drafts. A
    verify step's tokens reach the client together: one inter-token gap for them all, not a gap of
    zero for each kept draft."""
    spec = LLM(MODEL, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8,
               speculative_config={"num_speculative_tokens": 3})

    async def body(client, async_llm):
        before = await scrape(client)
        await (await client.post("/v1/completions", json={"prompt": list(range(3, 9)) * 5, "max_tokens": 24,
                                                          "temperature": 0, "ignore_eos": True})).json()
        return before, await scrape(client)

    before, after = run_with_client(spec, body)
    engine = spec.engine
    assert before["nanolab:spec_decode_num_drafts_total"] == 0
    assert after["nanolab:spec_decode_num_drafts_total"] == engine.spec_steps > 0
    assert after["nanolab:spec_decode_num_draft_tokens_total"] == engine.spec_draft_tokens > 0
    assert after["nanolab:spec_decode_num_accepted_tokens_total"] == engine.spec_accepted_tokens > 0
    gaps = after["nanolab:inter_token_latency_seconds_count"] - before["nanolab:inter_token_latency_seconds_count"]
    assert gaps == 24 - 1 - engine.spec_accepted_tokens
