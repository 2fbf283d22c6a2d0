"""Continuous batching: which requests run this step, admission by free blocks, preemption.

Introduced with the engine core (before Day 49). Requests join and leave between steps. A step
is either a ragged prefill of newly admitted requests or one decode token for every running
request. When a decode step would need more blocks than the pool has free, the most recently
admitted request is preempted: its row and blocks go back to the pool and it waits at the front
of the queue to be recomputed from its tokens so far (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque

from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 8192) -> None:
        self.blocks = blocks
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
        block = self.blocks.block_size
        free = self.blocks.allocator.num_free
        spare = sum(self.blocks.table(s.row).blocks_needed(1) for s in self.running)
        while self.waiting and self.blocks.free_row_count() > 0:
            seq = self.waiting[0]
            need = cdiv(seq.num_tokens, block) + (seq.num_tokens % block == 0)
            if batch and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            if free - need < spare:
                break
            self.waiting.popleft()
            seq.row = self.blocks.open_row()
            seq.status = SequenceStatus.RUNNING
            free -= need
            tokens += seq.num_tokens
            batch.append(seq)
        self.running.extend(batch)
        return batch

    def _make_room_for_decode(self) -> list[Sequence]:
        """Preempt from the newest until every running request can take one more token."""
        while self.running:
            need = sum(self.blocks.table(s.row).blocks_needed(1) for s in self.running)
            if need <= self.blocks.allocator.num_free:
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
            self.blocks.free_row(seq.row)
            seq.row = None
        if seq in self.running:
            self.running.remove(seq)
