"""Decode speed, nanolab against HF transformers on the same weights, in one run.

Introduced with the engine core (before Day 49). Both arms decode greedily from the same random
prompts and are timed the same way the work is done: nanolab's `Engine.step` one decode step at
a time (each step ends in a host sync, since the sampled tokens come back to the scheduler), and
HF's `generate` as the difference between `max_new_tokens=1 + steps` and `max_new_tokens=1`,
which leaves out the prefill and keeps everything else `generate` does per token. The medians
of `repeats` runs are reported. Targets are printed as ratios; nothing here asserts a time.

    python -m nanolab bench --model smollm2-135m --batches 1,8
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from nanolab.engine import Engine
from nanolab.llm import LLM
from nanolab.reference import load_hf
from nanolab.sampling import SamplingParams


@dataclass(frozen=True)
class DecodeTiming:
    engine: str  # "nanolab", "hf-static" or "hf-dynamic"
    batch: int
    prompt_len: int
    steps: int
    ms_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch / self.ms_per_step


def sync(device: torch.device) -> None:
    """Wait for the device, so a host timer brackets the work it launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[batch, prompt_len] int64 token ids, drawn away from the special ids at the bottom."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (batch, prompt_len), generator=g)


def time_nanolab(engine: Engine, prompts: torch.Tensor, steps: int, repeats: int = 3,
                 arm: str = "nanolab") -> DecodeTiming:
    """Median ms per decode step of `engine` over `steps` steps at batch len(prompts)."""
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    runs = []
    for _ in range(repeats + 1):  # the first run warms up allocators and kernels
        seqs = [engine.add_request(p.tolist(), params) for p in prompts]
        while any(len(s.output_token_ids) == 0 for s in seqs):
            engine.step()
        sync(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        runs.append((time.perf_counter() - start) * 1000 / steps)
        assert all(s.finished for s in seqs), "a benchmark request outlived its steps"
    return DecodeTiming(arm, len(prompts), prompts.shape[1], steps, statistics.median(runs[1:]))


def time_hf(model, prompts: torch.Tensor, steps: int, cache: str, repeats: int = 3) -> DecodeTiming:
    """Median ms per decode step of transformers' `generate` with a "static" or "dynamic" cache."""
    device = model.device
    ids = prompts.to(device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, disable_compile=True)
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def run(new: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=new, **kwargs)
        sync(device)
        return time.perf_counter() - start

    run(steps + 1)  # warm-up
    # Interleaved, so a slow patch of the machine lands on both sides of the difference.
    pairs = [(run(steps + 1), run(1)) for _ in range(repeats)]
    decode_s = statistics.median(full for full, _ in pairs) - statistics.median(prefill for _, prefill in pairs)
    if decode_s <= 0:
        raise RuntimeError(f"HF decode time not measurable: generate(max_new_tokens={steps + 1}) was not slower than "
                           "generate(max_new_tokens=1); the machine is too busy for this benchmark")
    return DecodeTiming(f"hf-{cache}", len(prompts), prompts.shape[1], steps, decode_s * 1000 / steps)


def decode_table(llm: LLM, batches: list[int], prompt_len: int, steps: int, hf_caches=("static", "dynamic"),
                 repeats: int = 3, progress: bool = True) -> pd.DataFrame:
    """One row per (engine, batch): ms/step, tokens/s and the ratio of nanolab's tokens/s to each
    HF arm's. HF is loaded once, beside nanolab, from the same folder and in the same dtype."""
    from tqdm.auto import tqdm

    hf = load_hf(llm.path, llm.dtype, llm.device)
    timings: list[DecodeTiming] = []
    jobs = [(b, arm) for b in batches for arm in ("nanolab", *hf_caches)]
    for batch, arm in tqdm(jobs, desc="decode bench", disable=not progress):
        prompts = random_prompts(batch, prompt_len, llm.config.vocab_size)
        if arm == "nanolab":
            timings.append(time_nanolab(llm.engine, prompts, steps, repeats))
        else:
            timings.append(time_hf(hf, prompts, steps, arm, repeats))
    del hf
    gc.collect()
    df = pd.DataFrame([{**asdict(t), "tokens_per_s": t.tokens_per_s} for t in timings])
    ours = df[df.engine == "nanolab"].set_index("batch").tokens_per_s
    df["nanolab_speedup"] = df.apply(lambda r: ours[r.batch] / r.tokens_per_s, axis=1)
    return df


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")


def main(args: argparse.Namespace) -> int:
    from nanolab.report import run_label, save_table

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(64, *batches),
              enforce_eager=args.enforce_eager)
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
