"""The front page's figure: where nanolab's decode step stands against its peers and the floor."""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from nanolab.lab.plots.common import log_batch_axes
from nanolab.lab.plots.floor import FLOOR_ARMS

SHORT_NAMES = {"nanolab": "nanolab", "gpt-fast": "gpt-fast (compiled)",
               "hf-default": "HF transformers (default, compiled)", "hf-eager": "HF transformers (eager)"}


def plot_headline(floor: pd.DataFrame, roofline: pd.DataFrame) -> Figure:
    """ms per decode step against batch at the shortest context, one line per arm of the floor
    bench, with the bandwidth floor dashed and every arm's time at batch 1 written beside it."""
    short = roofline.context.min()
    fig = Figure(figsize=(8.5, 4.8))
    ax = fig.subplots()
    for arm, part in floor[floor.context == short].groupby("arm", sort=False):
        colour, marker = FLOOR_ARMS.get(arm, ("C5", "v"))
        line = part.sort_values("batch")
        ax.plot(line.batch, line.ms_per_step, color=colour, marker=marker, lw=2.2 if arm == "nanolab" else 1.4,
                label=SHORT_NAMES.get(arm, arm))
        first = line.iloc[0]
        ax.annotate(f"{first.ms_per_step:.2f} ms", (first.batch, first.ms_per_step), textcoords="offset points",
                    xytext=(-8, 0), ha="right", va="center", fontsize=8, color=colour)
    base = roofline[roofline.context == short].sort_values("batch")
    ax.plot(base.batch, base.floor_ms, color="k", ls="--", lw=1, label="floor: every weight read once")
    log_batch_axes(ax, floor.batch, "ms per decode step (log)")
    ax.set_yticks([0.5, 1, 2, 5, 10, 20], ["0.5", "1", "2", "5", "10", "20"])
    ax.set_xlim(left=base.batch.min() / 2.2)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"Decode step time, prompts of {short} tokens: lower is faster", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", frameon=False)
    fig.tight_layout()
    return fig
