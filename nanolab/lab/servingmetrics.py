"""`vllm bench serve`'s numbers for one rate of a plan run, the SLOs goodput counts against, the
saturation test, and the gate that every request completed. Day 58.

- TTFT: first streamed chunk - send time, per request;
- TPOT: (latency - TTFT) / (output tokens - 1), per request, latency being the last chunk's time;
- ITL: the gaps between consecutive streamed chunks, pooled over every request;
- request and output-token throughput: completed requests and their tokens over the rate's
  duration (first send to last response);
- goodput: requests per second that meet every SLO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from nanolab.gates import Gate
from nanolab.lab.loadclient import PlanRun, RequestResult

SATURATION = 0.9  # sustained below this share of the offered rate: the queue grows, the rate is not sustainable
MIN_VERDICT = 4  # fewer requests than this at a rate: no central 80% to measure, no verdict


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


# Interactive chat: the first token within a quarter second, then at least about 67 tokens/s a
# user. On the CPU, within two seconds and about 7 tokens/s.
SLOS = {"cuda": SLO(ttft_ms=250.0, tpot_ms=15.0), "cpu": SLO(ttft_ms=2000.0, tpot_ms=150.0)}


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
            "e2el_p50_ms": _pct(e2el, 50), "e2el_p99_ms": _pct(e2el, 99), "itl_gaps": len(itl),
            **first_ttfts(done)}


def itl_quantiles(run: PlanRun, points: int = 201) -> pd.DataFrame:
    """The inter-token gaps of a rate's completed requests as `points` quantiles (ms), 0% to
    100%: a CDF small enough to commit, where the gaps themselves run to tens of thousands."""
    itl = [g for r in run.results if r.ok for g in r.itl]
    q = np.linspace(0, 100, points)
    values = np.percentile(itl, q) * 1000 if itl else np.full(points, np.nan)
    return pd.DataFrame({"quantile": q / 100, "itl_ms": values, "gaps": len(itl)})


FIRST = 10  # the requests a cold start is judged by


def first_ttfts(done: list) -> dict:
    """The slowest TTFT among the first `FIRST` requests sent, and that over the TTFT median of
    the rest: at a server's first rate, what a cold start costs the requests that meet it."""
    by_send = sorted(done, key=lambda r: r.send_s)
    first, rest = [r.ttft for r in by_send[:FIRST]], [r.ttft for r in by_send[FIRST:]]
    worst = max(first) * 1e3 if first else float("nan")
    steady = _pct(rest, 50)
    return {"first_ttft_max_ms": worst, "first_ttft_x_steady": worst / steady if rest else float("nan")}


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


def median_interval(values, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for the median of `values` (percentiles of the medians of `resamples`
    seeded resamples with replacement): how far the median of so few repeats could move."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return (float("nan"), float("nan"))
    medians = np.median(np.random.default_rng(seed).choice(x, size=(resamples, len(x))), axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
