"""`AsyncLLM`'s request path: a request is checked once, on the event loop's side, and the engine
core queues its own copy of the checked prompt."""

from __future__ import annotations

import asyncio

from nanolab.config import EngineConfig
from nanolab.engine.async_llm import AsyncLLM, EngineCore
from nanolab.engine.llm_engine import Engine, RequestLimits
from nanolab.sampling import SamplingParams


def test_a_request_is_checked_once_on_the_event_loops_side(tiny_model, monkeypatch):
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, block_size=16))
    checked = []
    check = RequestLimits.check

    def counted(self, prompt, params):
        checked.append(len(prompt))
        check(self, prompt, params)

    monkeypatch.setattr(RequestLimits, "check", counted)

    async def main():
        llm = AsyncLLM(engine)
        llm.start()
        one = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
        more = llm.add_requests([[5, 6], [7, 8, 9, 10]], [SamplingParams(temperature=0, max_tokens=2, n=2),
                                                          SamplingParams(temperature=0, max_tokens=2)])
        for stream in (one, *more):
            async for _ in stream:
                pass
        await llm.shutdown()
        return [one, *more]

    streams = asyncio.run(main())
    assert [s.finish_reason for s in streams] == ["length"] * 4
    assert [len(s.output_token_ids) for s in streams] == [3, 2, 2, 2]
    assert checked == [3, 2, 4]  # once a prompt (not a sample), and never again in the core


def test_the_core_queues_a_copy_no_caller_holds(tiny_model):
    """A core on a thread reads its message after `add_requests` returns: a caller that changes
    its stream's prompt then cannot reach what was checked."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, block_size=16))
    llm = AsyncLLM(engine)
    posted = []
    llm._post = posted.append  # the core not started: its message waits here
    stream = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
    stream.prompt_token_ids[0] = 10**6  # out of the vocabulary, after the check
    ((kind, requests),) = posted
    assert kind == "add"
    EngineCore(engine).add(requests)
    (seq,) = engine.requests.values()
    assert seq.prompt_token_ids == [5, 6, 7]
