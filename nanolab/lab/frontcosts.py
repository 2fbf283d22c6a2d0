"""The host's work on a request before and after its one prompt step, stage by stage, at several
prompt lengths (Day 64b): what a warm prefix hit pays outside the GPU. Every stage runs in this
process, timed alone over prompts of random ids, so no pipe, socket or step is in the numbers: they
are the CPU work a stage does for each id, not the wake-ups between processes.

The stages, in the order a request meets them (`STAGES`); where the engine changed a stage, the
design it replaced is its own arm beside it (`arm` "before"), run from here:

- "encode": the client's `json.dumps` of the completion's body (the bench's client, an SDK's), which
  TTFT counts as `vllm bench serve` does;
- "parse": the server reading the body, with the standard `json` module (before) and `orjson` (now);
- "fields": `protocol.parse_request` over the parsed body;
- "check": `RequestLimits.check`, each id's type and range, packed to int64;
- "post": pickling the request for the core's pipe; the core unpickling it and listing its ids, and
  now keeping their bytes for its `Sequence` too;
- "lookup": `BlockManager.cached_prefix` over a prompt whose every full block is cached, from the
  ids packed again (before) and from the packed prompt the check made (now);
- "share": `share_prefix` of those blocks to a row, and the row's release.

`idle_costs` times what the stages leave out, after the host has idled for a gap: a round trip
through a pipe to a process blocked reading it (two wake-ups, as a request's post and its reply
make), and one pass of the engine's stages, each timed once, as a request meets them, not the
fastest of warm loops.

    python -m nanolab frontcosts
    python -m nanolab frontcosts --lengths 2048,4096 --prefix day64b
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import pickle
import random
import time
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler

import orjson
import pandas as pd
import torch

from nanolab.engine.block_manager import BlockManager
from nanolab.engine.llm_engine import RequestLimits
from nanolab.entrypoints.openai import protocol
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.report import RunLabel, run_label, save_table
from nanolab.sampling import SamplingParams

STAGES = ("encode", "parse", "fields", "check", "post", "lookup", "share")
IDLE_GAPS_MS = (0.0, 1.0, 10.0, 50.0)
BLOCK_SIZE = 16
VOCAB = 128_256  # Llama 3's, as prefixbench's prompts on the GPU


def _time_us(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """The fastest of `repeats` loops, each the mean µs of `inner` back-to-back calls, after one
    untimed call, with the garbage collector off while they run (as `timeit` times): what the stage
    costs when nothing else interrupts it."""
    fn()
    runs = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            runs.append((time.perf_counter() - start) / inner * 1e6)
    finally:
        if was_enabled:
            gc.enable()
    return min(runs)


def _unpack(message: tuple, keep_bytes: bool = True) -> tuple[list[int], bytes | None]:
    """What the core makes of a posted request's ids: their list and, now, their bytes."""
    ((_, packed, _),) = message[1]
    return packed.tolist(), packed.tobytes() if keep_bytes else None


def stage_calls(prompt_len: int, seed: int = 0) -> list[tuple[str, str, Callable[[], object]]]:
    """(stage, arm, call) for a prompt of `prompt_len` random ids: arm "before" for the design a
    stage replaced, "now" for the engine's, "both" where nothing changed."""
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    body = {"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    raw = json.dumps(body).encode()
    parsed = orjson.loads(raw)
    limits = RequestLimits(VOCAB, 1 << 20, 1 << 16, BLOCK_SIZE)
    packed = limits.check(ids, params)
    blocks = BlockManager(prompt_len // BLOCK_SIZE + 8, BLOCK_SIZE, 2, enable_prefix_caching=True)
    row = blocks.open_row()
    blocks.grow([row], [prompt_len])
    blocks.commit_full_blocks(row, ids)
    blocks.free_row(row)  # every full block cached, held by none: a warm hit finds them all
    prompt_bytes = packed.tobytes()
    found = blocks.cached_prefix(prompt_bytes)
    assert len(found[0]) == (prompt_len - 1) // BLOCK_SIZE, "the warm prompt's blocks are not all cached"
    assert found == blocks.cached_prefix(ids), "packed and listed ids found different prefixes"

    def share() -> None:
        r = blocks.open_row()
        blocks.share_prefix(r, *found)
        blocks.free_row(r)
        blocks._new.clear()  # the staged entries a step would have copied to the device

    return [
        ("encode", "both", lambda: json.dumps(body).encode()),
        ("parse", "before", lambda: json.loads(raw)),
        ("parse", "now", lambda: orjson.loads(raw)),
        ("fields", "both", lambda: protocol.parse_request(parsed, chat=False, model="m")),
        ("check", "both", lambda: limits.check(ids, params)),
        ("post", "before", lambda: _unpack(pickle.loads(ForkingPickler.dumps(("add", [(0, packed, params)]))),
                                           keep_bytes=False)),
        ("post", "now", lambda: _unpack(pickle.loads(ForkingPickler.dumps(("add", [(0, packed, params)]))))),
        ("lookup", "before", lambda: blocks.cached_prefix(ids)),
        ("lookup", "now", lambda: blocks.cached_prefix(prompt_bytes)),
        ("share", "both", share),
    ]


def front_costs(lengths: Sequence[int] = (512, 2048, 4096), repeats: int = 7, inner: int = 20,
                seed: int = 0) -> pd.DataFrame:
    """A row per (prompt length, stage, arm): the µs one request's stage takes (`_time_us`)."""
    rows = []
    for n in lengths:
        if n < 2 * BLOCK_SIZE:
            raise ValueError(f"lengths: {n} is shorter than two blocks of {BLOCK_SIZE}")
        for stage, arm, fn in stage_calls(n, seed):
            rows.append({"prompt_len": n, "stage": stage, "arm": arm, "us": _time_us(fn, repeats, inner)})
    return pd.DataFrame(rows)


def _echo(inbox, outbox, poll_s: float = 0.0) -> None:
    """The peer of `idle_costs`' round trips: read `inbox`, send each message straight back; None
    ends it. With `poll_s`, after each message it polls `inbox` without blocking for up to that
    many seconds (a core that spins while it waits) before it blocks reading."""
    while True:
        if poll_s:
            deadline = time.monotonic() + poll_s
            while not inbox.poll() and time.monotonic() < deadline:
                pass
        message = inbox.recv()
        if message is None:
            return
        outbox.send(message)


# How long the polling peer of `idle_costs(polling=True)` spins before it blocks: past every default gap.
POLL_S = 0.2


MAX_GAP_MS = 10_000.0  # an idle gap longer than this measures nothing the engine's requests see


def check_gaps(gaps_ms: Sequence[float], name: str = "gaps") -> list[float]:
    """`gaps_ms` as a list, each from 0 to `MAX_GAP_MS` ms (NaN refused); `name` in the error."""
    gaps = list(gaps_ms)
    if not gaps or not all(0 <= g <= MAX_GAP_MS for g in gaps):
        raise ValueError(f"{name}: {gaps} must be ms from 0 to {MAX_GAP_MS:,.0f}, at least one")
    return gaps


def idle_costs(gaps_ms: Sequence[float] = IDLE_GAPS_MS, samples: int = 40, prompt_len: int = 2048,
               seed: int = 0, timeout_s: float = 60.0, polling: bool = False) -> pd.DataFrame:
    """What the host's part of a request costs after it idled: for each gap, `samples` times
    each, sleep the gap, then time one, with the garbage collector off:

    - "pipe round trip": a small message to a process blocked reading its pipe (spawned once, idle
      in between like an engine core between requests), and its echo back;
    - with `polling`, "pipe round trip, peer polling": the same to a second process that polls its
      pipe for up to `POLL_S` after each message before it blocks, so through every gap here it is
      spinning, not asleep (a core that spins while it waits; the engine's core blocks). Timed
      last at each gap, and followed by `POLL_S` of sleep, so its spinning overlaps nothing else;
    - "stages": one pass of the engine's stages for `prompt_len` ids (`stage_calls`' "now" and
      "both" arms, the client's "encode" left out), in order.

    A row per (gap, what): the median and p90 µs. An echo process that dies, or does not answer
    within `timeout_s`, is an error, not a wait."""
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive int, got {samples!r}")
    gaps_ms = check_gaps(gaps_ms)
    if prompt_len < 2 * BLOCK_SIZE:
        raise ValueError(f"prompt_len: {prompt_len} is shorter than two blocks of {BLOCK_SIZE}")
    stages = [fn for stage, arm, fn in stage_calls(prompt_len, seed) if arm != "before" and stage != "encode"]
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold a CUDA context
    peers = {"pipe round trip": 0.0, **({"pipe round trip, peer polling": POLL_S} if polling else {})}
    ends = {}  # what -> (the peer, its two pipes: (peer's in, ours to it), (ours from it, peer's out))
    for what, poll_s in peers.items():
        (peer_in, to_peer), (from_peer, peer_out) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
        ends[what] = (ctx.Process(target=_echo, args=(peer_in, peer_out, poll_s), daemon=True),
                      (peer_in, to_peer), (from_peer, peer_out))

    def echo(what, message):
        _, (_, to_peer), (from_peer, _) = ends[what]
        to_peer.send(message)
        if not from_peer.poll(timeout_s):  # an EOF (the peer died) polls ready, and recv raises it
            raise RuntimeError(f"the echo process did not answer within {timeout_s:g} s")
        back = from_peer.recv()
        if back != message:
            raise RuntimeError(f"the echo process sent {back!r} back for {message!r}")

    rows = []
    was_enabled = gc.isenabled()
    try:
        for peer, (peer_in, _), (_, peer_out) in ends.values():
            peer.start()
            peer_in.close()  # the peer's ends: once it exits, a read here ends at EOF instead of waiting
            peer_out.close()
        for what in ends:
            echo(what, -1)  # each peer is up and echoing before anything is timed
        if polling:
            time.sleep(POLL_S)  # the polling peer asleep again before the first round trips
        gc.disable()

        def round_trips(what: str, gap: float) -> list[float]:
            trips = []
            for i in range(samples):
                time.sleep(gap / 1e3)
                start = time.perf_counter()
                echo(what, i)
                trips.append((time.perf_counter() - start) * 1e6)
            return trips

        for gap in gaps_ms:
            timed = {"pipe round trip": round_trips("pipe round trip", gap)}
            passes = timed["stages"] = []
            for _ in range(samples):
                time.sleep(gap / 1e3)
                start = time.perf_counter()
                for fn in stages:
                    fn()
                passes.append((time.perf_counter() - start) * 1e6)
            if polling:  # last, then asleep again before anything else is timed: its spinning takes a CPU
                timed["pipe round trip, peer polling"] = round_trips("pipe round trip, peer polling", gap)
                time.sleep(POLL_S)
            for what in [*ends, "stages"]:  # the round trips in `ends`' order, then the stages
                series = pd.Series(timed[what])
                rows.append({"gap_ms": gap, "what": what, "prompt_len": prompt_len if what == "stages" else 0,
                             "samples": samples, "us_p50": series.median(), "us_p90": series.quantile(0.9)})
    finally:
        if was_enabled:
            gc.enable()
        for peer, (peer_in, to_peer), (from_peer, peer_out) in ends.values():
            try:
                to_peer.send(None)
            except OSError:  # the peer is gone already (or never started)
                pass
            if peer.is_alive():
                peer.join(10)
            if peer.is_alive():
                peer.kill()
            for conn in (to_peer, from_peer, peer_in, peer_out):
                conn.close()
    return pd.DataFrame(rows)


def front_totals(costs: pd.DataFrame) -> pd.DataFrame:
    """Per prompt length, the stages summed for the engine before and now ("both" counts in each)."""
    out = {}
    for arm in ("before", "now"):
        part = costs[costs.arm.isin([arm, "both"])]
        out[arm] = part.groupby("prompt_len").us.sum()
    table = pd.DataFrame(out)
    table["saved_us"] = table.before - table.now
    return table.reset_index()


# The command line: `python -m nanolab frontcosts`.


def front_label() -> RunLabel:
    """The run label of a `front_costs` table. The stages are the host's, and the label names the
    machine they ran on: its GPU, where it has one."""
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return run_label(dev, "none (a request's host work; ids of Llama 3's vocabulary)", torch.int64,
                     weights="synthesized random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", default="512,2048,4096", help="prompt lengths in ids (default: 512,2048,4096)")
    parser.add_argument("--repeats", default="7", help="timed loops a stage, the fastest kept (default: 7)")
    parser.add_argument("--gaps", default=",".join(f"{g:g}" for g in IDLE_GAPS_MS),
                        help="idle gaps in ms before each timed round trip and pass (default: 0,1,10,50)")
    parser.add_argument("--parts", default="front,idle",
                        help="comma-separated: front (the stage table, minutes), idle (after idle gaps)")
    parser.add_argument("--polling", action="store_true",
                        help="idle also times a round trip to a peer that polls its pipe instead of sleeping")
    parser.add_argument("--prefix", default="day64b",
                        help="the tables go to data/<prefix>_front_<device>.csv and <prefix>_idle_<device>.csv")


def main(args: argparse.Namespace) -> int:
    lengths = int_list(args.lengths, "--lengths", minimum=2 * BLOCK_SIZE)
    try:
        gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        raise ValueError(f"--gaps: {args.gaps!r} must be comma-separated ms") from None
    gaps = check_gaps(gaps, "--gaps")  # before the stage table's minutes, not after
    parts = [p.strip() for p in getattr(args, "parts", "front,idle").split(",") if p.strip()]
    if not parts or set(parts) - {"front", "idle"}:
        raise ValueError(f"--parts: {args.parts!r} must name front, idle or both")
    repeats = positive_int(args.repeats, "--repeats")
    label, saved = front_label(), []
    if "front" in parts:
        costs = front_costs(lengths, repeats=repeats)
        saved.append(save_table(costs, f"{args.prefix}_front", label).name)
        print(costs.pivot_table(index=["stage", "arm"], columns="prompt_len", values="us", sort=False).round(1))
        print(front_totals(costs).round(1).to_string(index=False))
    if "idle" in parts:
        idle = idle_costs(gaps, polling=getattr(args, "polling", False))
        saved.append(save_table(idle, f"{args.prefix}_idle", label).name)
        print(idle.round(1).to_string(index=False))
    print(f"{', '.join(saved)}: {label}")
    return 0
