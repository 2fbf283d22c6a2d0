"""Days 59 and 60's figures: the streamed read's state and walk, its launch sweep, and the engine
with it."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nanolab.kernels.paged_attention import BLOCK, NUM_WARPS
from nanolab.lab.plots.common import box, log_batch_axes


def plot_streamed_read(table: pd.DataFrame, example_lengths: list[int], *, heads: int = 32, block: int = 128,
                       head_dim: int = 64, measured: pd.DataFrame | None = None):
    """Day 59's four panels: the rectangle the reference scores for a ragged batch, one streamed
    program's whole live state, the ragged walk against the rectangle's tiles, and the table.

    table            `lab.costs.streambench_table()` (host arithmetic, the seed's rows)
    example_lengths  one ragged batch's row lengths, drawn in the first and third panels
    measured         `streambench.run_streambench`'s table from a GPU; when given, the fourth panel
                     shows it (microseconds per arm, and the engine's read's bandwidth) under the
                     host table, labelled with the device and date it was measured on
    """
    from nanolab.lab.costs import render_streambench, streamed_work

    fig, axes = plt.subplots(2, 2, figsize=(14, 9), gridspec_kw=dict(height_ratios=[1, 1.05]))
    (rect_ax, state_ax), (walk_ax, table_ax) = axes
    work = streamed_work(example_lengths, block)
    tiles = -(-work.width // block)
    big = table.iloc[table["rectangle MB"].idxmax()]

    # The oracle's rectangle: every row charged the widest row's tiles, padding loaded and masked.
    grid = np.zeros((len(example_lengths), tiles))
    for r, n in enumerate(example_lengths):
        grid[r, : -(-n // block)] = 1
    rect_ax.pcolormesh(grid, cmap=plt.matplotlib.colors.ListedColormap(["#f4c7c3", "#7aa6d6"]), vmin=0, vmax=1,
                       edgecolors="white", linewidth=0.8)
    rect_ax.invert_yaxis()
    rect_ax.set_xlabel(f"key tiles of {block} (width {work.width})")
    rect_ax.set_ylabel("row")
    rect_ax.set_title(f"the reference: a [rows, heads, 1, width] rectangle. Blue holds tokens; red is padding, "
                      f"loaded, scored, then masked.\nAt {int(big.rows)} rows x {int(big.width)}, {heads} heads: "
                      f"{big['rectangle MB']:.1f} MB of scores in one intermediate", fontsize=8.5)

    # One program's live state: nothing in it has the width in it.
    state_ax.set_xlim(0, 1)
    state_ax.set_ylim(0, 1)
    state_ax.axis("off")
    box(state_ax, 0.03, 0.55, 0.42, 0.3, f"K tile [{block}, {head_dim}]\nloaded from row r's own blocks", "#dbe9f6")
    box(state_ax, 0.53, 0.55, 0.42, 0.3, f"V tile [{block}, {head_dim}]", "#dbe9f6")
    box(state_ax, 0.03, 0.18, 0.27, 0.22, "running max m\ndenominator l", "#e6f2e6")
    box(state_ax, 0.36, 0.18, 0.27, 0.22, f"accumulator\nacc [{head_dim}]", "#e6f2e6")
    box(state_ax, 0.69, 0.18, 0.27, 0.22, f"scores\n[{block}] (this tile's)", "#e6f2e6")
    state_ax.set_title(f"the streamed read: one program per (row, head) holds only this.\nAt {int(big.rows)} rows x "
                       f"{heads} heads, {block}-key tiles: {big['tile MB']:.2f} MB, {big['holds']:.0f}x less "
                       f"(width / block)", fontsize=8.5)

    # The ragged walk.
    rows = np.arange(len(example_lengths))
    walked = [-(-n // block) for n in example_lengths]
    walk_ax.barh(rows, [tiles] * len(rows), color="#f4c7c3", label=f"rectangle: {work.rect_tiles} tiles")
    walk_ax.barh(rows, walked, color="#7aa6d6", label=f"streamed: {work.walked} tiles")
    walk_ax.invert_yaxis()
    walk_ax.set_xlabel("tiles a row's program walks")
    walk_ax.set_ylabel("row")
    walk_ax.legend(fontsize=8, loc="lower right")
    walk_ax.text(0.97, 0.55, "for b in range(tl.cdiv(ctx, BLOCK)):", transform=walk_ax.transAxes, ha="right",
                 fontsize=8, family="monospace", bbox=dict(facecolor="white", edgecolor="0.6"))
    walk_ax.set_title(f"the ragged walk: {work.walked} tiles against {work.rect_tiles} "
                      f"({work.ragged_saving:.2f}x); the loop bound is each row's own length", fontsize=8.5)

    table_ax.axis("off")
    table_ax.text(0.0, 1.0, render_streambench(table), family="monospace", fontsize=8.5 if measured is None else 7,
                  va="top")
    title = "the table, uniform rows left in: the tile saving is unconditional, the walk saving is the spread"
    if measured is not None:
        table_ax.text(0.0, 0.36, _measured_text(measured), family="monospace", fontsize=7, va="top")
        title = "above, the host arithmetic (the seed's table); below, one layer's read measured"
    table_ax.set_title(title, fontsize=8.5)
    fig.tight_layout()
    return fig


def _measured_text(measured: pd.DataFrame) -> str:
    """The streambench table as text: microseconds per arm for each shape, then the table-addressed
    read's K/V bandwidth and its speedup over the rectangle."""
    arms = [a for a in ("reference", "head", "gqa", "split", "table", "sdpa") if a in set(measured.arm)]
    us = measured.pivot(index="shape", columns="arm", values="us")
    tb = measured[measured.arm == "table"].set_index("shape")
    row = measured.iloc[0]
    lines = [f"{row['device']}, {row['dtype']}, {row['date']}, torch {row['torch']}, triton {row['triton']}: "
             "microseconds",
             f"{'shape':<20}" + "".join(f"{a:>10}" for a in arms) + f"{'TB/s':>7}{'x ref':>7}"]
    for shape in measured["shape"].unique():
        lines.append(f"{shape:<20}" + "".join(f"{us.loc[shape, a]:>10.1f}" for a in arms)
                     + f"{tb.loc[shape, 'tb_s']:>7.2f}{tb.loc[shape, 'x_reference']:>6.1f}x")
    lines.append("TB/s: K/V bytes the rows hold over the table read's time")
    return "\n".join(lines)


def plot_launch_sweep(sweep: pd.DataFrame, rule: pd.DataFrame):
    """The launch sweep, two panels. Left: for each swept shape, the fastest time found at each
    number of split shares (1 is "gqa", one program per row and KV head). Right: at the rule's
    variant, shares, BLOCK and NUM_WARPS, the time at each pipeline depth over the fastest depth.
    Ringed: what the rule picks. `rule` is `streambench.launch_rule`'s table indexed by shape
    (variant, splits, num_stages)."""
    fig, (share_ax, depth_ax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[1.25, 1]))
    group = sweep[sweep.variant != "head"]
    best = group.groupby(["shape", "splits"]).us.min().reset_index()
    shapes = list(dict.fromkeys(sweep["shape"]))
    for shape, part in best.groupby("shape", sort=False):
        colour = f"C{shapes.index(shape)}"
        share_ax.plot(part.splits, part.us, marker="o", color=colour, label=shape)
        pick = part[part.splits == rule.splits[shape]]
        share_ax.scatter(pick.splits, pick.us, s=160, facecolors="none", edgecolors=colour, linewidths=1.6)
    share_ax.set_xscale("log", base=2)
    share_ax.set_yscale("log")
    shares = sorted(best.splits.unique())
    share_ax.set_xticks(shares, [str(s) for s in shares])
    share_ax.minorticks_off()
    share_ax.set_xlabel("split shares per row (1: one program per row and KV head)")
    share_ax.set_ylabel("microseconds, fastest launch setting")
    share_ax.set_title("one layer's read through the block table: sharing the walk out fills the card\n"
                       "(ringed: the shares the rule picks)", fontsize=9)
    share_ax.legend(fontsize=8, ncol=2)
    for shape in shapes:
        r = rule.loc[shape]
        runs = sweep[(sweep["shape"] == shape) & (sweep.variant == r.variant) & (sweep.splits == r.splits)
                     & (sweep.block == BLOCK) & (sweep.num_warps == NUM_WARPS)].sort_values("num_stages")
        colour = f"C{shapes.index(shape)}"
        rel = runs.us / runs.us.min()
        depth_ax.plot(runs.num_stages, rel, marker="o", color=colour)
        pick = runs.num_stages == r.num_stages
        depth_ax.scatter(runs.num_stages[pick], rel[pick], s=160, facecolors="none", edgecolors=colour,
                         linewidths=1.6)
    depth_ax.set_xticks(sorted(sweep.num_stages.unique()))
    depth_ax.set_xlabel("pipeline stages (num_stages)")
    depth_ax.set_ylabel("time over the fastest depth")
    depth_ax.set_title(f"the rule's variant and shares, {BLOCK}-key tiles, {NUM_WARPS} warps: crowded grids of short\n"
                       "walks take 2 stages, the rest keep 3 (ringed: the depth the rule picks)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_streamed_engine(steps: pd.DataFrame, reference: str, streamed: str):
    """Day 60 end to end: ms per decode step against batch with the reference read and with the
    streamed read (both replayed as graphs), one line per context, and the ratio between them."""
    fig, (time_ax, ratio_ax) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw=dict(width_ratios=[1.3, 1]))
    for i, (context, part) in enumerate(steps.groupby("context")):
        ls = "-" if i == 0 else "--"
        for arm, colour, marker in ((reference, "C0", "o"), (streamed, "C3", "D")):
            rows = part[part.arm == arm].sort_values("batch")
            time_ax.plot(rows.batch, rows.ms_per_step, color=colour, marker=marker, ls=ls,
                         label=f"{arm.replace('nanolab ', '')}, context {context}")
        floor = part[part.arm == reference].sort_values("batch")
        time_ax.plot(floor.batch, floor.floor_ms, color="k", lw=1, ls=ls, label=f"floor, context {context}")
        ref = part[part.arm == reference].set_index("batch").ms_per_step
        new = part[part.arm == streamed].set_index("batch").ms_per_step
        ratio_ax.plot(ref.index, ref / new, color=f"C{i + 4}", marker="o", ls=ls, label=f"context {context}")
    log_batch_axes(time_ax, steps.batch, "ms per decode step")
    time_ax.legend(fontsize=7, ncol=2)
    time_ax.set_title("the decode step, graphs over either read", fontsize=9)
    ratio_ax.set_xscale("log", base=2)
    sizes = sorted(steps.batch.unique())
    ratio_ax.set_xticks(sizes, [str(b) for b in sizes])
    ratio_ax.minorticks_off()
    ratio_ax.axhline(1, color="k", lw=1)
    ratio_ax.set_xlabel("batch (requests decoding together)")
    ratio_ax.set_ylabel("reference step time / streamed step time")
    ratio_ax.set_title("above 1: the streamed read's step is faster", fontsize=9)
    ratio_ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
