"""Prefix caching in the block manager: the hash chain, shared blocks by reference count, and the
keyed blocks nobody holds, evicted least recently released first.

The property test drives a `BlockManager` through random rows over a few shared prefixes, with
failures injected (a row freed before its blocks are keyed, a pool too small for a grow), and
keeps a model of what each pool block holds: the tokens of the whole sequence up to its end, since
a block's K/V depends on every token before it. A row that shares a block must find its own
prefix there.
"""

from __future__ import annotations

import array
import random

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, needs_cuda, run_until_done
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab import LLM, Engine, EngineConfig, SamplingParams
from nanolab.engine.block_manager import BlockManager, CacheFull, KeyMemo, block_key, chain_keys, token_span

BS = 4


def test_the_key_chains_every_block_before():
    a, b = block_key(None, [1, 2, 3, 4]), block_key(None, [9, 2, 3, 4])
    assert block_key(a, [5, 6, 7, 8]) != block_key(b, [5, 6, 7, 8]), "a key ignores its parent"
    assert block_key(a, [5, 6, 7, 8]) == block_key(block_key(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert block_key(None, [1, 2, 3, 4]) != block_key(None, [1, 2, 3, 5])


def test_the_key_memo_gives_the_chains_keys_and_keeps_at_most_its_capacity():
    rng = random.Random(0)
    memo = KeyMemo(BS, capacity=12)
    shared = [rng.randrange(1, 50) for _ in range(3 * BS)]
    for _ in range(40):  # prompts over a few shared heads, a block repeated under different parents
        head = rng.choice([shared, shared[BS:], shared[:BS] * 3, []])
        ids = head + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 3 * BS))]
        first = rng.randrange(0, 2) if len(ids) >= BS else 0
        parent = None if first == 0 else block_key(None, ids[:BS])
        stop = len(ids) // BS
        assert list(memo.chain(parent, ids, first, stop)) == list(chain_keys(parent, ids, first, stop, BS))
        assert len(memo) <= 12
    # The same block after two different parents: two keys.
    a, b = [1] * BS + [7] * BS, [2] * BS + [7] * BS
    assert list(memo.chain(None, a, 0, 2))[1] != list(memo.chain(None, b, 0, 2))[1]


def test_keys_from_packed_ids_are_the_keys_of_the_ids():
    """A new request's prompt is keyed from the bytes its check packed (`Sequence.prompt_bytes`):
    every key, and every cached prefix found, is the one its list of ids gives."""
    rng = random.Random(1)
    m = BlockManager(num_blocks=32, block_size=BS, max_rows=2, enable_prefix_caching=True)
    prompt = [rng.randrange(0, 1 << 40) for _ in range(5 * BS + 2)]
    packed = array.array("q", prompt).tobytes()
    for first, stop in ((0, 5), (2, 4), (3, 3)):
        parent = None if first == 0 else block_key(None, prompt[:BS])
        assert list(chain_keys(parent, packed, first, stop, BS)) == list(chain_keys(parent, prompt, first, stop, BS))
    fill(m, m.open_row(), prompt)
    for n in (BS, BS + 1, 3 * BS, len(prompt)):  # whole blocks, and the last token left to compute
        assert m.cached_prefix(packed[:8 * n]) == m.cached_prefix(prompt[:n]), n
    assert len(m.cached_prefix(packed)[0]) == 5


def test_the_engine_keeps_each_prompt_packed_as_its_check_packed_it():
    llm = LLM("tiny", device="cpu", enable_prefix_caching=True)
    seqs = llm.engine.add_requests([[5, 6, 7], [9] * 40], [SamplingParams(max_tokens=1)] * 2)
    seqs.append(llm.engine.add_request([3, 2, 1], SamplingParams(max_tokens=1)))
    for seq, prompt in zip(seqs, ([5, 6, 7], [9] * 40, [3, 2, 1])):
        assert seq.prompt_token_ids == prompt and type(seq.prompt_token_ids) is list
        assert seq.prompt_bytes == array.array("q", prompt).tobytes()


def fill(manager: BlockManager, row: int, tokens: list[int]) -> None:
    """Grow `row` to hold all of `tokens` and key its full blocks, as a step that wrote them would."""
    table = manager.table(row)
    manager.grow([row], [len(tokens) - table.num_tokens])
    manager.commit_full_blocks(row, tokens)


def test_a_second_request_shares_the_full_blocks_of_its_prefix_and_never_the_last():
    m = BlockManager(num_blocks=16, block_size=BS, max_rows=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    first = m.open_row()
    fill(m, first, prompt)
    blocks, keys = m.cached_prefix(prompt + [42, 43])
    assert blocks == m.table(first).blocks[:2] and len(keys) == 2
    second = m.open_row()
    m.share_prefix(second, blocks, keys)
    assert m.table(second).num_tokens == 8 and all(m.allocator.refs(b) == 2 for b in blocks)
    assert m.cached_prefix(prompt[:8])[0] == blocks[:1], "the whole prompt was cached: no token left to sample"
    assert m.cached_prefix(prompt[:9])[0] == blocks
    fill(m, second, prompt + [42, 43])
    assert m.table(second).blocks[2] != m.table(first).blocks[2], "a partial block was shared"
    m.free_row(first)
    assert all(m.allocator.refs(b) == 1 for b in blocks)
    m.free_row(second)
    assert m.allocator.num_used == 0 and m.allocator.num_free == 16 and m.allocator.num_cached == 3
    assert m.allocator.num_evictable == 3
    assert m.cached_prefix(prompt + [42, 43, 44])[0] != [], "freed blocks stay findable until evicted"


def test_eviction_takes_unkeyed_blocks_first_then_the_least_recently_released():
    m = BlockManager(num_blocks=6, block_size=BS, max_rows=3, enable_prefix_caching=True)
    old, new = m.open_row(), m.open_row()
    fill(m, old, list(range(100, 108)))  # two keyed blocks
    fill(m, new, list(range(200, 208)))
    m.free_row(old)
    m.free_row(new)  # released after `old`: more recent
    row = m.open_row()
    m.grow([row], [2 * BS])  # the two unkeyed blocks
    assert m.allocator.evictions == 0
    m.grow([row], [BS])
    assert m.allocator.evictions == 1
    assert m.cached_prefix(list(range(200, 209)))[0] != [], "the most recently released prefix was evicted"
    assert len(m.cached_prefix(list(range(100, 109)))[0]) == 1, "old's tail should go before its head"


def test_a_prefix_ends_at_its_first_block_no_longer_cached():
    """A cached prefix is a run from the first block: with the first block's key evicted, the blocks
    after it are cached still but start no prefix (their keys chain from a block that is gone)."""
    m = BlockManager(num_blocks=4, block_size=BS, max_rows=2, enable_prefix_caching=True)
    prompt = list(range(1, 14))  # 13 tokens: three full blocks and one more
    row = m.open_row()
    fill(m, row, prompt)
    blocks = list(m.table(row).blocks[:3])
    m.free_row(row)
    for b in blocks[1:]:
        m.allocator.share(b)  # held again: of the keyed blocks only the first can be evicted
    taken = [m.allocator.allocate() for _ in range(2)]  # the free (unkeyed) block, then the first's
    assert blocks[0] in taken and m.allocator.evictions == 1
    m.allocator.release(blocks[1:])
    assert m.allocator.num_evictable == 2
    assert m.cached_prefix(prompt + [99]) == ([], [])


def test_a_shared_block_is_never_handed_out():
    """Sharing a block that waits to be evicted takes it off the eviction order: the pool runs dry
    before it would hand that block to anyone else."""
    m = BlockManager(num_blocks=3, block_size=BS, max_rows=2, enable_prefix_caching=True)
    row = m.open_row()
    fill(m, row, list(range(1, 9)))  # two keyed blocks
    first, second = m.table(row).blocks
    m.free_row(row)
    m.allocator.share(first)
    got = []
    with pytest.raises(CacheFull):
        while True:
            got.append(m.allocator.allocate())
    assert first not in got and second in got and m.allocator.refs(first) == 1


def test_the_key_epoch_moves_whenever_a_lookup_could_find_something_else():
    """The scheduler looks a waiting request up once per `key_epoch`, so the epoch moves when a key
    is set and when a keyed block is evicted, and not when blocks are only taken or given back."""
    m = BlockManager(num_blocks=3, block_size=BS, max_rows=2, enable_prefix_caching=True)
    a = m.allocator
    row = m.open_row()
    epoch = a.key_epoch
    m.grow([row], [BS])
    assert a.key_epoch == epoch, "taking a free block changed the epoch"
    m.commit_full_blocks(row, [1, 2, 3, 4])
    assert a.key_epoch > epoch, "a new key left the epoch"
    epoch = a.key_epoch
    m.free_row(row)
    row = m.open_row()
    m.grow([row], [2 * BS])  # the two free blocks: nothing evicted
    assert a.key_epoch == epoch and a.evictions == 0
    m.grow([row], [BS])  # the keyed block goes
    assert a.evictions == 1 and a.key_epoch > epoch, "an eviction left the epoch"


# Rows draw their tokens from a few prefixes, so they share blocks, and from random tails.
PREFIXES = [[], list(range(1, 9)), list(range(1, 5)) + [7, 7, 7, 7], [9] * 4 + list(range(1, 5)) + [3] * 3]
OPEN = st.tuples(st.just("open"), st.integers(0, len(PREFIXES) - 1), st.integers(1, 9))
GROW = st.tuples(st.just("grow"), st.integers(0, 1 << 16), st.integers(1, 6))
FREE = st.tuples(st.just("free"), st.integers(0, 1 << 16))
# A request's step fails after its blocks were taken: they hold what the failed forward wrote, are
# never keyed (the step's commit never runs), and go back with the row.
FAIL = st.tuples(st.just("fail"), st.integers(0, 1 << 16), st.integers(1, 6))


def check(m: BlockManager, seqs: dict[int, list[int]], holds: dict[int, tuple]) -> None:
    allocator = m.allocator
    counts: dict[int, int] = {}
    for row, table in enumerate(m.tables):
        if table is None:
            continue
        for i, block in enumerate(table.blocks):
            counts[block] = counts.get(block, 0) + 1
            end = min((i + 1) * BS, table.num_tokens)
            assert holds[block] == tuple(seqs[row][:end]), f"row {row}'s block {i} holds another sequence's tokens"
        assert len(table.blocks) == -(-table.num_tokens // BS)
    assert counts == {b: allocator.refs(b) for b in allocator.held()}, "a reference count is off"
    assert allocator.num_free + allocator.num_used == m.num_blocks
    assert not allocator.held() & set(allocator._free) and not allocator.held() & set(allocator._cached)
    for key, block in allocator._block_of.items():
        assert allocator._key_of[block] == key


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.one_of(OPEN, OPEN, GROW, GROW, FREE, FAIL), min_size=1, max_size=40),
       seed=st.integers(0, 1 << 16))
def test_reference_counts_and_contents_hold_under_random_rows_and_failures(ops, seed):
    rng = random.Random(seed)
    m = BlockManager(num_blocks=12, block_size=BS, max_rows=4, enable_prefix_caching=True)
    seqs: dict[int, list[int]] = {}  # open row -> its tokens
    holds: dict[int, tuple] = {}  # block -> the sequence's tokens up to the block's end, as written

    def write(row: int, tokens: list[int]) -> bool:
        """Grow the row to `tokens` and write its new tokens; a pool that cannot take them frees the
        row (the request fails) and returns False."""
        table = m.table(row)
        start = table.num_tokens
        try:
            m.grow([row], [len(tokens) - start])
        except CacheFull:
            m.free_row(row)
            seqs.pop(row)
            return False
        seqs[row] = tokens
        for i in range(start // BS, len(table.blocks)):
            holds[table.blocks[i]] = tuple(tokens[: min((i + 1) * BS, len(tokens))])
        m.commit_full_blocks(row, tokens)
        return True

    for op in ops:
        rows = sorted(seqs)
        if op[0] == "open" and m.free_row_count():
            tokens = PREFIXES[op[1]] + [rng.randrange(1, 4) for _ in range(op[2])]
            blocks, keys = m.cached_prefix(tokens)
            assert len(blocks) * BS < len(tokens)
            row = m.open_row()
            m.share_prefix(row, blocks, keys)
            seqs[row] = tokens[: len(blocks) * BS]
            write(row, tokens)
        elif op[0] == "grow" and rows:
            row = rows[op[1] % len(rows)]
            write(row, seqs[row] + [rng.randrange(1, 4) for _ in range(op[2])])
        elif op[0] == "free" and rows:
            row = rows[op[1] % len(rows)]
            m.free_row(row)
            seqs.pop(row)
        elif op[0] == "fail" and rows:
            row = rows[op[1] % len(rows)]
            table = m.table(row)
            start = table.num_tokens
            try:
                m.grow([row], [op[2]])
            except CacheFull:
                pass
            else:  # the failed forward wrote garbage from the row's end on
                for i in range(start // BS, len(table.blocks)):
                    holds[table.blocks[i]] = ("garbage", row, i)
            m.free_row(row)
            seqs.pop(row)
        check(m, seqs, holds)
    for row in sorted(seqs):
        m.free_row(row)
    assert m.allocator.num_used == 0 and m.allocator.num_free == m.num_blocks


def test_without_prefix_caching_nothing_is_keyed_or_shared():
    m = BlockManager(num_blocks=8, block_size=BS, max_rows=2)
    row = m.open_row()
    fill(m, row, list(range(1, 10)))
    assert m.allocator.num_cached == 0 and m.cached_prefix(list(range(1, 12))) == ([], [])
    m.free_row(row)
    assert m.allocator.num_free == 8


def test_growing_is_all_or_nothing():
    """`grow` refuses a row that is not open (negative, past the last, or freed) and a pool that
    cannot hold the step, each before any table changes."""
    m = BlockManager(num_blocks=4, block_size=BS, max_rows=3)
    a, b, c = m.open_row(), m.open_row(), m.open_row()
    m.grow([a, b], [1, 1])
    before = [(m.table(r).blocks[:], m.table(r).num_tokens) for r in (a, b)]
    for bad in (-1, 3):  # -1 would index the last row, which is open
        with pytest.raises(ValueError, match=f"row {bad} is not open"):
            m.grow([a, bad], [BS, 1])
    m.free_row(c)
    with pytest.raises(ValueError, match=f"row {c} is not open"):
        m.grow([a, c], [BS, 1])
    with pytest.raises(CacheFull):
        m.grow([a, b], [2 * BS, 2 * BS])  # 4 more blocks, 2 free
    assert [(m.table(r).blocks, m.table(r).num_tokens) for r in (a, b)] == before
    assert m.allocator.num_free == 2


def test_a_prefix_starts_only_an_empty_row():
    m = BlockManager(num_blocks=8, block_size=BS, max_rows=2, enable_prefix_caching=True)
    row = m.open_row()
    fill(m, row, list(range(1, 10)))
    blocks, keys = m.cached_prefix(list(range(1, 10)))
    with pytest.raises(ValueError, match="empty row"):
        m.share_prefix(row, blocks, keys)


# The engine with prefix caching: every step's logits against a one-shot forward, on a sharp model
# (whose output depends on every key it reads: a block shared by mistake shows).


def engine_with_cache(sharp, **kw):
    config = EngineConfig(**{"block_size": BS, "max_num_batched_tokens": 7, "enable_prefix_caching": True,
                             "num_blocks": 64, **kw})
    return Engine(sharp.model, config)


def test_cached_prefixes_give_the_reference_logits(sharp_gqa24):
    """A prompt seen whole, a prompt cut inside a block, a second turn over the first's prompt and
    output, a hit on a request still running (its partial last block not shared), and a stranger,
    in chunks of 7 tokens: the same logits as a one-shot forward, with prefix tokens found."""
    sharp = sharp_gqa24
    engine = engine_with_cache(sharp)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 320, (18,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    logits, keep = logit_recorder()
    first = engine.add_request(prompt, params)
    run_until_done(engine, on_step=keep)
    assert engine.scheduler.prefix_cache_hits == 0
    second_turn = prompt + first.output_token_ids + torch.randint(3, 320, (6,), generator=g).tolist()
    running = torch.randint(3, 320, (11,), generator=g).tolist()
    seqs = [engine.add_request(p, params) for p in (prompt, prompt[:10] + [7, 7, 7], second_turn, running)]
    steps = [0]

    def join_later(outputs):
        keep(outputs)
        steps[0] += 1
        if steps[0] == 3:  # `running` holds 8 full tokens and a partial block by now
            seqs.append(engine.add_request(running[:9] + [5, 5], params))
            seqs.append(engine.add_request(torch.randint(3, 320, (9,), generator=g).tolist(), params))

    run_until_done(engine, on_step=join_later)
    assert_logits_match_reference(sharp, [first, *seqs], logits)
    hits = engine.scheduler.prefix_cache_hits
    assert hits >= 16 + 8 + 20 + 8, f"only {hits} prompt tokens came from the cache"
    assert engine.block_manager.allocator.num_free == engine.num_blocks


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_on_a_running_prefix_is_admitted_for_what_it_adds(sharp_gqa24, chunked):
    """Admission counts the blocks a request adds, not those it shares: on a pool of 16 blocks of
    4, a request over the 40-token prompt of one still running (11 blocks promised) needs 2 more
    beside the 9 it shares, and runs beside it instead of waiting for it to finish (each alone
    would promise 11, 22 in all). Both keep the reference's logits, and every block comes back."""
    sharp = sharp_gqa24
    engine = engine_with_cache(sharp, num_blocks=16, enable_chunked_prefill=chunked,
                               max_num_batched_tokens=64 if chunked else 2048)
    prompt = torch.randint(3, 320, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    logits, keep = logit_recorder()
    first = engine.add_request(prompt, params)
    while not first.output_token_ids:
        keep(engine.step())
    second = engine.add_request(prompt, params)
    keep(engine.step())
    assert second.row is not None and not first.finished, "the second request waited for the first"
    assert engine.scheduler.prefix_cache_hits == 36
    run_until_done(engine, on_step=keep)
    assert_logits_match_reference(sharp, [first, second], logits)
    assert engine.block_manager.allocator.num_free == 16


def test_a_preempted_request_finds_its_outputs_blocks_again(sharp_gqa24):
    """A request preempted after its output filled blocks comes back to them: its lookup covers its
    output, not only the prompt its check packed (`Sequence.prompt_bytes`), and its logits stay the
    reference's."""
    sharp = sharp_gqa24
    engine = engine_with_cache(sharp)
    prompt = torch.randint(3, 320, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    logits, keep = logit_recorder()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    while len(seq.output_token_ids) < 8:  # 17 tokens: four full blocks of 4, two of them output
        keep(engine.step())
    engine.scheduler.running.remove(seq)
    engine.scheduler.preempt(seq)
    keep(engine.step())  # re-admitted: all its tokens but the last found cached
    assert seq.num_computed_tokens == 17 and engine.scheduler.prefix_cache_hits == 16
    run_until_done(engine, on_step=keep)
    assert_logits_match_reference(sharp, [seq], logits)


def test_evicted_prefixes_are_recomputed_under_a_tiny_pool(sharp_gqa24):
    """A pool of 12 blocks and more distinct prompts than it caches: old prefixes are evicted, a
    prompt that comes back finds what is left of its prefix, and every logit is the reference's."""
    sharp = sharp_gqa24
    engine = engine_with_cache(sharp, num_blocks=12, max_num_seqs=2)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (13,), generator=g).tolist() for _ in range(5)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    logits, keep = logit_recorder()
    seqs = [engine.add_request(p, params) for p in prompts]
    run_until_done(engine, on_step=keep)
    assert engine.block_manager.allocator.evictions > 0
    again = [engine.add_request(p, params) for p in (prompts[0], prompts[-1])]
    run_until_done(engine, on_step=keep)
    assert_logits_match_reference(sharp, seqs + again, logits)
    assert engine.scheduler.prefix_cache_hits > 0
    assert engine.block_manager.allocator.num_free == 12


def test_caching_changes_no_token(sharp_gqa24):
    """The same requests with prefix caching on and off give the same greedy tokens."""
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, 320, (12,), generator=g).tolist()
    prompts = [base + torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 5, 9)] + [base]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for on in (True, False):
        engine = engine_with_cache(sharp_gqa24, enable_prefix_caching=on)
        seqs = []
        for p in prompts:  # one after another, so each can find the ones before
            seqs.append(engine.add_request(p, params))
            run_until_done(engine)
        outs.append([s.output_token_ids for s in seqs])
        assert (engine.scheduler.prefix_cache_hits > 0) == on
    assert outs[0] == outs[1]


@needs_cuda
@pytest.mark.cuda
def test_prefix_caching_under_the_cuda_defaults(sharp_gqa24, monkeypatch):
    """On CUDA with every step graphed, the decode compiled and the streamed read: a prompt seen
    whole, one cut inside a block, a second turn and a stranger, in chunks of 24 tokens, give
    every step's logits within 1e-3 of the one-shot reference (fp32 weights, TF32 off), with hits;
    with asynchronous scheduling on and caching off, the same tokens."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    g = torch.Generator().manual_seed(5)
    prompt, tail = (torch.randint(3, 320, (n,), generator=g).tolist() for n in (70, 9))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for caching, overlap in ((True, False), (True, True), (False, True)):
        llm = LLM(str(sharp_gqa24.path), device="cuda", dtype="float32", max_num_batched_tokens=24, max_num_seqs=8,
                  num_blocks=128, enable_prefix_caching=caching, async_scheduling=overlap)
        engine = llm.engine
        assert engine.runner.varlen_graphs is not None and engine.kv_cache.read == "streamed"
        logits, keep = logit_recorder()
        first = engine.add_request(prompt, params)
        run_until_done(engine, on_step=None if overlap else keep)
        turn = prompt + first.output_token_ids + tail
        seqs = [engine.add_request(p, params) for p in (prompt, prompt[:37] + [9] * 5, turn, [4] * 30)]
        run_until_done(engine, on_step=None if overlap else keep)
        tokens[caching, overlap] = [s.output_token_ids for s in [first, *seqs]]
        assert (engine.scheduler.prefix_cache_hits >= 64 + 32 + 64) == caching
        if not overlap:
            cpu = {rid: [row.float().cpu() for row in rows] for rid, rows in logits.items()}
            assert_logits_match_reference(sharp_gqa24, [first, *seqs], cpu, atol=1e-3, rtol=1e-3)
        assert engine.block_manager.allocator.num_free == engine.num_blocks
    assert tokens[True, False] == tokens[True, True] == tokens[False, True]


def test_a_token_span_crosses_from_the_prompt_into_the_output():
    """`commit_rows` keys a row's due blocks from `token_span` of its prompt and output, without
    listing the whole sequence: every span equals the slice of the two lists joined."""
    prompt, output = list(range(10)), list(range(100, 107))
    joined = prompt + output
    for start in range(len(joined) + 1):
        for stop in range(start, len(joined) + 1):
            assert token_span(prompt, output, start, stop) == joined[start:stop], (start, stop)
    # a step's ids come from the same span (`Sequence.span`, which `run_varlen` and a verify step feed)
    from nanolab.engine.sequence import Sequence
    from nanolab.sampling import SamplingParams

    seq = Sequence(0, prompt, SamplingParams(), output_token_ids=output)
    assert all(seq.span(a, b) == joined[a:b] for a in range(len(joined) + 1) for b in range(a, len(joined) + 1))


# The allocator's and the memo's own promises, each of which the engine-level tests above would
# let slip: they change which blocks are reused, or how much hashing is saved, not the output.


def test_an_unkeyed_released_block_is_handed_out_first_again():
    from nanolab.engine.block_manager import BlockAllocator

    allocator = BlockAllocator(4)
    x, y = allocator.allocate(), allocator.allocate()
    allocator.release([x])
    allocator.release([y])
    assert allocator.allocate() == y and allocator.allocate() == x, "unkeyed blocks go last in, first out"


def test_a_keyed_block_keeps_its_first_key():
    from nanolab.engine.block_manager import BlockAllocator

    allocator = BlockAllocator(2)
    block = allocator.allocate()
    assert allocator.set_key(block, b"k1")
    assert not allocator.set_key(block, b"k2"), "a keyed block was keyed again"
    assert allocator.lookup(b"k1") == block and allocator.lookup(b"k2") is None


def test_the_key_memo_fills_to_its_capacity_and_drops_the_least_recently_used(monkeypatch):
    import hashlib

    memo = KeyMemo(4, capacity=3)
    blocks = [[i] * 4 for i in range(1, 5)]
    for block in blocks[:3]:
        list(memo.chain(None, block, 0, 1))
    assert len(memo) == 3, "the memo keeps fewer keys than its capacity"
    list(memo.chain(None, blocks[0], 0, 1))  # a hit: now the most recent
    list(memo.chain(None, blocks[3], 0, 1))  # drops blocks[1], the least recent
    hashed, sha256 = [], hashlib.sha256
    monkeypatch.setattr(hashlib, "sha256", lambda data: hashed.append(data) or sha256(data))
    list(memo.chain(None, blocks[0], 0, 1))
    assert hashed == [], "a key used just before was dropped first"


def test_a_row_keys_each_block_as_soon_as_it_is_full():
    class Seq:
        def __init__(self, row, prompt):
            self.row, self.prompt_token_ids, self.output_token_ids = row, prompt, []

    manager = BlockManager(num_blocks=8, block_size=4, max_rows=1, enable_prefix_caching=True)
    row = manager.open_row()
    prompt = [1, 2, 3, 4, 5]  # one full block and one token
    manager.grow([row], [len(prompt)])
    manager.commit_rows([Seq(row, prompt)])
    assert len(manager.table(row).keys) == 1
    assert manager.cached_prefix(prompt + [9])[0] == manager.table(row).blocks[:1]
