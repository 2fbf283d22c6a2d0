"""Day 61's instruments on the CPU: the Triton GEMV (in Triton's interpreter) against float64, the
sweep's tiles within shared memory, the levers' arms as engines built through the public
constructor, kernel classes, the waterfall's host share, and a mixed step's parts."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from nanolab import Engine, EngineConfig, load_model
from nanolab.engine import runner
from nanolab.kernels import gemv as gemv_module
from nanolab.kernels.gemv import MAX_ROWS, STEP_ROWS, GemvConfig, block_rows, gemv, step_config, step_linear
from nanolab.lab.agreement import LogitsSampler, decode_logits
from nanolab.lab.gemvbench import choose_config, projection_shapes, sweep_configs
from nanolab.lab.stepparts import breakdown, kernel_class
from nanolab.model.config import ModelConfig
from nanolab.model.weights import resolve_weights

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests: CPU tensors only")


@pytest.mark.parametrize("m, n, k, config", [
    (1, 40, 512, GemvConfig(16, 128, 1)),  # a column edge inside the last tile
    (3, 70, 1024, GemvConfig(32, 128, 2)),  # split-K: fp32 partials summed once
    (16, 64, 256, GemvConfig(64, 256, 1)),
    (5, 33, 2048, GemvConfig(16, 256, 8)),
    (40, 48, 512, GemvConfig(32, 128, 2)),  # rows in a 64-row tile, 24 of them padding
    (64, 32, 256, GemvConfig(32, 128, 1)),  # the most rows a launch takes
])
def test_gemv_is_a_linear(m, n, k, config):
    torch.manual_seed(m * n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    out = gemv(x, w, config)
    ref = x.double() @ w.double().T
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6


@pytest.mark.parametrize("m, n, k, config", [
    (3, 70, 1024, GemvConfig(32, 128, 1)),  # a column edge inside the last program
    (5, 33, 2048, GemvConfig(16, 256, 4)),  # split-K: the residual added by `_sum_splits`
    (40, 48, 512, GemvConfig(32, 128, 1)),  # 24 padding rows of a 64-row tile
])
def test_gemv_folds_the_norm_swiglu_and_residual_around_the_product(m, n, k, config):
    """Each neighbour `step_projection` folds into the GEMV, against float64 torch: RMSNorm of x
    (its scale applied after the dot), SwiGLU of a [gate, up] x, and the residual added before the
    one rounding, one share of K for the norm and any number for the others."""
    import torch.nn.functional as F

    torch.manual_seed(m * n + k)
    x, w, r = torch.randn(m, k) * 3, torch.randn(n, k), torch.randn(m, n)
    g, gate_up = torch.rand(k) + 0.5, torch.randn(m, 2 * k)

    def close(out, ref):
        assert out.shape == ref.shape and float((out.double() - ref).norm() / ref.norm()) < 1e-6

    if config.split_k == 1:
        ref = F.linear(F.rms_norm(x.double(), (k,), g.double(), 1e-5), w.double())
        close(gemv(x, w, config, norm=g), ref)
        close(gemv(x, w, config, norm=g, residual=r), ref + r.double())
    silu_up = F.silu(gate_up[:, :k].double()) * gate_up[:, k:].double()
    close(gemv(gate_up, w, config, swiglu=True), F.linear(silu_up, w.double()))
    close(gemv(gate_up, w, config, swiglu=True, residual=r), F.linear(silu_up, w.double()) + r.double())
    close(gemv(x, w, config, residual=r), F.linear(x.double(), w.double()) + r.double())


def test_gemv_refuses_folds_it_cannot_make():
    x, w = torch.randn(3, 256), torch.randn(48, 256)
    with pytest.raises(ValueError, match="norm must be"):
        gemv(x, w, GemvConfig(16, 128, 2), norm=torch.ones(256))  # a share of K cannot see a row's rms
    with pytest.raises(ValueError, match="norm must be"):
        gemv(x, w, norm=torch.ones(128))
    with pytest.raises(ValueError, match="swiglu takes twice"):
        gemv(x, w, swiglu=True)
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=torch.zeros(3, 47))


def test_step_projection_is_its_torch_definition_past_the_gemv_rows(monkeypatch):
    """At most MAX_ROWS rows through `gemv`; past that, or where the tiles do not divide K, the same
    function in torch's ops; both against the unfused layer's ops in float64. A residual of the
    wrong shape is refused, not broadcast."""
    import torch.nn.functional as F

    from nanolab.lab import folds

    torch.manual_seed(1)
    calls = []
    real = folds.gemv
    monkeypatch.setattr(folds, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for m, k in ((4, 256), (MAX_ROWS + 1, 256), (4, 200)):  # 200: no tile of at least 16 divides it past 8
        w, g = torch.randn(48, k), torch.rand(k) + 0.5
        x, gate_up, r = torch.randn(m, 1, k), torch.randn(m, 1, 2 * k), torch.randn(m, 1, 48)
        ref = F.linear(F.rms_norm(x.double(), (k,), g.double(), 1e-5), w.double()) + r.double()
        torch.testing.assert_close(folds.step_projection(x, w, g, 1e-5, r).double(), ref, rtol=1e-5, atol=1e-4)
        silu_up = F.silu(gate_up[..., :k].double()) * gate_up[..., k:].double()
        ref = F.linear(silu_up, w.double()) + r.double()
        torch.testing.assert_close(folds.step_projection(gate_up, w, residual=r, swiglu=True).double(), ref,
                                   rtol=1e-5, atol=1e-4)
    assert calls == [(4, 1, 256), (4, 1, 512)]
    with pytest.raises(ValueError, match="do not make a projection"):
        folds.step_projection(torch.randn(4, 1, 256), torch.randn(48, 256), residual=torch.randn(1, 48))


def test_gemv_keeps_leading_dims_and_refuses_what_it_cannot_run():
    x, w = torch.randn(2, 1, 256), torch.randn(48, 256)
    assert gemv(x, w).shape == (2, 1, 48)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(MAX_ROWS + 1, 256), w)
    with pytest.raises(ValueError, match="features"):
        gemv(torch.randn(1, 128), w)
    with pytest.raises(ValueError, match="multiple"):
        gemv(torch.randn(1, 256), torch.randn(8, 256), GemvConfig(16, 512, 1))


def test_sweep_tiles_fit_shared_memory_and_split_k_evenly():
    config = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)
    for n, k in projection_shapes(config).values():
        configs = sweep_configs(n, k)
        assert configs and choose_config(n, k).block_k * choose_config(n, k).split_k <= k
        for c in configs:
            assert k % (c.split_k * c.block_k) == 0
            assert (c.block_n + 16) * c.block_k * 2 * c.num_stages <= 200_000  # the OutOfResources an H200 raised


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)


@pytest.mark.parametrize("m", [1, 2, 8, 16, 17, 32, 64])
def test_step_tiles_divide_k_and_fit_shared_memory(m):
    for n, k in projection_shapes(ModelConfig(**LLAMA_1B)).values():
        c = step_config(n, k, m)
        assert k % (c.split_k * c.block_k) == 0
        assert (block_rows(m) + c.block_n) * c.block_k * 2 * c.num_stages <= 200_000
        c = step_config(n, k, m, swiglu=True)  # gate's and up's tiles: the OutOfResources an H200 raised at 64 rows
        assert (2 * block_rows(m) + c.block_n) * c.block_k * 2 * c.num_stages <= 200_000
    assert [block_rows(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


def test_step_linear_takes_its_rows_to_gemv_and_the_rest_to_f_linear(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(48, 1024)
    calls = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for m in (3, STEP_ROWS, STEP_ROWS + 1):
        x = torch.randn(m, 1, 1024)
        out = step_linear(x, w)
        assert out.shape == (m, 1, 48)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    assert calls == [(3, 1, 1024), (STEP_ROWS, 1, 1024)]


def test_step_kernels_run_the_compiled_batched_step_through_gemv(monkeypatch):
    """A compiled engine's decode step of 3 rows on the tiny model: every layer projection goes
    through `step_linear` (its kernel in the interpreter), the LM head does not, the first decode
    step's logits match the same engine's without the lever, and switching it off puts
    `F.linear` back."""
    model = load_model(resolve_weights("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 8, 6, 2]]
    seen = []
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, w, *a, **kw: seen.append(tuple(w.shape)) or real(x, w, *a, **kw))

    def logits(on: bool) -> torch.Tensor:
        torch._dynamo.reset()
        forward = runner.compile_decode(model)  # on the CPU, marks none; compiling waits for the first call
        runner.mark_step_kernels(model, on)
        engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read="reference"), forward=forward,
                        progress=False)
        return decode_logits(engine, prompts)

    try:
        ref = logits(False)
        assert not seen
        out = logits(True)
    finally:
        runner.mark_step_kernels(model, False)
        torch._dynamo.reset()
    layers = model.config.num_hidden_layers
    assert len(seen) == 4 * layers and tuple(model.lm_head.weight.shape) not in seen
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert not any(layer.mlp.down_proj.step_kernel for layer in model.layers)


def test_folded_step_folds_every_norm_add_and_swiglu_into_the_projections(monkeypatch):
    """`lab.folds.folded_decode`: the compiled batched step of the tiny model runs each layer as four
    GEMVs, the norms in the q/k/v and gate/up ones, the residual adds in the o and down ones and
    SwiGLU in down, and its first decode step's logits equal the engine's compiled step's (no
    fold); batch 1 is the model's own forward."""
    from nanolab.lab import folds

    model = load_model(resolve_weights("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    seen = []
    real = folds.gemv
    monkeypatch.setattr(folds, "gemv", lambda x, w, *a, **kw: seen.append(
        (tuple(w.shape), kw.get("norm") is not None, kw.get("residual") is not None, kw.get("swiglu", False)))
        or real(x, w, *a, **kw))

    def logits(build, prompts) -> torch.Tensor:
        torch._dynamo.reset()
        engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, read="reference"), forward=build(model),
                        progress=False)
        return decode_logits(engine, prompts)

    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 8, 6, 2]]
    try:
        ref = logits(runner.compile_decode, prompts)
        assert not seen
        out = logits(folds.folded_decode, prompts)
        layer = model.layers[0]
        qkv, o, gate_up, down = (tuple(p.weight.shape) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj))
        assert seen == [(qkv, True, False, False), (o, False, True, False), (gate_up, True, False, False),
                        (down, False, True, True)] * model.config.num_hidden_layers
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        seen.clear()
        one = logits(folds.folded_decode, prompts[:1])
        assert not seen  # batch 1: the model's forward
        torch.testing.assert_close(one, logits(runner.compile_decode, prompts[:1]), rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_kernel_classes():
    assert kernel_class("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == "projections"
    assert kernel_class("_paged_decode_group") == "attention read"
    assert kernel_class("_varlen_group") == kernel_class("_varlen_fold") == "attention read"
    assert kernel_class("triton_red_fused__to_copy_add_mean_mul_rsqrt_0") == "fused by inductor"
    assert kernel_class("void at::native::vectorized_layer_norm_kernel<c10::BFloat16") == "norms"
    assert kernel_class("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOps") == "sampling"
    assert kernel_class("Memcpy HtoD (Pageable -> Device)") == "copies and indexing"
    assert kernel_class("_upload") == "copies and indexing"  # the plan's upload kernel, kernels.step_inputs
    assert kernel_class("void at::native::silu_kernel") == "other elementwise"


def test_the_host_share_is_what_the_kernels_leave():
    profile = pd.DataFrame({"kernel": ["nvjet_x", "_paged_decode_group", "triton_poi_fused_0"],
                            "us_per_step": [800.0, 90.0, 80.0]})
    parts = breakdown(profile, ms_per_step=1.2).set_index("part").ms
    assert parts["projections"] == pytest.approx(0.8) and parts["attention read"] == pytest.approx(0.09)
    assert parts["host (GPU idle)"] == pytest.approx(1.2 - 0.97)


def test_a_prompt_steps_kernels_come_out_of_a_whole_calls_by_name():
    """`without_kernels`: a whole call's kernels less its prompt step's, by name, per decode step;
    a kernel only the prompt step ran (a weight widened) leaves nothing, and one it shares with the
    decode steps keeps the decode steps' calls and time alone."""
    from nanolab.lab.stepparts import without_kernels

    whole = pd.DataFrame({"arm": "fp8", "kernel": ["_gemv", "direct_copy_kernel", "nvjet_prompt", "_rope_write"],
                          "calls": [640, 64, 16, 170], "gpu_us": [6400.0, 3000.0, 400.0, 340.0]})
    prompt = pd.DataFrame({"arm": "fp8", "kernel": ["direct_copy_kernel", "nvjet_prompt", "_rope_write"],
                           "calls": [64, 16, 10], "gpu_us": [3000.0, 400.0, 40.0]})
    left = without_kernels(whole, prompt, steps=10).set_index("kernel")
    assert list(left.index) == ["_gemv", "_rope_write"]
    assert left.loc["_gemv", "us_per_step"] == pytest.approx(640.0)
    assert (left.loc["_rope_write", "calls"], left.loc["_rope_write", "us_per_step"]) == (160, pytest.approx(30.0))
    assert left.share.sum() == pytest.approx(1.0) and left.loc["_gemv", "class"] == "projections"
    assert (left.arm == "fp8").all()


def parts_of(stem: str, batch: int, order: list[str]) -> pd.DataFrame:
    from nanolab.lab.report import load_table

    parts = load_table(f"{stem}_parts", "h200")
    return (parts[parts.batch == batch].pivot_table(index="part", columns="arm", values="ms", aggfunc="sum")
            [order].fillna(0.0))


def test_a_committed_lever_run_is_shown_and_a_missing_one_says_how_to_make_it(capsys):
    from nanolab.lab.leverrun import show_lever_run

    levers, parts, order = show_lever_run("day61_batch1", "ms_per_step", "make it")
    assert order == list(dict.fromkeys(levers.arm)) and list(parts.columns) == order
    assert not parts.isna().any().any()
    # a run profiled at batches 1, 8 and 32 shows each, and returns batch 1's; one profiled at 8 alone, 8's
    _, step_parts, step_order = show_lever_run("day61_step", "ms_per_step", "make it")
    assert "batch 8, ms per step by part:" in capsys.readouterr().out
    assert step_parts.equals(parts_of("day61_step", 1, step_order))
    _, skip_parts, skip_order = show_lever_run("day61_skip", "ms_per_step", "make it")
    assert skip_parts.equals(parts_of("day61_skip", 8, skip_order))
    assert show_lever_run("day99_nothing", "ms_per_step", "python -m nanolab levers --stem day99_nothing") is None
    assert "`python -m nanolab levers --stem day99_nothing` on an H200 makes it" in capsys.readouterr().out


def test_the_default_arms_add_each_kept_lever_to_the_one_before_and_end_at_the_engine():
    """`DEFAULT_ARMS` is a waterfall: each arm keeps every setting of the one before and changes
    one lever, and the last is what the engine does by default."""
    from dataclasses import asdict

    from nanolab.lab.leverarms import ARMS, DEFAULT_ARMS, SPREAD_ARMS

    assert set(DEFAULT_ARMS) <= set(ARMS) and set(SPREAD_ARMS) <= set(ARMS)
    assert len({a.name for a in ARMS}) == len(ARMS)
    for before, after in zip(DEFAULT_ARMS, DEFAULT_ARMS[1:]):
        changed = {k for k, v in asdict(after).items() if k != "name" and asdict(before)[k] != v}
        assert len(changed) == 1, f"{after.name}: {sorted(changed)}"
    last = DEFAULT_ARMS[-1]
    assert last.compile and last.async_scheduling and last.tune_batch_1 and last.opaque == ("lm_head",)
    assert last.step_pdl and last.steady and last.triton_projections
    assert not (last.fused or last.autotune or last.step_fused)


def test_every_arm_builds_its_forward_through_public_construction(tiny_model):
    """Each arm's forward, as `lever_forward` builds it (nothing compiles until a call): the model
    itself, the compiled step with the arm's options, the autotuned batch 1, the fused projections
    over the compiled step, the folded step; with the arm's projections marked opaque or through
    the GEMV, and back as they were after."""
    from nanolab.lab.folds import FoldedStep
    from nanolab.lab.leverarms import ARMS, AUTOTUNE_BATCH_1, lever_forward
    from nanolab.lab.projections import FusedDecode

    model = tiny_model
    try:
        for lever in ARMS:
            forward = lever_forward(model, lever)
            if not lever.compile:
                assert forward is None, lever.name
                continue
            compiled = forward.fallback if lever.fused else forward
            assert isinstance(forward, FusedDecode) == lever.fused and (not lever.fused or forward.pdl == lever.pdl)
            assert isinstance(compiled, runner.DecodeForward), lever.name
            if lever.autotune:
                assert compiled.batch_1_options == AUTOTUNE_BATCH_1
            else:
                assert compiled.tune_batch_1 == lever.tune_batch_1 and compiled.pdl == lever.step_pdl
                assert compiled.steady == lever.steady
            assert isinstance(compiled.batched._orig_mod, FoldedStep) == lever.step_fused, lever.name
            assert model.lm_head.opaque == ("lm_head" in lever.opaque)
            assert model.layers[0].mlp.down_proj.opaque == ("down" in lever.opaque)
            assert model.layers[0].self_attn.qkv_proj.step_kernel == lever.triton_projections
    finally:
        lever_forward(model, ARMS[0])  # the session's model as it was: nothing opaque, no GEMV
        torch._dynamo.reset()
    assert not model.lm_head.opaque and not model.layers[0].mlp.down_proj.step_kernel


def test_the_levers_command_refuses_arms_it_does_not_have():
    from nanolab.lab.leverarms import ARMS
    from nanolab.lab.levers import parse_arms

    assert parse_arms(None, ARMS[:2]) == ARMS[:2]
    assert parse_arms(f"0,{len(ARMS) - 1}", ()) == (ARMS[0], ARMS[-1])
    for bad in ("", "x", f"{len(ARMS)}", "-1", "1,,2"):
        with pytest.raises(ValueError, match="--arms"):
            parse_arms(bad, ())


def test_decode_logits_reads_an_asynchronous_engine_through_its_sampler(tiny_model):
    """An engine that overlaps its steps returns no logits: `decode_logits` reads them through the
    `LogitsSampler` it was built with, and they equal a synchronous engine's. Without the sampler it
    refuses. (On the CPU, asynchronous scheduling runs without graphs, as asked.)"""
    prompts = [[1, 5, 9, 2], [7, 3], [4, 4, 8, 6, 2]]
    config = EngineConfig(num_blocks=64, block_size=4, read="reference", enable_chunked_prefill=False)
    ref = decode_logits(Engine(tiny_model, config, progress=False), prompts)
    sampler = LogitsSampler()
    overlapped = Engine(tiny_model, config.replace(async_scheduling=True), sampler=sampler, progress=False)
    assert overlapped.async_scheduling
    with pytest.raises(ValueError, match="sampler"):
        decode_logits(overlapped, prompts)
    torch.testing.assert_close(decode_logits(overlapped, prompts, sampler), ref)
    assert not sampler.synchronous


def test_recording_tuning_keeps_each_chosen_config_and_every_timing(monkeypatch):
    """`recording_tuning` appends what coordinate descent settled on and what each benchmark
    returned, per kernel, and puts inductor's methods back after."""
    from types import SimpleNamespace

    import triton
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from nanolab.lab.tuningspread import config_text, recording_tuning

    best = SimpleNamespace(config=triton.Config({"XBLOCK": 4, "R0_BLOCK": 2048}, num_warps=16, num_stages=1))
    other = SimpleNamespace(config=triton.Config({"XBLOCK": 1, "R0_BLOCK": 1024}, num_warps=8, num_stages=2))
    monkeypatch.setattr(CachingAutotuner, "coordinate_descent_tuning", lambda self, launcher: best)
    monkeypatch.setattr(CachingAutotuner, "bench", lambda self, launcher: 0.026 if launcher is best else 0.05)
    fake = SimpleNamespace(inductor_meta={"kernel_name": "triton_red_fused_mm_6"})
    configs, timings = [], []
    with recording_tuning(configs, timings):
        for launcher in (other, best):
            CachingAutotuner.bench(fake, launcher)
        assert CachingAutotuner.coordinate_descent_tuning(fake, other) is best
    assert configs == [{"kernel": "triton_red_fused_mm_6", "config": "XBLOCK: 4, R0_BLOCK: 2048, num_warps: 16"}]
    assert [t["us"] for t in timings] == [50.0, 26.0]
    assert timings[0]["config"] == config_text(other.config) == "XBLOCK: 1, R0_BLOCK: 1024, num_warps: 8, num_stages: 2"
    assert CachingAutotuner.bench(fake, best) == 0.026  # put back: nothing more recorded
    assert len(timings) == 2


def test_mixed_step_anatomy_splits_each_mixed_step_beside_a_decode_step():
    """`lab.mixedsteps` on the tiny model (CPU, eager): decode steps of the running rows, and the
    mixed steps of each prompt, chunk by chunk, each carrying those rows beside the prompt's tokens
    within the budget; the host's part inside `run_varlen` and sampling add up with the rest to
    the step, and a CPU has no GPU span. The engine's own methods are back afterwards."""
    from nanolab.lab.mixedsteps import _StepClock, mixed_step_anatomy

    table = mixed_step_anatomy(resolve_weights("tiny"), torch.float32, rows=3, context=16, prompt_lens=(8, 40),
                               repeats=2, budget=32, progress=False)["day61_mixed_anatomy"]
    decode, mixed = table[table.phase == "decode"], table[table.phase == "mixed"]
    assert len(decode) == 1 and decode.rows.iloc[0] == 3 and decode.tokens.iloc[0] == 3
    assert decode.rest_ms.isna().all()  # a decode step's parts are not split
    # the 8-token prompt rides one step beside the 3 rows; the 40-token one takes 29 tokens, then 11
    assert list(zip(mixed.prompt_len, mixed.chunk, mixed.tokens)) == [(8, 0, 11), (40, 0, 32), (40, 1, 14)]
    assert (mixed.rows == 4).all() and (mixed.steps == 2).all()
    parts = mixed.forward_host_ms + mixed.sample_ms + mixed.rest_ms
    assert (mixed.rest_ms >= 0).all() and ((parts - mixed.step_ms).abs() < 1e-6).all()
    assert mixed.forward_span_ms.isna().all() and (table.arm == "eager").all()

    clock = _StepClock(torch.device("cpu"))
    engine = Engine(load_model(resolve_weights("tiny"), dtype=torch.float32), EngineConfig(num_blocks=16),
                    progress=False, sampler=clock.sampler)
    clock.attach(engine)
    assert "run_varlen" in vars(engine.runner)
    clock.close()
    assert "run_varlen" not in vars(engine.runner)


def test_host_parts_charge_each_part_its_own_time_and_come_off_cleanly():
    """`mixedsteps._HostParts` on a made-up runner and model whose every call advances a fake clock by
    a known amount: each part is charged its own time, not its children's (the rotary tables are the
    gap between the embedding and the first layer; the read and the write are timed on the cache view
    the model's layers are handed, whether the cache comes by keyword or by position), and everything
    it installed is gone after `close()`, the instance's own wrappers beneath it included."""
    from types import SimpleNamespace

    from torch import nn

    from nanolab.lab.mixedsteps import _HostParts, _TimedView

    now = [0.0]

    class Leaf(nn.Module):
        def __init__(self, cost: float) -> None:
            super().__init__()
            self.cost = cost

        def forward(self, *_):
            now[0] += self.cost

    class Mlp(Leaf):
        def __init__(self) -> None:
            super().__init__(5.0)
            self.down_proj = Leaf(6.0)

        def forward(self):
            super().forward()
            self.down_proj()

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Mlp()

        def forward(self, cache):
            assert isinstance(cache, _TimedView) and cache.plan == "the plan"  # the view's own attributes show
            now[0] += 4.0
            cache.write_rotated()
            cache.read()
            self.mlp()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = Leaf(8.0)
            self.layers = nn.ModuleList([Layer()])

        def forward(self, ids, positions, cache, logits_index=None):
            now[0] += 3.0
            self.embed_tokens(ids)
            now[0] += 7.0  # the rotary tables
            for layer in self.layers:
                layer(cache)

    class View:
        plan = "the plan"

        def write_rotated(self):
            now[0] += 9.0

        def read(self):
            now[0] += 10.0

    model = Model()
    by_position = [False]

    def plan_varlen():
        now[0] += 2.0

    def own_wrapper():  # an instance attribute already there, as `_StepClock` leaves one
        now[0] += 1.0
        runner.kv_cache.plan_varlen()
        model(None, None, View()) if by_position[0] else model(None, None, cache=View())

    runner = SimpleNamespace(model=model, run_varlen=own_wrapper, kv_cache=SimpleNamespace(plan_varlen=plan_varlen))
    parts = _HostParts(clock=lambda: now[0])
    parts.attach(SimpleNamespace(runner=runner))
    expected = {"run_varlen: ids, the view, the rest": 1.0, "plan (plan_varlen)": 2.0,
                "model: the sampled rows' gather, the rest": 3.0, "embed_tokens": 8.0, "rotary tables": 7.0,
                "decoder layer: residual adds, the rest": 4.0, "rotation and K/V write": 9.0, "attention read": 10.0,
                "mlp: SwiGLU, the rest": 5.0, "down_proj": 6.0}
    for position in (False, True):
        by_position[0] = position
        runner.run_varlen()
        spent = parts.take()
        assert {part: us / 1e6 for part, (_, us) in spent.items()} == expected
        assert all(calls == 1 for calls, _ in spent.values())
    parts.close()
    assert parts.take() == {}
    assert runner.run_varlen is own_wrapper and runner.kv_cache.plan_varlen is plan_varlen
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_mixed_host_parts_split_every_mixed_step_of_the_tiny_model():
    from nanolab.lab.mixedsteps import mixed_host_parts

    path = resolve_weights("tiny")
    table = mixed_host_parts(path, torch.float32, rows=3, context=16, prompt_lens=(8, 20), repeats=2, budget=32,
                             progress=False)["day61_mixed_host"]
    layers = ModelConfig.from_dir(path).num_hidden_layers
    for prompt_len, t in table.groupby("prompt_len"):
        calls = t.set_index("part").calls
        assert calls["qkv_proj"] == calls["attention read"] == calls["input_layernorm"] == layers
        assert calls["plan (plan_varlen)"] == calls["lm_head"] == calls["rotary tables"] == 1
        assert (t.tokens == prompt_len + 3).all() and (t.us >= 0).all()
    with pytest.raises(ValueError, match="prompt_lens="):
        mixed_host_parts(path, torch.float32, rows=3, budget=32, prompt_lens=(30,), progress=False)
    for name in ("rows", "context", "repeats", "budget"):
        with pytest.raises(ValueError, match=f"^{name}=0"):
            mixed_host_parts(path, torch.float32, progress=False, **{name: 0})
