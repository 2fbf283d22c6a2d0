"""Decode speed, nanolab against HF transformers on the same weights, in one run.

Engine core (before Day 49). Both arms decode greedily from the same random prompts: nanolab's
`Engine.step` one decode step at a time (`lab.timing.time_engine`), HF's `generate` from outside
(`lab.timing.time_hf`). The medians of `repeats` runs are reported, with nanolab's tokens/s as a
ratio to each HF arm's; nothing here asserts a time.

    python -m nanolab bench --model smollm2-135m --batches 1,8
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict

import pandas as pd

from nanolab import LLM, EngineConfig
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.reference import load_hf
from nanolab.lab.timing import DecodeTiming, random_prompts, time_engine, time_hf


def decode_table(llm: LLM, batches: list[int], prompt_len: int, steps: int, hf_caches=("static", "dynamic"),
                 repeats: int = 3, progress: bool = True) -> pd.DataFrame:
    """One row per (engine, batch): ms/step, tokens/s and the ratio of nanolab's tokens/s to each
    HF arm's. HF is loaded once, beside nanolab, from the same folder and in the same dtype."""
    from nanolab.progress import progress_bar

    hf = load_hf(llm.path, llm.dtype, llm.device)
    timings: list[DecodeTiming] = []
    jobs = [(b, arm) for b in batches for arm in ("nanolab", *hf_caches)]
    for batch, arm in progress_bar(jobs, desc="decode bench", enabled=progress):
        prompts = random_prompts(batch, prompt_len, llm.config.vocab_size)
        if arm == "nanolab":
            timings.append(time_engine(llm.engine, prompts, steps, repeats))
        else:
            timings.append(time_hf(hf, prompts, steps, arm, repeats))
    del hf
    gc.collect()
    df = pd.DataFrame([{**asdict(t), "tokens_per_s": t.tokens_per_s} for t in timings])
    ours = df[df.engine == "nanolab"].set_index("batch").tokens_per_s
    df["nanolab_speedup"] = df.apply(lambda r: ours[r.batch] / r.tokens_per_s, axis=1)
    return df


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The engine's flags, as every command has them; every row of a timed batch starts decoding in the
    # same step (`timing.prefill`), so whole prompts.
    EngineConfig.add_cli_args(parser, enable_chunked_prefill=False)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)


def main(args: argparse.Namespace) -> int:
    from nanolab.lab.report import run_label, save_table

    batches = int_list(args.batches, "--batches")
    for flag in ("prompt_len", "steps", "repeats"):
        positive_int(getattr(args, flag), "--" + flag.replace("_", "-"))
    config = EngineConfig.from_cli_args(args)
    llm = LLM.from_config(config.replace(max_num_seqs=max(config.max_num_seqs, *batches)))
    if args.prompt_len + args.steps + 1 > llm.engine.max_model_len:  # a timed run asks for steps + 1 tokens
        raise ValueError(f"--prompt-len {args.prompt_len} and --steps {args.steps} make rows of "
                         f"{args.prompt_len + args.steps + 1} tokens; the context holds {llm.engine.max_model_len}")
    df = decode_table(llm, batches, args.prompt_len, args.steps, repeats=args.repeats)
    label = run_label(llm.device, args.model, llm.dtype, weights=llm.weights_kind)
    path = save_table(df, "decode_bench", label)
    print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    for arm in df.engine.unique():
        if arm != "nanolab":
            ratios = df[df.engine == arm].set_index("batch").nanolab_speedup
            print(f"nanolab / {arm} tokens/s: " + ", ".join(f"batch {b}: {r:.2f}x" for b, r in ratios.items()))
    print(f"{label.caption()}\nwrote {path}")
    return 0
