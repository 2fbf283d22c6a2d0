"""Decode at the bandwidth floor: nanolab against HF transformers and gpt-fast, every arm timed
the same way from outside, in one run on one device. Day 61 (issue 13).

Each arm is a whole generate call, `run(new_tokens)`, timed by `lab.timing.time_generate`: the
wall time of 257 new tokens minus that of 1 (gpt-fast's loop: 258 minus 2), over 256, from
interleaved pairs, medians. The arms:

- nanolab: `LLM.generate` on token-id prompts, greedy, ignoring EOS, as a user calls it (the
  caller builds the `LLM`, so engine options travel with it).
- HF transformers with a static cache, its default path: on CUDA it compiles the decode forward
  itself. The label says what ran ("compiled" only when graphs were compiled in the warm-up).
- HF transformers with a static cache and `disable_compile=True`: its eager path.
- gpt-fast, when a checkout is given (`lab.gptfast`): its own `generate()` with `decode_one_token`
  compiled as its `--compile` does, at the same shapes and on the same weights.

A compiling arm starts each shape from a fresh compiler state, as a process running that one shape
would. The floor of a step is the bytes it must read (every weight once, and the K and V of the
history an average timed step reads) over the copy bandwidth measured in the same run; `x_floor`
is ms/step over it. Issue 13's targets print as ratios; nothing asserts a time. TTFT is
`generate` with one new token, warmed, medians. One arm's failure (a compile error, OOM at a large
batch) is recorded in its rows and the bench goes on. The tables are saved after every row; where
a time limit splits the work, `--append` adds a run's rows to those saved before on the device, by
arm and shape, and each row's `run` says which process measured it.

    python -m nanolab floorbench --model llama-3.2-1b --gpt-fast third_party/gpt-fast
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import pandas as pd
import torch

from nanolab import LLM, SamplingParams
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.costs import kv_read_bytes, step_read_bytes
from nanolab.lab.timing import copy_bandwidth, hf_generate, random_prompts, time_generate, wall_s

BATCHES = (1, 8, 32, 64)
PROMPT_LEN = 128
CONTEXTS = ((32, 2048),)  # (batch, context): prompts of context - steps/2, so decode runs near `context`
STEPS = 256
ARMS = ("nanolab", "hf-default", "hf-eager", "gpt-fast")
# Issue 13's targets, ms per step by (batch, context).
TARGETS_MS = {(1, 128): 1.00, (8, 128): 1.10, (32, 128): 1.30, (64, 128): 1.50, (32, 2048): 1.90}
STRETCH_MS = {(1, 128): 0.80}
TTFT_CASES = ((1, 2048), (8, 1024))  # (batch, prompt_len)
TTFT_TARGET = 1.5  # nanolab's TTFT speedup over HF's default path at batch 1
CPU_TARGET = 2.0  # on a CPU (2 cores, SmolLM2, fp32): nanolab's speedup over HF at batch 1
STEMS = ("day61_floor", "day61_roofline", "day61_ttft")
ROOFLINE_SHOWN = ("batch", "context", "kv_tokens", "step_bytes", "bandwidth_tb_s", "floor_ms", "target_ms",
                  "stretch_ms", "target_x_floor")
WEIGHTS_SOURCE = "nanolab's folder"  # every arm loads the same weights
NAN = float("nan")


@dataclass(frozen=True)
class Shape:
    batch: int
    context: int  # as issue 13 names the shape: the prompt (128), or the history decode runs near (2048)
    prompt_len: int

    def kv_tokens(self, steps: int) -> int:
        """The history the average timed step reads: the prompt and half the timed steps."""
        return self.prompt_len + steps // 2


def decode_shapes(batches: Iterable[int], prompt_len: int = PROMPT_LEN, contexts: Iterable[tuple[int, int]] = CONTEXTS,
                  steps: int = STEPS) -> list[Shape]:
    """Every batch at `prompt_len`, then each (batch, context) with prompts of context - steps/2."""
    shapes = [Shape(b, prompt_len, prompt_len) for b in batches]
    for batch, context in contexts:
        if context - steps // 2 < 1:
            raise ValueError(f"context {context} is too short for {steps} steps: its prompt would be "
                             f"{context - steps // 2} tokens")
        shapes.append(Shape(batch, context, context - steps // 2))
    return shapes


def check_context(shapes: Iterable[Shape], ttft: Iterable[tuple[int, int]], steps: int, context: int,
                  longest_short: int = 2) -> None:
    """Refuse, naming its flags, a shape whose timed call (its prompt, `steps` tokens and an arm's
    short call, at most `longest_short`) or a TTFT prompt (and its one token) would not fit the
    model's `context`: every arm would fail it, one row at a time."""
    for s in shapes:
        if s.prompt_len + steps + longest_short > context:
            raise ValueError(f"--contexts/--prompt-len/--steps: a call at context {s.context} holds {s.prompt_len} "
                             f"prompt tokens and {steps + longest_short} new ones, past the model's context of "
                             f"{context}")
    for batch, prompt_len in ttft:
        if prompt_len + 1 > context:
            raise ValueError(f"--ttft {batch}x{prompt_len}: the prompt and its token would pass the model's context "
                             f"of {context}")


def parse_batches(text: str, option: str = "--batches") -> list[int]:
    """"1,8,32" -> [1, 8, 32]; "" -> []."""
    return int_list(text, option) if text.replace(",", "").strip() else []


def parse_pairs(text: str, option: str, sep: str) -> list[tuple[int, int]]:
    """"32@2048,8@4096" (sep "@") -> [(32, 2048), (8, 4096)]; "" or "none" -> []."""
    if text.strip().lower() in ("", "none"):
        return []
    pairs = []
    for part in text.split(","):
        fields = part.strip().split(sep)
        if len(fields) != 2:
            raise ValueError(f"{option}: {part.strip()!r} is not BATCH{sep}TOKENS (e.g. 32{sep}2048)")
        pairs.append((positive_int(fields[0], option), positive_int(fields[1], option)))
    return pairs


def parse_arms(text: str, gpt_fast: str | None) -> list[str]:
    """The arms to run, in `ARMS` order; "all" is every arm (gpt-fast only with a checkout)."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    if names == ["all"]:
        names = [a for a in ARMS if a != "gpt-fast" or gpt_fast]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise ValueError(f"--arms {text!r}: choose from {', '.join(ARMS)} (or all)")
    if "gpt-fast" in names and not gpt_fast:
        raise ValueError("--arms gpt-fast needs --gpt-fast PATH, a gpt-fast checkout")
    return [a for a in ARMS if a in names]


@dataclass(frozen=True)
class Arm:
    """A system under test. `runner(prompts)` prepares one shape (prompts [batch, len] int64) and
    returns `run(new_tokens)`, one whole generate call. `short` is the short call's new tokens."""

    name: str  # "nanolab", "hf-default", "hf-eager", "gpt-fast"
    label: str  # as the tables show it; "{compiled}" is filled from what ran
    runner: Callable[[torch.Tensor], Callable[[int], object]]
    short: int = 1
    compiles: bool = False  # starts each shape from a fresh compiler state
    note: str = ""

    def describe(self, graphs: int) -> str:
        return self.label.format(compiled="compiled" if graphs else "not compiled")


def graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def nanolab_generate(llm: LLM, prompts: torch.Tensor) -> Callable[[int], object]:
    """`run(new_tokens)`: `llm.generate` on `prompts` [batch, len] as token ids, greedy, ignoring EOS."""
    requests = [{"prompt_token_ids": p} for p in prompts.tolist()]

    def run(new: int):
        outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        failed = [o.error for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"nanolab: {len(failed)} request(s) failed: {failed[0]}")
        return outs

    return run


def nanolab_label(llm: LLM) -> str:
    """What ran: graphs or eager, inductor's step or the model's (batch 1 tuned or not), overlapped
    steps or not, the read. (The tables of 2026-11-30 were measured before the label named compile
    and async scheduling, and those of 2026-12-01 before it named the tuned batch 1; their nanolab
    rows ran with each, the defaults with graphs.)"""
    engine = llm.engine
    parts = ["graphs" if engine.runner.graphs is not None else "eager"]
    parts += ["inductor"] if getattr(llm, "compiled", False) else []
    parts += ["tuned batch 1"] if getattr(engine.runner.forward, "tune_batch_1", False) else []
    parts += ["async scheduling"] if engine.async_scheduling else []
    return f"nanolab ({', '.join(parts)}, {engine.kv_cache.read} read)"


def hf_arms(hf, device: torch.device) -> list[Arm]:
    """HF's default static-cache path and its eager path, over one loaded model."""

    def runner(disable_compile: bool):
        def prepare(prompts: torch.Tensor):
            # transformers sizes a static cache for the longest call it has seen; each shape starts fresh.
            hf.__dict__.pop("_previous_max_cache_length", None)
            return hf_generate(hf, prompts, "static", disable_compile=disable_compile)
        return prepare

    default_note = "" if device.type == "cuda" else (f"transformers auto-compiles the decode forward only on "
                                                      f"accelerators; on {device.type} its default path is eager")
    return [Arm("hf-default", "hf static (default, {compiled})", runner(False), compiles=True, note=default_note),
            Arm("hf-eager", "hf static (disable_compile=True, eager)", runner(True))]


def gpt_fast_arm(path, llm: LLM) -> Arm:
    """gpt-fast from a checkout at `path`, at `llm`'s shapes and weights; compiled on CUDA, as its
    `--compile` does, eager elsewhere."""
    from nanolab.lab.gptfast import build_transformer, gpt_fast_generate, import_gpt_fast

    gf = import_gpt_fast(path)
    model = build_transformer(gf, llm.config, llm.path, llm.dtype, llm.device)
    compile = llm.device.type == "cuda"
    label = "gpt-fast (compile reduce-overhead)" if compile else "gpt-fast (eager)"
    return Arm("gpt-fast", label, lambda prompts: gpt_fast_generate(gf, model, prompts, compile), short=2,
               compiles=compile, note="its generate() repeats prompts[0] over the batch; sampler at temperature 0")


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).splitlines())[:300]


def decode_row(arm: str, label: str, shape: Shape, steps: int, error: str = "", note: str = "") -> dict:
    """A decode table row, not yet measured; `floor_columns` fills its floor."""
    return {"arm": arm, "label": label, "batch": shape.batch, "context": shape.context,
            "prompt_len": shape.prompt_len, "kv_tokens": shape.kv_tokens(steps), "steps": steps,
            "ms_per_step": NAN, "tokens_per_s": NAN, "bandwidth_tb_s": NAN, "floor_ms": NAN, "x_floor": NAN,
            "target_ms": NAN, "x_target": NAN, "graphs_compiled": 0, "graphs_compiled_timed": 0, "error": error,
            "note": note, "weights_source": WEIGHTS_SOURCE, "run": ""}


def ttft_row(arm: str, label: str, batch: int, prompt_len: int, runs: int, error: str = "", note: str = "") -> dict:
    """A TTFT table row, not yet measured."""
    return {"arm": arm, "label": label, "batch": batch, "prompt_len": prompt_len, "ttft_ms": NAN,
            "runs": runs, "graphs_compiled": 0, "error": error, "note": note, "weights_source": WEIGHTS_SOURCE,
            "run": ""}


DECODE_COLUMNS = list(decode_row("", "", Shape(1, 1, 1), 1))
TTFT_COLUMNS = list(ttft_row("", "", 1, 1, 1))


def measure_decode(arm: Arm, shape: Shape, vocab: int, steps: int, repeats: int, warmup: int,
                   device: torch.device) -> dict:
    """One row: `arm` at `shape`, or the error it raised. `graphs_compiled_timed` counts graphs
    compiled during the timed pairs: 0 unless the warm-up was too short."""
    row = decode_row(arm.name, arm.describe(0), shape, steps, note=arm.note)
    try:
        if arm.compiles:
            torch._dynamo.reset()
        start = graph_count()
        run = arm.runner(random_prompts(shape.batch, shape.prompt_len, vocab))
        for _ in range(warmup):  # compiles, and records the CUDA graphs, outside the timed pairs
            run(arm.short + steps)
        warm = graph_count()
        ms = time_generate(run, steps, repeats, device=device, short=arm.short, warmup=0)
        row.update(label=arm.describe(warm - start), ms_per_step=ms, tokens_per_s=1000 * shape.batch / ms,
                   graphs_compiled=warm - start, graphs_compiled_timed=graph_count() - warm)
    except Exception as e:  # one arm's failure is its row's, and the bench goes on
        row["error"] = _error(e)
        _free(device)
    return row


def measure_ttft(arm: Arm, batch: int, prompt_len: int, vocab: int, repeats: int, warmup: int,
                 device: torch.device) -> dict:
    """One row: the median wall time of `arm`'s generate with one new token, or the error it raised."""
    row = ttft_row(arm.name, arm.describe(0), batch, prompt_len, repeats, note=arm.note)
    try:
        if arm.compiles:
            torch._dynamo.reset()
        start = graph_count()
        run = arm.runner(random_prompts(batch, prompt_len, vocab, seed=1))
        for _ in range(warmup):
            run(1)
        times = [wall_s(lambda: run(1), device) for _ in range(repeats)]
        graphs = graph_count() - start
        row.update(ttft_ms=1000 * statistics.median(times), graphs_compiled=graphs)
        if arm.name == "hf-default" and not graphs:
            row["note"] = "transformers runs the prefill uncompiled on its default path"
    except Exception as e:
        row["error"] = _error(e)
        _free(device)
    return row


@dataclass(frozen=True)
class FloorBench:
    decode: pd.DataFrame  # one row per arm and shape: ms_per_step, floor_ms, x_floor, x_target, ...
    roofline: pd.DataFrame  # one row per shape: the bytes, the floor, the target, each arm's x_floor
    ttft: pd.DataFrame  # one row per arm and case: ttft_ms, nanolab_speedup

    def tables(self) -> dict[str, pd.DataFrame]:
        return dict(zip(STEMS, (self.decode, self.roofline, self.ttft), strict=True))


def roofline_table(config, shapes: list[Shape], steps: int, dtype: torch.dtype, bandwidth: float,
                   targets: bool = True) -> pd.DataFrame:
    """One row per shape: the bytes a step must read, the floor they set at `bandwidth` (bytes/s),
    issue 13's target and how far above the floor it lies. The targets are the H200's: `targets`
    False (any other device) leaves them NaN."""
    records = []
    for s in shapes:
        kv = s.kv_tokens(steps)
        total = step_read_bytes(config, s.batch, kv, dtype)
        floor = total / bandwidth * 1000
        target = TARGETS_MS.get((s.batch, s.context), float("nan")) if targets else float("nan")
        records.append({"batch": s.batch, "context": s.context, "prompt_len": s.prompt_len, "kv_tokens": kv,
                        "weight_bytes": total - kv_read_bytes(config, s.batch, kv, dtype),
                        "kv_bytes": kv_read_bytes(config, s.batch, kv, dtype), "step_bytes": total,
                        "bandwidth_tb_s": bandwidth / 1e12, "floor_ms": floor, "target_ms": target,
                        "stretch_ms": STRETCH_MS.get((s.batch, s.context), float("nan")) if targets else NAN,
                        "target_x_floor": target / floor})
    return pd.DataFrame(records)


def _lookup(df: pd.DataFrame, keys: list[str], arm: str, column: str) -> Callable[[tuple], float]:
    """`arm`'s `column` by the values of `keys` in a row; NaN where the arm has no such row."""
    rows = df[df.arm == arm]
    values = dict(zip(rows[keys].itertuples(index=False, name=None), rows[column], strict=True))
    return lambda key: values.get(key, float("nan"))


def floor_columns(row: dict, roofline: pd.DataFrame) -> dict:
    """`row`'s floor at its shape in this run's `roofline`, its x_floor, its target and x_target."""
    r = roofline.set_index(["batch", "context"]).loc[(row["batch"], row["context"])]
    ms = row["ms_per_step"]
    return {"bandwidth_tb_s": r.bandwidth_tb_s, "floor_ms": r.floor_ms, "x_floor": ms / r.floor_ms,
            "target_ms": r.target_ms, "x_target": ms / r.target_ms}


def floor_tables(decode: pd.DataFrame, ttft: pd.DataFrame, roofline: pd.DataFrame) -> FloorBench:
    """The three tables with what compares rows: nanolab's speedup over each decode and TTFT row
    (its time over nanolab's at the same shape), and each arm's x_floor on the roofline."""
    shape, case = ["batch", "context"], ["batch", "prompt_len"]
    decode, ttft = decode.copy(), ttft.copy()
    roofline = roofline[[c for c in roofline.columns if not c.startswith("x_floor_")]].copy()
    ours = _lookup(decode, shape, "nanolab", "ms_per_step")
    decode["nanolab_speedup"] = [ms / ours(k) for ms, k in
                                 zip(decode.ms_per_step, decode[shape].itertuples(index=False, name=None),
                                     strict=True)]
    for arm in dict.fromkeys(decode.arm):
        x_floor = _lookup(decode, shape, arm, "x_floor")
        roofline[f"x_floor_{arm}"] = [x_floor(k) for k in roofline[shape].itertuples(index=False, name=None)]
    ours = _lookup(ttft, case, "nanolab", "ttft_ms")
    ttft["nanolab_speedup"] = [ms / ours(k) for ms, k in
                               zip(ttft.ttft_ms, ttft[case].itertuples(index=False, name=None), strict=True)]
    return FloorBench(decode, roofline, ttft)


def merge_tables(bench: FloorBench, previous: FloorBench) -> FloorBench:
    """`bench` over tables saved by earlier runs on this device: their rows of an arm and shape (or
    TTFT case) that `bench` did not measure are kept, each with the floor and `run` stamp of its own
    run, and the comparisons are redone over the whole."""

    def kept(old: pd.DataFrame, new: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
        # Empty text reads back from a CSV as NaN.
        old = old.assign(**{c: old[c].astype(object).where(old[c].notna(), "") for c in ("error", "note", "run")
                            if c in old})
        seen = set(new[keys].itertuples(index=False, name=None))
        old = old[[k not in seen for k in old[keys].itertuples(index=False, name=None)]]
        return pd.concat([old, new], ignore_index=True) if len(old) else new

    return floor_tables(kept(previous.decode, bench.decode, ["arm", "batch", "context"]),
                        kept(previous.ttft, bench.ttft, ["arm", "batch", "prompt_len"]),
                        kept(previous.roofline, bench.roofline, ["batch", "context"]))


def run_floorbench(llm: LLM, shapes: list[Shape], *, steps: int = STEPS, repeats: int = 3, warmup: int = 2,
                   arms: Iterable[str] = ARMS[:3], gpt_fast=None, ttft_cases=TTFT_CASES, ttft_repeats: int = 5,
                   bandwidth: float | None = None, extra_arms: Iterable[Arm] = (),
                   on_row: Callable[[FloorBench], None] | None = None, progress: bool = True) -> FloorBench:
    """Every arm in `arms` (then `extra_arms`) at every shape, arm by arm; TTFT for all but
    gpt-fast. `gpt_fast` is the checkout for the gpt-fast arm. `bandwidth` (bytes/s) defaults to
    `copy_bandwidth` measured now. `on_row` gets the tables so far after each row (to save them,
    so a run cut off by a time limit keeps what it measured)."""
    from nanolab.lab.reference import load_hf
    from nanolab.progress import progress_bar

    device, config, vocab = llm.device, llm.config, llm.config.vocab_size
    arms = list(arms)
    run = datetime.now(UTC).isoformat(timespec="milliseconds")  # which rows shared this process
    if bandwidth is None:
        bandwidth = copy_bandwidth(device, nbytes=1 << 30 if device.type == "cuda" else 1 << 26)
    roofline = roofline_table(config, shapes, steps, llm.dtype, bandwidth, targets=llm.device.type == "cuda")
    hf = []  # transformers' model, loaded once for both HF arms

    def setup(name: str) -> Arm:
        if name == "nanolab":
            return Arm("nanolab", nanolab_label(llm), lambda prompts: nanolab_generate(llm, prompts))
        if name == "gpt-fast":
            return gpt_fast_arm(gpt_fast, llm)
        if not hf:
            hf.append(load_hf(llm.path, llm.dtype, device, attn_implementation="sdpa"))
        return next(arm for arm in hf_arms(hf[0], device) if arm.name == name)

    plan = [(name, lambda name=name: setup(name)) for name in arms]
    plan += [(arm.name, lambda arm=arm: arm) for arm in extra_arms]
    timed_ttft = [name != "gpt-fast" for name, _ in plan]  # gpt-fast's loop has no TTFT row
    bar = progress_bar(total=len(plan) * len(shapes) + sum(timed_ttft) * len(ttft_cases), desc="floor bench",
                       enabled=progress)
    decode_rows, ttft_rows = [], []

    def done(n: int = 1) -> None:
        bar.update(n)
        if on_row is not None:
            on_row(tables())

    def tables() -> FloorBench:
        decode = [{**row, **floor_columns(row, roofline), "run": run} for row in decode_rows]
        return floor_tables(pd.DataFrame(decode, columns=DECODE_COLUMNS),
                            pd.DataFrame([{**row, "run": run} for row in ttft_rows], columns=TTFT_COLUMNS), roofline)

    for (name, start), with_ttft in zip(plan, timed_ttft, strict=True):
        try:
            arm = start()
        except Exception as e:  # the arm cannot start: every one of its rows says why
            error = _error(e)
            _free(device)
            decode_rows += [decode_row(name, name, s, steps, error) for s in shapes]
            if with_ttft:
                ttft_rows += [ttft_row(name, name, b, n, 0, error) for b, n in ttft_cases]
            done(len(shapes) + with_ttft * len(ttft_cases))
            continue
        for shape in shapes:
            bar.set_postfix_str(f"{name} batch {shape.batch} @ {shape.context}")
            # Only a compiling arm needs more than one untimed call to be warm.
            decode_rows.append(measure_decode(arm, shape, vocab, steps, repeats,
                                              warmup if arm.compiles else min(warmup, 1), device))
            done()
        if with_ttft:
            for batch, prompt_len in ttft_cases:
                bar.set_postfix_str(f"{name} TTFT {batch} x {prompt_len}")
                ttft_rows.append(measure_ttft(arm, batch, prompt_len, vocab, ttft_repeats, warmup, device))
                done()
        if arm.compiles:
            torch._dynamo.reset()  # lets go of its graphs and their memory pools
        _free(device)
    bar.close()
    return tables()


def ratio_lines(bench: FloorBench) -> list[str]:
    """Per shape: nanolab's step against the floor and issue 13's target (and stretch), then its
    speedup over each peer; per TTFT case, each arm's time and nanolab's speedup over it."""
    lines = []
    d = bench.decode
    for s in bench.roofline.itertuples():
        line = f"batch {s.batch} @ {s.context}: floor {s.floor_ms:.3f} ms"
        for r in d[(d.batch == s.batch) & (d.context == s.context)].itertuples():
            if not math.isfinite(r.ms_per_step):
                line += f"; {r.label}: failed"
            elif r.arm == "nanolab":
                line += f"; nanolab {r.ms_per_step:.3f} ms/step = {r.x_floor:.2f}x floor"
                if math.isfinite(s.target_ms):
                    line += f", {r.x_target:.2f}x target {s.target_ms:.2f} ms"
                if math.isfinite(s.stretch_ms):
                    line += f", {r.ms_per_step / s.stretch_ms:.2f}x stretch {s.stretch_ms:.2f} ms"
            else:
                line += f"; {r.label} {r.ms_per_step:.3f} ms"
                if math.isfinite(r.nanolab_speedup):
                    line += f" (nanolab speedup {r.nanolab_speedup:.2f}x)"
        lines.append(line)
    t = bench.ttft
    for (batch, prompt_len), rows in t.groupby(["batch", "prompt_len"], sort=False):
        parts = []
        for r in rows.itertuples():
            part = f"{r.label} failed" if not math.isfinite(r.ttft_ms) else f"{r.label} {r.ttft_ms:.1f} ms"
            if r.arm != "nanolab" and math.isfinite(r.nanolab_speedup):
                part += f" (nanolab speedup {r.nanolab_speedup:.2f}x" + (f", target {TTFT_TARGET}x)" if batch == 1 and
                                                                 r.arm == "hf-default" else ")")
            parts.append(part)
        lines.append(f"TTFT {batch} x {prompt_len}: " + ", ".join(parts))
    return lines


def cpu_target_line(bench: FloorBench) -> str | None:
    """Issue 13's CPU target at batch 1 (nanolab CPU_TARGET times as fast as HF's default path),
    and where that time lies against this machine's bandwidth floor; None without both rows."""
    d, r = bench.decode, bench.roofline
    one = d[(d.batch == 1) & (d.context == PROMPT_LEN)].set_index("arm").ms_per_step
    floor = r[(r.batch == 1) & (r.context == PROMPT_LEN)].floor_ms
    if not {"nanolab", "hf-default"} <= set(one.index) or floor.empty:
        return None
    wanted = one["hf-default"] / CPU_TARGET
    return (f"CPU target at batch 1: nanolab {one['hf-default'] / one['nanolab']:.2f}x as fast as HF's default path "
            f"(target {CPU_TARGET}x). {CPU_TARGET}x would be {wanted:.1f} ms a step, {wanted / floor.iloc[0]:.2f}x "
            f"the floor of reading every weight once at this machine's measured bandwidth")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes at --prompt-len")
    parser.add_argument("--prompt-len", default=str(PROMPT_LEN))
    parser.add_argument("--contexts", default=",".join(f"{b}@{c}" for b, c in CONTEXTS),
                        help="BATCH@CONTEXT pairs decoded near CONTEXT tokens of history ('none' for none)")
    parser.add_argument("--steps", default=str(STEPS), help="timed decode steps per call")
    parser.add_argument("--repeats", default="3", help="timed pairs per shape")
    parser.add_argument("--warmup", default="2", help="untimed long calls per shape (compiles happen here)")
    parser.add_argument("--arms", default="all", help=f"comma-separated, from {', '.join(ARMS)}, or all")
    parser.add_argument("--gpt-fast", default=None, metavar="PATH", help="a gpt-fast checkout: adds its arm")
    parser.add_argument("--ttft", default=",".join(f"{b}x{n}" for b, n in TTFT_CASES),
                        help="BATCHxPROMPT_LEN cases for time to first token ('none' to skip)")
    parser.add_argument("--compile", choices=("default", "on", "off"), default="default",
                        help="nanolab's decode step compiled by inductor: the engine's default is on with graphs "
                             "(CUDA) and off on the CPU")
    parser.add_argument("--eager-beside", action="store_true",
                        help="with --compile on: also time nanolab's eager step, as the arm nanolab-eager, from a "
                             "second engine in the same process")
    parser.add_argument("--append", action="store_true",
                        help="merge into the tables saved on this device: rows of arms and shapes not run now are kept")


def labelled(bench: FloorBench, label) -> FloorBench:
    """`bench` with `label`'s columns on every row (before a merge, where earlier rows keep theirs)."""
    return FloorBench(*(t.assign(**{k: v for k, v in label.as_columns().items() if k not in t})
                        for t in (bench.decode, bench.roofline, bench.ttft)))


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nanolab.lab.report import load_table, run_label, save_table

    batches = parse_batches(args.batches)
    prompt_len = positive_int(args.prompt_len, "--prompt-len")
    steps = positive_int(args.steps, "--steps")
    repeats = positive_int(args.repeats, "--repeats")
    warmup = positive_int(args.warmup, "--warmup", minimum=0)
    shapes = decode_shapes(batches, prompt_len, parse_pairs(args.contexts, "--contexts", "@"), steps)
    if not shapes:
        raise ValueError("no shapes: give --batches or --contexts")
    ttft = parse_pairs(args.ttft, "--ttft", "x")
    arms = parse_arms(args.arms, args.gpt_fast)
    if args.gpt_fast is not None and not Path(args.gpt_fast).expanduser().is_dir():
        raise ValueError(f"--gpt-fast {args.gpt_fast}: no such folder")
    rows = max(64, *(s.batch for s in shapes), *(b for b, _ in ttft))
    # Whole prompts, as HF's and gpt-fast's generate prefill them: in a call of 257 tokens, no
    # request decodes beside another's prompt chunks, so the difference with the 1-token call is
    # decode steps alone, and TTFT is one varlen forward against HF's one forward.
    compile = {"default": None, "on": True, "off": False}[args.compile]
    if args.eager_beside and args.compile != "on":
        raise ValueError("--eager-beside: needs --compile on (the nanolab arm is then the compiled step)")
    # Prefix caching off: TTFT repeats one prompt, and HF's generate keeps nothing between calls.
    engine_args = dict(device=args.device, dtype=args.dtype, max_num_seqs=rows, enable_chunked_prefill=False,
                       enable_prefix_caching=False)
    llm = LLM(args.model, compile=compile, **engine_args)
    check_context(shapes, ttft, steps, llm.engine.max_model_len)
    extra = []
    if args.eager_beside:
        eager = LLM(args.model, compile=False, enforce_eager=True, **engine_args)
        extra.append(Arm("nanolab-eager", nanolab_label(eager), lambda prompts: nanolab_generate(eager, prompts)))
    label = run_label(llm.device, args.model, llm.dtype, weights=llm.weights_kind)

    saved = [load_table(stem, label.device_slug) for stem in STEMS]
    previous = FloorBench(*saved) if args.append and all(t is not None for t in saved) else None
    if args.append and previous is None:
        print(f"--append: no complete set of {', '.join(STEMS)} tables for {label.device_slug} yet; writing new ones")

    def save(bench: FloorBench) -> tuple[FloorBench, list]:
        bench = labelled(bench, label)
        if previous is not None:
            bench = merge_tables(bench, previous)
        return bench, [save_table(table, stem, label) for stem, table in bench.tables().items()]

    bench = run_floorbench(llm, shapes, steps=steps, repeats=repeats, warmup=warmup, arms=arms,
                           gpt_fast=args.gpt_fast, ttft_cases=ttft, extra_arms=extra, on_row=save)
    bench, paths = save(bench)
    fmt = {"float_format": lambda x: f"{x:.3f}", "index": False}
    print(bench.decode[["label", "batch", "context", "ms_per_step", "floor_ms", "x_floor", "target_ms",
                        "x_target", "nanolab_speedup", "graphs_compiled", "graphs_compiled_timed", "run",
                        "error"]].to_string(**fmt))
    print(bench.roofline[[c for c in bench.roofline if c in ROOFLINE_SHOWN or c.startswith("x_floor_")]]
          .to_string(**fmt))
    if len(bench.ttft):
        print(bench.ttft[["label", "batch", "prompt_len", "ttft_ms", "nanolab_speedup", "error"]].to_string(**fmt))
    if "gpt-fast" not in arms:
        print("gpt-fast: not run (no --gpt-fast PATH)")
    print("\n".join(ratio_lines(bench)))
    if llm.device.type != "cuda" and (line := cpu_target_line(bench)):
        print(line)
    print(label.caption())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
