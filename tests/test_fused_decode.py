"""The fused decode step (`runner.FusedDecode`, `kernels.projections`): RMSNorm, RoPE, the K/V
write, SwiGLU and the residual adds folded into the projections. Every step's logits equal the
one-shot reference's on a model whose output depends on what it reads; larger batches and other
steps go to the fallback; the two-pass argmax agrees with torch's."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_logits_match_reference, logit_recorder, needs_cuda, run_until_done
from test_cache_properties import check_drained
from test_compile_decode import Counting

from nanolab import Engine, EngineConfig, SamplingParams, load_model
from nanolab.kernels import INTERPRETED
from nanolab.kernels.argmax import argmax
from nanolab.kernels.pdl import supports_pdl
from nanolab.lab.projections import MAX_ROWS, FusedDecode, Tiles, gemv_add

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
DEVICE = "cpu" if INTERPRETED else "cuda"  # Triton runs CPU tensors only in its interpreter


def run(sharp, *, max_rows=MAX_ROWS, cuda_graphs=False, pdl=None, max_tokens=7):
    model = load_model(sharp.path, dtype=torch.float32, device=DEVICE, prepack=False)
    fallback = Counting(model)  # counts the steps FusedDecode hands on
    forward = FusedDecode(model, fallback, max_rows=max_rows, pdl=pdl)
    config = EngineConfig(num_blocks=64, block_size=4, read="streamed", enforce_eager=not cuda_graphs,
                          async_scheduling=False)  # each step's logits come back with its tokens
    engine = Engine(model, config, forward=forward, progress=False)
    fallback.calls = 0  # capturing the buckets past max_rows called it
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    seqs = engine.add_requests(PROMPTS, [params] * len(PROMPTS))
    logits, on_step = logit_recorder()
    run_until_done(engine, on_step=on_step)
    return engine, seqs, {i: [row.cpu() for row in rows] for i, rows in logits.items()}, fallback


@pytest.mark.parametrize("sharp_model", ["mha64", "gqa32", "gqa24"], indirect=True)
def test_fused_decode_matches_the_reference(sharp_model):
    engine, seqs, logits, fallback = run(sharp_model)
    assert fallback.calls == 0, "a decode step of 3 rows left the fused path"
    assert_logits_match_reference(sharp_model, seqs, logits)
    check_drained(engine.kv_cache, engine.scheduler)


def test_more_rows_than_the_fused_path_takes_go_to_the_fallback(sharp_gqa24):
    _, seqs, logits, fallback = run(sharp_gqa24, max_rows=2, max_tokens=4)
    assert fallback.calls >= 1, "a 3-row step should have gone to the fallback"
    assert_logits_match_reference(sharp_gqa24, seqs, logits)


@needs_cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_decode_in_cuda_graphs(sharp_gqa24, pdl):
    if pdl and not supports_pdl("cuda"):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    engine, seqs, logits, fallback = run(sharp_gqa24, cuda_graphs=True, pdl=pdl)
    assert engine.runner.last_decode[1], "the decode steps did not replay a graph"
    assert fallback.calls == 0
    assert_logits_match_reference(sharp_gqa24, seqs, logits)


def test_fused_decode_refuses_a_row_bound_it_cannot_take(sharp_gqa24):
    model = load_model(sharp_gqa24.path, dtype=torch.float32, prepack=False)
    with pytest.raises(ValueError, match="max_rows"):
        FusedDecode(model, max_rows=MAX_ROWS + 1)


@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_add_adds_in_place_past_a_ragged_edge(split_k):
    """N not a multiple of the tile, K not of the shares, rows below the tile: the masked edges,
    and h updated in place (split shares added atomically)."""
    torch.manual_seed(0)
    a, w = torch.randn(3, 40, device=DEVICE), torch.randn(24, 40, device=DEVICE)
    h = torch.randn(3, 24, device=DEVICE)
    expected = h + a @ w.T
    out = gemv_add(a, w, h, tiles=Tiles(16, block_k=16, split_k=split_k))
    assert out.data_ptr() == h.data_ptr()
    torch.testing.assert_close(h, expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="fp32 h"):
        gemv_add(a.half(), w.half(), h.half(), tiles=Tiles(16, split_k=2))
    with pytest.raises(ValueError, match="rows"):
        gemv_add(torch.randn(MAX_ROWS + 1, 40, device=DEVICE), w, torch.zeros(MAX_ROWS + 1, 24, device=DEVICE))


@pytest.mark.parametrize("rows, vocab", [(1, 17), (3, 4096), (2, 9000)])
def test_argmax_takes_the_first_of_tied_maxima(rows, vocab):
    torch.manual_seed(0)
    x = torch.randn(rows, vocab, device=DEVICE)
    x[0, vocab // 2] = x[0, -1] = 50.0  # a tie across chunks: the lower index wins
    x[-1, 3] = x[-1, 5] = 60.0  # a tie inside a chunk
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    below = -1 - torch.rand(rows, vocab, device=DEVICE)  # every logit negative: padding must lose to all of them
    assert torch.equal(argmax(below), below.argmax(dim=-1))
