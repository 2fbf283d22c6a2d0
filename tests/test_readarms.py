"""`lab.readarms`: the varlen read's candidate launches as engine backends. In Triton's
interpreter on a CPU, a padded step read through persistent programs gives the reference read's
logits, the runner hands its cache that read before anything runs, and it refuses a cache that
does not read through Triton."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.engine.graphs import varlen_step
from nanolab.kernels import INTERPRETED
from nanolab.kernels.varlen_attention import varlen_reference
from nanolab.lab.readarms import READ_ARMS, PersistentReadRunner, persistent_varlen_op, persistent_varlen_read

needs_interpreter = pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(),
                                       reason="the streamed read on a CPU: Triton's interpreter, CPU only")


@needs_interpreter
def test_a_padded_step_through_persistent_programs_gives_the_reference_logits(tiny_model):
    config = tiny_model.config
    kw = dict(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
              head_dim=config.head_dim, num_blocks=16, block_size=4, max_rows=4)
    persistent, reference = make_cache(**kw, read="streamed"), make_cache(**kw)
    engine_read = persistent.varlen_reader
    calls = []

    def counted(view, layer, q, positions):
        calls.append(view.plan.padded)
        return persistent_varlen_read(view, layer, q, positions, engine_read=engine_read)

    persistent.varlen_reader = counted
    logits = []
    with torch.inference_mode():
        for cache in (persistent, reference):
            cache.reserve_varlen(16)
            rows = [cache.blocks.open_row() for _ in range(2)]
            plan = cache.plan_varlen(rows, (5, 3), input_ids=[4, 8, 15, 16, 23, 42, 7, 9], num_tokens=16)
            logits.append(varlen_step(tiny_model, cache, plan)[:2])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert calls and all(calls), "the padded step did not read through the persistent read"


@needs_interpreter
def test_the_operator_reads_what_the_reference_reads():
    """The compiled step's operator, called eagerly: two segments after cached keys, padded."""
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
    got = persistent_varlen_op(**args, block_size=page, num_sms=2)  # one program a KV head and share: it loops
    torch.testing.assert_close(got, varlen_reference(**args, block_size=page), rtol=1e-5, atol=1e-5)
    # what dynamo sees of it in a compiled step: its schema and its fake (the shape, without running it)
    torch.library.opcheck(persistent_varlen_op, tuple(args.values()), {"block_size": page, "num_sms": 2},
                          test_utils=("test_schema", "test_faketensor"))


@needs_interpreter
def test_the_runner_hands_its_cache_the_read_and_the_engine_still_decodes(tiny_model):
    config = EngineConfig(num_blocks=32, block_size=4, read="streamed", enforce_eager=True)
    plain, candidate = Engine(tiny_model, config), Engine(tiny_model, config, runner=READ_ARMS["persistent"])
    assert READ_ARMS["engine"] is type(plain.runner)
    assert candidate.kv_cache.varlen_reader is not plain.kv_cache.varlen_reader
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = []
    for engine in (plain, candidate):
        seq = engine.add_request([3, 14, 15, 92, 65, 35], params)
        while engine.has_unfinished_requests():
            engine.step()
        outs.append(seq.output_token_ids)
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="streamed read"):
        Engine(tiny_model, EngineConfig(num_blocks=32, block_size=4, read="reference", enforce_eager=True),
               runner=PersistentReadRunner)

