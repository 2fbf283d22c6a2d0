"""Day 65's figures: a decode step's bytes and time in bf16 and fp8 against their floors, output
tokens a second against batch size with speculation on and off, a verify step's kernels beside a
decode step's, paired rounds under load, and an fp8 prompt step's projections. Each function
takes a bench's table and returns a Figure."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

ARM_COLOURS = {"bf16": "C7", "fp8": "C0"}


def plot_fp8_steps(steps: pd.DataFrame) -> Figure:
    """`<prefix>_fp8_steps` (arm, batch, weight_bytes, kv_bytes, floor_ms, ms_per_step): the bytes a
    step must read per arm and batch (left, weights and K/V stacked), and the measured ms a step
    beside its floor (right, the floor as a hatched bar behind the measured one)."""
    fig = Figure(figsize=(11, 4))
    nbytes, ms = fig.subplots(1, 2)
    batches = sorted(steps.batch.unique())
    arms = [a for a in ARM_COLOURS if a in set(steps.arm)]
    width = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        rows = steps[steps.arm == arm].set_index("batch").reindex(batches)
        x = np.arange(len(batches)) + (j - (len(arms) - 1) / 2) * width
        colour = ARM_COLOURS[arm]
        weights, kv = rows.weight_bytes.to_numpy(float) / 1e9, rows.kv_bytes.to_numpy(float) / 1e9
        nbytes.bar(x, weights, width, color=colour, label=f"{arm} weights")
        nbytes.bar(x, kv, width, bottom=weights, color=colour, alpha=0.45, label=f"{arm} K/V")
        ms.bar(x, rows.floor_ms, width, color="none", edgecolor=colour, hatch="//", label=f"{arm} floor")
        ms.bar(x, rows.ms_per_step, width * 0.6, color=colour, label=f"{arm} measured")
        for xi, m, f in zip(x, rows.ms_per_step, rows.floor_ms, strict=True):
            ms.annotate(f"{m / f:.1f}x", (xi, m), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=8)
    for ax in (nbytes, ms):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    nbytes.set_ylabel("GB a decode step must read")
    ms.set_ylabel("ms a decode step (x its floor above)")
    nbytes.set_title("what a step reads", fontsize=9)
    ms.set_title("what a step takes, against its floor", fontsize=9)
    fig.tight_layout()
    return fig


def plot_spec_batches(batches: pd.DataFrame) -> Figure:
    """`<prefix>_spec_batches` (arm, batch, tokens_per_s, speedup_over_off): output tokens a second
    against batch size per arm (left, log-log), and speculation's speedup over off (right, the line
    at 1 where it stops paying)."""
    fig = Figure(figsize=(11, 4))
    tput, gain = fig.subplots(1, 2)
    for i, (arm, rows) in enumerate(batches.groupby("arm", sort=False)):
        rows = rows.sort_values("batch")
        tput.plot(rows.batch, rows.tokens_per_s, "o-", color=f"C{7 if arm == 'off' else i}", label=arm)
        if arm != "off":
            gain.plot(rows.batch, rows.speedup_over_off, "o-", color=f"C{i}", label=arm)
    gain.axhline(1.0, color="k", lw=1, ls="--")
    tput.set_xscale("log", base=2)
    tput.set_yscale("log")
    gain.set_xscale("log", base=2)
    tput.set_ylabel("output tokens / s")
    gain.set_ylabel("speculation's tokens / s over off")
    for ax in (tput, gain):
        ax.set_xlabel("requests at once (batch)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_fp8_tiles(tiles: pd.DataFrame, bandwidth_tb_s: float) -> Figure:
    """`<prefix>_fp8_tiles` (projection, n, k, rows, arm, us): per layer projection and batch, us a
    launch for bf16 (its step's path) and for the e4m3 weight (the best GEMV tile, and at batch 1
    inductor's compiled reduction), each beside the time its weight's bytes take at
    `bandwidth_tb_s` (a tick): a bar far above its tick is latency, not bytes."""
    rows_list = sorted(tiles.rows.unique())
    fig = Figure(figsize=(5.5 * len(rows_list), 4))
    axes = np.atleast_1d(fig.subplots(1, len(rows_list)))
    projections = list(dict.fromkeys(tiles.projection))
    for ax, m in zip(axes, rows_list, strict=True):
        t = tiles[(tiles.rows == m) & tiles.us.notna()]
        arms = {"bf16": (t[t.arm.str.startswith("bf16")], 2),
                "fp8 GEMV, best tile": (t[t.arm.str.startswith("fp8 gemv")], 1)}
        if (t.arm == "fp8 compiled reduction").any():
            arms["fp8 compiled reduction"] = (t[t.arm == "fp8 compiled reduction"], 1)
        width = 0.8 / len(arms)
        for j, (name, (sub, nbytes)) in enumerate(arms.items()):
            best = sub.groupby("projection").us.min().reindex(projections)
            shape = t.groupby("projection")[["n", "k"]].first().reindex(projections)
            x = np.arange(len(projections)) + (j - (len(arms) - 1) / 2) * width
            colour = ARM_COLOURS["bf16"] if name == "bf16" else f"C{j - 1}"
            ax.bar(x, best, width, color=colour, label=name)
            floor_us = shape.n * shape.k * nbytes / (bandwidth_tb_s * 1e6)
            ax.scatter(x, floor_us, marker="_", s=200, color="k", zorder=3,
                       label="its bytes at the copy bandwidth" if j == 0 else None)
        _projection_axes(ax, projections, "us a launch, chained in a graph", f"{m} row{'s' if m > 1 else ''}")
    fig.tight_layout()
    return fig


def _projection_axes(ax, projections: list[str], ylabel: str, title: str) -> None:
    """A panel of bars a layer projection: its ticks, labels, grid and legend."""
    ax.set_xticks(range(len(projections)), projections)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot_verify_kernels(kernels: pd.DataFrame) -> Figure:
    """`<prefix>_spec_verify_kernels` tables with a `run` column (arm "decode" or "verify", batch,
    class, us_per_step): us of GPU kernels a step by class, one stacked bar per batch, run and arm,
    so a verify step on each path stands beside the decode step of its run. One panel a batch."""
    classes = list(dict.fromkeys(kernels.sort_values("us_per_step", ascending=False)["class"]))
    batches = sorted(kernels.batch.unique())
    most = max(len(set(zip(g.run, g.arm))) for _, g in kernels.groupby("batch"))
    fig = Figure(figsize=(5.5 * len(batches), 1.6 + 0.55 * most))
    axes = np.atleast_1d(fig.subplots(1, len(batches)))
    for ax, batch in zip(axes, batches, strict=True):
        rows = kernels[kernels.batch == batch]
        bars = list(dict.fromkeys(zip(rows.run, rows.arm)))
        totals = rows.pivot_table(index=["run", "arm"], columns="class", values="us_per_step", aggfunc="sum",
                                  sort=False).reindex(index=pd.MultiIndex.from_tuples(bars), columns=classes)
        totals = totals.fillna(0.0)
        left = np.zeros(len(bars))
        for i, cls in enumerate(classes):
            ax.barh(range(len(bars)), totals[cls], left=left, color=f"C{i}", label=cls)
            left += totals[cls].to_numpy()
        for y, total in enumerate(left):
            ax.annotate(f"{total:,.0f} us", (total, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=8)
        ax.set_yticks(range(len(bars)), [f"{arm}\n({run})" for run, arm in bars], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("us of GPU kernels a step")
        ax.set_title(f"batch {batch}, 4 drafts a row", fontsize=9)
        ax.set_xlim(0, left.max() * 1.2)
        ax.grid(alpha=0.3, axis="x")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(classes), 4), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    return fig


def plot_specload_rules(rules: pd.DataFrame) -> Figure:
    """`day65specload_rules` (run, rules, arm, rate, itl_p50_ms; the plain arm "fullgraphs"): per
    run of the load, the speculating server's ITL p50 over the plain one's against the offered
    rate, one line a run labelled with its switch-off rules; the dashed line at 1 is the aim."""
    fig = Figure(figsize=(8, 4.8))
    ax = fig.subplots()
    for run, rows in rules.groupby("run"):
        itl = rows.pivot_table(index="rate", columns="arm", values="itl_p50_ms")
        spec = [c for c in itl.columns if c != "fullgraphs"][0]
        ax.plot(itl.index, itl[spec] / itl["fullgraphs"], "o-", color=f"C{run}", label=rows.rules.iloc[0])
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xlabel("offered requests / s")
    ax.set_ylabel("ITL p50, speculating over plain")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: the lines fill the axes
    fig.tight_layout()
    return fig


def plot_round_ratios(rounds: pd.DataFrame) -> Figure:
    """`graphbench --rounds` (round, arm, rate, itl_p50_ms, tpot_p50_ms; plain arms and their
    "+ngram" arms): per round, each speculating server's ITL p50 and TPOT p50 over its plain
    server's on the same stream, each round a dot, the median a bar, one colour a speculating arm;
    the dashed line at 1 is the ITL aim."""
    from nanolab.lab.serveprocess import split_speculation

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    pairs = [(arm, split_speculation(arm)[0]) for arm in rounds.arm.unique() if split_speculation(arm)[1]]
    width = 0.5 / len(pairs)
    for j, (spec, base) in enumerate(pairs):
        for i, (metric, name) in enumerate((("itl_p50_ms", "ITL p50"), ("tpot_p50_ms", "TPOT p50"))):
            table = rounds.pivot_table(index="round", columns="arm", values=metric)
            ratio = table[spec] / table[base]
            centre = i + (j - (len(pairs) - 1) / 2) * width
            x = centre + np.linspace(-0.3, 0.3, len(ratio)) * width
            label = (f"{spec} over {base}, a round each" if len(pairs) > 1 else f"{name}, a round each") \
                if i == 0 or len(pairs) == 1 else None
            colour = f"C{j}" if len(pairs) > 1 else f"C{i}"
            ax.plot(x, ratio, "o", color=colour, label=label)
            ax.hlines(ratio.median(), centre - width / 2, centre + width / 2, color=colour, lw=2.5)
    ax.axhline(1.0, color="k", lw=1, ls="--")
    ax.set_xticks([0, 1], ["ITL p50", "TPOT p50"])
    ax.set_xlim(-0.6, 1.6)
    ax.set_ylabel("speculating over plain, same stream")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)  # below: never over a dot
    fig.tight_layout()
    return fig


def plot_prompt_step_ms(runs: pd.DataFrame, prompt_set: str) -> Figure:
    """specbench's per-prompt table (`day65*_spec`: set, arm, prompt, decode_step_ms,
    verify_step_ms): for one prompt set, each arm's median plain and verify step time a prompt, one
    line an arm, so a prompt whose steps all ran slow stands out against the arms that ran it at
    the usual cost."""
    part = runs[runs.set == prompt_set]
    fig = Figure(figsize=(9, 4))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, column, title in zip(axes, ("decode_step_ms", "verify_step_ms"), ("plain steps", "verify steps"),
                                 strict=True):
        for j, (arm, rows) in enumerate(part.groupby("arm", sort=False)):
            if rows[column].notna().any():
                ax.plot(rows.prompt, rows[column], "o-", color=f"C{j}", label=arm)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("prompt")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms a step, median over the prompt")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_fp8_prefill(table: pd.DataFrame, arms: dict[str, str]) -> Figure:
    """`<prefix>_fp8_prefill` (projection, tokens, arm, us): per token count, us a launch of each
    layer projection for the arms named in `arms` (its arm -> its label), bars side by side, each
    arm's sum over a layer in its legend entry."""
    counts = sorted(table.tokens.unique())
    fig = Figure(figsize=(5.5 * len(counts), 4))
    axes = np.atleast_1d(fig.subplots(1, len(counts)))
    projections = list(dict.fromkeys(table.projection))
    width = 0.8 / len(arms)
    for ax, m in zip(axes, counts, strict=True):
        t = table[table.tokens == m]
        for j, (arm, name) in enumerate(arms.items()):
            us = t[t.arm == arm].set_index("projection").us.reindex(projections)
            x = np.arange(len(projections)) + (j - (len(arms) - 1) / 2) * width
            ax.bar(x, us, width, color=ARM_COLOURS["bf16"] if arm.startswith("bf16") else f"C{j}",
                   label=f"{name}: {us.sum():.0f} us a layer")
        _projection_axes(ax, projections, "us a launch", f"{m} tokens")
    fig.tight_layout()
    return fig


def plot_lookup_rules(table: pd.DataFrame) -> Figure:
    """`chained_settings` rows with a `rule` column (set, k, rule, verify_steps, speedup_chained):
    a panel per set, a group of bars per k, one bar per rule to its predicted speedup over plain
    greedy, each labelled with its verify steps."""
    sets = list(dict.fromkeys(table.set))
    rules = list(dict.fromkeys(table.rule))
    fig = Figure(figsize=(5.4 * len(sets), 4.0))
    axes = fig.subplots(1, len(sets), squeeze=False)[0]
    width = 0.8 / len(rules)
    for ax, name in zip(axes, sets, strict=True):
        rows = table[table.set == name]
        ks = sorted(rows.k.unique())
        for j, rule in enumerate(rules):
            got = rows[rows.rule == rule].set_index("k").reindex(ks)
            x = np.arange(len(ks)) + (j - (len(rules) - 1) / 2) * width
            bars = ax.bar(x, got.speedup_chained, width, color=f"C{j}", label=rule)
            for bar, steps in zip(bars, got.verify_steps, strict=True):
                ax.annotate(f"{steps:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 2),
                            textcoords="offset points", ha="center", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
        ax.set_ylim(0, 1.15 * table.speedup_chained.max())
        ax.set_ylabel("predicted speedup over plain greedy")
        ax.set_title(f"{name}: verify steps above each bar", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, loc="upper center", ncol=len(names))
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig
