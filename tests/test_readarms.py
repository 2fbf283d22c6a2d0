"""`lab.readarms`: the varlen read's other launches as engine backends. In Triton's interpreter on
a CPU, a padded step read through persistent programs or the flat grid gives the reference read's
logits, with the launch's programs actually passed to the kernel; a compiled step reaches the
lab's operator;
the runner hands its cache that read before its graphs could be captured; and the cache refuses a
read handed over too late, or one that is not a function."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache

import nanolab.lab.readarms as readarms
from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.graphs import varlen_step
from nanolab.engine.runner import ModelRunner
from nanolab.kernels import INTERPRETED
from nanolab.kernels.varlen_attention import varlen_reference
from nanolab.lab.readarms import (
    READ_ARMS,
    FlatReadRunner,
    PersistentReadRunner,
    launched_varlen_op,
    launched_varlen_read,
)

needs_interpreter = pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(),
                                       reason="the streamed read on a CPU: Triton's interpreter, CPU only")


def cache_kw(model) -> dict:
    c = model.config
    return dict(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                num_blocks=16, block_size=4, max_rows=4)


def padded_logits(model, cache) -> torch.Tensor:
    """Two rows' prompts (5 and 3 tokens) in one step padded to 16 tokens: the sampled logits."""
    cache.reserve_varlen(16)
    rows = [cache.blocks.open_row() for _ in range(2)]
    plan = cache.plan_varlen(rows, (5, 3), input_ids=[4, 8, 15, 16, 23, 42, 7, 9], num_tokens=16)
    with torch.inference_mode():
        return varlen_step(model, cache, plan)[:2]


def spy_programs(monkeypatch) -> list:
    """Every `programs` the lab's read hands `varlen_attention`."""
    seen, real = [], readarms.varlen_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("programs"))
        return real(*args, **kwargs)

    monkeypatch.setattr(readarms, "varlen_attention", spy)
    return seen


@needs_interpreter
@pytest.mark.parametrize("launch", ["persistent", "flat"])
def test_a_padded_step_through_a_launch_gives_the_reference_logits(tiny_model, monkeypatch, launch):
    seen = spy_programs(monkeypatch)
    persistent, reference = make_cache(**cache_kw(tiny_model), read="streamed"), make_cache(**cache_kw(tiny_model))
    engine_read = persistent.varlen_reader
    persistent.varlen_reader = lambda view, layer, q, positions: launched_varlen_read(
        view, layer, q, positions, launch=launch, engine_read=engine_read)
    torch.testing.assert_close(padded_logits(tiny_model, persistent), padded_logits(tiny_model, reference),
                               rtol=1e-4, atol=1e-4)
    layers = tiny_model.config.num_hidden_layers
    if launch == "flat":
        assert seen == [None] * layers, seen
        return
    assert len(seen) == layers and all(isinstance(p, int) and p >= 1 for p in seen), seen
    with pytest.raises(RuntimeError, match="varlen_reader"):  # reserved: too late to hand another over
        persistent.varlen_reader = engine_read
    with pytest.raises(ValueError, match="varlen_reader"):
        make_cache(**cache_kw(tiny_model)).varlen_reader = "persistent"


@needs_interpreter
def test_the_operator_reads_what_the_reference_reads():
    """The compiled step's operator, called eagerly: two segments after cached keys."""
    g = torch.Generator().manual_seed(0)
    page, kv_heads, heads, d = 4, 2, 4, 16
    k_pool, v_pool = (torch.randn(40 * page + 1, kv_heads, d, generator=g) for _ in range(2))
    table = torch.randperm(40, generator=g)[:20].view(2, 10).to(torch.int32)
    new, lens = [5, 3], [30, 11]
    n = sum(new)
    args = dict(q=torch.randn(n, heads, d, generator=g), k_pool=k_pool, v_pool=v_pool, block_table=table,
                table_rows=torch.arange(2), query_start_loc=torch.tensor([0, new[0], n]),
                context_lens=torch.tensor(lens),
                positions=torch.tensor([p for m, c in zip(new, lens) for p in range(c - m, c)]))
    ref = varlen_reference(**args, block_size=page)
    for launch in ("persistent", "flat"):  # persistent: one program a KV head and share on 2 SMs, looping
        got = launched_varlen_op(**args, block_size=page, launch=launch, num_sms=2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="launch 'wide'"):
        launched_varlen_op(**args, block_size=page, launch="wide", num_sms=2)
    # what dynamo sees of it in a compiled step: its schema and its fake (the shape, without running it)
    torch.library.opcheck(launched_varlen_op, tuple(args.values()),
                          {"block_size": page, "launch": "persistent", "num_sms": 2},
                          test_utils=("test_schema", "test_faketensor"))


@needs_interpreter
def test_a_compiled_step_reads_through_the_labs_operator(tiny_model, monkeypatch):
    """Inside a compile (`torch.compiler.is_compiling`), every varlen plan goes to the operator,
    never to the engine's read."""
    calls = []
    monkeypatch.setattr(readarms, "launched_varlen_op", lambda q, *a, **k: calls.append(q.shape) or q.clone())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    cache = make_cache(**cache_kw(tiny_model), read="streamed")

    def refuse(*_):
        raise AssertionError("the engine's read ran inside a compile")

    cache.varlen_reader = lambda view, layer, q, positions: launched_varlen_read(
        view, layer, q, positions, launch="persistent", engine_read=refuse)
    padded_logits(tiny_model, cache)
    assert len(calls) == tiny_model.config.num_hidden_layers and all(s[0] == 16 for s in calls)


@needs_interpreter
def test_the_runner_hands_its_cache_the_read_before_capturing_and_the_engine_decodes(tiny_model, monkeypatch):
    seen_at_init = []
    init = ModelRunner.__init__

    def spy_init(self, model, kv_cache, **kwargs):
        seen_at_init.append(kv_cache.varlen_reader)
        init(self, model, kv_cache, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", spy_init)
    config = EngineConfig(num_blocks=32, block_size=4, read="streamed", enforce_eager=True)
    plain, candidate = Engine(tiny_model, config), Engine(tiny_model, config, runner=READ_ARMS["persistent"])
    assert READ_ARMS["engine"] is ModelRunner and type(candidate.runner) is PersistentReadRunner
    assert READ_ARMS["flat"] is FlatReadRunner
    assert seen_at_init[0] is plain.kv_cache.varlen_reader  # the engine's, untouched
    assert seen_at_init[1] is candidate.kv_cache.varlen_reader is not plain.kv_cache.varlen_reader
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = []
    for engine in (plain, candidate):
        seq = engine.add_request([3, 14, 15, 92, 65, 35], params)
        while engine.has_unfinished_requests():
            engine.step()
        outs.append(seq.output_token_ids)
    assert outs[0] == outs[1]
    seen = spy_programs(monkeypatch)  # a padded step through the candidate's cache: persistent programs
    padded_logits(tiny_model, candidate.kv_cache)
    assert seen and all(isinstance(p, int) for p in seen)
    with pytest.raises(ValueError, match="streamed read"):
        Engine(tiny_model, EngineConfig(num_blocks=32, block_size=4, read="reference", enforce_eager=True),
               runner=PersistentReadRunner)


@needs_interpreter
def test_a_compiled_varlen_step_traces_the_persistent_read_into_one_graph(monkeypatch):
    """What a captured step runs on a GPU: the varlen step compiled (`DecodeForward.varlen`) with
    the persistent read in the cache. Dynamo traces through the runner's read into the lab's
    operator, whose kernel gets persistent programs, and the logits are the eager step's."""
    from nanolab import load_model
    from nanolab.engine.runner import compile_decode
    from nanolab.model.weights import resolve_weights

    model = load_model(resolve_weights("tiny"), dtype=torch.float32)
    kw = {**cache_kw(model), "num_blocks": 32, "max_rows": 8}
    eager, compiled = make_cache(**kw), make_cache(**kw, read="streamed")
    engine_read = compiled.varlen_reader
    compiled.varlen_reader = lambda view, layer, q, positions: launched_varlen_read(
        view, layer, q, positions, launch="persistent", engine_read=engine_read)
    forward = compile_decode(model)
    torch._dynamo.reset()
    seen = spy_programs(monkeypatch)
    ids = [5, 9, 12, 7, 3, 8, 22, 31, 4, 6, 17, 2, 11]
    with torch.inference_mode():
        logits = []
        for cache, run in ((eager, model), (compiled, forward.varlen)):
            cache.reserve_varlen(16)
            rows = [cache.blocks.open_row() for _ in range(3)]
            plan = cache.plan_varlen(rows, (1, 1, 11), [True, True, True], input_ids=ids, num_tokens=16)
            logits.append(varlen_step(run, cache, plan)[:3])
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    assert len(seen) == model.config.num_hidden_layers and all(isinstance(p, int) for p in seen), seen
