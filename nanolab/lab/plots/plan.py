"""Day 50's figure: where the addressing is decided, and what the compiler builds."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from nanolab.lab.plots.common import box


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
        box(where_ax, x0, 0.05, 0.44, 0.62, "", "white", edge="C3", ls="--")
        where_ax.text(x0 + 0.22, 0.63, "traced region (torch.compile)", ha="center", fontsize=7.5, color="C3")
        if planned:
            box(where_ax, x0 + 0.02, 0.72, 0.40, 0.16,
                 "plan_decode (host, once per step)\ngrows tables, builds write_slots,\n"
                 "slot_mapping, context_lens, positions",
                 "#dbe9f6", fontsize=7)
            where_ax.annotate("", (x0 + 0.22, 0.58), (x0 + 0.22, 0.72), arrowprops=dict(arrowstyle="->"))
            box(where_ax, x0 + 0.03, 0.36, 0.38, 0.17, "every layer: one index_put at\nplan.write_slots", "#e6f2e6",
                 fontsize=7.5)
            box(where_ax, x0 + 0.03, 0.12, 0.38, 0.17, "every layer: read plan.slot_mapping\n(validated=True)",
                 "#e6f2e6", fontsize=7.5)
        else:
            box(where_ax, x0 + 0.03, 0.36, 0.38, 0.17,
                 "layer 0: for each row,\ngrow table; [table.slot(p) for p in\nrange(start, table.num_tokens)]",
                 "#f8dcdc", fontsize=7)
            box(where_ax, x0 + 0.03, 0.12, 0.38, 0.17,
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
