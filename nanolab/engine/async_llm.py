"""`AsyncLLM`: the engine online. Requests arrive at any time from an asyncio program and join the
running batch; each has its own stream of new tokens.

An `EngineCore` owns the `Engine` and is the only code that touches it. Between steps it applies
the adds and aborts that asyncio posted, then steps while there is work, and hands back each
step's tokens in one message, with the engine's `SchedulerStats` after the step. A request is
checked once, by `AsyncLLM.add_requests` before it is posted; the core queues it as posted. The
core runs in one of two places:
- **a thread** of this process (`AsyncLLM(engine)`): tests and notebooks can reach into the engine;
- **a process of its own** (`await AsyncLLM.spawn(factory)`), as vLLM's engine core does: the
  server's choice. A thread would share the interpreter lock with the event loop that writes every
  chunk, and every step would wait on it.

Failures stay with their request. A request that fails in the forward or the sampler ends with
an error (see `Engine.step`). An abort, or a client that disconnects, ends its request before the
next step, and its blocks return to the pool then. Only an exception the engine cannot pin on a
request kills the core, or the core's process dying. Every open stream then ends with that error,
and `dead` says why.

The event loop's side times each request from `add_requests` to each token and to its end, one
`IterationStats` per message of the core's, and hands it to the stat loggers (`add_stat_logger`):
the server's `/metrics`.
"""

from __future__ import annotations

import array
import asyncio
import itertools
import json
import logging
import multiprocessing
import os
import queue
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

from nanolab.config import check_int
from nanolab.engine.llm_engine import Engine, RequestLimits
from nanolab.engine.sequence import Sequence
from nanolab.engine.stats import IterationStats, RequestStateStats, SchedulerStats, scheduler_stats
from nanolab.sampling import PositionLogprobs, SamplingParams

log = logging.getLogger("nanolab.engine")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """What one step gave one request: its new token (None when it failed or was aborted), and
    once it is done, why it ended."""

    token_id: int | None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None
    stop_text_index: int | None = None  # where a matched stop string starts in the output text
    logprobs: PositionLogprobs | None = None  # the token's, when the request asked for them
    prompt_logprobs: list[PositionLogprobs] | None = None  # with the first token, when asked for


class RequestStream:
    """One request's tokens, consumed with `async for delta in stream`. Lives on the event loop."""

    def __init__(self, rid: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.rid = rid
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_text_index: int | None = None  # where a matched stop string starts in the output text
        # With params.logprobs, one entry per output token; with params.prompt_logprobs, one per
        # prompt token after the first, once the first token has come.
        self.output_logprobs: list[PositionLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[PositionLogprobs] | None = None
        self.stats = RequestStateStats(time.monotonic())
        self._queue: asyncio.Queue[TokenDelta] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _put(self, delta: TokenDelta) -> None:
        if self.finished:  # an abort raced the request's last step
            return
        if delta.token_id is not None:
            self.output_token_ids.append(delta.token_id)
            if self.output_logprobs is not None:
                self.output_logprobs.append(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
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


# One request's step, as the core sends it (a tuple pickles faster than a dataclass): (request id,
# token or None, finish reason or None, error or None, stop text index or None, the token's logprobs
# or None, the prompt's logprobs with the first token or None).
Output = tuple[int, int | None, str | None, str | None, int | None, PositionLogprobs | None,
               list[PositionLogprobs] | None]


def graphs_line(runner) -> str:
    """Which steps replay CUDA graphs, and at how many shapes."""
    if runner.graphs is None:
        return "eager"
    varlen = runner.varlen_graphs
    return (f"CUDA graphs: {len(runner.graphs.graphs)} decode shapes"
            + (f", varlen steps up to {varlen.sizes[-1]} tokens at {len(varlen.sizes)} sizes" if varlen else
               ", varlen steps eager"))


def engine_info(engine: Engine) -> dict:
    """What a client of the core needs to know about its engine: the request limits, what the
    server's startup line says, and its `scheduler_stats` before the first step."""
    return {"limits": engine.limits, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
            "read": engine.kv_cache.read, "graphs": graphs_line(engine.runner),
            "prefill": (f"chunked prefill of {engine.scheduler.max_num_batched_tokens} tokens a step"
                        if engine.scheduler.enable_chunked_prefill else "whole prompts"),
            "num_blocks": engine.block_manager.num_blocks, "stats": scheduler_stats(engine)}


class EngineCore:
    """The engine and the bookkeeping around it, wherever it runs: requests by the client's id,
    one step at a time, and the step log."""

    def __init__(self, engine: Engine, step_log: str | Path | None = None) -> None:
        self.engine = engine
        self._seqs: dict[int, Sequence] = {}  # client id -> sequence
        self._rids: dict[int, int] = {}  # engine request id -> client id
        # "x": a step log never replaces a file (the server checked the path; this closes the gap after)
        self._log = None if step_log is None else Path(step_log).open("x", buffering=1 << 16)

    def add(self, requests: list[tuple[int, array.array, SamplingParams]]) -> None:
        """Queue one client call's requests [(id, prompt, params)] together, so the samples of one
        prompt share it. They come only from `AsyncLLM.add_requests`, which checked them against
        this engine's `RequestLimits` and posted each prompt's ids as the check packed them: they
        are queued without `Engine.add_requests`' second check. The step log gets an "add" event,
        timed as the core takes them."""
        if self._log is not None:
            self._log.write(json.dumps({"t": time.monotonic(), "event": "add", "requests": len(requests)}) + "\n")
        seqs = self.engine.add_checked_requests([r[1] for r in requests], [r[2] for r in requests])
        for (rid, _, _), seq in zip(requests, seqs):
            self._seqs[rid] = seq
            self._rids[seq.request_id] = rid

    def abort(self, rid: int) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            del self._rids[seq.request_id]
            self.engine.abort_request(seq.request_id)

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[Output]:
        begin = time.monotonic()
        outputs = self.engine.step()
        if self.engine.stalled(outputs):
            # Nothing could be admitted and nothing runs: every waiting request was validated to fit
            # the pool alone, so this is a scheduler fault.
            raise RuntimeError("the engine scheduled nothing while requests were waiting")
        record = self.engine.last_step
        if self._log is not None and record is not None:
            self._log.write(json.dumps({"t0": begin, "t": time.monotonic(), "phase": record.phase, "rows": record.rows,
                                        "batch": record.batch, "graph": record.graph, "tokens": record.tokens,
                                        "ms": record.seconds * 1e3}) + "\n")
        sent = []
        for out in outputs:
            seq = out.seq
            rid = self._rids[seq.request_id]
            if out.finished:
                del self._rids[seq.request_id]
                del self._seqs[rid]
            first = seq.prompt_logprobs is not None and len(seq.output_token_ids) == 1 and out.token_id is not None
            sent.append((rid, out.token_id, seq.finish_reason if out.finished else None, out.error,
                         seq.stop_text_index, out.logprobs, seq.prompt_logprobs if first else None))
        return sent

    def fail_all(self) -> None:
        """The core failed: end every request (its blocks go back) so nothing is left holding any."""
        for rid in list(self._seqs):
            self.abort(rid)

    def close(self) -> tuple[int, int]:
        """Flush the step log, release the engine's workers if it has any; return (free blocks, all blocks)."""
        if self._log is not None:
            self._log.close()
        blocks = self.engine.block_manager
        self.engine.close()
        return blocks.allocator.num_free, blocks.num_blocks

    def run(self, receive: Callable[[bool], tuple | None], send: Callable[[tuple], None]) -> None:
        """The loop: take what the client posted (waiting for it when idle), step while there is
        work, send each step's outputs with the engine's `scheduler_stats` after it, and the stats
        alone once more when the engine goes idle with stats not yet sent (its last request aborted,
        or ended in a step that gave no token). Ends on "stop" once idle, or on a failure, which it sends."""
        stopping = False
        sent = None  # the stats in the last message sent
        try:
            while True:
                outputs: list[Output] = []
                message = receive(not self.busy and not stopping)
                while message is not None:
                    kind = message[0]
                    if kind == "add":
                        self.add(message[1])
                    elif kind == "abort":
                        self.abort(message[1])
                    elif kind == "stop":
                        stopping = True
                    message = receive(False)
                if self.busy:
                    outputs += self.step()
                stats = scheduler_stats(self.engine)
                if outputs or (not self.busy and stats != sent):
                    send(("out", outputs, stats))
                    sent = stats
                if stopping and not self.busy:
                    send(("stopped", self.close()))
                    return
        except EOFError:  # the client went away
            self.fail_all()
            self.close()
        except Exception as e:  # the engine itself failed: no request can go on
            log.exception("the engine core died")
            why, freed = f"the engine failed: {type(e).__name__}: {e}", None
            try:  # its cleanup may fail too: the client still hears that the core died
                self.fail_all()
                freed = self.close()
            except Exception as cleanup:
                log.exception("the engine core's cleanup failed")
                why += f" (and its cleanup: {type(cleanup).__name__}: {cleanup})"
            send(("dead", why, freed))


def _core_process(factory: Callable[[], Engine], inbox, outbox, step_log) -> None:
    """The engine core's process: build the engine, say it is ready, run; it reads what the
    client posts from `inbox` and writes to `outbox` (two one-way pipes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        core = EngineCore(factory(), step_log)
    except Exception as e:
        bad_input = isinstance(e, (ValueError, FileNotFoundError))
        outbox.send(("error", (bad_input, str(e) if bad_input else f"{type(e).__name__}: {e}")))
        return
    outbox.send(("ready", engine_info(core.engine)))

    def receive(block: bool):
        try:
            return inbox.recv() if block or inbox.poll() else None
        except OSError as e:  # the client died mid-message: gone, as at an end of file
            raise EOFError(str(e)) from None

    core.run(receive, outbox.send)


class _Posts:
    """The event loop's messages to a core in another process, written to `conn` (a one-way
    multiprocessing pipe) without ever blocking the loop: each is pickled and framed as
    `Connection.send` frames it, so the core's `Connection.recv` reads it, and what the pipe does
    not take at once waits here, in order, until the loop sees the pipe writable again."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn  # kept open: its descriptor is written directly
        self._fd = conn.fileno()
        os.set_blocking(self._fd, False)
        self._loop = loop
        self._pending = bytearray()
        self._waiting = False  # whether the loop watches for the pipe to take more

    def post(self, message: tuple) -> None:
        if self._conn.closed:  # the core has stopped: its descriptor may be another file's by now
            raise RuntimeError("the engine is not running: it has stopped")
        data = ForkingPickler.dumps(message)
        # Connection's framing: a 4-byte big-endian size, or -1 and an 8-byte size past 2 GiB.
        size = struct.pack("!i", len(data)) if len(data) < 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
        self._pending += size
        self._pending += data
        if not self._waiting:
            self._flush()

    def _flush(self) -> None:
        try:
            written = os.write(self._fd, self._pending)
        except BlockingIOError:
            written = 0
        except OSError:  # the core is gone (a broken pipe): its end of the other pipe tells the loop
            written = len(self._pending)
        del self._pending[:written]
        if self._pending and not self._waiting:
            self._loop.add_writer(self._fd, self._flush)
            self._waiting = True
        elif not self._pending and self._waiting:
            self._loop.remove_writer(self._fd)
            self._waiting = False

    def close(self) -> None:
        if self._waiting:
            self._loop.remove_writer(self._fd)
            self._waiting = False
        self._conn.close()


class _Frames:
    """The core's messages from `conn` (a one-way multiprocessing pipe), read on the event loop
    without ever blocking it: whatever bytes have arrived are taken, and each message is unpickled
    once all of its frame (as `Connection.send` frames it) is in. `read` returns the messages
    complete so far; EOFError once the core's end is closed."""

    def __init__(self, conn) -> None:
        self._conn = conn  # kept open: its descriptor is read directly
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self._buffer = bytearray()

    def read(self) -> list:
        # One read a call: a message larger than the pipe arrives over several, the loop running between.
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            raise EOFError("the engine process closed its pipe")
        if chunk:
            self._buffer += chunk
        messages, at = [], 0
        while len(self._buffer) - at >= 4:
            (size,), head = struct.unpack_from("!i", self._buffer, at), 4
            if size == -1:  # past 2 GiB: an 8-byte size follows
                if len(self._buffer) - at < 12:
                    break
                (size,), head = struct.unpack_from("!Q", self._buffer, at + 4), 12
            if len(self._buffer) - at - head < size:
                break
            messages.append(ForkingPickler.loads(self._buffer[at + head: at + head + size]))
            at += head + size
        del self._buffer[:at]
        return messages

    def close(self) -> None:
        self._conn.close()


class AsyncLLM:
    """An engine served to asyncio code. `max_waiting` bounds the requests accepted but not yet
    producing tokens; `step_log` (a path) gets one JSON line per step (`StepRecord`, with `t0` and
    `t`, the `time.monotonic()` as the core began and ended it: scheduling included), and one per
    call of `add_requests` as the core took it (`"event": "add"`)."""

    def __init__(self, engine: Engine | None = None, *, max_waiting: int = 256,
                 step_log: str | Path | None = None) -> None:
        check_int("max_waiting", max_waiting)
        self.engine = engine  # None when the core runs in its own process
        self.max_waiting = max_waiting
        self.step_log = step_log
        self.info: dict = {} if engine is None else engine_info(engine)
        self.dead: str | None = None  # why the core died, once it has
        self.stopped: tuple[int, int] | None = None  # (free blocks, all blocks) once the core has stopped
        self._scheduler_stats: tuple | None = self.info.get("stats")  # as the core last sent them
        self._stat_loggers: list = []
        self._stopping = False  # shutdown has begun: no request is taken
        self._ids = itertools.count()
        self._streams: dict[int, RequestStream] = {}  # every stream not yet finished, by id
        self._waiting = 0  # streams with no token yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._post: Callable[[tuple], None] | None = None
        self._thread: threading.Thread | None = None
        self._process = None
        self._conn: _Frames | None = None  # the core's messages, read on the event loop
        self._posts: _Posts | None = None  # what the event loop posts to the core's process

    @property
    def limits(self) -> RequestLimits:
        return self.info["limits"]

    # Starting the core.

    def start(self) -> None:
        """Run the core on a thread of this process (the engine given at construction)."""
        self._loop = asyncio.get_running_loop()
        self._finished = asyncio.Event()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._post = inbox.put
        core = EngineCore(self.engine, self.step_log)

        def receive(block: bool):
            try:
                return inbox.get(timeout=0.5) if block else inbox.get_nowait()
            except queue.Empty:
                return None

        def send(message: tuple) -> None:
            self._loop.call_soon_threadsafe(self._receive, message)

        self._thread = threading.Thread(target=core.run, args=(receive, send), name="nanolab-engine", daemon=True)
        self._thread.start()

    @classmethod
    async def spawn(cls, factory: Callable[[], Engine], *, max_waiting: int = 256,
                    step_log: str | Path | None = None) -> AsyncLLM:
        """Run the core in a process of its own, which builds its engine with `factory` (picklable:
        a module-level function or a partial of one). Returns once the engine is ready; a factory
        that fails raises here (ValueError for bad arguments, RuntimeError otherwise)."""
        self = cls(None, max_waiting=max_waiting, step_log=step_log)
        context = multiprocessing.get_context("spawn")  # no CUDA state or threads copied by a fork
        # A pipe each way. The core blocks writing a step's outputs until they are read, so the event
        # loop never blocks writing: a post larger than the pipe holds would stall it while the core,
        # blocked on its own write, waits for the loop to read (`_Posts`).
        core_in, posts = context.Pipe(duplex=False)
        outputs, core_out = context.Pipe(duplex=False)
        self._process = context.Process(target=_core_process, args=(factory, core_in, core_out, step_log),
                                        name="nanolab-engine-core", daemon=True)
        self._process.start()
        core_in.close()
        core_out.close()
        try:
            kind, payload = await asyncio.to_thread(outputs.recv)
        except EOFError:
            posts.close()
            outputs.close()
            await asyncio.to_thread(self._process.join, 5)
            raise RuntimeError(f"the engine process exited with code {self._process.exitcode} "
                               "before it was ready") from None
        if kind == "error":
            posts.close()
            outputs.close()
            self._process.join()
            bad_input, message = payload
            raise (ValueError if bad_input else RuntimeError)(message)
        self.info = payload
        self._scheduler_stats = payload["stats"]
        self._loop = asyncio.get_running_loop()
        self._finished = asyncio.Event()
        self._posts = _Posts(posts, self._loop)
        self._post = self._posts.post
        self._conn = _Frames(outputs)
        self._loop.add_reader(self._conn.fd, self._readable)
        return self

    def _readable(self) -> None:
        try:
            for message in self._conn.read():
                self._receive(message)
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fd)
            self._conn.close()
            if self.stopped is None and self.dead is None:
                self._process.join(1.0)  # reaped, so its exit code is known
                self._died(f"the engine process exited with code {self._process.exitcode}")
            self._finished.set()

    # The event loop's side.

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have no token yet (queued, or in their prefill)."""
        return self._waiting

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engine's state as of the core's last message: after a step, or once it went idle."""
        return SchedulerStats(*self._scheduler_stats)

    def add_stat_logger(self, logger) -> None:
        """Call `logger.record(stats)` with the `IterationStats` of every message of the core's that
        arrives from now on (vLLM's `add_logger`). Add it before the first request: a logger added
        later misses the prompts and first tokens that came before it."""
        self._stat_loggers.append(logger)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Validate and post a request of one sample (`params.n` 1; `add_requests` takes more); its
        tokens arrive on the returned stream. Bad input raises ValueError or TypeError here, before
        anything is queued."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: add_request posts one sample; add_requests "
                             "posts a request's n samples")
        return self.add_requests([prompt_token_ids], [params], numbered=False)[0]

    def add_requests(self, prompts: list[list[int]], params: list[SamplingParams],
                     numbered: bool = True) -> list[RequestStream]:
        """All or nothing: every request is validated before any is posted, and only here: the core
        queues what it is posted unchecked (`EngineCore.add`). A request of `n` samples is n
        streams, in order (`SamplingParams.samples`); they go to the core together, so the samples
        compute their prompt once."""
        if self.dead is not None or self._post is None or self._stopping:
            why = self.dead or ("it has stopped" if self._stopping else "not started")
            raise RuntimeError(f"the engine is not running: {why}")
        prompts = [list(p) for p in prompts]
        if numbered:
            packed = self.limits.check_all(prompts, params)
        else:
            (prompt,), (p,) = prompts, params
            packed = [self.limits.check(prompt, p)]
        streams, requests = [], []
        # The core gets the checked ids as `check` packed them: its own copy (a stream's
        # `prompt_token_ids` is the caller's to change, and a core on a thread reads what it is
        # posted after this returns), and one run of bytes through the pipe rather than an object a token.
        for prompt, checked, p in zip(prompts, packed, params):
            for sample in p.samples():
                stream = RequestStream(next(self._ids), prompt, sample)
                self._streams[stream.rid] = stream
                self._waiting += 1
                streams.append(stream)
                requests.append((stream.rid, checked, sample))
        # One message: the core queues the call's requests together (`EngineCore.add`).
        self._post(("add", requests))
        return streams

    def abort(self, stream: RequestStream) -> None:
        """End a request now, counted as aborted by the stat loggers; the core frees its blocks
        before its next step."""
        if stream.finished:
            return
        self._end_here([stream], "abort")
        if self.dead is None and self.stopped is None:
            self._post(("abort", stream.rid))

    def _end_here(self, streams: list[RequestStream], reason: str, error: str | None = None) -> None:
        """End `streams` on this side, with no message of the core's (an abort, the core's death),
        and count their ends as any other (`IterationStats`)."""
        stats = IterationStats(time.monotonic())
        for stream in streams:
            stats.update_from_output(stream.stats, len(stream.prompt_token_ids), None, reason)
            self._deliver(stream, TokenDelta(None, reason, error=error))
        for logger in self._stat_loggers:
            logger.record(stats)

    def _deliver(self, stream: RequestStream, delta: TokenDelta) -> None:
        if not stream.output_token_ids and (delta.token_id is not None or delta.finish_reason is not None):
            self._waiting -= 1
        stream._put(delta)
        if stream.finished:
            self._streams.pop(stream.rid, None)

    def _receive(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            _, outputs, self._scheduler_stats = message
            stats = IterationStats(time.monotonic())
            for rid, token, reason, error, stop_at, logprobs, prompt_logprobs in outputs:
                stream = self._streams.get(rid)
                if stream is not None:
                    stats.update_from_output(stream.stats, len(stream.prompt_token_ids), token, reason)
                    self._deliver(stream, TokenDelta(token, reason, error, stop_at, logprobs, prompt_logprobs))
            for logger in self._stat_loggers:
                logger.record(stats)
        elif kind == "stopped":
            self.stopped = message[1]
            # None, unless one was posted after the stop.
            self._end_here(list(self._streams.values()), "error", "the engine stopped before this request ended")
            self._finished.set()
        elif kind == "dead":
            self.stopped = message[2]
            self._died(message[1])
            self._finished.set()

    def _died(self, why: str) -> None:
        self.dead = why
        log.error("engine: %s", why)
        self._end_here(list(self._streams.values()), "error", why)
        # No request runs or waits any more, and no block is held: the pool went with the core.
        if self._scheduler_stats is not None:
            running, waiting, used, free, *counts = self._scheduler_stats
            self._scheduler_stats = (0, 0, 0, used + free, *counts)

    async def drain(self, timeout: float, force: asyncio.Event | None = None) -> int:
        """Wait up to `timeout` seconds (or until `force` is set) for the unfinished requests to
        end, then abort the rest; return how many were aborted."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not (force is not None and force.is_set()):
            await asyncio.sleep(0.02)
        left = list(self._streams.values())
        for stream in left:
            self.abort(stream)
        return len(left)

    async def shutdown(self, timeout: float = 30.0, force: asyncio.Event | None = None) -> tuple[int, int] | None:
        """Stop the core once it has applied everything posted (aborts included); return its
        (free blocks, all blocks), or None when it died without saying, or did not stop within
        `timeout` seconds or before `force` was set: then it is dead (a core in its own process is
        killed). No request is taken once this is called."""
        self._stopping = True
        if self._post is not None and self.dead is None and self.stopped is None:
            self._post(("stop",))
            waits = [asyncio.ensure_future(self._finished.wait())]
            if force is not None:
                waits.append(asyncio.ensure_future(force.wait()))
            _, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for waiting in pending:
                waiting.cancel()
            if self.stopped is None and self.dead is None:
                told = force is not None and force.is_set()
                self._died("the engine was stopped at once" if told
                           else f"the engine did not stop within {timeout:g} s")
                if self._process is not None:
                    self._process.kill()
        if self._thread is not None and self.stopped is not None:  # a thread cannot be killed: left if stuck
            await asyncio.to_thread(self._thread.join)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 30)
            if self._process.is_alive():
                self._process.kill()
        if self._posts is not None:
            self._posts.close()
        return self.stopped
