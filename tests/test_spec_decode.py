"""Speculative decoding's halves on their own: the prompt-lookup proposer on token lists worked by
hand; greedy acceptance, which must emit exactly what plain greedy decoding emits; and rejection
sampling, whose output must be distributed as the target's, token by token (chi-square tests on a
small vocabulary, seeded, so they are deterministic)."""

from __future__ import annotations

import argparse
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.kernels import INTERPRETED
from nanolab.spec_decode import TokenIndex, greedy_accept, propose_ngram, rejection_sample

# Chi-square's 0.999 quantile with 4 degrees of freedom (a vocabulary of 5): a correct sampler
# exceeds it once in a thousand seeds; these seeds are fixed.
CHI2_4_999 = 18.467


def test_propose_ngram_copies_what_followed_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], k=3) == [7, 1, 2]  # the latest earlier [1, 2]
    # [5, 1, 2] matched (3 tokens) wins over the later [1, 2] (2 tokens).
    assert propose_ngram([5, 1, 2, 8, 1, 2, 9, 5, 1, 2], k=3) == [8, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, max_n=1) == [3, 4, 1]
    assert propose_ngram([7, 8, 9], k=2) == []  # nothing occurred before
    assert propose_ngram([4, 4], k=3) == [4]  # only what exists after the match
    assert propose_ngram([3], k=2) == []
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram([1, 2], k=0)


def _propose_by_definition(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup as its docstring defines it: for n from the longest down, the latest earlier
    start whose n tokens equal the last n, and up to k tokens after it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [i for i in range(len(tokens) - n) if tokens[i: i + n] == tokens[len(tokens) - n:]]
        if starts:
            return tokens[starts[-1] + n: starts[-1] + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 5), st.integers(1, 4), st.data())
def test_propose_ngram_is_its_definition(tokens, k, max_n, data):
    min_n = data.draw(st.integers(1, max_n))
    assert propose_ngram(tokens, k, max_n, min_n) == _propose_by_definition(tokens, k, max_n, min_n)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 5), st.integers(1, 4), st.data())
def test_propose_ngram_through_an_index_is_its_definition(tokens, k, max_n, data):
    """A `TokenIndex` over the first `covered` tokens, grown a piece at a time as a request's
    output grows (prompt, then outputs), the rest scanned: the same drafts as the definition,
    whatever part it covers, all of them included."""
    min_n = data.draw(st.integers(1, max_n))
    covered = data.draw(st.integers(0, len(tokens)))
    prompt_len = data.draw(st.integers(0, covered))
    index = TokenIndex()
    for upto in sorted(data.draw(st.lists(st.integers(prompt_len, covered), max_size=3))) + [covered]:
        index.update(tokens[:prompt_len], tokens[prompt_len:upto])
    assert index.length == covered and index.tokens == tokens[:covered]
    assert sorted(itertools.chain.from_iterable(index.positions.values())) == list(range(covered))
    assert all(tokens[i] == t for t, at in index.positions.items() for i in at)
    want = _propose_by_definition(tokens, k, max_n, min_n)
    assert propose_ngram(tokens, k, max_n, min_n, index) == want
    # As the engine looks up: the rest appended to the index's own tokens for the call, then taken off.
    index.tokens.extend(tokens[covered:])
    assert propose_ngram(index.tokens, k, max_n, min_n, index, covered) == want
    del index.tokens[covered:]


def test_greedy_accept_keeps_the_matching_drafts_and_adds_one():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, then the bonus
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token at the first mismatch
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert greedy_accept([3], []) == [3]
    with pytest.raises(ValueError, match="need 3 target tokens"):
        greedy_accept([1, 2], [1, 2])


def test_speculative_greedy_emits_plain_greedy_tokens():
    """A toy target whose next token depends on the last three (so prompt lookup often guesses
    right, and sometimes wrong): decoding with n-gram drafts of up to 4 tokens, verified by
    greedy_accept, gives the same tokens as one token at a time, in fewer target passes."""
    rng = random.Random(0)
    table = {}

    def target(prefix: list[int]) -> int:
        key = tuple(prefix[-3:])
        if key not in table:
            table[key] = rng.choice([1, 2, 3]) if rng.random() < 0.8 else rng.randrange(4, 9)
        return table[key]

    prompt = [1, 2, 3, 1, 2]
    plain = list(prompt)
    while len(plain) < 80:
        plain.append(target(plain))
    spec, passes = list(prompt), 0
    while len(spec) < 80 and passes < 80:  # a pass that emits nothing would loop forever
        drafts = propose_ngram(spec, k=4)
        argmax = [target(spec + drafts[:i]) for i in range(len(drafts) + 1)]  # one pass of the target
        spec += greedy_accept(argmax, drafts)
        passes += 1
    assert spec[:80] == plain
    assert passes < 80 - len(prompt), "no draft was ever kept"


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    """k = 2 drafts over a vocabulary of 5, 20,000 seeded trials: the first token is distributed
    as p_1, the second (given the first draft kept) as p_2, the third (both kept) as p_3; with a
    deterministic draft (the same two tokens every trial) and with drafts drawn from a draft
    distribution q each trial. And lengths 1 to k + 1 all occur."""
    g = torch.Generator().manual_seed(1)
    dirichlet = lambda rows: (lambda e: e / e.sum(-1, keepdim=True))(-torch.rand(rows, 5, generator=g).log())  # noqa: E731
    p = dirichlet(3)  # [k + 1, vocab]
    q = dirichlet(2) if with_draft_probs else None
    trials = 20_000
    drafts = (torch.multinomial(q, trials, replacement=True, generator=g).T.tolist() if with_draft_probs
              else [[1, 3]] * trials)
    outs = [rejection_sample(p, d, q, g) for d in drafts]
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=5).float()
    second = torch.bincount(torch.tensor([o[1] for o, d in zip(outs, drafts) if len(o) > 1]),
                            minlength=5).float()
    third = torch.bincount(torch.tensor([o[2] for o in outs if len(o) == 3]), minlength=5).float()
    for name, counts, probs in (("first", first, p[0]), ("second", second, p[1]), ("third", third, p[2])):
        assert counts.sum() > 500, f"too few {name} tokens to test"
        assert _chi2(counts, probs) < CHI2_4_999, f"the {name} token is not distributed as the target's"
    assert {len(o) for o in outs} == {1, 2, 3}


def test_a_sure_draft_is_always_kept_and_a_bonus_follows():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert all(rejection_sample(p, [1, 2], None, g) == [1, 2, 0] for _ in range(50))
    assert all(rejection_sample(p, [2, 2], None, g) == [1] for _ in range(50))  # an impossible draft
    with pytest.raises(ValueError, match=r"target_probs of shape \[3, vocab\]"):
        rejection_sample(p[:2], [1, 2])


# The engine with speculation, on a sharp model (a slot read wrong moves the logits by units).


def spec_engine(sharp, k: int | None = 4, **kw):
    from nanolab import Engine, EngineConfig

    spec = None if k is None else {"num_speculative_tokens": k}
    return Engine(sharp.model, EngineConfig(**{"block_size": 4, "max_num_batched_tokens": 64, "num_blocks": 96,
                                               "speculative_config": spec, **kw}))


def repetitive_prompts(seed: int, n: int = 3) -> list[list[int]]:
    """Prompts that repeat a short phrase, so prompt lookup finds drafts, and differ in length."""
    g = random.Random(seed)
    return [[g.randrange(3, 320) for _ in range(g.randrange(3, 7))] * g.randrange(2, 5) for _ in range(n)]


@pytest.mark.parametrize(("path", "read"), [
    ("decode", "reference"), ("padded", "reference"), ("varlen", "reference"),
    pytest.param("padded", "streamed", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))])
def test_speculative_greedy_is_plain_greedy_to_the_logit(sharp_gqa24, path, read):
    """Three repetitive prompts together, greedy, 24 tokens: with drafts of up to 4, never paused,
    the same tokens as without, every emitted token's logits within 1e-4 of a one-shot forward (a rejected
    draft's slot left in a row would show, and so would a fed token reading past its position), in
    fewer steps, with every block back. `path`: how the verify steps run. "decode", a decode step
    of a batch row a fed token; "padded", the same padded to a bucket's rows, as a decode graph
    replays it; "varlen", a varlen step with logits at every fed token, padded as a varlen graph
    replays it (its CPU stand-in), which a tensor-parallel leader and a step of more tokens than
    the cache's rows take. `read`: the cache's paged read (the streamed one, the GPU's, in
    Triton's interpreter)."""
    from conftest import assert_logits_match_reference, logit_recorder, run_until_done
    from test_cache_properties import check_drained
    from test_varlen_graphs import CapturedOnCPU

    from nanolab import SamplingParams
    from nanolab.engine.buckets import DecodeBuckets
    from nanolab.engine.graphs import capture_sizes

    prompts = repetitive_prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for k in (None, 4):
        # never paused (`max_draft_backoff` 0): every step looks its drafts up
        engine = spec_engine(sharp_gqa24, k, read=read, **({} if k is None else {"speculative_config": {
            "num_speculative_tokens": k, "max_draft_backoff": 0}}))
        runner, cache = engine.runner, engine.kv_cache
        planned, plan_decode = [], cache.plan_decode
        cache.plan_decode = lambda rows, planned=planned, plan=plan_decode, **kw: (planned.append(kw),
                                                                                 plan(rows, **kw))[1]
        if path == "padded":
            runner.buckets = DecodeBuckets.default(cache.max_rows, cache.max_width, min_width=16)
        if path == "varlen":
            runner.verify = runner._verify_varlen
            runner.varlen_graphs = stand_in = CapturedOnCPU(sharp_gqa24.model, cache, capture_sizes(64))
        logits, keep = logit_recorder()
        seqs = engine.add_requests(prompts, [params] * len(prompts))
        steps = run_until_done(engine, on_step=keep)
        runs[k] = ([s.output_token_ids for s in seqs], steps)
        assert_logits_match_reference(sharp_gqa24, seqs, logits)
        check_drained(engine.kv_cache, engine.scheduler)
    assert runs[4][0] == runs[None][0]
    assert runs[4][1] < runs[None][1], "no draft was kept"
    verified = [kw for kw in planned if kw.get("query_lens") is not None]
    if path == "varlen":  # the verify steps (more tokens than rows) replayed graphs
        assert not verified and engine.spec_steps and len(stand_in.replayed) >= engine.spec_steps
    else:
        assert len(verified) == engine.spec_steps
        padded = [kw["batch_size"] for kw in verified if (kw["batch_size"] or 0) > sum(kw["query_lens"])]
        assert bool(padded) == (path == "padded")
    assert 0 < engine.spec_accepted_tokens <= engine.spec_draft_tokens and engine.spec_steps > 0


def step_chain(engine, on_step) -> tuple[int, int]:
    """Step `engine` until its requests end, handing each step's outputs to `on_step`: (the step
    calls, those that left a step in flight)."""
    calls = overlapped = 0
    while engine.has_unfinished_requests():
        on_step(engine.step())
        calls += 1
        overlapped += engine._inflight is not None
    return calls, overlapped


def chained_logits(engine, monkeypatch):
    """Record the logits behind every token a chained engine emits: (on_step, logits). `on_step`
    for `run_until_done` keeps the logits that come with outputs (a prompt step's); every verify
    step's logits are kept with the drafts its rows kept, read from `accept_on_device`, and a plain
    link's (`runner.decode`) with its one token a row. `logits()`
    gives each request's rows in order, as many as it emitted."""
    from nanolab.engine import llm_engine

    first, launches, verify, accept = {}, [], engine.runner.verify, llm_engine.accept_on_device
    decode = engine.runner.decode

    def recorded_verify(seqs, counts, **kw):
        out = verify(seqs, counts, **kw)
        launches.append([list(seqs), list(counts), out.detach().clone(), None])
        return out

    def recorded_decode(seqs, ids=None):  # a link of the chain without drafts: one token a row, kept
        out = decode(seqs, ids)
        launches.append([list(seqs), [1] * len(seqs), out.detach().clone(), torch.zeros(len(seqs), dtype=torch.long)])
        return out

    def recorded_accept(logits, drafts, counts, fed=None, max_fed=None, **kw):
        result, shift = accept(logits, drafts, counts, fed, max_fed, **kw)
        launches[-1][3] = result[0].clone()  # on the device: reading it here would wait for the step
        return result, shift

    def on_step(outputs):
        for out in outputs:
            if out.logits is not None:
                first.setdefault(out.seq.request_id, []).append(out.logits.detach().clone())

    def logits(seqs):
        rows = {rid: list(r) for rid, r in first.items()}
        for seqs_, counts, out, kept in launches:
            for seq, start, a in zip(seqs_, itertools.accumulate(counts, initial=0), kept.tolist()):
                rows.setdefault(seq.request_id, []).extend(out[start: start + a + 1])
        return {s.request_id: rows.get(s.request_id, [])[:len(s.output_token_ids)] for s in seqs}

    engine.runner.verify = recorded_verify
    engine.runner.decode = recorded_decode
    monkeypatch.setattr(llm_engine, "accept_on_device", recorded_accept)
    return on_step, logits


@pytest.mark.parametrize(("path", "read"), [
    ("decode", "reference"), ("padded", "reference"),
    pytest.param("padded", "streamed", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))])
def test_chained_speculation_is_plain_greedy_to_the_logit(sharp_gqa24, monkeypatch, path, read):
    """Greedy requests with speculation under asynchronous scheduling chain every decode step: the
    next is planned and launched before the one in flight is read back, fed that step's last
    token on the device, with drafts proposed as if it kept all of its own, and its positions
    moved back on the device by what it did not keep. Three repetitive prompts and drafts of up to
    4, never paused: the same tokens as plain greedy, every emitted token's logits within 1e-4 of
    a one-shot forward (a token fed at the position a kept-all premise gave it, or a rejected
    draft's slot left in the table, would show), with drafts both kept and lost, every step but
    the prompt's and the last left in flight, and every block back. `path` and `read` as in the
    test above, with prefix caching on."""
    from conftest import assert_logits_match_reference, run_until_done
    from test_cache_properties import check_drained

    from nanolab import SamplingParams
    from nanolab.engine.buckets import DecodeBuckets

    prompts = repetitive_prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = spec_engine(sharp_gqa24, None)
    want = [s.output_token_ids for s in plain.add_requests(prompts, [params] * 3)]
    run_until_done(plain)
    engine = spec_engine(sharp_gqa24, None, read=read, async_scheduling=True, enable_prefix_caching=True,
                         speculative_config={"num_speculative_tokens": 4, "max_draft_backoff": 0})
    if path == "padded":
        engine.runner.buckets = DecodeBuckets.default(engine.kv_cache.max_rows, engine.kv_cache.max_width, min_width=16)
    on_step, logits = chained_logits(engine, monkeypatch)
    seqs = engine.add_requests(prompts, [params] * 3)
    calls, overlapped = step_chain(engine, on_step)
    assert [s.output_token_ids for s in seqs] == want
    assert_logits_match_reference(sharp_gqa24, seqs, logits(seqs))
    assert 0 < engine.spec_accepted_tokens < engine.spec_draft_tokens, "no verify step both kept and lost drafts"
    # what /metrics reports is the sum of what each request kept and was fed
    assert (engine.spec_accepted_tokens, engine.spec_draft_tokens) == (
        sum(s.num_accepted_tokens for s in seqs), sum(s.num_draft_tokens for s in seqs))
    assert overlapped == calls - 2 and calls < len(want[0]) - 1
    check_drained(engine.kv_cache, engine.scheduler)


def test_links_without_drafts_run_as_plain_decode_steps_inside_the_chain(sharp_gqa24, monkeypatch):
    """A chained step with no drafts after one with none runs as a plain decode step and stays in
    the chain. Lookups that find drafts at one step in four give every transition: a verify
    step, a step without drafts after it (still the verify path: its positions wait on what the
    one before kept), a plain link, and a verify step after a link, fed the link's token on the
    device. The same tokens as plain greedy, every logit within 1e-4 of a one-shot forward, every
    step but the prompt's and the last in flight, and every block back."""
    from conftest import assert_logits_match_reference, run_until_done
    from test_cache_properties import check_drained

    from nanolab import SamplingParams

    prompts = repetitive_prompts(0)
    # Lengths apart, so that rows leave the batch while the chain runs on (a link gathers the rest).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 13, 30)]
    plain = spec_engine(sharp_gqa24, None)
    want = [s.output_token_ids for s in plain.add_requests(prompts, params)]
    run_until_done(plain)
    engine = spec_engine(sharp_gqa24, None, async_scheduling=True,
                         speculative_config={"num_speculative_tokens": 4, "max_draft_backoff": 0})
    on_step, logits = chained_logits(engine, monkeypatch)
    lookup, kinds, links = engine._lookup, [], [0]
    engine._lookup = lambda seq, k, tail=None: [] if engine.num_steps % 4 else lookup(seq, k, tail)
    launch, launch_chained = engine._launch, engine._launch_chained

    def launched(*args, **kwargs):  # what the engine ran, not what this test expects it to run
        links[0] += bool(kwargs.get("chained"))
        return launch(*args, **kwargs)

    def recorded(seqs, drafts, assumed, guesses, prev):
        before = links[0]
        out = launch_chained(seqs, drafts, assumed, guesses, prev)
        kinds.append(("link" if links[0] > before else "verify", prev is not None and any(prev.drafts),
                      prev is not None and len(seqs) < len(prev.seqs)))
        return out

    engine._launch, engine._launch_chained = launched, recorded
    seqs = engine.add_requests(prompts, params)
    calls, overlapped = step_chain(engine, on_step)
    assert [s.output_token_ids for s in seqs] == want
    assert_logits_match_reference(sharp_gqa24, seqs, logits(seqs))
    links = [i for i, (kind, _, _) in enumerate(kinds) if kind == "link"]
    assert links and any(kinds[i + 1][0] == "verify" for i in links if i + 1 < len(kinds)), kinds
    assert any(kind == "verify" and after_drafts for kind, after_drafts, _ in kinds)
    assert any(kind == "link" and lost for kind, _, lost in kinds), "no link gathered the rows left"
    assert overlapped >= calls - 4  # the prompt's step, and each request's end, may read back with nothing launched
    check_drained(engine.kv_cache, engine.scheduler)


def check_pauses(steps: list[int], cap: int) -> None:
    """`steps`, the steps at which a request that never kept a draft looked its drafts up: after
    the i-th, a pause of b = min(2 ** i, cap) steps, ending on a step numbered a multiple of b, so
    the next lookup is b + 1 to 2b steps later, at a multiple of b."""
    for i, (a, c) in enumerate(zip(steps, steps[1:])):
        b = min(2 ** i, cap)
        assert b < c - a <= 2 * b and c % b == 0, (i, a, c, b)


def test_a_request_whose_drafts_fail_stops_speculating_and_the_steps_overlap_again(sharp_gqa24, monkeypatch):
    """Two sampled requests at once (top_k 1: greedy's tokens, drafts verified by rejection
    sampling, so their verify steps run synchronously; greedy rows chain instead, below). The
    proposer offers the first only tokens greedy never picks here and the second the tokens greedy
    will pick. The first's drafts pause after each verify step, at least 1, 2, 4 then 8 steps
    (`check_pauses`), while the second goes on speculating and keeping every draft; over
    `max_num_seqs` = 1, neither gets any. While nothing can speculate, steps overlap under
    asynchronous scheduling (a step is left in flight), and through every switch the tokens are
    plain greedy's (an overlapped step's logits are not kept)."""
    from conftest import run_until_done

    from nanolab import SamplingParams
    from nanolab.engine import llm_engine

    prompts = repetitive_prompts(1, n=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = spec_engine(sharp_gqa24, None)
    want = [s.output_token_ids for s in plain.add_requests(prompts, [params] * 2)]
    run_until_done(plain)
    wrong = next(t for t in range(3, 320) if t not in {t for out in want for t in out})

    def propose(tokens, k, *args):  # the first request: wrong tokens; the second: greedy's own
        right = tokens[:len(prompts[1])] == prompts[1]
        done = len(tokens) - len(prompts[1])
        return want[1][done:done + k] if right else [wrong] * k

    monkeypatch.setattr(llm_engine, "propose_ngram", propose)
    for max_rows in (8, 1):
        engine = spec_engine(sharp_gqa24, 2, async_scheduling=True, speculative_config={
            "num_speculative_tokens": 2, "max_num_seqs": max_rows, "max_draft_backoff": 8})
        sampled = SamplingParams(temperature=0.8, top_k=1, max_tokens=20, ignore_eos=True)
        seqs, overlapped, verified = engine.add_requests(prompts, [sampled] * 2), 0, []
        while engine.has_unfinished_requests():
            drafts, step = seqs[0].num_draft_tokens, engine.num_steps
            engine.step()
            overlapped += engine._inflight is not None
            if seqs[0].num_draft_tokens > drafts:
                verified.append(step)
        assert [s.output_token_ids for s in seqs] == want
        assert overlapped > 5
        first, second = seqs
        assert first.num_accepted_tokens == 0 and first.num_draft_tokens == 2 * len(verified)
        check_pauses(verified, 8)
        assert (len(verified) >= 4) == (max_rows > 1)
        assert second.num_accepted_tokens == second.num_draft_tokens
        assert (second.num_draft_tokens > 4) == (max_rows > 1)


@pytest.mark.parametrize("top_k", [None, 1], ids=["greedy", "top_k 1"])
def test_a_request_whose_lookup_finds_no_match_pauses_it_and_the_steps_overlap(sharp_gqa24, monkeypatch, top_k):
    """Prompt lookup that never matches, for a request sampled with top_k 1 (whose verify steps
    would run synchronously), is a miss as a verify step that keeps nothing is: the request looks
    up drafts at a step, then pauses at least 1, 2, 4, 8, 8 ... steps (`check_pauses`). A greedy
    request's steps chain, and a chained step overlaps with or without drafts, so its misses pause
    nothing: it looks up at every decode step. Either way the lookup that finds nothing runs before
    the step, over the tokens the request has (and, chained, the drafts of the step in flight), so
    no step runs synchronously for it: every decode step is left in flight. The tokens are plain
    greedy's."""
    from conftest import run_until_done

    from nanolab import SamplingParams
    from nanolab.engine import llm_engine

    prompt = repetitive_prompts(1, n=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = spec_engine(sharp_gqa24, None)
    want = plain.add_requests(prompt, [params])[0]
    run_until_done(plain)
    engine = spec_engine(sharp_gqa24, 2, async_scheduling=True, speculative_config={
        "num_speculative_tokens": 2, "max_draft_backoff": 8})
    looked = []

    def propose(tokens, k, *args):  # no match, ever
        looked.append(engine.num_steps)
        return []

    monkeypatch.setattr(llm_engine, "propose_ngram", propose)
    asked = params if top_k is None else SamplingParams(temperature=0.8, top_k=top_k, max_tokens=40, ignore_eos=True)
    seq, calls, overlapped = engine.add_requests(prompt, [asked])[0], 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        calls += 1
        overlapped += engine._inflight is not None
    assert seq.output_token_ids == want.output_token_ids
    if top_k is None:  # chained: a lookup at every decode step, the last one's (which ends the request) aside
        assert looked == list(range(looked[0], looked[0] + len(looked))) and len(looked) >= 38
    else:
        check_pauses(looked, 8)
    # every decode step overlapped: only the call of the prompt step and the last read-back left none in flight
    assert len(looked) >= 5 and overlapped == calls - 2
    assert seq.num_draft_tokens == 0


def test_until_a_draft_is_kept_a_request_takes_only_longer_matches(sharp_gqa24):
    """A request none of whose drafts has been kept yet looks up matches of at least
    `min_until_kept` tokens (two by default), so its last token alone, repeated from earlier, gives
    no draft; once one is kept, matches as short as `prompt_lookup_min` count."""
    from nanolab import SamplingParams
    from nanolab.config import SpeculativeConfig

    params = SamplingParams(temperature=0, max_tokens=8)
    engine = spec_engine(sharp_gqa24, 4)
    one, two = engine.add_requests([[7, 8, 9, 10, 7], [7, 8, 9, 10, 7, 8]], [params] * 2)
    assert engine._lookup(one, 4) == [] and engine._lookup(two, 4) == [9, 10, 7, 8]
    one.num_accepted_tokens = 1  # a verify step kept one of its drafts
    assert engine._lookup(one, 4) == [8, 9, 10, 7]
    loose = spec_engine(sharp_gqa24, 4, speculative_config={"num_speculative_tokens": 4,
                                                              "prompt_lookup_min_until_kept": 1})
    assert loose._lookup(loose.add_request([7, 8, 9, 10, 7], params), 4) == [8, 9, 10, 7]
    assert SpeculativeConfig(prompt_lookup_min=3).min_until_kept == 3
    assert SpeculativeConfig(prompt_lookup_max=1).min_until_kept == 1
    for bad, message in (({"prompt_lookup_min": 2, "prompt_lookup_min_until_kept": 1}, "an int >= 2"),
                         ({"prompt_lookup_min_until_kept": 5}, "at most prompt_lookup_max")):
        with pytest.raises(ValueError, match=f"prompt_lookup_min_until_kept=.*{message}"):
            SpeculativeConfig(**bad)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_stops_where_plain_decoding_stops_and_under_a_small_pool(sharp_gqa24, async_scheduling):
    """EOS inside a kept run of drafts ends the request there (what follows is dropped), max_tokens
    is never passed, a pool too small to feed the drafts decodes one token a row, and two sampled
    requests run to their length: one seeded (no drafts), one with top_k 1, which verifies its
    drafts by rejection sampling and so emits greedy's tokens; every block comes back. Under
    asynchronous scheduling the greedy rows chain once the sampled ones have ended."""
    from conftest import run_until_done
    from test_cache_properties import check_drained

    from nanolab import SamplingParams

    prompts = repetitive_prompts(1, 4)
    plain = spec_engine(sharp_gqa24, None)
    want = plain.add_requests(prompts, [SamplingParams(temperature=0, max_tokens=15)] * 4)
    run_until_done(plain)
    for blocks in (96, 24):
        # Matches of one token count from the start: the sampled row's output repeats only single
        # tokens early on, and its drafts are what this test verifies by rejection sampling.
        engine = spec_engine(sharp_gqa24, 3, num_blocks=blocks, max_num_seqs=4, async_scheduling=async_scheduling,
                             speculative_config={"num_speculative_tokens": 3, "prompt_lookup_min_until_kept": 1})
        seqs = engine.add_requests(prompts, [SamplingParams(temperature=0, max_tokens=15)] * 4)
        sampled = engine.add_request(prompts[0], SamplingParams(temperature=0.8, seed=3, max_tokens=11))
        top1 = engine.add_request(prompts[1], SamplingParams(temperature=0.8, top_k=1, max_tokens=15))
        budget = []  # (drafts a verify step feeds a row, tokens its max_tokens leaves it), on the synchronous path
        verify = engine.runner.verify

        def recorded(rows, counts, *args, _budget=budget, _verify=verify, **kw):
            # a row's drafts sit at the end of its output while the step runs (`_run_speculative`)
            _budget.extend((n - 1, s.params.max_tokens - len(s.output_token_ids) + n - 1) for s, n in zip(rows, counts))
            return _verify(rows, counts, *args, **kw)

        engine.runner.verify = recorded
        run_until_done(engine)
        if not async_scheduling:  # a chained step feeds ahead of outputs the host has not read back yet
            # the drafts leave room for the token the step adds after them
            assert budget and all(d <= left - 1 for d, left in budget), f"drafts past max_tokens: {budget}"
            assert any(0 < d == left - 1 for d, left in budget), "no verify step's drafts were cut to max_tokens"
        assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in want]
        assert [s.finish_reason for s in seqs] == [s.finish_reason for s in want]
        assert len(sampled.output_token_ids) == 11 and top1.output_token_ids == want[1].output_token_ids
        assert blocks < 96 or top1.num_draft_tokens > 0
        check_drained(engine.kv_cache, engine.scheduler)


def test_a_seeded_sampled_request_keeps_its_seeds_tokens_beside_speculating_rows(sharp_gqa24):
    """Temperature 0.8 with a seed: the same tokens alone without speculation, alone with it, and
    beside a greedy repetitive request that speculates (verify steps run with the seeded row in
    them). Rejection sampling would draw from its generator otherwise than a plain step, so the
    seeded row gets no drafts."""
    from conftest import run_until_done

    from nanolab import SamplingParams

    prompt, other = repetitive_prompts(5, 2)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    runs, verify_steps, drafted = [], [], []
    for k, beside in ((None, False), (4, False), (4, True)):
        engine = spec_engine(sharp_gqa24, k, **({} if k is None else {"speculative_config": {
            "num_speculative_tokens": k, "max_draft_backoff": 0}}))
        seq = engine.add_request(prompt, seeded)
        if beside:
            engine.add_request(other, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        run_until_done(engine)
        runs.append(seq.output_token_ids)
        verify_steps.append(engine.spec_steps)
        drafted.append(seq.num_draft_tokens)
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 20
    assert verify_steps[2] > 0 and drafted == [0, 0, 0]  # the seeded row shared verify steps, with no drafts


def test_a_verify_step_feeds_no_more_tokens_than_the_budget(sharp_gqa24):
    """With a budget of 3 tokens a step and two rows, drafts are cut so that no step feeds more than
    3 tokens; the tokens stay plain greedy's."""
    from conftest import run_until_done

    from nanolab import SamplingParams

    prompts = repetitive_prompts(2, 2)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    plain = spec_engine(sharp_gqa24, None, max_num_batched_tokens=3)
    want = plain.add_requests(prompts, params)
    run_until_done(plain)
    engine = spec_engine(sharp_gqa24, None, max_num_batched_tokens=3, speculative_config={
        "num_speculative_tokens": 4, "max_draft_backoff": 0})
    seqs = engine.add_requests(prompts, params)
    fed = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        fed.append(engine.last_step.tokens if engine.last_step else 0)
    assert not engine.has_unfinished_requests() and engine.spec_steps > 0
    assert max(fed) <= 3, fed
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in want]


def test_speculative_config_is_checked():
    from nanolab import EngineConfig

    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens=0"):
        EngineConfig(speculative_config={"num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config={"k": 2})
    with pytest.raises(ValueError, match="speculative_config.method='eagle'"):
        EngineConfig(speculative_config={"method": "eagle"})
    for backoff in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="speculative_config.max_draft_backoff"):
            EngineConfig(speculative_config={"max_draft_backoff": backoff})
    assert EngineConfig(speculative_config={}, async_scheduling=True).async_scheduling
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 2, "max_num_seqs": 4}'])
    spec = EngineConfig.from_cli_args(args).speculative_config
    assert (spec.num_speculative_tokens, spec.max_num_seqs, spec.method) == (2, 4, "ngram")


@pytest.mark.slow
def test_speculative_greedy_on_smollm2_is_plain_greedy(smollm2_path):
    """Real text: SmolLM2 asked to repeat a code edit, greedy, 40 tokens, without drafts, with
    drafts of up to 4 in synchronous verify steps, and chained (asynchronous scheduling, up to 8
    drafts over matches of two tokens, plain links where a lookup finds none): the same tokens,
    and some drafts kept (fewer steps)."""
    from nanolab import LLM, SamplingParams

    code = "def area(width, height):\n    return width * height\n\ndef perimeter(width, height):\n" \
           "    return 2 * (width + height)\n"
    prompt = [{"role": "user", "content": f"Rename width to w in this code and print it again:\n{code}"}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    arms = {"plain": (None, False), "sync": ({"num_speculative_tokens": 4}, False),
            "chained": ({"num_speculative_tokens": 8, "prompt_lookup_min": 2}, True)}
    for arm, (spec, overlap) in arms.items():
        llm = LLM("smollm2-135m", device="cpu", speculative_config=spec, async_scheduling=overlap)
        engine, links = llm.engine, [0]
        launch = engine._launch

        def counted(*args, launch=launch, links=links, **kwargs):  # the plain links the engine ran
            links[0] += bool(kwargs.get("chained"))
            return launch(*args, **kwargs)

        engine._launch = counted
        seq = engine.add_request(llm.tokenizer.encode_chat(prompt), params)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        runs[arm] = (seq.output_token_ids, steps, links[0])
        llm.close()
    for arm in ("sync", "chained"):
        assert runs[arm][0] == runs["plain"][0], arm
        assert runs[arm][1] < runs["plain"][1], f"{arm}: no draft was kept"
    assert runs["chained"][2] > 0, "no plain link ran"


def test_a_row_asking_for_logprobs_gets_them_beside_speculating_rows(sharp_gqa24):
    """A row that asks for logprobs gets no drafts, but its steps may be speculative ones for the
    rows beside it: it still gets one entry per token, the reference's log-probabilities."""
    from conftest import run_until_done
    from test_logprobs import assert_positions, reference

    from nanolab import SamplingParams

    prompts = repetitive_prompts(2, 2)
    engine = spec_engine(sharp_gqa24, 4)
    want, other = engine.add_requests(prompts, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                               logprobs=2),
                                                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    run_until_done(engine)
    assert engine.spec_steps > 0
    ref = reference(sharp_gqa24, want.prompt_token_ids + want.output_token_ids)
    n = len(want.prompt_token_ids)
    assert_positions(want.output_logprobs, ref[n - 1:-1], want.output_token_ids, 2, "output token")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_verify_steps_replay_decode_graphs_on_cuda(sharp_gqa24, monkeypatch, compiled):
    """On CUDA with graphs: speculating, every verify step replays a decode graph (a batch row a fed
    token), the tokens equal plain greedy's, and every emitted token's logits are within 1e-3 of
    the plain run's (fp32 weights, TF32 off)."""
    from nanolab import LLM, SamplingParams

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    prompts = repetitive_prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for k in (None, 4):
        # 16 rows: a verify step of the three prompts' 5 tokens each fits a decode bucket
        llm = LLM(str(sharp_gqa24.path), device="cuda", dtype="float32", max_num_seqs=16, num_blocks=96,
                  block_size=4, compile=compiled, async_scheduling=False, enable_prefix_caching=False,
                  speculative_config=None if k is None else {"num_speculative_tokens": k})
        engine, logits, verify_graphs = llm.engine, {}, []
        seqs = engine.add_requests(prompts, [params] * len(prompts))
        while engine.has_unfinished_requests():
            spec = engine.spec_steps
            for out in engine.step():
                logits.setdefault(out.seq.request_id, []).append(out.logits.float().cpu())
            if engine.spec_steps > spec:
                verify_graphs.append(engine.last_step.graph)
        runs[k] = ([s.output_token_ids for s in seqs], [torch.stack(logits[s.request_id]) for s in seqs])
        if k:
            assert verify_graphs and all(verify_graphs), verify_graphs
            assert engine.spec_accepted_tokens > 0
        llm.close()
    assert runs[4][0] == runs[None][0]
    for on, off in zip(runs[4][1], runs[None][1], strict=True):
        torch.testing.assert_close(on, off, rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode graphs need a CUDA device")
@pytest.mark.parametrize(("compiled", "delay"), [(False, False), (False, True), (True, False)],
                         ids=["eager", "eager-delayed", "compiled"])
def test_chained_speculation_replays_decode_graphs_on_cuda(sharp_gqa24, monkeypatch, compiled, delay):
    """On CUDA with graphs and asynchronous scheduling, greedy speculation chains: every step after
    the prompt's is launched before the one before it is read back and replays a decode graph, its
    positions moved back on the device. The tokens equal plain greedy's, and every emitted token's
    logits are within 1e-3 of the plain run's (fp32 weights, TF32 off), with drafts kept and lost.
    Nothing here waits for the device between steps; with `delay`, a spin kernel of about a
    millisecond runs before every replay, so the host plans each step well ahead of the device
    and a staging buffer reused too early, or a read-back taken before its step ends, shows."""
    from conftest import run_until_done

    from nanolab import LLM, SamplingParams

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    prompts = repetitive_prompts(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, num_blocks=96, block_size=4, compile=compiled)
    plain = LLM(str(sharp_gqa24.path), async_scheduling=False, **kw)
    logits: dict[int, list[torch.Tensor]] = {}
    seqs = plain.engine.add_requests(prompts, [params] * len(prompts))
    run_until_done(plain.engine, on_step=lambda outs: [logits.setdefault(o.seq.request_id, []).append(
        o.logits.float().cpu()) for o in outs])
    want = ([s.output_token_ids for s in seqs], [torch.stack(logits[s.request_id]) for s in seqs])
    plain.close()
    llm = LLM(str(sharp_gqa24.path), async_scheduling=True, **kw,
              speculative_config={"num_speculative_tokens": 4, "max_draft_backoff": 0})
    engine = llm.engine
    on_step, chained = chained_logits(engine, monkeypatch)
    if delay:
        replay = engine.runner.graphs.replay

        def delayed(*args, **kwargs):
            torch.cuda._sleep(2_000_000)  # clock cycles: about a millisecond
            return replay(*args, **kwargs)

        monkeypatch.setattr(engine.runner.graphs, "replay", delayed)
    seqs, graphed = engine.add_requests(prompts, [params] * len(prompts)), []
    while engine.has_unfinished_requests():
        on_step(engine.step())
        if engine.in_flight:
            graphed.append(engine.runner.last_decode[1])
    got = chained(seqs)
    assert [s.output_token_ids for s in seqs] == want[0]
    for seq, expected in zip(seqs, want[1], strict=True):
        torch.testing.assert_close(torch.stack(got[seq.request_id]).float().cpu(), expected, rtol=1e-3, atol=1e-3)
    assert graphed and all(graphed), graphed
    assert 0 < engine.spec_accepted_tokens < engine.spec_draft_tokens
    llm.close()


def kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs Triton: a GPU or its interpreter")
@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 2**31))
def test_the_acceptance_kernel_keeps_what_greedy_accept_keeps(counts, seed):
    """`kernels.chain.accept_drafts` and the engine's torch path (`accept_on_device` without fed
    tokens) against `greedy_accept` row by row: random greedy choices over a vocabulary of 3, so
    drafts match at random, each row's first fed token not compared."""
    from nanolab.engine.llm_engine import accept_on_device

    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    best = torch.randint(0, 3, (total,), generator=g)
    fed = torch.randint(0, 3, (total,), generator=g)
    logits = torch.nn.functional.one_hot(best, 5).float()  # argmax: best
    loc = list(itertools.accumulate(counts, initial=0))
    drafts = [fed[a + 1: b].tolist() for a, b in zip(loc, loc[1:])]
    want = [greedy_accept(best[a: b].tolist(), d) for a, b, d in zip(loc, loc[1:], drafts)]
    dev = kernel_device()
    for result, shift in (accept_on_device(logits.to(dev), drafts, counts, fed.to(dev)),
                          accept_on_device(logits, drafts, counts)):
        kept, last = result.cpu().tolist()
        assert [d[:a] + [t] for d, a, t in zip(drafts, kept, last)] == want
        assert shift.cpu().tolist() == [a - len(d) for a, d in zip(kept, drafts)]


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs Triton: a GPU or its interpreter")
def test_the_shift_kernel_moves_each_token_back_by_its_rows_shift():
    """`kernels.chain.shift_step` on a hand-made plan of 5 tokens over two rows continuing rows 1
    and 0 of the step before, whose shifts are 0 and -2 and last tokens 7 and 9: positions and
    context lengths move by their row's shift, write slots are read again from the block table,
    and each row's first token becomes its last token."""
    from nanolab.kernels.chain import shift_step

    dev = kernel_device()
    block_size = 4
    table = torch.tensor([[5, 6, 7], [2, 3, 4], [-1, -1, -1]], dtype=torch.int32, device=dev)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    src, head = t([1, 1, 1, 0, 0]), t([1, 0, 0, 1, 0])  # tokens 0-2 continue row 1, 3-4 row 0
    rows = t([0, 0, 0, 1, 1])  # their cache rows
    positions, lens = t([6, 7, 8, 9, 10]), t([7, 8, 9, 10, 11])
    slots, ids = t([0] * 5), t([0, 41, 42, 0, 43])
    shift_step(src, head, t([-2, 0]), t([9, 7]), positions, lens, rows, slots, ids, table, block_size)
    assert positions.tolist() == [6, 7, 8, 7, 8] and lens.tolist() == [7, 8, 9, 8, 9]
    # row 0's blocks 5, 6, 7 and row 1's 2, 3, 4: slot = block * 4 + position % 4
    assert slots.tolist() == [6 * 4 + 2, 6 * 4 + 3, 7 * 4 + 0, 3 * 4 + 3, 4 * 4 + 0]
    assert ids.tolist() == [7, 41, 42, 9, 43]


def test_a_draft_the_target_gives_no_probability_is_never_kept(monkeypatch):
    """torch.rand may return exactly 0.0: a draft kept with probability 0 must still be rejected."""
    import nanolab.spec_decode as spec_decode

    monkeypatch.setattr(spec_decode.torch, "rand", lambda *a, **k: torch.tensor(0.0))
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    assert rejection_sample(p, [0])[0] != 0


def test_a_rejected_draft_the_draft_model_gave_no_probability_draws_from_the_target():
    """p == q with q(d) == 0: the draft is rejected, max(p - q, 0) is empty, and the token comes from
    p itself, not from a 0/0 distribution."""
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    assert rejection_sample(p, [0], p[:1].clone(), torch.Generator().manual_seed(0))[0] == 1


@pytest.mark.parametrize("extra", [18, 21])
def test_a_verify_step_never_feeds_the_contexts_last_position(sharp_gqa24, extra):
    """A token at position max_model_len - 1 has no successor to sample: drafts stop one short of
    the context, and the request still ends holding the whole context."""
    from conftest import run_until_done

    from nanolab import SamplingParams

    prompt = repetitive_prompts(1, 1)[0]
    context = len(prompt) + extra
    engine = spec_engine(sharp_gqa24, None, max_model_len=context, async_scheduling=False,
                         speculative_config={"num_speculative_tokens": 4, "max_draft_backoff": 0,
                                             "prompt_lookup_min_until_kept": 1})
    fed, verify = [], engine.runner.verify

    def spy(seqs, counts, *args, **kwargs):
        fed.extend(s.num_tokens for s in seqs)  # a row's drafts are in its tokens while it is verified
        return verify(seqs, counts, *args, **kwargs)

    engine.runner.verify = spy
    seq = engine.add_request(prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=None))
    run_until_done(engine)
    assert engine.spec_steps > 0 and seq.num_tokens == context
    assert max(fed) <= context - 1, fed
