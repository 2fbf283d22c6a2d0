"""What the GPU does between two replays of the graphed decode step, as `LLM.generate` runs them.
Day 61.

`step_loop` profiles a whole `generate` call per batch (torch's profiler, CUDA activity) and cuts
the GPU's timeline at each graph replay: a step is one replay's kernels, then every kernel and
copy the GPU runs before the next replay (sampling, the read-back, the next plan's upload, the
next step's ids). For each step it gives:
- `period_us`: from one replay's first kernel to the next's;
- `graph_span_us`: the replay's first kernel's start to its last kernel's end;
- `graph_busy_us`: the replay's kernels' summed durations;
- `outside_ops` and `outside_busy_us`: the other operations, on any stream, that start between
  one replay's start and the next's, and their time;
- `between_us`: from the replay's end to the next replay's start;
- `launch_to_start_us`: from the host's launch of the next replay to its first kernel, which is
  how far the host runs ahead (near zero: the GPU waits for the host).
`day61_loop` has the medians per batch; `day61_loop_ops`, the operations between the replays of
one step in the middle of the call, in order, each with the gap before it. Nothing here asserts a
time. (The engine's old work between steps, four copies and the read-back on the step's stream,
was timed against today's on one engine and is committed: `data/day61_between_*`.)

    python -m nanolab levers --only loop --model llama-3.2-1b
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from nanolab import SamplingParams
from nanolab.lab.timing import random_prompts

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LOOP_COLUMNS = ("period_us", "graph_span_us", "graph_busy_us", "outside_ops", "outside_busy_us", "between_us",
                "launch_to_start_us")


def _end(e: dict) -> float:
    return e["ts"] + e["dur"]


def split_steps(events: list[dict]) -> tuple[list[dict], dict[int, dict]]:
    """A chrome trace's events -> the steps, each {"graph": [its replay's GPU events], "after": [the
    other GPU events that start after the replay's first kernel and before the next replay's],
    "corr": its launch's correlation id}, in order; and the runtime calls by correlation id. A GPU
    event belongs to a replay when its correlation id is that `cudaGraphLaunch`'s. "after" holds
    every stream's events: a copy on another stream may overlap the replay or the next one."""
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    launches = {c for c, e in runtime.items() if e["name"] == "cudaGraphLaunch"}
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    graphs: dict[int, list[dict]] = {}
    for e in gpu:
        corr = e.get("args", {}).get("correlation")
        if corr in launches:
            graphs.setdefault(corr, []).append(e)
    steps = sorted(({"graph": g, "after": [], "corr": c} for c, g in graphs.items()), key=lambda s: s["graph"][0]["ts"])
    starts = [s["graph"][0]["ts"] for s in steps]
    i = 0
    for e in gpu:
        if e.get("args", {}).get("correlation") in launches or not steps or e["ts"] < starts[0]:
            continue
        while i + 1 < len(steps) and e["ts"] >= starts[i + 1]:
            i += 1
        steps[i]["after"].append(e)
    return steps, runtime


def loop_records(events: list[dict]) -> list[dict]:
    """One record per step that has a next one (`LOOP_COLUMNS`), from a chrome trace's events."""
    steps, runtime = split_steps(events)
    records = []
    for step, nxt in zip(steps, steps[1:]):
        start, end = step["graph"][0]["ts"], max(_end(e) for e in step["graph"])
        next_start = nxt["graph"][0]["ts"]
        launch = runtime[nxt["corr"]]
        records.append({"period_us": next_start - start, "graph_span_us": end - start,
                        "graph_busy_us": sum(e["dur"] for e in step["graph"]),
                        "outside_ops": len(step["after"]), "outside_busy_us": sum(e["dur"] for e in step["after"]),
                        "between_us": next_start - end, "launch_to_start_us": next_start - launch["ts"]})
    return records


def middle_step_ops(events: list[dict]) -> pd.DataFrame:
    """The operations between a typical replay in the middle of the trace and the next, in order of
    their start: each one's kind ("kernel", "gpu_memcpy", "gpu_memset"), name, stream, duration,
    and the gap from the end of what ran before it (negative: it overlaps, on another stream)."""
    steps = split_steps(events)[0][:-1]  # the last replay has no next one
    if not steps:
        return pd.DataFrame(columns=["order", "kind", "op", "stream", "us", "gap_us"])
    # a typical step: of those with the median count of operations (not one that also writes a new
    # block-table entry), the one nearest the middle
    typical = statistics.median_low(len(s["after"]) for s in steps)
    middle = (len(steps) - 1) / 2
    _, step = min(((i, s) for i, s in enumerate(steps) if len(s["after"]) == typical),
                  key=lambda pair: abs(pair[0] - middle))
    t = max(_end(e) for e in step["graph"])
    rows = []
    for i, e in enumerate(step["after"]):
        rows.append({"order": i, "kind": e["cat"], "op": e["name"][:80], "stream": e.get("args", {}).get("stream"),
                     "us": e["dur"], "gap_us": e["ts"] - t})
        t = max(t, _end(e))
    return pd.DataFrame(rows)


def trace_events(fn) -> list[dict]:
    """Run `fn()` under torch's profiler (CPU and CUDA activity) and return its chrome trace's events."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.remove(path)


def step_loop(llm, batches=(1, 8, 32), prompt_len: int = 128, new_tokens: int = 33) -> dict[str, pd.DataFrame]:
    """`day61_loop` (medians per batch of `loop_records`) and `day61_loop_ops` (`middle_step_ops` per
    batch) for `llm` (graphs on, CUDA), each batch's greedy `generate` of `new_tokens` tokens
    over random `prompt_len`-token prompts, profiled after one unprofiled call."""
    if llm.engine.runner.graphs is None:
        raise ValueError("llm: needs CUDA graphs (a CUDA device, enforce_eager=False)")
    for name, value in (("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not isinstance(value, int) or value < 2:
            raise ValueError(f"{name}={value!r}: must be an int >= 2")
    rows = llm.engine.block_manager.max_rows
    if not batches or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= rows for b in batches):
        raise ValueError(f"batches={batches!r}: each must be an int from 1 to the engine's {rows} rows")
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    loops, ops = [], []
    for batch in batches:
        prompts = [{"prompt_token_ids": p} for p in
                   random_prompts(batch, prompt_len, llm.config.vocab_size).tolist()]
        def call(prompts=prompts):
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()

        call()  # compiles nothing new: warms this batch's first calls outside the trace
        events = trace_events(call)
        records = loop_records(events)
        if not records:
            raise RuntimeError(f"batch {batch}: the trace holds no two graph replays")
        loops.append({"batch": batch, "steps": len(records),
                      **{c: statistics.median(r[c] for r in records) for c in LOOP_COLUMNS}})
        ops.append(middle_step_ops(events).assign(batch=batch))
    return {"day61_loop": pd.DataFrame(loops), "day61_loop_ops": pd.concat(ops, ignore_index=True)}
