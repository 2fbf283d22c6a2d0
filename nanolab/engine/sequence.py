"""`Sequence`: one request's tokens and state as the scheduler moves it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nanolab.engine.block_manager import token_span
from nanolab.engine.detokenizer import TextDeltas
from nanolab.sampling import PositionLogprobs, SamplingParams
from nanolab.spec_decode import TokenIndex


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and state. `row` is its cache row while it runs; `num_computed_tokens`
    (vLLM's name) how many of its tokens are in that row's cache, counting the ones this step feeds."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    row: int | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # why the request failed, when finish_reason is "error"
    stop_text_index: int | None = None  # where a matched stop string starts in the output text
    text: TextDeltas | None = None  # the output's text, kept only for a request with stop strings
    stop_scanned: int = 0  # characters of `text` already searched for stop strings
    num_preemptions: int = 0
    # Speculative decoding: drafts proposed for this request and how many were kept; after steps that
    # gave it no draft to keep (no match, or none kept), the engine step from which it looks drafts
    # up again, and the pause's length (`Engine._drafted`).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafts_from_step: int = 0
    draft_backoff: int = 0
    num_computed_tokens: int = 0  # back to 0 when preempted: recomputed from its tokens so far
    # The request queued beside this one with the same prompt (another of a request's n samples):
    # with prefix caching, this one is admitted only once that one's prompt is cached, and shares it.
    parent: Sequence | None = None
    # With params.logprobs, one entry per output token; with params.prompt_logprobs, one per prompt
    # token after the first, filled as the prompt's chunks run.
    output_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs] | None = None
    # Speculative decoding: where each of its token ids occurs, for prompt lookup (made on its first lookup).
    token_index: TokenIndex | None = None
    # The prompt's ids packed as int64 (native order), as the request's check packed them: what the
    # prefix cache keys a new request's blocks from, without packing its thousands of ids again.
    prompt_bytes: bytes | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def span(self, start: int, stop: int) -> list[int]:
        """Tokens start .. stop - 1 of prompt then output, sliced without listing the rest: a step
        feeds a few tokens of a row that may hold thousands."""
        return token_span(self.prompt_token_ids, self.output_token_ids, start, stop)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Every token but the last sampled one is in the cache: its next step feeds that one token."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
