"""How closely two engines decode alike: the first decode step's logits (`decode_logits`) and the
greedy tokens, and bf16 decode, eager and compiled, against fp32's (`fp32_agreement`). Day 61.

    python -m nanolab levers --only agreement --model llama-3.2-1b
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pandas as pd
import torch

from nanolab import Engine, EngineConfig, load_model
from nanolab.engine.block_manager import cdiv
from nanolab.lab.capturebench import rows_equal
from nanolab.lab.reference import engine_greedy
from nanolab.lab.timing import drain, prefill, random_prompts
from nanolab.model.config import ModelConfig
from nanolab.sampling import sample_tokens


class LogitsSampler:
    """The engine's sampler (`sample_tokens`), handed to `Engine(..., sampler=...)`, that gives the
    engine host tokens inside `synchronously()`: the engine then finishes each step before it
    returns, asynchronous scheduling or not, and hands back the step's logits with its tokens
    (`StepOutput.logits`). Outside, it is `sample_tokens` as it is."""

    def __init__(self) -> None:
        self.synchronous = False

    def __call__(self, logits: torch.Tensor, params, generators):
        tokens = sample_tokens(logits, params, generators)
        return tokens.tolist() if self.synchronous else tokens

    @contextlib.contextmanager
    def synchronously(self) -> Iterator[None]:
        self.synchronous = True
        try:
            yield
        finally:
            self.synchronous = False


def decode_logits(engine: Engine, prompts: list[list[int]], sampler: LogitsSampler | None = None) -> torch.Tensor:
    """[rows, vocab] fp32 logits of the first decode step after prefilling `prompts`. An engine with
    asynchronous scheduling returns no logits (the next replay overwrites a step's before its tokens
    are read): it must have been built with `sampler`, which hands it host tokens for these steps."""
    if engine.async_scheduling and sampler is None:
        raise ValueError("sampler: an engine with asynchronous scheduling needs the LogitsSampler it was built with")
    with sampler.synchronously() if sampler is not None else contextlib.nullcontext():
        seqs = prefill(engine, prompts, 2)
        logits = {o.seq.request_id: o.logits.clone() for o in engine.step()}
    drain(engine)
    return torch.stack([logits[s.request_id] for s in seqs])


def fp32_agreement(model_path, steps: int = 32, rows: int = 8, block_size: int = 16) -> pd.DataFrame:
    """How far bf16 decode is from fp32 decode, eagerly and compiled, each under CUDA graphs without
    asynchronous scheduling: the first decode step's logits of each against the fp32 eager engine's
    (relative error), and how many rows' `steps` greedy tokens equal fp32's. Random weights give
    near-flat logits, so greedy tokens part early even between two correct bf16 paths; the logits'
    error is the measure that tells them apart."""
    device = torch.device("cuda")
    prompts = random_prompts(rows, 64, ModelConfig.from_dir(model_path).vocab_size, seed=1).tolist()
    config = EngineConfig(num_blocks=rows * (cdiv(64 + steps, block_size) + 1) + 8, block_size=block_size,
                          max_num_seqs=rows, enable_chunked_prefill=False, async_scheduling=False)
    results, reference = [], None
    for dtype, compiled in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        model = load_model(model_path, dtype=dtype, device=device)
        engine = Engine(model, config.replace(compile=compiled), progress=False)
        tokens, logits = engine_greedy(engine, prompts, steps), decode_logits(engine, prompts)
        reference = reference or (tokens, logits)
        results.append({"arm": f"{str(dtype).removeprefix('torch.')} {'inductor' if compiled else 'eager'} graphs",
                        "rows": rows, "steps": steps, "rows equal to fp32": rows_equal(tokens, reference[0]),
                        "logits rel err to fp32": float((logits - reference[1]).norm() / reference[1].norm())})
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    return pd.DataFrame(results)
