"""`python -m nanolab serve`: an OpenAI-compatible HTTP server on aiohttp. Added with the server.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streamed as Server-Sent Events or
whole), `GET /v1/models`, `GET /health`, and `GET /metrics` (Prometheus' text format: `metrics.py`).
The engine runs online under `AsyncLLM`, in a process of its own, so this process's event loop never
competes with a step for the interpreter. A handler checks its request, posts it, and turns the
request's token stream into text chunks. When the client goes away, aiohttp cancels the handler
(`handler_cancellation`), and the handler's cleanup aborts the request.

Who gets in: the server binds 127.0.0.1 unless told otherwise. With an API key, every `/v1` route
needs `Authorization: Bearer <key>` (as vLLM's: `/health` and `/metrics` stay open to probes and
scrapers). When more than `max_waiting` requests are queued,
new ones get a 503 with `Retry-After`. SIGINT or SIGTERM stops new requests, gives the ones in
flight `shutdown_timeout` seconds to finish, aborts the rest, and exits once every block is free. A
second signal aborts them at once; a third (or 30 s without the engine stopping) kills the engine's
process, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from nanolab.config import EngineConfig
from nanolab.engine.async_llm import AsyncLLM, RequestStream
from nanolab.engine.detokenizer import TextDeltas
from nanolab.engine.llm_engine import Engine
from nanolab.entrypoints.openai import protocol
from nanolab.entrypoints.openai.metrics import PrometheusStatLogger
from nanolab.entrypoints.openai.protocol import APIError, CompletionRequest, error_body
from nanolab.model.tokenizer import Tokenizer, normalize_messages
from nanolab.model.weights import resolve_weights

log = logging.getLogger("nanolab.server")

API_KEY_ENV = "NANOLAB_API_KEY"
SERVING = web.AppKey("serving", object)  # the OpenAIServing behind the routes
SUMMARY = web.RequestKey("summary", str)  # what the request's log line says about it


def _json_error(status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(message, type, param, code), status=status, headers=headers)


_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 503: "service_unavailable"}


@web.middleware
async def _errors_and_log(request: web.Request, handler):
    """Every error leaves as OpenAI's error object. One log line per request, none for health checks
    and metrics scrapes."""
    start = time.perf_counter()
    try:
        response = await handler(request)
    except APIError as e:
        response = web.json_response(e.body(), status=e.status, headers=e.headers)
        request[SUMMARY] = f"({e.param or 'request'}: {e.message[:120]})"
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text if e.status != 404 else f"no route {request.method} {request.path}"
        response = _json_error(e.status, message, _HTTP_TYPES.get(e.status, "invalid_request_error"))
    except (asyncio.CancelledError, ConnectionResetError):
        log.info("%s %s client disconnected %s", request.method, request.path, request.get(SUMMARY, ""))
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        response = _json_error(500, "internal server error", "internal_error")
    if request.path not in ("/health", "/metrics"):
        log.info("%s %s %d %s%.0f ms", request.method, request.path, response.status,
                 request.get(SUMMARY, "") + " " if request.get(SUMMARY) else "",
                 (time.perf_counter() - start) * 1e3)
    return response


def _auth(api_key: str | None):
    @web.middleware
    async def check(request: web.Request, handler):
        if api_key is not None and request.path.startswith("/v1"):
            # A header that is not valid UTF-8 arrives surrogate-escaped; it compares as bytes.
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
                raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                               type="authentication_error", code="invalid_api_key")
        return await handler(request)
    return check


class OpenAIServing:
    """The routes, over an engine run by `AsyncLLM` and the model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, async_llm: AsyncLLM, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.async_llm = async_llm
        self.model_name = model_name
        self.draining = False

    async def health(self, request: web.Request) -> web.Response:
        if self.async_llm.dead is not None:
            return _json_error(503, f"the engine is not running: {self.async_llm.dead}", "service_unavailable")
        if self.draining:
            return _json_error(503, "the server is shutting down", "service_unavailable")
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "nanolab",
             "max_model_len": self.async_llm.limits.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _body(self, request: web.Request):
        try:
            raw = await request.read()  # raises 413 past client_max_size
        except (HttpProcessingError, RequestPayloadError) as e:  # a body that does not decode or ends early
            raise APIError(400, f"the request body could not be read: {e}") from None
        # orjson: a prompt of ids is thousands of numbers, parsed on the event loop every stream waits
        # on. It refuses what the standard module lets through (NaN, a lone surrogate) and reads an
        # integer past 64 bits as a float, which the request's checks then refuse by field.
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:  # bad syntax or UTF-8, an infinite number, nesting past 1,024
            raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None

    def _token_ids(self, req: CompletionRequest) -> list[list[int]]:
        # Encoding runs on the event loop, and every other stream waits while it does: text far longer
        # than any prompt the context can take (more than 16 characters a token) is refused unencoded.
        limit = 16 * self.async_llm.limits.max_model_len
        if req.chat:
            try:
                messages = normalize_messages(req.messages)  # each content one str
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            if len(messages) > self.async_llm.limits.max_model_len:  # a turn renders to a token at least
                raise APIError(400, f"{len(messages)} messages are more than the model's context holds "
                                    f"({self.async_llm.limits.max_model_len} tokens)", param="messages")
            if sum(len(m["content"]) for m in messages) > limit:
                raise APIError(400, f"the messages are longer than the model's context ({limit} characters is "
                                    "the most the server encodes)", param="messages")
            try:
                return [self.tokenizer.encode_chat(messages)]
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e), param="messages") from None
            except Exception as e:  # the template itself is broken, whatever the messages
                raise APIError(500, f"the chat template failed: {type(e).__name__}: {e}", type="internal_error",
                               param="messages") from None
        if any(isinstance(p, str) and len(p) > limit for p in req.prompts):
            raise APIError(400, f"the prompt is longer than the model's context ({limit} characters is the most "
                                "the server encodes)", param="prompt")
        return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in req.prompts]

    def _admit(self, req: CompletionRequest) -> list[RequestStream]:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable",
                           headers={"Retry-After": "5"})
        if self.async_llm.dead is not None:
            raise APIError(503, f"the engine is not running: {self.async_llm.dead}", type="service_unavailable")
        count = (len(req.prompts) if req.prompts is not None else 1) * req.params.n
        if count > self.async_llm.max_waiting:  # never admitted, however long the client waits
            raise APIError(400, f"the request asks for {count} completions (prompts times n), more than the "
                                f"server queues at once ({self.async_llm.max_waiting})",
                           param="n" if req.params.n > 1 else "prompt")
        if self.async_llm.num_waiting + count > self.async_llm.max_waiting:
            raise APIError(503, f"too many requests are waiting ({self.async_llm.num_waiting}); retry shortly",
                           type="service_unavailable", code="overloaded", headers={"Retry-After": "1"})
        prompts = self._token_ids(req)
        limit = self.async_llm.limits.max_model_len
        for i, ids in enumerate(prompts):
            # As vLLM does: a max_tokens the context cannot hold is an error, not a silent cut.
            if req.params.max_tokens is not None and len(ids) < limit < len(ids) + req.params.max_tokens:
                where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
                raise APIError(400, f"the model's context is {limit} tokens, but {where} ({len(ids)} tokens) plus "
                                    f"{req.max_tokens_field} ({req.params.max_tokens}) needs "
                                    f"{len(ids) + req.params.max_tokens}", param=req.max_tokens_field)
        try:  # choice j is sample j % n of prompt j // n
            return self.async_llm.add_requests(prompts, [req.params] * len(prompts))
        except (ValueError, TypeError) as e:
            message = str(e) if len(prompts) > 1 else str(e).removeprefix("request 0: ")
            if "max_tokens" in message:
                message = message.replace("max_tokens", req.max_tokens_field)
                param = req.max_tokens_field
            else:
                param = "messages" if req.chat else "prompt"
            raise APIError(400, message, param=param) from None

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        req = protocol.parse_request(await self._body(request), chat=chat, model=self.model_name)
        streams = self._admit(req)
        rid = protocol.request_id(chat)
        try:
            if req.stream:
                return await self._stream(request, req, rid, streams)
            return await self._whole(request, req, rid, streams)
        except ConnectionResetError:  # the client left mid-stream: its requests are aborted below
            raise asyncio.CancelledError from None
        finally:
            for s in streams:
                self.async_llm.abort(s)  # a no-op for a finished request
            done = sum(len(s.output_token_ids) for s in streams)
            reasons = ",".join(str(s.finish_reason) for s in streams)
            request[SUMMARY] = f"{rid} prompt={_usage(streams, req.params.n)['prompt_tokens']} " \
                                 f"completion={done} finish={reasons}"

    def _echo(self, req: CompletionRequest, j: int, stream: RequestStream) -> str:
        """Choice j's prompt as its text begins with `echo`: the prompt string as sent, else its ids decoded."""
        prompt = req.prompts[j // req.params.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(stream.prompt_token_ids)

    def _logprobs(self, req: CompletionRequest, token_ids: list[int], entries: list,
                  offsets: protocol.TextOffsets, hidden: list[bool] | None = None) -> dict:
        """The logprobs object of `token_ids` scored by `entries` (None for a prompt's first token);
        a completion's text offsets continue from `offsets`, past the tokens its text leaves out
        (`hidden`, one flag a token; default: the special tokens, which decoding skips)."""
        if req.chat:
            return protocol.chat_logprobs(token_ids, entries, self.tokenizer.token_bytes)
        if hidden is None:
            hidden = [self.tokenizer.is_special(t) for t in token_ids]
        return protocol.completion_logprobs(token_ids, entries, self.tokenizer.token_bytes, hidden, offsets)

    def _echoed_logprobs(self, req: CompletionRequest, j: int, stream: RequestStream, token_ids: list[int],
                         entries: list, offsets: protocol.TextOffsets, shown: dict) -> dict:
        """With `echo`, choice j's prompt tokens (the first unscored) before `token_ids`'. The text
        begins with the prompt as `_echo` gives it: ids decoded, special tokens skipped; a string as
        sent, so a special token it spells is in the text, and one the tokenizer added (BOS) is not,
        told apart by position (`_echo_hidden`). `shown` keeps each prompt's flags for its other
        choices."""
        if not req.echo:
            return self._logprobs(req, token_ids, entries, offsets)
        ids, p = stream.prompt_token_ids, j // req.params.n
        if isinstance(req.prompts[p], str) and p not in shown:
            shown[p] = self._echo_hidden(req.prompts[p], ids)
        echoed = self._logprobs(req, ids, [None, *(stream.prompt_logprobs or [None] * (len(ids) - 1))], offsets,
                                shown.get(p))
        rest = self._logprobs(req, token_ids, entries, offsets)
        return {key: echoed[key] + rest[key] for key in echoed}

    def _echo_hidden(self, prompt: str, ids: list[int]) -> list[bool]:
        """Per token of `prompt`'s `ids`, whether the echoed string leaves it out: a special token
        it does not spell (an added one spans none of it). None is left out where the string no
        longer encodes to those ids."""
        encoding = self.tokenizer.encode_with_offsets(prompt)
        if encoding.ids != ids:
            return [False] * len(ids)
        return [self.tokenizer.is_special(t) and b == a for t, (a, b) in zip(ids, encoding.offsets, strict=True)]

    async def _whole(self, request, req: CompletionRequest, rid: str, streams) -> web.Response:
        choices = []
        shown: dict = {}  # each echoed prompt's flags (`_echoed_logprobs`), for its n choices
        for j, stream in enumerate(streams):
            async for _ in stream:
                pass
            if stream.finish_reason == "error":
                raise APIError(500, f"the request failed: {stream.error}", type="internal_error")
            try:
                tokens, entries = stream.output_token_ids, stream.output_logprobs
                if req.echo_only:  # the prompt alone: the one token sampled to score it is left out
                    tokens, entries = [], None if entries is None else []
                text = self.tokenizer.decode(tokens)
                last = stream.stop_text_index
                text = text if last is None else text[:last]
                logprobs = None
                if entries is not None:
                    logprobs = self._echoed_logprobs(req, j, stream, tokens, entries, protocol.TextOffsets(), shown)
                choices.append(((self._echo(req, j, stream) if req.echo else "") + text,
                                _echo_only_reason(stream.finish_reason) if req.echo_only else stream.finish_reason,
                                logprobs))
            except Exception as e:  # the engine's tokens came back; rendering them did not
                log.exception("request %s: its response could not be built", rid)
                raise APIError(500, f"the response could not be built: {type(e).__name__}: {e}",
                               type="internal_error") from None
        return web.json_response(protocol.completion(rid, self.model_name, req.chat, choices,
                                                     _usage(streams, req.params.n, req.echo_only)))

    async def _stream(self, request, req: CompletionRequest, rid: str, streams) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        texts = [TextDeltas(self.tokenizer.decode, req.params.stop_strings) for _ in streams]
        chunks = protocol.ChunkEncoder(rid, self.model_name, req.chat, created, req.include_usage)
        first = [True] * len(streams)
        offsets = [protocol.TextOffsets() for _ in streams]  # each choice's text so far, for completions' logprobs
        shown: dict = {}  # each echoed prompt's flags (`_echoed_logprobs`), for its n choices
        async for index, delta in _merge(streams):
            if delta.finish_reason == "error":
                err = error_body(f"the request failed: {delta.error}", "internal_error")
                await response.write(_sse(err))
                break
            stream = streams[index]
            if req.echo_only:  # one chunk a choice, once its token is in: the prompt, scored, and "length"
                if delta.finish_reason is None:
                    continue
                delta = dataclasses.replace(delta, token_id=None, logprobs=None,
                                            finish_reason=_echo_only_reason(delta.finish_reason))
            try:
                text = "" if req.echo_only else texts[index].push(delta.token_id, delta.finish_reason is not None,
                                                                   delta.stop_text_index)
                logprobs = None
                if stream.output_logprobs is not None and (delta.token_id is not None or req.echo_only):
                    if first[index]:  # with echo, the prompt's tokens go first, in the first chunk
                        fed = [] if req.echo_only else [delta.token_id]
                        logprobs = self._echoed_logprobs(req, index, stream, fed, [delta.logprobs] if fed else [],
                                                         offsets[index], shown)
                    else:
                        logprobs = self._logprobs(req, [delta.token_id], [delta.logprobs], offsets[index])
                if req.echo and first[index]:
                    text = self._echo(req, index, stream) + text
                # One chunk per token, its text possibly "" (an incomplete character, or text that may
                # start a stop string, is held back): a client timing chunks times tokens.
                chunk = chunks.encode(index, text, delta.finish_reason, role=req.chat and first[index],
                                      logprobs=logprobs)
            except Exception as e:  # the stream has begun: the error is its last event (`_serve` aborts the rest)
                log.exception("request %s: its stream could not be built", rid)
                await response.write(_sse(error_body(f"the response could not be built: {type(e).__name__}: {e}",
                                                     "internal_error")))
                break
            await response.write(chunk)
            first[index] = False
        if req.include_usage:
            await response.write(_sse(protocol.usage_chunk(rid, self.model_name, req.chat, created,
                                                           _usage(streams, req.params.n, req.echo_only))))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _usage(streams: list[RequestStream], n: int = 1, echo_only: bool = False) -> dict:
    """Each prompt counted once, whatever its number of samples `n` (OpenAI's usage); an `echo_only`
    request completes nothing."""
    return protocol.usage(sum(len(s.prompt_token_ids) for s in streams[::n]),
                          0 if echo_only else sum(len(s.output_token_ids) for s in streams))


def _echo_only_reason(reason: str | None) -> str | None:
    """An `echo_only` choice's finish reason: "length" (no token was asked for) where its one
    sampled token ended it, as that token is left out; any other end as it came."""
    return "length" if reason in ("stop", "length") else reason


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """(index, delta) from every stream as they come; one stream needs no tasks."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for delta in stream:
            await merged.put((i, delta))
        await merged.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            i, delta = await merged.get()
            if delta is None:
                open_ -= 1
            else:
                yield i, delta
    finally:
        for t in tasks:
            t.cancel()


class _AnsweredBodies(logging.Filter):
    """Drops aiohttp's "Unhandled exception" for a request body it could not decode: the handler
    has answered it with a 400 already (`_body`), and aiohttp, reading the rest of the body to keep
    the connection, fails on it again. A client sending such bodies cannot fill the log with
    tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RequestPayloadError))


def build_app(serving: OpenAIServing, *, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> web.Application:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _AnsweredBodies) for f in server_log.filters):
        server_log.addFilter(_AnsweredBodies())
    app = web.Application(middlewares=[_errors_and_log, _auth(api_key)], client_max_size=max_body_bytes)
    app[SERVING] = serving
    app.router.add_get("/health", serving.health)
    app.router.add_get("/v1/models", serving.models)
    app.router.add_get("/metrics", PrometheusStatLogger(serving.async_llm, serving.model_name).metrics)
    app.router.add_post("/v1/completions", serving.completions)
    app.router.add_post("/v1/chat/completions", serving.chat_completions)
    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="queued requests past this get 503 with Retry-After")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on the /v1 routes (or ${API_KEY_ENV})")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    parser.add_argument("--step-log", default=None,
                        help="write one JSON line per engine step to this new file (one that exists is refused)")


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: must be in [0, 65535]")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting {args.max_waiting}: must be >= 1")
    if not 0 <= args.shutdown_timeout < float("inf"):  # NaN fails too
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: must be a finite number of seconds >= 0")
    if args.step_log is not None:
        folder = os.path.dirname(os.path.abspath(args.step_log))
        if not args.step_log or os.path.lexists(args.step_log):
            # Never over a file that is there: a log flag must not empty what a mistyped path names.
            raise ValueError(f"--step-log {args.step_log!r}: must name a new file (this one exists, or names nothing)")
        if not os.path.isdir(folder):
            raise ValueError(f"--step-log {args.step_log}: its folder does not exist")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"--step-log {args.step_log}: its folder is not writable")


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, one per address `host` resolves to (as asyncio's `create_server`
    binds them), bound and not yet listening. They are taken before the engine is built, so a
    host that does not resolve or a port in use is an error at once rather than after minutes
    of loading and capture, and nobody takes the port meanwhile; until the app listens a client
    is refused, as with no server at all."""
    try:
        # "" is every interface, as asyncio takes it: the wildcard address of each family.
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: the name does not resolve ({e.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio sets it
            if family == socket.AF_INET6:  # each family on its own socket, as asyncio binds them
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot bind ({e.strerror})") from None
    return sockets


def build_engine(config: EngineConfig) -> Engine:
    """The engine core process's factory: an `LLM`'s engine (weights, pool, captured graphs),
    warmed up on CUDA (`Engine.warm_up`: every kernel a request can reach is built before
    `/health` answers). On the CPU nothing is built lazily, and the warm-up is skipped."""
    from nanolab.llm import LLM

    start = time.perf_counter()
    engine = LLM.from_config(config).engine
    runner = engine.runner
    reports = [g.report for g in (runner.graphs, getattr(runner, "varlen_graphs", None)) if g and g.report]
    log.info("nanolab: engine built in %.1f s%s", time.perf_counter() - start,
             "".join(f"; {r}" for r in reports))
    if engine.device.type == "cuda":
        log.info("nanolab: %s", engine.warm_up())
    return engine


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT or SIGTERM; the exit code: 0, or 1 when the engine core died."""
    started = time.perf_counter()
    config = EngineConfig.from_cli_args(args)  # every flag checked before the core starts
    # The port first: a port in use or a host that does not resolve is an error before a preset's
    # weights are converted or synthesized, which can take minutes on first use.
    sockets = bind_sockets(args.host, args.port)
    try:
        tokenizer = Tokenizer.from_dir(resolve_weights(config.model))
        return await _serve_on(args, config, tokenizer, sockets, started)
    finally:
        for sock in sockets:
            sock.close()


async def _serve_on(args: argparse.Namespace, config: EngineConfig, tokenizer: Tokenizer,
                    sockets: list[socket.socket], started: float) -> int:
    factory = functools.partial(build_engine, config)
    # The engine runs in a process of its own: here, the event loop has the interpreter to itself.
    async_llm = await AsyncLLM.spawn(factory, max_waiting=args.max_waiting, step_log=args.step_log)
    serving = OpenAIServing(tokenizer, async_llm, args.served_model_name or args.model)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(serving, api_key=api_key)
    # The drain below ends every request before the runner stops, so the runner's own wait for
    # handlers (60 s by default, spent twice for a client that stops reading) only has sockets to close.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    for sock in sockets:
        await web.SockSite(runner, sock).start()
    # The first signal drains; a second aborts what is left at once; a third kills the engine's
    # process if it has not stopped by then.
    stop, force, kill = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        for event in (stop, force, kill):
            if not event.is_set():
                event.set()
                return

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    port = sockets[0].getsockname()[1]
    info = async_llm.info
    log.info("nanolab: serving %s at http://%s:%d (device %s, %s, read %s, %s, %s, %d KV blocks%s); "
             "ready %.1f s after start",
             serving.model_name, args.host, port, info["device"], info["dtype"], info["read"],
             info["graphs"], info["prefill"], info["num_blocks"],
             ", API key required" if api_key else "", time.perf_counter() - started)
    await stop.wait()

    serving.draining = True
    log.info("nanolab: shutting down: %d requests in flight get %g s to finish", async_llm.num_unfinished,
             args.shutdown_timeout)
    aborted = await async_llm.drain(args.shutdown_timeout, force)
    await runner.cleanup()
    stopped = await async_llm.shutdown(force=kill)
    if stopped is None:  # the core's process died: its blocks died with it
        log.error("error: nanolab stopped after the engine died: %s", async_llm.dead)
        return 1
    free, total = stopped
    log.info("nanolab: stopped (%d requests aborted; %d of %d KV blocks free)", aborted, free, total)
    if free != total:
        raise RuntimeError(f"KV blocks leaked at shutdown: {total - free} of {total} still held")
    return 1 if async_llm.dead is not None else 0


def main(args: argparse.Namespace) -> int:
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        _check_args(args)
        return asyncio.run(serve(args))
    except (ValueError, FileNotFoundError, OSError) as e:
        log.error("error: %s", e)
        return 2
