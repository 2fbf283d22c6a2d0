"""The load client against a stand-in server: `KeepAliveClient` sends one request after another
over one connection, and each is timed as `send_request` times it."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from nanolab.lab.loadclient import KeepAliveClient
from nanolab.lab.workload import PlannedRequest


class StandIn:
    """A server on a loop of its own thread that streams one token a request, then [DONE], and
    only `tail_s` later ends the body. It records each request's client port: its connection."""

    def __init__(self, tail_s: float = 0.05) -> None:
        self.tail_s = tail_s
        self.ports: list[int] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner, self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.ports.append(request.transport.get_extra_info("peername")[1])
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"text":"a","finish_reason":"length"}]}\n\n')
        usage = f'{{"prompt_tokens":{len(body["prompt"])},"completion_tokens":1}}'
        await response.write(b'data: {"choices":[],"usage":' + usage.encode() + b"}\n\n")
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.tail_s)  # the body ends after [DONE] has been read
        await response.write_eof()
        return response

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_keep_alive_client_sends_every_request_over_one_connection():
    server = StandIn()
    try:
        with KeepAliveClient(server.url, "m") as client:
            runs = [client.send(PlannedRequest(i, 5.0, (20, 21, 22), 1)) for i in range(4)]
    finally:
        server.close()
    assert len(server.ports) == 4 and len(set(server.ports)) == 1
    for run in runs:
        (r,) = run.results
        assert r.ok and r.tokens_match and r.text == "a", r
        # timed from just before the POST (arrival_s is not waited for), the first chunk inside the run
        assert run.start_s <= r.send_s < r.chunk_s[0] <= run.end_s and r.send_s - run.start_s < 1.0
        assert run.window[0] <= run.window[1]
