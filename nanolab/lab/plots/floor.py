"""Day 61's figures: the levers as a waterfall of one decode step, nanolab and its peers against the
bandwidth floor, the projections alone against cuBLAS, the server's ITL with chunked prefill on
and off, and what the GPU runs between two decode steps. Each takes the committed tables as they
are saved (`lab.leverrun`, `lab.gemvbench`, `lab.floorbench`, `lab.graphbench`, `lab.steploop`)
and returns a Figure.
The figures are made without pyplot, so a notebook shows each once, where it calls `show`, and
not again at the end of the cell."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from nanolab.lab.plots.common import log_batch_axes
from nanolab.lab.plots.serving import SERVING_ARMS

# The waterfall's parts, bottom to top, each always in the same colour: the GPU's kernel classes
# (`stepparts.KERNEL_CLASSES`) under the host's share, which is grey.
PARTS = {
    "projections": "#4c72b0",
    "attention read": "#55a868",
    "norms": "#8172b2",
    "fused by inductor": "#ccb974",
    "copies and indexing": "#c44e52",
    "other elementwise": "#dd8452",
    "sampling": "#64b5cd",
    "host (GPU idle)": "0.82",
}
FLOOR_ARMS = {"nanolab": ("C0", "o"), "gpt-fast": ("C2", "^"), "hf-default": ("C1", "s"), "hf-eager": ("C7", "D")}
PROJECTION_ARMS = (("cublas", "cuBLAS (F.linear)", "0.45"), ("gemv", "Triton GEMV, default tiles", "C1"),
                   ("best gemv", "Triton GEMV, best of the sweep", "C3"))


def plot_lever_waterfall(parts: pd.DataFrame, floor_ms: float, target_ms: float,
                         replay_ms: Mapping[str, float] | None = None):
    """One stacked bar per arm (columns arm, part, ms; arms in the order they appear): the step's
    ms by kernel class with the host's share on top, each part in its `PARTS` colour. Dashed: the
    floor; dotted: the target. `replay_ms` (by arm), when given, marks the graph's replay alone."""
    unknown = set(parts.part) - set(PARTS)
    assert not unknown, f"parts without a colour: {sorted(unknown)}"
    arms = list(dict.fromkeys(parts.arm))
    ms = parts.pivot_table(index="arm", columns="part", values="ms", aggfunc="sum").reindex(arms).fillna(0.0)
    fig = Figure(figsize=(max(10.0, 2.0 + 1.2 * len(arms)), 5.6))
    ax = fig.subplots()
    x = np.arange(len(arms))
    bottom = np.zeros(len(arms))
    for part, colour in PARTS.items():
        if part not in ms:
            continue
        heights = ms[part].to_numpy()
        ax.bar(x, heights, 0.6, bottom=bottom, color=colour, edgecolor="white", linewidth=0.6, label=part,
               hatch="//" if part.startswith("host") else None)
        for i, (h, b) in enumerate(zip(heights, bottom, strict=True)):
            if h >= 0.05:
                ax.text(x[i], b + h / 2, f"{h:.2f}", ha="center", va="center", fontsize=7.5)
        bottom += heights
    for i, total in enumerate(bottom):  # above the bar and above its replay tick, whichever is higher
        top = max(total, (replay_ms or {}).get(arms[i], 0.0))
        ax.text(x[i], top + 0.02, f"{total:.2f} ms", ha="center", va="bottom", fontsize=9, weight="bold")
    if replay_ms is not None:
        ticks = [(i, replay_ms[arm]) for i, arm in enumerate(arms) if arm in replay_ms]
        ax.hlines([r for _, r in ticks], [i - 0.38 for i, _ in ticks], [i + 0.38 for i, _ in ticks], color="k",
                  lw=1.6, label="the graph's replay alone (GPU time)")
    ax.axhline(floor_ms, color="k", ls="--", lw=1, label=f"floor: the bytes a step must read ({floor_ms:.2f} ms)")
    ax.axhline(target_ms, color="C3", ls=":", lw=1.5, label=f"target ({target_ms:.2f} ms)")
    ax.set_xticks(x, [textwrap.fill(a, 13) for a in arms], fontsize=9)  # wrapped, not overlapping
    ax.set_ylim(0, bottom.max() * 1.12)
    ax.set_ylabel("ms per decode step")
    ax.set_title("one decode step, lever by lever (each arm keeps the levers to its left)", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _compiles_panel(ax, spread: pd.DataFrame, arms: list[str], target_ms: float) -> None:
    """Each fresh compile's batch-1 ms per step as a dot in its arm's column, a bar at each arm's
    median, the target dotted."""
    for i, arm in enumerate(arms):
        ms = spread[spread.arm == arm].ms_per_step
        ax.plot(np.full(len(ms), i), ms, "o", color="C0", alpha=0.75)
        ax.hlines(ms.median(), i - 0.25, i + 0.25, color="k", lw=2)
    ax.axhline(target_ms, color="C3", ls=":", lw=1.5, label=f"target ({target_ms:.2f} ms)")
    ax.set_ylabel("batch-1 ms per decode step")
    ax.set_title("the same step, compiled afresh: one dot a compile, bar at the median", fontsize=9)
    ax.legend(fontsize=8)


def _arm_columns(axes, arms: list[str]) -> None:
    for ax in axes:
        ax.set_xticks(range(len(arms)), [textwrap.fill(a.removeprefix("+ "), 16) for a in arms], fontsize=8)
        ax.set_xlim(-0.6, len(arms) - 0.4)
        ax.grid(axis="y", alpha=0.3)


def plot_tuning_spread(spread: pd.DataFrame, head: pd.DataFrame, target_ms: float) -> Figure:
    """Two panels, one column per arm (in the order they appear in `spread`): each fresh compile's
    batch-1 ms per step (columns arm, trial, ms_per_step), a bar at the median, the target dotted;
    and each compile's LM head in us per step (`tuningspread.once_a_step`'s columns), cuBLAS's kernels
    (named nvjet) as squares, inductor's reductions as dots."""
    arms = list(dict.fromkeys(spread.arm))
    fig = Figure(figsize=(11, 4.4))
    step_ax, head_ax = fig.subplots(1, 2)
    _compiles_panel(step_ax, spread, arms, target_ms)
    for i, arm in enumerate(arms):
        us = head[head.arm == arm]
        cublas = us.kernel.str.contains("nvjet")
        head_ax.plot(np.full(int(cublas.sum()), i), us[cublas].us_per_step, "s", color="0.35", alpha=0.8)
        head_ax.plot(np.full(int((~cublas).sum()), i), us[~cublas].us_per_step, "o", color="C1", alpha=0.8)
    head_ax.set_ylabel("LM head, us per step")
    head_ax.set_ylim(0, None)
    head_ax.set_title("its LM head: cuBLAS (squares) or inductor's tuned reduction (dots)", fontsize=9)
    _arm_columns((step_ax, head_ax), arms)
    fig.tight_layout()
    return fig


def plot_kernel_draws(spread: pd.DataFrame, kernel: pd.DataFrame, target_ms: float, kernel_name: str,
                      marked: str) -> Figure:
    """Two panels, one column per arm (in the order they appear in `spread`): each fresh compile's
    batch-1 ms per step (columns arm, trial, ms_per_step), a bar at the median, the target dotted;
    and one kernel of the same compiles in us per step (columns arm, trial, us_per_step, config),
    squares where tuning chose the config `marked`, dots where it chose another."""
    arms = list(dict.fromkeys(spread.arm))
    fig = Figure(figsize=(11, 4.4))
    step_ax, kernel_ax = fig.subplots(1, 2)
    _compiles_panel(step_ax, spread, arms, target_ms)
    for i, arm in enumerate(arms):
        us = kernel[kernel.arm == arm]
        hit = us.config == marked
        kernel_ax.plot(np.full(int(hit.sum()), i), us[hit].us_per_step, "s", color="C2", alpha=0.85,
                       label=None if i else textwrap.fill(f"tuned to {marked}", 40))
        kernel_ax.plot(np.full(int((~hit).sum()), i), us[~hit].us_per_step, "o", color="C1", alpha=0.85,
                       label=None if i else "tuned to another config")
    kernel_ax.set_ylabel(f"{kernel_name}, us per step")
    kernel_ax.set_ylim(0, None)
    kernel_ax.set_title(f"its {kernel_name}, by the config tuning chose", fontsize=9)
    kernel_ax.legend(fontsize=8, loc="lower right")
    _arm_columns((step_ax, kernel_ax), arms)
    fig.tight_layout()
    return fig


def lever_run_waterfall(levers: pd.DataFrame, parts: pd.DataFrame, target_ms: float, batch: int = 1) -> Figure:
    """`plot_lever_waterfall` of a lever run as `leverrun.show_lever_run` returns it (its table, and
    the parts by arm of its smallest profiled batch, `batch`), with that batch's floor and each
    arm's replay at the shortest context."""
    rows = levers[levers.batch == batch]
    rows = rows[rows.context == rows.context.min()].set_index("arm")
    return plot_lever_waterfall(parts.reset_index().melt(id_vars="part", var_name="arm", value_name="ms"),
                                float(rows.floor_ms.iloc[0]), target_ms, replay_ms=rows.replay_ms.to_dict())


def plot_floor_roofline(floor: pd.DataFrame, roofline: pd.DataFrame):
    """Two panels against batch, one line per arm of the floor bench (its `label`): ms per decode
    step, and the same over the floor. The shortest context is drawn as lines with the floor
    (dashed) and the targets (red x); each longer context as hollow markers at its batch."""
    short = roofline.context.min()
    fig = Figure(figsize=(13, 5))
    ms_ax, x_ax = fig.subplots(1, 2)
    for arm, part in floor.groupby("arm", sort=False):
        colour, marker = FLOOR_ARMS.get(arm, ("C5", "v"))
        name = part.label.iloc[0] if "label" in part else arm
        line, rest = part[part.context == short].sort_values("batch"), part[part.context != short]
        for ax, col in ((ms_ax, "ms_per_step"), (x_ax, "x_floor")):
            ax.plot(line.batch, line[col], color=colour, marker=marker, label=name)
            ax.scatter(rest.batch, rest[col], marker=marker, facecolors="white", edgecolors=colour, s=55, zorder=3)
    base = roofline[roofline.context == short].sort_values("batch")
    ms_ax.plot(base.batch, base.floor_ms, color="k", ls="--", lw=1, label=f"floor (context {short})")
    ms_ax.scatter(base.batch, base.target_ms, marker="x", color="C3", s=60, zorder=4, label="target")
    x_ax.axhline(1, color="k", ls="--", lw=1, label="the floor")
    x_ax.scatter(base.batch, base.target_ms / base.floor_ms, marker="x", color="C3", s=60, zorder=4,
                 label="target")
    for _, r in roofline[roofline.context != short].iterrows():
        ms_ax.scatter([r.batch], [r.floor_ms], marker="_", color="k", s=300, zorder=4)
        ms_ax.scatter([r.batch], [r.target_ms], marker="x", color="C3", s=60, zorder=4)
        x_ax.scatter([r.batch], [r.target_ms / r.floor_ms], marker="x", color="C3", s=60, zorder=4)
        ms_ax.annotate(f"context {r.context:,}", (r.batch, r.floor_ms), textcoords="offset points", xytext=(8, -4),
                       fontsize=7.5)
    log_batch_axes(ms_ax, floor.batch, "ms per decode step")
    log_batch_axes(x_ax, floor.batch, "ms per step / floor")
    for ax in (ms_ax, x_ax):
        ax.set_yticks([0.5, 1, 2, 5, 10, 20], ["0.5", "1", "2", "5", "10", "20"])
        ax.grid(alpha=0.3, which="both")
    ms_ax.set_title(f"decode step at context {short} (lines); hollow: a longer context at its batch", fontsize=9)
    x_ax.set_title("how far above the floor (1 = every byte read once at the measured bandwidth)", fontsize=9)
    handles, labels = ms_ax.get_legend_handles_labels()
    # Hung from the top of the strip tight_layout leaves free, so it ends above the caption that
    # `report.caption_figure` hangs below y=0.
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.1), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def best_of_sweep(projections: pd.DataFrame) -> pd.DataFrame:
    """Per projection and rows, in the table's order: cuBLAS's microseconds, the GEMV's with its
    default tiles (`gemv`), and the fastest GEMV measured (`best gemv`, its tiles in `best tiles`:
    the sweep's best where one ran, else the default), each also over cuBLAS's."""
    keys = ["projection", "rows"]
    gemv = projections[projections.arm.str.startswith("gemv")]
    table = projections[projections.arm.isin(("cublas", "gemv"))].pivot_table(index=keys, columns="arm", values="us")
    fastest = gemv.loc[gemv.groupby(keys).us.idxmin()].set_index(keys)
    table["best gemv"], table["best tiles"] = fastest.us, fastest.arm
    for arm in ("gemv", "best gemv"):
        table[f"{arm} / cublas"] = table[arm] / table["cublas"]
    order = pd.MultiIndex.from_frame(projections[keys].drop_duplicates())
    return table.reindex(order).reset_index()


def plot_projections(projections: pd.DataFrame, rows: Sequence[int] = (1, 16)):
    """One panel per row count in `rows`: each projection's time alone relative to cuBLAS's (1 is
    a tie, below 1 the GEMV wins), for the Triton GEMV with its default tiles and the fastest of
    its sweep. The tick under each projection gives its [N, K] and cuBLAS's microseconds."""
    table = best_of_sweep(projections)
    fig = Figure(figsize=(6.2 * len(rows), 4.6))
    axes = fig.subplots(1, len(rows), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], rows, strict=True):
        part = table[table.rows == m]
        shapes = projections.drop_duplicates("projection").set_index("projection")
        x = np.arange(len(part))
        width = 0.27
        for j, (arm, name, colour) in enumerate(PROJECTION_ARMS):
            rel = part[arm] / part["cublas"]
            ax.bar(x + (j - 1) * width, rel, width, color=colour, label=name)
            for xi, v in zip(x, rel, strict=True):
                ax.text(xi + (j - 1) * width, v + 0.01, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
        ax.axhline(1, color="k", lw=1)
        ax.set_xticks(x, [f"{p}\n{shapes.n[p]}x{shapes.k[p]}\n{us:.1f} us" for p, us in
                          zip(part.projection, part.cublas, strict=True)], fontsize=8)
        ax.set_title(f"{m} row{'s' if m > 1 else ''} against the weight, L2 flushed before every launch", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_ylabel("time / cuBLAS's time")
    axes[0, 0].set_ylim(0, table[table.rows.isin(rows)]["gemv / cublas"].max() * 1.2)
    axes[0, 0].legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def plot_chunked_itl(rates: pd.DataFrame, aim: float = 3.0):
    """Graphbench's ITL p50 (left) and p99 (right), one bar per arm at each offered rate. On the
    p99 panel a black tick over each bar marks `aim` x that arm's p50 at that rate: the tail's aim."""
    arms = list(dict.fromkeys(rates.arm))
    values = sorted(rates.rate.unique())
    fig = Figure(figsize=(11, 4.4))
    axes = fig.subplots(1, 2)
    width = 0.8 / len(arms)
    x = np.arange(len(values))
    by = rates.set_index(["arm", "rate"])
    for ax, col, name in ((axes[0], "itl_p50_ms", "p50"), (axes[1], "itl_p99_ms", "p99")):
        for j, arm in enumerate(arms):
            colour = SERVING_ARMS.get(arm, ("C5", "v"))[0]
            heights = [by.loc[(arm, r), col] for r in values]
            offset = x + (j - (len(arms) - 1) / 2) * width
            ax.bar(offset, heights, width * 0.95, color=colour, label=arm)
            for xi, h in zip(offset, heights, strict=True):
                ax.text(xi, h, f"{h:.2f}" if name == "p50" else f"{h:.1f}", ha="center", va="bottom", fontsize=8)
            if name == "p99":
                ticks = [aim * by.loc[(arm, r), "itl_p50_ms"] for r in values]
                ax.hlines(ticks, offset - width * 0.45, offset + width * 0.45, color="k", lw=2,
                          label=f"aim: {aim:g} x p50" if j == 0 else None)
        ax.set_xticks(x, [f"{r:g} req/s" for r in values])
        ax.set_ylabel(f"ITL {name} (ms)")
        ax.set_title(f"inter-token latency, {name}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_folds(folds: pd.DataFrame, removed_us: Mapping[str, float] | None = None) -> Figure:
    """`gemvbench.fold_table`: one panel per row count, a pair of bars per projection and fold, the
    plain GEMV's us per launch (grey) beside the same GEMV with the fold inside it (red), what
    the fold added written over it. `removed_us`, by fold, is the kernel that fold takes out of the
    step: drawn as a dashed line at the grey bar plus it, where the red bar must stay to pay."""
    rows = sorted(folds.rows.unique())
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, len(rows), sharey=True, squeeze=False)[0]
    for ax, m in zip(axes, rows, strict=True):
        at = folds[folds.rows == m]
        plain = at[at.fold == "none"].set_index("projection").us
        folded = at[at.fold != "none"]
        x = np.arange(len(folded))
        ax.bar(x - 0.2, [plain[p] for p in folded.projection], 0.4, color="0.7", label="GEMV alone")
        ax.bar(x + 0.2, folded.us, 0.4, color="C3", label="with the fold inside")
        for xi, (us, added) in enumerate(zip(folded.us, folded.us_added, strict=True)):
            ax.text(xi + 0.2, us, f"+{added:.1f}", ha="center", va="bottom", fontsize=8)
        if removed_us:
            marked = [(xi, plain[p] + removed_us[f]) for xi, (p, f) in enumerate(zip(folded.projection, folded.fold,
                                                                                     strict=True)) if f in removed_us]
            ax.hlines([y for _, y in marked], [xi - 0.4 for xi, _ in marked], [xi + 0.4 for xi, _ in marked],
                      color="k", lw=1.5, ls="--", label="alone + the kernel the fold removes")
        ax.set_xticks(x, [f"{p}\n{f}" for p, f in zip(folded.projection, folded.fold, strict=True)], fontsize=8)
        ax.set_title(f"{m} rows", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("us per launch (back to back, PDL)")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def plot_mixed_steps(traces: Mapping[str, pd.DataFrame], step_ms: float | None = None) -> Figure:
    """Each mixed step of a graphbench step trace (`phase` "mixed") as a point, its ms against the
    tokens it fed, one colour per trace (`traces`: its name -> the trace rows); `step_ms`, where
    given, a dashed line at the server's median step (graphbench's `server_step_p50_ms`)."""
    fig = Figure(figsize=(8, 4.2))
    ax = fig.subplots()
    for i, (name, trace) in enumerate(traces.items()):
        mixed = trace[trace.phase == "mixed"]
        ax.scatter(mixed.tokens, mixed.ms, s=18, color=f"C{i}", alpha=0.75,
                   label=f"{name}: median {mixed.ms.median():.1f} ms")
    if step_ms is not None:
        ax.axhline(step_ms, color="k", ls="--", lw=1, label=f"the server's median step ({step_ms:.1f} ms)")
    ax.set_xlabel("tokens the mixed step fed (decode rows and prompt chunks)")
    ax.set_ylabel("step (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_mixed_anatomy(anatomy: pd.DataFrame, kernels: pd.DataFrame | None = None) -> Figure:
    """`day61_mixed_anatomy`'s mixed steps, one bar each per arm: the host's time inside the varlen
    forward, sampling with its read-back, and the rest of the step, stacked; a black tick at the
    forward's span on the GPU; and, from `day61_mixed_kernels` where given, a red tick at the
    GPU's summed kernel time for its profiled prompt. A dashed line marks each arm's decode step."""
    mixed = anatomy[anatomy.phase == "mixed"]
    arms = list(dict.fromkeys(mixed.arm))
    fig = Figure(figsize=(8.5, 1.8 + 0.8 * len(mixed)))
    axes = fig.subplots(len(arms), 1, sharex=True, squeeze=False)[:, 0]
    parts = [("forward_host_ms", "host inside the varlen forward", "C0"),
             ("sample_ms", "sampling and read-back", "C1"), ("rest_ms", "rest of the step", "C7")]
    busy = {} if kernels is None else kernels.groupby(["arm", "prompt_len"]).us_per_step.sum() / 1000
    for ax, arm in zip(axes, arms, strict=True):
        rows = mixed[mixed.arm == arm].reset_index(drop=True)
        y = range(len(rows))
        left = [0.0] * len(rows)
        for col, label, colour in parts:
            ax.barh(y, rows[col], left=left, color=colour, label=label, height=0.6)
            left = [a + b for a, b in zip(left, rows[col], strict=True)]
        ax.scatter(rows.forward_span_ms, y, marker="|", s=400, color="k", label="the forward's span on the GPU")
        gpu = [busy.get((arm, p), float("nan")) if c == 0 else float("nan")
               for p, c in zip(rows.prompt_len, rows.chunk, strict=True)]
        ax.scatter(gpu, y, marker="|", s=400, color="C3", label="its kernels' summed time (profiled prompt)")
        decode = anatomy[(anatomy.arm == arm) & (anatomy.phase == "decode")].step_ms
        if len(decode):
            ax.axvline(float(decode.iloc[0]), color="k", ls="--", lw=1, label="a decode step of the same rows")
        ax.set_yticks(list(y), [f"{p:,}-token prompt, chunk {c} ({t:,} tokens)"
                                for p, c, t in zip(rows.prompt_len, rows.chunk, rows.tokens.astype(int), strict=True)],
                      fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{arm} mixed steps", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


def between_steps_timeline(ops: pd.DataFrame) -> pd.DataFrame:
    """`day61_loop_ops`'s rows for one step (order, stream, us, gap_us, each gap from the end of what
    ran before) with `start_us` and `end_us` from the replay's end: each starts its gap after the
    latest end so far, and a negative gap overlaps it on another stream."""
    t, starts = 0.0, []
    for row in ops.sort_values("order").itertuples():
        starts.append(t + row.gap_us)
        t = max(t, starts[-1] + row.us)
    out = ops.sort_values("order").assign(start_us=starts)
    return out.assign(end_us=out.start_us + out.us)


def _op_label(op: str) -> str:
    if op.startswith("Memcpy"):  # "Memcpy HtoD (Pinned -> Device)" -> "HtoD"
        return op.split()[1]
    return op


def plot_between_steps(ops: pd.DataFrame, loop: pd.DataFrame, batch: int) -> Figure:
    """What the GPU runs from one replay's end to the next replay's start at `batch`, one panel per
    variant (`day61_between_loop_ops` and `day61_between_loop`, in the order the variants appear):
    each operation a bar on its stream's lane (kernels blue, copies by direction), at the times
    `between_steps_timeline` gives, and a dashed line at the median start of the next replay."""
    ops = ops[ops.batch == batch]
    variants = list(dict.fromkeys(ops.variant))
    colours = {"kernel": "C0", "HtoD": "C1", "DtoH": "C2", "DtoD": "C7"}
    fig = Figure(figsize=(8.5, 1.4 + 1.5 * len(variants)))
    axes = fig.subplots(len(variants), 1, sharex=True, squeeze=False)[:, 0]
    right = 0.0
    for ax, variant in zip(axes, variants, strict=True):
        steps = between_steps_timeline(ops[ops.variant == variant])
        streams = list(dict.fromkeys(steps.stream))
        for row in steps.itertuples():
            label = _op_label(row.op)
            lane = streams.index(row.stream)
            colour = colours["kernel"] if row.kind == "kernel" else colours.get(label, "C3")
            ax.barh(lane, row.us, left=row.start_us, height=0.5, color=colour, edgecolor="k", lw=0.5)
            ax.text(row.start_us, lane - 0.3, label, ha="left", va="bottom", fontsize=6.5, rotation=25)
        right = max(right, float(steps.end_us.max()))
        next_start = loop[(loop.variant == variant) & (loop.batch == batch)].between_us
        if len(next_start):
            x = float(next_start.iloc[0])
            right = max(right, x)
            ax.axvline(x, color="k", ls="--", lw=1)
            ax.text(x + 0.3, len(streams) - 0.55, f"next replay starts: {x:.1f} us", fontsize=7, va="bottom")
        ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams], fontsize=7)
        ax.set_ylim(len(streams) - 0.5, -1.2)
        ax.set_title(variant, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, right + 8)
    axes[-1].set_xlabel(f"us after the last kernel of a batch-{batch} replay")
    fig.tight_layout()
    return fig


def plot_mixed_host(host: pd.DataFrame) -> Figure:
    """`day61_mixed_host`: the host's us inside an eager mixed step's `run_varlen` by part, one bar
    per prompt length in each part's row, parts ordered by their time at the longest prompt, each
    labelled with its calls a step (the longest prompt's), the largest at the top."""
    prompts = sorted(host.prompt_len.unique())
    order = host[host.prompt_len == prompts[-1]].sort_values("us").part.tolist()
    fig = Figure(figsize=(8.5, 1.5 + 0.32 * len(order)))
    ax = fig.subplots()
    height = 0.8 / len(prompts)
    for i, prompt_len in enumerate(prompts):
        rows = host[host.prompt_len == prompt_len].set_index("part").reindex(order)
        y = np.arange(len(order)) + (i - (len(prompts) - 1) / 2) * height
        tokens = int(rows.tokens.dropna().iloc[0])
        ax.barh(y, rows.us / 1000, height=height, color=f"C{i}", label=f"{prompt_len}-token prompt ({tokens} tokens)")
    calls = host[host.prompt_len == prompts[-1]].set_index("part").calls.reindex(order)
    ax.set_yticks(np.arange(len(order)), [f"{p}  (x{int(c)})" for p, c in zip(order, calls, strict=True)], fontsize=7)
    ax.set_xlabel("ms of host time a mixed step, each part's own (calls a step in brackets)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
