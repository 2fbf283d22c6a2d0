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

With `reads` (`--reads engine,flat`), each of `lab.readarms`' varlen reads runs the same
requests on an engine of its own over the same model, one after another in one process; every
row names its read.

    python -m nanolab prefixsteps --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from nanolab import LLM, Engine, SamplingParams
from nanolab.config import resolve_device, resolve_dtype
from nanolab.engine.kv_cache import default_read
from nanolab.lab.readarms import READ_ARMS
from nanolab.lab.report import run_label, save_table
from nanolab.lab.stepparts import class_line, profiled_kernels
from nanolab.model.weights import resolve_weights, weights_kind

SYSTEM_LEN = 2048
SUFFIXES = (16, 50, 200, 400)
PROFILED_SUFFIX = 50  # the shared-prefix request of `prefixbench`: 2,048 + about 50 tokens


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


def run_prefix_steps(model: str, device: str, system_len: int = SYSTEM_LEN, suffixes: Sequence[int] = SUFFIXES,
                     repeats: int = 5, decode_steps: int = 32, profile: bool | None = None,
                     reads: Sequence[str] = ("engine",), log: Callable[[str], None] = print
                     ) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(steps, kernels): the tables above. Each suffix's requests follow two untimed ones (the
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
    longest = system_len + max(max(suffixes), PROFILED_SUFFIX if profile else 0) + 1
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
                    profiled_kernels(lambda: [run_request(engine, prompt) for prompt in hits], repeats,
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
    return pd.DataFrame(rows), pd.concat(tables, ignore_index=True) if tables else None


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
    steps, kernels = run_prefix_steps(args.model, str(device), args.system_len, suffixes, args.repeats,
                                      reads=reads)
    label = run_label(device, args.model, resolve_dtype("auto", device),
                      weights=weights_kind(resolve_weights(args.model)))
    print(steps.groupby(["read", "case", "suffix", "phase"]).ms.median().round(3).to_string())
    print(f"{args.prefix}_prefix_steps: {save_table(steps, f'{args.prefix}_prefix_steps', label)}")
    if kernels is not None:
        print(kernels.groupby(["read", "arm"], sort=False).head(12).round(1).to_string(index=False))
        print(f"{args.prefix}_prefix_kernels: {save_table(kernels, f'{args.prefix}_prefix_kernels', label)}")
    return 0
