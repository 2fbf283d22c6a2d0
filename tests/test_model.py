"""The model's parts against transformers where it has one, and the variants the presets do not
exercise on the CPU: llama3 rope scaling, untied embeddings, half-precision dtypes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_parity import assert_logits_close, nanolab_logits
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from nanolab import PRESETS, load_model
from nanolab.lab.reference import hf_greedy, load_hf, nanolab_greedy
from nanolab.model.layers import rope_inv_freq
from nanolab.model.weights import synthesize_weights


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3.1-8b", "smollm2-135m"])
def test_rope_inv_freq_matches_transformers(preset):
    config = PRESETS[preset]
    rotary = LlamaRotaryEmbedding(LlamaConfig(**config.to_hf()))
    assert rotary.attention_scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(config), rotary.inv_freq, rtol=0, atol=0)


@pytest.fixture(scope="module")
def untied_llama3(tmp_path_factory):
    """tiny's shapes with an untied head and llama3 rope scaling, in the HF layout."""
    config = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=False,
                                 rope_scaling=PRESETS["llama-3.2-1b"].rope_scaling, rope_theta=500000.0)
    return synthesize_weights(config, tmp_path_factory.mktemp("untied"), dtype=torch.float32, progress=False)


def test_untied_llama3_matches_hf(untied_llama3):
    model = load_model(untied_llama3)
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    hf = load_hf(untied_llama3)
    ids = torch.randint(3, 512, (1500,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
    assert_logits_close(nanolab_logits(model, ids.tolist()), ref)
    prompt = ids[:40].tolist()
    assert nanolab_greedy(model, [prompt], 32)[0] == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(tiny_path, dtype):
    ids = list(range(3, 120))
    full = nanolab_logits(load_model(tiny_path), ids)
    half = nanolab_logits(load_model(tiny_path, dtype=dtype), ids)
    assert half.dtype == torch.float32  # logits come back in fp32 whatever the weights are
    assert (half - full).abs().max() < 0.05 * full.abs().max()
    assert nanolab_greedy(load_model(tiny_path, dtype=dtype), [ids[:9]], 8)[0]  # decodes end to end
