"""The decode step compiled by inductor (`runner.compile_decode`): the streamed read goes in as one
opaque op (`paged_attention_op`), the K/V writes stay writes into the pools, and every step's
logits equal the one-shot reference's, as the eager step's do."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, needs_cuda, run_until_done
from test_cache_properties import check_drained

from nanolab import Engine, EngineConfig, SamplingParams, load_model
from nanolab.engine.runner import CPU_OPTIONS, compile_decode, steady_tuning
from nanolab.kernels import INTERPRETED
from nanolab.kernels.paged_attention import paged_attention, paged_attention_op
from nanolab.lab.leverarms import opaque_projections
from nanolab.model.layers import linear_op, packed_linear_op

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def plain(sharp, device="cpu"):
    """The sharp model with plain weights, its matmuls `F.linear` (oneDNN's prepacked path has its
    own test below)."""
    return load_model(sharp.path, dtype=torch.float32, device=device, prepack=False)


class Counting:
    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("read", ["reference", "streamed"])
def test_compiled_decode_matches_the_reference(sharp_gqa24, read):
    if read == "streamed" and not INTERPRETED:
        pytest.skip("a CPU cache reads through Triton only in its interpreter; on a GPU machine the CUDA test "
                    "below runs the compiled streamed read")
    torch._dynamo.reset()
    model = plain(sharp_gqa24)
    forward = Counting(compile_decode(model))
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read=read), forward=forward)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
    logits, on_step = logit_recorder()
    run_until_done(engine, on_step=on_step)
    assert forward.calls >= 6, "the decode steps did not go through the compiled forward"
    assert_logits_match_reference(sharp_gqa24, seqs, logits)
    check_drained(engine.kv_cache, engine.scheduler)


def test_opaque_projections_compile_to_the_reference(sharp_gqa24):
    """The LM head and down projections marked opaque (`Linear.opaque`) reach the compiled graph as
    `linear_op` calls, and the decode logits still equal the reference's."""
    torch._dynamo.reset()
    model = plain(sharp_gqa24)
    opaque_projections(model, ("lm_head", "down"))
    forward = compile_decode(model)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read="reference"), forward=forward)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
    logits, on_step = logit_recorder()
    with torch._inductor.utils.fresh_cache():
        _, code = torch._inductor.utils.run_and_get_code(run_until_done, engine, on_step=on_step)
    assert sum("nanolab.linear" in c for c in code) >= 1, "no compiled graph called the opaque projection"
    assert_logits_match_reference(sharp_gqa24, seqs, logits)
    x, w = torch.randn(3, 24), torch.randn(7, 24)
    torch.testing.assert_close(linear_op(x, w), x @ w.T)
    torch.library.opcheck(linear_op, (x, w))
    with pytest.raises(ValueError, match="opaque: unknown projections"):
        opaque_projections(model, ("qkv",))


def test_prepacked_matmuls_compile_to_the_reference(sharp_gqa24):
    """With oneDNN's prepacked weights (the CPU's default), the compiled step calls each matmul as
    `packed_linear_op`, which finds the packed copy by the weight it is given, and the decode
    logits equal the reference's. A second model of the same shapes reuses the first one's graphs
    (nothing model-specific is baked in) and still reads its own weights."""
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]

    def decode(model, code: list[str] | None = None) -> tuple[list, list]:
        """Decode PROMPTS; into `code`, when given, the code inductor generated (this resets dynamo)."""
        assert model.lm_head.packed is not None
        forward = compile_decode(model)
        assert forward.options == CPU_OPTIONS  # a CPU model's wrapper is C++
        engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read="reference"), forward=forward)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
        logits, on_step = logit_recorder()
        if code is None:
            run_until_done(engine, on_step=on_step)
        else:
            with torch._inductor.utils.fresh_cache():
                code += torch._inductor.utils.run_and_get_code(run_until_done, engine, on_step=on_step)[1]
        return seqs, logits

    model = load_model(sharp_gqa24.path, dtype=torch.float32, device="cpu", prepack=True)
    code = []
    seqs, logits = decode(model, code)
    assert sum("packed_linear" in c for c in code) >= 1, "no compiled graph called the prepacked matmul"
    assert_logits_match_reference(sharp_gqa24, seqs, logits)
    compiled = graphs["unique_graphs"]
    down = model.layers[0].mlp.down_proj
    for rows in (1, 8):
        x = torch.randn(rows, down.in_features)
        torch.testing.assert_close(packed_linear_op(x, down.weight), x @ down.weight.T)
    del model, down
    gc.collect()

    again = load_model(sharp_gqa24.path, dtype=torch.float32, device="cpu", prepack=True)
    seqs, logits = decode(again)
    assert graphs["unique_graphs"] == compiled, "a second model of the same shapes compiled its own graphs"
    assert_logits_match_reference(sharp_gqa24, seqs, logits)
    with pytest.raises(RuntimeError, match="no prepacked copy of this weight"):
        packed_linear_op(x, torch.randn_like(again.layers[0].mlp.down_proj.weight))
    again.layers[0].mlp.down_proj.packed = None
    with pytest.raises(RuntimeError, match="no prepacked copy of this weight"):
        packed_linear_op(x, again.layers[0].mlp.down_proj.weight)


def test_one_row_matmuls_compile_to_a_reduction_on_the_cpu(sharp_gqa24):
    """A compiled one-row step on the CPU writes each matmul as a product and a sum
    (`layers.Linear.forward`), which inductor lowers into its own reduction: the one-row graph
    calls no matmul of any kind, and every step's logits equal the reference's. The graph that
    batches of 2 and 3 share calls the prepacked matmul, which the same check finds there, and
    the one-row test adds no guard to it."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()
    model = load_model(sharp_gqa24.path, dtype=torch.float32, device="cpu", prepack=True)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read="reference"), forward=compile_decode(model))
    seqs = engine.add_requests(PROMPTS[-1:], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    logits, on_step = logit_recorder()
    matmuls = ("packed_linear", "aten.mm", "cpu_mm_out", "addmm", "_linear_pointwise", "mkldnn")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    graphs = torch._dynamo.utils.counters["stats"]
    with torch._inductor.utils.fresh_cache():  # every graph compiled here, its code returned
        code = torch._inductor.utils.run_and_get_code(run_until_done, engine, on_step=on_step)[1]
        assert code, "nothing was compiled"
        assert not [m for m in matmuls if any(m in c for c in code)]  # no matmul left in the one-row graph
        assert_logits_match_reference(sharp_gqa24, seqs, logits)
        code = []  # as run_and_get_code collects it, without its reset: the one-row graph stays
        with mock.patch.object(GraphLowering, "save_output_code", code.append):
            for rows in (2, 3):
                before = graphs["unique_graphs"]
                engine.add_requests(PROMPTS[:rows], [params] * rows)
                run_until_done(engine)
                assert graphs["unique_graphs"] == before + (rows == 2), \
                    f"batch {rows}: {graphs['unique_graphs'] - before}"
        assert any("packed_linear" in c for c in code)
    torch._dynamo.reset()


def test_steady_tuning_swaps_the_benchmarker_and_puts_it_back():
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.benchmarking import TritonBenchmarker

    saved = triton_heuristics.benchmarker
    with steady_tuning():
        assert type(triton_heuristics.benchmarker) is TritonBenchmarker
    assert triton_heuristics.benchmarker is saved
    with pytest.raises(KeyError), steady_tuning():
        raise KeyError("a failed compile")
    assert triton_heuristics.benchmarker is saved


def test_a_decode_forward_tunes_batch_1_steadily_and_launches_its_ops_as_dependents(tiny_model):
    """Each call runs inside what the forward was built with: batch 1 (and only batch 1) inside
    `steady_tuning` when `steady`, and every batch with the engine's ops launched as programmatic
    dependents when `pdl`; both are put back after the call. On the CPU, `compile_decode` turns
    neither on."""
    import contextvars

    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.benchmarking import TritonBenchmarker

    def launching_dependents() -> bool:
        """The scoped setting `kernels.pdl.launching_dependents` holds in this context (what
        `ops_pdl` asks before the device: a CPU never launches as a dependent)."""
        return {var.name: on for var, on in contextvars.copy_context().items()}.get("nanolab.ops_pdl", False)

    default = compile_decode(tiny_model)
    assert not (default.pdl or default.steady or default.tune_batch_1)
    seen = []

    def record(name):
        def forward(ids, positions, cache=None):
            seen.append((name, launching_dependents(), type(triton_heuristics.benchmarker) is TritonBenchmarker))
        return forward

    try:
        forward = compile_decode(tiny_model, tune_batch_1=True, pdl=True)
        assert forward.steady  # with the batch-1 tuning, by default
        forward.single, forward.batched = record("single"), record("batched")
        for rows in (1, 4):
            forward(torch.zeros(rows, 1, dtype=torch.long), torch.zeros(rows, 1, dtype=torch.long))
    finally:
        tiny_model.lm_head.opaque = False  # compile_decode marked the session's model
    assert seen == [("single", True, True), ("batched", True, False)]
    assert not launching_dependents() and type(triton_heuristics.benchmarker) is not TritonBenchmarker


def test_an_engine_compiles_past_what_other_engines_left_of_dynamos_limit(tiny_path):
    """Dynamo counts one function's compiled graphs across the process, and every engine's model
    shares `LlamaModel.forward`, so engines of other dtypes or quantizations built earlier use up
    its limit (8 by default: a process's third such engine failed its capture). With the limit at
    1, as if they had, a compiled engine still decodes at two rows and at one, and its varlen step
    (what a varlen graph captures) runs at four tokens and at one: four graphs, the limit back at 1
    after each call. Without `recompile_budget` the second compile fails."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from nanolab import LLM
    from nanolab.engine.graphs import varlen_step
    from nanolab.model.llama import LlamaModel

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            llm = LLM(str(tiny_path), device="cpu", compile=True)
            outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                                [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5)],
                                use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
            runner = llm.engine.runner
            with torch.inference_mode():
                runner.kv_cache.reserve_varlen(8)
                for n in (4, 1):
                    varlen_step(runner.forward.varlen, runner.kv_cache, runner.kv_cache.plan_varlen_padding(n))
            assert len(_debug_get_cache_entry_list(LlamaModel.forward.__code__)) == 4
            assert torch._dynamo.config.recompile_limit == 1
    finally:
        torch._dynamo.reset()  # later tests count their own compiles of the model


def test_the_read_op_is_the_kernel():
    """The custom op returns what the kernel returns, and its fake gives the shape dynamo traces with."""
    torch.manual_seed(0)
    dev = "cpu" if INTERPRETED else "cuda"  # Triton runs CPU tensors only in its interpreter
    q, k, v = (torch.randn(*shape, device=dev) for shape in ((2, 1, 4, 16), (33, 2, 16), (33, 2, 16)))
    table = torch.tensor([[0, 1], [-1, -1], [-1, -1]], dtype=torch.int32, device=dev)
    rows, lens = torch.tensor([0, 0], device=dev), torch.tensor([20, 5], device=dev)
    args = (q, k, v, table, rows, lens, (lens - 1)[:, None], 16)
    assert torch.equal(paged_attention_op(*args), paged_attention(q, k, v, table, rows, 16, lens, (lens - 1)[:, None]))
    torch.library.opcheck(paged_attention_op, args)


@needs_cuda
def test_compiled_graphs_with_async_scheduling_on_cuda(sharp_gqa24):
    """The configuration `LLM` builds on a GPU: inductor's step captured in CUDA graphs, launched
    ahead of the read-back. fp32, so its logits (read synchronously) and its greedy tokens (read
    asynchronously) must equal the eager engine's."""
    torch._dynamo.reset()
    model = plain(sharp_gqa24, "cuda")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def decode(forward=None, **fields):
        config = EngineConfig(num_blocks=64, block_size=4, compile=False, async_scheduling=False).replace(**fields)
        engine = Engine(model, config, forward=forward, progress=False)
        seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
        logits, on_step = logit_recorder()
        # An asynchronous step's logits are overwritten before its tokens are read: none to record.
        run_until_done(engine, on_step=None if engine.async_scheduling else on_step)
        check_drained(engine.kv_cache, engine.scheduler)
        return seqs, logits

    forward = compile_decode(model)
    eager, _ = decode(enforce_eager=True)
    synced, logits = decode(forward=forward)
    assert_logits_match_reference(sharp_gqa24, synced, {k: [r.cpu() for r in v] for k, v in logits.items()},
                                  atol=1e-3, rtol=1e-3)
    overlapped, _ = decode(forward=forward, async_scheduling=True)
    expected = [s.output_token_ids for s in eager]
    assert [s.output_token_ids for s in synced] == expected
    assert [s.output_token_ids for s in overlapped] == expected


@needs_cuda
def test_batch_1_decodes_through_its_own_tuned_graph_on_cuda(sharp_gqa24):
    """On CUDA a lone request's steps go through `DecodeForward.single`, compiled with
    coordinate-descent tuning (its projections become Triton reductions), and a batch's through
    `batched`; both give the reference's logits in fp32. On the CPU there is one graph."""
    cpu = plain(sharp_gqa24)
    assert not compile_decode(cpu).tune_batch_1
    assert not any(layer.self_attn.qkv_proj.step_kernel for layer in cpu.layers)
    torch._dynamo.reset()
    model = plain(sharp_gqa24, "cuda")
    forward = compile_decode(model)
    assert forward.tune_batch_1 and forward.single is not forward.batched
    # a batch's layer projections through the Triton GEMV (`kernels.gemv.step_linear`), not the LM head
    assert all(p.step_kernel for layer in model.layers
               for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert not model.lm_head.step_kernel
    forward.single, forward.batched = Counting(forward.single), Counting(forward.batched)
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, compile=False, async_scheduling=False),
                    progress=False, forward=forward)
    assert forward.single.calls and forward.batched.calls, "capture did not build both graphs"
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    logits, on_step = logit_recorder()
    alone = engine.add_requests(PROMPTS[:1], [params])
    run_until_done(engine, on_step=on_step)
    together = engine.add_requests(PROMPTS[1:], [params] * 2)
    run_until_done(engine, on_step=on_step)
    assert_logits_match_reference(sharp_gqa24, alone + together, {k: [r.cpu() for r in v] for k, v in logits.items()},
                                  atol=1e-3, rtol=1e-3)
    check_drained(engine.kv_cache, engine.scheduler)


@needs_cuda
def test_folded_step_matches_the_reference_on_cuda(sharp_gqa24, monkeypatch):
    """The lab's folded step (`lab.folds.folded_decode`): a graphed batch's compiled steps run each
    layer's norms, residual adds and SwiGLU inside its GEMVs, and every step's logits equal the
    one-shot reference's in fp32, to 1e-3."""
    from nanolab.lab import folds

    folded = []
    real = folds.gemv
    monkeypatch.setattr(folds, "gemv", lambda x, w, *a, **kw: folded.append(kw.get("norm") is not None)
                        or real(x, w, *a, **kw))
    torch._dynamo.reset()
    model = plain(sharp_gqa24, "cuda")
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, compile=False, async_scheduling=False),
                    progress=False, forward=folds.folded_decode(model))
    assert any(folded), "the captured batch steps did not fold the norms into their GEMVs"
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
    logits, on_step = logit_recorder()
    run_until_done(engine, on_step=on_step)
    assert_logits_match_reference(sharp_gqa24, seqs, {k: [r.cpu() for r in v] for k, v in logits.items()},
                                  atol=1e-3, rtol=1e-3)
    check_drained(engine.kv_cache, engine.scheduler)
    torch._dynamo.reset()
