"""The fp8 prompt step's matmul (`kernels.w8a16`): e4m3 bytes widened in registers, against the
dequantized weight's matmul in float64, in Triton's interpreter on the CPU and compiled on CUDA;
the tile rule; and the lab's prefill table (`lab.w8a16`)."""

from __future__ import annotations

import pytest
import torch

from nanolab.kernels.w8a16 import PROMPT_TILES, MMConfig, prompt_tile, w8a16_linear
from nanolab.lab.w8a16 import CONFIGS
from nanolab.model.quant import dequantize_fp8, quantize_fp8


def _case(m: int, n: int, k: int, seed: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    # Output channels' scales four orders apart: a scale applied on the wrong axis shows.
    w = torch.randn(n, k, generator=g, device=device) * torch.logspace(-2, 2, n, device=device)[:, None]
    q, scale = quantize_fp8(w)
    return x, q, scale, x.double() @ dequantize_fp8(q, scale).double().T


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-3)).max())


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU tensors only")
@pytest.mark.parametrize("m, n, k", [(70, 90, 200), (1, 64, 64), (129, 40, 128)])
def test_w8a16_is_the_matmul_of_the_weight_read_back(m, n, k):
    """Edges inside the last tile of every axis (rows, columns and K), groups of row blocks, one
    row: fp32 rows, to 1e-5 of the largest output."""
    x, q, scale, ref = _case(m, n, k, m + n + k)
    out = w8a16_linear(x, q, scale, MMConfig(32, 32, 64, group_m=2))
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    batched = w8a16_linear(x.view(1, m, k), q, scale, MMConfig(32, 32, 64, group_m=2))
    assert batched.shape == (1, m, n) and torch.equal(batched[0], out)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU tensors only")
@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_w8a16_split_along_k_adds_every_share_once(split_k):
    """K of 200 in tiles of 32 (7 tiles, the last partial) asked in 2, 3 and 5 shares of whole tiles
    (2, 3 and 4 shares of 4, 3 and 2 tiles once rounded): the sum over all of K, fp32 rows to 1e-5,
    bf16 rows through the "f16" dot within bf16's rounding."""
    x, q, scale, ref = _case(70, 90, 200, split_k)
    out = w8a16_linear(x, q, scale, MMConfig(32, 32, 32, group_m=2, split_k=split_k))
    assert out.shape == (70, 90) and out.dtype == torch.float32
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    xb = x.bfloat16()
    refb = xb.double() @ dequantize_fp8(q, scale).double().T
    outb = w8a16_linear(xb, q, scale, MMConfig(32, 32, 32, group_m=2, split_k=split_k), dot="f16")
    assert outb.dtype == torch.bfloat16 and _rel(outb, refb) < 8e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU tensors only")
def test_w8a16_through_fp16_tensor_cores_keeps_bf16_rows_in_range():
    """bf16 rows of 1e-3 to 1e5 (past fp16's range unless divided by 256) through the "f16" dot,
    within the bf16 output's rounding."""
    x, q, scale, _ = _case(40, 48, 128, 3)
    x = (x * torch.logspace(-3, 5, x.numel()).reshape(x.shape)).bfloat16()
    ref = x.double() @ dequantize_fp8(q, scale).double().T
    out = w8a16_linear(x, q, scale, MMConfig(32, 32, 64), dot="f16")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and _rel(out, ref) < 8e-3


def test_the_prompt_tile_is_the_largest_that_gives_every_sm_a_program():
    """At 132 SMs, Llama-3.2-1B's projections get the tile that was fastest on the H100 in seven
    cases of eight and 4.1% behind it in the eighth (o at 512 rows; data/day65d_fp8_prefill_*):
    128 x 128 only for gate_up at 512 rows, 64 x 128 where that still fills the device, 64 x 64 x
    128 where nothing larger does."""
    big, mid, small = PROMPT_TILES
    assert (big.block_m, big.block_n, mid.block_m, mid.block_n, small.block_n) == (128, 128, 64, 128, 64)
    assert prompt_tile(512, 16384, 132) == big  # gate_up: 4 x 128 programs
    assert prompt_tile(128, 16384, 132) == mid  # 1 x 128 of the big tile is under 132
    assert prompt_tile(512, 3072, 132) == mid  # qkv: 8 x 24
    for m, n in ((128, 3072), (128, 2048), (512, 2048)):  # qkv at 128, o and down at 128 and 512
        assert prompt_tile(m, n, 132) == small
    assert prompt_tile(1, 8, 132) == small and prompt_tile(10**6, 8, 1) == big


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter: CPU tensors only")
def test_the_default_tile_and_dot_compute_the_same_function():
    """No tile or dot given: fp32 rows through "x" at the CPU's default tile, and bf16 rows through
    "f16", each equal to the same call with those named."""
    x, q, scale, ref = _case(130, 136, 192, 9)
    out = w8a16_linear(x, q, scale)
    assert torch.equal(out, w8a16_linear(x, q, scale, PROMPT_TILES[0], dot="x"))
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    xb = x.bfloat16()
    assert torch.equal(w8a16_linear(xb, q, scale), w8a16_linear(xb, q, scale, PROMPT_TILES[0], dot="f16"))


def test_bad_inputs_are_refused_by_name():
    x, q, scale, _ = _case(4, 8, 16, 0)
    with pytest.raises(ValueError, match="qweight"):
        w8a16_linear(x, q.float(), scale)
    with pytest.raises(ValueError, match="scale"):
        w8a16_linear(x, q, scale[:4])
    with pytest.raises(ValueError, match="features"):
        w8a16_linear(x[:, :8], q, scale)
    with pytest.raises(ValueError, match="dot="):
        w8a16_linear(x, q, scale, dot="f16")  # fp32 rows
    with pytest.raises(ValueError, match="split_k"):
        w8a16_linear(x, q, scale, MMConfig(split_k=0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA device")
@pytest.mark.parametrize("dot", ["x", "f16"])
def test_w8a16_on_cuda_at_a_prompt_steps_shapes(dot):
    """Every tile of the prefill sweep, 128 and 300 rows of bf16 at Llama-3.2-1B's o and down shapes."""
    for m, (n, k) in ((128, (2048, 2048)), (300, (2048, 8192))):
        x, q, scale, _ = _case(m, n, k, m, "cuda")
        x = x.bfloat16() * 30
        ref = x.double() @ dequantize_fp8(q, scale).double().T
        for config in CONFIGS:
            assert _rel(w8a16_linear(x, q, scale, config, dot=dot), ref) < 8e-3, (m, n, k, config, dot)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA device")
def test_fp8_linear_takes_a_prompts_rows_through_w8a16_on_cuda(monkeypatch):
    """The engine's op past the GEMV's rows: the W8A16 matmul, called with no tile or dot (so
    `prompt_tile`'s tile and the "f16" dot), as close to the weight read back as the kernel is;
    64 rows stay the GEMV's."""
    from nanolab.kernels import gemv

    calls = []
    monkeypatch.setattr(gemv, "w8a16_linear", lambda *a, **kw: calls.append((a[0].shape, len(a), kw))
                        or w8a16_linear(*a, **kw))
    for m in (65, 200):
        x, q, scale, _ = _case(m, 2048, 2048, m, "cuda")
        x = x.bfloat16()
        ref = x.double() @ dequantize_fp8(q, scale).double().T
        assert _rel(gemv.fp8_linear(x.view(1, m, -1), q, scale)[0], ref) < 8e-3
    gemv.fp8_linear(x[:64], q, scale)
    assert calls == [((1, 65, 2048), 3, {}), ((1, 200, 2048), 3, {})]


def test_a_layers_prefill_sums_each_projections_fastest_tile():
    import pandas as pd

    from nanolab.lab.w8a16 import layer_prefill

    rows = []
    for proj, base in (("qkv", 10.0), ("down", 30.0)):
        rows += [{"projection": proj, "tokens": 128, "arm": "bf16 F.linear", "us": base},
                 {"projection": proj, "tokens": 128, "arm": "fp8 widened, F.linear, scaled (engine)", "us": 3 * base},
                 {"projection": proj, "tokens": 128, "arm": "fp8 w8a16 a dot x", "us": base * 0.9},
                 {"projection": proj, "tokens": 128, "arm": "fp8 w8a16 b dot f16", "us": base * 0.6},
                 {"projection": proj, "tokens": 128, "arm": "fp8 w8a16 c dot x", "us": float("nan")}]
    layer = layer_prefill(pd.DataFrame(rows)).set_index("tokens").loc[128]
    assert layer["bf16 F.linear"] == 40.0 and layer["fp8 widened, F.linear, scaled (engine)"] == 120.0
    assert layer["fp8 w8a16 (each projection's best tile)"] == 24.0  # 6 + 18: the fastest of each
