"""The server's step log (`serve --step-log`: one JSON line a step) and row compaction read from
it: each decode step runs at the smallest capture bucket holding its live rows. Day 58.

A step's record: t (time.monotonic()), phase ("prefill", "decode" or "mixed"), rows (live),
batch (what the forward ran at), graph (a replay), tokens, ms. Sliced by each rate's window of the
same clock, the log says what the server did while the client measured.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from nanolab.engine.buckets import DecodeBuckets
from nanolab.gates import Gate

STEP_COLUMNS = ["t", "phase", "rows", "batch", "graph", "tokens", "ms"]


def read_step_log(path: str | Path) -> pd.DataFrame:
    """The server's `--step-log`: one row a step (t, phase, rows, batch, graph, tokens, ms, and
    t0 where the log has it) and its padding share; no rows when the log was never written. Event
    lines (`read_step_events`) are left out."""
    lines = [line for line in _log_lines(path) if "event" not in line]
    steps = pd.DataFrame(lines, columns=STEP_COLUMNS + (["t0"] if lines and "t0" in lines[0] else []))
    steps["padding_share"] = (steps.batch - steps.rows) / steps.batch
    return steps


def read_step_events(path: str | Path, event: str = "add") -> pd.Series:
    """The monotonic times of the step log's `event` lines ("add": the core took a call's requests)."""
    return pd.Series([line["t"] for line in _log_lines(path) if line.get("event") == event], dtype=float)


def _log_lines(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def slice_steps(steps: pd.DataFrame, windows: dict[float, tuple[float, float]]) -> pd.DataFrame:
    """The steps that ended inside each rate's monotonic window, with `rate` and `t_s` (seconds
    from the window's start) added; steps outside every window (warm-up) are dropped."""
    parts = []
    for rate, (t0, t1) in windows.items():
        part = steps[(steps.t >= t0) & (steps.t <= t1)]
        parts.append(part.assign(rate=rate, t_s=part.t - t0))
    return pd.concat(parts, ignore_index=True) if parts else steps.iloc[:0].assign(rate=[], t_s=[])


def smallest_bucket(rows: int, batch_sizes: Sequence[int]) -> int | None:
    """The batch the engine pads `rows` live rows up to (`DecodeBuckets.lookup`), None past the list."""
    shape = DecodeBuckets(tuple(batch_sizes), None).lookup(rows, 0)
    return None if shape is None else shape[0]


def check_compaction(steps: pd.DataFrame, batch_sizes: Sequence[int], expect_graphs: bool | None = None) -> Gate:
    """Each decode step ran at the smallest capture bucket holding its fed tokens when a graph
    replayed, and unpadded (batch == tokens) otherwise: a batch row a token, so a plain decode
    step's live rows, a verify step's pending tokens and drafts (without a `tokens` column, the
    rows). `expect_graphs` True also asks that every decode step inside the list replayed a graph;
    False that none did. `steps` is a step log, or `step_summary`'s counts of one (its `steps`
    column weighs each row)."""
    decode = steps[steps.phase == "decode"]
    count = decode.steps if "steps" in decode.columns else pd.Series(1, index=decode.index)
    graphed = decode.graph.astype(bool)
    fed = _fed(decode)
    bucket = fed.map(lambda r: smallest_bucket(int(r), batch_sizes))
    expected = bucket.where(graphed, fed)
    off = decode.batch != expected
    inside = fed <= max(batch_sizes)
    wrong_mode = inside & (graphed != expect_graphs) if expect_graphs is not None else pd.Series(False, decode.index)
    total = int(count.sum())
    numbers = {"decode steps": total, "graphed": int(count[graphed].sum()), "off the smallest bucket":
               int(count[off].sum()), "graph on/off not as expected": int(count[wrong_mode].sum()),
               "padding share (mean)": round(float((decode.padding_share * count).sum() / total), 3) if total else None}
    if off.any():
        first = decode[off].iloc[0]
        numbers["first"] = f"{int(first.rows)} rows ({int(fed[off].iloc[0])} tokens) ran at {int(first.batch)}"
    return Gate("row compaction: a decode step runs at the smallest bucket holding its fed tokens",
                total > 0 and not off.any() and not wrong_mode.any(), numbers)


def _fed(steps: pd.DataFrame) -> pd.Series:
    """Each step's batch rows before padding: its fed tokens where the log gives them for a decode
    step, else its rows."""
    if "tokens" not in steps.columns:
        return steps.rows
    return steps.tokens.where((steps.phase == "decode") & steps.tokens.notna(), steps.rows).astype(int)


def weighted_median_rows(decode: pd.DataFrame) -> float:
    """The live rows of the decode step that produced the median token: a step of r rows streams
    r chunks, so each step counts r times, as the pooled ITL counts it."""
    if decode.empty:
        return float("nan")
    rows = np.sort(decode.rows.to_numpy())
    cum = np.cumsum(rows)
    return float(rows[np.searchsorted(cum, cum[-1] / 2)])


def step_summary(steps: pd.DataFrame) -> pd.DataFrame:
    """Steps counted by (arm, rate, phase, rows, batch, graph) and, for a decode step, its fed
    tokens (a verify step feeds more than its rows; other phases leave it empty), with their median
    ms: the compaction table of a whole run in a few hundred rows."""
    keys = ["arm", "rate", "phase", "rows", "batch", "graph"]
    if "tokens" in steps.columns:
        steps = steps.assign(tokens=steps.tokens.where(steps.phase == "decode"))
        keys.append("tokens")
    out = steps.groupby(keys, as_index=False, dropna=False).agg(steps=("ms", "size"), ms_p50=("ms", "median"))
    out["padding_share"] = (out.batch - _fed(out)) / out.batch
    return out


def step_columns(window: pd.DataFrame, graphed: bool, batch_sizes: Sequence[int]) -> dict:
    """What the step log says about one rate's window: step counts, the token-weighted median live
    rows, the batch a step of that many rows runs at (its bucket when `graphed`), the server's own
    median decode, prefill and mixed (prompt chunks beside decode rows) step times, and the mean
    padding share of its decode steps."""
    nan = float("nan")
    decode, prefill = window[window.phase == "decode"], window[window.phase == "prefill"]
    mixed = window[window.phase == "mixed"]
    median = weighted_median_rows(decode)
    batch = nan
    if median == median:  # not NaN: the window has decode steps
        batch = smallest_bucket(int(median), batch_sizes) if graphed else int(median)
    return dict(decode_steps=len(decode), prefill_steps=len(prefill), median_rows=median, step_batch=batch,
                server_step_p50_ms=float(decode.ms.median()) if len(decode) else nan,
                prefill_p50_ms=float(prefill.ms.median()) if len(prefill) else nan,
                mixed_steps=len(mixed), mixed_p50_ms=float(mixed.ms.median()) if len(mixed) else nan,
                padding_share=float(decode.padding_share.mean()) if len(decode) else nan,
                graphed_share=float(decode.graph.astype(bool).mean()) if len(decode) else nan)


def capture_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode buckets' batch axis a CUDA server captures: powers of two up to its row limit,
    64 at most (`ModelRunner`'s default list)."""
    return DecodeBuckets.default(min(max_num_seqs, 64)).batch_sizes
