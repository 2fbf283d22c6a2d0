"""Varlen steps padded to a capture size: the step a varlen CUDA graph replays.

On the CPU the padded step runs eagerly, through the same function a graph captures
(`varlen_step`) and the same fixed buffers: its logits and every pool slot it writes are checked
against the unpadded step's, step after step, on the sharp models (whose output depends on every
key they read). The graphs themselves are checked on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, make_cache, run_until_done

from nanolab import LLM, Engine, EngineConfig, SamplingParams
from nanolab.engine.graphs import VarlenGraphs, capture_sizes, varlen_step
from nanolab.engine.kv_cache import SINK
from nanolab.kernels import INTERPRETED
from nanolab.kernels.varlen_attention import (
    captured_programs,
    captured_splits,
    choose_varlen_splits,
    persistent_programs,
)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")

# (row, tokens fed, sampled) per segment, step after step: whole prompts; two decode rows beside a
# prompt's first chunk; its last chunk beside one decode row (the same capture size as the step
# before, with fewer segments, so anything the buffers kept from that step would show); one decode
# row alone.
STEPS = [
    [(0, 5, True), (1, 9, True), (2, 3, True)],
    [(0, 1, True), (1, 1, True), (3, 6, False)],
    [(3, 5, True), (2, 1, True)],
    [(0, 1, True)],
]


def caches(sharp, read: str = "reference"):
    config = sharp.model.config
    kw = dict(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
              head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=6, read=read)
    plain, padded = make_cache(**kw), make_cache(**kw)
    padded.reserve_varlen(32)
    for cache in (plain, padded):
        for _ in range(4):
            cache.blocks.open_row()
    return plain, padded


def check_pools_agree(plain, padded) -> None:
    """Every slot but the sink holds the same K/V in both caches: a padding token that wrote a
    real slot, or a real token written to the wrong one, shows here."""
    for layer, (a, b) in enumerate(zip(plain.k_pools + plain.v_pools, padded.k_pools + padded.v_pools)):
        torch.testing.assert_close(b[:SINK], a[:SINK], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, layer=layer: f"pool {layer}: {m}")


def test_padded_steps_give_the_unpadded_steps_logits_and_writes(sharp_model):
    torch.manual_seed(0)
    plain, padded = caches(sharp_model)
    sizes = capture_sizes(32)
    vocab = sharp_model.model.config.vocab_size
    tokens = {row: torch.randint(1, vocab, (20,)).tolist() for row in range(4)}  # no token 0: padding's id
    fed = dict.fromkeys(tokens, 0)
    for i, step in enumerate(STEPS):
        rows, counts, sampled = zip(*step)
        ids = [t for row, n in zip(rows, counts) for t in tokens[row][fed[row]:fed[row] + n]]
        for row, n in zip(rows, counts):
            fed[row] += n
        size = next(s for s in sizes if s >= len(ids))
        plan = plain.plan_varlen(rows, counts, sampled)
        with torch.inference_mode():
            expected = sharp_model.model(torch.tensor([ids]), plan.positions, cache=plain.view(plan),
                                         logits_index=plan.logits_index)
            plan = padded.plan_varlen(rows, counts, sampled, input_ids=ids, num_tokens=size)
            assert plan.num_tokens == size and plan.padded and not plan.whole_prompts
            got = varlen_step(sharp_model.model, padded, plan)[: sum(sampled)]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
        check_pools_agree(plain, padded)


def test_a_padded_plan_rewrites_every_field_of_the_buffers(tiny_model):
    """A smaller step after a larger one leaves nothing of the larger: padding writes the sink
    at position 0, the empty segments sit where the real tokens end, on the all-sink table row."""
    config = tiny_model.config
    cache = make_cache(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=4)
    cache.reserve_varlen(16)
    for _ in range(3):
        cache.blocks.open_row()
    cache.plan_varlen((0, 1, 2), (5, 4, 3), input_ids=list(range(1, 13)), num_tokens=16)
    plan = cache.plan_varlen((1,), (2,), (False,), input_ids=[7, 8], num_tokens=8)
    assert plan.write_slots.tolist()[2:] == [SINK] * 6 and plan.positions[0].tolist() == [4, 5] + [0] * 6
    assert plan.input_ids[0].tolist() == [7, 8] + [0] * 6
    assert plan.query_start_loc.tolist() == [0, 2, 2, 2, 2]
    assert plan.table_rows.tolist() == [1] + [cache.pad_row] * 3
    assert plan.context_lens.tolist() == [6, 0, 0, 0]
    assert plan.logits_index.tolist() == [0, 0, 0, 0]  # nothing sampled: every entry is padding
    assert (cache.block_table[cache.pad_row] == SINK).all()


def test_a_padded_plan_gives_logits_for_as_many_rows_as_the_cache_has_and_no_more(tiny_model):
    """A graph's head runs on `max_rows` rows of logits: a step that asks exactly that many is
    planned, every entry real; one more is refused before any table grows."""
    config = tiny_model.config
    cache = make_cache(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=4)
    cache.reserve_varlen(16)
    rows = [cache.blocks.open_row() for _ in range(4)]
    plan = cache.plan_varlen(rows, (2, 1, 3, 1), input_ids=list(range(1, 8)), num_tokens=8)
    assert plan.logits_index.tolist() == [1, 2, 5, 6]
    with pytest.raises(ValueError, match="at most 4 rows of logits"):
        cache.plan_varlen(rows[:1], (5,), all_logits=(True,), input_ids=list(range(1, 6)), num_tokens=8)
    assert cache.blocks.table(rows[0]).num_tokens == 2, "a refused plan grew a table"


def test_padded_plans_are_checked_and_a_stale_one_is_refused(tiny_model):
    config = tiny_model.config
    cache = make_cache(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=4)
    row = cache.blocks.open_row()
    with pytest.raises(ValueError, match="reserved"):  # no buffers yet
        cache.plan_varlen((row,), (2,), input_ids=[1, 2], num_tokens=4)
    cache.reserve_varlen(8)
    buffers = cache._varlen_inputs
    cache.reserve_varlen(8)
    assert cache._varlen_inputs is buffers, "reserving again remade the buffers a graph may read"
    with pytest.raises(RuntimeError, match="reserved for 8 tokens"):
        cache.reserve_varlen(16)
    with pytest.raises(ValueError, match="num_tokens 9"):
        cache.plan_varlen((row,), (2,), input_ids=[1, 2], num_tokens=9)
    with pytest.raises(ValueError, match="num_tokens 1 must hold"):
        cache.plan_varlen((row,), (2,), input_ids=[1, 2], num_tokens=1)
    with pytest.raises(ValueError, match="input ids"):
        cache.plan_varlen((row,), (2,), num_tokens=4)
    assert cache.blocks.table(row).num_tokens == 0, "a refused plan changed the tables"
    first = cache.plan_varlen((row,), (2,), input_ids=[1, 2], num_tokens=4)
    cache.view(first)
    cache.plan_varlen((row,), (1,), input_ids=[3], num_tokens=4)
    with pytest.raises(RuntimeError, match="stale padded VarlenPlan"):
        cache.view(first)


def test_capture_sizes_follow_vllms_list():
    sizes = capture_sizes(512)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-3:] == (480, 496, 512)
    assert 248 in sizes and 256 in sizes and 252 not in sizes and len(sizes) == 3 + 31 + 17
    assert capture_sizes(100)[-2:] == (96, 100) and capture_sizes(3) == (1, 2, 3)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    full = EngineConfig(device="cpu")  # "full", the default
    assert full.cudagraph_mode == "full" and full.varlen_capture_size(cuda, "streamed") == 512
    assert full.replace(max_num_batched_tokens=2048).varlen_capture_size(cuda, "streamed") == 512  # vLLM's cap
    assert full.replace(max_num_batched_tokens=256).varlen_capture_size(cuda, "streamed") == 256
    assert full.replace(max_cudagraph_capture_size=64).varlen_capture_size(cuda, "streamed") == 64
    assert full.varlen_capture_size(cpu, "streamed") is None
    assert full.replace(enforce_eager=True).varlen_capture_size(cuda, "streamed") is None
    assert full.replace(cudagraph_mode="full_decode_only").varlen_capture_size(cuda, "streamed") is None
    assert full.varlen_capture_size(cuda, "reference") is None  # its segments are walked on the host


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_varlen_graphs_replay_the_eager_steps_logits(sharp_gqa24, monkeypatch, compiled):
    """An engine whose varlen steps replay graphs against one that runs them eagerly: the same
    requests, chunked so steps mix chunks and decode rows, every step's logits within 1e-3 (fp32
    weights, TF32 off). Each graphed step replayed the smallest size holding it, and a plan given
    to a graph of another size is refused. Compiled, the graphs capture the compiled model
    (`DecodeForward.varlen`)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    path = sharp_gqa24.path
    prompts = [torch.randint(1, 200, (n,)).tolist() for n in (37, 5, 61, 12)]
    params = SamplingParams(temperature=0, max_tokens=6)
    runs = {}
    for mode in ("full", "full_decode_only"):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_batched_tokens=48, max_num_seqs=8,
                  num_blocks=64, compile=compiled, cudagraph_mode=mode, async_scheduling=False)
        engine = llm.engine  # synchronous: every step's logits come back with its tokens
        seen, logits = [], {}
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                logits.setdefault(out.seq.request_id, []).append(out.logits.float().cpu())
            seen.append(engine.runner.last_varlen)
            step = engine.last_step
            if step.phase != "decode":
                assert step.graph == (mode == "full"), step
                if step.graph:  # the smallest size holding the step's tokens
                    size = engine.runner.last_varlen[0]
                    assert size == min(n for n in engine.runner.varlen_graphs.sizes if n >= step.tokens), step
        runs[mode] = logits
        if mode == "full":
            graphs = engine.runner.varlen_graphs
            # compiled, the graphs captured the compiled model's varlen entry, not the eager model
            assert (graphs.model == engine.runner.forward.varlen) if compiled else graphs.model is engine.runner.model
            replayed = [n for n, graphed in seen if graphed]
            assert replayed and all(n in graphs.sizes for n in replayed)
            row = engine.kv_cache.blocks.open_row()
            plan = engine.kv_cache.plan_varlen((row,), (3,), input_ids=[1, 2, 3], num_tokens=4)
            graphs.graphs.pop(4)
            with pytest.raises(ValueError, match="no varlen graph for 4 tokens"):
                graphs.replay(plan, 1)
        else:
            assert engine.runner.varlen_graphs is None and not any(graphed for _, graphed in seen)
    for rid, rows in runs["full_decode_only"].items():
        torch.testing.assert_close(torch.stack(runs["full"][rid]), torch.stack(rows), rtol=1e-3, atol=1e-3)


class CapturedOnCPU(VarlenGraphs):
    """`VarlenGraphs` without CUDA, replaying through `VarlenGraphs.replay` itself. What stands in
    for the graph of n tokens is the step a graph captures (`varlen_step` into the logits buffer)
    bound to the capture plan of n tokens, whose tensors view the cache's fixed buffers: like a
    graph, it reads whatever the buffers hold when replayed, over its own n tokens, whatever the
    step. Only the host fields the reference read walks (the real segments) come from the plan
    being replayed; a graph's read (the streamed one) has none."""

    class Recorded:
        def __init__(self, graphs: CapturedOnCPU, n: int) -> None:
            self.graphs, self.n, self.captured = graphs, n, graphs.cache.plan_varlen_padding(n)

        def replay(self) -> None:
            g, current = self.graphs, self.graphs.current
            # A graph of fewer tokens than the step's would read past its own rows on a GPU.
            assert sum(current.query_lens) <= self.n, f"the graph of {self.n} tokens replayed a step of more"
            g.replayed.append((sum(current.query_lens), self.n))  # (the step's tokens, the graph's)
            plan = dataclasses.replace(self.captured, query_lens=current.query_lens, rows=current.rows,
                                       planned_lens=current.planned_lens, epoch=current.epoch)
            g.logits.copy_(varlen_step(g.model, g.cache, plan))

    def __init__(self, model, cache, sizes) -> None:
        self.model, self.cache, self.sizes = model, cache, tuple(sizes)
        cache.reserve_varlen(self.sizes[-1])
        self.logits = torch.empty((cache.max_rows, model.config.vocab_size))
        self.graphs = {n: self.Recorded(self, n) for n in self.sizes}
        self.replayed: list[tuple[int, int]] = []
        self.current = None

    def replay(self, plan, num_sampled: int) -> torch.Tensor:
        self.current = plan
        return super().replay(plan, num_sampled)


@pytest.mark.parametrize("read", ["reference", pytest.param("streamed", marks=pytest.mark.skipif(
    not INTERPRETED, reason="the streamed read on a CPU needs Triton's interpreter"))])
def test_an_engine_whose_varlen_steps_take_the_graphed_path_gives_the_same_logits(sharp_gqa24, read):
    """Chunked prefill under a 7-token budget, the varlen steps padded to sizes up to 8 (so every
    step takes the padded path, and steps of 5, 6 and 7 tokens share the size 8), against the
    engine that runs them unpadded: the same greedy tokens, and every step's logits within 1e-4
    of the one-shot reference."""
    sharp = sharp_gqa24
    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=7, read=read)
    plain, graphed = Engine(sharp.model, config), Engine(sharp.model, config)
    graphed.runner.varlen_graphs = stand_in = CapturedOnCPU(sharp.model, graphed.kv_cache, capture_sizes(8))
    g = torch.Generator().manual_seed(0)
    prompt_list = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 9, 14, 22, 1)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for engine in (plain, graphed):
        logits, keep = logit_recorder()
        seqs = [engine.add_request(p, params) for p in prompt_list]
        run_until_done(engine, on_step=keep)
        runs.append((seqs, logits))
    (plain_seqs, _), (seqs, logits) = runs
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in plain_seqs]
    assert_logits_match_reference(sharp, seqs, logits)
    assert {n for _, n in stand_in.replayed} >= {8} and len(stand_in.replayed) > 5
    smallest = {tokens: min(n for n in capture_sizes(8) if n >= tokens) for tokens in range(1, 9)}
    assert all(n == smallest[tokens] for tokens, n in stand_in.replayed), stand_in.replayed
    assert [stand_in.lookup(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert graphed.block_manager.allocator.num_free == 64


@pytest.mark.skipif(not INTERPRETED, reason="the streamed read on a CPU needs Triton's interpreter")
def test_the_streamed_read_runs_a_padded_step_and_a_capture_plan(tiny_model, monkeypatch):
    """What a varlen graph captures and replays, through the Triton read (the interpreter here):
    the all-padding plan a graph is captured on runs and writes nothing but the sink, and a padded
    step of real rows gives the reference read's logits. On 4 SMs, a 16-token step of 2 KV heads
    (one query tile) takes 4 shares (`captured_splits`; the rule for unpadded steps would take 2),
    and every layer's read loops one persistent program a KV head and share over its tiles. An
    unpadded step of the same rows, on 132 SMs, takes the unpadded rule: contexts too short to
    share, one share, a program a tile."""
    import nanolab.engine.kv_cache as kv_cache

    launches, real = [], kv_cache.varlen_attention

    def spy(*args, **kwargs):
        launches.append((kwargs["splits"], kwargs["programs"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_cache, "varlen_attention", spy)
    config = tiny_model.config
    kw = dict(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
              head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=4)
    streamed, reference = make_cache(**kw, read="streamed"), make_cache(**kw)
    streamed.num_sms = 4  # what a captured step's shares and programs are chosen for
    kv_heads, group = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    assert (captured_splits(16, kv_heads, group, 4), choose_varlen_splits(16, 1, kv_heads, group, 4)) == (4, 2)
    for cache in (streamed, reference):
        cache.reserve_varlen(16)
    with torch.inference_mode():
        varlen_step(tiny_model, streamed, streamed.plan_varlen_padding(16))
        for pool in streamed.k_pools + streamed.v_pools:
            assert not pool[:SINK].any(), "the capture plan wrote a real slot"
        logits = []
        for cache in (streamed, reference):
            rows = [cache.blocks.open_row() for _ in range(2)]
            plan = cache.plan_varlen(rows, (5, 3), input_ids=[4, 8, 15, 16, 23, 42, 7, 9], num_tokens=16)
            logits.append(varlen_step(tiny_model, cache, plan)[:2])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert captured_programs(kv_heads, 4, 4) == persistent_programs(kv_heads, 4, 4) == 1
    assert launches == [(4, 1)] * (2 * config.num_hidden_layers), launches
    launches.clear()
    streamed.num_sms = 132  # where only the short contexts keep an unpadded step unsplit
    with torch.inference_mode():  # the same rows' next tokens, unpadded: contexts of 6 and 4 keys
        logits = []
        for cache in (streamed, reference):
            plan = cache.plan_varlen([0, 1], (1, 1))
            ids = torch.tensor([[5, 6]])
            logits.append(tiny_model(ids, plan.positions, cache=cache.view(plan), logits_index=plan.logits_index))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert launches == [(1, None)] * config.num_hidden_layers, launches


@pytest.mark.skipif(not INTERPRETED, reason="the streamed read on a CPU needs Triton's interpreter")
def test_the_compiled_varlen_step_gives_the_eager_steps_logits_in_one_graph(sharp_gqa24):
    """What a varlen graph captures when the engine compiles (`DecodeForward.varlen`): padded steps
    of two sizes and different mixes of segments (decode rows, a chunk after history, a whole
    prompt) through the compiled model give the eager model's logits within 1e-4, and one graph
    serves both sizes and every mix: the token count is symbolic and no host value of the plan is
    guarded on. The larger size comes first, as the engine captures, and equals the cache's rows,
    so a token count that dynamo tied to another dimension of the same size would compile twice."""
    from nanolab import load_model
    from nanolab.engine.runner import compile_decode

    model = load_model(sharp_gqa24.path, dtype=torch.float32)
    config = model.config
    kw = dict(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
              head_dim=config.head_dim, num_blocks=32, block_size=4, max_rows=16, read="streamed")
    eager, compiled = make_cache(**kw), make_cache(**kw)
    forward = compile_decode(model)
    torch._dynamo.reset()
    steps = [((0, 1, 2), (1, 1, 11), [True, True, True]), ((0, 1), (9, 4), [True, True]),
             ((2, 3), (3, 2), [True, False])]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for cache in (eager, compiled):
            cache.reserve_varlen(16)
            for _ in range(4):
                cache.blocks.open_row()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for i, (rows, counts, sampled) in enumerate(steps):
            ids = torch.randint(3, config.vocab_size, (sum(counts),), generator=g).tolist()
            size = 8 if sum(counts) <= 8 else 16
            want = varlen_step(model, eager, eager.plan_varlen(rows, counts, sampled, input_ids=ids, num_tokens=size))
            plan = compiled.plan_varlen(rows, counts, sampled, input_ids=ids, num_tokens=size)
            got = varlen_step(forward.varlen, compiled, plan)
            torch.testing.assert_close(got[:sum(sampled)], want[:sum(sampled)], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, i=i: f"step {i}: {m}")
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1
