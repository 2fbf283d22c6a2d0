"""The front page's figure: where nanolab's decode step stands against its peers and the floor."""

from __future__ import annotations

import math

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
    firsts = []
    for arm, part in floor[floor.context == short].groupby("arm", sort=False):
        colour, marker = FLOOR_ARMS.get(arm, ("C5", "v"))
        line = part.sort_values("batch")
        ax.plot(line.batch, line.ms_per_step, color=colour, marker=marker, lw=2.2 if arm == "nanolab" else 1.4,
                label=SHORT_NAMES.get(arm, arm))
        firsts.append((line.iloc[0], colour))
    # Each arm's first time beside its point, nudged up where two lie within a label's height
    # (0.06 of a decade; about 175 points a decade on this axis).
    last_y = None
    for first, colour in sorted(firsts, key=lambda fc: fc[0].ms_per_step):
        y = math.log10(first.ms_per_step)
        shift = 0.0 if last_y is None else max(0.0, last_y + 0.06 - y)
        last_y = y + shift
        ax.annotate(f"{first.ms_per_step:.2f} ms", (first.batch, first.ms_per_step), textcoords="offset points",
                    xytext=(-8, shift * 175), ha="right", va="center", fontsize=8, color=colour)
    base = roofline[roofline.context == short].sort_values("batch")
    ax.plot(base.batch, base.floor_ms, color="k", ls="--", lw=1, label="floor: every weight read once")
    log_batch_axes(ax, floor.batch, "ms per decode step (log)")
    ax.set_yticks([0.5, 1, 2, 5, 10, 20], ["0.5", "1", "2", "5", "10", "20"])
    ax.set_xlim(left=base.batch.min() / 2.2)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(f"Decode step time, prompts of {short} tokens: lower is faster", fontsize=10)
    ax.legend(fontsize=8, loc="center right", frameon=False)  # the band between the eager line and the rest
    fig.tight_layout()
    return fig
