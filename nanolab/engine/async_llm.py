"""`AsyncLLM`: the engine online. Requests arrive at any time from an asyncio program and join the
running batch; each has its own stream of new tokens. Added with the server.

One thread owns the `Engine` and is the only code that touches it. Between steps it takes the
requests and aborts that asyncio posted to its inbox, then steps while there is work, and hands
each step's tokens back to the event loop in one call (`call_soon_threadsafe`). The event loop
never waits on a step, and the step never waits on a client. A step releases the GIL while the
device runs, which is when the event loop writes the previous step's chunks to the sockets.

Failures stay with their request. A request that fails in the forward or the sampler ends
with an error (see `Engine.step`). An abort, or a client that disconnects, ends its request
before the next step, and its blocks return to the pool then. Only an exception the engine
cannot pin on a request kills the loop. Every open stream then ends with that error, and
`dead` says why.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nanolab.engine.llm_engine import Engine
from nanolab.engine.sequence import Sequence
from nanolab.sampling import SamplingParams

log = logging.getLogger("nanolab.engine")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one step gave one request: its new token (None when it failed or was aborted), and
    once it is done, why it ended."""

    token_id: int | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    stop_text_index: int | None = None  # where a matched stop string starts in the output text


class RequestStream:
    """One request's tokens, consumed with `async for delta in stream`. Lives on the event loop."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_text_index: int | None = None  # where a matched stop string starts in the output text
        self._queue: asyncio.Queue[TokenDelta] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _put(self, delta: TokenDelta) -> None:
        if self.finished:  # an abort raced the request's last step
            return
        if delta.token_id is not None:
            self.output_token_ids.append(delta.token_id)
        if delta.finish_reason is not None:
            self.finish_reason, self.error = delta.finish_reason, delta.error
            self.stop_text_index = delta.stop_text_index
        self._queue.put_nowait(delta)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        return await self._queue.get()


class AsyncLLM:
    """`engine` served to asyncio code. `max_waiting` bounds the requests queued but not yet
    running; `step_log` (a path) gets one JSON line per step (`StepRecord` plus `t`, the
    `time.monotonic()` at its end)."""

    def __init__(self, engine: Engine, *, max_waiting: int = 256, step_log: str | Path | None = None) -> None:
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 1:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an int >= 1")
        self.engine = engine
        self.max_waiting = max_waiting
        self.step_log = None if step_log is None else Path(step_log)
        self.dead: str | None = None  # why the loop died, once it has
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Adds posted (counted by the event loop) and taken (counted by the loop thread); each
        # counter has one writer, so their difference needs no lock.
        self._posted = 0
        self._taken = 0
        self._seqs: dict[RequestStream, Sequence] = {}  # the loop thread's own, both ways
        self._by_id: dict[int, RequestStream] = {}
        self._streams: set[RequestStream] = set()  # the event loop's own: every stream not yet finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # The event loop's side.

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nanolab-engine", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet."""
        return self._posted - self._taken + len(self.engine.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Validate and post a request; its tokens arrive on the returned stream. Bad input raises
        ValueError or TypeError here, before anything is queued."""
        if self.dead is not None:
            raise RuntimeError(f"the engine is not running: {self.dead}")
        prompt = list(prompt_token_ids)
        self.engine.validate_request(prompt, params)  # reads only the config: safe from this thread
        return self._post(prompt, params)

    def add_requests(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestStream]:
        """All or nothing: every request is validated before any is posted."""
        if self.dead is not None:
            raise RuntimeError(f"the engine is not running: {self.dead}")
        prompts = [list(p) for p in prompts]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                self.engine.validate_request(prompt, p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
        return [self._post(prompt, p) for prompt, p in zip(prompts, params)]

    def _post(self, prompt: list[int], params: SamplingParams) -> RequestStream:
        stream = RequestStream(prompt, params)
        self._streams.add(stream)
        self._posted += 1
        self._inbox.put(("add", stream))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End a request now; the loop frees its blocks before its next step."""
        if stream.finished:
            return
        stream._put(TokenDelta(None, "abort"))
        self._streams.discard(stream)
        self._inbox.put(("abort", stream))

    async def drain(self, timeout: float, force: asyncio.Event | None = None) -> int:
        """Wait up to `timeout` seconds (or until `force` is set) for the unfinished requests to
        end, then abort the rest; return how many were aborted."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not (force is not None and force.is_set()):
            await asyncio.sleep(0.02)
        left = list(self._streams)
        for stream in left:
            self.abort(stream)
        return len(left)

    async def shutdown(self) -> None:
        """Stop the loop thread once it has processed everything posted (aborts included)."""
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def _deliver(self, deltas: list[tuple[RequestStream, TokenDelta]]) -> None:
        for stream, delta in deltas:
            stream._put(delta)
            if stream.finished:
                self._streams.discard(stream)

    def _died(self, why: str) -> None:
        self.dead = why
        for stream in list(self._streams):
            stream._put(TokenDelta(None, "error", error=why))
        self._streams.clear()

    # The loop thread's side: the only code that touches the engine.

    def _run(self) -> None:
        log_file = None if self.step_log is None else self.step_log.open("w", buffering=1 << 16)
        try:
            while True:
                deltas = self._take_inbox(block=not self.engine.has_unfinished_requests()
                                          and not self._stop.is_set())
                if deltas:
                    self._loop.call_soon_threadsafe(self._deliver, deltas)
                if self._stop.is_set() and not self.engine.has_unfinished_requests():
                    return
                if not self.engine.has_unfinished_requests():
                    continue
                outputs = self.engine.step()
                record = self.engine.last_step
                if log_file is not None and outputs and record is not None:
                    log_file.write(json.dumps({"t": time.monotonic(), "phase": record.phase, "rows": record.rows,
                                               "batch": record.batch, "graph": record.graph,
                                               "tokens": record.tokens, "ms": record.seconds * 1e3}) + "\n")
                deltas = []
                for out in outputs:
                    stream = self._by_id[out.seq.request_id]
                    if out.finished:
                        del self._by_id[out.seq.request_id]
                        self._seqs.pop(stream, None)
                    deltas.append((stream, TokenDelta(out.token_id, out.seq.finish_reason if out.finished else None,
                                                      out.error, out.seq.stop_text_index)))
                if deltas:
                    self._loop.call_soon_threadsafe(self._deliver, deltas)
                elif self.engine.has_unfinished_requests() and not self._seqs_running():
                    # Nothing could be admitted and nothing runs: every waiting request was
                    # validated to fit the pool alone, so this is a scheduler fault.
                    raise RuntimeError("the engine scheduled nothing while requests were waiting")
        except Exception as e:  # the engine itself failed: no request can go on
            log.exception("engine loop died")
            why = f"the engine failed: {type(e).__name__}: {e}"
            for seq in list(self.engine.requests.values()):
                self.engine.abort_request(seq.request_id)
            self._loop.call_soon_threadsafe(self._died, why)
        finally:
            if log_file is not None:
                log_file.close()

    def _seqs_running(self) -> bool:
        return bool(self.engine.scheduler.running)

    def _take_inbox(self, block: bool) -> list[tuple[RequestStream, TokenDelta]]:
        """Apply what the event loop posted, in order; return the deltas of adds that failed."""
        failed = []
        while True:
            try:
                kind, stream = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return failed
            block = False
            if kind == "add":
                self._taken += 1
                if stream.finished:  # aborted before the loop saw it
                    continue
                try:
                    (seq,) = self.engine.add_requests([stream.prompt_token_ids], [stream.params])
                except (ValueError, TypeError) as e:  # validated on post; kept from killing the loop anyway
                    failed.append((stream, TokenDelta(None, "error", error=str(e))))
                    continue
                self._seqs[stream] = seq
                self._by_id[seq.request_id] = stream
            elif kind == "abort":
                seq = self._seqs.pop(stream, None)
                if seq is not None:
                    self._by_id.pop(seq.request_id, None)
                    self.engine.abort_request(seq.request_id)
