"""The scheduler's choices: whom preemption evicts (the most recently admitted), where the evicted
request waits (the front of the queue) and how it comes back (recomputed from all its tokens),
and the admission reserve (admission keeps back a block for every row whose table is full, so
the decode step after an admission never has to preempt).

Driven without a model: `Driver` plans every step on the cache (a varlen or a decode plan, which
grow the tables) and writes zeros for its K/V through the plan's view, and appends a token to
every request sampled, as `Engine.step` would. These choices are the whole-prompt scheduler's
(`enable_chunked_prefill=False`), whose steps are either prefills or decodes; the chunked
scheduler's are in test_chunked_prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache, run_until_done
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.block_manager import cdiv
from nanolab.engine.scheduler import Scheduler
from nanolab.engine.sequence import Sequence, SequenceStatus

BLOCK = 4


class Driver:
    def __init__(self, num_blocks: int, max_rows: int = 8) -> None:
        self.cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BLOCK,
                                max_rows=max_rows)
        self.blocks = self.cache.blocks
        self.scheduler = Scheduler(self.blocks, 8192, enable_chunked_prefill=False)
        self.seqs: list[Sequence] = []
        self.prefilled: list[list[Sequence]] = []  # every prefill batch, in order

    def add(self, prompt_len: int, max_tokens: int = 100) -> Sequence:
        seq = Sequence(len(self.seqs), [7] * prompt_len, SamplingParams(max_tokens=max_tokens))
        self.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], bool, int]:
        """One step: (its batch, whether it was a prefill, how many requests it preempted)."""
        before = self.scheduler.num_preemptions
        out = self.scheduler.schedule()
        seqs, prefill = out.seqs, out.phase == "prefill"
        if seqs:
            rows = [s.row for s in seqs]
            lengths = out.num_scheduled_tokens
            plan = self.cache.plan_varlen(rows, lengths) if prefill else self.cache.plan_decode(rows)
            kv = torch.zeros(1, sum(lengths), 1, 2)
            self.cache.view(plan).write(0, kv, kv)
            if prefill:
                self.prefilled.append(list(seqs))
            for s in seqs:
                s.output_token_ids.append(3)
                if len(s.output_token_ids) >= s.params.max_tokens:
                    self.scheduler.finish(s, "length")
        return seqs, prefill, self.scheduler.num_preemptions - before


def test_preemption_evicts_the_most_recently_admitted_and_requeues_it_first():
    d = Driver(num_blocks=5)
    a, b, c = d.add(3), d.add(3), d.add(3)  # one block each; the second decode needs a new block each
    assert d.step()[:2] == ([a, b, c], True)
    assert d.step()[:2] == ([a, b, c], False)  # token 4 of each fills its block
    late = d.add(2)
    batch, prefill, preempted = d.step()  # three new blocks needed, two free: c, the newest, goes
    assert (batch, prefill, preempted) == ([a, b], False, 1)
    assert c.status is SequenceStatus.WAITING and c.row is None and c.num_preemptions == 1
    assert list(d.scheduler.waiting) == [c, late], "the preempted request must wait ahead of later arrivals"
    assert d.blocks.allocator.num_free == 1
    # free room: c comes back first, recomputed from every token it had (prompt and outputs)
    d.scheduler.abort(a)
    tokens = c.num_tokens  # its prompt and the two tokens it had sampled
    assert tokens == 5
    batch, prefill, _ = d.step()
    assert prefill and batch[0] is c
    assert d.blocks.table(c.row).num_tokens == tokens


def test_preemption_keeps_evicting_from_the_newest():
    d = Driver(num_blocks=7)
    seqs = [d.add(3) for _ in range(4)]  # 4 blocks after prefill, 3 free: each needs one at token 5
    d.step()
    d.step()
    batch, _, preempted = d.step()
    assert preempted == 1 and batch == seqs[:3] and list(d.scheduler.waiting) == [seqs[3]]
    # a readmitted request is the newest again: it is the next to go
    d.scheduler.abort(seqs[0])  # frees 2 blocks
    batch, prefill, _ = d.step()
    assert prefill and batch == [seqs[3]]
    assert d.scheduler.running[-1] is seqs[3]


def test_admission_keeps_a_block_for_every_full_table():
    d = Driver(num_blocks=3)
    a = d.add(4)  # 4 tokens: the prefill fills one block and admission asks for a second for token 5
    d.step()
    assert d.blocks.table(a.row).num_tokens == 4 and d.blocks.allocator.num_free == 2
    b = d.add(7)  # needs 2 blocks: it fits the free count, but then a's next decode could not grow
    batch, prefill, preempted = d.step()
    assert (batch, prefill, preempted) == ([a], False, 0), "admitting b would force the next decode to preempt"
    assert b.status is SequenceStatus.WAITING
    c = d.add(3)
    assert d.scheduler.waiting[0] is b and c in d.scheduler.waiting
    # with a's block taken, one block is left: b (2 blocks) still waits, and c queues behind it
    batch, prefill, _ = d.step()
    assert not prefill and c.status is SequenceStatus.WAITING


OPS = st.lists(st.tuples(st.integers(1, 14), st.integers(1, 20), st.integers(0, 3)), min_size=2, max_size=10)


@settings(max_examples=200, deadline=None)
@given(requests=OPS, num_blocks=st.integers(6, 14), max_rows=st.integers(2, 6))
def test_the_decode_after_an_admission_never_preempts(requests, num_blocks, max_rows):
    """Requests arrive over time on a tight pool. Preemption may happen, but never in the decode
    step that directly follows a prefill: admission kept enough blocks back for it."""
    d = Driver(num_blocks, max_rows)
    pending = [(p, m, at) for p, m, at in requests if cdiv(p + m, BLOCK) <= num_blocks]
    last_prefill = False
    for step in range(5000):
        for p, m, at in pending:
            if at == step:
                d.add(p, m)
        if not d.scheduler.has_unfinished() and step > 3:
            break
        _, prefill, preempted = d.step()
        if last_prefill and not prefill:
            assert preempted == 0, "the decode right after an admission had to preempt"
        last_prefill = prefill
    else:
        pytest.fail("the driver did not drain in 5000 steps")
    assert d.blocks.allocator.num_free == num_blocks and all(t is None for t in d.blocks.tables)


def test_the_engine_preempts_its_newest_request(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=10, block_size=4))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seqs = [engine.add_request([5, 6, 7], params) for _ in range(3)]
    victims = []
    real = engine.scheduler.preempt

    def preempt(seq):
        victims.append((seq, list(engine.scheduler.running)))
        real(seq)

    engine.scheduler.preempt = preempt
    run_until_done(engine)
    assert victims, "the pool was meant to force a preemption"
    for seq, running in victims:
        assert seq is running[-1]
    assert all(len(s.output_token_ids) == 12 for s in seqs)


def test_whole_prompt_admission_fills_the_budget_exactly():
    """Without chunking, prompts are admitted while they fit the token budget, the last one
    exactly: two prompts of 4 under a budget of 8 run in one step."""
    from nanolab.engine.block_manager import BlockManager

    scheduler = Scheduler(BlockManager(16, 4, 4), max_num_batched_tokens=8, enable_chunked_prefill=False)
    a, b = (Sequence(i, [5] * 4, SamplingParams(max_tokens=4)) for i in range(2))
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert out.seqs == [a, b] and out.num_tokens == 8


def test_a_sample_whose_prompt_is_one_block_is_not_held_back_for_its_parent():
    """A prompt of exactly one block shares nothing (its last token is always computed), so its
    sibling is admitted beside its parent, not after it."""
    from nanolab.engine.block_manager import BlockManager

    scheduler = Scheduler(BlockManager(16, 4, 4, enable_prefix_caching=True), max_num_batched_tokens=64)
    parent = Sequence(0, [1, 2, 3, 4], SamplingParams(max_tokens=4))
    child = Sequence(1, [1, 2, 3, 4], SamplingParams(max_tokens=4), parent=parent)
    scheduler.add(parent)
    scheduler.add(child)
    assert scheduler.schedule().seqs == [parent, child]
