"""Day 58's serving measurement: the real server over loopback, with CUDA graphs on and off.

Day 58. For each arm ("graphs", "eager" = `--enforce-eager`) this starts `python -m nanolab serve`
with a step log (an arm may name the prefill too: "graphs-whole" serves with
`--no-enable-chunked-prefill`, "graphs-chunked" with `--enable-chunked-prefill`, and the `prefill`
column says which; a bare arm takes the server's default, chunked), sends a seeded Poisson stream
of streamed completions at each rate from its own aiohttp client, and reduces the timings with
`vllm bench serve`'s definitions:

- TTFT: first streamed chunk - send time, per request;
- TPOT: (latency - TTFT) / (output tokens - 1), per request, latency being the last chunk's time;
- ITL: the gaps between consecutive streamed chunks, pooled over every request;
- request and output-token throughput: completed requests and their tokens over the rate's
  duration (first send to last response);
- goodput: requests per second that meet every SLO.

Rates are the seed's 1, 2, 4 and 8 requests/s, then doubled until the server saturates (the rate
at which it takes requests in falls below 0.9x the offered rate, `sustained_rates`) or `max_rate`.
The server's step log, sliced by each rate's window, shows row compaction: the live rows of every
step, the bucket that ran them, and the padding share (`check_compaction`). After the servers,
the same model is loaded in-process (`LLM`, graphs as in the arm) and decode steps are timed at
the batch each rate ran at, so the chapter can say what the server adds to a step.

    python -m nanolab graphbench --device cuda --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd

from nanolab.engine.buckets import DecodeBuckets
from nanolab.gates import Gate

ARMS = ("graphs", "eager")
# An arm's optional suffix: the server's prefill. "compiled" is chunked, with the steps that mix decode
# rows and prompt chunks compiled too (`--compile-varlen`).
PREFILLS = ("chunked", "whole", "compiled")
# The server's token budget a step unless told (`serve --max-num-batched-tokens`'s default), as the table
# records it.
SERVER_TOKEN_BUDGET = 2048
SEED_RATES = (1.0, 2.0, 4.0, 8.0)
SATURATION = 0.9  # sustained below this share of the offered rate: the queue grows, the rate is not sustainable
MIN_VERDICT = 4  # fewer requests than this at a rate: no central 80% to measure, no verdict
TOKEN_ID_FLOOR = 16  # prompt ids are drawn above the special tokens at the bottom of the vocabulary


@dataclass(frozen=True)
class Workload:
    """What each rate sends: prompt and output lengths uniform over [lo, hi] (inclusive), and
    max(min_requests, rate x duration_s) requests, at most max_requests."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    duration_s: float
    min_requests: int
    max_requests: int

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")
        if not 1 <= self.min_requests <= self.max_requests:
            raise ValueError(f"need 1 <= min_requests <= max_requests, got {self.min_requests}, {self.max_requests}")

    def requests_at(self, rate: float) -> int:
        return int(min(self.max_requests, max(self.min_requests, round(rate * self.duration_s))))

    @property
    def mean_output(self) -> float:
        return sum(self.output_len) / 2


@dataclass(frozen=True)
class SLO:
    """Per-request service levels, in ms (None: not part of the SLO). Goodput counts the
    requests that meet every one (vLLM's `--goodput ttft:.. tpot:.. e2el:..`); a one-token
    request's TPOT counts as 0, as vLLM counts it."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, r: RequestResult) -> bool:
        """Whether a completed request met every level."""
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot or 0.0), (self.e2el_ms, r.latency))
        return all(limit is None or 1000 * value <= limit for limit, value in checks)


# The H200 run, Llama-3.2-1B shapes: prompts of 64 to 512 tokens and 32 to 256 new tokens, so 64
# full rows hold at most 49k tokens, and requests that start together finish up to 8x apart, which
# is what row compaction is about. 8 s of arrivals a rate, at least 16 requests (the 1 request/s
# rate still pools about 2,300 ITL gaps) and at most 512: both arms, the offline steps and the
# weights' synthesis took 222 s on an H200 (2026-11-30).
WORKLOADS = {
    "cuda": Workload(prompt_len=(64, 512), output_len=(32, 256), duration_s=8.0, min_requests=16, max_requests=512),
    # SmolLM2 on two CPU cores decodes a step in 40 to 100 ms: short requests, 2.5 s a rate, so the
    # seed's four rates take about 20 s (8 requests/s saturates it).
    "cpu": Workload(prompt_len=(16, 64), output_len=(8, 24), duration_s=2.5, min_requests=4, max_requests=16),
}
# Interactive chat: the first token within a quarter second, then at least about 67 tokens/s a
# user. On the CPU, within two seconds and about 7 tokens/s.
SLOS = {"cuda": SLO(ttft_ms=250.0, tpot_ms=15.0), "cpu": SLO(ttft_ms=2000.0, tpot_ms=150.0)}


# The request plan.


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    arrival_s: float  # from the start of the rate
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def request_plan(rate: float, n: int, vocab_size: int, workload: Workload, seed: int = 0) -> list[PlannedRequest]:
    """`n` requests arriving as a Poisson process of `rate` per second (exponential gaps; the first
    at 0), with random token-id prompts so their lengths are exact. Seeded by (seed, rate): every
    arm gets the same plan at a rate."""
    rng = np.random.default_rng([seed, int(round(rate * 1000))])
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    prompt_lens = rng.integers(workload.prompt_len[0], workload.prompt_len[1] + 1, size=n)
    output_lens = rng.integers(workload.output_len[0], workload.output_len[1] + 1, size=n)
    plan = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(TOKEN_ID_FLOOR, vocab_size, size=prompt_lens[i]))
        plan.append(PlannedRequest(i, float(arrivals[i]), prompt, int(output_lens[i])))
    return plan


def rate_schedule(rates: Sequence[float], max_rate: float) -> list[float]:
    """The listed rates, then doubling from the last up to `max_rate`: the order they run in, until
    one past the listed ones saturates."""
    rates = [float(r) for r in rates]
    while rates[-1] * 2 <= max_rate:
        rates.append(rates[-1] * 2)
    return rates


# The client.


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    index: int
    prompt_len: int
    max_tokens: int
    send_s: float
    chunk_s: tuple[float, ...]  # arrival of each chunk that carried a choice: one a token, or one for several
    output_tokens: int | None  # the usage chunk's completion_tokens
    prompt_tokens: int | None  # the usage chunk's prompt_tokens
    finish_reason: str | None
    error: str | None = None

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


async def send_request(session, url: str, model: str, req: PlannedRequest, start: float) -> RequestResult:
    """Wait until `start + req.arrival_s` (perf_counter), then stream one completion from `url`
    (the server's root) and time its chunks. Failures come back in `error`, never raised."""
    import aiohttp

    delay = start + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    payload = {"model": model, "prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens,
               "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[float] = []
    usage: dict = {}
    finish = error = None
    send = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                async for raw in resp.content:  # one SSE line at a time
                    now = time.perf_counter()  # before parsing: the chunk's arrival
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        error = f"error chunk: {msg['error']}"
                    elif msg.get("choices"):
                        chunks.append(now)
                        finish = msg["choices"][0].get("finish_reason") or finish
                    elif msg.get("usage"):
                        usage = msg["usage"]
                else:
                    error = error or "the stream ended without [DONE]"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    return RequestResult(req.index, len(req.prompt_token_ids), req.max_tokens, send, tuple(chunks),
                         usage.get("completion_tokens"), usage.get("prompt_tokens"), finish, error)


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
    import aiohttp

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


# Metrics.


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if len(values) else float("nan")


def sustained_rates(results: Sequence[RequestResult]) -> tuple[float, float]:
    """(offered, sustained) requests per second over the central 80% of the run: sends between
    the 10th and 90th percentile send, and first tokens between the same percentiles of first-token
    times. Under continuous batching a request's first token comes when the server takes it in, so
    a server that keeps up takes requests in as fast as they come, and one that has fallen behind
    takes them in at the pace rows free up while its queue grows. First tokens, unlike finish
    times, do not carry the spread of output lengths: at 2 requests/s, 32 to 256 new tokens and
    10 ms a token, 16 requests' finish times read as saturated about one run in three (simulated). With fewer than
    `MIN_VERDICT` requests, or a failed one, both are NaN."""
    sends = sorted(r.send_s for r in results)
    firsts = sorted(r.chunk_s[0] for r in results if r.ok)
    if len(sends) < MIN_VERDICT or len(firsts) < len(sends):
        return float("nan"), float("nan")
    lo, hi = int(0.1 * (len(sends) - 1)), int(np.ceil(0.9 * (len(sends) - 1)))
    rate = lambda t: (hi - lo) / (t[hi] - t[lo]) if t[hi] > t[lo] else float("nan")
    return rate(sends), rate(firsts)


def serving_metrics(run: PlanRun, slo: SLO) -> dict:
    """`vllm bench serve`'s numbers for one rate: ms at p50 and p99, throughput per second of the
    run's duration. Requests that failed count in `failed` and in no other number."""
    done = [r for r in run.results if r.ok]
    ttft = [r.ttft for r in done]
    tpot = [r.tpot for r in done if r.tpot is not None]
    itl = [g for r in done for g in r.itl]
    e2el = [r.latency for r in done]
    offered, sustained = sustained_rates(run.results)
    duration = run.duration_s
    return {"requests": len(run.results), "completed": len(done), "failed": len(run.results) - len(done),
            "token_mismatches": sum(not r.tokens_match for r in run.results),
            "chunk_shortfall": sum(r.chunk_shortfall for r in done), "duration_s": duration,
            "request_throughput": len(done) / duration, "output_throughput": sum(r.tokens for r in done) / duration,
            "goodput": sum(slo.met(r) for r in done) / duration,
            "offered_req_s": offered, "sustained_req_s": sustained,
            "saturated": bool(sustained < SATURATION * offered),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
            "e2el_p50_ms": _pct(e2el, 50), "e2el_p99_ms": _pct(e2el, 99), "itl_gaps": len(itl)}


def check_requests(rates: pd.DataFrame) -> Gate:
    """Every request of every rate completed with the tokens it asked for (`RequestResult.tokens_match`),
    each token in a chunk of its own, and every server exited 0 on SIGTERM."""
    numbers = {"requests": int(rates.requests.sum()), "completed": int(rates.completed.sum()),
               "token mismatches": int(rates.token_mismatches.sum()),
               "tokens without a chunk": int(rates.chunk_shortfall.sum()),
               "servers not exiting 0": int((rates.groupby("arm").server_exit.first() != 0).sum())}
    passed = (numbers["requests"] > 0 and numbers["completed"] == numbers["requests"]
              and numbers["token mismatches"] == 0 and numbers["tokens without a chunk"] == 0
              and numbers["servers not exiting 0"] == 0)
    return Gate("every request completes with its tokens, one chunk each; the servers stop cleanly", passed, numbers)


# The step log.


STEP_COLUMNS = ["t", "phase", "rows", "batch", "graph", "tokens", "ms"]


def read_step_log(path: str | Path) -> pd.DataFrame:
    """The server's `--step-log`: one row a step (t, phase, rows, batch, graph, tokens, ms) and its
    padding share; no rows when the log was never written."""
    path = Path(path)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    steps = pd.DataFrame(lines, columns=STEP_COLUMNS)
    steps["padding_share"] = (steps.batch - steps.rows) / steps.batch
    return steps


def slice_steps(steps: pd.DataFrame, windows: dict[float, tuple[float, float]]) -> pd.DataFrame:
    """The steps that ended inside each rate's monotonic window, with `rate` and `t_s` (seconds
    from the window's start) added; steps outside every window (warm-up) are dropped."""
    parts = []
    for rate, (t0, t1) in windows.items():
        part = steps[(steps.t >= t0) & (steps.t <= t1)]
        parts.append(part.assign(rate=rate, t_s=part.t - t0))
    return pd.concat(parts, ignore_index=True) if parts else steps.iloc[:0].assign(rate=[], t_s=[])


def smallest_bucket(rows: int, batch_sizes: Sequence[int]) -> int | None:
    """The batch the engine pads `rows` live rows up to (`DecodeBuckets.lookup`), None past the list."""
    shape = DecodeBuckets(tuple(batch_sizes), None).lookup(rows, 0)
    return None if shape is None else shape[0]


def check_compaction(steps: pd.DataFrame, batch_sizes: Sequence[int], expect_graphs: bool | None = None) -> Gate:
    """Each decode step ran at the smallest capture bucket holding its live rows when a graph
    replayed, and unpadded (batch == rows) otherwise. `expect_graphs` True also asks that every
    decode step inside the list replayed a graph; False that none did. `steps` is a step log, or
    `step_summary`'s counts of one (its `steps` column weighs each row)."""
    decode = steps[steps.phase == "decode"]
    count = decode.steps if "steps" in decode.columns else pd.Series(1, index=decode.index)
    graphed = decode.graph.astype(bool)
    bucket = decode.rows.map(lambda r: smallest_bucket(int(r), batch_sizes))
    expected = bucket.where(graphed, decode.rows)
    off = decode.batch != expected
    inside = decode.rows <= max(batch_sizes)
    wrong_mode = inside & (graphed != expect_graphs) if expect_graphs is not None else pd.Series(False, decode.index)
    total = int(count.sum())
    numbers = {"decode steps": total, "graphed": int(count[graphed].sum()), "off the smallest bucket":
               int(count[off].sum()), "graph on/off not as expected": int(count[wrong_mode].sum()),
               "padding share (mean)": round(float((decode.padding_share * count).sum() / total), 3) if total else None}
    if off.any():
        first = decode[off].iloc[0]
        numbers["first"] = f"{int(first.rows)} rows ran at {int(first.batch)}"
    return Gate("row compaction: a decode step runs at the smallest bucket holding its live rows",
                total > 0 and not off.any() and not wrong_mode.any(), numbers)


def weighted_median_rows(decode: pd.DataFrame) -> float:
    """The live rows of the decode step that produced the median token: a step of r rows streams
    r chunks, so each step counts r times, as the pooled ITL counts it."""
    if decode.empty:
        return float("nan")
    rows = np.sort(decode.rows.to_numpy())
    cum = np.cumsum(rows)
    return float(rows[np.searchsorted(cum, cum[-1] / 2)])


def step_summary(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps counted by (arm, rate, phase, rows, batch, graph), with their median ms: the compaction
    table of a whole run in a few hundred rows."""
    keys = ["arm", "rate", "phase", "rows", "batch", "graph"]
    out = steps.groupby(keys, as_index=False).agg(steps=("ms", "size"), ms_p50=("ms", "median"))
    out["padding_share"] = (out.batch - out.rows) / out.batch
    return out


# The server.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_arm(arm: str) -> tuple[str, str | None]:
    """An arm's graphs mode and prefill: "graphs-whole" -> ("graphs", "whole"); "eager" ->
    ("eager", None), the server's default prefill."""
    mode, _, prefill = arm.partition("-")
    if mode not in ARMS or prefill not in ("", *PREFILLS):
        raise ValueError(f"unknown arm {arm!r}: one of {ARMS}, optionally ending in -{' or -'.join(PREFILLS)}")
    return mode, prefill or None


def serve_command(model: str, port: int, *, device: str, eager: bool, step_log: Path, dtype: str = "auto",
                  read: str = "auto", max_num_seqs: int = 64, max_model_len: int | None = None,
                  max_waiting: int = 1024, chunked_prefill: bool | None = None,
                  compile_varlen: bool = False, max_num_batched_tokens: int | None = None) -> list[str]:
    """`python -m nanolab serve` on loopback with a step log. `max_waiting` is set above any rate's
    request count: a bench past saturation measures the queue, not the server's 503s.
    `chunked_prefill` None leaves the server's default; `compile_varlen` adds `--compile-varlen`;
    `max_num_batched_tokens`, the tokens a step feeds, None the server's default."""
    argv = [sys.executable, "-m", "nanolab", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--device", device, "--dtype", dtype, "--read", read, "--max-num-seqs", str(max_num_seqs),
            "--max-waiting", str(max_waiting), "--step-log", str(step_log)]
    if eager:
        argv.append("--enforce-eager")
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if chunked_prefill else "--no-enable-chunked-prefill")
    if compile_varlen:
        argv.append("--compile-varlen")
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return argv


class ServeProcess:
    """A server subprocess on `port`: started and waited for (`GET /health` is 200) on enter,
    stopped with SIGTERM on exit. Its stdout and stderr go to `log`; an early death raises with the
    log's tail. `exit_code` is what it returned to SIGTERM (-9 if it had to be killed)."""

    def __init__(self, argv: list[str], port: int, log: Path, start_timeout_s: float = 600.0,
                 stop_timeout_s: float = 60.0) -> None:
        self.argv, self.port, self.log = argv, port, Path(log)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.ready_s: float | None = None  # seconds from launch to the first healthy answer

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {self.proc.returncode}; the end of its log "
                               f"({self.log}):\n{self.tail()}")

    def __enter__(self) -> ServeProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        launched = time.monotonic()
        while not self._healthy():
            try:
                self.check_alive()
            except RuntimeError:
                self.proc = None
                raise
            if time.monotonic() - launched > self.start_timeout_s:
                self.stop()
                raise RuntimeError(f"the server was not healthy within {self.start_timeout_s:.0f} s; the end of "
                                   f"its log ({self.log}):\n{self.tail()}")
            time.sleep(0.25)
        self.ready_s = time.monotonic() - launched
        return self

    def model_id(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as resp:
            return json.load(resp)["data"][0]["id"]

    def stop(self) -> int | None:
        """SIGTERM, and wait; kill after `stop_timeout_s`."""
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __exit__(self, *exc) -> None:
        self.stop()


# One arm, and the bench.


@dataclass
class ArmRun:
    arm: str
    rates: list[dict] = field(default_factory=list)  # one serving_metrics row per rate, then its step columns
    windows: dict[float, tuple[float, float]] = field(default_factory=dict)
    steps: pd.DataFrame | None = None  # the step log inside the windows
    server_exit: int | None = None
    ready_s: float | None = None


def run_arm(arm: str, model: str, device: str, vocab_size: int, rates: Sequence[float], max_rate: float,
            workload: Workload, slo: SLO, *, seed: int = 0, dtype: str = "auto", read: str = "auto",
            max_num_seqs: int = 64, max_model_len: int | None = None, warmup: int = 8,
            max_num_batched_tokens: int | None = None, start_timeout_s: float = 600.0, workdir: Path | None = None,
            log: Callable[[str], None] = print, command: Callable[..., list[str]] = serve_command) -> ArmRun:
    """Serve `model` in one arm and send every rate of `rate_schedule(rates, max_rate)` until a rate
    beyond the listed ones saturates. `warmup` requests (all at once, outside every window) go
    first, so first-use costs fall outside the measured rates. `command` builds the server's argv
    (`serve_command`'s signature; tests start a stand-in)."""
    mode, prefill = split_arm(arm)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="graphbench-"))
    step_log = workdir / f"steps_{arm}.jsonl"
    port = free_port()
    extra = {} if prefill is None else {"chunked_prefill": prefill != "whole"}
    if prefill == "compiled":
        extra["compile_varlen"] = True
    if max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = max_num_batched_tokens
    argv = command(model, port, device=device, eager=mode == "eager", step_log=step_log, dtype=dtype, read=read,
                   max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   max_waiting=max(1024, workload.max_requests + warmup), **extra)
    out = ArmRun(arm)
    with ServeProcess(argv, port, workdir / f"server_{arm}.log", start_timeout_s) as server:
        out.ready_s = server.ready_s
        log(f"{arm}: server ready in {server.ready_s:.1f} s ({' '.join(argv[1:])})")
        served = server.model_id()
        if warmup:
            plan = [replace(r, arrival_s=0.0) for r in request_plan(1000.0, warmup, vocab_size, workload, seed)]
            run_plan(server.url, served, plan)
        for rate in rate_schedule(rates, max_rate):
            plan = request_plan(rate, workload.requests_at(rate), vocab_size, workload, seed)
            run = run_plan(server.url, served, plan)
            server.check_alive()
            m = {"arm": arm, "prefill": prefill or "default", "rate": rate, **serving_metrics(run, slo)}
            out.rates.append(m)
            out.windows[rate] = run.window
            log(f"{arm:>6} {rate:5g} req/s: {m['completed']}/{m['requests']} in {m['duration_s']:.1f} s, "
                f"ITL p50 {m['itl_p50_ms']:.2f} ms p99 {m['itl_p99_ms']:.2f} ms, TTFT p50 {m['ttft_p50_ms']:.0f} ms, "
                f"{m['output_throughput']:.0f} tok/s, sustained {m['sustained_req_s']:.2f} of "
                f"{m['offered_req_s']:.2f} req/s offered{'  SATURATED' if m['saturated'] else ''}")
            if m["saturated"] and rate >= max(rates):
                break
    out.server_exit = server.exit_code
    if server.exit_code != 0:
        log(f"{arm}: the server exited with {server.exit_code} on SIGTERM; the end of its log:\n{server.tail()}")
    out.steps = slice_steps(read_step_log(step_log), out.windows).assign(arm=arm)
    graphed = mode == "graphs" and device.startswith("cuda")
    for m in out.rates:
        m.update(step_columns(out.steps[out.steps.rate == m["rate"]], graphed, capture_batch_sizes(max_num_seqs)),
                 server_exit=out.server_exit, server_ready_s=out.ready_s)
    return out


def step_columns(window: pd.DataFrame, graphed: bool, batch_sizes: Sequence[int]) -> dict:
    """What the step log says about one rate's window: step counts, the token-weighted median live
    rows, the batch a step of that many rows runs at (its bucket when `graphed`), the server's own
    median decode, prefill and mixed (prompt chunks beside decode rows) step times, and the mean
    padding share of its decode steps."""
    nan = float("nan")
    decode, prefill = window[window.phase == "decode"], window[window.phase == "prefill"]
    mixed = window[window.phase == "mixed"]
    median = weighted_median_rows(decode)
    batch = nan
    if median == median:  # not NaN: the window has decode steps
        batch = smallest_bucket(int(median), batch_sizes) if graphed else int(median)
    return dict(decode_steps=len(decode), prefill_steps=len(prefill), median_rows=median, step_batch=batch,
                server_step_p50_ms=float(decode.ms.median()) if len(decode) else nan,
                prefill_p50_ms=float(prefill.ms.median()) if len(prefill) else nan,
                mixed_steps=len(mixed), mixed_p50_ms=float(mixed.ms.median()) if len(mixed) else nan,
                padding_share=float(decode.padding_share.mean()) if len(decode) else nan,
                graphed_share=float(decode.graph.astype(bool).mean()) if len(decode) else nan)


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode buckets' batch axis a CUDA server captures: powers of two up to its row limit,
    64 at most (`ModelRunner`'s default list)."""
    return DecodeBuckets.default(min(max_num_seqs, 64)).batch_sizes


def time_offline(model: str, device: str, arm: str, batches: Sequence[int], context: int, *, dtype: str = "auto",
                 read: str = "auto", max_num_seqs: int = 64, steps: int = 32, repeats: int = 3,
                 vocab_size: int | None = None) -> pd.DataFrame:
    """Decode steps of `LLM(model)` in-process (graphs as in `arm`) at each batch in `batches`,
    the history at the middle timed step `context` tokens long: `repeats` runs of `steps` steps
    after one warm-up run, each step between its own syncs (`timing.timed_steps`). `ms_p50` is the
    median step, the number ITL p50 is held against; `ms_mean` the mean."""
    import statistics

    import torch

    from nanolab import LLM
    from nanolab.lab.timing import drain, prefill, random_prompts, timed_steps

    # Whole prompts: every row of a timed batch starts decoding in the same step (`timing.prefill`).
    llm = LLM(model, device=device, dtype=dtype, enforce_eager=split_arm(arm)[0] == "eager", read=read,
              max_num_seqs=max(max_num_seqs, *batches), enable_chunked_prefill=False)
    vocab = vocab_size or llm.config.vocab_size
    prompt_len = max(1, context - steps // 2)
    records = []
    for batch in sorted(set(int(b) for b in batches)):
        prompts = random_prompts(batch, prompt_len, vocab)
        times = []
        for run in range(repeats + 1):
            seqs = prefill(llm.engine, prompts, steps + 2)
            timed = timed_steps(llm.engine, steps)
            drain(llm.engine)  # with asynchronous scheduling the last step is still in flight
            assert all(s.finished for s in seqs), "a timed request outlived its steps"
            times += timed if run else []  # the first run warms up
        records.append({"arm": arm, "batch": batch, "context": context, "steps": steps * repeats,
                        "ms_p50": 1000 * statistics.median(times), "ms_mean": 1000 * statistics.fmean(times)})
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return pd.DataFrame(records)


@dataclass(frozen=True)
class GraphBench:
    rates: pd.DataFrame  # one row per (arm, rate): serving_metrics, compaction and the step batch
    steps: pd.DataFrame  # step_summary of every window
    trace: pd.DataFrame  # one window's steps per arm, step by step: the compaction figure's data
    offline: pd.DataFrame  # arm, batch, context, steps, ms_p50, ms_mean: decode steps in-process

    def tables(self, prefix: str = "day58") -> dict[str, pd.DataFrame]:
        """The tables by the names they are saved under."""
        return dict(zip(graphbench_stems(prefix), (self.rates, self.steps, self.trace, self.offline), strict=True))


def graphbench_stems(prefix: str = "day58") -> tuple[str, ...]:
    """The names `GraphBench.tables` saves under, in its order."""
    return tuple(f"{prefix}_{name}" for name in ("graphbench", "steps", "trace", "offline"))


def trace_window(arm: ArmRun, max_steps: int) -> pd.DataFrame:
    """The steps of the arm's busiest sustainable rate (the most decode rows at the median), its
    last `max_steps`: the batch at load, then draining as requests finish at their own lengths."""
    rates = pd.DataFrame(arm.rates)
    ok = rates[~rates.saturated] if (~rates.saturated).any() else rates
    rate = float(ok.loc[ok.median_rows.fillna(0).idxmax(), "rate"])
    part = arm.steps[arm.steps.rate == rate]
    return part.tail(max_steps).reset_index(drop=True)


def run_graphbench(model: str, device: str, arms: Sequence[str] = ARMS, rates: Sequence[float] = SEED_RATES,
                   max_rate: float = 256.0, workload: Workload | None = None, slo: SLO | None = None, *,
                   seed: int = 0, dtype: str = "auto", read: str = "auto", max_num_seqs: int = 64,
                   max_model_len: int | None = None, warmup: int = 8, offline: bool = True,
                   max_num_batched_tokens: int | None = None,
                   offline_steps: int = 32, offline_repeats: int = 3, trace_steps: int = 800,
                   start_timeout_s: float = 600.0, log: Callable[[str], None] = print) -> GraphBench:
    """Both arms through the real server, then the offline step at each rate's batch. `workload`
    and `slo` default to the device's (`WORKLOADS`, `SLOS`); `max_num_batched_tokens`, every
    server's token budget a step (None: the server's default, `SERVER_TOKEN_BUDGET`)."""
    from nanolab.model.config import ModelConfig
    from nanolab.model.weights import resolve_weights

    kind = "cuda" if device.startswith("cuda") else "cpu"
    if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool)
                                               or not isinstance(max_num_batched_tokens, int)
                                               or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}: must be a positive int")
    modes = [split_arm(arm)[0] for arm in arms]  # an unknown arm fails here, before any server starts
    if kind == "cpu" and "graphs" in modes:
        raise ValueError("a CPU has no CUDA graphs: run the eager arm alone (arms=('eager',))")
    workload, slo = workload or WORKLOADS[kind], slo or SLOS[kind]
    vocab = ModelConfig.from_dir(resolve_weights(model)).vocab_size  # prepared here, once, outside any server start
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="graphbench-") as workdir:
        for arm in arms:
            runs.append(run_arm(arm, model, device, vocab, rates, max_rate, workload, slo, seed=seed, dtype=dtype,
                                read=read, max_num_seqs=max_num_seqs, max_model_len=max_model_len, warmup=warmup,
                                max_num_batched_tokens=max_num_batched_tokens, start_timeout_s=start_timeout_s,
                                workdir=Path(workdir), log=log))
    rows = [m for run in runs for m in run.rates]
    table = pd.DataFrame(rows)
    context = int(sum(workload.prompt_len) / 2 + workload.mean_output / 2)
    table = table.assign(prompt_lo=workload.prompt_len[0], prompt_hi=workload.prompt_len[1],
                         output_lo=workload.output_len[0], output_hi=workload.output_len[1],
                         slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms, slo_e2el_ms=slo.e2el_ms, seed=seed,
                         max_num_seqs=max_num_seqs, offline_context=context)
    # a chunked arm's tokens a step; a whole-prompt arm's cap on the prompts one step admits
    table["token_budget"] = max_num_batched_tokens or SERVER_TOKEN_BUDGET
    offline_tables = []
    if offline:
        for arm in arms:
            batches = table[table.arm == arm].step_batch.dropna().astype(int).unique()
            batches = [b for b in batches if b >= 1]
            if batches:
                log(f"{arm}: timing decode steps in-process at batch {', '.join(map(str, sorted(batches)))}")
                offline_tables.append(time_offline(model, device, arm, batches, context, dtype=dtype, read=read,
                                                   max_num_seqs=max_num_seqs, steps=offline_steps,
                                                   repeats=offline_repeats, vocab_size=vocab))
    off = pd.concat(offline_tables, ignore_index=True) if offline_tables else pd.DataFrame(
        columns=["arm", "batch", "context", "steps", "ms_p50", "ms_mean"])
    log(f"graphbench: {time.monotonic() - started:.0f} s in all")
    all_steps = pd.concat([run.steps for run in runs], ignore_index=True)
    trace = pd.concat([trace_window(run, trace_steps) for run in runs], ignore_index=True)
    trace = trace[["arm", "rate", "t_s", "phase", "rows", "batch", "graph", "tokens", "ms", "padding_share"]]
    return GraphBench(table, step_summary(all_steps), trace, off)


def graphbench_ratios(rates: pd.DataFrame, offline: pd.DataFrame, seed_rates: Sequence[float] = SEED_RATES
                      ) -> pd.DataFrame:
    """The chapter's three ratios, each with its aim, whether it is met, and the numbers behind it:

    - at each seed rate, eager ITL p50 over graphs ITL p50 (aim: 3x or more);
    - per arm and rate, ITL p50 over the offline median step at the same batch, minus 1: what the
      server adds (aim: 10% or less). The detail splits it at the server's own median step (the
      step log's): the engine step inside the server, then the path from step to client;
    - per arm, ITL p99 over p50 at its highest sustainable rate (aim: 3x or less);
    - at each rate both ran, ITL p99 of an arm's whole-prompt server over its chunked one (aim:
      above 1, chunking shortens the tail)."""
    records = []
    by = rates.set_index(["arm", "rate"])
    arms = rates.arm.unique()
    if {"graphs", "eager"} <= set(arms):
        for rate in seed_rates:
            if ("graphs", rate) in by.index and ("eager", rate) in by.index:
                eager, graphs = by.loc[("eager", rate), "itl_p50_ms"], by.loc[("graphs", rate), "itl_p50_ms"]
                records.append({"ratio": "eager / graphs ITL p50", "arm": "both", "rate": rate,
                                "value": eager / graphs, "aim": ">= 3", "met": eager / graphs >= 3,
                                "detail": f"ITL p50 {eager:.2f} ms eager, {graphs:.2f} ms graphs"})
    off = offline.set_index(["arm", "batch"]).ms_p50 if len(offline) else pd.Series(dtype=float)
    for (arm, rate), row in by.iterrows():
        if row.step_batch == row.step_batch and (arm, int(row.step_batch)) in off.index:
            step = off[arm, int(row.step_batch)]
            value = row.itl_p50_ms / step - 1
            detail = f"ITL p50 {row.itl_p50_ms:.2f} ms, offline step {step:.2f} ms"
            if "server_step_p50_ms" in row and row.server_step_p50_ms == row.server_step_p50_ms:
                detail += (f"; the server's step {row.server_step_p50_ms:.2f} ms "
                           f"({row.server_step_p50_ms / step - 1:+.0%} on offline, ITL "
                           f"{row.itl_p50_ms / row.server_step_p50_ms - 1:+.0%} on it)")
            records.append({"ratio": f"ITL p50 / offline step at batch {int(row.step_batch)} - 1", "arm": arm,
                            "rate": rate, "value": value, "aim": "<= 0.10", "met": value <= 0.10, "detail": detail})
    for arm in arms:
        part = rates[(rates.arm == arm) & ~rates.saturated.astype(bool)]
        if len(part):
            row = part.loc[part.rate.idxmax()]
            value = row.itl_p99_ms / row.itl_p50_ms
            detail = f"ITL p99 {row.itl_p99_ms:.2f} ms, p50 {row.itl_p50_ms:.2f} ms"
            prefill_ms = row.get("prefill_p50_ms", float("nan"))
            if prefill_ms == prefill_ms:  # the tail's usual cause: decode steps that waited behind a prefill
                detail += (f"; {int(row.prefill_steps)} prefill steps among {int(row.decode_steps)} decode steps, "
                           f"{prefill_ms:.2f} ms at the median")
            mixed_ms = row.get("mixed_p50_ms", float("nan"))
            if mixed_ms == mixed_ms:
                detail += f"; {int(row.mixed_steps)} mixed steps, {mixed_ms:.2f} ms at the median"
            records.append({"ratio": "ITL p99 / p50 at the highest sustainable rate", "arm": arm, "rate": row.rate,
                            "value": value, "aim": "<= 3", "met": value <= 3, "detail": detail})
    for mode in ARMS:
        for rate in rates.rate.unique():
            whole, chunked = (f"{mode}-whole", rate), (f"{mode}-chunked", rate)
            if whole in by.index and chunked in by.index:
                w, c = by.loc[whole, "itl_p99_ms"], by.loc[chunked, "itl_p99_ms"]
                records.append({"ratio": "whole / chunked ITL p99", "arm": mode, "rate": rate, "value": w / c,
                                "aim": "> 1", "met": w / c > 1,
                                "detail": f"ITL p99 {w:.2f} ms whole prompts, {c:.2f} ms chunked"})
    return pd.DataFrame(records, columns=["ratio", "arm", "rate", "value", "aim", "met", "detail"])


# The command line.


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda, cpu = WORKLOADS["cuda"], WORKLOADS["cpu"]
    per_device = lambda f: f"(default: {f(cuda)} on CUDA, {f(cpu)} on a CPU)"
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--read", default="auto", help="the decode read: auto, streamed or reference")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms: graphs (CUDA graphs), eager (--enforce-eager), either "
                             "ending in -chunked or -whole to serve with or without chunked prefill, e.g. "
                             "graphs-chunked,graphs-whole (default: graphs,eager on CUDA, eager on a CPU)")
    parser.add_argument("--rates", default="1,2,4,8", help="requests/s always run, in order (default: the seed's)")
    parser.add_argument("--max-rate", type=float, default=256.0,
                        help="after --rates, the rate doubles until it saturates or passes this (default: 256)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of arrivals a rate " + per_device(lambda w: w.duration_s))
    parser.add_argument("--min-requests", type=int, default=None,
                        help="requests at least, a rate " + per_device(lambda w: w.min_requests))
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests at most, a rate " + per_device(lambda w: w.max_requests))
    parser.add_argument("--prompt-len", type=_pair, default=None,
                        help="lo,hi: prompt tokens, uniform " + per_device(lambda w: ",".join(map(str, w.prompt_len))))
    parser.add_argument("--output-len", type=_pair, default=None,
                        help="lo,hi: new tokens, uniform " + per_device(lambda w: ",".join(map(str, w.output_len))))
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput's TTFT level; giving any --slo-* replaces the device's SLO "
                             f"(default: {SLOS['cuda'].ttft_ms:g} on CUDA, {SLOS['cpu'].ttft_ms:g} on a CPU)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help=f"goodput's TPOT level (default: {SLOS['cuda'].tpot_ms:g} on CUDA, "
                             f"{SLOS['cpu'].tpot_ms:g} on a CPU)")
    parser.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput's end-to-end level (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompt ids")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the server's running-request limit")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="every server's token budget a step: chunks with chunked prefill, whole prompts "
                             "without (default: the server's)")
    parser.add_argument("--warmup", type=int, default=8, help="requests sent at once before the first rate")
    parser.add_argument("--offline-steps", type=int, default=32, help="decode steps timed in-process per batch")
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--no-offline", action="store_true",
                        help="skip the in-process step timing (and so the server-overhead ratio)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--prefix", default="day58", help="tables go to data/<prefix>_graphbench_<device>.csv, ...")


def main(args: argparse.Namespace) -> int:
    import torch

    from nanolab.lab.plots.serving import plot_graphbench, plot_row_compaction
    from nanolab.lab.report import run_label, save_figure, save_table
    from nanolab.llm import resolve_device, resolve_dtype
    from nanolab.model.weights import resolve_weights, weights_kind

    try:
        device = str(resolve_device(args.device))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = "cuda" if device.startswith("cuda") else "cpu"
    arms = tuple(args.arms.split(",")) if args.arms else (ARMS if kind == "cuda" else ("eager",))
    base = WORKLOADS[kind]
    workload = Workload(args.prompt_len or base.prompt_len, args.output_len or base.output_len,
                        args.duration or base.duration_s, args.min_requests or base.min_requests,
                        args.max_requests or base.max_requests)
    given = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    slo = SLO(*given) if any(v is not None for v in given) else SLOS[kind]
    try:
        bench = run_graphbench(args.model, device, arms, [float(r) for r in args.rates.split(",")], args.max_rate,
                               workload, slo, seed=args.seed, dtype=args.dtype, read=args.read,
                               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, warmup=args.warmup,
                               offline_steps=args.offline_steps, offline_repeats=args.offline_repeats,
                               start_timeout_s=args.start_timeout, offline=not args.no_offline,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = resolve_weights(args.model)
    label = run_label(torch.device(device), args.model, resolve_dtype(args.dtype, torch.device(device)),
                      weights=weights_kind(path))
    for name, table in bench.tables(args.prefix).items():
        print(f"{name}: {save_table(table, name, label)}")
    cols = ["arm", "prefill", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tpot_p50_ms",
            "request_throughput", "output_throughput", "goodput", "median_rows", "step_batch", "saturated"]
    print(bench.rates[cols].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(bench.offline.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(graphbench_ratios(bench.rates, bench.offline).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(save_figure(plot_graphbench(bench.rates), f"{args.prefix}_graphbench", label))
    print(save_figure(plot_row_compaction(bench.trace, capture_batch_sizes(args.max_num_seqs)),
                      f"{args.prefix}_row_compaction", label))
    gates = [check_requests(bench.rates)]
    for arm in arms:
        expect = (split_arm(arm)[0] == "graphs") if kind == "cuda" else False
        gates.append(check_compaction(bench.steps[bench.steps.arm == arm], capture_batch_sizes(args.max_num_seqs),
                                      expect))
    print("\n".join(f"{g}" for g in gates))
    print(label.caption())
    return 0 if all(gates) else 1
