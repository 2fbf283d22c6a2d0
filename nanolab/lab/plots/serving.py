"""Day 58's figures: the server under load with CUDA graphs on and off, and row compaction step by step."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

SERVING_ARMS = {"graphs": ("C0", "o"), "eager": ("C7", "s"), "graphs-chunked": ("C0", "o"),
                "eager-chunked": ("C7", "s"), "graphs-whole": ("C3", "^"), "eager-whole": ("C1", "D")}


def _rate_axis(ax, rates: pd.Series) -> None:
    values = sorted(rates.unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [f"{r:g}" for r in values])
    ax.minorticks_off()
    ax.set_xlabel("offered rate (requests/s, Poisson)")
    ax.grid(alpha=0.3, which="both")


def plot_graphbench(rates: pd.DataFrame):
    """Two panels against the offered rate, one line per arm: ITL at p50 (solid) and p99 (dashed),
    and output-token throughput beside the offered token rate. A hollow marker is a saturated rate:
    the server finished requests slower than they came."""
    fig, (itl, tput) = plt.subplots(1, 2, figsize=(12, 4.6))
    for arm, part in rates.groupby("arm", sort=False):
        colour, marker = SERVING_ARMS.get(arm, ("C5", "v"))
        part = part.sort_values("rate")
        sat = part.saturated.astype(bool).to_numpy()
        for col, ls, name in (("itl_p50_ms", "-", "p50"), ("itl_p99_ms", "--", "p99")):
            itl.plot(part.rate, part[col], ls=ls, color=colour, label=f"{arm}, ITL {name}")
            itl.scatter(part.rate[~sat], part[col][~sat], marker=marker, color=colour, zorder=3)
            itl.scatter(part.rate[sat], part[col][sat], marker=marker, facecolors="white", edgecolors=colour,
                        zorder=3)
        tput.plot(part.rate, part.output_throughput, color=colour, label=f"{arm}")
        tput.scatter(part.rate[~sat], part.output_throughput[~sat], marker=marker, color=colour, zorder=3)
        tput.scatter(part.rate[sat], part.output_throughput[sat], marker=marker, facecolors="white",
                     edgecolors=colour, zorder=3)
    offered = rates.drop_duplicates("rate").sort_values("rate")
    mean_out = (offered.output_lo + offered.output_hi) / 2
    tput.plot(offered.rate, offered.rate * mean_out, color="k", lw=1, ls=":", label="offered (rate x mean output)")
    for ax in (itl, tput):
        _rate_axis(ax, rates.rate)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    itl.set_ylabel("inter-token latency (ms)")
    itl.set_title("ITL: gaps between streamed chunks, pooled over requests\n(hollow: saturated)", fontsize=9)
    tput.set_ylabel("output tokens/s")
    tput.set_title("output-token throughput", fontsize=9)
    fig.tight_layout()
    return fig


def plot_row_compaction(trace: pd.DataFrame, batch_sizes):
    """Per arm, one window of steps over time: the live rows and the batch the step ran at (the
    capture bucket when a graph replayed) with the bucket sizes as guides and prefill and mixed
    steps (prompt chunks beside decode rows) as ticks, and under it each decode step's padding share."""
    arms = list(trace.arm.unique())
    fig, axes = plt.subplots(2, len(arms), figsize=(6.5 * len(arms), 5.6), sharex="col", squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1]})
    for j, arm in enumerate(arms):
        part = trace[trace.arm == arm]
        decode, prefill = part[part.phase == "decode"], part[part.phase != "decode"]
        rows_ax, pad_ax = axes[0, j], axes[1, j]
        top = max(int(part.batch.max()), 1)
        for b in batch_sizes:
            if b <= 2 * top:
                rows_ax.axhline(b, color="0.85", lw=0.8, zorder=0)
        # The batch drawn wide under the rows: eagerly the two are one line, and both stay visible.
        rows_ax.step(decode.t_s, decode.batch, where="post", color="C3", lw=3, alpha=0.5, label="batch run (bucket)")
        rows_ax.step(decode.t_s, decode.rows, where="post", color="C0", lw=1.2, label="live rows")
        rows_ax.plot(prefill.t_s, np.zeros(len(prefill)), "|", color="k", ms=8, label="prefill or mixed step")
        rows_ax.set_ylabel("rows")
        rows_ax.set_yscale("symlog", base=2, linthresh=1)
        shown = [b for b in batch_sizes if b <= 2 * top]
        rows_ax.set_yticks([0, *shown], ["0", *map(str, shown)])
        rows_ax.minorticks_off()
        rate = part.rate.iloc[0] if len(part) else float("nan")
        mean_pad = float(decode.padding_share.mean()) if len(decode) else float("nan")
        rows_ax.set_title(f"{arm}, {rate:g} req/s: {len(decode)} decode steps, padding {mean_pad:.0%} of rows "
                          "on average", fontsize=9)
        rows_ax.legend(fontsize=7, loc="upper right")
        pad_ax.bar(decode.t_s, decode.padding_share, width=float(decode.ms.median()) / 1000 if len(decode) else 0.01,
                   color="C1", align="edge")
        pad_ax.set_ylim(0, 1)
        pad_ax.set_ylabel("padding share")
        pad_ax.set_xlabel("seconds into the rate's window")
        pad_ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
