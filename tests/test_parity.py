"""Parity with HF transformers' `LlamaForCausalLM` on the same weights: a reference nobody here
wrote. Logits within fp32 tolerance, and identical greedy tokens for 64 new tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_cache, needs_smollm2, prefill_logits

from nanolab import load_model
from nanolab.lab.reference import hf_greedy, load_hf, nanolab_greedy
from nanolab.model.tokenizer import Tokenizer

PARAGRAPH = (
    "The history of the printing press is a story of small improvements that added up. Movable type "
    "existed for centuries before it changed how ideas travelled, because paper was scarce, ink smeared "
    "and the presses themselves were slow. Each of those problems was solved by a different person in a "
    "different town, and only together did they make books cheap. "
)


def long_prompt(tokenizer: Tokenizer, min_tokens: int = 1024) -> list[int]:
    ids: list[int] = []
    while len(ids) < min_tokens:
        ids += tokenizer.encode(PARAGRAPH)
    return ids


def nanolab_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, vocab] logits of one prefill over a fresh cache."""
    c, weight = model.config, model.embed_tokens.weight
    cache = make_cache(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       num_blocks=len(ids) // 16 + 2, block_size=16, max_rows=1, dtype=weight.dtype,
                       device=weight.device)
    return prefill_logits(model, cache, [cache.blocks.open_row()], [ids])[0]


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 tolerance scaled to the logits' range; the worst position is what is checked.
    torch.testing.assert_close(ours, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)


def test_tiny_logits_match_hf(tiny_path, tiny_model):
    hf = load_hf(tiny_path)
    for length in (1, 37, 1100):
        ids = torch.randint(3, tiny_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            ref = hf(ids[None]).logits[0]
        assert_logits_close(nanolab_logits(tiny_model, ids.tolist()), ref)


def test_tiny_greedy_matches_hf(tiny_path, tiny_model):
    hf = load_hf(tiny_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 23, 1030)]
    ours = nanolab_greedy(tiny_model, prompts, 64)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, 64)


@needs_smollm2
def test_smollm2_logits_match_hf(smollm2_path, smollm2_model):
    tok = Tokenizer.from_dir(smollm2_path)
    hf = load_hf(smollm2_path)
    for ids in (tok.encode("The capital of France is"), long_prompt(tok)):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0]
        assert_logits_close(nanolab_logits(smollm2_model, ids), ref)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_path, smollm2_model):
    tok = Tokenizer.from_dir(smollm2_path)
    hf = load_hf(smollm2_path)
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}]),
        long_prompt(tok),
    ]
    assert len(prompts[2]) > 1000
    ours = nanolab_greedy(smollm2_model, prompts, 32)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, 32)


def test_prepacked_matmuls_match_plain(tiny_path):
    """The CPU's oneDNN path (`layers.Linear.prepack`) computes what `F.linear` computes."""
    plain = load_model(tiny_path, prepack=False)
    packed = load_model(tiny_path, prepack=True)
    assert packed.lm_head.packed is not None and plain.lm_head.packed is None
    ids = list(range(3, 200))
    assert_logits_close(nanolab_logits(packed, ids), nanolab_logits(plain, ids))
    prompts = [[5] * 7, list(range(10, 40))]
    assert nanolab_greedy(packed, prompts, 32) == nanolab_greedy(plain, prompts, 32)
