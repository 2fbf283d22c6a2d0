"""Where a prompt step after a cached prefix spends its time (Day 64).

With prefix caching a request behind a shared system prompt feeds only its own suffix, but that
step still reads the whole prefix's K/V. Two tables:

- `<prefix>_prefix_steps`: every step of requests of `suffix` new tokens after a `system_len`-token
  system prompt already in the cache, sent one at a time to an `LLM` with the engine's defaults:
  its phase, the tokens it fed, whether a graph replayed, and its wall time from scheduling to the
  sampled token on the host (`Engine.last_step`). A decode step of the same engine at batch 1 is
  timed beside them.
- `<prefix>_prefix_kernels` (CUDA): the GPU kernels of those requests' steps under the profiler,
  by kernel and class (`stepparts.kernel_class`), us a step, and the same for the decode steps.
- `<prefix>_prefix_split`: the prompt step of each request of `PROFILED_SUFFIX` tokens split on the
  host (`split_prompt_steps`): scheduling, the forward's host part, sampling with the wait for the
  GPU, the rest, and inside the first two the prefix lookup, its sharing, the plan (its block
  table entries and a padded plan's inputs among it) and the graph's launch; with the GPU time of
  its graph's replay, and of that graph replayed back to back.
- `<prefix>_prefix_ttft`: those requests' TTFT inside the process (`engine_ttft`: from `add_request`
  to the first token on the host, no server), with caching on (the LLM's engine) and off (an engine
  of its own over the same model and pool), taken in turn: what prefix caching gives before any
  HTTP, pipe or event loop adds its part.

With `reads` (`--reads engine,flat`), each of `lab.readarms`' varlen reads runs the same
requests on an engine of its own over the same model, one after another in one process; every
row names its read.

    python -m nanolab prefixsteps --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from nanolab import LLM, Engine, SamplingParams
from nanolab.config import resolve_device, resolve_dtype
from nanolab.engine.kv_cache import default_read
from nanolab.lab.readarms import READ_ARMS
from nanolab.lab.report import run_label, save_table
from nanolab.lab.stepparts import class_line, graph_replay_ms, patched_methods, profiled_kernels, timed_methods
from nanolab.model.weights import resolve_weights, weights_kind

SYSTEM_LEN = 2048
SUFFIXES = (16, 50, 200, 400)
PROFILED_SUFFIX = 50  # the shared-prefix request of `prefixbench`: 2,048 + about 50 tokens
NAN = float("nan")


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, size=n).tolist()


def run_request(engine: Engine, prompt: list[int], max_tokens: int = 1) -> list[dict]:
    """One request alone, greedy, stepped to its end: a row per step that ran a forward."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    rows = []
    while engine.has_unfinished_requests():
        engine.step()
        r = engine.last_step
        if r is not None:
            rows.append({"phase": r.phase, "tokens": r.tokens, "graph": r.graph, "ms": 1e3 * r.seconds})
    return rows


def hit_step(engine: Engine, prompt: list[int], suffix: int = PROFILED_SUFFIX) -> list[dict]:
    """`run_request` for a prompt whose last `suffix` tokens are all the cache lacks: refused
    (RuntimeError) when its prompt step fed another count, as a prompt seen before would (cached past
    the system prompt), so no table names a step it did not time."""
    rows = run_request(engine, prompt)
    if not rows or rows[0]["tokens"] != suffix:
        fed = rows[0]["tokens"] if rows else 0
        raise RuntimeError(f"a hit's prompt step fed {fed} tokens, not its {suffix} new ones: was the prompt "
                           "seen before?")
    return rows


# A prompt step's parts on the host (`split_prompt_steps`), in order; with the step's wall time they
# leave "rest_ms", the rest of `Engine.step` (emitting the token, keying the blocks it filled).
SPLIT_PARTS = {"schedule_ms": "schedule", "forward_host_ms": "run_varlen", "sample_ms": "_sample"}  # column: method
# Inside those, timed too (column: method): in scheduling, the prefix lookup and the sharing of
# what it found; in the forward's host part, the plan and the graph's launch; inside the plan, the
# block table's new entries (host tables grown, their device copy) and a padded plan's inputs
# (written to the staging buffer and uploaded in one copy).
DETAIL_PARTS = {"prefix_lookup_ms": "_cached_prefix", "prefix_share_ms": "share_prefix", "plan_ms": "plan_varlen",
                "table_ms": "_grow", "inputs_ms": "_padded_varlen", "launch_ms": "replay"}


class PrefixStepTables(NamedTuple):
    """`run_prefix_steps`' tables (the module's docstring); `kernels` is None without the profiler."""

    steps: pd.DataFrame
    kernels: pd.DataFrame | None
    split: pd.DataFrame
    ttft: pd.DataFrame


def engine_ttft(engine: Engine, prompt: list[int]) -> dict:
    """`prompt` alone, greedy, one token: ms from `add_request` to its token on the host, the steps
    that took and the tokens they fed (the prompt less what the cache held)."""
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    steps = fed = 0
    while not seq.output_token_ids and not seq.finished:
        engine.step()
        r = engine.last_step
        if r is not None:
            steps, fed = steps + 1, fed + r.tokens
    ttft = 1e3 * (time.perf_counter() - t0)
    if seq.error or not seq.output_token_ids:
        raise RuntimeError(f"a {len(prompt)}-token request ended without a token: {seq.error or seq.finish_reason}")
    while engine.has_unfinished_requests():
        engine.step()
    return {"prompt_len": len(prompt), "steps": steps, "fed_tokens": fed, "ttft_ms": ttft}


def varlen_replay_ms(engine: Engine, size: int, repeats: int = 50) -> float:
    """Median ms of the `size`-token varlen graph's replay alone, timed with events: the GPU's part
    of a graphed prompt step, no host work between replays. Replays the plan the buffers hold last,
    which rewrites the K/V its tokens wrote: run it only when no request is live."""
    return graph_replay_ms(engine.runner.varlen_graphs.graphs[size], repeats)


def split_prompt_steps(engine: Engine, prompts: Sequence[list[int]]) -> list[dict]:
    """Each of `prompts` alone, greedy, one token, its prompt step split on the host (`SPLIT_PARTS`,
    by wrapping the engine's own methods on their instances, `stepparts.timed_methods`): scheduling
    (the prefix lookup and sharing among it), the forward's host part (`run_varlen`: the plan, its
    upload and the graph's launch, or an eager forward's launches), sampling with the wait for the
    GPU and the read-back, and the rest of `Engine.step`; and parts inside the first two
    (`DETAIL_PARTS`, 0 where a step has none, as an eager step has no launch). With a varlen graph,
    also the GPU time of its replay (`graph_gpu_ms`, events around the launch: the GPU idles until then; recording them
    adds a few us to the forward's host part) and of that graph replayed back to back after the
    last request (`replay_alone_ms`). One row a step."""
    runner, cuda = engine.runner, engine.runner.device.type == "cuda"
    graphs = runner.varlen_graphs
    rows, events = [], []

    def evented(replay):
        def wrapper(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(*args, **kwargs)
            end.record()
            events.append((start, end))
            return out
        return wrapper

    spent: dict[str, float] = {}
    owners = {"schedule": engine.scheduler, "run_varlen": runner, "_sample": engine,
              "_cached_prefix": engine.scheduler, "share_prefix": engine.block_manager, "plan_varlen": runner.kv_cache,
              "_grow": runner.kv_cache, "_padded_varlen": runner.kv_cache, "replay": graphs}
    timed = [(owners[m], m) for m in (*SPLIT_PARTS.values(), *DETAIL_PARTS.values()) if owners[m] is not None]
    # the events go on first, so the launch's time holds their recording
    with patched_methods([(graphs, "replay", evented)] if graphs is not None else []), timed_methods(timed, spent):
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            while engine.has_unfinished_requests():
                spent.clear()
                events.clear()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.step()
                wall = 1e3 * (time.perf_counter() - t0)
                r = engine.last_step
                if r is None:
                    continue
                parts = {column: 1e3 * spent.get(method, 0.0) for column, method in SPLIT_PARTS.items()}
                detail = {column: 1e3 * spent.get(method, 0.0) for column, method in DETAIL_PARTS.items()}
                gpu = NAN
                if events:
                    events[0][1].synchronize()
                    gpu = events[0][0].elapsed_time(events[0][1])
                rows.append({"phase": r.phase, "tokens": r.tokens, "graph": r.graph,
                             "size": runner.last_varlen[0], "step_ms": wall, **parts,
                             "rest_ms": wall - sum(parts.values()), **detail, "graph_gpu_ms": gpu})
    if rows and graphs is not None and rows[-1]["graph"]:
        alone = varlen_replay_ms(engine, rows[-1]["size"])
        for row in rows:
            row["replay_alone_ms"] = alone if row["graph"] and row["size"] == rows[-1]["size"] else NAN
    return rows


# A warm hit's TTFT in order (`warm_hit_ledger`): (part, side, prefixbench's split column or None).
LEDGER = (("front", "host", "front_ms"), ("core wait", "host", "core_wait_ms"), ("step host", "host", "step_host_ms"),
          ("prompt step, host", "host", None), ("prompt step, graph", "GPU", None), ("back", "host", "back_ms"))


def warm_hit_ledger(ttft: pd.DataFrame, split: pd.DataFrame, part: str = "shared prefix", aim: float = 5.0
                    ) -> pd.DataFrame:
    """A warm hit's TTFT as parts (`LEDGER`), each on the host or the GPU: `prefixbench`'s split of
    `part`'s warm requests with caching on (its TTFT table, `ttft_summary`'s medians), with the
    server's prompt step cut in two by `split_prompt_steps`' medians (`split`, the same step shape
    run alone): its graph's GPU time, and the host's rest of it (scheduling is in "step host"; the
    plan, the launch and the read-back are here). Each row also has the TTFT p50 the parts approach
    (a sum of medians is not a median) and the budget for the whole request at `aim` times below
    the TTFT p50 with caching off."""
    warm = ttft[(ttft.part == part) & ttft.phase.isin(["warm", "turn 2"])].set_index("arm")
    if not {"on", "off"} <= set(warm.index):
        raise ValueError(f"ttft has no warm {part!r} rows of both arms")
    on = warm.loc["on"]
    steps = split[split.read == "engine"] if "read" in split else split  # a candidate read's graph is not the engine's
    graph = float(steps.graph_gpu_ms.median())
    if not np.isfinite(graph) or graph > on.server_prefill_ms:
        raise ValueError(f"the split's graph ({graph:.3f} ms on the GPU) does not fit the server's prompt step "
                         f"({on.server_prefill_ms:.3f} ms): were they the same step shape and machine?")
    rows = []
    for name, side, column in LEDGER:
        ms = (on[column] if column else graph if side == "GPU" else on.server_prefill_ms - graph)
        rows.append({"part": name, "side": side, "ms": float(ms)})
    return pd.DataFrame(rows).assign(ttft_p50_ms=float(on.ttft_p50_ms),
                                     budget_ms=float(warm.loc["off"].ttft_p50_ms) / aim)


def warm_hit_ledgers(runs, aim: float = 5.0) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """`warm_hit_ledger` of each (run, ttft, split) in `runs`, skipping a run whose table or split
    is missing (None): (the ledgers with a `run` column, in order; the TTFT tables they came from,
    for a label), or (None, None) when no run has both."""
    ledgers, ttfts = [], []
    for run, ttft, split in runs:
        if ttft is not None and split is not None:
            ttfts.append(ttft)
            ledgers.append(warm_hit_ledger(ttft, split, aim=aim).assign(run=run))
    if not ledgers:
        return None, None
    return pd.concat(ledgers, ignore_index=True), pd.concat(ttfts, ignore_index=True)


def ledger_summary(ledgers: pd.DataFrame) -> pd.DataFrame:
    """`warm_hit_ledger` tables with a `run` column, one row a run: its TTFT p50, the host's parts
    and the GPU's summed, the whole request's budget at the aim, what that leaves the host once the
    GPU's part is paid, and the host's parts over that."""
    sides = ledgers.groupby(["run", "side"], sort=False).ms.sum().unstack()
    runs = ledgers.groupby("run", sort=False)
    summary = pd.DataFrame({"TTFT p50": runs.ttft_p50_ms.first(), "host": sides.host, "GPU": sides.GPU,
                            "budget at the aim": runs.budget_ms.first()})
    summary["host's budget"] = summary["budget at the aim"] - summary.GPU
    summary["host / its budget"] = summary.host / summary["host's budget"]
    return summary


def run_prefix_steps(model: str, device: str, system_len: int = SYSTEM_LEN, suffixes: Sequence[int] = SUFFIXES,
                     repeats: int = 5, decode_steps: int = 32, profile: bool | None = None,
                     reads: Sequence[str] = ("engine",), log: Callable[[str], None] = print
                     ) -> PrefixStepTables:
    """The tables above. Each suffix's requests follow two untimed ones (the
    system prompt's first use, and a warm hit); `profile` (default: on CUDA) adds the kernels.

    Each of `reads` (`READ_ARMS`) has an engine of its own over the LLM's model ("engine" the
    LLM's own), every one with the LLM's pool; they take the same requests in turn, request by
    request. A read whose engine fails is logged, leaves a row with its error, and drops out; the
    others go on."""
    if system_len < 1 or repeats < 1 or decode_steps < 1 or not suffixes or min(suffixes) < 1:
        raise ValueError("system_len, repeats, decode_steps and every suffix must be positive")
    if not reads or any(r not in READ_ARMS for r in reads) or len(set(reads)) < len(reads):
        raise ValueError(f"reads {list(reads)}: name each of {', '.join(READ_ARMS)} at most once")
    if set(reads) - {"engine"} and default_read(resolve_device(device)) != "streamed":
        raise ValueError(f"reads {list(reads)}: a candidate read is a launch of the streamed read, which this "
                         "device does not run")
    llm = LLM(model, device=device)
    if not llm.engine_config.enable_prefix_caching:
        llm.close()
        raise ValueError("prefixsteps measures prefix caching: the engine has it off")
    profile = llm.device.type == "cuda" if profile is None else profile
    context = llm.engine.max_model_len
    longest = system_len + max(max(suffixes), PROFILED_SUFFIX) + 1
    if longest > context or 64 + decode_steps + 1 > context:
        llm.close()
        raise ValueError(f"system_len {system_len} and suffixes up to {max(suffixes)} need {longest} tokens, "
                         f"and the decode case {65 + decode_steps}; the engine's context holds {context} "
                         "(--system-len, --suffixes)")
    vocab = llm.config.vocab_size
    rng = np.random.default_rng(0)  # every read takes these same requests
    system = _ids(rng, system_len, vocab)
    warm = [system + _ids(rng, max(suffixes), vocab) for _ in range(2)]
    timed = {suffix: [system + _ids(rng, suffix, vocab) for _ in range(repeats + 1)] for suffix in suffixes}
    decode_prompt = _ids(rng, 64, vocab)
    hits = [system + _ids(rng, PROFILED_SUFFIX, vocab) for _ in range(repeats)]
    # Drawn last, so the prompts above stay as they were; each pass below has prompts of its own, as a
    # prompt seen before would be cached past the system prompt.
    split_hits = [system + _ids(rng, PROFILED_SUFFIX, vocab) for _ in range(repeats)]
    ttft_hits = [system + _ids(rng, PROFILED_SUFFIX, vocab) for _ in range(repeats + 1)]
    rows, tables, engines = [], [], {}

    def attempt(read: str, work: Callable[[], object]) -> None:
        """`work` for `read`; a failure ends that read: logged, a row, its engine closed."""
        try:
            work()
        except Exception as e:  # one read's failure (its kernel, its capture) leaves the others' rows
            log(f"{read}: failed, {type(e).__name__}: {e}")
            rows.append({"read": read, "case": "failed", "error": f"{type(e).__name__}: {e}"[:300]})
            engine = engines.pop(read, None)
            if engine is not None and engine is not llm.engine:
                engine.close()

    pool = llm.engine_config.replace(num_blocks=llm.engine.num_blocks)  # every read's pool the LLM's
    for read in reads:
        def build(read=read):
            engines[read] = llm.engine if read == "engine" else Engine(llm.model, pool, runner=READ_ARMS[read])
        attempt(read, build)
    for prompt in warm:  # untimed: the prefix written, then a hit (first uses of its shapes)
        for read, engine in list(engines.items()):
            attempt(read, lambda e=engine, p=prompt: run_request(e, p))
    for suffix, prompts in timed.items():
        for read, engine in list(engines.items()):  # untimed: this suffix's step shape
            attempt(read, lambda e=engine, p=prompts[0]: run_request(e, p))
        for i, prompt in enumerate(prompts[1:]):
            for read, engine in list(engines.items()):
                def one(read=read, engine=engine, i=i, prompt=prompt, suffix=suffix):
                    rows.extend({"read": read, "case": "prefix hit", "system_len": system_len, "suffix": suffix,
                                 "request": i, "step": j, **step}
                                for j, step in enumerate(run_request(engine, prompt)))
                attempt(read, one)
        for read in engines:
            done = [r for r in rows if r["read"] == read and r.get("suffix") == suffix and r["phase"] != "decode"]
            log(f"{read}: {suffix} tokens after a cached {system_len}: "
                f"{statistics.median(r['ms'] for r in done):.3f} ms a prompt step "
                f"({sum(r['graph'] for r in done)} of {len(done)} graphed)")
    split = []
    for read, engine in list(engines.items()):
        def parts(read=read, engine=engine):
            done = split_prompt_steps(engine, split_hits)
            split.extend({"read": read, "system_len": system_len, "suffix": PROFILED_SUFFIX, "request": i, **row}
                         for i, row in enumerate(done))
            t = pd.DataFrame(done)
            log(f"{read}: the {PROFILED_SUFFIX}-token step after a cached {system_len}, medians: "
                + ", ".join(f"{c[:-3].replace('_', ' ')} {t[c].median():.3f}" for c in t.columns if c.endswith("_ms"))
                + " ms")
        attempt(read, parts)
    ttft = []
    if "engine" in engines:
        off = None
        try:  # a failure here is logged and leaves the table empty; the engine's read goes on
            off = Engine(llm.model, pool.replace(enable_prefix_caching=False))
            arms = [("on", engines["engine"]), ("off", off)]
            for _, engine in arms:  # untimed: each arm's first request of this shape
                engine_ttft(engine, ttft_hits[0])
            for i, prompt in enumerate(ttft_hits[1:]):
                for arm, engine in arms if i % 2 == 0 else arms[::-1]:  # each arm first in turn
                    ttft.append({"arm": arm, "system_len": system_len, "suffix": PROFILED_SUFFIX, "request": i,
                                 **engine_ttft(engine, prompt)})
            t = pd.DataFrame(ttft).groupby("arm").ttft_ms.median()
            log(f"in process, {PROFILED_SUFFIX} tokens after a cached {system_len}: TTFT p50 {t['on']:.3f} ms on, "
                f"{t['off']:.3f} ms off ({t['off'] / t['on']:.2f}x)")
        except Exception as e:
            log(f"in process TTFT: failed, {type(e).__name__}: {e}")
            ttft.clear()
        finally:
            if off is not None:
                off.close()
    for read, engine in list(engines.items()):
        def decode(read=read, engine=engine):
            steps = run_request(engine, decode_prompt, max_tokens=decode_steps + 1)
            rows.extend({"read": read, "case": "decode", "system_len": 0, "suffix": 0, "request": 0, "step": j, **r}
                        for j, r in enumerate(steps))
            log(f"{read}: decode at batch 1: {statistics.median(r['ms'] for r in steps if r['phase'] == 'decode'):.3f}"
                " ms a step")
        attempt(read, decode)
    if profile:
        for read, engine in list(engines.items()):
            def kernels(read=read, engine=engine):
                part = pd.concat([
                    profiled_kernels(lambda: [hit_step(engine, prompt) for prompt in hits], repeats,
                                     f"prefix hit + {PROFILED_SUFFIX}"),
                    profiled_kernels(lambda: run_request(engine, decode_prompt, max_tokens=decode_steps + 1),
                                     decode_steps, "decode")], ignore_index=True)
                tables.append(part.assign(read=read))
                for arm, t in part.groupby("arm", sort=False):
                    log(f"{read}, {arm}: {class_line(t)}")
            attempt(read, kernels)
    for engine in engines.values():
        if engine is not llm.engine:
            engine.close()
    llm.close()
    return PrefixStepTables(pd.DataFrame(rows), pd.concat(tables, ignore_index=True) if tables else None,
                            pd.DataFrame(split), pd.DataFrame(ttft))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--system-len", type=int, default=SYSTEM_LEN, help="the cached system prompt's tokens")
    parser.add_argument("--suffixes", default=",".join(map(str, SUFFIXES)), help="new tokens a request feeds")
    parser.add_argument("--repeats", type=int, default=5, help="timed requests a suffix")
    parser.add_argument("--prefix", default="day64", help="tables go to data/<prefix>_prefix_steps_<device>.csv")
    parser.add_argument("--reads", default="engine",
                        help=f"comma-separated varlen reads, each on its own engine: {', '.join(READ_ARMS)} "
                             "(default: the engine's)")


def main(args: argparse.Namespace) -> int:
    try:
        suffixes = [int(s) for s in args.suffixes.split(",")]
    except ValueError:
        raise ValueError(f"--suffixes {args.suffixes!r}: comma-separated token counts") from None
    reads = [r.strip() for r in args.reads.split(",") if r.strip()]
    device = resolve_device(args.device)
    steps, kernels, split, ttft = run_prefix_steps(args.model, str(device), args.system_len, suffixes, args.repeats,
                                                   reads=reads)
    label = run_label(device, args.model, resolve_dtype("auto", device),
                      weights=weights_kind(resolve_weights(args.model)))
    print(steps.groupby(["read", "case", "suffix", "phase"]).ms.median().round(3).to_string())
    print(f"{args.prefix}_prefix_steps: {save_table(steps, f'{args.prefix}_prefix_steps', label)}")
    print(f"{args.prefix}_prefix_split: {save_table(split, f'{args.prefix}_prefix_split', label)}")
    if len(ttft):
        print(f"{args.prefix}_prefix_ttft: {save_table(ttft, f'{args.prefix}_prefix_ttft', label)}")
    if kernels is not None:
        print(kernels.groupby(["read", "arm"], sort=False).head(12).round(1).to_string(index=False))
        print(f"{args.prefix}_prefix_kernels: {save_table(kernels, f'{args.prefix}_prefix_kernels', label)}")
    return 0
