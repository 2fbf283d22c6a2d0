"""FP8 weights: e4m3 values with a scale per output channel. The round trip stays within e4m3's
rounding bound on weights whose rows differ in scale by orders of magnitude (so a scale applied
along the wrong axis shows); a quantized `Linear` computes the matmul of the weight read back; and
on SmolLM2, quantizing every decoder layer keeps the perplexity of a text shipped in tests/data
within 1% of bf16's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_smollm2

from nanolab import LLM, EngineConfig, SamplingParams
from nanolab.model.layers import Linear
from nanolab.model.quant import E4M3, dequantize_fp8, fp8_error_bound, quantize_fp8

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def weights(out: int = 48, inp: int = 48) -> torch.Tensor:
    """Rows scaled from 1e-3 to 1e2 (and one row of zeros), with a few large outliers."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-3, 2, out)[:, None]
    w[5] = 0.0
    w[7, 3] = 500.0
    return w


def test_the_round_trip_stays_within_e4m3s_bound():
    w = weights()
    q, scale = quantize_fp8(w)
    assert q.dtype == E4M3 and scale.shape == (48,) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale)
    assert ((back - w).abs() <= fp8_error_bound(w, scale)).all()
    assert float(q.float().abs().amax(dim=1)[7]) == 448.0  # each row spans e4m3's range
    assert (back[5] == 0).all()
    rect = weights(16, 80)
    q, scale = quantize_fp8(rect)
    assert ((dequantize_fp8(q, scale) - rect).abs() <= fp8_error_bound(rect, scale)).all()
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        quantize_fp8(torch.ones(2, 3, 4))


def test_a_quantized_linear_is_the_matmul_of_its_weight_read_back():
    layer = Linear(48, 48)
    layer.weight.data = weights()
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(1))
    exact = F.linear(x, layer.weight.data)
    layer.quantize_fp8_()
    assert layer.weight is None and layer.qweight.dtype == E4M3
    out = layer(x)
    read_back = dequantize_fp8(layer.qweight, layer.scale, torch.float64)
    ref = x.double() @ read_back.T
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.allclose(out, exact, rtol=0.07, atol=0.07 * float(exact.abs().max()))
    # bf16 rows: the widened weight is exact, so only the product's and the scale's roundings remain
    low = layer(x.bfloat16())
    ref = x.bfloat16().double() @ read_back.T
    assert low.dtype == torch.bfloat16
    assert bool(((low.double() - ref).abs() <= 2.0**-7 * (x.bfloat16().double().abs() @ read_back.abs().T)).all())


def test_quantization_is_a_checked_field():
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(quantization="int4")
    assert EngineConfig(quantization="fp8").quantization == "fp8"


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], from the engine's prompt logprobs."""
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return float(torch.tensor([-lp for lp, _ in out.prompt_logprobs]).mean().exp())


@needs_smollm2
@pytest.mark.slow
def test_fp8_keeps_smollm2s_perplexity_within_1_percent_of_bf16():
    base = LLM("smollm2-135m", device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    ids = base.tokenizer.encode(TEXT.read_text())
    assert len(ids) > 300
    fp8 = LLM("smollm2-135m", device="cpu", dtype="bfloat16", quantization="fp8", enable_prefix_caching=False)
    assert all(m.qweight is not None for m in fp8.model.layers[0].modules() if isinstance(m, Linear))
    assert fp8.model.lm_head.qweight is None and fp8.model.embed_tokens.weight.dtype == torch.bfloat16
    bf16, quantized = perplexity(base, ids), perplexity(fp8, ids)
    print(f"SmolLM2 perplexity over {len(ids)} tokens: bf16 {bf16:.3f}, fp8 {quantized:.3f} "
          f"({quantized / bf16 - 1:+.2%})")
    assert abs(quantized / bf16 - 1) < 0.01


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fp8 GEMV in Triton's interpreter: CPU tensors only")
@pytest.mark.parametrize("m, n, k, split", [(1, 40, 512, 1), (3, 70, 1024, 2), (16, 48, 256, 1)])
def test_the_fp8_gemv_is_the_matmul_of_the_weight_read_back(m, n, k, split):
    """The GEMV reading e4m3 bytes and scaling each column (in Triton's interpreter), against the
    dequantized weight's matmul in float64: a column edge inside the last tile, split-K, 16 rows;
    the rows' scales differ by orders of magnitude, so a scale on the wrong axis shows."""
    from nanolab.kernels.gemv import GemvConfig, gemv

    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None]
    q, scale = quantize_fp8(w)
    out = gemv(x, q, GemvConfig(16, 128, split), scale=scale)
    ref = x.double() @ dequantize_fp8(q, scale).double().T
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    with pytest.raises(ValueError, match="fp8 weight takes a contiguous fp32 scale"):
        gemv(x, q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fp8 GEMV in Triton's interpreter: CPU tensors only")
@pytest.mark.parametrize("dot, m, split", [("mma_f16", 1, 1), ("mma_f16", 3, 2), ("fma", 1, 1), ("fma", 1, 2)])
def test_the_fp8_gemvs_other_dots_compute_the_same_product(dot, m, split):
    """bf16 rows against an e4m3 weight through fp16 tensor cores (x taken as x / 256) and through
    one row's fp32 products, against the dequantized weight's matmul in float64, within the bf16
    output's rounding. Rows of 1e-3 to 1e5 (past fp16's range unless divided) and scales four orders
    apart: an overflow, a missing 256 or a scale on the wrong axis shows."""
    from nanolab.kernels.gemv import GemvConfig, gemv

    g = torch.Generator().manual_seed(7 * m + split)
    n, k = 40, 512
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 5, m * k).reshape(m, k)).bfloat16()
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, n)[:, None]
    q, scale = quantize_fp8(w)
    out = gemv(x, q, GemvConfig(16, 128, split), scale=scale, dot=dot)
    ref = x.double() @ dequantize_fp8(q, scale).double().T
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert float(((out.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-3)).max()) < 8e-3
    with pytest.raises(ValueError, match="dot="):
        gemv(x.float(), q, GemvConfig(16, 128, split), scale=scale, dot="mma_f16")
    with pytest.raises(ValueError, match="dot="):
        gemv(torch.randn(2, k).bfloat16(), q, GemvConfig(16, 128, split), scale=scale, dot="fma")


def scaled_mm_device() -> str:
    """Where the W8A8 matmul runs: a GPU with fp8 tensor cores (compute capability 8.9 or more), else
    the CPU."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) else "cpu"


def needs_rowwise_scaled_mm(device: str) -> None:
    """Skip where this torch's `_scaled_mm` takes one scale a tensor on `device` (torch 2.11's CPU
    backend, the H200 image's), not one a row and one a column; any other error fails the test."""
    a = torch.zeros(16, 16, device=device).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                         scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        if "per-tensor" not in str(e):
            raise
        pytest.skip(f"torch {torch.__version__}'s _scaled_mm on {device} takes no row-wise scales: {e}")


def test_the_w8a8_variants_matmul_is_the_matmul_of_the_weight_read_back_within_e4m3s_bound():
    """The lab's W8A8 variant of a prompt step (`lab.fp8bench.scaled_mm_linear`, on the GPU's fp8
    tensor cores where there is one, else the CPU's `torch._scaled_mm`): each activation row
    quantized with its own scale, both scales on the fp32 sum. Rows differ in scale by orders of
    magnitude and so do the weight's channels, so a row's scale dropped or one taken from the wrong
    row shows; every output stays within the bound e4m3's rounding of the activations allows (1/16
    of each product's size), plus bf16's rounding."""
    from nanolab.lab.fp8bench import scaled_mm_linear

    device = scaled_mm_device()
    needs_rowwise_scaled_mm(device)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(80, 64, generator=g) * torch.logspace(-2, 2, 80)[:, None]).to(torch.bfloat16)
    q, scale = quantize_fp8(torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48)[:, None])
    w = dequantize_fp8(q, scale, torch.float64)
    out = scaled_mm_linear(x.to(device), q.to(device), scale.to(device)).cpu()
    ref = x.double() @ w.T
    bound = (x.double().abs() @ w.abs().T) / 16 + ref.abs() * 2.0**-8
    assert out.shape == (80, 48) and out.dtype == torch.bfloat16
    assert bool(((out.double() - ref).abs() <= bound).all())
    xq, x_scale = quantize_fp8(x)  # the activations' rows, by the weights' rule
    assert xq.dtype == E4M3 and x_scale.shape == (80,)
    assert bool(((dequantize_fp8(xq, x_scale) - x.float()).abs() <= fp8_error_bound(x, x_scale)).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled fp8 GEMV needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 2])
def test_fp8_layers_on_cuda_decode_as_the_weight_read_back(tiny_path, batch):
    """On CUDA with graphs and the compiled decode step, the tiny model with fp8 layers: the
    compiled steps at batch 1 (SwiGLU's activation written by its own kernel) and 2 (the fp8 GEMV
    at every projection) give the greedy tokens, and their log-probabilities, of the same fp8 model
    run with every layer's weight read back (eager, F.linear)."""
    from nanolab.kernels import gemv as gemv_module

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):"][:batch]
    fast = LLM(str(tiny_path), device="cuda", dtype="bfloat16", quantization="fp8")
    got = fast.generate(prompts, params, use_tqdm=False)
    reference = LLM(str(tiny_path), device="cuda", dtype="bfloat16", quantization="fp8", enforce_eager=True,
                    compile=False)
    layer = reference.model.layers[0].self_attn.o_proj
    x = torch.randn(2, layer.qweight.shape[1], device="cuda", dtype=torch.bfloat16)
    direct = gemv_module.fp8_linear(x, layer.qweight, layer.scale)
    readback = F.linear(x, dequantize_fp8(layer.qweight, layer.scale, torch.bfloat16))
    assert torch.allclose(direct.float(), readback.float(), rtol=2e-2, atol=2e-2)
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):  # each token's log-probability: (chosen, top-k) a position
        fast_lp = torch.tensor([lp for lp, _ in g.outputs[0].logprobs])
        want_lp = torch.tensor([lp for lp, _ in w.outputs[0].logprobs])
        torch.testing.assert_close(fast_lp, want_lp, atol=5e-2, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the W8A16 prompt matmul needs a CUDA device")
def test_fp8_prompt_steps_on_cuda_score_as_the_weight_read_back(tiny_path, monkeypatch):
    """Prompts of 300 and 90 tokens in chunks of up to 128 (graphed prompt and mixed steps past the
    GEMV's 64 rows, through `kernels.w8a16`), every prompt token scored (`prompt_logprobs`): the
    scores and greedy tokens of the same fp8 model with every projection's weight read back
    (eager, `F.linear`), the scores within bf16's rounding of a logit."""
    from nanolab.model import layers

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 10 for i in range(n)]} for j, n in ((0, 300), (1, 90))]
    fast = LLM(str(tiny_path), device="cuda", dtype="bfloat16", quantization="fp8", max_num_batched_tokens=128)
    got = fast.generate(prompts, params, use_tqdm=False)
    fast.close()
    monkeypatch.setattr(layers, "fp8_linear", lambda x, q, s: F.linear(x, dequantize_fp8(q, s, x.dtype)))
    reference = LLM(str(tiny_path), device="cuda", dtype="bfloat16", quantization="fp8", enforce_eager=True,
                    compile=False, max_num_batched_tokens=128)
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        fast_lp = torch.tensor([lp for lp, _ in g.prompt_logprobs])
        want_lp = torch.tensor([lp for lp, _ in w.prompt_logprobs])
        assert len(fast_lp) == len(g.prompt_token_ids) - 1
        torch.testing.assert_close(fast_lp, want_lp, atol=5e-2, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp8 GEMV's compiled kernels need a CUDA device")
@pytest.mark.parametrize("m", [1, 8])
def test_every_dot_of_the_fp8_gemv_on_cuda_is_the_dequantized_matmul(m):
    """Each way the GEMV multiplies an fp8 tile, compiled for the GPU, at step_config's tiles for an
    fp8 weight of Llama-3.2-1B's down shape (four shares of K) and a gate/up shape (one), against the
    dequantized weight's matmul in float64."""
    from nanolab.kernels.gemv import gemv, step_config

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in ((2048, 8192), (16384, 2048)):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16() * 30
        w = torch.randn(n, k, device="cuda", generator=g) * torch.logspace(-2, 2, n, device="cuda")[:, None]
        q, scale = quantize_fp8(w)
        ref = x.double() @ dequantize_fp8(q, scale).double().T
        for dot in ("mma", "mma_f16") + (("fma",) if m == 1 else ()):
            out = gemv(x, q, step_config(n, k, m, element_size=1), scale=scale, dot=dot)
            err = float(((out.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-3)).max())
            assert err < 8e-3, (n, k, dot, err)


def test_fp8bench_times_a_prompt_in_both_arms_in_one_process():
    """`run_prompt_steps` on the tiny preset: a row per arm and length, each the median of its
    alternated calls within their fastest and slowest, fp8's ratio over bf16's; bad lengths and
    repeats refused by name."""
    from nanolab.lab.fp8bench import run_prompt_steps

    table = run_prompt_steps("tiny", "cpu", lengths=(16, 40), repeats=3, log=lambda _: None)
    assert list(zip(table.arm, table.prompt_len)) == [("bf16", 16), ("fp8", 16), ("bf16", 40), ("fp8", 40)]
    assert (table.ms_min <= table.ms).all() and (table.ms <= table.ms_max).all() and (table.ms_min > 0).all()
    for _, g in table.groupby("prompt_len"):
        by = g.set_index("arm")
        assert by.fp8_over_bf16.to_dict() == pytest.approx({"bf16": 1.0, "fp8": by.ms["fp8"] / by.ms["bf16"]})
    for kwargs, name in (({"lengths": (16, 0)}, "lengths\\[1\\]"), ({"repeats": 0}, "repeats"),
                         ({"lengths": ()}, "lengths")):
        with pytest.raises(ValueError, match=name):
            run_prompt_steps("tiny", "cpu", **{"lengths": (16,), **kwargs})


def test_fp8_quantizes_every_decoder_projection_and_nothing_else(tiny_path):
    """`quantization="fp8"`: every Linear of every decoder layer holds e4m3 weights with a scale per
    output channel; the embedding and the LM head stay in the model's dtype."""
    from nanolab.model.llama import load_model

    model = load_model(tiny_path, quantization="fp8")
    linears = [(i, name, m) for i, layer in enumerate(model.layers) for name, m in layer.named_modules()
               if isinstance(m, Linear)]
    assert len(linears) == 4 * len(model.layers) > 4
    for i, name, m in linears:
        assert m.qweight is not None and m.qweight.dtype == torch.float8_e4m3fn, f"layer {i}'s {name}"
        assert m.scale.shape == (m.qweight.shape[0],), f"layer {i}'s {name}"
    assert model.lm_head.qweight is None and model.embed_tokens.weight.dtype == torch.float32


def test_a_quantized_models_bytes_are_its_e4m3_weights_and_scales():
    """fp8bench's floor: a quantized Linear counts one byte a weight and four a scale, a tied
    weight once."""
    from nanolab.lab.fp8bench import agreed_prefix, stored_weight_bytes

    model = torch.nn.Sequential(Linear(32, 16), Linear(16, 8))
    model[0].weight.data, model[1].weight.data = torch.randn(16, 32), torch.randn(8, 16)
    assert stored_weight_bytes(model) == (16 * 32 + 8 * 16) * 4
    model[0].quantize_fp8_()
    assert stored_weight_bytes(model) == 16 * 32 + 16 * 4 + 8 * 16 * 4
    assert agreed_prefix([1, 2, 3], [1, 2, 4]) == 2 and agreed_prefix([1, 2], [1, 2, 3]) == 2


def test_the_w8a8_variant_changes_its_own_llms_prompt_steps_alone(tiny_path):
    """`lab.fp8bench.fp8_gemm_chunks_` sends one `LLM`'s prompt steps through the W8A8 matmul: its
    prompt logprobs move a little from the engine's own fp8 path, and another `LLM` of the same
    weights keeps the engine's path."""
    from nanolab.lab.fp8bench import fp8_gemm_chunks_

    needs_rowwise_scaled_mm("cpu")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ids = {"prompt_token_ids": [(7 * i) % 200 + 1 for i in range(96)]}  # 96 rows: past the GEMV's 64
    plain = LLM(str(tiny_path), device="cpu", quantization="fp8", enable_prefix_caching=False)
    variant = LLM(str(tiny_path), device="cpu", quantization="fp8", enable_prefix_caching=False)
    fp8_gemm_chunks_(variant)
    assert not any("forward" in vars(m) for m in plain.model.modules())
    (a,), (b,) = (llm.generate(ids, params, use_tqdm=False) for llm in (plain, variant))
    assert (a.error, b.error) == (None, None)
    a, b = torch.tensor([lp for lp, _ in a.prompt_logprobs]), torch.tensor([lp for lp, _ in b.prompt_logprobs])
    assert not torch.equal(a, b) and float((a - b).abs().max()) < 0.5
