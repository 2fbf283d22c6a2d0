"""Days 52 to 56's figure: the capture list, its padding, its pool and the graphed step."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nanolab.lab.plots.common import log_batch_axes

CAPTURE_ARMS = {"nanolab graphs + compile": ("C3", "D"), "nanolab graphs": ("C0", "o"),
                "nanolab eager": ("C7", "x"), "hf-static": ("C1", "s")}


def plot_capture_buckets(buckets, waste: pd.DataFrame, capture: pd.DataFrame, steps: pd.DataFrame,
                         breakdown: pd.DataFrame):
    """Day 54's four panels: the capture list and its worst padding, the graphs' pool with and
    without sharing, step time against batch for every arm beside the floor, and where a
    batch-1 graphed step's time goes."""
    fig = plt.figure(figsize=(15, 9.5))
    grid = fig.add_gridspec(2, 3, height_ratios=[1, 1.1], width_ratios=[1.5, 0.8, 1])
    lst, pool, bars = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[0, 2])
    speed = [fig.add_subplot(grid[1, 0:2])]

    # The capture list: one cell per (batch, width), shaded by the worst padding a batch in it pays.
    cells = waste.pivot(index="batch", columns="width", values="worst waste").loc[list(buckets.batch_sizes)]
    lst.pcolormesh(cells.to_numpy(), cmap="Oranges", vmin=0, vmax=1.4, edgecolors="white", linewidth=1)
    order = {shape: i + 1 for i, shape in enumerate(buckets.shapes)}
    for i, b in enumerate(cells.index):
        for j, w in enumerate(cells.columns):
            lst.text(j + 0.5, i + 0.5, f"#{order[b, w]}\n{cells.loc[b, w]:.0%}", ha="center", va="center",
                     fontsize=7)
    lst.set_xticks(np.arange(len(cells.columns)) + 0.5, [str(w) for w in cells.columns], fontsize=8)
    lst.set_yticks(np.arange(len(cells.index)) + 0.5, [str(b) for b in cells.index], fontsize=8)
    lst.set_xlabel("width bucket (tokens)")
    lst.set_ylabel("batch bucket (rows)")
    lst.set_title(f"the capture list: {len(buckets)} graphs\n(#capture order, largest first; worst padding share)",
                  fontsize=9)

    # The pool, with and without sharing (the graphs that capture the eager forward).
    eager = capture[capture.forward == "eager"]
    pool.bar(eager["pool"], eager.pool_mib, color=["C7" if p != "shared" else "C0" for p in eager["pool"]])
    for x, (mib, sec) in enumerate(zip(eager.pool_mib, eager.seconds, strict=True)):
        pool.text(x, mib, f"{mib:,.0f} MiB\n{sec:.2f} s", ha="center", va="bottom", fontsize=8)
    ratio = eager.set_index("pool").pool_mib
    pool.set_title(f"graph memory pool: sharing one saves {ratio['one per graph'] / ratio['shared']:.1f}x", fontsize=9)
    pool.set_ylabel("MiB kept by the captured graphs")
    pool.set_ylim(0, eager.pool_mib.max() * 1.3)
    pool.tick_params(axis="x", labelsize=7)
    pool.set_xlabel("the whole list captured into ... (and how long it took)", fontsize=8)

    # Where one batch-1 step's time goes.
    b = breakdown.set_index("arm")
    parts = [("gpu_matmul_ms", "GPU: matmuls", "C0"), ("gpu_other_ms", "GPU: other kernels", "C9"),
             ("host_ms", "host (GPU idle)", "0.75")]
    bottom = np.zeros(len(b))
    for col, name, colour in parts:
        bars.bar(range(len(b)), b[col], bottom=bottom, color=colour, label=name)
        bottom += b[col].to_numpy()
    bars.axhline(b.floor_ms.iloc[0], color="k", ls="--", lw=1, label=f"floor {b.floor_ms.iloc[0]:.2f} ms")
    bars.axhline(0.9, color="C3", ls=":", lw=1.2, label="target 0.9 ms")
    bars.set_xticks(range(len(b)), [a.replace("nanolab ", "") for a in b.index], fontsize=7, rotation=12)
    bars.set_ylim(0, b.step_ms.max() * 1.6)
    bars.set_ylabel("ms per decode step")
    bars.set_title(f"batch 1, context {int(b.context.iloc[0])}: where a graphed step goes", fontsize=9)
    bars.legend(fontsize=7, loc="upper left", ncol=2)

    # Step time against batch, both contexts.
    ax = speed[0]
    for (arm, context), part in steps.groupby(["arm", "context"]):
        colour, marker = CAPTURE_ARMS.get(arm, ("C5", "v"))
        ax.plot(part.batch, part.ms_per_step, marker=marker, color=colour, ls="-" if context == steps.context.min()
                else "--", label=f"{arm}, context {context}")
    for context, part in steps[steps.arm == steps.arm.iloc[0]].groupby("context"):
        ax.plot(part.batch, part.floor_ms, color="k", lw=1, ls="-" if context == steps.context.min() else "--",
                label=f"bandwidth floor, context {context}")
    log_batch_axes(ax, steps.batch, "ms per decode step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("decode step time: graphs on and off, HF transformers' static cache, and the floor", fontsize=9)
    fig.tight_layout()
    return fig
