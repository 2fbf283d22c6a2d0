"""Day 58's serving measurement: the real server over loopback, with CUDA graphs on and off.

For each arm (`serveprocess`: "graphs", "eager" = `--enforce-eager`, either optionally naming its
prefill, "-chunked" or "-whole", then optionally "+ngram" for a server that speculates, Day 65,
with `SpeculativeConfig` settings after colons, "+ngram:prompt_lookup_min=2")
this starts `python -m nanolab serve` with a step log, sends a seeded Poisson stream of streamed
completions at each rate from its own aiohttp client (`workload`, `loadclient`), and reduces the
timings with `vllm bench serve`'s definitions (`servingmetrics`).

Rates are the seed's 1, 2, 4 and 8 requests/s, then doubled until the server saturates (the rate
at which it takes requests in falls below 0.9x the offered rate, `sustained_rates`) or `max_rate`.
The server's step log, sliced by each rate's window, shows row compaction: the live rows of every
step, the bucket that ran them, and the padding share (`compaction`). After the servers, the same
model is loaded in-process (`LLM`, graphs as in the arm) and decode steps are timed at the batch
each rate ran at (`offlinesteps`), so the chapter can say what the server adds to a step.

    python -m nanolab graphbench --device cuda --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from nanolab.config import resolve_device, resolve_dtype
from nanolab.lab.cliargs import float_list, int_pair_arg, positive_float, positive_int
from nanolab.lab.compaction import (
    capture_batch_sizes,
    check_compaction,
    read_step_log,
    slice_steps,
    step_columns,
    step_summary,
)
from nanolab.lab.loadclient import run_plan
from nanolab.lab.offlinesteps import time_offline
from nanolab.lab.plots.serving import plot_graphbench, plot_row_compaction
from nanolab.lab.report import run_label, save_figure, save_table
from nanolab.lab.serveprocess import (
    ARMS,
    DEFAULT_ARMS,
    GRAPHED,
    SERVER_TOKEN_BUDGET,
    ServeProcess,
    free_port,
    serve_command,
    split_arm,
    split_speculation,
)
from nanolab.lab.servingmetrics import SLO, SLOS, check_requests, itl_quantiles, median_interval, serving_metrics
from nanolab.lab.workload import SEED_RATES, WORKLOADS, Workload, rate_schedule, request_plan
from nanolab.model.config import ModelConfig
from nanolab.model.weights import resolve_weights, weights_kind

# The server's startup lines (`api_server.build_engine`), as this parses them.
_BUILT = re.compile(r"engine built in ([\d.]+) s")
_CAPTURED = re.compile(r"captured (\d+) (decode|varlen) graphs in ([\d.]+) s; .*? holds ([\d.]+) MiB")
_WARMED = re.compile(r"warmed up on (\d+) requests in (\d+) steps, ([\d.]+) s")


def startup_columns(log_text: str) -> dict:
    """What the server's log says its start cost: the engine's build (weights, pool, capture) in
    seconds, each graph kind's count, capture seconds and pool MiB, and the warm-up's requests and
    seconds. A part the log does not mention is absent (no graphs, a CPU's skipped warm-up)."""
    out = {}
    if m := _BUILT.search(log_text):
        out["engine_build_s"] = float(m[1])
    for count, kind, seconds, mib in _CAPTURED.findall(log_text):
        out.update({f"{kind}_graphs": int(count), f"{kind}_capture_s": float(seconds), f"{kind}_pool_mib": float(mib)})
    if m := _WARMED.search(log_text):
        out.update(warm_up_requests=int(m[1]), warm_up_s=float(m[3]))
    return out


# Speculative decoding's counters on `/metrics` (vLLM's names, `vllm:` made `nanolab:`), by column.
SPEC_COUNTERS = {"verify_steps": "nanolab:spec_decode_num_drafts_total",
                 "draft_tokens": "nanolab:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "nanolab:spec_decode_num_accepted_tokens_total"}


def spec_columns(before: dict[str, float], after: dict[str, float] | None) -> dict[str, float]:
    """What a rate's window moved the server's speculative counters by (two `/metrics` scrapes), and
    the acceptance rate (drafts kept over drafts proposed); NaN where the server lacks them."""
    nan = float("nan")
    cols = {col: after[name] - before[name] if after and name in after and name in before else nan
            for col, name in SPEC_COUNTERS.items()}
    cols["acceptance_rate"] = cols["accepted_tokens"] / cols["draft_tokens"] if cols["draft_tokens"] else nan
    return cols


def startup_table(bench_log: str) -> pd.DataFrame:
    """One row per server a graphbench log started: its arm, seconds to ready, `--cudagraph-mode`
    and `--max-num-batched-tokens` as given (None: the default), and `startup_columns` of the
    startup lines the bench logged for it."""
    rows = []
    for line in bench_log.splitlines():
        if m := re.match(r"(\S+): server ready in ([\d.]+) s \((.*)\)$", line):
            argv = m[3].split()
            flag = {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}
            rows.append({"arm": m[1], "ready_s": float(m[2]), "cudagraph_mode": flag.get("--cudagraph-mode"),
                         "token_budget": flag.get("--max-num-batched-tokens")})
        elif rows and line.startswith(f"{rows[-1]['arm']}: "):
            rows[-1].update(startup_columns(line))
    return pd.DataFrame(rows)


@dataclass
class ArmRun:
    arm: str
    rates: list[dict] = field(default_factory=list)  # one serving_metrics row per rate, then its step columns
    windows: dict[float, tuple[float, float]] = field(default_factory=dict)
    steps: pd.DataFrame | None = None  # the step log inside the windows
    itl: list[pd.DataFrame] = field(default_factory=list)  # each rate's ITL quantiles
    server_exit: int | None = None
    ready_s: float | None = None
    startup: dict = field(default_factory=dict)  # `startup_columns` of the server's log


def arm_command(arm: str, model: str, port: int, device: str, step_log: Path, *, dtype: str = "auto",
                read: str = "auto", max_num_seqs: int = 64, max_model_len: int | None = None, max_waiting: int = 1024,
                max_num_batched_tokens: int | None = None, command: Callable[..., list[str]] = serve_command
                ) -> list[str]:
    """The argv of `arm`'s server (`serve_command`'s signature; tests pass a stand-in's)."""
    mode, prefill = split_arm(arm)
    extra = {} if prefill is None else {"chunked_prefill": prefill != "whole"}
    if max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = max_num_batched_tokens
    if mode in GRAPHED:  # named, not left to the server's default
        extra["cudagraph_mode"] = "full" if mode == "fullgraphs" else "full_decode_only"
    speculative_config = split_speculation(arm)[1]
    if speculative_config is not None:
        extra["speculative_config"] = speculative_config
    return command(model, port, device=device, eager=mode == "eager", step_log=step_log, dtype=dtype, read=read,
                   max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_waiting=max_waiting, **extra)


@contextmanager
def started_arm(arm: str, model: str, device: str, vocab_size: int, workload: Workload, out: ArmRun, *,
                warmup: int, seed: int, workdir: Path, start_timeout_s: float, log: Callable[[str], None],
                **server) -> Iterator[tuple[ServeProcess, str]]:
    """`arm`'s server (`arm_command`, `server` its keywords; its step log at
    workdir/steps_<arm>.jsonl), started, healthy and warmed up by `warmup` requests inside the
    block: (the server, the model id it serves). Its start's seconds and log lines are recorded in
    `out`; after the block it is stopped, and a nonzero exit is logged with its log's end."""
    port = free_port()
    (workdir / f"steps_{arm}.jsonl").unlink(missing_ok=True)  # an earlier round's: the server writes a new one
    argv = arm_command(arm, model, port, device, workdir / f"steps_{arm}.jsonl",
                       max_waiting=max(1024, workload.max_requests + warmup), **server)
    with ServeProcess(argv, port, workdir / f"server_{arm}.log", start_timeout_s) as proc:
        out.ready_s = proc.ready_s
        log(f"{arm}: server ready in {proc.ready_s:.1f} s ({' '.join(argv[1:])})")
        text = proc.log.read_text(errors="replace")
        out.startup = startup_columns(text)
        for line in text.splitlines():  # the lines `startup_columns` reads, as `startup_table` reads them back
            if _BUILT.search(line) or _WARMED.search(line):
                log(f"{arm}: {line.split('nanolab: ', 1)[-1]}")
        served = proc.model_id()
        warm_up(proc, served, warmup, vocab_size, workload, seed)
        yield proc, served
    out.server_exit = proc.exit_code
    if proc.exit_code != 0:
        log(f"{arm}: the server exited with {proc.exit_code} on SIGTERM; the end of its log:\n{proc.tail()}")


def warm_up(server: ServeProcess, served: str, requests: int, vocab_size: int, workload: Workload, seed: int) -> None:
    """`requests` requests sent at once, outside every window, so first-use costs fall outside them."""
    if requests:
        plan = [replace(r, arrival_s=0.0) for r in request_plan(1000.0, requests, vocab_size, workload, seed)]
        run_plan(server.url, served, plan)


def send_rate(server: ServeProcess, served: str, arm: str, rate: float, vocab_size: int, workload: Workload,
              slo: SLO, seed: int, log: Callable[[str], None]) -> tuple[dict, pd.DataFrame, tuple[float, float]]:
    """One seeded Poisson stream at `rate` through `server`: `serving_metrics` (with speculation's
    counters for a speculating arm), the ITL quantiles, and the window it ran in."""
    plan = request_plan(rate, workload.requests_at(rate), vocab_size, workload, seed)
    speculating = split_speculation(arm)[1] is not None
    before = server.metrics() if speculating else None
    run = run_plan(server.url, served, plan)
    server.check_alive()
    m = {"arm": arm, "prefill": split_arm(arm)[1] or "default", "rate": rate, **serving_metrics(run, slo)}
    if before is not None:
        m.update(spec_columns(before, server.metrics()))
        log(f"{arm:>6} {rate:5g} req/s: {m['verify_steps']:.0f} verify steps kept {m['accepted_tokens']:.0f} "
            f"of {m['draft_tokens']:.0f} drafts ({m['acceptance_rate']:.2f})")
    log(f"{arm:>6} {rate:5g} req/s: {m['completed']}/{m['requests']} in {m['duration_s']:.1f} s, "
        f"ITL p50 {m['itl_p50_ms']:.2f} ms p99 {m['itl_p99_ms']:.2f} ms, TTFT p50 {m['ttft_p50_ms']:.0f} ms, "
        f"{m['output_throughput']:.0f} tok/s, sustained {m['sustained_req_s']:.2f} of "
        f"{m['offered_req_s']:.2f} req/s offered{'  SATURATED' if m['saturated'] else ''}")
    return m, itl_quantiles(run).assign(arm=arm, rate=rate), run.window


def run_arm(arm: str, model: str, device: str, vocab_size: int, rates: Sequence[float], max_rate: float,
            workload: Workload, slo: SLO, *, seed: int = 0, dtype: str = "auto", read: str = "auto",
            max_num_seqs: int = 64, max_model_len: int | None = None, warmup: int = 8,
            max_num_batched_tokens: int | None = None, start_timeout_s: float = 600.0, workdir: Path | None = None,
            log: Callable[[str], None] = print, command: Callable[..., list[str]] = serve_command) -> ArmRun:
    """Serve `model` in one arm and send every rate of `rate_schedule(rates, max_rate)` until a rate
    beyond the listed ones saturates. `warmup` requests (all at once, outside every window) go
    first, so first-use costs fall outside the measured rates. `command` builds the server's argv
    (`serve_command`'s signature; tests start a stand-in)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="graphbench-"))
    out = ArmRun(arm)
    with started_arm(arm, model, device, vocab_size, workload, out, warmup=warmup, seed=seed, workdir=workdir,
                     start_timeout_s=start_timeout_s, log=log, dtype=dtype, read=read, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                     command=command) as (server, served):
        for rate in rate_schedule(rates, max_rate):
            m, itl, window = send_rate(server, served, arm, rate, vocab_size, workload, slo, seed, log)
            out.rates.append(m)
            out.itl.append(itl)
            out.windows[rate] = window
            if m["saturated"] and rate >= max(rates):
                break
    out.steps = slice_steps(read_step_log(workdir / f"steps_{arm}.jsonl"), out.windows).assign(arm=arm)
    mode = split_arm(arm)[0]
    graphed = mode in GRAPHED and device.startswith("cuda")
    for m in out.rates:
        m.update(step_columns(out.steps[out.steps.rate == m["rate"]], graphed, capture_batch_sizes(max_num_seqs)),
                 server_exit=out.server_exit, server_ready_s=out.ready_s, **out.startup)
    return out


def run_rounds(arms: Sequence[str], model: str, device: str, vocab_size: int, rates: Sequence[float], rounds: int,
               workload: Workload, slo: SLO, *, seed: int = 0, dtype: str = "auto", read: str = "auto",
               max_num_seqs: int = 64, max_model_len: int | None = None, warmup: int = 8,
               max_num_batched_tokens: int | None = None, start_timeout_s: float = 600.0,
               workdir: Path | None = None, log: Callable[[str], None] = print,
               command: Callable[..., list[str]] = serve_command) -> pd.DataFrame:
    """Every arm's server up at once (started one after another, each warmed up), then `rounds`
    rounds at each rate: round r sends the Poisson stream seeded seed + r to every arm in turn,
    the arms' order turned by r places (AB, BA, ... for two arms; ABC, BCA, CAB, ... for three),
    so that over any n rounds of n arms each arm takes each place once (a count of rounds that
    is not a multiple of n leaves the places uneven, and is logged), drift over the run falls on
    each arm alike, and each round pairs the arms on one stream. With three arms or more, an arm
    that is not first always follows the same arm (C after B), so what one arm leaves the next is
    not balanced. A server waits
    idle while another is measured. One row per (round, rate, arm): `send_rate`'s metrics, the
    round, the arm's place in its round, and its server's exit code on SIGTERM."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: must be a positive int")
    if arms and rounds % len(arms):
        log(f"{rounds} rounds of {len(arms)} arms: the arms take each place evenly only over a multiple of "
            f"{len(arms)} rounds")
    workdir = Path(workdir or tempfile.mkdtemp(prefix="graphbench-"))
    rows, runs = [], {arm: ArmRun(arm) for arm in arms}
    with ExitStack() as stack:
        servers = {arm: stack.enter_context(started_arm(
            arm, model, device, vocab_size, workload, runs[arm], warmup=warmup, seed=seed, workdir=workdir,
            start_timeout_s=start_timeout_s, log=log, dtype=dtype, read=read, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, command=command))
            for arm in arms}
        for r in range(rounds):
            order = [*arms[r % len(arms):], *arms[:r % len(arms)]]
            for rate in rates:
                for place, arm in enumerate(order):
                    server, served = servers[arm]
                    m, _, _ = send_rate(server, served, arm, rate, vocab_size, workload, slo, seed + r, log)
                    rows.append({"round": r, "place": place, **m})
    table = pd.DataFrame(rows)
    return table.assign(server_exit=table.arm.map({arm: run.server_exit for arm, run in runs.items()}))


def round_ratios(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per speculating arm ("+ngram") and rate, its ITL p50 and TPOT p50 over its plain arm's in
    each round (the same stream), the median over rounds with a 95% bootstrap interval
    (`median_interval`), and the ITL aim (1 or less) met by the median."""
    records = []
    arms = set(rounds.arm)
    for arm in sorted(arms):
        base, speculation = split_speculation(arm)
        if speculation is None or base not in arms:
            continue
        for rate in sorted(set(rounds.rate)):
            on = rounds[(rounds.arm == arm) & (rounds.rate == rate)].set_index("round")
            off = rounds[(rounds.arm == base) & (rounds.rate == rate)].set_index("round")
            for metric in ("itl_p50_ms", "tpot_p50_ms"):
                per_round = (on[metric] / off[metric]).dropna()
                value = float(per_round.median())
                lo, hi = median_interval(per_round)
                aim = "<= 1" if metric == "itl_p50_ms" else "-"
                records.append({"ratio": f"speculating / plain {metric.split('_')[0].upper()} p50", "arm": arm,
                                "rate": rate, "rounds": len(per_round), "value": value, "lo": lo, "hi": hi,
                                "aim": aim, "met": value <= 1 if aim != "-" else None,
                                "detail": "per round " + ", ".join(f"{x:.3f}" for x in per_round)})
    return pd.DataFrame(records, columns=["ratio", "arm", "rate", "rounds", "value", "lo", "hi", "aim", "met",
                                          "detail"])


@dataclass(frozen=True)
class GraphBench:
    rates: pd.DataFrame  # one row per (arm, rate): serving_metrics, compaction and the step batch
    steps: pd.DataFrame  # step_summary of every window
    trace: pd.DataFrame  # one window's steps per arm, step by step: the compaction figure's data
    offline: pd.DataFrame  # arm, batch, context, steps, ms_p50, ms_mean: decode steps in-process
    itl: pd.DataFrame | None = None  # arm, rate, quantile, itl_ms: each rate's ITL distribution

    def tables(self, prefix: str = "day58") -> dict[str, pd.DataFrame]:
        """The tables by the names they are saved under."""
        return dict(zip(graphbench_stems(prefix), (self.rates, self.steps, self.trace, self.offline), strict=True))


def graphbench_stems(prefix: str = "day58") -> tuple[str, ...]:
    """The names `GraphBench.tables` saves under, in its order."""
    return tuple(f"{prefix}_{name}" for name in ("graphbench", "steps", "trace", "offline"))


def trace_window(arm: ArmRun, max_steps: int) -> pd.DataFrame:
    """The steps of the arm's busiest sustainable rate (the most decode rows at the median), its
    last `max_steps`: the batch at load, then draining as requests finish at their own lengths."""
    rates = pd.DataFrame(arm.rates)
    ok = rates[~rates.saturated] if (~rates.saturated).any() else rates
    rate = float(ok.loc[ok.median_rows.fillna(0).idxmax(), "rate"])
    part = arm.steps[arm.steps.rate == rate]
    return part.tail(max_steps).reset_index(drop=True)


def run_graphbench(model: str, device: str, arms: Sequence[str] = DEFAULT_ARMS, rates: Sequence[float] = SEED_RATES,
                   max_rate: float = 256.0, workload: Workload | None = None, slo: SLO | None = None, *,
                   seed: int = 0, dtype: str = "auto", read: str = "auto", max_num_seqs: int = 64,
                   max_model_len: int | None = None, warmup: int = 8, offline: bool = True,
                   max_num_batched_tokens: int | None = None,
                   offline_steps: int = 32, offline_repeats: int = 3, trace_steps: int = 800,
                   start_timeout_s: float = 600.0, log: Callable[[str], None] = print) -> GraphBench:
    """Both arms through the real server, then the offline step at each rate's batch. `workload`
    and `slo` default to the device's (`WORKLOADS`, `SLOS`); `max_num_batched_tokens`, every
    server's token budget a step (None: the server's default, `SERVER_TOKEN_BUDGET`)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if max_num_batched_tokens is not None and (isinstance(max_num_batched_tokens, bool)
                                               or not isinstance(max_num_batched_tokens, int)
                                               or max_num_batched_tokens < 1):
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r}: must be a positive int")
    modes = [split_arm(arm)[0] for arm in arms]  # an unknown arm fails here, before any server starts
    if kind == "cpu" and set(modes) & set(GRAPHED):
        raise ValueError("a CPU has no CUDA graphs: run the eager arm alone (arms=('eager',))")
    workload, slo = workload or WORKLOADS[kind], slo or SLOS[kind]
    vocab = ModelConfig.from_dir(resolve_weights(model)).vocab_size  # prepared here, once, outside any server start
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="graphbench-") as workdir:
        for arm in arms:
            runs.append(run_arm(arm, model, device, vocab, rates, max_rate, workload, slo, seed=seed, dtype=dtype,
                                read=read, max_num_seqs=max_num_seqs, max_model_len=max_model_len, warmup=warmup,
                                max_num_batched_tokens=max_num_batched_tokens, start_timeout_s=start_timeout_s,
                                workdir=Path(workdir), log=log))
    rows = [m for run in runs for m in run.rates]
    table = pd.DataFrame(rows)
    context = int(sum(workload.prompt_len) / 2 + workload.mean_output / 2)
    table = table.assign(prompt_lo=workload.prompt_len[0], prompt_hi=workload.prompt_len[1],
                         output_lo=workload.output_len[0], output_hi=workload.output_len[1],
                         slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms, slo_e2el_ms=slo.e2el_ms, seed=seed,
                         max_num_seqs=max_num_seqs, offline_context=context)
    # a chunked arm's tokens a step; a whole-prompt arm's cap on the prompts one step admits
    table["token_budget"] = max_num_batched_tokens or SERVER_TOKEN_BUDGET
    offline_tables = []
    if offline:
        for arm in arms:
            batches = table[table.arm == arm].step_batch.dropna().astype(int).unique()
            batches = [b for b in batches if b >= 1]
            if batches and split_speculation(arm)[1] is None:  # a speculating arm's plain decode step is its base's
                log(f"{arm}: timing decode steps in-process at batch {', '.join(map(str, sorted(batches)))}")
                offline_tables.append(time_offline(model, device, arm, batches, context, dtype=dtype, read=read,
                                                   max_num_seqs=max_num_seqs, steps=offline_steps,
                                                   repeats=offline_repeats, vocab_size=vocab))
    off = pd.concat(offline_tables, ignore_index=True) if offline_tables else pd.DataFrame(
        columns=["arm", "batch", "context", "steps", "ms_p50", "ms_mean"])
    log(f"graphbench: {time.monotonic() - started:.0f} s in all")
    all_steps = pd.concat([run.steps for run in runs], ignore_index=True)
    trace = pd.concat([trace_window(run, trace_steps) for run in runs], ignore_index=True)
    trace = trace[["arm", "rate", "t_s", "phase", "rows", "batch", "graph", "tokens", "ms", "padding_share"]]
    itl = pd.concat([q for run in runs for q in run.itl], ignore_index=True)
    return GraphBench(table, step_summary(all_steps), trace, off, itl[["arm", "rate", "quantile", "itl_ms", "gaps"]])


def graphbench_ratios(rates: pd.DataFrame, offline: pd.DataFrame, seed_rates: Sequence[float] = SEED_RATES
                      ) -> pd.DataFrame:
    """The chapter's three ratios, each with its aim, whether it is met, and the numbers behind it:

    - at each seed rate, eager ITL p50 over graphs ITL p50 (aim: 3x or more);
    - per arm and rate, ITL p50 over the offline median step at the same batch, minus 1: what the
      server adds (aim: 10% or less). The detail splits it at the server's own median step (the
      step log's): the engine step inside the server, then the path from step to client;
    - per arm, ITL p99 over p50 at its highest sustainable rate (aim: 3x or less);
    - at each rate both ran, ITL p99 of an arm's whole-prompt server over its chunked one (aim:
      above 1, chunking shortens the tail);
    - at each rate both ran, a speculating arm's ("+ngram") ITL p50 over its plain arm's (aim: 1 or
      less), TPOT p50 beside it in the detail."""
    records = []
    by = rates.set_index(["arm", "rate"])
    arms = rates.arm.unique()
    if {"graphs", "eager"} <= set(arms):
        for rate in seed_rates:
            if ("graphs", rate) in by.index and ("eager", rate) in by.index:
                eager, graphs = by.loc[("eager", rate), "itl_p50_ms"], by.loc[("graphs", rate), "itl_p50_ms"]
                records.append({"ratio": "eager / graphs ITL p50", "arm": "both", "rate": rate,
                                "value": eager / graphs, "aim": ">= 3", "met": eager / graphs >= 3,
                                "detail": f"ITL p50 {eager:.2f} ms eager, {graphs:.2f} ms graphs"})
    for arm in arms:  # a speculating arm against the same server without it
        base, speculation = split_speculation(arm)
        if speculation is None or base not in set(arms):
            continue
        for rate in sorted(set(rates[rates.arm == arm].rate) & set(rates[rates.arm == base].rate)):
            on, off_ms = by.loc[(arm, rate), "itl_p50_ms"], by.loc[(base, rate), "itl_p50_ms"]
            records.append({"ratio": "speculating / plain ITL p50", "arm": arm, "rate": rate, "value": on / off_ms,
                            "aim": "<= 1", "met": on / off_ms <= 1,
                            "detail": f"ITL p50 {on:.2f} ms speculating, {off_ms:.2f} ms plain (a verify step's "
                                      "tokens reach the client together, so their gaps are short); TPOT p50 "
                                      f"{by.loc[(arm, rate), 'tpot_p50_ms']:.2f} ms speculating, "
                                      f"{by.loc[(base, rate), 'tpot_p50_ms']:.2f} ms plain"})
    off = offline.set_index(["arm", "batch"]).ms_p50 if len(offline) else pd.Series(dtype=float)
    for (arm, rate), row in by.iterrows():
        if row.step_batch == row.step_batch and (arm, int(row.step_batch)) in off.index:
            step = off[arm, int(row.step_batch)]
            value = row.itl_p50_ms / step - 1
            detail = f"ITL p50 {row.itl_p50_ms:.2f} ms, offline step {step:.2f} ms"
            if "server_step_p50_ms" in row and row.server_step_p50_ms == row.server_step_p50_ms:
                detail += (f"; the server's step {row.server_step_p50_ms:.2f} ms "
                           f"({row.server_step_p50_ms / step - 1:+.0%} on offline, ITL "
                           f"{row.itl_p50_ms / row.server_step_p50_ms - 1:+.0%} on it)")
            records.append({"ratio": f"ITL p50 / offline step at batch {int(row.step_batch)} - 1", "arm": arm,
                            "rate": rate, "value": value, "aim": "<= 0.10", "met": value <= 0.10, "detail": detail})
    for arm in arms:
        part = rates[(rates.arm == arm) & ~rates.saturated.astype(bool)]
        if len(part):
            row = part.loc[part.rate.idxmax()]
            value = row.itl_p99_ms / row.itl_p50_ms
            detail = f"ITL p99 {row.itl_p99_ms:.2f} ms, p50 {row.itl_p50_ms:.2f} ms"
            prefill_ms = row.get("prefill_p50_ms", float("nan"))
            if prefill_ms == prefill_ms:  # the tail's usual cause: decode steps that waited behind a prefill
                detail += (f"; {int(row.prefill_steps)} prefill steps among {int(row.decode_steps)} decode steps, "
                           f"{prefill_ms:.2f} ms at the median")
            mixed_ms = row.get("mixed_p50_ms", float("nan"))
            if mixed_ms == mixed_ms:
                detail += f"; {int(row.mixed_steps)} mixed steps, {mixed_ms:.2f} ms at the median"
            records.append({"ratio": "ITL p99 / p50 at the highest sustainable rate", "arm": arm, "rate": row.rate,
                            "value": value, "aim": "<= 3", "met": value <= 3, "detail": detail})
    for mode in ARMS:
        for rate in rates.rate.unique():
            whole, chunked = (f"{mode}-whole", rate), (f"{mode}-chunked", rate)
            if whole in by.index and chunked in by.index:
                w, c = by.loc[whole, "itl_p99_ms"], by.loc[chunked, "itl_p99_ms"]
                records.append({"ratio": "whole / chunked ITL p99", "arm": mode, "rate": rate, "value": w / c,
                                "aim": "> 1", "met": w / c > 1,
                                "detail": f"ITL p99 {w:.2f} ms whole prompts, {c:.2f} ms chunked"})
    return pd.DataFrame(records, columns=["ratio", "arm", "rate", "value", "aim", "met", "detail"])


# The command line.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda, cpu = WORKLOADS["cuda"], WORKLOADS["cpu"]
    per_device = lambda f: f"(default: {f(cuda)} on CUDA, {f(cpu)} on a CPU)"
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument("--read", default="auto", help="the decode read: auto, streamed or reference")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arms: graphs (the server's CUDA graphs), fullgraphs "
                             "(--cudagraph-mode full), eager (--enforce-eager), each optionally "
                             "ending in -chunked or -whole to serve with or without chunked prefill, then "
                             "optionally in +ngram to speculate, with SpeculativeConfig settings after colons, e.g. "
                             "graphs-chunked,graphs-whole or fullgraphs,fullgraphs+ngram:prompt_lookup_min=2 "
                             "(default: graphs,eager on CUDA, eager on a CPU)")
    parser.add_argument("--rates", default="1,2,4,8", help="requests/s always run, in order (default: the seed's)")
    parser.add_argument("--max-rate", type=float, default=256.0,
                        help="after --rates, the rate doubles until it saturates or passes this (default: 256)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of arrivals a rate " + per_device(lambda w: w.duration_s))
    parser.add_argument("--min-requests", type=int, default=None,
                        help="requests at least, a rate " + per_device(lambda w: w.min_requests))
    parser.add_argument("--max-requests", type=int, default=None,
                        help="requests at most, a rate " + per_device(lambda w: w.max_requests))
    parser.add_argument("--prompt-len", type=int_pair_arg, default=None,
                        help="lo,hi: prompt tokens, uniform " + per_device(lambda w: ",".join(map(str, w.prompt_len))))
    parser.add_argument("--output-len", type=int_pair_arg, default=None,
                        help="lo,hi: new tokens, uniform " + per_device(lambda w: ",".join(map(str, w.output_len))))
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput's TTFT level; giving any --slo-* replaces the device's SLO "
                             f"(default: {SLOS['cuda'].ttft_ms:g} on CUDA, {SLOS['cpu'].ttft_ms:g} on a CPU)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help=f"goodput's TPOT level (default: {SLOS['cuda'].tpot_ms:g} on CUDA, "
                             f"{SLOS['cpu'].tpot_ms:g} on a CPU)")
    parser.add_argument("--slo-e2el-ms", type=float, default=None, help="goodput's end-to-end level (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompt ids")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the server's running-request limit")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="every server's token budget a step: chunks with chunked prefill, whole prompts "
                             "without (default: the server's)")
    parser.add_argument("--warmup", type=int, default=8, help="requests sent at once before the first rate")
    parser.add_argument("--offline-steps", type=int, default=32, help="decode steps timed in-process per batch")
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--no-offline", action="store_true",
                        help="skip the in-process step timing (and so the server-overhead ratio)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--rounds", type=int, default=0,
                        help="instead of each arm's rate sweep: every arm's server up at once, and this many rounds "
                             "at each of --rates, the arms taking turns on one stream a round (AB, BA, ...); "
                             "writes data/<prefix>_rounds_<device>.csv (default: 0, the sweep)")
    parser.add_argument("--prefix", default="day58", help="tables go to data/<prefix>_graphbench_<device>.csv, ...")


def main(args: argparse.Namespace) -> int:
    try:
        device = str(resolve_device(args.device))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = "cuda" if device.startswith("cuda") else "cpu"
    arms = tuple(args.arms.split(",")) if args.arms else (DEFAULT_ARMS if kind == "cuda" else ("eager",))
    base = WORKLOADS[kind]
    given = (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms)
    try:
        rates, max_rate = float_list(args.rates, "--rates"), positive_float(args.max_rate, "--max-rate")
        # The server's flags too, so a bad one is refused before weights are made and a server started.
        positive_int(args.max_num_seqs, "--max-num-seqs")
        for value, flag in ((args.max_model_len, "--max-model-len"),
                            (args.max_num_batched_tokens, "--max-num-batched-tokens")):
            if value is not None:
                positive_int(value, flag)
        positive_int(args.warmup, "--warmup", minimum=0)
        positive_int(args.offline_steps, "--offline-steps")
        positive_int(args.offline_repeats, "--offline-repeats")
        positive_int(args.rounds, "--rounds", minimum=0)
        positive_int(args.seed, "--seed", minimum=0)
        positive_float(args.start_timeout, "--start-timeout")
        if args.arms is not None and not all(a.strip() for a in args.arms.split(",")):
            raise ValueError(f"--arms: {args.arms!r} has an empty entry")
        if len(set(arms)) != len(arms):
            raise ValueError(f"--arms: {args.arms!r} names an arm twice")
        workload = Workload(
            args.prompt_len or base.prompt_len, args.output_len or base.output_len,
            base.duration_s if args.duration is None else positive_float(args.duration, "--duration"),
            base.min_requests if args.min_requests is None else positive_int(args.min_requests, "--min-requests"),
            base.max_requests if args.max_requests is None else positive_int(args.max_requests, "--max-requests"))
        slo = SLO(*(None if v is None else positive_float(v, f) for v, f in zip(
            given, ("--slo-ttft-ms", "--slo-tpot-ms", "--slo-e2el-ms")))) if any(
            v is not None for v in given) else SLOS[kind]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.rounds:
        return main_rounds(args, device, arms, rates, workload, slo)
    try:
        bench = run_graphbench(args.model, device, arms, rates, max_rate,
                               workload, slo, seed=args.seed, dtype=args.dtype, read=args.read,
                               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, warmup=args.warmup,
                               offline_steps=args.offline_steps, offline_repeats=args.offline_repeats,
                               start_timeout_s=args.start_timeout, offline=not args.no_offline,
                               max_num_batched_tokens=args.max_num_batched_tokens)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = resolve_weights(args.model)
    label = run_label(torch.device(device), args.model, resolve_dtype(args.dtype, torch.device(device)),
                      weights=weights_kind(path))
    for name, table in bench.tables(args.prefix).items():
        print(f"{name}: {save_table(table, name, label)}")
    if bench.itl is not None and len(bench.itl):
        print(f"{args.prefix}_itl: {save_table(bench.itl, f'{args.prefix}_itl', label)}")
    cols = ["arm", "prefill", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tpot_p50_ms",
            "request_throughput", "output_throughput", "goodput", "median_rows", "step_batch", "saturated"]
    print(bench.rates[cols].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(bench.offline.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(graphbench_ratios(bench.rates, bench.offline).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(save_figure(plot_graphbench(bench.rates), f"{args.prefix}_graphbench", label))
    print(save_figure(plot_row_compaction(bench.trace, capture_batch_sizes(args.max_num_seqs)),
                      f"{args.prefix}_row_compaction", label))
    gates = [check_requests(bench.rates)]
    for arm in arms:
        expect = (split_arm(arm)[0] in GRAPHED) if kind == "cuda" else False
        gates.append(check_compaction(bench.steps[bench.steps.arm == arm], capture_batch_sizes(args.max_num_seqs),
                                      expect))
    print("\n".join(f"{g}" for g in gates))
    print(label.caption())
    return 0 if all(gates) else 1


def main_rounds(args: argparse.Namespace, device: str, arms: Sequence[str], rates: Sequence[float],
                workload: Workload, slo: SLO) -> int:
    """`--rounds`: `run_rounds`, its table saved and `round_ratios` printed."""
    path = resolve_weights(args.model)
    vocab = ModelConfig.from_dir(path).vocab_size
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="graphbench-") as workdir:
            table = run_rounds(arms, args.model, device, vocab, rates, args.rounds, workload, slo, seed=args.seed,
                               dtype=args.dtype, read=args.read, max_num_seqs=args.max_num_seqs,
                               max_model_len=args.max_model_len, warmup=args.warmup,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               start_timeout_s=args.start_timeout, workdir=Path(workdir))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"graphbench: {args.rounds} rounds in {time.monotonic() - started:.0f} s")
    label = run_label(torch.device(device), args.model, resolve_dtype(args.dtype, torch.device(device)),
                      weights=weights_kind(path))
    print(f"{args.prefix}_rounds: {save_table(table, f'{args.prefix}_rounds', label)}")
    cols = ["round", "place", "arm", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "ttft_p50_ms",
            "output_throughput"]
    print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(round_ratios(table).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    gate = check_requests(table)
    print(gate)
    print(label.caption())
    return 0 if gate else 1
