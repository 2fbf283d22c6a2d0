"""`GET /metrics`: the server's numbers in Prometheus' text format, named as vLLM names them with
`vllm:` made `nanolab:`, each series labelled with the served `model_name`.

Two sources, each read where it lives:
- the engine core's state, the `SchedulerStats` its last message carried (`AsyncLLM.scheduler_stats`),
  is read when Prometheus scrapes: requests running and waiting, KV blocks used and free, the
  pool's usage, the prefix cache's cumulative queries and hits, in tokens, and speculative
  decoding's cumulative verify steps, drafts proposed and drafts kept;
- tokens and latencies are counted on the event loop as each message of the core's arrives
  (`IterationStats`): prompt and generation token counters, ended requests by finish reason, and
  histograms of time to first token, inter-token latency and end-to-end request latency, in seconds.

Each server has a `CollectorRegistry` of its own, so servers (and tests) in one process never share
a series.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanolab.engine.async_llm import AsyncLLM
from nanolab.engine.stats import IterationStats

# vLLM's bucket bounds, in seconds. Inter-token latency and request latency get finer bounds below
# vLLM's first (10 ms and 300 ms): a decode step of a small model on a GPU takes milliseconds, and a
# short request ends in well under a second.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


# The engine's state, read from `SchedulerStats` at each scrape: (kind, name after "nanolab:", the
# field it reads, help text).
# How a request can end (`Sequence.finish_reason`): a request aborted on the event loop (its client
# left) and the requests a dead core leaves are counted there (`AsyncLLM._end_here`).
FINISH_REASONS = ("stop", "length", "abort", "error")

ENGINE_SERIES = (
    (GaugeMetricFamily, "num_requests_running", "num_running_reqs", "Requests in the running batch."),
    (GaugeMetricFamily, "num_requests_waiting", "num_waiting_reqs", "Requests queued, not yet admitted."),
    (GaugeMetricFamily, "kv_blocks_used", "num_used_blocks", "KV-cache blocks held by requests."),
    (GaugeMetricFamily, "kv_blocks_free", "num_free_blocks",
     "KV-cache blocks held by none, cached (evictable) ones included."),
    (GaugeMetricFamily, "kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks held, from 0 to 1."),
    (CounterMetricFamily, "prefix_cache_queries", "prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache."),
    (CounterMetricFamily, "prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    (CounterMetricFamily, "spec_decode_num_drafts", "spec_decode_num_drafts",
     "Verify steps run by speculative decoding."),
    (CounterMetricFamily, "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    (CounterMetricFamily, "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens kept."),
)


class PrometheusStatLogger:
    """One server's registry (vLLM's `PrometheusStatLogger`): a stat logger of `async_llm` for the
    counters and histograms, and a collector of the registry for the engine's state."""

    def __init__(self, async_llm: AsyncLLM, model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)
        self.counter_prompt_tokens = Counter(
            "nanolab:prompt_tokens", "Prompt tokens, counted at each request's first token.",
            **labels).labels(model_name)
        self.counter_generation_tokens = Counter(
            "nanolab:generation_tokens", "Tokens generated.", **labels).labels(model_name)
        self.histogram_time_to_first_token = Histogram(
            "nanolab:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, **labels).labels(model_name)
        self.histogram_inter_token_latency = Histogram(
            "nanolab:inter_token_latency_seconds", "Seconds between two tokens of a request.",
            buckets=ITL_BUCKETS, **labels).labels(model_name)
        self.histogram_e2e_time_request = Histogram(
            "nanolab:e2e_request_latency_seconds", "Seconds from a request's arrival to its end.",
            buckets=E2E_BUCKETS, **labels).labels(model_name)
        self.counter_request_success = Counter(
            "nanolab:request_success", "Requests the engine ended, by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # each series exists from the start, at 0, as vLLM's do
            self.counter_request_success.labels(model_name, reason)
        self.registry.register(self)
        async_llm.add_stat_logger(self)

    def record(self, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.counter_prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.counter_generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.histogram_time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.histogram_inter_token_latency.observe(itl)
        for e2e in stats.e2e_latencies:
            self.histogram_e2e_time_request.observe(e2e)
        for reason in stats.finished_reasons:
            self.counter_request_success.labels(self.model_name, reason).inc()

    def collect(self):
        """The engine's state as of the core's last message, for the registry at each scrape."""
        s = self.async_llm.scheduler_stats
        for family, name, field, documentation in ENGINE_SERIES:
            yield self._one(family, f"nanolab:{name}", documentation, getattr(s, field))

    def _one(self, family, name: str, documentation: str, value: float):
        metric = family(name, documentation, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric

    async def metrics(self, request: web.Request) -> web.Response:
        # Always the text format: prometheus_client's OpenMetrics output, which a scraper's Accept
        # header may prefer, turns the colons of sample names (not of their families) into underscores.
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
