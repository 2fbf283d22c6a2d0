"""HF transformers as the reference arm, and nanolab's greedy decode beside it, so tests and
chapters compare the two through one pair of functions."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from nanolab import Engine, EngineConfig, LlamaModel
from nanolab.lab.timing import drain, prefill


def load_hf(path: Path, dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "eager"):
    """transformers' model for a nanolab weights folder, never stopping on EOS by itself (greedy
    comparisons decode exactly the tokens asked for). Eager attention by default, the plainest
    reference for parity; timings may ask for "sdpa", transformers' own default."""
    with warnings.catch_warnings():
        # transformers imports tqdm.auto, which warns in a notebook without ipywidgets; the bar it
        # would draw while loading is switched off below, so nothing is lost.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = None
    return model.to(device).eval()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def engine_greedy(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`new_tokens` greedy tokens for each prompt, decoded together by `engine`."""
    seqs = prefill(engine, prompts, new_tokens)
    drain(engine)
    return [s.output_token_ids for s in seqs]


def nanolab_greedy(model: LlamaModel, prompts: list[list[int]], new_tokens: int, **config) -> list[list[int]]:
    """nanolab's greedy continuations of all prompts, decoded together in a new engine of `config`'s
    fields (`EngineConfig`; eager unless told)."""
    config.setdefault("enforce_eager", True)
    config.setdefault("num_blocks", sum(len(p) + new_tokens for p in prompts) // 16 + len(prompts) + 1)
    return engine_greedy(Engine(model, EngineConfig(**config)), prompts, new_tokens)
