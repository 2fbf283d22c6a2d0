"""The load client: it sends a request plan to a server at the plan's arrival times, streaming
each completion over its own connection, and times every chunk as it arrives. Day 58.
`KeepAliveClient` sends requests one at a time over one kept-alive connection instead, as an SDK
client does.

A request's result keeps the raw times (send, each chunk); TTFT, TPOT and ITL are read from them
as `vllm bench serve` defines them, from just before the POST, the client's JSON encoding of the
body included; how long that encoding took is kept too (`encode_s`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import aiohttp

from nanolab.lab.workload import PlannedRequest


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    send_s: float  # just before the POST, its body not yet encoded
    chunk_s: tuple[float, ...]  # arrival of each chunk that carried a choice: one a token, or one for several
    output_tokens: int | None  # the usage chunk's completion_tokens
    prompt_tokens: int | None  # the usage chunk's prompt_tokens
    finish_reason: str | None
    error: str | None = None
    text: str = ""  # the streamed text, chunk after chunk (Day 64: a chat's reply goes back in its next turn)
    encode_s: float = 0.0  # the client's JSON encoding of the body: the first part of TTFT

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_s) and self.finish_reason is not None

    @property
    def tokens(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_s)

    @property
    def tokens_match(self) -> bool:
        """The usage chunk counts the tokens asked for and the prompt as sent, and no chunk came
        without a token."""
        return (self.ok and self.output_tokens == self.max_tokens and self.prompt_tokens == self.prompt_len
                and len(self.chunk_s) <= self.output_tokens)

    @property
    def chunk_shortfall(self) -> int:
        """Tokens that came without a chunk of their own: a server that holds back a token whose
        text is not yet whole (part of a UTF-8 character) sends it with the next one. Each such
        token turns two ITL gaps into one gap of two steps."""
        return max(0, self.tokens - len(self.chunk_s)) if self.ok else 0

    @property
    def ttft(self) -> float | None:
        return self.chunk_s[0] - self.send_s if self.chunk_s else None

    @property
    def latency(self) -> float | None:
        return self.chunk_s[-1] - self.send_s if self.chunk_s else None

    @property
    def tpot(self) -> float | None:
        if not self.chunk_s or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


JSON_HEADERS = {"Content-Type": "application/json"}


async def send_request(session, url: str, model: str, req: PlannedRequest, start: float) -> RequestResult:
    """Wait until `start + req.arrival_s` (perf_counter), then stream one completion from `url`
    (the server's root) and time its chunks. Failures come back in `error`, never raised."""
    delay = start + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    payload = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[float] = []
    texts: list[str] = []
    usage: dict = {}
    finish = error = None
    done = False
    send = time.perf_counter()
    body = json.dumps(payload).encode()  # as aiohttp's json= would, timed
    encoded = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", data=body, headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                # Read to the body's end, past [DONE]: a connection is kept for the next request only
                # once its response has ended.
                async for raw in resp.content:  # one SSE line at a time
                    now = time.perf_counter()  # before parsing: the chunk's arrival
                    line = raw.strip()
                    if done or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    msg = json.loads(data)
                    if "error" in msg:
                        error = f"error chunk: {msg['error']}"
                    elif msg.get("choices"):
                        chunks.append(now)
                        texts.append(msg["choices"][0].get("text") or "")
                        finish = msg["choices"][0].get("finish_reason") or finish
                    elif msg.get("usage"):
                        usage = msg["usage"]
                if not done:
                    error = error or "the stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    return RequestResult(req.index, len(req.prompt_token_ids), req.max_tokens, send, tuple(chunks),
                         usage.get("completion_tokens"), usage.get("prompt_tokens"), finish, error, "".join(texts),
                         encoded - send)


@dataclass(frozen=True)
class PlanRun:
    results: list[RequestResult]
    start_s: float  # perf_counter at the plan's time 0
    end_s: float  # perf_counter when the last response had ended
    window: tuple[float, float]  # time.monotonic() at the same two moments: the step log's clock

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


async def run_plan_async(url: str, model: str, plan: Sequence[PlannedRequest], timeout_s: float = 600.0) -> PlanRun:
    """Send every planned request at its arrival time, each on its own connection when they overlap."""
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap: the server alone decides the batch
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        mono, start = time.monotonic(), time.perf_counter()
        results = await asyncio.gather(*(send_request(session, url, model, r, start) for r in plan))
        end, mono_end = time.perf_counter(), time.monotonic()
    return PlanRun(list(results), start, end, (mono, mono_end))


def run_plan(url: str, model: str, plan: Sequence[PlannedRequest], timeout_s: float = 600.0) -> PlanRun:
    """`run_plan_async` on an event loop of its own thread: callable from a notebook, whose own loop
    is already running."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run_plan_async(url, model, plan, timeout_s)).result()


class KeepAliveClient:
    """Requests sent one after another over one kept-alive connection, as an SDK client sends
    them: the first opens it and every later one reuses it, so a later request's TTFT holds no TCP
    handshake. Each is timed as `send_request` times it, from just before its POST (its JSON
    encoding included, and kept in `encode_s`). The session lives on an event loop of its own
    thread, so a notebook, whose own loop is already running, can call `send`; use it as a context
    manager, or `close` it."""

    def __init__(self, url: str, model: str, timeout_s: float = 600.0) -> None:
        self.url, self.model = url, model
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="nanolab-keepalive-client", daemon=True)
        self._thread.start()
        self._session = self._run(self._open(timeout_s))

    async def _open(self, timeout_s: float) -> aiohttp.ClientSession:
        # One connection: requests never overlap, and a second would only be opened if they did.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                     timeout=aiohttp.ClientTimeout(total=timeout_s))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def send(self, req: PlannedRequest) -> PlanRun:
        """Stream `req` now (its `arrival_s` is ignored) and return once it has ended: a `PlanRun` of
        its one result."""
        async def one() -> PlanRun:
            mono, start = time.monotonic(), time.perf_counter()
            result = await send_request(self._session, self.url, self.model, replace(req, arrival_s=0.0), start)
            return PlanRun([result], start, time.perf_counter(), (mono, time.monotonic()))

        return self._run(one())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._session.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> KeepAliveClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
