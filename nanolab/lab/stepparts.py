"""Where a graphed decode step's time goes: its GPU kernels by class (`breakdown`), the graph's replay
alone (`replay_ms`), and the host's parts of a step (`step_anatomy`). Day 61.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import pandas as pd
import torch

from nanolab import Engine
from nanolab.lab.capturebench import kernel_table
from nanolab.lab.timing import drain, prefill

# Kernel classes of the waterfall, matched in order against a kernel's name.
KERNEL_CLASSES = (
    # "_mm": inductor's kernels that hold a matmul (a tuned batch-1 reduction, with its norm or
    # activation fused in) are named after it.
    ("projections", ("nvjet", "gemm", "cutlass", "splitkreduce", "triton_tem", "_mm", "_gemv", "_sum_splits",
                     "_norm_qkv_rope", "_norm_gate_up", "_norm_head")),
    ("attention read", ("_paged_decode", "_merge_splits", "_varlen_group", "_varlen_fold")),
    ("sampling", ("argmax", "reduce_kernel", "_chunk_max", "_pick")),
    ("norms", ("layer_norm", "rms")),
    ("fused by inductor", ("triton_",)),
    ("copies and indexing", ("copy", "index", "gather", "cat", "memcpy", "memset", "fill", "scatter",
                             "_upload")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in lowered for k in keys):
            return cls
    return "other elementwise"


def profiled_kernels(run: Callable[[], object], steps: int, arm: str) -> pd.DataFrame:
    """The CUDA kernels `run()` launches under the profiler, over the `steps` steps it runs
    (`capturebench.kernel_table`: calls, GPU us, us a step, share), each with its class."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = kernel_table(prof, steps, arm)
    table["class"] = table.kernel.map(kernel_class)
    return table


def without_kernels(whole: pd.DataFrame, part: pd.DataFrame, steps: int) -> pd.DataFrame:
    """`whole`'s kernels (a `profiled_kernels` table) less `part`'s, kernel by kernel (calls and GPU
    us), over `steps` steps: what `whole` ran beyond `part`. A kernel left with no call is dropped;
    us_per_step, share and class are those of what is left."""
    counts = part.set_index("kernel")[["calls", "gpu_us"]]
    left = whole.set_index("kernel")[["calls", "gpu_us"]].sub(counts, fill_value=0)
    left = left[left.calls > 0].clip(lower=0)  # a kernel only `part` ran is left with fewer than none
    table = left.reset_index().assign(arm=whole.arm.iloc[0] if len(whole) else "")
    table = table.sort_values("gpu_us", ascending=False, ignore_index=True)
    table["us_per_step"] = table.gpu_us / steps
    table["share"] = table.gpu_us / table.gpu_us.sum()
    table["class"] = table.kernel.map(kernel_class)
    return table[["arm", "kernel", "calls", "gpu_us", "us_per_step", "share", "class"]]


def decode_kernels(run: Callable[[int], object], steps: int, arm: str) -> pd.DataFrame:
    """The CUDA kernels of `steps` decode steps alone: `run(n)` (a whole `generate` call of n new
    tokens, the first from its prompt step) profiled at `steps` + 1 tokens and at 1, the second's
    kernels taken from the first's (`without_kernels`). The prompt step's kernels cancel, however
    much they cost: an fp8 prompt step widens every layer's weight."""
    whole = profiled_kernels(lambda: run(steps + 1), steps, arm)
    prompt = profiled_kernels(lambda: run(1), steps, arm)
    return without_kernels(whole, prompt, steps)


def class_line(table: pd.DataFrame, digits: int = 0) -> str:
    """One arm's kernels as a line: us a step in all, then by class."""
    by_class = table.groupby("class").us_per_step.sum()
    return (f"{table.us_per_step.sum():.{digits}f} us of kernels a step; "
            + ", ".join(f"{c} {us:.{digits}f}" for c, us in by_class.items()))


def breakdown(profile: pd.DataFrame, ms_per_step: float) -> pd.DataFrame:
    """ms per step by kernel class, and the host's share: the measured step less the GPU's time."""
    by_class = profile.assign(cls=profile.kernel.map(kernel_class)).groupby("cls").us_per_step.sum() / 1000
    rows = [{"part": cls, "ms": ms} for cls, ms in by_class.items()]
    rows.append({"part": "host (GPU idle)", "ms": ms_per_step - by_class.sum()})
    return pd.DataFrame(rows)


def replay_ms(engine: Engine, batch: int, repeats: int = 50) -> float:
    """Median ms of the batch-`batch` graph's replay alone, timed with events: the GPU's part of a
    step, its kernels and the gaps between them. Replays whatever plan the buffers hold last; run
    it only when no request is live."""
    return graph_replay_ms(engine.runner.graphs.graphs[(batch, None)], repeats)


def graph_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50) -> float:
    """Median ms of `graph`'s replay, each timed alone with events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextmanager
def patched_methods(patches: list[tuple[object, str, Callable[[Callable], Callable]]]) -> Iterator[None]:
    """While open, each (instance, name, wrap) of `patches` has `wrap(method)` in place of its method
    on that instance; on leaving, also after an exception, the class's method (or the instance's own
    attribute, as an engine's sampler is) shows through again."""
    owned = [name in vars(obj) for obj, name, _ in patches]
    originals = [getattr(obj, name) for obj, name, _ in patches]
    try:
        for obj, name, wrap in patches:
            setattr(obj, name, wrap(getattr(obj, name)))
        yield
    finally:
        for (obj, name, _), original, own in zip(patches, originals, owned, strict=True):
            if own:
                setattr(obj, name, original)
            elif name in vars(obj):
                delattr(obj, name)  # an instance attribute: the class's method shows through again


def _timed(name: str, spent: dict[str, float], fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


def timed_methods(patches: list[tuple[object, str]], spent: dict[str, float]):
    """`patched_methods` that add each call's wall seconds to `spent[name]`."""
    return patched_methods([(obj, name, partial(_timed, name, spent)) for obj, name in patches])


def step_anatomy(engine: Engine, prompts: torch.Tensor, steps: int) -> dict[str, float]:
    """Mean host microseconds a graphed decode step spends in each part, found by wrapping the
    engine's own methods on this instance (`timed_methods`): scheduling, planning (host tables and
    the copies into the step buffers), issuing the replay, launching the sampler (`sample_tokens`
    leaves the tokens on the device), and the rest of `Engine.step`, which holds the wait for the GPU
    and the tokens' read-back. Each step starts from an idle GPU, so an engine with asynchronous
    scheduling overlaps nothing here: compare its parts with the other arms', and its step time with
    `time_engine`'s. Also the share of steps that replayed a graph."""
    spent: dict[str, float] = {}
    runner = engine.runner
    patches = [(engine.scheduler, "schedule"), (runner, "plan_step"), (runner.graphs, "replay"), (engine, "sampler")]
    with timed_methods(patches, spent):
        prefill(engine, prompts, steps + 1)
        spent.clear()
        graphed, total = 0, 0.0
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            graphed += runner.last_decode[1]
    drain(engine)
    out = {f"{name}_us": 1e6 * s / steps for name, s in spent.items()}
    out["rest_us"] = 1e6 * total / steps - sum(out.values())
    out["graphed_share"] = graphed / steps
    return out
