"""The numbers a server reports, counted where they happen (vLLM's `v1/metrics/stats.py`):
`SchedulerStats`, the engine core's state after a step, which the core sends beside the step's
tokens; and `IterationStats`, what one message of the core's gave its requests, timed on the event
loop as it arrives. Plain Python: the Prometheus side is the server's
(`nanolab.entrypoints.openai.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from nanolab.engine.llm_engine import Engine


class SchedulerStats(NamedTuple):
    """The engine core's state after its last step (vLLM's `SchedulerStats`). The prefix-cache
    counts run from the engine's start and count tokens, as vLLM v1's do."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_blocks: int  # held by a block table
    num_free_blocks: int  # held by none, cached ones (evictable) included: what an allocation can take
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int  # of those, tokens found cached
    # Speculative decoding, from the engine's start: verify steps, drafts proposed, drafts kept.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the pool's blocks held, 0 to 1 (vLLM's `kv_cache_usage`)."""
        return self.num_used_blocks / (self.num_used_blocks + self.num_free_blocks)


def scheduler_stats(engine: Engine) -> tuple[int, ...]:
    """`engine`'s `SchedulerStats` fields, as the plain tuple the core sends after every step (a
    tuple of ints pickles in a few bytes)."""
    scheduler, allocator = engine.scheduler, engine.block_manager.allocator
    return (len(scheduler.running), len(scheduler.waiting), allocator.num_used, allocator.num_free,
            scheduler.prefix_cache_queries, scheduler.prefix_cache_hits, engine.spec_steps,
            engine.spec_draft_tokens, engine.spec_accepted_tokens)


@dataclass(slots=True)
class RequestStateStats:
    """One request's times on the event loop, `time.monotonic()` seconds (vLLM's
    `RequestStateStats`): when it was added, and when its last token arrived (None before its first)."""

    arrival_time: float
    last_token_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """What one message of the engine core's gave its requests, timed at `now`, when the message
    reached the event loop (vLLM's `IterationStats`). A prompt counts once its first token arrives;
    latencies are in seconds."""

    now: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)  # one per request that ended
    finished_reasons: list[str] = field(default_factory=list)  # the same requests' finish reasons

    def update_from_output(self, req: RequestStateStats, prompt_len: int, token_id: int | None,
                           finish_reason: str | None) -> None:
        """Count one of a request's tokens in the message (or its end), and move its
        `last_token_time` to `now`. A request's later tokens in the same message (drafts a verify
        step kept) add no inter-token gap, as vLLM counts one a request an output."""
        if token_id is not None:
            self.num_generation_tokens += 1
            if req.last_token_time is None:
                self.num_prompt_tokens += prompt_len
                self.time_to_first_tokens.append(self.now - req.arrival_time)
            elif req.last_token_time != self.now:
                self.inter_token_latencies.append(self.now - req.last_token_time)
            req.last_token_time = self.now
        if finish_reason is not None:
            self.e2e_latencies.append(self.now - req.arrival_time)
            self.finished_reasons.append(finish_reason)
