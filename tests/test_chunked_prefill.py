"""Chunked prefill: prompts fed a chunk at a time under a token budget, beside decode rows, in one
varlen forward a step.

- Parity: greedy tokens and every step's logits with budgets of 5 and 7 tokens (chunks end in
  the middle of 4-token blocks) equal the whole-prompt engine's and a one-shot HF forward's, on a
  model whose output depends on what it reads (conftest's sharp models).
- A decode row's logits in a mixed step equal the same row's in a decode-only step.
- The scheduler, driven without a model over random arrivals, aborts and injected failures: the
  budget holds, every prompt token is fed exactly once between preemptions, decode rows are never
  starved by a prompt, nothing leaks, and the step after an admission never preempts.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, make_cache, needs_smollm2, run_until_done
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.block_manager import cdiv
from nanolab.engine.scheduler import Scheduler
from nanolab.engine.sequence import Sequence, SequenceStatus
from nanolab.kernels import INTERPRETED
from nanolab.lab.reference import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = 4
READS = ["reference",
         pytest.param("streamed", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))]


def prompts(lengths=(3, 9, 14, 22, 1), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(engine: Engine, prompt_list, new_tokens: int = 8):
    """Every request's greedy tokens and per-step logits, and each step's phase and tokens fed."""
    logits, keep = logit_recorder()
    seqs = [engine.add_request(p, greedy(new_tokens)) for p in prompt_list]
    steps = []

    def on_step(outputs):
        keep(outputs)
        steps.append((engine.last_step.phase, engine.last_step.tokens))

    run_until_done(engine, on_step=on_step)
    return seqs, logits, steps


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("budget", [5, 7])
def test_chunked_equals_whole_prompts_and_hf(sharp_gqa24, budget, read):
    sharp = sharp_gqa24
    whole_seqs, whole_logits, whole_steps = run(
        Engine(sharp.model, EngineConfig(num_blocks=64, block_size=BLOCK, read=read,
                                         enable_chunked_prefill=False)), prompts())
    engine = Engine(sharp.model, EngineConfig(num_blocks=64, block_size=BLOCK, read=read,
                                              max_num_batched_tokens=budget))
    seqs, logits, steps = run(engine, prompts())
    assert {p for p, _ in whole_steps} == {"prefill", "decode"}
    assert "mixed" in {p for p, _ in steps}, "no step ran a chunk beside decode rows"
    assert all(tokens <= budget for _, tokens in steps), "a step fed more tokens than its budget"
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in whole_seqs]
    for a, b in zip(seqs, whole_seqs):
        torch.testing.assert_close(torch.stack(logits[a.request_id]), torch.stack(whole_logits[b.request_id]),
                                   rtol=1e-4, atol=1e-4)
    assert_logits_match_reference(sharp, seqs, logits)
    for s in seqs[:2]:
        assert s.output_token_ids == hf_greedy(sharp.hf, s.prompt_token_ids, 8)
    assert engine.block_manager.allocator.num_free == 64


@needs_smollm2
def test_chunked_equals_whole_prompts_on_smollm2(smollm2_model):
    """The real model, 30 layers: prompts in chunks of 5 tokens (16-token blocks) beside decode rows."""
    vocab = smollm2_model.config.vocab_size
    g = torch.Generator().manual_seed(2)
    prompt_list = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 21, 13)]
    whole_seqs, whole_logits, _ = run(Engine(smollm2_model, EngineConfig(num_blocks=16, enable_chunked_prefill=False)),
                                      prompt_list, 4)
    seqs, logits, steps = run(Engine(smollm2_model, EngineConfig(num_blocks=16, max_num_batched_tokens=5)),
                              prompt_list, 4)
    assert "mixed" in {p for p, _ in steps}
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in whole_seqs]
    for a, b in zip(seqs, whole_seqs):
        ours, ref = torch.stack(logits[a.request_id]), torch.stack(whole_logits[b.request_id])
        torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_a_prompt_longer_than_the_budget_is_fed_in_chunks_and_sampled_once(sharp_gqa24):
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=7))
    (seq,) = [engine.add_request(prompts((22,))[0], greedy(3))]
    fed, outputs = [], []
    while engine.has_unfinished_requests():
        outputs.append(len(engine.step()))
        fed.append(engine.last_step.tokens)
    assert fed == [7, 7, 7, 1, 1, 1] and outputs == [0, 0, 0, 1, 1, 1]
    assert len(seq.output_token_ids) == 3


@pytest.mark.parametrize("read", READS)
def test_a_decode_row_in_a_mixed_step_reads_as_in_a_decode_step(sharp_gqa24, read):
    """Two engines, the same decode row: in one, the step that decodes it also feeds another
    request's prompt chunk (a mixed step); in the other it decodes alone (a decode-only step). Its
    logits must agree."""
    first, late = prompts((11, 13), seed=4)
    alone = Engine(sharp_gqa24.model, EngineConfig(num_blocks=64, block_size=BLOCK, read=read))
    mixed = Engine(sharp_gqa24.model, EngineConfig(num_blocks=64, block_size=BLOCK, read=read,
                                                   max_num_batched_tokens=6))
    rows = {}
    for engine in (alone, mixed):
        seq = engine.add_request(first, greedy(6))
        while not seq.output_token_ids:
            engine.step()
        if engine is mixed:
            engine.add_request(late, greedy(2))
        got = []
        for _ in range(3):
            outs = engine.step()
            got.append((engine.last_step.phase, next(o.logits.clone() for o in outs if o.seq is seq)))
        rows[engine is mixed] = got
    assert [p for p, _ in rows[False]] == ["decode"] * 3
    assert [p for p, _ in rows[True]] == ["mixed"] * 3  # 5 prompt tokens a step beside the decode row
    for (_, a), (_, b) in zip(rows[False], rows[True]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_forward_failure_mid_prefill_frees_everything(sharp_gqa24):
    engine = Engine(sharp_gqa24.model, EngineConfig(num_blocks=32, block_size=BLOCK, max_num_batched_tokens=5))
    long, short = engine.add_requests(prompts((17, 3), seed=5), [greedy(4), greedy(4)])
    engine.step()  # long's first chunk
    assert long.num_computed_tokens == 5 and not long.output_token_ids
    real = engine.runner.run_varlen

    def broken(*args):
        raise RuntimeError("injected")

    engine.runner.run_varlen = broken
    outs = engine.step()
    assert {o.seq for o in outs} == {long} or {o.seq for o in outs} == {long, short}
    assert long.finish_reason == "error" and long.row is None
    engine.runner.run_varlen = real
    run_until_done(engine)
    assert engine.block_manager.allocator.num_free == 32 and all(t is None for t in engine.block_manager.tables)


def test_engine_flag_and_budget_are_checked(tiny_model):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        Engine(tiny_model, EngineConfig(num_blocks=8, enable_chunked_prefill=1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(tiny_model, EngineConfig(num_blocks=8, max_num_batched_tokens=0))
    assert Engine(tiny_model, EngineConfig(num_blocks=8,
                                           max_num_batched_tokens=5)).scheduler.max_num_batched_tokens == 5
    # Without chunks a whole prompt must fit one step: the budget is raised to the context.
    whole = Engine(tiny_model, EngineConfig(num_blocks=8, max_num_batched_tokens=5, enable_chunked_prefill=False))
    assert whole.scheduler.max_num_batched_tokens == whole.max_model_len


# The scheduler alone: random arrivals, aborts and failures, with a fake forward.


class Driver:
    """Steps the chunked scheduler as `Engine.step` does, with random tokens for sampling. Keeps,
    for each request, the positions fed since its last (re)admission, to check each is fed once."""

    def __init__(self, num_blocks: int, max_rows: int, budget: int, seed: int) -> None:
        self.cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=BLOCK,
                                max_rows=max_rows)
        self.scheduler = Scheduler(self.cache.blocks, budget)
        self.budget = budget
        self.rng = random.Random(seed)
        self.seqs: list[Sequence] = []
        self.fed: dict[int, list[int]] = {}  # request id -> positions fed since admission
        self.admitted_last = False

    def add(self, prompt_len: int, max_tokens: int) -> None:
        seq = Sequence(len(self.seqs), [7] * prompt_len, SamplingParams(max_tokens=max_tokens))
        self.seqs.append(seq)
        self.scheduler.add(seq)

    def step(self, fail: str | None = None) -> None:
        sched = self.scheduler
        decoding = [s for s in sched.running if s.is_decoding]
        before = sched.num_preemptions
        out = sched.schedule()
        preempted = sched.num_preemptions - before
        assert out.num_tokens <= self.budget, "the step is over budget"
        if self.admitted_last:
            assert preempted == 0, "the step after an admission had to preempt"
        self.admitted_last = any(a == 0 for a in out.num_computed_tokens)
        # Decode rows first, every one of them while the budget allows: no prompt starves them.
        survivors = [s for s in decoding if s.status is SequenceStatus.RUNNING]
        n_decode = sum(out.decode)
        assert out.decode == sorted(out.decode, reverse=True), "a decode row came after a prompt chunk"
        assert n_decode == min(len(survivors), self.budget), "a running decode row got no token"
        if not out.seqs:
            return
        for s, a, n in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            if a == 0:
                self.fed[s.request_id] = []
            assert self.fed[s.request_id] == list(range(a)), "a chunk does not continue where the last ended"
            self.fed[s.request_id] += list(range(a, a + n))
        rows = [s.row for s in out.seqs]
        if out.decode_only:
            plan = self.cache.plan_decode(rows)
        else:
            plan = self.cache.plan_varlen(rows, out.num_scheduled_tokens, out.sampled)
        kv = torch.zeros(1, plan.write_slots.numel(), 1, 2)  # [rows * T] tokens either way
        self.cache.view(plan).write(0, kv, kv)
        if fail == "forward":  # Engine.step: the whole step's requests end
            for s in out.seqs:
                sched.finish(s, "error")
            return
        for s, due in zip(out.seqs, out.sampled):
            if not due:
                assert s.num_computed_tokens < s.num_tokens
                continue
            assert s.num_computed_tokens == s.num_tokens, "sampled before its last token was fed"
            if fail == "sample" and self.rng.random() < 0.5:  # one row's sampling raised
                sched.finish(s, "error")
                continue
            s.output_token_ids.append(3)
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.finish(s, "length")

    def check(self) -> None:
        sched, blocks = self.scheduler, self.cache.blocks
        owned = [b for t in blocks.tables if t is not None for b in t.blocks]
        assert len(owned) == len(set(owned)) and set(owned) == blocks.allocator.held()
        assert sorted(s.row for s in sched.running) == [r for r, t in enumerate(blocks.tables) if t is not None]
        for s in sched.running:
            assert blocks.table(s.row).num_tokens == s.num_computed_tokens <= s.num_tokens
        for s in sched.waiting:
            assert s.row is None and s.num_computed_tokens == 0


ADD = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 24))
STEP = st.tuples(st.just("step"), st.integers(1, 8), st.sampled_from([None, None, None, "forward", "sample"]))
ABORT = st.tuples(st.just("abort"), st.integers(0, 1 << 16))
# A burst of adds first, so that several requests grow together and the pool runs out.
OPS = st.builds(lambda first, rest: first + rest, st.lists(ADD, min_size=2, max_size=6),
                st.lists(st.one_of(ADD, STEP, ABORT), max_size=30))


@settings(max_examples=400, deadline=None)
@given(ops=OPS, num_blocks=st.integers(6, 16), max_rows=st.integers(1, 5), budget=st.integers(1, 24),
       seed=st.integers(0, 2**31))
def test_the_chunked_scheduler_keeps_its_promises(ops, num_blocks, max_rows, budget, seed):
    d = Driver(num_blocks, max_rows, budget, seed)
    for op in ops:
        if op[0] == "add":
            if cdiv(op[1] + op[2], BLOCK) <= num_blocks:  # Engine's request check
                d.add(op[1], op[2])
        elif op[0] == "step":
            d.step(op[2])  # a failure, if any, in the first step
            for _ in range(op[1] - 1):
                d.step()
                d.check()
        elif d.seqs:
            d.scheduler.abort(d.seqs[op[1] % len(d.seqs)])
        d.check()
    for _ in range(5000):
        if not d.scheduler.has_unfinished():
            break
        d.step()
        d.check()
    else:
        pytest.fail("the scheduler did not drain in 5000 steps")
    assert d.cache.blocks.allocator.num_free == num_blocks and all(t is None for t in d.cache.blocks.tables)
    for s in d.seqs:
        assert s.finished and (s.finish_reason != "length" or len(s.output_token_ids) == s.params.max_tokens)
    event("preempted" if d.scheduler.num_preemptions else "no preemption")
    event("chunked" if any(len(s.prompt_token_ids) > budget for s in d.seqs) else "no prompt over budget")
