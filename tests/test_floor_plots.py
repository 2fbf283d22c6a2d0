"""Day 61's figures, drawn from small synthetic tables shaped like the committed ones: each draws
what it should (bars, lines, labels), and the sweep's best is the fastest GEMV measured. The
figures never touch pyplot, so no backend is chosen here."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import LineCollection
from matplotlib.patches import Rectangle

from nanolab.lab.plots.floor import (
    PARTS,
    best_of_sweep,
    between_steps_timeline,
    plot_between_steps,
    plot_chunked_itl,
    plot_floor_roofline,
    plot_folds,
    plot_kernel_draws,
    plot_lever_waterfall,
    plot_mixed_anatomy,
    plot_mixed_host,
    plot_mixed_steps,
    plot_projections,
    plot_tuning_spread,
)
from nanolab.lab.tuningspread import once_a_step


def bars(ax) -> list[Rectangle]:
    return [p for c in ax.containers for p in c.patches]


def legend_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def hline_ys(ax) -> list[float]:
    return [ln.get_ydata()[0] for ln in ax.get_lines() if len(set(ln.get_ydata())) == 1]


def test_waterfall_stacks_each_arm_in_the_fixed_order():
    parts = pd.DataFrame([
        ("before", "projections", 0.8), ("before", "other elementwise", 0.2), ("before", "host (GPU idle)", 0.4),
        ("after", "projections", 0.8), ("after", "fused by inductor", 0.1), ("after", "host (GPU idle)", 0.1),
    ], columns=["arm", "part", "ms"])
    fig = plot_lever_waterfall(parts, floor_ms=0.6, target_ms=1.0, replay_ms={"before": 1.0, "after": 0.9})
    (ax,) = fig.axes
    assert len(bars(ax)) == 2 * 4  # one bar per arm for each of the four parts present (zero where absent)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["before", "after"]
    # Stacks: each arm's bars add up to its step, and the parts sit in PARTS order, bottom to top.
    tops = {}
    for rect in bars(ax):
        arm = round(rect.get_x() + rect.get_width() / 2)
        tops[arm] = max(tops.get(arm, 0.0), rect.get_y() + rect.get_height())
    assert tops == pytest.approx({0: 1.4, 1: 1.0})
    labels = legend_texts(ax)
    present = [p for p in PARTS if p in set(parts.part)]
    assert [lb for lb in labels if lb in PARTS] == present[::-1]  # the legend reads top of the stack first
    assert any(lb.startswith("floor") for lb in labels) and any(lb.startswith("target") for lb in labels)
    assert sorted(hline_ys(ax)) == pytest.approx([0.6, 1.0])
    (replay,) = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert [seg[0][1] for seg in replay.get_segments()] == pytest.approx([1.0, 0.9])


def test_waterfall_refuses_a_part_without_a_colour():
    parts = pd.DataFrame({"arm": ["a"], "part": ["mystery kernels"], "ms": [1.0]})
    with pytest.raises(AssertionError, match="mystery kernels"):
        plot_lever_waterfall(parts, 0.5, 1.0)


def floor_tables() -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = []
    for arm, label, scale, batches in (("nanolab", "nanolab (graphs)", 2.0, (1, 8, 32)),
                                       ("hf-default", "hf static (compiled)", 4.0, (1, 8))):
        for b in batches:
            rows.append((arm, label, b, 128, 0.6 * scale, scale))
    rows.append(("nanolab", "nanolab (graphs)", 32, 2048, 2.0, 1.8))
    floor = pd.DataFrame(rows, columns=["arm", "label", "batch", "context", "ms_per_step", "x_floor"])
    roofline = pd.DataFrame({"batch": [1, 8, 32, 32], "context": [128, 128, 128, 2048],
                             "floor_ms": [0.6, 0.61, 0.65, 1.1], "target_ms": [1.0, 1.1, 1.3, 1.9]})
    return floor, roofline


def test_roofline_draws_a_line_per_arm_the_floor_and_the_targets():
    floor, roofline = floor_tables()
    fig = plot_floor_roofline(floor, roofline)
    ms_ax, x_ax = fig.axes
    for ax, col in ((ms_ax, "ms_per_step"), (x_ax, "x_floor")):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert np.allclose(lines["nanolab (graphs)"].get_ydata(), floor[(floor.arm == "nanolab")
                                                                        & (floor.context == 128)][col])
        assert list(lines["hf static (compiled)"].get_xdata()) == [1, 8]
    floor_line = next(ln for ln in ms_ax.get_lines() if ln.get_label().startswith("floor"))
    assert np.allclose(floor_line.get_ydata(), [0.6, 0.61, 0.65])
    assert 1 in hline_ys(x_ax)  # the floor is 1 on the right
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["nanolab (graphs)", "hf static (compiled)"] and "target" in labels
    # The long context is a hollow marker at its batch, not a point on the line.
    hollow = [c for c in ms_ax.collections if c.get_offsets().shape[0] and (c.get_facecolor()[:, :3] == 1).all()]
    assert any(np.allclose(c.get_offsets(), [[32, 2.0]]) for c in hollow)


def projections() -> pd.DataFrame:
    rows = []
    for name, n, k, cublas in (("qkv", 96, 64, 9.0), ("lm_head", 512, 64, 100.0)):
        for m in (1, 2, 16):
            rows += [(name, n, k, m, "cublas", cublas), (name, n, k, m, "gemv", cublas * 1.5)]
            if m != 2:  # the sweep ran at 1 and 16 rows only
                rows += [(name, n, k, m, "gemv 16x128 split 1", cublas * 1.2),
                         (name, n, k, m, "gemv 32x256 split 2", cublas * 0.95)]
    return pd.DataFrame(rows, columns=["projection", "n", "k", "rows", "arm", "us"])


def test_best_of_sweep_takes_the_fastest_gemv_measured():
    table = best_of_sweep(projections())
    assert list(table.projection.unique()) == ["qkv", "lm_head"]  # the table's order, not alphabetical
    swept = table[table.rows != 2]
    assert (swept["best tiles"] == "gemv 32x256 split 2").all()
    assert np.allclose(swept["best gemv / cublas"], 0.95) and np.allclose(table["gemv / cublas"], 1.5)
    unswept = table[table.rows == 2]
    assert (unswept["best tiles"] == "gemv").all() and np.allclose(unswept["best gemv / cublas"], 1.5)


def test_projections_panel_per_row_count():
    fig = plot_projections(projections(), rows=(1, 16))
    assert len(fig.axes) == 2
    for ax in fig.axes:
        heights = sorted(round(r.get_height(), 6) for r in bars(ax))
        assert heights == [0.95, 0.95, 1.0, 1.0, 1.5, 1.5]  # 2 projections x (cuBLAS, default, best)
        assert [t.get_text().split("\n")[0] for t in ax.get_xticklabels()] == ["qkv", "lm_head"]
    assert legend_texts(fig.axes[0])[0].startswith("cuBLAS")


def test_chunked_itl_bars_and_the_tail_aim():
    rates = pd.DataFrame({"arm": ["graphs-chunked"] * 2 + ["graphs-whole"] * 2, "rate": [16.0, 32.0] * 2,
                          "itl_p50_ms": [1.2, 1.3, 1.25, 1.3], "itl_p99_ms": [14.0, 16.0, 17.0, 30.0]})
    fig = plot_chunked_itl(rates, aim=3.0)
    p50, p99 = fig.axes
    assert sorted(r.get_height() for r in bars(p50)) == sorted(rates.itl_p50_ms)
    assert sorted(r.get_height() for r in bars(p99)) == sorted(rates.itl_p99_ms)
    assert [t.get_text() for t in p50.get_xticklabels()] == ["16 req/s", "32 req/s"]
    ticks = [seg[0][1] for c in p99.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert sorted(ticks) == pytest.approx(sorted(3.0 * rates.itl_p50_ms))
    assert legend_texts(p99) == ["aim: 3 x p50", "graphs-chunked", "graphs-whole"]


def test_folds_pair_each_fold_with_its_plain_gemv_and_mark_the_kernel_it_removes():
    folds = pd.DataFrame([("qkv", 8, "none", 7.0, 0.0), ("qkv", 8, "norm", 16.0, 9.0), ("o", 8, "none", 7.0, 0.0),
                          ("o", 8, "residual", 7.4, 0.4), ("qkv", 64, "none", 7.2, 0.0),
                          ("qkv", 64, "norm", 25.0, 17.8), ("o", 64, "none", 6.8, 0.0),
                          ("o", 64, "residual", 7.1, 0.3)],
                         columns=["projection", "rows", "fold", "us", "us_added"])
    fig = plot_folds(folds, {"norm": 2.3, "residual": 0.0})
    assert [ax.get_title() for ax in fig.axes] == ["8 rows", "64 rows"]
    eight = fig.axes[0]
    assert sorted(r.get_height() for r in bars(eight)) == [7.0, 7.0, 7.4, 16.0]
    assert [t.get_text() for t in eight.texts] == ["+9.0", "+0.4"]
    lines = [seg[0][1] for c in eight.collections if isinstance(c, LineCollection) for seg in c.get_segments()]
    assert lines == pytest.approx([9.3, 7.0])  # each fold's own: a norm's kernel, and none for a residual


def test_mixed_steps_scatter_each_trace_with_its_median():
    trace = pd.DataFrame({"phase": ["decode", "mixed", "mixed", "mixed"], "tokens": [8, 100, 300, 500],
                          "ms": [1.2, 7.5, 8.0, 9.0]})
    fig = plot_mixed_steps({"eager": trace, "compiled": trace.assign(ms=trace.ms + 1)}, step_ms=1.2)
    ax = fig.axes[0]
    assert [len(c.get_offsets()) for c in ax.collections] == [3, 3]
    assert legend_texts(ax) == ["eager: median 8.0 ms", "compiled: median 9.0 ms", "the server's median step (1.2 ms)"]


def test_mixed_anatomy_stacks_each_step_and_ticks_the_gpu():
    nan = float("nan")
    anatomy = pd.DataFrame({
        "arm": ["eager"] * 3 + ["compiled"] * 3, "phase": ["decode", "mixed", "mixed"] * 2,
        "prompt_len": [0, 512, 2048] * 2, "chunk": [0, 0, 1] * 2, "tokens": [16, 528, 32] * 2,
        "step_ms": [1.2, 10.5, 10.1] * 2, "forward_host_ms": [nan, 10.0, 9.6] * 2,
        "forward_span_ms": [nan, 9.9, 9.5] * 2, "sample_ms": [nan, 0.2, 0.2] * 2, "rest_ms": [nan, 0.3, 0.3] * 2})
    kernels = pd.DataFrame({"arm": ["eager", "eager", "compiled"], "prompt_len": 512,
                            "us_per_step": [2000.0, 1300.0, 3200.0]})
    fig = plot_mixed_anatomy(anatomy, kernels)
    assert len(fig.axes) == 2
    for ax, busy in zip(fig.axes, (3.3, 3.2)):
        widths = sorted(round(p.get_width(), 3) for p in bars(ax))
        assert widths == [0.2, 0.2, 0.3, 0.3, 9.6, 10.0]  # host, sampling and rest of two steps
        span, gpu = ax.collections
        assert list(span.get_offsets()[:, 0]) == [9.9, 9.5]
        assert gpu.get_offsets()[0, 0] == pytest.approx(busy)
        assert np.ma.is_masked(gpu.get_offsets()[1, 0])  # chunk 1 was not profiled: no tick
        assert ax.lines[0].get_xdata()[0] == 1.2  # the decode step


def between_ops() -> tuple[pd.DataFrame, pd.DataFrame]:
    before, after = "four copies", "one kernel"
    ops = pd.DataFrame({
        "variant": [before] * 3 + [after] * 3 + [after], "batch": [8] * 6 + [1],
        "order": [0, 1, 2, 0, 1, 2, 0], "kind": ["kernel", "gpu_memcpy", "gpu_memcpy", "kernel", "kernel",
                                                 "gpu_memcpy", "kernel"],
        "op": ["_pick", "Memcpy DtoH (Device -> Pinned)", "Memcpy HtoD (Pinned -> Device)", "_pick", "_upload",
               "Memcpy DtoH (Device -> Pinned)", "_pick"],
        "stream": [7, 7, 7, 7, 7, 45, 7], "us": [1.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0],
        "gap_us": [2.0, 5.0, 3.0, 2.0, 1.0, -1.5, 2.0]})
    loop = pd.DataFrame({"variant": [before, after], "batch": 8, "between_us": [16.0, 8.0]})
    return ops, loop


def test_between_steps_places_each_op_after_its_gap_and_overlaps_on_negative_gaps():
    ops, _ = between_ops()
    before = between_steps_timeline(ops[(ops.variant == "four copies")])
    assert list(before.start_us) == [2.0, 8.0, 13.0] and list(before.end_us) == [3.0, 10.0, 14.0]
    after = between_steps_timeline(ops[(ops.variant == "one kernel") & (ops.batch == 8)].iloc[::-1])
    assert list(after.start_us) == [2.0, 4.0, 4.5]  # in order, whatever the rows' order; the read-back overlaps


def test_between_steps_draws_each_variant_on_its_stream_lanes_and_the_next_replay():
    ops, loop = between_ops()
    fig = plot_between_steps(ops, loop, batch=8)
    assert [ax.get_title() for ax in fig.axes] == ["four copies", "one kernel"]
    for ax, lanes, replay in zip(fig.axes, ([0, 0, 0], [0, 0, 1]), (16.0, 8.0)):
        assert [round(p.get_y() + p.get_height() / 2) for p in bars(ax)] == lanes
        assert ax.lines[0].get_xdata()[0] == replay
    colours = [p.get_facecolor() for p in bars(fig.axes[0])]
    assert len({tuple(c) for c in colours}) == 3  # a kernel, a read-back and an upload copy


def test_mixed_host_bars_each_part_per_prompt_largest_on_top():
    host = pd.DataFrame({"prompt_len": [64, 64, 512, 512], "part": ["read", "plan", "read", "plan"],
                         "calls": [16, 1, 16, 1], "us": [2000.0, 500.0, 2100.0, 2500.0], "tokens": [80, 80, 528, 528]})
    fig = plot_mixed_host(host)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["read  (x16)", "plan  (x1)"]  # by the 512 prompt's time
    widths = {round(p.get_y() + p.get_height() / 2, 2): p.get_width() for p in bars(ax)}
    assert widths == {-0.2: 2.0, 0.2: 2.1, 0.8: 0.5, 1.2: 2.5}  # ms; the shorter prompt's bar below
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["64-token prompt (80 tokens)",
                                                                   "512-token prompt (528 tokens)"]


def test_the_figures_stay_out_of_pyplot():
    """A notebook's inline backend shows every pyplot figure again at the end of a cell; these are
    shown once, by `show`."""
    import matplotlib.pyplot as plt

    before = set(plt.get_fignums())
    floor, roofline = floor_tables()
    plot_floor_roofline(floor, roofline)
    plot_projections(projections())
    assert set(plt.get_fignums()) == before


def test_tuning_spread_marks_each_compile_and_the_lm_head_it_ran():
    """One dot per compile and a median bar per arm; the LM head is the longest kernel launched
    once a step, drawn as a square when cuBLAS ran it and a dot when inductor's reduction did."""
    spread = pd.DataFrame({"arm": ["tuned", "tuned", "tuned", "cublas head", "cublas head"],
                           "trial": [0, 1, 2, 0, 1], "ms_per_step": [1.0, 1.2, 1.1, 1.05, 1.04]})
    rows = []
    for arm, trial, head_kernel, head_us in [("tuned", 0, "triton_red_fused_mm_19", 300.0),
                                              ("tuned", 1, "triton_red_fused_mm_19", 150.0),
                                              ("tuned", 2, "triton_red_fused_mm_19", 200.0),
                                              ("cublas head", 0, "nvjet_sm90_256x8", 120.0),
                                              ("cublas head", 1, "nvjet_sm90_256x8", 121.0)]:
        rows += [(arm, trial, head_kernel, 32, head_us), (arm, trial, "_chunk_max", 32, 2.0),
                 (arm, trial, "triton_red_fused_mm_silu_6", 512, 400.0)]  # longer, but once a layer
    profile = pd.DataFrame(rows, columns=["arm", "trial", "kernel", "calls", "us_per_step"])
    head = once_a_step(profile)
    assert head.us_per_step.tolist() == [120.0, 121.0, 300.0, 150.0, 200.0]
    fig = plot_tuning_spread(spread, head, target_ms=1.0)
    step_ax, head_ax = fig.axes
    dots = [ln for ln in step_ax.get_lines() if ln.get_marker() == "o"]
    assert sorted(np.concatenate([ln.get_ydata() for ln in dots]).tolist()) == sorted(spread.ms_per_step)
    assert sorted(seg[0][1] for seg in step_ax.collections[0].get_segments()) == [1.1]  # tuned's median
    squares = np.concatenate([ln.get_ydata() for ln in head_ax.get_lines() if ln.get_marker() == "s"])
    assert sorted(squares.tolist()) == [120.0, 121.0]
    assert 1.0 in hline_ys(step_ax)


def test_kernel_draws_square_the_marked_config_and_dot_the_rest():
    """Left: one dot per compile and a median bar per arm, the target dotted. Right: the kernel's
    time in each compile, a square where tuning chose the marked config and a dot elsewhere."""
    spread = pd.DataFrame({"arm": ["kept", "kept", "pdl", "pdl", "pdl"], "trial": [0, 1, 0, 1, 2],
                           "ms_per_step": [1.10, 1.20, 1.00, 0.95, 1.05]})
    good, bad = "XBLOCK: 4, R0_BLOCK: 2048, num_warps: 16", "XBLOCK: 1, R0_BLOCK: 4096, num_warps: 16"
    kernel = pd.DataFrame({"arm": ["kept", "kept", "pdl", "pdl", "pdl"], "trial": [0, 1, 0, 1, 2],
                           "us_per_step": [185.0, 294.0, 184.0, 186.0, 240.0],
                           "config": [good, bad, good, good, bad]})
    fig = plot_kernel_draws(spread, kernel, target_ms=1.0, kernel_name="down projection", marked=good)
    step_ax, kernel_ax = fig.axes
    dots = [line for line in step_ax.lines if line.get_marker() == "o"]
    assert [list(d.get_ydata()) for d in dots] == [[1.10, 1.20], [1.00, 0.95, 1.05]]
    medians = [seg[0][1] for c in step_ax.collections for seg in c.get_segments()]
    assert medians == pytest.approx([1.15, 1.00])
    assert 1.0 in hline_ys(step_ax)  # the target
    squares = [(list(line.get_xdata()), list(line.get_ydata())) for line in kernel_ax.lines
               if line.get_marker() == "s" and len(line.get_xdata())]
    others = [(list(line.get_xdata()), list(line.get_ydata())) for line in kernel_ax.lines
              if line.get_marker() == "o" and len(line.get_xdata())]
    assert squares == [([0], [185.0]), ([1, 1], [184.0, 186.0])]
    assert others == [([0], [294.0]), ([1], [240.0])]
    assert legend_texts(kernel_ax)[1] == "tuned to another config"
    assert [t.get_text() for t in step_ax.get_xticklabels()] == ["kept", "pdl"]
