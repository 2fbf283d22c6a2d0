"""Batch rows that are not their table rows: a decode batch's row i reads and writes the cache row
its request owns (`DecodePlan.table_rows`), whatever its place in the batch.

A fresh engine puts request i in batch row i and table row i, so an addressing that ignores
`table_rows` passes every test that only runs a batch from start to end. Here rows leave holes
and are reused (aborts), requests join into them (joins), the scheduler evicts and readmits
(preemption), and the batch order is reversed outright; every step's logits are checked against
a one-shot forward of the same tokens (conftest's `assert_logits_match_reference`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_logits_match_reference, bounded, logit_recorder, run_until_done

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.kernels import INTERPRETED

pytestmark = pytest.mark.usefixtures("one_thread")
READS = ["reference",
         pytest.param("streamed", marks=pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter"))]


def prompts(n: int, seed: int, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class Recorder:
    """on_step for the engine loop: keeps every step's logits and counts the decode steps in which
    some batch row's table row differs from its batch index. A decode step is one that built a
    DecodePlan (the cache's plan epoch moved); a prefill builds none."""

    def __init__(self, engine: Engine) -> None:
        self.logits, self._keep = logit_recorder()
        self.moved_steps = 0
        self._cache = engine.kv_cache
        self._epoch = self._cache.plan_epoch

    def __call__(self, outputs) -> None:
        self._keep(outputs)
        decode, self._epoch = self._cache.plan_epoch != self._epoch, self._cache.plan_epoch
        if decode and any(o.seq.row is not None and o.seq.row != i for i, o in enumerate(outputs)):
            self.moved_steps += 1


def step(engine: Engine, rec: Recorder) -> None:
    rec(engine.step())


@pytest.mark.parametrize("read", READS)
def test_aborts_leave_holes_that_joins_fill(sharp_model, read):
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=96, block_size=4, read=read))
    rec = Recorder(engine)
    seqs = [engine.add_request(p, greedy(14)) for p in prompts(6, seed=1)]
    for _ in range(3):
        step(engine, rec)
    # abort two middle requests: table rows 1 and 3 are freed, the batch closes ranks
    for s in (seqs[1], seqs[3]):
        engine.abort_request(s.request_id)
    for _ in range(2):
        step(engine, rec)
    # joiners take rows 1 and 3 but join the end of the batch
    late = [engine.add_request(p, greedy(10)) for p in prompts(3, seed=2)]
    assert [s.row for s in late] == [None] * 3
    step(engine, rec)  # their prefill
    assert sorted(s.row for s in late) == [1, 3, 6]
    run_until_done(engine, on_step=rec)
    assert rec.moved_steps > 0, "no decode step had a batch row away from its table row"
    assert_logits_match_reference(sharp_model, seqs + late, rec.logits)


@pytest.mark.parametrize("read", READS)
def test_joins_mid_run(sharp_model, read):
    """Requests join while others decode, some after a finished request freed its row."""
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=96, block_size=4, read=read))
    rec = Recorder(engine)
    first = [engine.add_request(p, greedy(n)) for p, n in zip(prompts(4, seed=3), (3, 12, 5, 12))]
    joined = []
    batches = iter(prompts(6, seed=4)[i:i + 2] for i in (0, 2, 4))
    steps = 0
    for _ in bounded(lambda: engine.has_unfinished_requests() or len(joined) < 6):
        step(engine, rec)
        steps += 1
        if steps in (2, 5, 7):
            joined.extend(engine.add_request(p, greedy(8)) for p in next(batches))
    assert rec.moved_steps > 0
    assert_logits_match_reference(sharp_model, first + joined, rec.logits)


@pytest.mark.parametrize("read", READS)
def test_preemption_readmits_into_other_rows(sharp_model, read):
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=14, block_size=4, read=read))
    rec = Recorder(engine)
    seqs = [engine.add_request(p, greedy(16)) for p in prompts(5, seed=5, lo=6, hi=14)]
    run_until_done(engine, on_step=rec)
    assert engine.scheduler.num_preemptions > 0
    assert rec.moved_steps > 0
    assert_logits_match_reference(sharp_model, seqs, rec.logits)
    assert engine.block_manager.allocator.num_free == engine.kv_cache.num_blocks


@pytest.mark.parametrize("read", READS)
def test_reversed_batch_order(sharp_model, read):
    """The scheduler's running list reversed after the prefill: batch row i owns table row n-1-i."""
    engine = Engine(sharp_model.model, EngineConfig(num_blocks=96, block_size=4, read=read))
    rec = Recorder(engine)
    seqs = [engine.add_request(p, greedy(10)) for p in prompts(5, seed=6)]
    step(engine, rec)
    engine.scheduler.running.reverse()
    run_until_done(engine, on_step=rec)
    assert rec.moved_steps >= 8  # every decode step but the last, where all rows finish
    assert_logits_match_reference(sharp_model, seqs, rec.logits)
