"""Diagrams the notebooks draw from live engine state and measured tables (matplotlib only).

Introduced with the engine core (before Day 49).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nanolab.cache import BatchedPagedKVCache
from nanolab.kernels.paged_attention import BLOCK, NUM_WARPS

ARM_STYLE = {"nanolab": ("C0", "o"), "hf-static": ("C1", "s"), "hf-dynamic": ("C2", "^")}


def plot_block_tables(cache: BatchedPagedKVCache, rows: list[int], names: list[str]):
    """Left: the pool's blocks, coloured by the row that owns them. Right: the read rectangle
    `slot_mapping` [rows, max_ctx] that the reference gathers, with its padding cells hatched."""
    mapping, lens = (t.cpu() for t in cache.slot_mapping(rows))
    width = mapping.shape[1]
    fig, (pool_ax, map_ax) = plt.subplots(
        1, 2, figsize=(13, 1.4 + 0.75 * len(rows)), gridspec_kw={"width_ratios": [1, 2.2]})

    owner = np.full(cache.num_blocks, -1)
    for i, row in enumerate(rows):
        owner[cache.table(row).blocks] = i
    shown = min(cache.num_blocks, max(24, int(np.max(np.nonzero(owner >= 0))) + 4))
    for b in range(shown):
        colour = f"C{owner[b]}" if owner[b] >= 0 else "0.92"
        pool_ax.add_patch(plt.Rectangle((b % 8, -(b // 8)), 0.95, 0.9, color=colour))
        pool_ax.text(b % 8 + 0.47, -(b // 8) + 0.45, str(b), ha="center", va="center", fontsize=7)
    pool_ax.set_xlim(0, 8)
    pool_ax.set_ylim(-(shown - 1) // 8 - 0.2, 1)
    pool_ax.set_axis_off()
    pool_ax.set_title(f"KV pool: first {shown} of {cache.num_blocks} blocks of {cache.block_size} slots")

    for i, name in enumerate(names):
        for p in range(width):
            real = p < lens[i]
            map_ax.add_patch(plt.Rectangle((p, -i), 0.95, 0.9, facecolor=f"C{i}" if real else "white",
                                           alpha=0.8 if real else 1, hatch=None if real else "///", edgecolor="0.6"))
            if width <= 48:
                map_ax.text(p + 0.47, -i + 0.45, str(int(mapping[i, p])), ha="center", va="center", fontsize=6,
                            rotation=90, color="black" if real else "0.5")
        blocks = cache.table(rows[i]).blocks
        map_ax.text(-0.5, -i + 0.45, f"{name}: {int(lens[i])} tokens, blocks {blocks}", ha="right", va="center",
                    fontsize=8)
    for p in range(0, width + 1, cache.block_size):
        map_ax.axvline(p - 0.025, color="0.3", lw=0.8, ls=":")
    map_ax.set_xlim(-0.2, width)
    map_ax.set_ylim(-len(rows) + 0.8, 1.1)
    map_ax.set_axis_off()
    padding = int((width - lens).sum())
    map_ax.set_title(f"slot_mapping [{len(rows)}, {width}]: {padding} of {len(rows) * width} cells are padding "
                     "(hatched, slot 0, loaded then masked)")
    fig.tight_layout()
    return fig


def _log_batch_axes(ax, batches: pd.Series, ylabel: str) -> None:
    """Batch on a log-2 x axis ticked at the measured sizes, the measure on a log y axis."""
    sizes = sorted(batches.unique())
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("batch (requests decoding together)")
    ax.set_ylabel(ylabel)


def plot_decode_speed(tables: dict[str, pd.DataFrame]):
    """Decode tokens/s against batch size for each arm, one panel per device's table."""
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    for ax, df in zip(axes[0], tables.values(), strict=True):
        for arm, part in df.groupby("engine"):
            colour, marker = ARM_STYLE.get(arm, ("C7", "x"))
            ax.plot(part.batch, part.tokens_per_s, marker=marker, color=colour, label=arm)
        first = df.iloc[0]
        _log_batch_axes(ax, df.batch, "decode tokens/s")
        ax.set_title(f"{first.device}\n{first.model} ({first.weights} weights), {first['dtype']}, {first.date}",
                     fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    return fig


def _box(ax, x, y, w, h, text, face, edge="0.3", style="round,pad=0.02", fontsize=8, ls="-"):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=face, edgecolor=edge, linestyle=ls))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, wrap=True)


def plot_decode_plan(guards: dict[str, tuple[str, list[str]]], sweep: pd.DataFrame, rebuild: pd.DataFrame):
    """Day 50's diagram.

    guards  {arm: (mode, reasons)}: dynamo's guard failures, verbatim, in one mode of each arm
    sweep   rows of the compile bench: arm ("unplanned"/"planned"), mode, builds, steps, step_ms
    rebuild rows of steps, rebuild_cells, appended_cells
    """
    import textwrap

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (where_ax, guard_ax), (sweep_ax, price_ax) = axes

    for x0, title, planned in ((0.02, "before: addressing inside the forward", False),
                               (0.52, "after: a DecodePlan built outside it", True)):
        where_ax.text(x0 + 0.22, 0.95, title, ha="center", fontsize=9, weight="bold")
        _box(where_ax, x0, 0.05, 0.44, 0.62, "", "white", edge="C3", ls="--")
        where_ax.text(x0 + 0.22, 0.63, "traced region (torch.compile)", ha="center", fontsize=7.5, color="C3")
        if planned:
            _box(where_ax, x0 + 0.02, 0.72, 0.40, 0.16,
                 "plan_decode (host, once per step)\ngrows tables, builds write_slots,\n"
                 "slot_mapping, context_lens, positions",
                 "#dbe9f6", fontsize=7)
            where_ax.annotate("", (x0 + 0.22, 0.58), (x0 + 0.22, 0.72), arrowprops=dict(arrowstyle="->"))
            _box(where_ax, x0 + 0.03, 0.36, 0.38, 0.17, "every layer: one index_put at\nplan.write_slots", "#e6f2e6",
                 fontsize=7.5)
            _box(where_ax, x0 + 0.03, 0.12, 0.38, 0.17, "every layer: read plan.slot_mapping\n(validated=True)",
                 "#e6f2e6", fontsize=7.5)
        else:
            _box(where_ax, x0 + 0.03, 0.36, 0.38, 0.17,
                 "layer 0: for each row,\ngrow table; [table.slot(p) for p in\nrange(start, table.num_tokens)]",
                 "#f8dcdc", fontsize=7)
            _box(where_ax, x0 + 0.03, 0.12, 0.38, 0.17,
                 "layers 1..: reuse layer 0's slots;\nrebuild [rows, max_ctx] rectangle", "#f8dcdc", fontsize=7.5)
    where_ax.set_xlim(0, 1)
    where_ax.set_ylim(0, 1)
    where_ax.set_axis_off()
    where_ax.set_title("where the addressing lives", fontsize=10)

    guard_ax.set_axis_off()
    guard_ax.set_title("the guard dynamo fails on (its own words), and the builds it costs", fontsize=10)
    y = 0.97
    for arm, colour in (("unplanned", "C3"), ("planned", "C0")):
        mode, reasons = guards[arm]
        runs = sweep[sweep["arm"] == arm].set_index("mode")
        counts = ", ".join(f"{m} {int(r.builds)}" for m, r in runs.iterrows() if m != "off")
        guard_ax.text(0.0, y, f"{arm}: builds over {int(runs.steps.iloc[0])} steps: {counts}", fontsize=9,
                      weight="bold", color=colour, va="top")
        shown = [line for reason in reasons[:3] for line in textwrap.wrap(reason.split("#")[0].strip(), 78)]
        text = f"{mode}:\n" + ("\n".join(shown) if shown else "(no guard failed)")
        guard_ax.text(0.02, y - 0.07, text, fontsize=7.5, family="monospace", va="top")
        y -= 0.5

    arms = ["unplanned", "planned"]
    modes = list(dict.fromkeys(sweep["mode"]))
    width = 0.38
    for j, arm in enumerate(arms):
        part = sweep[sweep["arm"] == arm].set_index("mode").reindex(modes)
        xs = np.arange(len(modes)) + (j - 0.5) * width
        bars = sweep_ax.bar(xs, part.step_ms, width, color="C3" if arm == "unplanned" else "C0", label=arm)
        for bar, builds in zip(bars, part.builds, strict=True):
            sweep_ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{int(builds)} builds",
                          ha="center", va="bottom", fontsize=7)
    sweep_ax.set_xticks(np.arange(len(modes)), modes)
    sweep_ax.set_yscale("log")
    sweep_ax.set_ylabel("median decode step (ms)")
    sweep_ax.set_title("the measured sweep", fontsize=10)
    sweep_ax.legend()
    sweep_ax.grid(alpha=0.3, axis="y")

    price_ax.plot(rebuild.steps, rebuild.rebuild_cells, "o-", color="C3",
                  label="cells rebuilt (rectangle every step)")
    price_ax.plot(rebuild.steps, rebuild.appended_cells, "s-", color="C0",
                  label="cells appended (one per row per step)")
    price_ax.plot(rebuild.steps, 32 * rebuild.appended_cells, ":", color="0.4",
                  label="check_rebuild_bounded limit (32x)")
    price_ax.set_xscale("log", base=2)
    price_ax.set_yscale("log")
    price_ax.set_xlabel("decode steps (4 rows, 16-token prompt)")
    price_ax.set_ylabel("int64 cells written on the host")
    price_ax.set_title("the price: rebuilt against appended", fontsize=10)
    price_ax.legend(fontsize=8)
    price_ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


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
    _log_batch_axes(ax, steps.batch, "ms per decode step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("decode step time: graphs on and off, HF transformers' static cache, and the floor", fontsize=9)
    fig.tight_layout()
    return fig


def plot_streamed_read(table: pd.DataFrame, example_lengths: list[int], *, heads: int = 32, block: int = 128,
                       head_dim: int = 64, measured: pd.DataFrame | None = None):
    """Day 59's four panels: the rectangle the reference scores for a ragged batch, one streamed
    program's whole live state, the ragged walk against the rectangle's tiles, and the table.

    table            `captured.streambench_table()` (host arithmetic, the seed's rows)
    example_lengths  one ragged batch's row lengths, drawn in the first and third panels
    measured         `streambench.run_streambench`'s table from a GPU; when given, the fourth panel
                     shows it (microseconds per arm, and the engine's read's bandwidth) under the
                     host table, labelled with the device and date it was measured on
    """
    from nanolab.captured import render_streambench, streamed_work

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
    _box(state_ax, 0.03, 0.55, 0.42, 0.3, f"K tile [{block}, {head_dim}]\nloaded from row r's own blocks", "#dbe9f6")
    _box(state_ax, 0.53, 0.55, 0.42, 0.3, f"V tile [{block}, {head_dim}]", "#dbe9f6")
    _box(state_ax, 0.03, 0.18, 0.27, 0.22, "running max m\ndenominator l", "#e6f2e6")
    _box(state_ax, 0.36, 0.18, 0.27, 0.22, f"accumulator\nacc [{head_dim}]", "#e6f2e6")
    _box(state_ax, 0.69, 0.18, 0.27, 0.22, f"scores\n[{block}] (this tile's)", "#e6f2e6")
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
    _log_batch_axes(time_ax, steps.batch, "ms per decode step")
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
