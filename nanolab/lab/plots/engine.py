"""The engine chapter's figures: the pool and a read rectangle, decode speed against HF."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from nanolab.engine.kv_cache import KVCache
from nanolab.engine.plan import derive_slot_mapping
from nanolab.lab.plots.common import ARM_STYLE, log_batch_axes


def plot_block_tables(cache: KVCache, rows: list[int], names: list[str]):
    """Left: the pool's blocks, coloured by the row that owns them. Right: the read rectangle
    `slot_mapping` [rows, max_ctx] that the reference read gathers, derived from the device block
    table as a plan derives it, with its padding cells hatched."""
    lens = torch.tensor([cache.blocks.table(row).num_tokens for row in rows])
    width = int(lens.max())
    mapping = derive_slot_mapping(cache.block_table, torch.tensor(rows).to(cache.device), lens.to(cache.device),
                                  width, cache.block_size).cpu()
    fig, (pool_ax, map_ax) = plt.subplots(
        1, 2, figsize=(13, 1.4 + 0.75 * len(rows)), gridspec_kw={"width_ratios": [1, 2.2]})

    owner = np.full(cache.num_blocks, -1)
    for i, row in enumerate(rows):
        owner[cache.blocks.table(row).blocks] = i
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
        blocks = cache.blocks.table(rows[i]).blocks
        map_ax.text(-0.5, -i + 0.45, f"{name}: {int(lens[i])} tokens, blocks {blocks}", ha="right", va="center",
                    fontsize=8)
    for p in range(0, width + 1, cache.block_size):
        map_ax.axvline(p - 0.025, color="0.3", lw=0.8, ls=":")
    map_ax.set_xlim(-0.2, width)
    map_ax.set_ylim(-len(rows) + 0.8, 1.1)
    map_ax.set_axis_off()
    padding = int((width - lens).sum())
    map_ax.set_title(f"slot_mapping [{len(rows)}, {width}]: {padding} of {len(rows) * width} cells are padding "
                     "(hatched: slot -1, the sink, loaded then masked)")
    fig.tight_layout()
    return fig


def plot_decode_speed(tables: dict[str, pd.DataFrame]):
    """Decode tokens/s against batch size for each arm, one panel per device's table."""
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    for ax, df in zip(axes[0], tables.values(), strict=True):
        for arm, part in df.groupby("engine"):
            colour, marker = ARM_STYLE.get(arm, ("C7", "x"))
            ax.plot(part.batch, part.tokens_per_s, marker=marker, color=colour, label=arm)
        first = df.iloc[0]
        log_batch_axes(ax, df.batch, "decode tokens/s")
        ax.set_title(f"{first.device}\n{first.model} ({first.weights} weights), {first['dtype']}, {first.date}",
                     fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    return fig
