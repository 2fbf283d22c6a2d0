"""`AsyncLLM`'s request path: a request is checked once, on the event loop's side, and the engine
core queues its own copy of the checked prompt."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time

import pytest

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


def test_add_request_takes_one_sample(tiny_model):
    """`add_request` returns one stream, so it refuses a request of n samples (as
    `Engine.add_request` does) rather than run samples no caller can read or abort."""
    llm = AsyncLLM(Engine(tiny_model, EngineConfig(num_blocks=64, block_size=16)))
    posted = []
    llm._post = posted.append
    with pytest.raises(ValueError, match="SamplingParams.n=3"):
        llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, n=3))
    assert posted == [] and llm.num_waiting == 0


def test_a_request_after_shutdown_is_refused(tiny_model):
    """A stopped core reads nothing more: a request posted then would wait for ever."""
    async def main():
        llm = AsyncLLM(Engine(tiny_model, EngineConfig(num_blocks=64, block_size=16)))
        llm.start()
        await llm.shutdown()
        with pytest.raises(RuntimeError, match="it has stopped"):
            llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
        assert llm.num_waiting == 0

    asyncio.run(main())


def test_a_post_larger_than_the_pipe_never_blocks_the_event_loop(tiny_path):
    """The core in its own process, stopped (SIGSTOP) so it reads nothing: a call of 150 prompts of
    2,000 ids (about 0.9 MB pickled, several times what the pipe holds) returns at once, and the
    loop keeps running. Were the loop to write to the pipe itself, it would block there until the
    core read, and a core blocked writing a large step's outputs would then never be read: the
    server and its core deadlocked. A watchdog resumes the core after 5 s either way. Once resumed
    the core reads the call and the aborts after it, framed as its `Connection.recv` expects, or
    it dies and `shutdown` returns None."""
    from nanolab.entrypoints.openai.api_server import build_engine

    async def main():
        llm = await AsyncLLM.spawn(functools.partial(build_engine, EngineConfig(model=str(tiny_path), device="cpu")))
        pid = llm._process.pid
        os.kill(pid, signal.SIGSTOP)
        watchdog = threading.Timer(5.0, os.kill, (pid, signal.SIGCONT))
        watchdog.start()
        try:
            prompts = [[256 + i] + [300] * 1999 for i in range(150)]  # each its own list: pickled whole
            start = time.perf_counter()
            streams = llm.add_requests(prompts, [SamplingParams(temperature=0, max_tokens=1)] * len(prompts))
            await asyncio.sleep(0.05)  # the loop runs on while the core sleeps
            posted = time.perf_counter() - start
            for stream in streams:
                llm.abort(stream)
        finally:
            watchdog.cancel()
            os.kill(pid, signal.SIGCONT)
        free, total = await llm.shutdown()
        return posted, free, total, [s.finish_reason for s in streams]

    posted, free, total, reasons = asyncio.run(main())
    assert posted < 2.0, f"posting blocked the event loop for {posted:.1f} s"
    assert free == total and set(reasons) == {"abort"}
