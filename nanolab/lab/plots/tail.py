"""Day 63's figures: each rate's ITL distribution per arm, and where a server's start goes. Each
function takes measured tables and returns a Figure."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

# An arm's colour and its line's label; an arm not listed keeps matplotlib's cycle.
TAIL_ARMS = {"graphs": ("C7", "decode steps graphed, mixed steps eager"),
             "fullgraphs": ("C0", "every step graphed"),
             "eager": ("C1", "every step eager")}


def plot_itl_cdf(itl: pd.DataFrame, aim: float = 3.0, labels: dict[str, str] | None = None) -> Figure:
    """`<prefix>_itl` (arm, rate, quantile, itl_ms): one panel per rate, each arm's ITL distribution
    from its median up, as the share of gaps longer than x (one minus the CDF, both axes log, so
    the tail gets the room). A dotted line marks p99 (1% of gaps longer); a dot, each arm's p99; a
    short tick on the line, `aim` x that arm's p50 (the tail's aim): a dot left of its tick meets
    it. `labels` names arms (default `TAIL_ARMS`')."""
    rates = sorted(itl.rate.unique())
    arms = list(dict.fromkeys(itl.arm))
    fig = Figure(figsize=(3.2 * len(rates) + 0.6, 3.8))
    axes = fig.subplots(1, len(rates), sharey=True, squeeze=False)[0]
    for ax, rate in zip(axes, rates, strict=True):
        lo, hi = np.inf, 0.0
        for i, arm in enumerate(arms):
            part = itl[(itl.arm == arm) & (itl.rate == rate) & (itl["quantile"] >= 0.5)].sort_values("quantile")
            if part.empty:
                continue
            colour = TAIL_ARMS.get(arm, (f"C{i + 2}", arm))[0]
            name = (labels or {}).get(arm, TAIL_ARMS.get(arm, (None, arm))[1])
            above = (1 - part["quantile"]).clip(lower=1e-3)  # the last quantile (the longest gap) sits on the floor
            ax.step(part.itl_ms, above, where="post", color=colour, lw=1.8, label=name)
            p50 = float(np.interp(0.5, part["quantile"], part.itl_ms))
            p99 = float(np.interp(0.99, part["quantile"], part.itl_ms))
            ax.plot([p99], [0.01], "o", color=colour, ms=5)
            ax.vlines(aim * p50, 0.007, 0.014, color=colour, lw=2.5)
            ax.annotate(f"p99/p50 {p99 / p50:.1f}x", (p99, 0.01), xytext=(5, 8 + 11 * i),
                        textcoords="offset points", fontsize=7, color=colour)
            lo, hi = min(lo, p50), max(hi, float(part.itl_ms.max()))
        ax.axhline(0.01, color="k", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yscale("log")
        ax.set_ylim(8e-4, 0.6)
        if np.isfinite(lo):
            ax.set_xlim(lo / 1.3, hi * 1.3)
        ax.set_title(f"{rate:g} req/s", fontsize=9)
        ax.set_xlabel("inter-token gap (ms)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("share of gaps longer than this")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=len(arms))
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


# The parts of a server's start, from `graphbench.startup_table`, in the order they happen.
START_PARTS = [("decode_capture_s", "decode graphs: compile and capture", "C0"),
               ("varlen_capture_s", "varlen graphs: capture", "C2"),
               ("build_rest_s", "rest of the engine's build (weights, pool)", "C7"),
               ("warm_up_s", "warm-up requests", "C1"),
               ("spawn_s", "process start, tokenizer, HTTP", "C8")]


def plot_startup(startup: pd.DataFrame) -> Figure:
    """One bar per server start (`graphbench.startup_table`'s rows with an engine build), named by
    its `server` column (else its arm), its seconds to ready split into `START_PARTS`: what is left
    of the build after both captures, and of the start after the build and the warm-up, are their
    own parts."""
    rows = startup.dropna(subset=["engine_build_s"]).reset_index(drop=True)
    rows = rows.assign(varlen_capture_s=rows.get("varlen_capture_s", 0.0)).fillna({"varlen_capture_s": 0.0})
    rows["build_rest_s"] = rows.engine_build_s - rows.decode_capture_s - rows.varlen_capture_s
    rows["spawn_s"] = rows.ready_s - rows.engine_build_s - rows.warm_up_s
    fig = Figure(figsize=(9, 1.4 + 0.45 * len(rows)))
    ax = fig.subplots()
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for col, label, colour in START_PARTS:
        ax.barh(y, rows[col], left=left, color=colour, height=0.6, label=label)
        left += rows[col].to_numpy()
    for yi, total in zip(y, rows.ready_s, strict=True):
        ax.text(total + 0.5, yi, f"{total:.0f} s", va="center", fontsize=8)
    ax.set_yticks(y, rows["server"] if "server" in rows else rows.arm, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from launch to /health answering 200")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
