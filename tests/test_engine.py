"""The engine's promises: batch invariance, joining mid-flight, preemption that changes nothing,
stopping rules, streaming, and bad input that is refused without disturbing anyone else."""

from __future__ import annotations

import pytest
import torch
from conftest import bounded, needs_smollm2, run_until_done

from nanolab import LLM, Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def ragged_prompts(vocab: int, lengths=(3, 4, 5, 15, 16, 17, 31, 33), seed: int = 0) -> list[list[int]]:
    """Prompts whose lengths sit on both sides of 4- and 16-token block boundaries."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, prompts, params=GREEDY, join_after: int | None = None) -> list[list[int]]:
    """Greedy outputs in prompt order. With `join_after`, the second half of the prompts joins
    after that many steps of the first half."""
    first = prompts if join_after is None else prompts[: len(prompts) // 2]
    seqs = [engine.add_request(p, params) for p in first]
    steps = 0
    for _ in bounded(lambda: engine.has_unfinished_requests() or len(seqs) < len(prompts)):
        engine.step()
        steps += 1
        if steps == join_after:
            seqs.extend(engine.add_request(p, params) for p in prompts[len(first):])
    return [s.output_token_ids for s in seqs]


def assert_all_free(engine: Engine) -> None:
    cache = engine.kv_cache
    assert cache.blocks.allocator.num_free == cache.num_blocks
    assert all(t is None for t in cache.blocks.tables)


@pytest.mark.parametrize("block_size", [4, 16])
def test_batch_invariance_tiny(tiny_model, block_size):
    prompts = ragged_prompts(tiny_model.config.vocab_size)
    alone = [run(Engine(tiny_model, EngineConfig(num_blocks=64, block_size=block_size)), [p])[0] for p in prompts]
    engine = Engine(tiny_model, EngineConfig(num_blocks=256, block_size=block_size))
    assert run(engine, prompts) == alone
    assert run(engine, prompts, join_after=5) == alone
    assert_all_free(engine)


@needs_smollm2
def test_batch_invariance_smollm2(smollm2_model):
    # Both sides of a 16-token block boundary; the tiny model's test walks every length.
    prompts = ragged_prompts(smollm2_model.config.vocab_size, lengths=(4, 15, 17, 33), seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [run(Engine(smollm2_model, EngineConfig(num_blocks=16)), [p], params)[0] for p in prompts]
    engine = Engine(smollm2_model, EngineConfig(num_blocks=128))
    assert run(engine, prompts, params) == alone
    assert run(engine, prompts, params, join_after=3) == alone
    assert_all_free(engine)


def test_preemption_recomputes_and_changes_nothing(tiny_model):
    prompts = ragged_prompts(tiny_model.config.vocab_size)
    expected = run(Engine(tiny_model, EngineConfig(num_blocks=256, block_size=4)), prompts)
    # 24 blocks of 4 cannot hold eight requests of up to 57 tokens: the scheduler must preempt.
    tight = Engine(tiny_model, EngineConfig(num_blocks=24, block_size=4))
    assert run(tight, prompts) == expected
    assert tight.scheduler.num_preemptions > 0
    assert_all_free(tight)


def test_abort_returns_blocks_wherever_the_request_is(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=16, block_size=4, max_num_seqs=2))
    seqs = [engine.add_request(p, GREEDY) for p in ragged_prompts(512)]
    for _ in range(3):
        engine.step()
    assert any(s.row is not None for s in seqs) and any(s.row is None for s in seqs)
    for s in seqs:
        engine.abort_request(s.request_id)
    assert not engine.has_unfinished_requests()
    assert all(s.finish_reason == "abort" for s in seqs)
    assert_all_free(engine)


def test_max_tokens_and_model_len(tiny_model):
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, block_size=4, max_model_len=20))
    a = engine.add_request([5] * 6, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    b = engine.add_request([5] * 6, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    run_until_done(engine)
    assert (len(a.output_token_ids), a.finish_reason) == (3, "length")
    assert (b.num_tokens, b.finish_reason) == (20, "length")


def test_eos_stops_unless_ignored(tiny_model):
    prompt = ragged_prompts(512)[3]
    first = run(Engine(tiny_model, EngineConfig(num_blocks=32)), [prompt])[0]
    eos = first[5]  # pretend the sixth greedy token is the model's EOS
    engine = Engine(tiny_model, EngineConfig(num_blocks=32))
    engine.eos_token_ids = frozenset({eos})
    stopped = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24))
    ignored = engine.add_request(prompt, GREEDY)
    run_until_done(engine)
    cut = first.index(eos) + 1
    assert stopped.output_token_ids == first[:cut] and stopped.finish_reason == "stop"
    assert ignored.output_token_ids == first


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([1] * 2048, GREEDY, "context"),
        ([1, 2, 99999], GREEDY, "token ids"),
        ([1, 2, 3], SamplingParams(max_tokens=5000), "KV pool"),
        ([1, 2, 3], {"temperature": 0}, "SamplingParams"),
    ],
)
def test_bad_requests_are_refused_and_others_keep_running(tiny_model, prompt, params, match):
    prompts = ragged_prompts(512)[:3]
    # A context longer than the pool holds, so a request can ask for more than the pool.
    config = EngineConfig(num_blocks=64, block_size=16, max_model_len=2048)
    expected = run(Engine(tiny_model, config), prompts)
    engine = Engine(tiny_model, config)
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    free = engine.block_manager.allocator.num_free
    with pytest.raises((ValueError, TypeError), match=match):
        engine.add_request(prompt, params)
    assert engine.block_manager.allocator.num_free == free and len(engine.scheduler.waiting) == 0
    run_until_done(engine)
    assert [s.output_token_ids for s in seqs] == expected


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", device="cpu", dtype="float32")


@needs_smollm2
class TestLLM:
    def test_generate_in_prompt_order(self, llm):
        prompts = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert [o.prompt for o in outs] == prompts
        assert "Paris" in outs[0].text
        assert outs[0].outputs[0].token_ids == outs[0].token_ids
        assert llm.tokenizer.decode(outs[1].token_ids) == outs[1].text

    def test_chat_stops_at_eos(self, llm):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        (out,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
        assert "Paris" in out.text
        assert out.finish_reason == "stop" and out.token_ids[-1] in llm.config.eos_token_id
        assert "<|im_end|>" not in out.text

    def test_stop_string_truncates(self, llm):
        (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16, stop="."),
                              use_tqdm=False)
        assert out.text == " Paris" and out.finish_reason == "stop"

    def test_stream_equals_generate(self, llm):
        for params in (SamplingParams(temperature=0, max_tokens=20),
                       SamplingParams(temperature=0, max_tokens=20, stop=["The answer"])):
            deltas = list(llm.stream("The capital of France is", params))
            (out,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
            assert "".join(deltas) == out.text and len(deltas) > 1
        assert not llm.engine.has_unfinished_requests()

    def test_closing_a_stream_aborts_it(self, llm):
        stream = llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=50))
        next(stream)
        stream.close()
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.allocator.num_free == llm.engine.kv_cache.num_blocks

    def test_one_bad_prompt_adds_nothing(self, llm):
        with pytest.raises(ValueError, match="prompt 1"):
            llm.generate(["fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()

    def test_dtype_names(self):
        from nanolab.config import resolve_dtype

        cpu = torch.device("cpu")
        assert resolve_dtype("bf16", cpu) is torch.bfloat16 and resolve_dtype(torch.float16, cpu) is torch.float16
        assert resolve_dtype("auto", cpu) is torch.float32
        with pytest.raises(ValueError, match="dtype"):
            resolve_dtype("float8", cpu)


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_model):
    """Seventeen rows at once, then sixteen, through every sampling path (on the CPU the long prompts are
    skipped: nothing there is built lazily); afterwards no request, no row and no block is held,
    and the engine decodes a request as a fresh one would."""
    engine = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_seqs=20))
    fresh = Engine(tiny_model, EngineConfig(num_blocks=64, max_num_seqs=20))
    report = engine.warm_up()
    assert (report.requests, report.steps) == (33, 6) and "33 requests" in str(report)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.allocator.num_free == engine.num_blocks
    assert engine.block_manager.free_row_count() == 20
    params = SamplingParams(temperature=0, max_tokens=5)
    outs = []
    for e in (engine, fresh):
        seq = e.add_request([5, 9, 2, 7], params)
        run_until_done(e)
        outs.append(seq.output_token_ids)
    assert outs[0] == outs[1]
