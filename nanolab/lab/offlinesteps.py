"""The serving bench's offline step: the same model loaded in-process, decode steps timed at the
batch a rate ran at, so the chapter can say what the server adds to a step. Day 58.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Sequence

import pandas as pd
import torch

from nanolab import LLM
from nanolab.lab.serveprocess import split_arm
from nanolab.lab.timing import drain, prefill, random_prompts, timed_steps


def time_offline(model: str, device: str, arm: str, batches: Sequence[int], context: int, *, dtype: str = "auto",
                 read: str = "auto", max_num_seqs: int = 64, steps: int = 32, repeats: int = 3,
                 vocab_size: int | None = None, kv_cache_bytes: int | None = None) -> pd.DataFrame:
    """Decode steps of `LLM(model)` in-process (graphs as in `arm`) at each batch in `batches`,
    the history at the middle timed step `context` tokens long: `repeats` runs of `steps` steps
    after one warm-up run, each step between its own syncs (`timing.timed_steps`). `ms_p50` is the
    median step, the number ITL p50 is held against; `ms_mean` the mean. `kv_cache_bytes` None
    sizes the pool as the server does (`EngineConfig`'s default)."""
    # Whole prompts: every row of a timed batch starts decoding in the same step (`timing.prefill`).
    mode = split_arm(arm)[0]
    llm = LLM(model, device=device, dtype=dtype, enforce_eager=mode == "eager", read=read,
              cudagraph_mode="full" if mode == "fullgraphs" else "full_decode_only",
              max_num_seqs=max(max_num_seqs, *batches), enable_chunked_prefill=False, kv_cache_bytes=kv_cache_bytes)
    vocab = vocab_size or llm.config.vocab_size
    prompt_len = max(1, context - steps // 2)
    records = []
    for batch in sorted(set(int(b) for b in batches)):
        prompts = random_prompts(batch, prompt_len, vocab)
        times = []
        for run in range(repeats + 1):
            seqs = prefill(llm.engine, prompts, steps + 2)
            timed = timed_steps(llm.engine, steps)
            drain(llm.engine)  # with asynchronous scheduling the last step is still in flight
            assert all(s.finished for s in seqs), "a timed request outlived its steps"
            times += timed if run else []  # the first run warms up
        records.append({"arm": arm, "batch": batch, "context": context, "steps": steps * repeats,
                        "ms_p50": 1000 * statistics.median(times), "ms_mean": 1000 * statistics.fmean(times)})
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return pd.DataFrame(records)
