"""Continuous batching: which requests run this step, admission by free blocks, preemption.

Introduced with the engine core (before Day 49). Requests join and leave between steps. A step
is either a ragged prefill of newly admitted requests or one decode token for every running
request. When a decode step would need more blocks than the pool has free, the most recently
admitted request is preempted: its row and blocks go back to the pool and it waits at the front
of the queue to be recomputed from its tokens so far (vLLM's recompute preemption).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from nanolab.cache import BatchedPagedKVCache, cdiv
from nanolab.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens and state. `row` is its cache row while it runs."""

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    row: int | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_text_index: int | None = None  # where a matched stop string starts in the output text
    num_preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


class Scheduler:
    def __init__(self, cache: BatchedPagedKVCache, max_num_batched_tokens: int = 8192) -> None:
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next forward, and whether it is a prefill."""
        batch = self._admit()
        if batch:
            return batch, True
        return self._make_room_for_decode(), False

    def _admit(self) -> list[Sequence]:
        """Admit waiting requests while rows, the token budget and free blocks allow. Blocks are
        kept back for the decode step that follows, one for every row (running or admitted)
        whose table is full, so an admission never forces that step to preempt."""
        batch: list[Sequence] = []
        tokens = 0
        block = self.cache.block_size
        free = self.cache.allocator.num_free
        spare = sum(self.cache.table(s.row).blocks_needed(1) for s in self.running)
        while self.waiting and self.cache.free_row_count() > 0:
            seq = self.waiting[0]
            need = cdiv(seq.num_tokens, block) + (seq.num_tokens % block == 0)
            if batch and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if free - need < spare:
                break
            self.waiting.popleft()
            seq.row = self.cache.open_row()
            seq.status = SequenceStatus.RUNNING
            free -= need
            tokens += seq.num_tokens
            batch.append(seq)
        self.running.extend(batch)
        return batch

    def _make_room_for_decode(self) -> list[Sequence]:
        """Preempt from the newest until every running request can take one more token."""
        while self.running:
            need = sum(self.cache.table(s.row).blocks_needed(1) for s in self.running)
            if need <= self.cache.allocator.num_free:
                break
            self.preempt(self.running[-1])
        return list(self.running)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        """End a request wherever it is; its blocks return to the pool."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        elif seq.status is SequenceStatus.RUNNING:
            self.finish(seq, "abort")

    def _release(self, seq: Sequence) -> None:
        if seq.row is not None:
            self.cache.free_row(seq.row)
            seq.row = None
        if seq in self.running:
            self.running.remove(seq)
