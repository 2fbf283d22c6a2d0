"""The one timing loop every bench shares, and the clocks around it.

`prefill` queues greedy requests and runs the engine until each has its first token; `timed_steps`
then times decode steps one at a time, each bracketed by a device sync. A whole generate call is
timed from outside (`time_generate`: any system's, HF's through `time_hf`), one read alone as a
CUDA graph replay (`time_us`).
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
    each step, outside the clock. An engine with asynchronous scheduling is not synced between
    steps (a sync would drain the step it keeps in flight): one untimed step fills the pipeline,
    and each step's time is the interval between two returns, which in steady state is the longer
    of the GPU's step and the host's. Such an engine still has a step in flight afterwards
    (`drain` it): its requests need one more token than the steps timed."""
    times = []
    overlapped = getattr(engine, "async_scheduling", False)
    if overlapped:
        engine.step()
    sync(engine.device)
    last = time.perf_counter()
    for _ in range(steps):
        if not overlapped:
            sync(engine.device)
            last = time.perf_counter()
        engine.step()
        if not overlapped:
            sync(engine.device)
        now = time.perf_counter()
        times.append(now - last)
        if after is not None:
            after()
        last = time.perf_counter()
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
    """Median over `repeats` runs (after one warm-up) of ms per decode step at batch len(prompts):
    prefill, then the wall time of stepping the engine until every request holds its `steps` more
    tokens, over `steps`. The loop is the one `LLM.generate` runs, so host work between steps is
    in the time, and an engine that launches a step before reading back the last one (asynchronous
    scheduling) is timed as it overlaps."""
    runs = []
    for _ in range(repeats + 1):
        seqs = prefill(engine, prompts, steps + 1)
        sync(engine.device)
        start = time.perf_counter()
        drain(engine)
        sync(engine.device)
        runs.append(1000 * (time.perf_counter() - start) / steps)
        assert all(s.finished and len(s.output_token_ids) == steps + 1 for s in seqs), \
            "a benchmark request ended early or outlived its steps"
    return DecodeTiming(arm, len(prompts), prompts.shape[1], steps, statistics.median(runs[1:]))


def wall_s(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one call of `fn`, between two device syncs."""
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def time_generate(run: Callable[[int], object], steps: int, repeats: int = 3, *, device: torch.device | str = "cpu",
                  short: int = 1, warmup: int = 1, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds per decode step of a whole-generate call `run(new_tokens)`, timed from outside:
    the wall time of `short + steps` new tokens minus that of `short`, over `steps`. The prefill and
    the first `short` tokens are in both calls and cancel. `short` is 1 for `generate`-style calls
    (gpt-fast's loop: 2). After `warmup` long calls, `repeats` pairs are timed interleaved, so a
    slow patch of the machine lands on both sides of the difference, and the medians are used (the
    fastest of each side when a busy machine makes the medians cross: more pairs are timed first)."""
    device = torch.device(device)
    long = short + steps
    for _ in range(warmup):
        run(long)
    pairs = [(wall_s(lambda: run(long), device, clock), wall_s(lambda: run(short), device, clock))
             for _ in range(repeats)]
    decode_s = statistics.median(full for full, _ in pairs) - statistics.median(head for _, head in pairs)
    for _ in range(3 * repeats):
        if decode_s > 0:
            break
        pairs.append((wall_s(lambda: run(long), device, clock), wall_s(lambda: run(short), device, clock)))
        decode_s = min(full for full, _ in pairs) - min(head for _, head in pairs)
    if decode_s <= 0:
        raise RuntimeError(f"decode time not measurable: {long} new tokens were not slower than {short}; the "
                           "machine is too busy for this benchmark")
    return decode_s * 1000 / steps


def hf_generate(model, prompts: torch.Tensor, cache: str = "static", disable_compile: bool = True
                ) -> Callable[[int], object]:
    """`run(new_tokens)`: transformers' greedy `generate` on `prompts` [batch, len] with a "static" or
    "dynamic" cache. `disable_compile=False` is transformers' default path, which compiles the
    decode forward itself where it judges that it can (a static cache on CUDA)."""
    ids = prompts.to(model.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    if disable_compile:
        kwargs["disable_compile"] = True
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def run(new: int):
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=new, **kwargs)

    return run


def time_hf(model, prompts: torch.Tensor, steps: int, cache: str, repeats: int = 3) -> DecodeTiming:
    """Median ms per decode step of transformers' `generate` with a "static" or "dynamic" cache and
    `disable_compile=True` (`time_generate`)."""
    ms = time_generate(hf_generate(model, prompts, cache), steps, repeats, device=model.device)
    return DecodeTiming(f"hf-{cache}", len(prompts), prompts.shape[1], steps, ms)


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
    """Bytes per second a device-to-device copy moves (read plus write), the median of `repeats`;
    on CUDA timed by events, elsewhere by the host clock."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            times.append(wall_s(lambda: dst.copy_(src), device))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * nbytes / statistics.median(times)
