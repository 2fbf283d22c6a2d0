"""The one timing loop every bench shares, and the clocks around it.

`prefill` queues greedy requests and runs the engine until each has its first token; `timed_steps`
then times decode steps one at a time, each bracketed by a device sync. HF's `generate` is timed
from outside (`time_hf`), one read alone as a CUDA graph replay (`time_us`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab import Engine, SamplingParams
from nanolab.engine.graphs import capture_graph
from nanolab.engine.sequence import Sequence


def sync(device: torch.device) -> None:
    """Wait for the device, so a host timer brackets the work it launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[batch, prompt_len] int64 token ids, drawn away from the special ids at the bottom."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (batch, prompt_len), generator=g)


def prefill(engine: Engine, prompts, new_tokens: int, max_steps: int = 100_000) -> list[Sequence]:
    """Queue `prompts` (lists or a [batch, len] tensor) as greedy requests of `new_tokens` tokens that
    ignore EOS, and step `engine` until every one holds its first token. Every request then holds
    exactly one only when the engine prefills whole prompts (`enable_chunked_prefill=False`), or all
    of them fit one step's budget: with chunks, the first admitted decode while later ones prefill."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(list(map(int, p)), params) for p in prompts]
    for _ in range(max_steps):
        if all(s.output_token_ids for s in seqs):
            return seqs
        engine.step()
    raise RuntimeError(f"the prompts were not all prefilled within {max_steps} steps")


def timed_steps(engine: Engine, steps: int, after: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of `steps` engine steps, each between two device syncs; `after` runs after
    each step, outside the clock."""
    times = []
    for _ in range(steps):
        sync(engine.device)
        start = time.perf_counter()
        engine.step()
        sync(engine.device)
        times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return times


def drain(engine: Engine, max_steps: int = 100_000) -> int:
    """Step `engine` until no request is left; the steps it took. Raises past `max_steps` (a livelock)."""
    for n in range(max_steps):
        if not engine.has_unfinished_requests():
            return n
        engine.step()
    raise RuntimeError(f"the engine still had requests after {max_steps} steps")


@dataclass(frozen=True)
class DecodeTiming:
    engine: str  # the arm: "nanolab", "hf-static", ...
    batch: int
    prompt_len: int
    steps: int
    ms_per_step: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch / self.ms_per_step


def time_engine(engine: Engine, prompts: torch.Tensor, steps: int, repeats: int = 3, arm: str = "nanolab"
                ) -> DecodeTiming:
    """Median over `repeats` runs (after one warm-up) of the mean ms per decode step at batch
    len(prompts): prefill, then `steps` timed steps that finish every request. Each step is timed
    between its own syncs; a step already ends in one (its sampled tokens come back to the host)."""
    runs = []
    for _ in range(repeats + 1):
        seqs = prefill(engine, prompts, steps + 1)
        runs.append(1000 * sum(timed_steps(engine, steps)) / steps)
        assert all(s.finished for s in seqs), "a benchmark request outlived its steps"
    return DecodeTiming(arm, len(prompts), prompts.shape[1], steps, statistics.median(runs[1:]))


def time_hf(model, prompts: torch.Tensor, steps: int, cache: str, repeats: int = 3) -> DecodeTiming:
    """Median ms per decode step of transformers' `generate` with a "static" or "dynamic" cache and
    `disable_compile=True`: the time of `1 + steps` new tokens minus the time of 1, so the prefill
    is left out (the fastest of each instead of the medians when a busy machine makes those cross)."""
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
    # A busy machine can make the medians cross. Then more pairs are timed and the fastest of each
    # side used: the runs the machine disturbed least.
    for _ in range(3 * repeats):
        if decode_s > 0:
            break
        pairs.append((run(steps + 1), run(1)))
        decode_s = min(full for full, _ in pairs) - min(prefill for _, prefill in pairs)
    if decode_s <= 0:
        raise RuntimeError(f"HF decode time not measurable: generate(max_new_tokens={steps + 1}) was not slower than "
                           "generate(max_new_tokens=1); the machine is too busy for this benchmark")
    return DecodeTiming(f"hf-{cache}", len(prompts), prompts.shape[1], steps, decode_s * 1000 / steps)


def time_us(fn, device: torch.device, repeats: int, flush_bytes: int = 512 << 20) -> float:
    """Median microseconds of `fn` over `repeats` launches, each after a write that evicts the L2.

    On CUDA, `fn` is captured once into a CUDA graph and replayed, as the engine replays its decode
    step: the time is the GPU's, with no Python launch cost in it. The flush runs just before each
    replay and takes longer than the replay takes to issue, so the start event is never waiting on
    the host."""
    fn()  # compile and warm
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    scratch = torch.empty(flush_bytes, dtype=torch.uint8, device=device)
    graph, _ = capture_graph(fn)
    times = []
    for _ in range(repeats):
        scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    del graph
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), the median of `repeats`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * nbytes / statistics.median(times)
