"""Day 62's figures: tensor parallelism's step on paper, link by link, and as measured at TP = 1
and TP = 2. Each takes a table as `lab.tpbench` makes it and returns a Figure, drawn without
pyplot."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

LINK_COLOURS = ("C0", "C1", "C3")


def plot_paper_speedup(paper: pd.DataFrame, batch: int = 1) -> Figure:
    """TP = 2's speedup over one GPU at `batch`, by model, one bar per link (`tpbench.predicted_steps`)."""
    rows = paper[paper.batch == batch]
    models = list(dict.fromkeys(rows.model))
    links = list(dict.fromkeys(rows.link))
    fig = Figure(figsize=(7.5, 3.8))
    ax = fig.add_subplot()
    width = 0.8 / len(links)
    x = np.arange(len(models))
    for i, (link, colour) in enumerate(zip(links, LINK_COLOURS, strict=False)):
        speedup = rows[rows.link == link].set_index("model").speedup.reindex(models)
        bars = ax.bar(x + (i - (len(links) - 1) / 2) * width, speedup, width, label=link, color=colour)
        ax.bar_label(bars, fmt="%.2fx", fontsize=7, padding=2)
    ax.axhline(1.0, color="0.3", lw=0.8)
    ax.axhline(2.0, color="0.6", lw=0.8, ls="--")
    ax.text(len(models) - 0.5, 2.0, "two GPUs' bandwidth", ha="right", va="bottom", fontsize=7, color="0.4")
    ax.set_xticks(x, [f"{m}\n{w:.0f} GB" for m, w in zip(models, rows.groupby("model", sort=False).weights_gb.first(),
                                                           strict=True)])
    ax.set_ylabel(f"TP=2 over one GPU, batch {batch}")
    ax.set_ylim(0, 2.6)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    ax.set_title("On paper: weights over HBM bandwidth, collectives over the link", fontsize=10)
    return fig


def plot_tp_steps(measured: pd.DataFrame) -> Figure:
    """Measured ms per step by batch, one panel per model: each arm's bars and each GPU's floor
    (`tpbench.run_tpbench`'s rows; failed rows are left out)."""
    ok = measured[measured.error.fillna("") == ""]
    models = list(dict.fromkeys(ok.model))
    arms = list(dict.fromkeys(ok.label))
    fig = Figure(figsize=(4.2 * len(models), 3.8))
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models, strict=True):
        rows = ok[ok.model == model]
        batches = sorted(rows.batch.unique())
        x = np.arange(len(batches))
        width = 0.8 / len(arms)
        for i, arm in enumerate(arms):
            arm_rows = rows[rows.label == arm].set_index("batch").reindex(batches)
            offset = (i - (len(arms) - 1) / 2) * width
            bars = ax.bar(x + offset, arm_rows.ms_per_step, width, label=arm, color=f"C{i}")
            ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
            ax.hlines(arm_rows.floor_ms, x + offset - width / 2, x + offset + width / 2, color="k", lw=1.5)
        ax.set_xticks(x, [f"batch {b}" for b in batches])
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("ms per decode step")
        ax.margins(y=0.15)
    axes[0].legend(fontsize=7, loc="upper left", frameon=False)
    fig.suptitle("Measured: black ticks are each GPU's floor (its shard over the copy bandwidth)", fontsize=9)
    return fig
