"""Properties of the paged cache under continuous batching, over random sequences of operations
(add a request, step, abort a request) on a pool small enough that preemption really happens.

Two levels: the scheduler and cache driven by a fake forward that writes random K/V for every
layer (no model), and the real `Engine` on the `tiny` preset. After every operation the pool's
bookkeeping must add up; at the end every block is free and every row closed.
"""

import contextlib
import random

import pytest
import torch
from conftest import load_tiny, make_cache
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.block_manager import cdiv
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.scheduler import Scheduler
from nanolab.engine.sequence import Sequence, SequenceStatus

BLOCK = 4
VOCAB = 512
MAX_STEPS = 5000  # a drain that takes longer than this has livelocked


pytestmark = pytest.mark.usefixtures("one_thread")


def check_pool(cache: KVCache, scheduler: Scheduler, inflight: dict[int, int] | None = None) -> None:
    """The invariants that must hold between any two operations. `inflight`: request id -> the
    tokens a decode step launched and not yet read back (asynchronous scheduling) fed that
    request, which its table already holds: its pending token, and under chained speculation the
    drafts after it."""
    inflight = inflight or {}
    allocator = cache.blocks.allocator
    tables = [t for t in cache.blocks.tables if t is not None]
    owned = [b for t in tables for b in t.blocks]
    for t in tables:
        assert len(t.blocks) == len(set(t.blocks)), "a table holds a block twice"
    holders = {b: owned.count(b) for b in set(owned)}
    if not cache.blocks.enable_prefix_caching:
        assert max(holders.values(), default=1) == 1, "a block is held by two tables without prefix caching"
    assert holders == {b: allocator.refs(b) for b in allocator.held()}, "a reference count is not its holders"
    assert not set(owned) & (set(allocator._free) | set(allocator._cached)), "a held block is also free"
    assert allocator.num_free + allocator.num_used == cache.num_blocks
    assert allocator.num_used == len(holders)
    for t in tables:
        assert len(t.blocks) == cdiv(t.num_tokens, cache.block_size)
    # Rows: open exactly for the running requests.
    open_rows = [r for r, t in enumerate(cache.blocks.tables) if t is not None]
    assert sorted(s.row for s in scheduler.running) == open_rows
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        # The table holds the tokens the sequence has computed: every token but the last sampled one
        # once its prompt is in (a prefill writes the whole sequence and then samples one, a decode
        # writes the previous sample and then samples one), fewer while its prompt is in chunks.
        table = cache.blocks.table(seq.row)
        assert table.num_tokens == seq.num_computed_tokens
        ahead = inflight.get(seq.request_id, 0)  # its in-flight tokens are in the table, not yet in its output
        assert seq.num_computed_tokens == seq.num_tokens - 1 + ahead or not seq.output_token_ids \
            or seq.num_preemptions
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.row is None and seq.num_computed_tokens == 0


def check_drained(cache: KVCache, scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished()
    assert cache.blocks.allocator.num_free == cache.num_blocks and cache.blocks.allocator.num_used == 0
    assert all(t is None for t in cache.blocks.tables)


def fits(prompt_len: int, max_tokens: int, num_blocks: int) -> bool:
    """Engine.validate_request's pool check: the longest the request can grow must fit the pool."""
    return cdiv(prompt_len + max_tokens, BLOCK) <= num_blocks


# Operations: ("add", prompt_len, max_tokens, ignore_eos, n), ("step", n), ("abort", pick). An add
# of n > 1 queues n samples of one prompt together (the later ones wait for the first's prompt).
ADD = st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 48), st.booleans(), st.sampled_from([1, 1, 2, 3]))
STEP = st.tuples(st.just("step"), st.integers(1, 8))
ABORT = st.tuples(st.just("abort"), st.integers(0, 1 << 16))
# A burst of adds first, so several requests grow together and the pool runs out.
OPS = st.builds(lambda first, rest: first + rest, st.lists(ADD, min_size=2, max_size=6),
                st.lists(st.one_of(ADD, STEP, ABORT), max_size=30))


# Level (a): scheduler and cache, no model.

class FakeForward:
    """`Engine.step` with random K/V in place of the model and random tokens in place of sampling.
    It remembers the K it wrote at layer 0 for each token of each running request, to check that
    no request's slots are overwritten by another's."""

    num_layers, kv_heads, head_dim = 2, 2, 4

    def __init__(self, num_blocks: int, max_rows: int, seed: int, budget: int | None = None,
                 prefix_caching: bool = False) -> None:
        """`budget` None: whole prompts; else chunked prefill with that many tokens a step. With
        `prefix_caching`, prompts begin with one of a few shared prefixes."""
        self.cache = make_cache(num_layers=self.num_layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                                num_blocks=num_blocks, block_size=BLOCK, max_rows=max_rows)
        self.cache.blocks.enable_prefix_caching = prefix_caching
        self.scheduler = Scheduler(self.cache.blocks, budget or 8192, enable_chunked_prefill=budget is not None)
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.seqs: list[Sequence] = []
        self.admitted_last = False
        # Blocks a, b, c, d: b follows both a and c, so a key that forgot its parent would share it.
        a, b, c, d = ([self.rng.randrange(VOCAB) for _ in range(BLOCK)] for _ in range(4))
        self.prefixes = [a + b + [1], c + b + [2], a + b + d] if prefix_caching else []

    @classmethod
    def key_of(cls, tokens: list[int]) -> torch.Tensor:
        """The K a token gets at layer 0: a function of the token and every token before it, as a
        model's is (so a block of the same tokens after another prefix holds other K)."""
        return torch.full((cls.kv_heads, cls.head_dim), float(hash(tuple(tokens)) % 1_000_003))

    def add(self, prompt_len: int, max_tokens: int, n: int = 1) -> None:
        head = self.rng.choice(self.prefixes) if self.prefixes else []
        prompt = (head + [self.rng.randrange(VOCAB) for _ in range(prompt_len)])[:max(prompt_len, 1)]
        first = None
        for _ in range(n):  # as `Engine.add_requests` links the samples of one prompt
            seq = Sequence(len(self.seqs), prompt, SamplingParams(max_tokens=max_tokens), parent=first)
            first = first or seq
            self.seqs.append(seq)
            self.scheduler.add(seq)

    def abort(self, pick: int) -> None:
        if self.seqs:
            self.scheduler.abort(self.seqs[pick % len(self.seqs)])

    def step(self) -> None:
        before, waiting = self.scheduler.num_preemptions, {id(s) for s in self.scheduler.waiting}
        out = self.scheduler.schedule()
        # Admission keeps back what the next step needs, shared prefixes counted once: that step
        # never preempts.
        assert not (self.admitted_last and self.scheduler.num_preemptions > before), \
            "the step after an admission had to preempt"
        self.admitted_last = any(id(s) in waiting for s in out.seqs)
        if not out.seqs:
            return
        rows = tuple(s.row for s in out.seqs)
        lengths = out.num_scheduled_tokens
        if out.decode_only:
            view, shape = self.cache.view(self.cache.plan_decode(rows)), (len(rows), 1)
        else:
            view, shape = self.cache.view(self.cache.plan_varlen(rows, lengths, out.sampled)), (1, sum(lengths))
        # Segments in order, each token's K from its sequence up to it (`key_of`).
        k = torch.stack([self.key_of(s.token_ids[:p + 1]) for s, a, n in zip(out.seqs, out.num_computed_tokens,
                                                                               lengths) for p in range(a, a + n)])
        for layer in range(self.num_layers):
            view.write(layer, k.view(*shape, self.kv_heads, self.head_dim), torch.randn(
                *shape, self.kv_heads, self.head_dim, generator=self.gen))
        for s in out.seqs:  # the forward ran: its full blocks may be keyed (`Engine._commit`)
            self.cache.blocks.commit_full_blocks(s.row, s.token_ids)
        for s, due in zip(out.seqs, out.sampled):
            if due:
                s.output_token_ids.append(self.rng.randrange(VOCAB))
                if len(s.output_token_ids) >= s.params.max_tokens:
                    self.scheduler.finish(s, "length")

    def check(self) -> None:
        check_pool(self.cache, self.scheduler)
        for s in self.scheduler.running:
            table = self.cache.blocks.table(s.row)
            slots = [table.slot(p) for p in range(table.num_tokens)]
            expected = [self.key_of(s.token_ids[:p + 1]) for p in range(table.num_tokens)]
            assert not slots or torch.equal(self.cache.k_pools[0][slots], torch.stack(expected)), \
                f"request {s.request_id}'s slots hold K/V of other tokens (overwritten, or shared by mistake)"


# The step budget: None is the whole-prompt scheduler, a number chunked prefill's budget.
BUDGET = st.sampled_from([None, 3, 7, 2048])


@settings(max_examples=400, deadline=None)
@given(ops=OPS, num_blocks=st.integers(6, 16), max_rows=st.integers(1, 4), seed=st.integers(0, 2**31),
       drain=st.sampled_from(["abort", "complete"]), budget=BUDGET, caching=st.booleans())
def test_scheduler_and_cache_keep_the_pool_consistent(ops, num_blocks, max_rows, seed, drain, budget,
                                                       caching) -> None:
    fake = FakeForward(num_blocks, max_rows, seed, budget, prefix_caching=caching)
    for op in ops:
        if op[0] == "add":
            if fits(op[1], op[2], num_blocks):
                fake.add(op[1], op[2], op[4])
        elif op[0] == "step":
            for _ in range(op[1]):
                fake.step()
                fake.check()
        else:
            fake.abort(op[1])
        fake.check()
    if drain == "abort":
        for seq in fake.seqs:
            fake.scheduler.abort(seq)
            fake.check()
    else:
        for _ in range(MAX_STEPS):
            if not fake.scheduler.has_unfinished():
                break
            fake.step()
            fake.check()
        for s in fake.seqs:
            assert s.finish_reason == "abort" or len(s.output_token_ids) == s.params.max_tokens
    check_drained(fake.cache, fake.scheduler)
    assert all(s.finished and s.row is None for s in fake.seqs)
    event(f"fake forward: {'preempted' if fake.scheduler.num_preemptions else 'no preemption'}")
    if caching:
        event(f"fake forward: {'prefix hits' if fake.scheduler.prefix_cache_hits else 'no prefix hit'}")


def test_fake_forward_preempts_on_a_small_pool() -> None:
    """Three requests of 7 tokens growing to 15 on 8 blocks of 4: all are admitted, but they
    cannot all grow, so the newest is preempted and later recomputed; every one still finishes."""
    fake = FakeForward(num_blocks=8, max_rows=4, seed=0)
    for _ in range(3):
        fake.add(7, 8)
    for _ in range(MAX_STEPS):
        if not fake.scheduler.has_unfinished():
            break
        fake.step()
        fake.check()
    assert fake.scheduler.num_preemptions >= 1
    assert [len(s.output_token_ids) for s in fake.seqs] == [8, 8, 8]
    check_drained(fake.cache, fake.scheduler)


# Level (b): the real Engine on tiny.

def check_engine(engine: Engine) -> None:
    """`check_pool` on the engine's cache and scheduler, with its in-flight step's sequences."""
    step, fed = engine._inflight, {}
    if step is not None:
        fed = {s.request_id: 1 + (len(step.drafts[i]) if step.chained else 0) for i, s in enumerate(step.seqs)}
    check_pool(engine.kv_cache, engine.scheduler, fed)


def run_ops(engine: Engine, ops, seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    seqs: list[Sequence] = []
    check_engine(engine)
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, ignore_eos, n = op
            prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
            if rng.random() < 0.4:  # a phrase repeated: prompt lookup finds drafts in it
                prompt = (prompt[:3] * prompt_len)[:prompt_len]
            # Some requests want logprobs (their steps are read back at once) or their prompt's (no prefix hit).
            # Unseeded sampling draws from torch's generator, seeded by the test: such rows speculate
            # (a seeded sampled row does not), so rejection sampling keeps and rejects drafts too.
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=max_tokens,
                                    ignore_eos=ignore_eos, seed=rng.choice([None, rng.randrange(1000)]), n=n,
                                    logprobs=rng.choice([None, None, 2]), prompt_logprobs=rng.choice([None, None, 1]))
            if fits(prompt_len, max_tokens, engine.kv_cache.num_blocks):
                seqs += engine.add_requests([prompt] * n, params.samples())
            else:
                before = (len(engine.scheduler.waiting), len(engine.requests))
                with pytest.raises(ValueError, match="more than the whole KV pool holds"):
                    engine.add_request(prompt, params)
                assert (len(engine.scheduler.waiting), len(engine.requests)) == before
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check_engine(engine)
        elif seqs:
            engine.abort_request(seqs[op[1] % len(seqs)].request_id)
        check_engine(engine)
    return seqs


def drain(engine: Engine) -> None:
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        check_engine(engine)
    raise AssertionError(f"the engine did not finish within {MAX_STEPS} steps")


@contextlib.contextmanager
def corrupted_lookup(seed: int):
    """Prompt lookup whose drafts are kept up to a random point and random tokens after it, so that
    verify steps keep some drafts and reject the rest (the tiny model's own text rarely parts from
    a repeated phrase's draft)."""
    from unittest import mock

    from nanolab.engine import llm_engine

    rng, lookup = random.Random(seed), llm_engine.propose_ngram

    def propose(tokens, k, *args):
        drafts = lookup(tokens, k, *args)
        cut = rng.randrange(len(drafts) + 1)
        return drafts[:cut] + [rng.randrange(VOCAB) for _ in drafts[cut:]]

    with mock.patch.object(llm_engine, "propose_ngram", propose):
        yield


def make_engine(num_blocks: int, max_num_seqs: int, budget: int | None = None, caching: bool = False,
                speculative: bool | int = False, overlapped: bool = False) -> Engine:
    # The model's whole context, longer than these pools: a request can ask for more than the pool
    # holds, and must be refused whole.
    model = load_tiny()
    return Engine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK, max_num_seqs=max_num_seqs,
                                      max_model_len=model.config.max_position_embeddings,
                                      max_num_batched_tokens=budget or 2048,
                                      enable_chunked_prefill=budget is not None, enable_prefix_caching=caching,
                                      speculative_config={"num_speculative_tokens": 3,  # an int: its most rows
                                                          "max_num_seqs": 8 if speculative is True else speculative}
                                      if speculative else None,
                                      async_scheduling=overlapped))


@settings(max_examples=250, deadline=None)
@given(ops=OPS, num_blocks=st.integers(6, 16), max_num_seqs=st.integers(1, 4), seed=st.integers(0, 2**31),
       finish=st.sampled_from(["abort", "complete"]), budget=BUDGET, caching=st.booleans(),
       speculative=st.sampled_from([False, 1, 2, 8]), overlapped=st.booleans())
def test_engine_keeps_the_pool_consistent(ops, num_blocks, max_num_seqs, seed, finish, budget, caching,
                                          speculative, overlapped) -> None:
    """With speculation, drafts are kept and rejected at random (prompts repeat a phrase, so prompt
    lookup proposes, and its drafts are corrupted from a random point on, `corrupted_lookup`), and
    each rejected draft's slot must go back; `speculative` is the most rows a step speculates at.
    `overlapped`: asynchronous scheduling, which with speculation chains every step while the rows
    are greedy (the next step planned before the last is read back, its tables grown as if every
    draft were kept, and cut back once read), and otherwise switches between overlapped steps
    (more rows than that, or every request's drafts paused) and synchronous ones."""
    torch.manual_seed(seed)
    engine = make_engine(num_blocks, max_num_seqs, budget, caching, speculative, overlapped)

    spec_steps, run_speculative = [0], engine._run_speculative

    def counted(out, drafts):
        spec_steps[0] += 1
        return run_speculative(out, drafts)

    engine._run_speculative = counted
    launches, links, launch = [0], [0], engine._launch

    def launched(*args, **kwargs):
        launches[0] += 1
        links[0] += bool(kwargs.get("chained"))  # a chained step with no drafts after one with none
        return launch(*args, **kwargs)

    engine._launch = launched
    chained, launch_chained = [0], engine._launch_chained

    def chained_launch(*args):
        chained[0] += 1
        return launch_chained(*args)

    engine._launch_chained = chained_launch
    with corrupted_lookup(seed):
        seqs = run_ops(engine, ops, seed)
    if finish == "abort":
        for seq in seqs:
            engine.abort_request(seq.request_id)
            check_engine(engine)
    else:
        drain(engine)
        for s in seqs:
            if s.finish_reason == "length":
                assert len(s.output_token_ids) == s.params.max_tokens
            elif s.finish_reason == "stop":
                assert s.output_token_ids[-1] in engine.eos_token_ids and not s.params.ignore_eos
            else:
                assert s.finish_reason == "abort"
    check_drained(engine.kv_cache, engine.scheduler)
    assert not engine.requests
    assert all(s.finished and s.row is None for s in seqs)
    event(f"engine: {'preempted' if engine.scheduler.num_preemptions else 'no preemption'}")
    if speculative:
        event(f"engine: {'a speculative step' if spec_steps[0] else 'no speculative step'}")
    if overlapped:
        event(f"engine: {'a step overlapped' if launches[0] else 'no step overlapped'}"
              f"{' beside speculation' if speculative and spec_steps[0] else ''}")
    if speculative and not overlapped and spec_steps[0]:
        lost = engine.spec_draft_tokens > engine.spec_accepted_tokens
        event(f"engine: synchronous drafts {'lost' if lost else 'all kept'}")
    if overlapped and speculative:
        event(f"engine: {'speculation chained' if chained[0] else 'no chained step'}")
        event(f"engine: {'a plain link in the chain' if links[0] else 'no plain link'}")
        if chained[0] and engine.spec_draft_tokens > engine.spec_accepted_tokens > 0:
            event("engine: chained drafts kept and lost")


def test_sampled_rows_keep_the_pool_through_rejection_sampling() -> None:
    """Unseeded sampled rows (temperature 1 over each step's two likeliest tokens), each step fed
    drafts (its last token, repeated, which the tiny model's text often repeats): rejection sampling
    keeps some drafts and rejects others, every rejected draft's slot goes back (the pool's
    invariants after every step), and every block comes back at the end."""
    from unittest import mock

    from nanolab.engine import llm_engine

    torch.manual_seed(0)
    engine = make_engine(num_blocks=32, max_num_seqs=4, speculative=True)
    sampled, reject = [0], llm_engine.rejection_sample

    def rejection_sample(probs, drafts, *args):
        sampled[0] += len(drafts)
        return reject(probs, drafts, *args)

    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 9, 13)]
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=24, ignore_eos=True)
    with mock.patch.object(llm_engine, "propose_ngram", lambda tokens, k, *args: [tokens[-1]] * k), \
            mock.patch.object(llm_engine, "rejection_sample", rejection_sample):
        seqs = engine.add_requests(prompts, [params] * len(prompts))
        drain(engine)
    assert sampled[0] and engine.spec_draft_tokens > engine.spec_accepted_tokens > 0, \
        (sampled[0], engine.spec_draft_tokens, engine.spec_accepted_tokens)
    assert all(len(s.output_token_ids) == 24 for s in seqs)
    check_drained(engine.kv_cache, engine.scheduler)


def greedy_outputs(requests, num_blocks: int, max_num_seqs: int, budget: int | None = None, caching: bool = False,
                   speculative: bool = False, chained: bool = False) -> tuple[list[list[int]], int]:
    """Each request's greedy output and the preemptions, on an engine of that pool (`check_engine`
    after every step, as `drain` does); `speculative`: with speculation, synchronous or, with
    `chained`, under asynchronous scheduling, where every step chains."""
    engine = make_engine(num_blocks, max_num_seqs, budget, caching, speculative=speculative, overlapped=chained)
    seqs = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos))
            for prompt, n, ignore_eos in requests]
    drain(engine)
    check_drained(engine.kv_cache, engine.scheduler)
    if speculative:
        event(f"{'chained' if chained else 'synchronous'}: "
              f"{'drafts kept' if engine.spec_accepted_tokens else 'no draft kept'}, "
              f"{'drafts lost' if engine.spec_draft_tokens > engine.spec_accepted_tokens else 'no draft lost'}")
    return [s.output_token_ids for s in seqs], engine.scheduler.num_preemptions


PROMPT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
REQUEST = st.tuples(PROMPT, st.integers(1, 16), st.booleans())  # prompt, max_tokens, ignore_eos


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(REQUEST, min_size=1, max_size=6), spare=st.integers(0, 3),
       max_num_seqs=st.integers(2, 4), budget=BUDGET, shared=st.lists(st.integers(0, VOCAB - 1), max_size=12),
       caching=st.booleans())
def test_greedy_outputs_do_not_depend_on_preemption(requests, spare, max_num_seqs, budget, shared, caching) -> None:
    """Recompute preemption re-prefills a request from its tokens so far (in chunks, with a
    budget; with prefix caching, after what its prefix still has cached); greedy decoding must
    then continue exactly as if it had never been interrupted, and as the whole-prompt engine on a
    pool that never preempts and caches nothing. Prompts begin with one shared run of tokens."""
    requests = [(shared + prompt, n, ignore_eos) for prompt, n, ignore_eos in requests]
    smallest = max(cdiv(len(prompt) + n, BLOCK) for prompt, n, _ in requests)
    small, preemptions = greedy_outputs(requests, smallest + spare, max_num_seqs, budget, caching)
    large, none = greedy_outputs(requests, 512, max_num_seqs)
    assert none == 0
    assert small == large
    event(f"greedy: {'preempted' if preemptions else 'no preemption'}")


@settings(max_examples=100, deadline=None)
@given(requests=st.lists(REQUEST, min_size=1, max_size=4), spare=st.integers(0, 3), max_num_seqs=st.integers(1, 4),
       budget=BUDGET, caching=st.booleans(), repeats=st.integers(1, 4), seed=st.integers(0, 2**31),
       chained=st.booleans())
def test_speculation_keeps_the_pool_and_greedy_outputs(requests, spare, max_num_seqs, budget, caching,
                                                       repeats, seed, chained) -> None:
    """Greedy requests with speculation, synchronous or (`chained`) under asynchronous scheduling,
    where each decode step is planned before the one in flight is read back, its tables grown as
    if every draft in flight were kept and cut back once read. Prompts repeat a phrase, so prompt
    lookup proposes, and its drafts are corrupted at random from a random point on
    (`corrupted_lookup`), so that verify steps keep some and lose the rest. On a pool small enough
    to preempt, the pool's invariants hold after every step (a row holds exactly its kept tokens
    and what a step in flight fed it), every block comes back, and the outputs are plain greedy's
    on a pool that never preempts."""
    requests = [((prompt * repeats)[:40], n, ignore_eos) for prompt, n, ignore_eos in requests]
    smallest = max(cdiv(len(prompt) + n, BLOCK) for prompt, n, _ in requests)
    with corrupted_lookup(seed):
        speculative, preemptions = greedy_outputs(requests, smallest + spare, max_num_seqs, budget, caching,
                                                  speculative=True, chained=chained)
    plain, none = greedy_outputs(requests, 512, max_num_seqs)
    assert none == 0
    assert speculative == plain
    event(f"{'chained' if chained else 'synchronous'}: {'preempted' if preemptions else 'no preemption'}")


@pytest.mark.parametrize("budget", [None, 5])
def test_engine_preempts_on_a_small_pool_and_greedy_is_unchanged(budget) -> None:
    requests = [(list(range(10 + i, 17 + i)), 8, True) for i in range(3)]
    small, preemptions = greedy_outputs(requests, 8, 4, budget)
    assert preemptions >= 1
    large, none = greedy_outputs(requests, 512, 4)
    assert none == 0
    assert small == large
    assert [len(out) for out in small] == [8, 8, 8]
