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
        return check(self, prompt, params)

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


def test_a_request_after_shutdown_began_is_refused(tiny_model):
    """A stopping core reads nothing after its stop: a request posted then would wait for ever."""
    async def main():
        llm = AsyncLLM(Engine(tiny_model, EngineConfig(num_blocks=64, block_size=16)))
        llm.start()
        stopping = asyncio.create_task(llm.shutdown())
        await asyncio.sleep(0)  # the stop is posted; the core has not answered yet
        with pytest.raises(RuntimeError, match="it has stopped"):
            llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
        assert await stopping == (64, 64) and llm.num_waiting == 0

    asyncio.run(main())


def test_frames_are_read_whole_without_blocking():
    """The core's messages as `Connection.send` frames them, read on the event loop's side by
    `_Frames`: half a frame returns nothing at once (a blocking read would wait for the rest),
    frames come out whole and in order however the bytes arrive, and a closed pipe is EOFError."""
    import multiprocessing

    from nanolab.engine.async_llm import _Frames

    reader, writer = multiprocessing.Pipe(duplex=False)
    frames = _Frames(reader)
    big = ("out", list(range(30_000)), "x" * 70_000)  # past a pipe's 64 KiB
    pending = bytearray()
    for message in (("out", [1, 2], None), big, ("stopped", (3, 4))):
        data = bytes(multiprocessing.reduction.ForkingPickler.dumps(message))
        pending += len(data).to_bytes(4, "big") + data
    got = []

    def read_now() -> None:  # on a thread, so that a read that blocks fails the test rather than hanging it
        read = threading.Thread(target=lambda: got.extend(frames.read()), daemon=True)
        read.start()
        read.join(5.0)
        assert not read.is_alive(), "a read blocked"

    for at in range(0, len(pending), 40_000):  # a frame's bytes split across reads
        os.write(writer.fileno(), pending[at: at + 40_000])
        read_now()
    read_now()  # nothing more has come
    assert got == [("out", [1, 2], None), big, ("stopped", (3, 4))]
    writer.close()
    with pytest.raises(EOFError):
        frames.read()


def test_a_core_that_does_not_stop_is_killed(tiny_path):
    """A stuck core (SIGSTOP) never answers the stop: shutdown gives up after its timeout, kills
    the core's process, says why, and returns None (no count of free blocks it could trust)."""
    from nanolab.entrypoints.openai.api_server import build_engine

    async def main():
        llm = await AsyncLLM.spawn(functools.partial(build_engine, EngineConfig(model=str(tiny_path), device="cpu")))
        os.kill(llm._process.pid, signal.SIGSTOP)
        start = time.perf_counter()
        stopped = await llm.shutdown(timeout=1.0)
        return stopped, time.perf_counter() - start, llm.dead, llm._process.exitcode

    stopped, seconds, dead, code = asyncio.run(main())
    assert stopped is None and seconds < 10 and code == -signal.SIGKILL
    assert dead == "the engine did not stop within 1 s"


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

