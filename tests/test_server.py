"""The OpenAI-compatible server in-process, on the tiny model: every kind of bad input gets its
status and OpenAI's error object (never a 500), keys and queue limits are enforced, a client that
leaves frees its blocks, 64 streams run at once, and a request that fails ends alone."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from nanolab import LLM, SamplingParams
from nanolab.engine.async_llm import AsyncLLM
from nanolab.entrypoints.openai import protocol
from nanolab.entrypoints.openai.api_server import SERVING, OpenAIServing, _echo_only_reason, build_app
from nanolab.sampling import sample

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", num_blocks=512, block_size=16, max_num_seqs=64)


def run_with_client(llm, body, *, api_key=None, max_waiting=256, max_body_bytes=1 << 20):
    """Start the app over `llm`'s engine (its core on a thread, so tests can reach into the engine)
    on a loopback port, run `body(client, async_llm)`, stop it, and check that the engine is left
    with no request and every block free."""

    async def main():
        async_llm = AsyncLLM(llm.engine, max_waiting=max_waiting)
        app = build_app(OpenAIServing(llm.tokenizer, async_llm, MODEL), api_key=api_key,
                        max_body_bytes=max_body_bytes)
        async with TestClient(TestServer(app)) as client:
            async_llm.start()
            try:
                return await body(client, async_llm)
            finally:
                await async_llm.drain(0)
                await async_llm.shutdown()

    result = asyncio.run(main())
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.block_manager.allocator.num_free == engine.block_manager.num_blocks
    return result


async def sse(response) -> list:
    """The parsed `data:` events of a stream; "[DONE]" stays a string."""
    events = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


BAD = [
    # (body, status, param)
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": 129}, 400, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ({"prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs"),  # a chat field
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "temperature": True}, 400, "temperature"),
    ({"prompt": "hi", "temperature": 1e-5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ({"prompt": "hi", "top_k": 1.5}, 400, "top_k"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": "hi", "seed": False}, 400, "seed"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, 400, "max_tokens"),
    ({"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"five": 0}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": False}}, 400, "logit_bias"),
    ({"prompt": "hi", "suffix": " end"}, 400, "suffix"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stream": "true"}, 400, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": [1, 10**6]}, 400, "prompt"),
    ({"prompt": [1, "2"]}, 400, "prompt"),
    ({"prompt": [True, 1]}, 400, "prompt"),
    ({"prompt": [[1, 2], [3, None]]}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": [[1, 2], 3]}, 400, "prompt"),
    ({"prompt": "x" * 5000}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "stop": ["s"] * 17}, 400, "stop"),
    ({"prompt": "hi", "stop": "s" * 257}, 400, "stop"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage"),
    # Fields that would change the output and are not implemented: refused, never ignored.
    ({"prompt": "hi", "min_tokens": 2}, 400, "min_tokens"),
    ({"prompt": "hi", "repetition_penalty": 1.1}, 400, "repetition_penalty"),
    ({"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "n": True}, 400, "n"),
    ({"prompt": "hi", "stop_token_ids": [2]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "sampling_temperature": 0.2}, 400, "sampling_temperature"),  # a field nobody implements
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),  # a chat field
]

# Fields at the values where they change nothing, and fields that never change the output: accepted.
NOOPS = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
         "repetition_penalty": 1.0, "min_p": 0, "min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True,
         "user": "someone", "metadata": {"k": "v"}, "store": False, "logit_bias": {"5": 0, "7": 0.0}, "suffix": ""}


def test_bad_requests_get_their_status_and_an_error_object(llm, caplog):
    async def body(client, _):
        results = []
        for request, status, param in BAD:
            r = await client.post("/v1/completions", json=request)
            results.append((request, status, param, r.status, await r.json()))
        # Bodies the parser refuses: bad syntax or UTF-8, an infinite number, nesting past 1,024, NaN,
        # and a lone surrogate (JSON's grammar carries "\ud800"; no tokenizer takes it).
        for raw in (b"{bad", b"[1, 2]", b"\xff\xfe", b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
                    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"prompt": [1, NaN]}',
                    b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                    b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}'):
            r = await client.post("/v1/completions", data=raw)
            results.append((raw[:40], 400, None, r.status, await r.json()))
            if raw != b"[1, 2]":  # valid JSON, but not an object
                assert "not valid JSON" in (await r.json())["error"]["message"], raw[:40]
        for messages, where in (([{"role": "user"}], "messages[0].content"),
                                ([{"role": "robot", "content": "hi"}], "messages[0].role"),
                                ([{"role": "user", "content": "hi"}, "hello"], "messages[1]"),
                                ([{"role": "user", "content": ""}] * 20_000, "more than the model's context"),
                                ("hello", "messages")):
            r = await client.post("/v1/chat/completions", json={"messages": messages})
            results.append((messages, 400, "messages", r.status, await r.json()))
            assert where in (await r.json())["error"]["message"]
        # Both limits, disagreeing: neither is dropped silently. Agreeing, they are one limit.
        one = {"messages": [{"role": "user", "content": "x"}], "temperature": 0}
        r = await client.post("/v1/chat/completions", json={**one, "max_tokens": 5, "max_completion_tokens": 50})
        results.append(("both limits", 400, "max_completion_tokens", r.status, await r.json()))
        r = await client.post("/v1/chat/completions", json={**one, "max_tokens": 2, "max_completion_tokens": 2})
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] <= 2
        # A null name is no name.
        r = await client.post("/v1/chat/completions", json={**one, "max_tokens": 1, "messages": [
            {"role": "user", "content": "x", "name": None}]})
        assert r.status == 200, await r.text()
        # The context's limit, named by the field that set it.
        for field in ("max_tokens", "max_completion_tokens"):
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                  field: 10**6})
            results.append((field, 400, field, r.status, await r.json()))
            assert f"{field} (1000000)" in (await r.json())["error"]["message"]
        r = await client.post("/v1/completions", data=b" " * (2 << 20))
        results.append(("2 MiB", 413, None, r.status, await r.json()))
        for method, path, status in (("GET", "/v2/nothing", 404), ("GET", "/v1/completions", 405)):
            r = await client.request(method, path)
            results.append((path, status, None, r.status, await r.json()))
        # Last: aiohttp drops the connection after a body it cannot decode (the 400 is sent first).
        r = await client.post("/v1/completions", data=b"not gzip", headers={"Content-Encoding": "gzip"})
        results.append(("bad gzip", 400, None, r.status, await r.json()))
        return results

    with caplog.at_level(logging.ERROR):
        answers = run_with_client(llm, body)
    for request, status, param, got, payload in answers:
        assert got == status, (request, payload)
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], request
        assert error["param"] == param, (request, error)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a bad request logged an error"


def test_token_ids_are_checked_once_where_the_vocabulary_is_known(llm):
    """The protocol tells a token-id prompt by its first item and reads its ids only to copy them;
    `AsyncLLM.add_requests` checks each id once, by type and range. A bad id anywhere in any
    prompt is a 400 that names the prompt and the range."""
    class Counted(list):
        reads = 0

        def __iter__(self):
            Counted.reads += 1
            return super().__iter__()

    req = protocol.parse_request({"prompt": Counted(range(2000))}, chat=False, model=MODEL)
    assert req.prompts == [list(range(2000))] and Counted.reads == 1

    async def body(client, _):
        errors = []
        for prompt in ([1, 2, 3.0], [[1, 2], [3, 512]]):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            errors.append((r.status, (await r.json())["error"]))
        return errors

    (status, error), (status2, error2) = run_with_client(llm, body)
    assert (status, error["param"], error["message"]) == (400, "prompt", "prompt token ids must be ints in [0, 512)")
    assert (status2, error2["param"], error2["message"]) == (400, "prompt",
                                                             "request 1: prompt token ids must be ints in [0, 512)")


def test_fields_at_their_no_op_values_are_accepted(llm):
    """A client that sends every field with its default (vLLM's benchmark sends `best_of: 1` and
    `logprobs: null`) is served, and gets what it gets without them."""
    async def body(client, _):
        plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        noop = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                          **NOOPS})
        return plain.status, noop.status, (await plain.json())["choices"][0]["text"], \
            (await noop.json())["choices"][0]["text"]

    status, noop_status, text, noop_text = run_with_client(llm, body)
    assert (status, noop_status) == (200, 200) and noop_text == text


def test_the_api_key_guards_every_v1_route(llm):
    async def body(client, _):
        no_key = await client.get("/v1/models")
        wrong = await client.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer no"})
        right = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        health, metrics = await client.get("/health"), await client.get("/metrics")
        return (no_key.status, (await no_key.json())["error"]["type"], wrong.status, right.status, health.status,
                metrics.status)

    assert run_with_client(llm, body, api_key="s3cret") == (401, "authentication_error", 401, 200, 200, 200)


def paused(llm, monkeypatch) -> threading.Event:
    """Hold the engine's steps until the returned event is set: posted requests wait."""
    go = threading.Event()
    step = llm.engine.step

    def held():
        go.wait(30)
        return step()

    monkeypatch.setattr(llm.engine, "step", held)
    return go


def test_a_full_queue_answers_503_with_retry_after(llm, monkeypatch):
    """While the engine is held, posted requests wait; past `max_waiting` the server turns new
    ones away instead of queueing without bound."""
    go = paused(llm, monkeypatch)

    async def body(client, async_llm):
        waiting = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
                   for _ in range(2)]
        while async_llm.num_waiting < 2:
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        status, retry, error = r.status, r.headers.get("Retry-After"), (await r.json())["error"]
        go.set()
        done = [await (await task).json() for task in waiting]
        assert all(d["choices"][0]["finish_reason"] == "length" for d in done)
        return status, retry, error

    status, retry, error = run_with_client(llm, body, max_waiting=2)
    assert status == 503 and retry is not None and int(retry) >= 1
    assert error["type"] == "service_unavailable" and error["code"] == "overloaded"


def test_one_request_cannot_queue_more_prompts_than_the_limit(llm):
    """A request of more completions (prompts times n) than the queue holds could never be admitted:
    a 400 naming the field, not a 503 that a client would retry."""
    async def body(client, _):
        r = await client.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 2})
        samples = await client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
        return [(x.status, (await x.json())["error"]["param"]) for x in (r, samples)]

    assert run_with_client(llm, body, max_waiting=4) == [(400, "prompt"), (400, "n")]  # 5 prompts; 2 x 3 samples


def test_a_client_that_disconnects_frees_its_blocks(llm):
    engine = llm.engine

    async def body(client, _):
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1500, "ignore_eos": True,
                                                       "temperature": 0, "stream": True})
        await r.content.readline()
        held = engine.block_manager.num_blocks - engine.block_manager.allocator.num_free
        r.close()  # the client goes away mid-stream
        for _ in range(500):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
        return held, len(engine.requests)

    held, left = run_with_client(llm, body)
    assert held > 0 and left == 0


def test_64_streaming_clients_at_once(llm):
    prompts = [f"request {i}: " + "ab" * (i % 7) for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]

    async def one(client, prompt):
        r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True, "stream": True,
                                                       "stream_options": {"include_usage": True}})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return await sse(r)

    async def body(client, async_llm):
        return await asyncio.gather(*(one(client, p) for p in prompts))

    for events, want in zip(run_with_client(llm, body), expected):
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if e["choices"]]
        assert len(chunks) == 8  # one chunk per token
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8


def test_several_prompts_in_one_request(llm):
    prompts = ["one", "two two", "three three three"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]

    async def body(client, _):
        request = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={**request, "stream": True}))
        return whole, streamed

    whole, streamed = run_with_client(llm, body)
    assert [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])] == expected
    assert whole["usage"]["completion_tokens"] == 15
    texts = [""] * 3
    for event in streamed[:-1]:
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
    assert texts == expected


def test_stop_strings_cut_the_text_as_generate_does(llm):
    base = llm.generate("stop here", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    stop = base.text[3:5]  # a stop string the output will meet
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop)
    want = llm.generate("stop here", params, use_tqdm=False)[0].text

    async def body(client, _):
        request = {"prompt": "stop here", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": stop}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={**request, "stream": True}))
        return whole, streamed

    whole, streamed = run_with_client(llm, body)
    assert whole["choices"][0]["text"] == want and whole["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == want
    assert stop not in want


def test_a_failing_request_ends_alone(llm, monkeypatch):
    """A request whose sampling raises gets an error (a chunk in its stream, a 500 when whole);
    the request beside it finishes with its own text, and the server goes on."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate("fine", params, use_tqdm=False)[0].text

    def sampler(logits, params, generators):
        if any(p.seed == 7 for p in params):
            raise RuntimeError("injected")
        return sample(logits, params, generators)

    monkeypatch.setattr(llm.engine, "sampler", sampler)
    request = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def body(client, _):
        good = client.post("/v1/completions", json={**request, "prompt": "fine", "stream": True})
        bad = client.post("/v1/completions", json={**request, "prompt": "boom", "seed": 7, "stream": True})
        good, bad = await asyncio.gather(good, bad)
        good, bad = await asyncio.gather(sse(good), sse(bad))
        whole = await client.post("/v1/completions", json={**request, "prompt": "boom", "seed": 7})
        after = await (await client.post("/v1/completions", json={**request, "prompt": "fine"})).json()
        return good, bad, whole.status, await whole.json(), after

    good, bad, status, whole, after = run_with_client(llm, body)
    assert "".join(e["choices"][0]["text"] for e in good[:-1]) == want
    assert bad[-1] == "[DONE]" and "injected" in bad[-2]["error"]["message"]
    assert status == 500 and whole["error"]["type"] == "internal_error"
    assert after["choices"][0]["text"] == want


def test_health_reports_a_dead_engine(llm, monkeypatch):
    def broken():
        raise RuntimeError("scheduler bug")

    async def body(client, async_llm):
        before = (await client.get("/health")).status
        serving = client.server.app[SERVING]
        serving.draining = True
        draining = (await client.get("/health")).status
        serving.draining = False
        assert draining == 503
        monkeypatch.setattr(llm.engine.scheduler, "schedule", broken)
        failed = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        after = await client.get("/health")
        refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        return before, failed.status, after.status, refused.status, (await refused.json())["error"]["type"]

    assert run_with_client(llm, body) == (200, 500, 503, 503, "service_unavailable")


def test_n_logprobs_and_echo_are_what_generate_gives(llm):
    """Completions with n=2, a seed, logprobs=3 and echo, whole and streamed, and chat with
    top_logprobs: the same samples and the same numbers as `LLM.generate` on the same engine, in
    OpenAI's shapes (legacy lists for completions, the prompt first and its first token unscored;
    content entries with top alternatives for chat), and usage counts the prompt once."""
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    (want,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    text = llm.tokenizer.decode

    async def body(client, _):
        request = {"prompt": prompt, "max_tokens": 4, "temperature": 0.9, "seed": 4, "n": 2, "best_of": 2,
                   "logprobs": 3, "echo": True, "ignore_eos": True}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={**request, "stream": True}))
        chat = await (await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "ignore_eos": True})).json()
        return whole, streamed, chat

    whole, streamed, chat = run_with_client(llm, body)
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
    joined = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in range(2)]
    for event in streamed[:-1]:
        if event["choices"] and event["choices"][0]["logprobs"]:
            choice = event["choices"][0]
            for key, values in choice["logprobs"].items():
                joined[choice["index"]][key] += values
    name = lambda t: protocol.token_string(llm.tokenizer.token_bytes(t))  # noqa: E731
    for i, (choice, out) in enumerate(zip(whole["choices"], want.outputs)):
        assert choice["index"] == i and choice["text"] == text(prompt) + out.text
        lp = choice["logprobs"]
        assert lp["token_logprobs"] == [None] + [e[0] for e in want.prompt_logprobs + out.logprobs]
        assert lp["tokens"] == [name(t) for t in prompt + out.token_ids]
        assert lp["top_logprobs"][0] is None and all(3 <= len(top) <= 4 for top in lp["top_logprobs"][1:])
        for top, entry in zip(lp["top_logprobs"][1:], want.prompt_logprobs + out.logprobs):
            assert [top[name(t)] for t, _ in entry[1]] == [v for _, v in entry[1]]
        check_offsets(choice["text"], prompt + out.token_ids, lp, llm.tokenizer)
        assert joined[i] == lp, "the stream's logprobs are not the whole response's"
    assert want.outputs[0].token_ids != want.outputs[1].token_ids
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 3
    for entry in content:
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert entry["token"] == protocol.token_string(bytes(entry["bytes"]))


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(llm):
    """`max_tokens: 0` with `echo` (a loglikelihood request as older lm-eval sends it): the prompt,
    its text and its scores as `LLM.generate` gives them, nothing generated, "length", and no
    completion tokens in usage; streamed, one chunk a choice with the same. Chat keeps refusing 0."""
    prompt = [5, 6, 7, 8, 9, 10]
    (want,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)

    async def body(client, _):
        request = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "n": 2}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={
            **request, "stream": True, "stream_options": {"include_usage": True}}))
        bare = await (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0,
                                                                  "echo": True})).json()
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 0})
        return whole, streamed, bare, chat.status, (await chat.json())["error"]["param"]

    whole, streamed, bare, chat_status, chat_param = run_with_client(llm, body)
    scores = [None] + [e[0] for e in want.prompt_logprobs]
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6}
    for i, choice in enumerate(whole["choices"]):
        assert (choice["index"], choice["text"], choice["finish_reason"]) == (i, llm.tokenizer.decode(prompt), "length")
        assert choice["logprobs"]["token_logprobs"] == scores and len(choice["logprobs"]["tokens"]) == 6
    chunks = [e for e in streamed[:-1] if e["choices"]]
    assert sorted(c["choices"][0]["index"] for c in chunks) == [0, 1]
    for c in chunks:
        assert c["choices"][0]["text"] == whole["choices"][0]["text"]
        assert c["choices"][0]["logprobs"] == whole["choices"][0]["logprobs"]
        assert c["choices"][0]["finish_reason"] == "length"
    assert streamed[-2]["usage"]["completion_tokens"] == 0 and streamed[-1] == "[DONE]"
    assert bare["choices"][0]["text"] == "hi" and bare["choices"][0]["logprobs"] is None
    assert bare["usage"]["completion_tokens"] == 0
    assert (chat_status, chat_param) == (400, "max_tokens")
    # the one token sampled to score the prompt may have been EOS: the choice still ends for its length
    assert [_echo_only_reason(r) for r in ("stop", "length", "abort", None)] == ["length", "length", "abort", None]


def test_echo_and_roles_stream_as_the_whole_response_for_each_choice(llm):
    """Two prompts with n=2 and echo: choice j is sample j % 2 of prompt j // 2, its text that
    prompt and then its own tokens, and the stream's chunks of each choice join into the whole
    response's text, the prompt once. A streamed chat sends the assistant's role in each choice's
    first chunk only."""
    prompts = ["one two", "three four five"]

    async def body(client, _):
        request = {"prompt": prompts, "n": 2, "echo": True, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={**request, "stream": True}))
        chat = await sse(await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True}))
        return whole, streamed, chat

    whole, streamed, chat = run_with_client(llm, body)
    texts = [c["text"] for c in whole["choices"]]
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for j, text in enumerate(texts):
        assert text.startswith(prompts[j // 2]) and len(text) > len(prompts[j // 2]), (j, text)
    joined = ["", "", "", ""]
    for event in streamed[:-1]:
        for c in event["choices"]:
            joined[c["index"]] += c["text"]
    assert joined == texts
    roles: dict[int, list[bool]] = {0: [], 1: []}
    for event in chat[:-1]:
        for c in event["choices"]:
            roles[c["index"]].append("role" in c["delta"])
    assert all(r[0] and not any(r[1:]) and len(r) > 1 for r in roles.values()), roles


@pytest.mark.parametrize("bos", [False, True])
def test_echo_offsets_index_a_prompt_that_spells_a_special_token(llm, bos):
    """A string prompt that spells special tokens is echoed as sent, their text included, so the
    offsets of the tokens after them count it; with a tokenizer that adds BOS, the added one (the
    same token the prompt spells first) is not in the text and adds nothing, told apart by its
    place. Generated special tokens add nothing. Whole and streamed give the same offsets, for
    both of n = 2 choices."""
    from tokenizers import processors

    prompt = "<|im_start|>ab<|im_end|>cd and more"
    hf = llm.tokenizer._tok
    kept = hf.post_processor
    if bos:  # BOS as Llama 3's tokenizer adds it: a special token the text does not spell
        hf.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                          special_tokens=[("<|im_start|>", 1)])

    async def body(client, _):
        request = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logprobs": 0, "echo": True,
                   "ignore_eos": True, "n": 2}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={**request, "stream": True}))
        return whole, streamed

    try:
        whole, streamed = run_with_client(llm, body)
        ids = llm.tokenizer.encode(prompt)
    finally:
        hf.post_processor = kept
    assert ids[0] == 1 and (ids[1] == 1) == bos  # <|im_start|>: added, then spelled; or spelled alone
    for choice in whole["choices"]:
        assert choice["text"].startswith(prompt)
        lp = choice["logprobs"]
        assert lp["text_offset"][:2] == ([0, 0] if bos else [0, 12])
        after = [i for i, t in enumerate(ids) if llm.tokenizer.is_special(t)][-1] + 1  # the token after <|im_end|>
        assert choice["text"][lp["text_offset"][after]:].startswith("cd"), (lp["text_offset"], choice["text"])
        offsets = [o for e in streamed[:-1] if e["choices"] and e["choices"][0]["index"] == choice["index"]
                   and e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]]
        assert offsets == lp["text_offset"]


def test_a_response_that_cannot_be_built_ends_alone(llm, monkeypatch, caplog):
    """The server's own work on one request raises after the engine's tokens came back: its text's
    stop-string check while it streams, its logprobs' rendering when whole. The stream, already
    begun, ends with an error event naming the failure and then [DONE]; the whole response is a
    500 naming it. A stream beside it finishes, and the engine is left with every block free."""
    from nanolab.entrypoints.openai import api_server

    class Failing(api_server.TextDeltas):
        def __init__(self, decode, stop_strings=()):
            super().__init__(decode, stop_strings)
            self.poisoned = "ZZQ" in stop_strings

        def push(self, *args, **kwargs):
            if self.poisoned and self.ids:  # its second token: the stream has begun
                raise RuntimeError("injected text failure")
            return super().push(*args, **kwargs)

    monkeypatch.setattr(api_server, "TextDeltas", Failing)
    real = protocol.completion_logprobs

    def logprobs(token_ids, entries, *args):
        if 7 in token_ids:  # the poisoned request echoes its prompt, which holds id 7
            raise RuntimeError("injected logprobs failure")
        return real(token_ids, entries, *args)

    monkeypatch.setattr(protocol, "completion_logprobs", logprobs)

    async def body(client, _):
        base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
        bad, good = await asyncio.gather(
            client.post("/v1/completions", json={**base, "prompt": [5, 6], "stop": "ZZQ"}),
            client.post("/v1/completions", json={**base, "prompt": [5, 6, 8]}))
        whole = await client.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 2, "logprobs": 1,
                                                              "echo": True})
        return await sse(bad), await sse(good), whole.status, await whole.json()

    with caplog.at_level(logging.ERROR):
        bad, good, status, whole = run_with_client(llm, body)
    assert bad[-1] == "[DONE]" and "injected text failure" in bad[-2]["error"]["message"], bad[-3:]
    assert good[-1] == "[DONE]" and sum(len(e["choices"][0]["text"]) > 0 for e in good[:-1]) >= 1
    assert status == 500 and "could not be built: RuntimeError: injected logprobs failure" in whole["error"]["message"]


def check_offsets(text: str, token_ids: list[int], logprobs: dict, tokenizer) -> None:
    """`text_offset` indexes the choice's text: a token that spells whole characters is found at its
    offset, one inside a character starts where that character does, special tokens add nothing, and
    the offsets never pass the text's end."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] <= len(text) and len(offsets) == len(token_ids)
    for t, token, at in zip(token_ids, logprobs["tokens"], offsets, strict=True):
        data = tokenizer.token_bytes(t)
        if not tokenizer.is_special(t) and not token.startswith("bytes:"):
            assert text[at: at + len(token)] == token
        elif not tokenizer.is_special(t):  # a piece of the character at `at`, or of bytes that are none
            assert text[at] == "\ufffd" or data in text[at].encode()


def test_logprobs_name_tokens_by_their_bytes_and_offsets_index_the_text(llm):
    """Tokens that split a character (Japanese, an emoji) under the byte-level tokenizer: each is
    named by its bytes ("bytes:\\x.."), so alternatives that decode to the same replacement
    character stay apart and the chosen token keeps its own log-probability; chat's `bytes` spell
    the text; offsets index the text, whole or a token at a time."""
    tok = llm.tokenizer
    text = "日本語 😀 and café"
    ids = tok.encode(text)
    # five alternatives that each decode alone to U+FFFD: lone bytes past ASCII, none of them in the text
    partial = [t for t in range(3, 259) if tok.token_bytes(t)[:1] >= b"\x80" and t not in ids][:5]
    assert len(partial) == 5 and {tok.decode([t]) for t in partial} == {"\ufffd"}
    entries = [(-0.5 - j, [(p, -1.0 - k) for k, p in enumerate(partial)]) for j in range(len(ids))]
    lp = protocol.completion_logprobs(ids, entries, tok.token_bytes, [tok.is_special(t) for t in ids],
                                    protocol.TextOffsets())
    assert any(name.startswith("bytes:") for name in lp["tokens"])
    for token, entry, top in zip(lp["tokens"], entries, lp["top_logprobs"]):
        assert list(top.values()) == [v for _, v in entry[1]] + [entry[0]] and top[token] == entry[0]
    check_offsets(text, ids, lp, tok)
    one_by_one, offsets = [], protocol.TextOffsets()
    for t, e in zip(ids, entries):
        one = protocol.completion_logprobs([t], [e], tok.token_bytes, [tok.is_special(t)], offsets)
        one_by_one += one["text_offset"]
    assert one_by_one == lp["text_offset"]
    chat = protocol.chat_logprobs(ids, entries, tok.token_bytes)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text


def test_samples_stream_by_index_and_echo_puts_the_prompt_first(llm):
    """Two prompts of n=2, streamed with usage: four choices by index, prompt-major, each the text
    of its whole twin, and usage counting each prompt once; echo without logprobs puts the prompt
    string itself before the completion."""
    prompts = ["one two", "three four five"]

    async def body(client, _):
        request = {"prompt": prompts, "n": 2, "seed": 9, "temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
        whole = await (await client.post("/v1/completions", json=request)).json()
        streamed = await sse(await client.post("/v1/completions", json={
            **request, "stream": True, "stream_options": {"include_usage": True}}))
        echoed = await (await client.post("/v1/completions", json={"prompt": prompts[1], "echo": True,
                                                                   "max_tokens": 3, "temperature": 0})).json()
        return whole, streamed, echoed

    whole, streamed, echoed = run_with_client(llm, body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    texts = [""] * 4
    for event in streamed[:-2]:
        texts[event["choices"][0]["index"]] += event["choices"][0]["text"]
        assert "usage" in event and event["usage"] is None  # OpenAI's: null on every chunk but the last
    assert texts == [c["text"] for c in whole["choices"]] and texts[0] != texts[1]
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in prompts)
    assert streamed[-2]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] == prompt_tokens
    assert whole["usage"]["completion_tokens"] == 16
    assert echoed["choices"][0]["text"].startswith(prompts[1]) and echoed["choices"][0]["logprobs"] is None
