"""Day 64's figures: requests' block tables sharing a prefix, TTFT with prefix caching on and off,
and no-hit throughput per repeat. Each function takes tables (`prefixbench`'s, or the chapter's)
and returns a Figure."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

# An arm's colour and its bars' label.
PREFIX_ARMS = {"off": ("C7", "prefix caching off"), "on": ("C0", "prefix caching on")}


def plot_prefix_ttft(summary: pd.DataFrame) -> Figure:
    """`<prefix>_ttft` (part, phase, arm, ttft_p50_ms, ttft_p90_ms): one panel per part (the
    shared prefix's cold and warm requests, the multi-turn chat's turns 1 and 2), a bar per arm
    at each phase to its p50 TTFT with a whisker up to p90, and above each phase off over on at p50."""
    parts = list(dict.fromkeys(summary.part))
    fig = Figure(figsize=(5.2 * len(parts), 4.2))
    axes = fig.subplots(1, len(parts), squeeze=False)[0]
    width = 0.38
    for ax, part in zip(axes, parts, strict=True):
        rows = summary[summary.part == part]
        phases = list(dict.fromkeys(rows.phase))
        for j, arm in enumerate(PREFIX_ARMS):
            colour, name = PREFIX_ARMS[arm]
            got = rows[rows.arm == arm].set_index("phase").reindex(phases)
            x = np.arange(len(phases)) + (j - 0.5) * width
            p50, p90 = got.ttft_p50_ms.to_numpy(float), got.ttft_p90_ms.to_numpy(float)
            ax.bar(x, p50, width, color=colour, label=name)
            ax.errorbar(x, p50, yerr=[np.zeros_like(p50), np.nan_to_num(p90 - p50)], fmt="none", ecolor="k",
                        capsize=3, lw=1)
        by = rows.set_index(["phase", "arm"]).ttft_p50_ms
        for i, phase in enumerate(phases):
            if (phase, "off") in by.index and (phase, "on") in by.index:
                top = rows[rows.phase == phase].ttft_p90_ms.max()
                ax.annotate(f"{by[phase, 'off'] / by[phase, 'on']:.1f}x", (i, top), xytext=(0, 6),
                            textcoords="offset points", ha="center", fontsize=9)
        prompt = int(rows.prompt_len.max())
        ax.set_xticks(range(len(phases)), phases)
        ax.set_ylim(0, 1.15 * np.nanmax(rows.ttft_p90_ms.to_numpy(float)))  # from 0: bar heights in proportion
        ax.set_ylabel("time to first token (ms): p50, whisker to p90")
        ax.set_title(f"{part}, prompts up to {prompt:,} tokens (off / on above)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=len(names))
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def plot_nohit_throughput(nohit: pd.DataFrame, aim: float = 0.99) -> Figure:
    """`<prefix>_nohit` (repeat, arm, tokens_per_s): output tokens/s of each repeat's pass per arm
    (left), and on over off per repeat with its median and the aim (right)."""
    fig = Figure(figsize=(11, 4))
    tput, ratio = fig.subplots(1, 2)
    for arm, (colour, name) in PREFIX_ARMS.items():
        part = nohit[nohit.arm == arm].sort_values("repeat")
        tput.plot(part.repeat, part.tokens_per_s, "o-", color=colour, label=name)
    tput.set_xlabel("repeat (arms alternate first)")
    tput.set_ylabel("output tokens/s")
    tput.set_title("output-token throughput at a 0% hit rate, one process", fontsize=9)
    tput.legend(fontsize=8)
    pairs = nohit.pivot_table(index="repeat", columns="arm", values="tokens_per_s")
    r = pairs["on"] / pairs["off"]
    ratio.plot(r.index, r.to_numpy(), "o", color="C0")
    ratio.axhline(r.median(), color="C0", lw=1, label=f"median {r.median():.3f}")
    ratio.axhline(1.0, color="k", lw=0.8, ls=":")
    ratio.axhspan(aim, 2 - aim, color="C2", alpha=0.12, label=f"within {1 - aim:.0%}")
    ratio.set_xlabel("repeat")
    ratio.set_ylabel("tokens/s, on / off")
    ratio.set_title("what prefix caching costs when nothing hits", fontsize=9)
    ratio.legend(fontsize=8)
    for ax in (tput, ratio):
        ax.set_xticks(sorted(nohit.repeat.unique()))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_shared_blocks(tables: pd.DataFrame, pool: pd.DataFrame) -> Figure:
    """Left: `tables` (request, index, block, refs, keyed): each request's block table, a cell per
    block in order, its pool block's number inside; a block held by more than one table is coloured
    by its number, one held alone is grey, and a block not yet full (not keyed) is hatched. Right:
    `pool` (moment, state, blocks): the pool's blocks by state at each moment, as stacked bars."""
    requests = list(dict.fromkeys(tables.request))
    width = int(tables["index"].max()) + 1
    fig = Figure(figsize=(13, 1.2 + 0.55 * len(requests)))
    grid, states = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.4, 1]})
    shared = sorted(set(tables.block[tables.refs > 1]))
    colour = {b: f"C{i % 10}" for i, b in enumerate(shared)}
    for r, request in enumerate(requests):
        for row in tables[tables.request == request].itertuples():
            y = -r
            grid.add_patch(Rectangle((row.index, y), 0.94, 0.86, facecolor=colour.get(row.block, "0.85"),
                                     hatch=None if row.keyed else "///", edgecolor="0.4", lw=0.5))
            grid.text(row.index + 0.47, y + 0.43, str(row.block), ha="center", va="center", fontsize=7,
                      color="white" if row.block in colour else "black")
        grid.text(-0.3, -r + 0.43, request, ha="right", va="center", fontsize=8)
    grid.set_xlim(-0.1, width)
    grid.set_ylim(-len(requests) + 0.9, 1.0)
    grid.set_axis_off()
    grid.set_title("block tables: pool block numbers; coloured = shared, hatched = partial (not keyed)", fontsize=9)
    moments = list(dict.fromkeys(pool.moment))
    bottom = np.zeros(len(moments))
    for state, c in (("held", "C0"), ("cached (free, findable)", "C2"), ("free", "0.85")):
        counts = pool[pool.state == state].set_index("moment").reindex(moments).blocks.fillna(0).to_numpy(float)
        states.barh(range(len(moments)), counts, left=bottom, color=c, label=state)
        bottom += counts
    states.set_yticks(range(len(moments)), moments, fontsize=8)
    states.invert_yaxis()
    states.set_xlabel("pool blocks")
    states.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3)
    states.set_title("the pool at each moment", fontsize=9)
    fig.tight_layout()
    return fig


def plot_front_costs(costs: pd.DataFrame) -> Figure:
    """`<prefix>_front` (prompt_len, stage, arm, us): at each prompt length, the request's host work
    before and now as two bars, each stacked from the stages in order ("both" stages in each bar),
    with the total at the bar's end."""
    from nanolab.lab.frontcosts import STAGES

    lengths = sorted(costs.prompt_len.unique())
    fig = Figure(figsize=(9, 1.0 + 1.1 * len(lengths)))
    ax = fig.subplots()
    colours = {stage: f"C{i}" for i, stage in enumerate(STAGES)}
    ticks, names = [], []
    for i, n in enumerate(lengths):
        for j, arm in enumerate(("before", "now")):
            y = i * 3 + j
            rows = costs[(costs.prompt_len == n) & costs.arm.isin([arm, "both"])].set_index("stage").us
            left = 0.0
            for stage in STAGES:
                if stage in rows:
                    ax.barh(y, rows[stage], left=left, color=colours[stage], height=0.8,
                            label=stage if (i, j) == (0, 0) else None)
                    left += rows[stage]
            ax.annotate(f"{left:,.0f} us", (left, y), xytext=(4, 0), textcoords="offset points", va="center",
                        fontsize=8)
            ticks.append(y)
            names.append(f"{n:,} ids, {arm}")
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("host work of one request (us), each stage alone on this machine")
    ax.set_xlim(0, 1.15 * ax.get_xlim()[1])
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, ncol=len(STAGES), loc="upper center", bbox_to_anchor=(0.5, 1.16), frameon=False)
    fig.tight_layout()
    return fig


def plot_read_shares(sweep: pd.DataFrame, chosen: dict[str, int]) -> Figure:
    """`<prefix>_varlen_sweep`'s reads alone at one setting of the fewest tiles a share (case, splits,
    num_stages, narrow, us; the caller picks the rows): one panel per case, µs of the read against
    its shares at the default stages (0), wide (grey) and narrow (blue) offsets, with the share
    count the engine chooses for the case (`chosen`) marked."""
    cases = list(dict.fromkeys(sweep.case))
    fig = Figure(figsize=(5.2 * len(cases), 4))
    axes = fig.subplots(1, len(cases), squeeze=False)[0]
    for ax, case in zip(axes, cases, strict=True):
        rows = sweep[(sweep.case == case) & (sweep.num_stages == 0)]
        for narrow, (colour, name) in {False: ("C7", "wide offsets (64-bit, K's and V's apart)"),
                                       True: ("C0", "narrow offsets (int32, shared)")}.items():
            part = rows[rows.narrow.astype(bool) == narrow].set_index("splits").us.sort_index()
            ax.plot(part.index, part.to_numpy(), "o-", color=colour, label=name)
        ax.axvline(chosen[case], color="k", ls=":", lw=1, label="the engine's shares in a captured step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(rows.splits.unique()), [str(int(s)) for s in sorted(rows.splits.unique())])
        ax.set_ylim(0, 1.15 * rows.us.max())
        ax.set_xlabel("shares a walk is cut into")
        ax.set_ylabel("µs a read, alone in a CUDA graph")
        ax.set_title(case, fontsize=9)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=len(names))
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def plot_read_in_step(in_step: pd.DataFrame) -> Figure:
    """Chapter 64c's table of the read inside a captured step (index case; "alone us", "step us",
    "alone us at the step's shares", "programs launched", "programs with a tile"): per case, a
    bar each for the engine's launch alone, the same read alone at the step's shares, and the
    engine's launch in the step's layout, with the share of the step's programs that exit at once
    written over the last."""
    bars = {"alone us": ("C7", "the engine's launch, alone"),
            "alone us at the step's shares": ("C2", "alone, at the shares the step takes"),
            "step us": ("C3", "the engine's launch in a captured step's layout")}
    fig = Figure(figsize=(10, 4.2))
    ax = fig.subplots()
    x = np.arange(len(in_step))
    width = 0.8 / len(bars)
    for i, (column, (colour, name)) in enumerate(bars.items()):
        ax.bar(x + (i - 1) * width, in_step[column].to_numpy(), width, color=colour, label=name)
    exiting = 1 - in_step["programs with a tile"] / in_step["programs launched"]
    for xi, (us, share) in enumerate(zip(in_step["step us"], exiting, strict=True)):
        ax.annotate(f"{share:.0%} exit", (xi + width, us), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [c.replace(" + ", "\n+ ").replace(" after", "\nafter") for c in in_step.index], fontsize=7)
    ax.set_ylabel("µs a read (one layer)")
    ax.set_ylim(0, 1.12 * in_step[list(bars)].max().max())
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(bars))  # below: over no bar
    fig.tight_layout()
    return fig


def plot_read_launches(launches: pd.DataFrame) -> Figure:
    """Chapter 64c's table of the read's two launches in a captured step's layout (index case;
    "shares", "a program a tile us", "persistent us"): per case a bar for each launch, with
    persistent over a program a tile written above the pair, and the case's shares under it."""
    bars = {"a program a tile us": ("C7", "a program for every tile the grid could need"),
            "persistent us": ("C0", "persistent programs, looping over the step's tiles")}
    fig = Figure(figsize=(10, 4.2))
    ax = fig.subplots()
    x = np.arange(len(launches))
    width = 0.38
    for i, (column, (colour, name)) in enumerate(bars.items()):
        ax.bar(x + (i - 0.5) * width, launches[column].to_numpy(), width, color=colour, label=name)
    top = launches[list(bars)].max(axis=1)
    ratio = launches["persistent us"] / launches["a program a tile us"]
    for xi, (us, r) in enumerate(zip(top, ratio, strict=True)):
        ax.annotate(f"{r:.2f}x", (xi, us), ha="center", va="bottom", fontsize=8)
    labels = [f"{case}\n({int(s)} share{'s' if s > 1 else ''})".replace(" + ", "\n+ ").replace(" after", "\nafter")
              .replace(", nothing", ",\nnothing")
              for case, s in zip(launches.index, launches["shares"], strict=True)]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("µs a read (one layer)")
    ax.set_ylim(0, 1.15 * top.max())
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=len(bars))
    fig.tight_layout()
    return fig


def plot_capture_sweep(sweep: pd.DataFrame, chosen: dict[int, int]) -> Figure:
    """`varlenbench --capture-sweep`'s table (case "N tokens after H", tokens, splits, persistent,
    us; the read's rows in a captured step's layout): a panel per cached context, us a read against
    shares for each token count, solid with persistent programs and dashed with a program a tile,
    and a ring on each count's line at the shares `chosen` (tokens -> shares) takes."""
    sweep = sweep.assign(history=sweep.case.str.split(" after ").str[1])
    histories = list(dict.fromkeys(sweep.history))
    fig = Figure(figsize=(5.2 * len(histories), 4.2))
    axes = fig.subplots(1, len(histories), squeeze=False)[0]
    for ax, history in zip(axes, histories, strict=True):
        rows = sweep[sweep.history == history]
        for i, tokens in enumerate(sorted(rows.tokens.unique())):
            for persistent, style in ((True, "-"), (False, "--")):
                line = rows[(rows.tokens == tokens) & (rows.persistent == persistent)].groupby("splits").us.min()
                ax.plot(line.index, line.to_numpy(), style, marker="o", ms=3, color=f"C{i}",
                        label=f"{tokens} tokens" if persistent else None)
            pick = chosen.get(int(tokens))
            picked = rows[(rows.tokens == tokens) & (rows.splits == pick) & (rows.persistent == (pick > 1))]
            if pick is not None and len(picked):
                ax.plot([pick], [picked.us.min()], "o", ms=10, mfc="none", color=f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlabel("shares a walk is cut into")
        ax.set_ylabel("µs a read (one layer)")
        ax.set_title(f"after {history} cached tokens", fontsize=10)
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="solid: persistent programs; dashed: a program a tile", title_fontsize=7)
    fig.tight_layout()
    return fig


def plot_ratio_runs(runs: pd.DataFrame, aim: float = 5.0) -> Figure:
    """Each prefix bench run's two TTFT ratios (`runs`: run, card, ratio ("shared prefix" or
    "second turn"), value), in the order given: a point per run and ratio, a marker per card, and
    the aim as a dashed line."""
    fig = Figure(figsize=(8.5, 3.8))
    ax = fig.subplots()
    order = list(dict.fromkeys(runs.run))
    markers = dict(zip(dict.fromkeys(runs.card), "osD^v"))
    for i, (ratio, rows) in enumerate(runs.groupby("ratio", sort=False)):
        x = [order.index(r) for r in rows.run]
        ax.plot(x, rows.value.to_numpy(), "-", color=f"C{i}", alpha=0.4)
        for card, part in rows.groupby("card", sort=False):
            ax.plot([order.index(r) for r in part.run], part.value.to_numpy(), markers[card], color=f"C{i}", ms=7,
                    label=f"{ratio}, {card}")
    ax.axhline(aim, ls="--", color="C3", lw=1)
    ax.text(len(order) - 1, aim, f" aim {aim:g}x", color="C3", va="bottom", ha="right", fontsize=9)
    ax.set_xticks(range(len(order)), order, fontsize=8, rotation=15, ha="right")
    ax.set_ylabel("TTFT p50, caching off / on")
    ax.set_ylim(0, max(aim, runs.value.max()) * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    return fig


def plot_warm_hit_ledger(ledgers: pd.DataFrame) -> Figure:
    """`prefixsteps.warm_hit_ledger` tables with a `run` column: a horizontal bar per run, its parts
    stacked in order (the host's in blues and greys, the GPU's graph in orange, each labelled with
    its ms), the run's TTFT p50 as a tick and its budget at the aim as a red line."""
    runs = list(dict.fromkeys(ledgers.run))
    parts = list(dict.fromkeys(ledgers.part))
    host_colours = iter(["#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#bdbdbd", "#969696"])
    colours = {p: "C1" if side == "GPU" else next(host_colours)
               for p, side in dict(zip(ledgers.part, ledgers.side)).items()}
    fig = Figure(figsize=(9, 1.2 + 1.0 * len(runs)))
    ax = fig.subplots()
    for y, run in enumerate(runs):
        rows = ledgers[ledgers.run == run].set_index("part")
        left = 0.0
        for p in parts:
            if p not in rows.index:
                continue
            ms = float(rows.loc[p, "ms"])
            ax.barh(y, ms, left=left, color=colours[p], edgecolor="white", label=p if y == 0 else None)
            if ms > 0.25:
                ax.text(left + ms / 2, y, f"{ms:.2f}", ha="center", va="center", fontsize=8)
            left += ms
        budget, ttft = float(rows.budget_ms.iloc[0]), float(rows.ttft_p50_ms.iloc[0])
        ax.plot([budget, budget], [y - 0.45, y + 0.45], color="C3", lw=2, label="budget at the aim" if y == 0 else None)
        ax.plot([ttft], [y + 0.48], "v", color="black", ms=6, label="TTFT p50" if y == 0 else None)
    ax.set_yticks(range(len(runs)), runs, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("ms of a warm hit's TTFT (medians of its parts)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(runs) < 3 else -0.2))
    fig.tight_layout()
    return fig
