"""Continuous batching: which requests run this step and how many tokens each feeds, admission by
free blocks, preemption.

Requests join and leave between steps. With chunked prefill (`enable_chunked_prefill`, vLLM v1's
rule and the default) a step has a budget of `max_num_batched_tokens` tokens: every running decode
row takes one token first, so a long prompt never stalls a running stream; then a running request
whose prompt is partly in the cache continues with its next chunk; then waiting requests are
admitted with a chunk that fits what is left. A request is sampled only in the step that feeds its
last token. Without chunked prefill a step is either a prefill of whole prompts of newly admitted
requests or one decode token for every running request (the engine before chunking).

When a decode row needs a block the pool does not have, the most recently admitted request is
preempted: its row and blocks go back to the pool and it waits at the front of the queue to be
recomputed from its tokens so far (vLLM's recompute preemption).

With prefix caching (the block manager's), an admitted request starts after the cached full blocks
of its prefix, shared with whoever else holds them; admission counts only the blocks it adds, the
shared blocks a running request holds already taking nothing more from the pool.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step (vLLM's name): the sequences in forward order and, for each, the tokens it feeds
    (`num_scheduled_tokens`), the tokens it had in the cache before (`num_computed_tokens`), whether
    it is a decode row (its one pending sampled token) and whether it is sampled after this step
    (its last token is fed)."""

    seqs: list[Sequence]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    decode: list[bool]
    sampled: list[bool]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row: the step can run as a planned (and graphed) decode."""
        return all(self.decode)

    @property
    def phase(self) -> str:
        """"decode" (every row a decode row), "prefill" (none) or "mixed"."""
        if all(self.decode):
            return "decode"
        return "mixed" if any(self.decode) else "prefill"


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True) -> None:
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at admission, and those found (vLLM's counters).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The last `_cached_prefix`: (request, (the allocator's key epoch, its tokens), what it found).
        self._prefix_memo: tuple | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step. Every scheduled sequence's `num_computed_tokens` already counts the tokens
        it feeds (as vLLM v1 advances it when it schedules): the step runs them or ends them."""
        if self.enable_chunked_prefill:
            scheduled = self._schedule_chunked()
        else:
            seqs = self._admit() or self._make_room_for_decode()
            scheduled = {s: s.num_tokens - s.num_computed_tokens for s in seqs}
        seqs, counts = list(scheduled), list(scheduled.values())
        computed = [s.num_computed_tokens for s in seqs]
        decode = [s.is_decoding for s in seqs]
        sampled = [c + n == s.num_tokens for s, c, n in zip(seqs, computed, counts, strict=True)]
        for seq, n in zip(seqs, counts, strict=True):
            seq.num_computed_tokens += n
        return SchedulerOutput(seqs, counts, computed, decode, sampled)

    # Chunked prefill.

    def _schedule_chunked(self) -> dict[Sequence, int]:
        """Tokens per sequence under the budget, in forward order: decode rows, then the next chunk
        of each running prompt, then admissions (`_admits`)."""
        budget = self.max_num_batched_tokens
        block = self.blocks.block_size
        scheduled: dict[Sequence, int] = {}
        taken = 0  # blocks this step's tokens will take from the pool when the runner plans them
        for seq in list(self.running):  # decode rows, oldest first
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue  # preempted by an older row of this loop, or mid-prefill
            table = self.blocks.table(seq.row)
            while table.blocks_needed(1) > self.blocks.allocator.num_free - taken:
                # The newest is never a row scheduled already: this loop goes oldest first.
                self.preempt(self.running[-1])
                if seq.status is not SequenceStatus.RUNNING:
                    break
            else:
                taken += table.blocks_needed(1)
                scheduled[seq] = 1
                budget -= 1
        for seq in self.running:  # prompts partly in the cache, oldest first
            if budget == 0:
                break
            if seq in scheduled or seq.is_decoding:
                continue
            table = self.blocks.table(seq.row)
            room = (len(table.blocks) + self.blocks.allocator.num_free - taken) * block - table.num_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, room)
            if n > 0:  # else it waits for a decode row's preemption or finish to free blocks
                taken += table.blocks_needed(n)
                scheduled[seq] = n
                budget -= n
        while budget > 0 and self.blocks.free_row_count() > 0:
            seq = self._next_waiting()
            if seq is None:
                break
            prefix = self._cached_prefix(seq)
            if not self._admits(seq, prefix[0]):
                break
            self.waiting.remove(seq)
            self._open_row(seq, prefix)
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.blocks.table(seq.row).blocks_needed(n)
            assert need <= self.blocks.allocator.num_free - taken, "admission promised these blocks"
            taken += need
            scheduled[seq] = n
            budget -= n
        return scheduled

    def _admits(self, seq: Sequence, prefix: list[int]) -> bool:
        """Whether the pool can promise `seq` all its tokens and one more while every running
        sequence keeps the same promise, cdiv(num_tokens + 1, block_size) blocks each: the blocks
        held now, what each running sequence's promise needs beyond the blocks it holds, and the
        blocks `seq` needs beyond those of its cached `prefix` that are held already (shared, they
        take nothing from the pool; a cached block no table holds is taken from the free ones) fit
        the pool. Blocks are taken a chunk at a time, but a prompt is admitted only when it can
        finish, and the step after an admission never has to preempt: each running sequence then
        holds at most its promise."""
        block, allocator = self.blocks.block_size, self.blocks.allocator
        beyond = sum(max(0, cdiv(s.num_tokens + 1, block) - len(self.blocks.table(s.row).blocks))
                     for s in self.running)
        return allocator.num_used + beyond + self._new_blocks(seq, prefix) <= self.blocks.num_blocks

    def _new_blocks(self, seq: Sequence, prefix: list[int]) -> int:
        """Blocks the pool gives `seq` for all its tokens and one more, admitted with the cached
        `prefix` (`_cached_prefix`): all but the prefix's blocks some table holds already."""
        shared = sum(1 for b in prefix if self.blocks.allocator.refs(b))
        return cdiv(seq.num_tokens + 1, self.blocks.block_size) - shared

    # Whole prompts (enable_chunked_prefill=False).

    def _admit(self) -> list[Sequence]:
        """Admit waiting requests while rows, the token budget and free blocks allow. Blocks are
        kept back for the decode step that follows, one for every row (running or admitted)
        whose table is full, so an admission never forces that step to preempt."""
        batch: list[Sequence] = []
        tokens = 0
        free = self.blocks.allocator.num_free
        spare = sum(self.blocks.table(s.row).blocks_needed(1) for s in self.running)
        while self.blocks.free_row_count() > 0:
            seq = self._next_waiting()
            if seq is None:
                break
            if batch and tokens + seq.num_tokens > self.max_num_batched_tokens:
                break
            prefix = self._cached_prefix(seq)
            need = self._new_blocks(seq, prefix[0])  # the prompt and one more token, less what it shares
            if free - need < spare:
                break
            self.waiting.remove(seq)
            self._open_row(seq, prefix)
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

    def _next_waiting(self) -> Sequence | None:
        """The first waiting request not held back: with prefix caching, a request whose `parent`
        (another sample of the same prompt) has not yet run its prompt waits for it, so that the
        prompt's blocks are computed once and shared; those behind it may go first. A sample that
        would share nothing goes at once: one that wants its prompt's logprobs (it computes every
        prompt token), or one whose prompt fills no block before its last token."""
        block = self.blocks.block_size
        for seq in self.waiting:
            parent = seq.parent
            if (parent is None or not self.blocks.enable_prefix_caching or parent.finished
                    or parent.output_token_ids or seq.params.prompt_logprobs is not None
                    or (len(seq.prompt_token_ids) - 1) // block == 0):
                return seq
        return None

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """The cached full blocks (and their keys) `seq` would start after if admitted now: none
        without prefix caching, nor for a request that wants its prompt's logprobs, which need the
        logits of every prompt token. A request back from preemption may find its output's blocks
        too; a new one has only its prompt."""
        if not self.blocks.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return [], []
        # A request left waiting (the pool full) is looked up again at every step; its blocks and
        # keys change only when a key is added or evicted, so one lookup serves until then.
        epoch = self.blocks.allocator.key_epoch
        memo = self._prefix_memo
        if memo is not None and memo[0] is seq and memo[1] == (epoch, seq.num_tokens):
            return memo[2]
        found = self.blocks.cached_prefix(
            seq.prompt_bytes if seq.prompt_bytes is not None and not seq.output_token_ids else seq.token_ids)
        self._prefix_memo = (seq, (epoch, seq.num_tokens), found)
        return found

    def _open_row(self, seq: Sequence, prefix: tuple[list[int], list[bytes]]) -> None:
        """Give an admitted request its row, starting after `prefix`, its `_cached_prefix` looked up
        at admission, shared: those tokens count as computed."""
        seq.row = self.blocks.open_row()
        seq.status = SequenceStatus.RUNNING
        if not self.blocks.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        blocks, keys = prefix
        self._prefix_memo = None
        self.prefix_cache_queries += seq.num_tokens
        if blocks:
            self.blocks.share_prefix(seq.row, blocks, keys)
            seq.num_computed_tokens = len(blocks) * self.blocks.block_size
            self.prefix_cache_hits += seq.num_computed_tokens

    # Leaving.

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is (running, or back in the queue after a preemption); its row and
        blocks return to the pool."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        """End a request wherever it is; its blocks return to the pool."""
        if seq.status is not SequenceStatus.FINISHED:
            self.finish(seq, "abort")

    def _release(self, seq: Sequence) -> None:
        if seq.row is not None:
            self.blocks.free_row(seq.row)
            seq.row = None
        if seq in self.running:
            self.running.remove(seq)
