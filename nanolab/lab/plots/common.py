"""What every figure shares: arm colours, a log-batch axis, a labelled box."""

from __future__ import annotations

import pandas as pd

ARM_STYLE = {"nanolab": ("C0", "o"), "hf-static": ("C1", "s"), "hf-dynamic": ("C2", "^")}


def log_batch_axes(ax, batches: pd.Series, ylabel: str) -> None:
    """Batch on a log-2 x axis ticked at the measured sizes, the measure on a log y axis."""
    sizes = sorted(batches.unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests decoding together)")
    ax.set_ylabel(ylabel)


def box(ax, x, y, w, h, text, face, edge="0.3", style="round,pad=0.02", fontsize=8, ls="-"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=face, edgecolor=edge, linestyle=ls))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, wrap=True)
