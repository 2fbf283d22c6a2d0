"""Day 58's graphbench on the CPU: vLLM's metric definitions on hand-computed timings, the seeded
Poisson plan, the aiohttp client against a stand-in SSE server (in-process and as a subprocess
with a step log), the server lifecycle, and the row-compaction gate on synthetic step logs. The
real server's run is the chapter's (notebooks/58_graphbench.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np
import pandas as pd
import pytest

from nanolab.lab.compaction import (
    check_compaction,
    read_step_log,
    slice_steps,
    smallest_bucket,
    step_summary,
    weighted_median_rows,
)
from nanolab.lab.graphbench import (
    graphbench_ratios,
    round_ratios,
    run_arm,
    run_graphbench,
    run_rounds,
    startup_columns,
    startup_table,
)
from nanolab.lab.loadclient import PlanRun, RequestResult, run_plan, run_plan_async
from nanolab.lab.offlinesteps import time_offline
from nanolab.lab.serveprocess import (
    SERVER_TOKEN_BUDGET,
    ServeProcess,
    free_port,
    serve_command,
    split_arm,
    split_speculation,
)
from nanolab.lab.servingmetrics import SLO, check_requests, first_ttfts, itl_quantiles, serving_metrics, sustained_rates
from nanolab.lab.workload import WORKLOADS, PlannedRequest, Workload, rate_schedule, request_plan

BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# A stand-in for `python -m nanolab serve`, following its protocol: /health, /v1/models, and
# /v1/completions streaming one SSE chunk per token from a shared step loop (a prefill step for
# newly arrived requests, else one decode step for every live one), a usage chunk, then [DONE].
# With step_log=PATH it writes the server's step log; SIGTERM ends it with exit status 0.
FAKE_SERVER = r'''
import asyncio, json, sys, time
from aiohttp import web

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def make_app(tick=0.002, step_log=None, graphs=True, model="fake-model"):
    live = {}  # request id -> [queue, prefilled, prompt_len]
    state = {"next": 0}

    async def engine(app):
        log = open(step_log, "a") if step_log else None

        async def loop():
            while True:
                await asyncio.sleep(tick)
                new = [r for r in live.values() if not r[1]]
                if new:
                    phase, rows, batch, graph, tokens = "prefill", new, len(new), False, sum(r[2] for r in new)
                else:
                    rows = list(live.values())
                    if not rows:
                        continue
                    graph = graphs and len(rows) <= BUCKETS[-1]
                    batch = next(b for b in BUCKETS if b >= len(rows)) if graph else len(rows)
                    phase, tokens = "decode", len(rows)
                for r in rows:
                    r[1] = True
                    r[0].put_nowait(1)
                if log:
                    log.write(json.dumps({"t": time.monotonic(), "phase": phase, "rows": len(rows), "batch": batch,
                                          "graph": graph, "tokens": tokens, "ms": 1000 * tick}) + "\n")

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        if log:
            log.close()

    async def health(request):
        return web.Response()

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completions(request):
        body = await request.json()
        n, prompt = body["max_tokens"], body["prompt"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = state["next"]
        state["next"] += 1
        live[rid] = [asyncio.Queue(), False, len(prompt)]
        try:
            for i in range(n):
                await live[rid][0].get()
                text = "" if i % 3 else f" t{i}"  # some tokens' text deltas are empty, as a BPE split can leave them
                choice = {"index": 0, "text": text, "finish_reason": "length" if i == n - 1 else None}
                chunk = {"id": str(rid), "object": "text_completion", "model": model, "choices": [choice]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        finally:
            live.pop(rid, None)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.cleanup_ctx.append(engine)
    app.add_routes([web.get("/health", health), web.get("/v1/models", models),
                    web.post("/v1/completions", completions)])
    return app


if __name__ == "__main__":
    args = dict(a.split("=", 1) for a in sys.argv[1:])
    web.run_app(make_app(float(args.get("tick", 0.002)), args.get("step_log"), args.get("graphs") == "True"),
                host="127.0.0.1", port=int(args["port"]), print=None)
'''

TINY = Workload(prompt_len=(4, 12), output_len=(3, 9), duration_s=0.3, min_requests=4, max_requests=12)


def fake_app(**kwargs):
    namespace: dict = {}
    exec(FAKE_SERVER, namespace)
    return namespace["make_app"](**kwargs)


@pytest.fixture
def fake_script(tmp_path):
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return path


def result(send, chunks, max_tokens, tokens=None, prompt_len=8, error=None) -> RequestResult:
    return RequestResult(0, prompt_len, max_tokens, send, tuple(chunks), len(chunks) if tokens is None else tokens,
                         prompt_len, "length" if chunks and error is None else None, error)


# Metrics, against values worked out by hand.

HAND = [result(0.0, (0.5, 0.6, 0.7, 1.1), 4),  # TTFT 0.5, TPOT (1.1 - 0.5) / 3 = 0.2, ITL 0.1 0.1 0.4
        result(1.0, (1.2, 1.5), 3),  # TTFT 0.2, TPOT 0.3, ITL 0.3; asked for 3 tokens, got 2
        result(2.0, (3.0,), 1),  # TTFT 1.0, one token: no TPOT, no ITL
        result(3.0, (), 5, tokens=None, error="HTTP 500: boom")]


def test_metrics_follow_vllm_definitions():
    m = serving_metrics(PlanRun(HAND, 0.0, 4.0, (0.0, 4.0)), SLO(ttft_ms=600, tpot_ms=250))
    assert (m["requests"], m["completed"], m["failed"], m["token_mismatches"]) == (4, 3, 1, 2)
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx((4 + 2 + 1) / 4)
    # TTFT from each request's own send, not the run's start: 0.5, 0.2, 1.0
    assert m["ttft_p50_ms"] == pytest.approx(500)
    assert m["ttft_p99_ms"] == pytest.approx(1000 * (0.5 + 0.98 * 0.5))
    # TPOT over output tokens - 1, per request: 0.2 and 0.3 (over tokens it would be 0.15 and 0.15)
    assert m["tpot_p50_ms"] == pytest.approx(250)
    # ITL pooled over every gap (0.1, 0.1, 0.4, 0.3), not averaged per request (0.2, 0.3), TTFT not among them
    assert m["itl_p50_ms"] == pytest.approx(200)
    assert m["itl_p99_ms"] == pytest.approx(1000 * (0.3 + 0.97 * 0.1))
    assert m["itl_gaps"] == 4
    assert m["e2el_p50_ms"] == pytest.approx(1000)  # latencies 1.1, 0.5, 1.0
    assert m["chunk_shortfall"] == 0
    # Goodput: only the first meets TTFT <= 600 ms and TPOT <= 250 ms; a one-token request's TPOT is 0
    assert m["goodput"] == pytest.approx(1 / 4)
    assert serving_metrics(PlanRun(HAND, 0.0, 4.0, (0.0, 4.0)), SLO(tpot_ms=250))["goodput"] == pytest.approx(2 / 4)


def test_a_token_held_back_is_counted_not_failed():
    # 4 tokens in 3 chunks: the second token's text was part of a character, sent with the third.
    r = result(0.0, (0.5, 0.7, 0.8), 4, tokens=4)
    assert r.tokens_match and r.chunk_shortfall == 1
    assert r.itl == pytest.approx([0.2, 0.1]) and r.tpot == pytest.approx(0.1)  # TPOT still per token
    assert not result(0.0, (0.5, 0.6, 0.7), 4, tokens=3).tokens_match  # usage short of max_tokens
    assert not result(0.0, (0.5, 0.6, 0.7), 2, tokens=2).tokens_match  # more chunks than tokens


def test_sustained_rate_tells_a_long_tail_from_a_growing_queue():
    rng = np.random.default_rng(0)
    sends = np.arange(16.0)  # 16 requests at 1 a second
    # Taken in at once, then 0.26 to 2 s of decoding: vLLM's requests / duration reads 16 / 17.x,
    # and the spread of finish times alone would read under 0.9 of the rate.
    latencies = [0.26, 0.26, *rng.uniform(0.26, 2.0, 12), 2.0, 2.0]  # the early ones short, the late ones long
    keeping_up = [result(s, (s + 0.05, s + lat), 2) for s, lat in zip(sends, latencies)]
    offered, sustained = sustained_rates(keeping_up)
    assert offered == pytest.approx(1.0) and sustained == pytest.approx(1.0)
    finishes = sorted(r.chunk_s[-1] for r in keeping_up)
    assert 13 / (finishes[14] - finishes[1]) < 0.9  # what a finish-time test would have said
    # A server that takes one request in every 2 s, whatever comes in.
    falling_behind = [result(s, (2.0 * (i + 1), 2.0 * (i + 1) + 0.5), 2) for i, s in enumerate(sends)]
    offered, sustained = sustained_rates(falling_behind)
    assert sustained == pytest.approx(0.5)
    assert all(np.isnan(sustained_rates(falling_behind[:3])))  # too few requests to tell
    run = PlanRun(falling_behind, 0.0, 32.5, (0.0, 32.5))
    assert serving_metrics(run, SLO())["saturated"]
    assert not serving_metrics(PlanRun(keeping_up, 0.0, 17.5, (0.0, 17.5)), SLO())["saturated"]


# The plan.


def test_poisson_plan_is_seeded_and_keeps_its_rate():
    one_token = Workload(prompt_len=(1, 1), output_len=(1, 1), duration_s=1.0, min_requests=1, max_requests=1)
    a = request_plan(4.0, 20_000, 1000, one_token, seed=1)
    assert a == request_plan(4.0, 20_000, 1000, one_token, seed=1)
    assert a != request_plan(4.0, 20_000, 1000, one_token, seed=2)
    arrivals = np.array([r.arrival_s for r in a])
    assert arrivals[0] == 0 and (np.diff(arrivals) > 0).all()
    assert len(a) / arrivals[-1] == pytest.approx(4.0, rel=0.02)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential gaps, not a metronome
    assert [r.arrival_s for r in request_plan(1.0, 8, 1000, one_token, seed=1)] != list(arrivals[:8])  # per rate

    plan = request_plan(4.0, 2000, 1000, WORKLOADS["cuda"], seed=1)
    prompts = np.array([len(r.prompt_token_ids) for r in plan])
    outputs = np.array([r.max_tokens for r in plan])
    assert (prompts.min(), prompts.max()) == (64, 512) and (outputs.min(), outputs.max()) == (32, 256)
    assert prompts.mean() == pytest.approx(288, rel=0.03) and outputs.mean() == pytest.approx(144, rel=0.03)
    ids = np.concatenate([r.prompt_token_ids for r in plan[:50]])
    assert ids.min() >= 16 and ids.max() < 1000


def test_rates_and_request_counts():
    assert rate_schedule([1, 2, 4, 8], 100) == [1, 2, 4, 8, 16, 32, 64]
    assert rate_schedule([1, 2, 4, 8], 8) == [1, 2, 4, 8]
    w = WORKLOADS["cuda"]
    assert [w.requests_at(r) for r in (1, 2, 32, 128)] == [16, 16, 256, 512]
    with pytest.raises(ValueError):
        Workload((10, 5), (1, 2), 1.0, 1, 2)


# The client.


def test_client_streams_from_a_fake_server():
    plan = request_plan(200.0, 10, 500, TINY, seed=3)

    async def go():
        from aiohttp import web

        runner = web.AppRunner(fake_app(tick=0.003))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await run_plan_async(f"http://127.0.0.1:{port}", "fake-model", plan)
        finally:
            await runner.cleanup()

    run = asyncio.run(go())
    assert len(run.results) == 10
    for req, r in zip(plan, run.results):
        assert r.ok and r.tokens_match, r
        assert len(r.chunk_s) == req.max_tokens == r.output_tokens  # chunks with text "" count as tokens
        assert r.send_s >= run.start_s + req.arrival_s
        assert r.ttft > 0 and all(g > 0 for g in r.itl)
    m = serving_metrics(run, SLO())
    assert m["completed"] == 10 and m["token_mismatches"] == 0
    assert 2 < m["itl_p50_ms"] < 60  # one step a 3 ms tick, give or take a loaded CI machine


def test_client_reports_a_refused_request():
    async def go():
        from aiohttp import web

        async def refuse(request):
            return web.json_response({"error": {"message": "no", "type": "BadRequestError"}}, status=400)

        app = web.Application()
        app.add_routes([web.post("/v1/completions", refuse)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await run_plan_async(f"http://127.0.0.1:{port}", "m", [PlannedRequest(0, 0.0, (20, 21), 3)])
        finally:
            await runner.cleanup()

    (r,) = asyncio.run(go()).results
    assert not r.ok and r.error.startswith("HTTP 400") and not r.tokens_match


# The server's lifecycle and one arm end to end, on the stand-in.


def test_serve_process_lifecycle(fake_script, tmp_path):
    port = free_port()
    log = tmp_path / "steps.jsonl"
    argv = [sys.executable, str(fake_script), f"port={port}", f"step_log={log}", "graphs=True"]
    with ServeProcess(argv, port, tmp_path / "server.log", start_timeout_s=30) as server:
        assert server.model_id() == "fake-model"
        run = run_plan(server.url, "fake-model", request_plan(100.0, 6, 500, TINY, seed=0))
    assert server.exit_code == 0
    assert all(r.tokens_match for r in run.results)
    steps = read_step_log(log)  # flushed when SIGTERM ended the server
    assert (steps.phase == "decode").any() and (steps.phase == "prefill").any()
    assert check_compaction(steps, BUCKETS, expect_graphs=True)


def test_serve_process_reports_a_dead_server(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('cannot load the model: no such preset'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no such preset"):
        with ServeProcess(argv, free_port(), tmp_path / "server.log", start_timeout_s=30):
            pass
    hung = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = ServeProcess(hung, free_port(), tmp_path / "hung.log", start_timeout_s=1, stop_timeout_s=5)
    with pytest.raises(RuntimeError, match="not healthy within 1 s(.|\n)*loading"):
        server.__enter__()
    assert server.proc.poll() is not None  # stopped, not left behind


def test_run_arm_on_the_stand_in(fake_script, tmp_path):
    def command(model, port, *, device, eager, step_log, **_):
        return [sys.executable, str(fake_script), f"port={port}", f"step_log={step_log}", f"graphs={not eager}"]

    arm = run_arm("graphs", "fake-model", "cuda", 500, [20.0, 40.0], 40.0, TINY, SLO(), warmup=2, workdir=tmp_path,
                  command=command, log=lambda _: None)
    rates = pd.DataFrame(arm.rates)
    assert list(rates.rate) == [20.0, 40.0] and (rates.server_exit == 0).all()
    assert check_requests(rates)
    (a0, a1), (b0, _) = arm.windows[20.0], arm.windows[40.0]
    assert a0 < a1 <= b0  # the rates' windows do not overlap
    assert set(arm.steps.rate) == {20.0, 40.0} and (arm.steps.t_s >= 0).all()
    assert (rates.decode_steps > 0).all() and (rates.step_batch >= rates.median_rows).all()
    assert check_compaction(arm.steps, BUCKETS, expect_graphs=True)
    assert check_compaction(step_summary(arm.steps), BUCKETS, expect_graphs=True)


def test_rounds_keep_every_server_up_and_turn_the_arms_on_one_stream_a_round(fake_script, tmp_path):
    started = []

    def command(model, port, *, device, eager, step_log, **kw):
        started.append(kw.get("speculative_config"))
        return [sys.executable, str(fake_script), f"port={port}", f"step_log={step_log}", f"graphs={not eager}"]

    log = []
    arms = ["graphs", "graphs+ngram", "eager"]
    table = run_rounds(arms, "fake-model", "cuda", 500, [20.0], 3, TINY, SLO(), warmup=1,
                       workdir=tmp_path, command=command, log=log.append)
    assert started == [None, {"method": "ngram"}, None]  # each server started once, for every round
    # the order turns a place a round: over three rounds each arm takes each place once (a reversal
    # on odd rounds would keep the middle arm in the middle)
    assert [a for a in table.arm] == [*arms, *arms[1:], arms[0], arms[2], *arms[:2]]
    assert list(table.place) == [0, 1, 2] * 3 and (table.server_exit == 0).all()
    assert (table.groupby("arm").place.nunique() == 3).all()
    assert check_requests(table)
    by = table.set_index(["round", "arm"]).requests
    assert (by.xs("graphs", level="arm") == by.xs("graphs+ngram", level="arm")).all()
    with pytest.raises(ValueError, match="rounds=0"):
        run_rounds(["graphs"], "fake-model", "cuda", 500, [20.0], 0, TINY, SLO(), command=command)


def test_round_ratios_pair_each_round_and_take_the_median():
    rounds = pd.DataFrame({"round": [0, 0, 1, 1, 2, 2], "arm": ["graphs", "graphs+ngram"] * 3, "rate": 32.0,
                           "itl_p50_ms": [1.0, 1.1, 2.0, 1.9, 1.0, 1.02],
                           "tpot_p50_ms": [1.0, 1.2, 1.0, 1.0, 1.0, 1.1]})
    r = round_ratios(rounds).set_index("ratio")
    itl = r.loc["speculating / plain ITL p50"]
    # Paired by round: 1.1, 0.95, 1.02; pooling the arms' medians instead would give 1.1 / 1.0.
    assert itl.value == pytest.approx(1.02) and not itl.met and itl["rounds"] == 3
    assert itl.lo <= 0.95 + 1e-9 and itl.hi >= 1.1 - 1e-9 and itl.detail == "per round 1.100, 0.950, 1.020"
    assert r.loc["speculating / plain TPOT p50"].value == pytest.approx(1.1)
    assert round_ratios(rounds[rounds.arm == "graphs"]).empty  # no speculating arm, no ratio


def test_arms_name_the_prefill_and_the_server_gets_the_flag(fake_script, tmp_path):
    assert split_arm("graphs") == ("graphs", None) and split_arm("eager-whole") == ("eager", "whole")
    assert split_arm("fullgraphs-chunked+ngram") == ("fullgraphs", "chunked")
    assert split_speculation("fullgraphs+ngram") == ("fullgraphs", {"method": "ngram"})
    assert split_speculation("graphs") == ("graphs", None)
    assert split_speculation("graphs+ngram:prompt_lookup_min=2:num_speculative_tokens=8") == (
        "graphs", {"method": "ngram", "prompt_lookup_min": 2, "num_speculative_tokens": 8})
    for unknown in ("graphs-sometimes", "graphs-compiled", "compiled", "graphs+eagle", "graphs+", "graphs+eagle:k=2"):
        with pytest.raises(ValueError, match="unknown arm"):
            split_arm(unknown)
    for bad, field in (("graphs+ngram:k=4", "not a setting"), ("graphs+ngram:prompt_lookup_min", "not a setting"),
                       ("graphs+ngram:max_num_seqs=two", "not a setting"), ("graphs+ngram:max_num_seqs=--3", "not a"),
                       ("graphs+ngram:max_num_seqs=\u00b2", "not a setting"),
                       ("graphs+ngram:max_num_seqs=2:max_num_seqs=3", "max_num_seqs is set twice"),
                       ("graphs+ngram:num_speculative_tokens=0", "'graphs.ngram:num_speculative_tokens=0': "
                                                                 "speculative_config.num_speculative_tokens=0")):
        with pytest.raises(ValueError, match=field):
            split_arm(bad)
    argv = lambda **kw: serve_command("m", 1, device="cpu", eager=True, step_log=tmp_path / "s", **kw)
    assert "--no-enable-chunked-prefill" in argv(chunked_prefill=False)
    assert "--enable-chunked-prefill" in argv(chunked_prefill=True)
    assert not any("chunked" in a for a in argv())  # the server's default
    assert argv(max_num_batched_tokens=512)[-2:] == ["--max-num-batched-tokens", "512"]
    assert "--max-num-batched-tokens" not in argv()
    assert argv(speculative_config={"method": "ngram"})[-2:] == ["--speculative-config", '{"method": "ngram"}']
    seen = {}

    def command(model, port, *, device, eager, step_log, **kw):
        seen.update(kw)
        return [sys.executable, str(fake_script), f"port={port}", f"step_log={step_log}", f"graphs={not eager}"]

    arm = run_arm("graphs-whole", "fake-model", "cuda", 500, [20.0], 20.0, TINY, SLO(), warmup=0, workdir=tmp_path,
                  command=command, log=lambda _: None)
    assert seen["chunked_prefill"] is False
    assert "max_num_batched_tokens" not in seen  # the server's default budget
    rates = pd.DataFrame(arm.rates)
    assert list(rates.arm) == ["graphs-whole"] and list(rates.prefill) == ["whole"]
    assert {"mixed_steps", "mixed_p50_ms"} <= set(rates.columns)
    assert check_compaction(arm.steps, BUCKETS, expect_graphs=True)  # "graphs-whole" replays graphs

    # What run_arm hands the command is all this checks: no server needs to start for it.
    class Built(Exception):
        pass

    def record(model, port, *, device, eager, step_log, **kw):
        seen.clear()
        seen.update(kw, eager=eager)
        raise Built

    with pytest.raises(Built):
        run_arm("graphs-chunked", "fake-model", "cuda", 500, [20.0], 20.0, TINY, SLO(), warmup=0, workdir=tmp_path,
                command=record, log=lambda _: None, max_num_batched_tokens=512)
    assert seen["chunked_prefill"] is True and seen["max_num_batched_tokens"] == 512 and not seen["eager"]
    assert seen["cudagraph_mode"] == "full_decode_only"  # named: the server's default is "full"
    with pytest.raises(Built):
        run_arm("fullgraphs", "fake-model", "cuda", 500, [20.0], 20.0, TINY, SLO(), warmup=0, workdir=tmp_path,
                command=record, log=lambda _: None)
    assert seen["cudagraph_mode"] == "full" and not seen["eager"]
    with pytest.raises(Built):
        run_arm("eager", "fake-model", "cpu", 500, [20.0], 20.0, TINY, SLO(), warmup=0, workdir=tmp_path,
                command=record, log=lambda _: None)
    assert seen["eager"] and "chunked_prefill" not in seen  # a bare arm: the server's default prefill
    assert "cudagraph_mode" not in seen


STARTUP_LOG = """\
fullgraphs: server ready in 43.6 s (-m nanolab serve --model m --port 1 --cudagraph-mode full)
fullgraphs: engine built in 36.4 s; captured 7 decode graphs in 30.37 s; one shared pool holds 556.0 MiB; \
captured 51 varlen graphs in 1.64 s; one shared pool holds 842.0 MiB
fullgraphs: warmed up on 35 requests in 14 steps, 0.51 s
fullgraphs     4 req/s: 32/32 in 6.1 s
eager: server ready in 9.5 s (-m nanolab serve --model m --port 2 --enforce-eager --max-num-batched-tokens 256)
eager: engine built in 2.0 s
"""


def test_the_startup_table_reads_each_servers_lines():
    """The server's startup lines, as graphbench logs them, become one row per server: its seconds
    to ready, its flags, and what building and warming it cost; a part its log lacks stays empty."""
    table = startup_table(STARTUP_LOG).set_index("arm")
    full, eager = table.loc["fullgraphs"], table.loc["eager"]
    assert (full.ready_s, full.cudagraph_mode, full.engine_build_s, full.decode_graphs, full.decode_capture_s,
            full.decode_pool_mib) == (43.6, "full", 36.4, 7, 30.37, 556.0)
    assert (full.varlen_graphs, full.varlen_capture_s, full.varlen_pool_mib) == (51, 1.64, 842.0)
    assert (full.warm_up_requests, full.warm_up_s) == (35, 0.51)
    assert (eager.ready_s, eager.token_budget, eager.engine_build_s) == (9.5, "256", 2.0)
    assert pd.isna(eager.cudagraph_mode) and pd.isna(eager.decode_graphs) and pd.isna(eager.warm_up_s)
    assert startup_columns("no startup here") == {}


def test_the_server_takes_every_flag_serve_command_passes(tmp_path):
    from nanolab.entrypoints.openai.api_server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = serve_command("tiny", 8123, device="cpu", eager=True, step_log=tmp_path / "s", dtype="float32",
                         read="reference", max_num_seqs=8, max_model_len=256, max_waiting=99, chunked_prefill=False,
                         max_num_batched_tokens=512)
    assert argv[1:4] == ["-m", "nanolab", "serve"]
    args = parser.parse_args(argv[4:])
    assert (args.model, args.host, args.port, args.device, args.dtype, args.read) == (
        "tiny", "127.0.0.1", 8123, "cpu", "float32", "reference")
    assert (args.enforce_eager, args.enable_chunked_prefill, args.max_num_batched_tokens) == (True, False, 512)
    assert (args.max_num_seqs, args.max_model_len, args.max_waiting, args.step_log) == (8, 256, 99,
                                                                                          str(tmp_path / "s"))
    assert parser.parse_args(serve_command("tiny", 1, device="cpu", eager=False, step_log=tmp_path / "s",
                                           chunked_prefill=True)[4:]).enable_chunked_prefill
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    assert parser.parse_args(serve_command("tiny", 1, device="cpu", eager=False, step_log=tmp_path / "s",
                                           speculative_config=spec)[4:]).speculative_config == spec


def test_the_recorded_default_budget_is_the_servers():
    from nanolab.entrypoints.openai.api_server import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.get_default("max_num_batched_tokens") == SERVER_TOKEN_BUDGET


@pytest.mark.parametrize("budget", [0, -5, 1.5, True])
def test_a_token_budget_that_is_not_a_positive_int_is_refused_before_any_server_starts(budget):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        run_graphbench("tiny", "cpu", ("eager",), max_num_batched_tokens=budget)


def test_whole_over_chunked_itl_p99_at_each_rate():
    rates = pd.DataFrame({"arm": ["graphs-chunked", "graphs-whole", "graphs-chunked", "graphs-whole"],
                          "rate": [8.0, 8.0, 32.0, 32.0], "itl_p50_ms": [3.0, 2.5, 4.0, 3.0],
                          "itl_p99_ms": [6.0, 12.0, 8.0, 49.5], "step_batch": [8, 8, 32, 32],
                          "saturated": [False] * 4})
    r = graphbench_ratios(rates, pd.DataFrame(columns=["arm", "batch", "ms_p50"])).set_index(["ratio", "arm", "rate"])
    whole = r.xs("whole / chunked ITL p99", level="ratio")
    assert list(whole.index) == [("graphs", 8.0), ("graphs", 32.0)]
    assert whole.value.tolist() == pytest.approx([2.0, 49.5 / 8.0]) and whole.met.all()


# Row compaction.


def step_log(records) -> pd.DataFrame:
    """(phase, rows, batch, graph[, tokens]) a step; tokens default to the rows (a plain decode step's)."""
    records = [(*r, r[1]) if len(r) == 4 else r for r in records]
    df = pd.DataFrame(records, columns=["phase", "rows", "batch", "graph", "tokens"]).assign(t=0.0, ms=1.0)
    return df.assign(padding_share=(df.batch - df.tokens) / df.batch)


GOOD = [("prefill", 3, 3, False, 40), ("decode", 3, 4, True), ("decode", 5, 8, True), ("decode", 1, 1, True),
        ("decode", 64, 64, True), ("decode", 65, 65, False),  # 65 rows: outside the list, eagerly
        ("decode", 1, 8, True, 5), ("decode", 2, 16, True, 10)]  # verify steps: a batch row a fed token


def test_compaction_gate_passes_a_compacted_log_and_fails_every_defect():
    assert smallest_bucket(5, BUCKETS) == 8 and smallest_bucket(64, BUCKETS) == 64
    assert smallest_bucket(65, BUCKETS) is None
    good = check_compaction(step_log(GOOD), BUCKETS, expect_graphs=True)
    assert good, good
    assert good.numbers["decode steps"] == 7 and good.numbers["graphed"] == 6
    for defect in [("decode", 3, 8, True),  # a bucket bigger than needed
                   ("decode", 5, 4, True),  # a bucket too small to hold the rows
                   ("decode", 1, 1, True, 5),  # a verify step at its rows' bucket, not its tokens'
                   ("decode", 2, 8, True, 2),  # a plain step at a verify step's bucket
                   ("decode", 3, 4, False)]:  # padded without a graph
        bad = check_compaction(step_log([*GOOD, defect]), BUCKETS)
        assert not bad and bad.numbers["off the smallest bucket"] == 1, defect
    eager_step = check_compaction(step_log([*GOOD, ("decode", 3, 3, False)]), BUCKETS, expect_graphs=True)
    assert not eager_step and eager_step.numbers["graph on/off not as expected"] == 1
    assert not check_compaction(step_log(GOOD), BUCKETS, expect_graphs=False)  # the eager arm replayed graphs
    assert check_compaction(step_log([("decode", 3, 3, False), ("decode", 7, 7, False)]), BUCKETS, expect_graphs=False)
    assert not check_compaction(step_log([("prefill", 3, 3, False)]), BUCKETS)  # no decode step: nothing shown
    summary = step_summary(step_log([*GOOD, ("decode", 3, 8, True)]).assign(arm="graphs", rate=1.0))
    assert not check_compaction(summary, BUCKETS)
    summary = step_summary(step_log(GOOD).assign(arm="graphs", rate=1.0))
    assert check_compaction(summary, BUCKETS, expect_graphs=True)
    assert summary.tokens.isna().sum() == 1  # the prefill step's: only a decode step's fed tokens are kept


def test_median_rows_weighs_each_step_by_its_tokens_and_windows_slice():
    steps = step_log([("decode", 1, 1, True)] * 3 + [("decode", 8, 8, True)])
    assert weighted_median_rows(steps) == 8  # 8 of the 11 chunks came from the 8-row step
    timed = steps.assign(t=[1.0, 2.0, 5.0, 6.0])
    sliced = slice_steps(timed, {1.0: (0.5, 2.5), 2.0: (4.0, 7.0)})
    assert list(sliced.rate) == [1.0, 1.0, 2.0, 2.0] and list(sliced.t_s) == [0.5, 1.5, 1.0, 2.0]


def test_offline_steps_time_each_batch(tiny_path, one_thread):
    # a 16 MiB pool, not the CPU's default 1 GiB: zeroing that took longer than the steps
    off = time_offline(str(tiny_path), "cpu", "eager", [2, 1, 2], context=12, steps=4, repeats=2,
                       kv_cache_bytes=16 << 20)
    assert list(off.batch) == [1, 2] and (off.steps == 8).all() and (off.context == 12).all()
    assert (off.ms_p50 > 0).all() and (off.ms_mean > 0).all()


def test_ratios_against_their_aims():
    rates = pd.DataFrame({"arm": ["graphs", "graphs", "eager", "eager"], "rate": [1.0, 64.0, 1.0, 64.0],
                          "itl_p50_ms": [2.0, 4.0, 7.0, 9.0], "itl_p99_ms": [3.0, 20.0, 8.0, 25.0],
                          "step_batch": [1, 64, 1, 40], "saturated": [False, False, False, True]})
    offline = pd.DataFrame({"arm": ["graphs", "eager"], "batch": [1, 1], "ms_p50": [1.9, 6.0]})
    r = graphbench_ratios(rates, offline).set_index(["ratio", "arm", "rate"])
    speedup = r.loc[("eager / graphs ITL p50", "both", 1.0)]
    assert speedup.value == pytest.approx(3.5) and speedup.met
    assert r.loc[("ITL p50 / offline step at batch 1 - 1", "graphs", 1.0)].value == pytest.approx(2.0 / 1.9 - 1)
    assert not r.loc[("ITL p50 / offline step at batch 1 - 1", "eager", 1.0)].met  # 7 / 6: 17% added
    tail = r.xs("ITL p99 / p50 at the highest sustainable rate", level="ratio")
    assert tail.loc[("graphs", 64.0)].value == pytest.approx(5.0) and not tail.loc[("graphs", 64.0)].met
    assert tail.loc[("eager", 1.0)].value == pytest.approx(8 / 7)  # 64 req/s saturated the eager arm
    with_prefill = rates.assign(prefill_p50_ms=9.5, prefill_steps=12, decode_steps=300)
    detail = graphbench_ratios(with_prefill, offline).set_index(["ratio", "arm"]).loc[
        ("ITL p99 / p50 at the highest sustainable rate", "graphs"), "detail"]
    assert detail.endswith("12 prefill steps among 300 decode steps, 9.50 ms at the median")
    rates["tpot_p50_ms"] = 5.0
    spec = pd.concat([rates, rates[rates.arm == "graphs"].assign(arm="graphs+ngram", itl_p50_ms=[1.8, 4.4])])
    worse = graphbench_ratios(spec, offline).set_index(["ratio", "arm", "rate"]).xs("speculating / plain ITL p50")
    assert worse.loc[("graphs+ngram", 1.0)].met and worse.loc[("graphs+ngram", 1.0)].value == pytest.approx(0.9)
    assert not worse.loc[("graphs+ngram", 64.0)].met  # 4.4 against 4.0 ms: speculation cost 10% at load


def test_figures_draw_from_the_tables():
    import matplotlib

    matplotlib.use("Agg")
    from nanolab.lab.plots.serving import plot_graphbench, plot_row_compaction

    rates = pd.DataFrame({"arm": ["graphs"] * 2 + ["eager"] * 2, "rate": [1.0, 2.0] * 2,
                          "itl_p50_ms": [2, 3, 7, 8], "itl_p99_ms": [4, 6, 9, 20],
                          "output_throughput": [30, 60, 30, 50],
                          "saturated": [False, False, False, True], "output_lo": 8, "output_hi": 32})
    trace = step_log(GOOD).assign(arm="graphs", rate=2.0, t_s=np.arange(len(GOOD)) * 0.01)
    for fig in (plot_graphbench(rates), plot_row_compaction(trace, BUCKETS)):
        assert fig.axes


def test_the_first_requests_ttft_is_held_against_the_rest():
    """Requests sent in another order than listed: the first ten by send time are the cold ones."""
    results = [RequestResult(i, 8, 2, send_s=float(20 - i), chunk_s=(20 - i + (0.3 if i >= 10 else 0.01),),
                             output_tokens=1, prompt_tokens=8, finish_reason="length") for i in range(20)]
    got = first_ttfts(results)  # sends 11..20 (i < 10) are the last ten; 1..10 (i >= 10) the first, at 300 ms
    assert got["first_ttft_max_ms"] == pytest.approx(300.0) and got["first_ttft_x_steady"] == pytest.approx(30.0)
    assert np.isnan(first_ttfts(results[:5])["first_ttft_x_steady"])


def test_itl_quantiles_are_a_cdf_of_the_completed_requests_gaps():
    ok = result(0.0, [0.1, 0.2, 0.4, 0.7], 4)  # gaps 100, 200, 300 ms
    failed = result(0.0, [0.1, 5.0], 4, error="broken")  # its 4.9 s gap is left out
    q = itl_quantiles(PlanRun([ok, failed], 0.0, 1.0, (0.0, 1.0)), points=3)
    assert q["quantile"].tolist() == [0.0, 0.5, 1.0] and q.gaps.tolist() == [3] * 3
    np.testing.assert_allclose(q.itl_ms, [100.0, 200.0, 300.0])


def test_spec_columns_are_what_a_window_moved_the_counters_by():
    from nanolab.lab.graphbench import SPEC_COUNTERS, spec_columns

    names = list(SPEC_COUNTERS.values())  # verify steps, drafts proposed, drafts kept
    before = dict(zip(names, (2.0, 8.0, 3.0), strict=True))
    after = dict(zip(names, (5.0, 20.0, 9.0), strict=True))
    assert spec_columns(before, after) == {"verify_steps": 3, "draft_tokens": 12, "accepted_tokens": 6,
                                           "acceptance_rate": 0.5}
    for missing in (None, {}):  # a server without /metrics, or without the counters
        assert all(v != v for v in spec_columns(before, missing).values())
    assert spec_columns(before, before)["acceptance_rate"] != spec_columns(before, before)["acceptance_rate"]
