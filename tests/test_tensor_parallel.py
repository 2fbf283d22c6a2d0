"""Tensor parallelism (issue 15): the shards, the follower's block tables, and whole groups of 2
processes on the gloo backend whose greedy tokens and logits equal one process's, in fp32.

The groups are real: `LLM(tensor_parallel_size=2)` spawns a worker process that joins over
`env://`, holds its own shard and its own KV heads' cache, and follows rank 0's steps.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import needs_smollm2

from nanolab import LLM, SamplingParams
from nanolab.engine.parallel import FollowerBlockManager, StepCall
from nanolab.lab.tpbench import PROMPTS, greedy_and_logits
from nanolab.model.config import PRESETS
from nanolab.model.llama import _fuse
from nanolab.model.parallel import TensorParallel, check_shardable, shard_state, split
from nanolab.model.weights import load_checkpoint, resolve_weights


@pytest.mark.parametrize("n,world", [(3, 2), (8, 2), (9, 4), (1, 1), (5, 5)])
def test_split_is_contiguous_covers_everything_and_is_as_even_as_it_can_be(n, world):
    shares = [split(n, world, r) for r in range(world)]
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
    sizes = [b - a for a, b in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("preset", ["tiny", pytest.param("smollm2-135m", marks=needs_smollm2)])
def test_the_shards_put_back_together_are_the_model(preset):
    """Every rank's slice, laid side by side along the split axis, is the whole weight: q/k/v by
    head (SmolLM2's 3 KV heads go 2 and 1, with 6 and 3 query heads), gate/up by intermediate
    column, o and down by input, embedding and head by vocabulary row, norms whole."""
    config = PRESETS[preset]
    path = resolve_weights(preset)
    whole = _fuse(load_checkpoint(path, config, dtype=torch.float32, device="cpu"), config)
    shards = [shard_state(dict(whole), config, TensorParallel(r, 2)) for r in range(2)]
    d = config.head_dim
    for name, w in whole.items():
        parts = [s[name] for s in shards]
        if name.endswith("qkv_proj.weight"):
            per = [TensorParallel(r, 2) for r in range(2)]
            qs = [p[: (t.q_heads(config)[1] - t.q_heads(config)[0]) * d] for p, t in zip(parts, per, strict=True)]
            rest = [p[q.shape[0]:] for p, q in zip(parts, qs, strict=True)]
            ks = [r[: r.shape[0] // 2] for r in rest]
            vs = [r[r.shape[0] // 2:] for r in rest]
            assert torch.equal(torch.cat([*qs, *ks, *vs]), w)
            assert [q.shape[0] // d for q in qs] == ([2, 2] if preset == "tiny" else [6, 3])
        elif name.endswith("gate_up_proj.weight"):
            gates = [p[: p.shape[0] // 2] for p in parts]
            ups = [p[p.shape[0] // 2:] for p in parts]
            assert torch.equal(torch.cat([*gates, *ups]), w)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), w)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(torch.cat(parts), w)
        else:
            assert all(torch.equal(p, w) for p in parts)


def test_a_group_larger_than_the_kv_heads_is_refused_by_name():
    with pytest.raises(ValueError, match="tensor_parallel_size=4: the model has 3 KV heads"):
        check_shardable(PRESETS["smollm2-135m"], 4)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM("tiny", device="cpu", tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tensor_parallel_size=3: the model has 2 KV heads"):
        LLM("tiny", device="cpu", tensor_parallel_size=3)


def test_a_follower_takes_rank_0s_blocks_and_chooses_none():
    blocks = FollowerBlockManager(num_blocks=16, block_size=4, max_rows=2)
    # Row 1 took 5 tokens into blocks 9 and 3; the next step adds 4, which rank 0 put in a new block 12.
    blocks.adopt(StepCall("varlen", rows=[1], blocks=[[9, 3]], tokens_before=[0]))
    blocks.grow([1], [5])
    assert blocks.take_new_entries() == {(1, 0): 9, (1, 1): 3}
    blocks.adopt(StepCall("varlen", rows=[1], blocks=[[9, 3, 12]], tokens_before=[5]))
    assert blocks.table(1).blocks == [9, 3] and blocks.table(1).num_tokens == 5
    blocks.grow([1], [4])
    assert blocks.table(1).blocks == [9, 3, 12] and blocks.table(1).num_tokens == 9
    assert blocks.take_new_entries() == {(1, 2): 12}
    assert blocks.allocator.num_free == 16, "a follower never allocates from its own pool"
    with pytest.raises(KeyError):
        blocks.grow([1], [4])  # a cell rank 0 sent no block for


def test_a_follower_puts_a_shared_prefix_into_its_device_table():
    """Rank 0 may start a row from cached blocks the worker never grew there: the worker stages
    those cells for its device table once, and only the cells it grows after that."""
    blocks = FollowerBlockManager(num_blocks=16, block_size=4, max_rows=2)
    blocks.adopt(StepCall("varlen", rows=[0], blocks=[[7, 2, 11]], tokens_before=[8]))  # 8 tokens shared
    blocks.grow([0], [3])
    assert blocks.take_new_entries() == {(0, 0): 7, (0, 1): 2, (0, 2): 11}
    blocks.adopt(StepCall("decode", rows=[0], blocks=[[7, 2, 11]], tokens_before=[11]))
    blocks.grow([0], [1])
    assert blocks.take_new_entries() == {}, "cells the device table already holds were staged again"


def _greedy(llm: LLM, new: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_and_logits(llm, PROMPTS, new)


@pytest.mark.parametrize("preset", ["tiny", pytest.param("smollm2-135m", marks=needs_smollm2)])
def test_two_gloo_ranks_decode_what_one_process_decodes(preset):
    """fp32 on the CPU: greedy tokens equal, and the prefill logits within float rounding of the
    all-reduce's different order of additions. SmolLM2's real weights make the tokens depend on
    what every layer reads; chunked prefill under an 8-token budget mixes prompt chunks with
    decode rows, so the follower adopts tables mid-prompt."""
    kw = dict(device="cpu", dtype="float32", num_blocks=64, max_num_batched_tokens=8)
    one_tokens, one_logits = _greedy(LLM(preset, **kw), 10)
    with LLM(preset, tensor_parallel_size=2, **kw) as two:
        assert two.model.num_kv_heads == (1 if preset == "tiny" else 2)
        two_tokens, two_logits = _greedy(two, 10)
    assert two_tokens == one_tokens
    for a, b in zip(two_logits, one_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_two_gloo_ranks_with_prefix_caching_decode_what_one_process_decodes():
    """Prefix caching under TP: rank 0 starts each prompt's second pass (the prefill logits read
    after generating) from the cached blocks of its first, and the worker reads them through cells
    it never grew. fp32: the same greedy tokens and prefill logits as one process without caching."""
    kw = dict(device="cpu", dtype="float32", num_blocks=64, block_size=4, max_num_batched_tokens=8)
    one_tokens, one_logits = _greedy(LLM("tiny", **kw), 10)
    with LLM("tiny", tensor_parallel_size=2, enable_prefix_caching=True, **kw) as two:
        two_tokens, two_logits = _greedy(two, 10)
        assert two.engine.scheduler.prefix_cache_hits > 0
    assert two_tokens == one_tokens
    for a, b in zip(two_logits, one_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _step_logits(llm: LLM, prompt: str, new: int, *, tokens: list | None = None) -> torch.Tensor:
    """Every step's logits of one greedy request, prefill and decode, [new, vocab]; its tokens are
    appended to `tokens` when given."""
    seq = llm.engine.add_request(llm.tokenizer.encode(prompt),
                                 SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    rows = []
    while llm.engine.has_unfinished_requests():
        rows += [out.logits.clone() for out in llm.engine.step() if out.seq is seq and out.logits is not None]
    if tokens is not None:
        tokens.extend(seq.output_token_ids)
    return torch.stack(rows)


def test_two_gloo_ranks_with_inductor_decode_what_one_eager_process_decodes():
    """`compile=True` compiles every rank's decode step (dynamo turns the in-place all-reduce and
    all-gather into traceable collectives): each decode step's logits equal one eager process's
    within float rounding."""
    kw = dict(device="cpu", dtype="float32", num_blocks=64)
    one = _step_logits(LLM("tiny", **kw), PROMPTS[0], 6)
    with LLM("tiny", tensor_parallel_size=2, compile=True, **kw) as two:
        assert two.compiled and two.engine.runner.forward is not two.model
        got = _step_logits(two, PROMPTS[0], 6)
    torch.testing.assert_close(got, one, atol=1e-4, rtol=1e-4)


def test_two_gloo_ranks_with_asynchronous_scheduling_decode_what_one_process_decodes():
    """Asynchronous scheduling under TP: rank 0 launches decode step t + 1 before it reads step t
    back, and each step's ids reach the worker by a broadcast over the group, never through the
    host. fp32: every greedy token equals one synchronous process's. A worker reads its ids only
    in its share of the embedding, so the model is tiny, whose random tokens land in both ranks'
    halves of the vocabulary (SmolLM2's English stays mostly in rank 0's)."""
    kw = dict(device="cpu", dtype="float32", num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.token_ids for o in LLM("tiny", **kw).generate(PROMPTS, params)]
    vocab = LLM("tiny", **kw).config.vocab_size
    assert any(t >= vocab // 2 for row in one for t in row), "no token in the worker's half of the vocabulary"
    with LLM("tiny", tensor_parallel_size=2, async_scheduling=True, **kw) as two:
        assert two.engine.async_scheduling
        got = [o.token_ids for o in two.generate(PROMPTS, params)]
    assert got == one


def test_two_gloo_ranks_speculating_decode_what_one_process_decodes():
    """Speculation under TP: each verify step is a decode step of a batch row per fed token, and the
    worker plans the same rows from rank 0's call (its fed tokens and counts). Prompts that repeat a
    phrase give prompt lookup drafts; fp32: every greedy token equals one process's without
    speculation, which a worker planning the step otherwise would not give."""
    kw = dict(device="cpu", dtype="float32", num_blocks=64, block_size=4)
    prompts = [list(range(5 + i, 11 + i)) * 3 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    one = [o.token_ids for o in LLM("tiny", **kw).generate(inputs, params)]
    with LLM("tiny", tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3, "max_draft_backoff": 0},
             **kw) as two:
        got = [o.token_ids for o in two.generate(inputs, params)]
        assert two.engine.spec_steps > 0 and two.engine.runner.last_decode[0] > 1
    assert got == one


def test_a_forward_that_fails_on_rank_0_ends_the_group_instead_of_hanging():
    """Rank 0's forward raises after its step went out, so the worker waits in a collective rank 0
    never joins: the request fails with the reason, the worker is ended, and every later request
    fails at once, naming why, instead of hanging. (The requests run in a thread: if this breaks,
    the test ends the worker and fails rather than hang the suite.)"""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM("tiny", device="cpu", dtype="float32", num_blocks=32, tensor_parallel_size=2) as llm:
        assert llm.generate(["a b c"], params)[0].error is None
        real = llm.model.lm_head.forward

        def broken(x):  # after every all-reduce of the layers: the worker waits in the head's all-gather
            raise RuntimeError("injected")

        def requests() -> list:
            llm.model.lm_head.forward = broken
            first = llm.generate(["d e f"], params)[0]
            llm.model.lm_head.forward = real
            return [first, llm.generate(["g h i"], params)[0]]

        box = []
        run = threading.Thread(target=lambda: box.extend(requests()), daemon=True)
        run.start()
        run.join(120)
        if run.is_alive():
            for p in llm.workers.processes:
                p.kill()
            llm.workers.closed = True
            pytest.fail("a failed forward on rank 0 left the group hanging")
        first, later = box
        assert "injected" in first.error
        assert "the tensor-parallel group has ended" in later.error and "injected" in later.error
        assert all(p.poll() is not None for p in llm.workers.processes), "the worker was left running"


def test_a_worker_that_exits_fails_the_next_request_and_every_later_one():
    """A worker killed between requests: rank 0's next step finds its pipe broken, so that request
    fails naming the worker and its exit code, and every later one fails at once for the same
    reason; nothing hangs and no block is left allocated."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM("tiny", device="cpu", dtype="float32", num_blocks=32, tensor_parallel_size=2) as llm:
        assert llm.generate(["a b c"], params)[0].error is None
        worker = llm.workers.processes[0]
        worker.kill()
        worker.wait()
        first, later = (llm.generate([p], params)[0] for p in ("d e f", "g h i"))
        assert "worker has exited: rank 1 (exit code -9)" in first.error
        assert "the tensor-parallel group has ended" in later.error and "rank 1" in later.error
        assert llm.engine.block_manager.allocator.num_used == 0


def test_an_idle_worker_outlasts_the_groups_timeout():
    """A worker waits for the next step on its pipe, which has no timeout, so a server idle for
    longer than the group's collective timeout (30 minutes by default on gloo) still serves; here
    the timeout is 15 s and the group idles for 17. (The timeout also bounds the workers' start, a
    fresh interpreter importing torch, so it cannot be much shorter on a busy 2-core machine, where
    another test process may share the cores.)"""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM("tiny", device="cpu", dtype="float32", num_blocks=32, tensor_parallel_size=2,
             distributed_timeout_s=15.0) as llm:
        before = llm.generate(["a b c"], params)[0]
        time.sleep(17)
        after = llm.generate(["a b c"], params)[0]
        assert after.error is None and after.token_ids == before.token_ids
        assert llm.workers.exited() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_collectives_are_captured_and_replayed_in_decode_graphs_on_one_rank(monkeypatch):
    """A group of one NCCL rank: every decode graph captures the model's all-reduces and its
    head's all-gather, and replays them. Over one rank they change nothing, so the greedy tokens
    equal the same graphed engine's without a group. This is the capture mechanics two GPUs rely
    on, checked where one GPU is all there is."""
    import torch.distributed as dist

    from nanolab import Engine, EngineConfig, load_model
    from nanolab.engine.parallel import free_port, join_group
    from nanolab.lab.reference import engine_greedy

    path = resolve_weights("tiny")
    prompts = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23]]
    config = EngineConfig(num_blocks=64, block_size=4, compile=False, async_scheduling=False)
    alone = engine_greedy(Engine(load_model(path, dtype=torch.float32, device="cuda"), config, progress=False), prompts,
                          8)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    tp = join_group(0, 1, "cuda")
    try:
        model = load_model(path, dtype=torch.float32, device="cuda", tp=tp)
        engine = Engine(model, config, progress=False)
        assert engine.runner.graphs is not None and len(engine.runner.graphs.graphs) > 1
        assert engine_greedy(engine, prompts, 8) == alone
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensor_parallelism_on_cuda_is_refused_by_name_until_its_nccl_path_works():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 on cuda.*unverified_nccl=True"):
        LLM("tiny", device="cuda", tensor_parallel_size=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (nvidia-h200-x2); this test hung on "
                    "its first run there (2026-11-30), before any output: it is the check for the NCCL path's fix "
                    "(`scripts/gpu_run.sh tp` runs it)")
@pytest.mark.parametrize("compile", [False, True], ids=["eager-step", "inductor"])
def test_two_nccl_ranks_with_graphs_agree_with_one_gpu_in_bf16(tmp_path, compile):
    """NCCL, bf16, each rank replaying its own captured graphs with the collectives inside (over
    the eager step, and over inductor's), on random weights at SmolLM2's shapes. bf16 rounds the
    all-reduce's sums differently from one GPU's matmul, so near-tied greedy tokens may part: the
    logits' relative error is the measure, prefill and decode steps, and the agreement is printed."""
    from nanolab.model.weights import synthesize_weights

    path = str(synthesize_weights(PRESETS["smollm2-135m"], tmp_path / "smollm2-shapes", progress=False))
    kw = dict(device="cuda", dtype="bfloat16", num_blocks=256, max_num_batched_tokens=8, async_scheduling=False,
              unverified_nccl=True)
    one = LLM(path, compile=False, **kw)
    one_tokens, one_logits = _greedy(one, 10)
    one_ids, two_ids = [], []
    one_steps = _step_logits(one, PROMPTS[1], 8, tokens=one_ids)
    with LLM(path, tensor_parallel_size=2, compile=compile, **kw) as two:
        assert two.engine.runner.graphs is not None
        two_tokens, two_logits = _greedy(two, 10)
        two_steps = _step_logits(two, PROMPTS[1], 8, tokens=two_ids)
    # Steps whose inputs were the same: up to and including the first where the tokens part.
    same = next((i for i, (a, b) in enumerate(zip(one_ids, two_ids, strict=True)) if a != b), len(one_ids) - 1) + 1
    step_err = float((two_steps[:same] - one_steps[:same]).norm() / one_steps[:same].norm())
    print(f"{same} steps with the same inputs: logits rel err {step_err:.2e}")
    assert step_err < 5e-2
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(two_logits, one_logits, strict=True)]
    equal = sum(a == b for x, y in zip(two_tokens, one_tokens, strict=True) for a, b in zip(x, y, strict=True))
    print(f"TP=2 against one GPU, bf16: {equal} of {sum(map(len, one_tokens))} greedy tokens equal; "
          f"prefill logits rel err {max(errors):.2e} at most")
    assert max(errors) < 5e-2, errors  # a wrong shard or a missing all-reduce is off by order 1
