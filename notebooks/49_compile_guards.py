# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Day 49: the compiler fighting the engine
#
# The engine from the first chapter decodes eagerly. The obvious next step is to hand its decode
# forward to `torch.compile` and see what inductor makes of it. The seed's Day 49 log records
# what happened on Llama-3.2-1B on a CPU: one graph, no graph breaks, and a decode that ran
# 46 times slower than eager, because dynamo rebuilt the graph on 8 of 9 steps. It guarded on
# `kwargs['cache'].cache.tables[0].num_tokens == 13`, a Python integer inside the cache that
# grows by one every step.
#
# This chapter reproduces that on the pre-plan decode path, which `nanolab.lab.history` keeps as
# a runner the engine accepts (`planned=False` here): the forward itself grows the block tables
# and works out the slots. It shows the guard in dynamo's
# own words, then checks the one fix Day 49 did land: the attention read takes its bounds from
# the cache as host ints instead of calling `int(context_lens.min())` on a device tensor.
#
# On a CPU the chapter runs the two-layer `tiny` model in fp32 so that CI finishes in minutes.
# On a GPU it runs Llama-3.2-1B shapes in bf16 (random weights unless `NANOLAB_MODEL` points at a
# real folder). Both use the seed's batch: 4 rows, 16-token prompts, 9 decode steps.

# %%
import nanolab.lab as lab
from nanolab import load_model

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="tiny")
ON_GPU = DEVICE.type == "cuda"
model = load_model(path, dtype=DTYPE, device=DEVICE)
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The benchmark
#
# `compilebench_table` builds an engine whose decode forward is the mode under test, prefills the
# 4 prompts eagerly, and times each decode step on its own:
#
# - `off` is the eager model; `dynamic` is `torch.compile(model, dynamic=True)`; `static` is
#   `dynamic=False`. Both compiled modes use inductor.
# - `shapes` counts the distinct `(rows, width)` read rectangles the steps asked for. The width is
#   the longest history, so it grows by one every step.
# - `builds` counts calls into the inductor backend (one per graph traced and compiled), and
#   `reuse` is the share of steps that built nothing.
# - `fell back` is true when dynamo refused to compile again at its recompile limit and ran the
#   frame eagerly instead.
# - `compile s` comes from dynamo's own frame-compile timer: tracing, guards and the backend call,
#   summed over every build. The seed estimated it as total time minus median step times steps,
#   and said itself that this was an artefact: when most steps build, the median step is a build,
#   and the estimate reads near zero.
# - `step ms` is the median wall time of one `Engine.step`; `speedup` is against `off`, and
#   `breakeven steps` is how many steps the per-step saving needs to pay back `compile s`
#   (infinite when there is no saving).

# %%
import torch
import torch._dynamo

BENCH = dict(rows=4, prompt_len=16, steps=9)
ROUND = {"reuse": 3, "compile s": 2, "step ms": 2, "speedup": 5, "breakeven steps": 1}
print(f"{model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}; {BENCH}")
print(f"dynamo recompile limit: {torch._dynamo.config.recompile_limit}")

df, results = lab.compilebench_table(model, planned=False, **BENCH)
lab.save_table(df, "day49_compilebench", label)
# every guard failure, verbatim, for Day 50
lab.save_table(lab.guards_table(results), "day49_guards", label)
lab.show(df.round(ROUND))

# %% [markdown]
# When most steps build, the median step is itself a build step, so `step ms` for the compiled
# modes is mostly compile time. That is the honest reading of the row: at this run length the
# compiled forward never gets to show what it costs once built.
#
# ## The guard, in dynamo's words
#
# Each time a step misses every compiled graph, dynamo records why: for each cached graph, the
# guard that failed. This is the first reason it recorded in the `dynamic` run, printed as
# dynamo wrote it:

# %%
dynamic = results["dynamic"]
print(lab.first_guard_failure(dynamic))

# %% [markdown]
# That is one reason with its stack. The first line of each reason is the guard expression
# itself; these are the distinct ones over the whole `dynamic` run, in the order they first
# failed:

# %%
import re

import pandas as pd


def guard_table(lines: list[str]) -> pd.DataFrame:
    """Guard lines as dynamo wrote them, cut at the comment: the guard, then its source line."""
    cut = [re.split(r"\s+#\s+", line, maxsplit=1) + [""] for line in lines]
    return pd.DataFrame([c[:2] for c in cut], columns=["guard", "source line (dynamo's comment)"])


guard_lines = list(dict.fromkeys(reason.splitlines()[0] for reason in dynamic.guard_failures))
with pd.option_context("display.max_colwidth", None):
    lab.show(guard_table(guard_lines))
static_first = lab.first_guard_failure(results["static"]).splitlines()[0]
print(f"static, first reason: {guard_table([static_first]).guard.iloc[0]}")
gate = lab.check_graph_reused(dynamic)
print(gate)

# %%
assert any("num_tokens" in reason for reason in dynamic.guard_failures), dynamic.guard_failures
# Every guard that failed is on a Python attribute of the cache's tables, none on a tensor.
assert all("cache.cache.tables[" in line for line in guard_lines), guard_lines
assert dynamic.steps_with_build > 1 and dynamic.builds > 1
assert not gate, gate  # the gate that documents the pathology: it has to fail here

# %% [markdown]
# Every guard above names an attribute of a `BlockTable`, a plain Python object the cache keeps
# per row: how many tokens it holds, or how many blocks. The unplanned forward reads those while
# it runs, because layer 0's `write` grows the tables and lists the new slots with
# `[table.slot(p) for p in range(start, table.num_tokens)]`. Dynamo traces Python by running it,
# so a loop bound read off an object becomes a constant in the graph, and the only way to keep
# that graph correct is a guard that the value is still what it was. The value grows by one
# every step, so the guard fails every step, and each failure costs a full trace and compile
# until the recompile limit is reached and dynamo gives up on the frame.
#
# `dynamic=True` does not help. It makes tensor sizes symbolic: a dimension can be `s0` instead
# of 17, and one graph serves every value of it. A Python int reached through attributes of an
# arbitrary object is not a tensor size, so there is no symbol to give it; it is still
# specialised and guarded. That is why the two compiled rows look alike. `static` has the growing
# read width to fail on as well, but it is guarded on the same attributes; its first recorded
# reason is printed above, under the `dynamic` run's.
#
# The first guard in this run need not be the seed's `num_tokens` one. With 16-token prompts and
# 16-slot blocks each row's first decode token opens a second block, so the first thing that
# changes between the first and second decode step can be `len(blocks)`; after that it is
# `num_tokens`. Both are the same kind of guard.
#
# ## The Day-49 fix: bounds from the cache, not from the device
#
# The read needs the shortest and longest context in the batch. Before Day 49 it computed them
# from the `context_lens` tensor with `int(context_lens.min())` and `int(...max())`. Under
# dynamo, turning a tensor into a Python int is a `.item()` call, which it cannot put in a graph
# by default, so the graph breaks there, in every layer. Day 49 has the cache hand the two
# numbers down as host ints it already has from its tables. `bounds="device"` runs the read the
# old way, so the two can be compared on the same batch.

# %%
from torch._dynamo.utils import counters

breaks_before = counters["graph_break"].copy()
before = lab.run_compilebench(model, mode="dynamic", planned=False, bounds="device", **BENCH)
new_breaks = {reason: n - breaks_before.get(reason, 0)
              for reason, n in counters["graph_break"].items()}
break_reasons = {reason: n for reason, n in new_breaks.items() if n > 0}
bounds = lab.results_table([results["off"], dynamic, before]).iloc[1:]
bounds.insert(0, "read bounds", ["host ints from the cache (Day 49)",
                                 "int(context_lens.min()) on the device"])
lab.save_table(bounds, "day49_bounds", label)
columns = ["read bounds", "builds", "reuse", "fell back", "graph breaks", "compile s", "step ms"]
lab.show(bounds[columns].round(ROUND))

# %%
assert dynamic.graph_breaks == 0, dynamic.graph_breaks
assert before.graph_breaks > 0, before.graph_breaks
print(f"graph-break reasons in the device-bounds run ({before.graph_breaks} breaks), verbatim:")
for reason, n in break_reasons.items():
    print(f"--- {n}x\n{reason}")
print("\nfirst guard failure in the device-bounds run, verbatim:")
print(lab.first_guard_failure(before) or "(none)")
print("\nthe distinct guard lines of the device-bounds run:")
with pd.option_context("display.max_colwidth", None):
    lab.show(guard_table(list(dict.fromkeys(r.splitlines()[0] for r in before.guard_failures))))

# %% [markdown]
# The fix removes the graph breaks and does not stop the rebuilds: the tables are still read
# inside the forward, so the fixed arm still builds on most steps.
#
# The two rows need careful reading, because the device-bounds arm can show the faster median
# step, and when it does its compiled code is not the reason. A graph break inside a layer ends
# the graph there, and dynamo resumes the rest of that layer's forward as a frame of its own.
# That frame is one code object shared by every layer, and its guards include the layer's index,
# an int attribute of the module that dynamo treats as a constant (the `self.layer == ...` lines
# above). Each layer after the first therefore costs a build of its own. A model with more layers
# than the recompile limit uses the limit up inside its first decode step, and from then on
# dynamo runs those frames eagerly: later steps build nothing because dynamo has stopped trying.
# `steps that built` and `fell back` say which of these happened in this run:

# %%
layers, limit = model.config.num_hidden_layers, torch._dynamo.config.recompile_limit
print(f"{layers} layers against a recompile limit of {limit}")
both_bounds = (("from the cache", dynamic), ("on the device", before))
lab.show(pd.DataFrame([{"read bounds": name, "builds": r.builds,
                        "steps that built": r.steps_with_build, "steps": r.steps,
                        "fell back": r.fell_back, "median step ms": r.step_ms,
                        "eager median step ms": results["off"].step_ms}
                       for name, r in both_bounds]).round(2))

# %% [markdown]
# ## The compiled forward still decodes the same tokens
#
# Rebuilding every step is slow but should not be wrong. Each compiled run's greedy tokens are
# compared with the eager run's, row by row, and so are the last step's logits. The gate is
# exact equality of tokens in fp32 only. In bf16 the kernels inductor fuses round differently
# from eager's, and greedy decoding on random weights turns a single near-tie into a different
# continuation from that step on, so in bf16 the cell prints the agreement and does not assert
# it.

# %%
off = results["off"]
agreement = []
for mode, r in {**results, "dynamic, device bounds": before}.items():
    worst = (r.logits - off.logits).abs().max().item()
    rows_equal = sum(a == b for a, b in zip(r.tokens, off.tokens))
    agreement.append({"mode": mode, "rows equal to off": rows_equal, "rows": len(off.tokens),
                      "max |logit - off|, last step": f"{worst:.2e}"})
    if DTYPE == torch.float32:
        assert r.tokens == off.tokens, mode
        torch.testing.assert_close(r.logits, off.logits, rtol=1e-4, atol=1e-4)
lab.show(pd.DataFrame(agreement))

# %% [markdown]
# ## The picture
#
# Left: for each arm, how many distinct shapes its steps asked for, how many steps built a graph,
# and how many graphs were built in all. Right: the median step on a log axis, with the speedup
# over `off` written on each bar.

# %%
import matplotlib.pyplot as plt
import numpy as np

arms = {"off": results["off"], "static": results["static"], "dynamic": dynamic,
        "dynamic,\ndevice bounds": before}
counts = pd.DataFrame({"distinct shapes": [r.shapes for r in arms.values()],
                       "steps that built": [r.steps_with_build for r in arms.values()],
                       "graphs built": [r.builds for r in arms.values()],
                       "graph breaks": [r.graph_breaks for r in arms.values()]}, index=list(arms))
fig, (count_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
counts.plot.bar(ax=count_ax, rot=0, width=0.8)
count_ax.axhline(BENCH["steps"], color="0.4", ls=":", label=f"decode steps ({BENCH['steps']})")
count_ax.set_title("what dynamo did over the decode steps")
count_ax.legend(fontsize=8)
ms = np.array([r.step_ms for r in arms.values()])
bars = time_ax.bar(list(arms), ms, color=["C7", "C1", "C3", "C4"])
for bar, r in zip(bars, arms.values()):
    speedup = results["off"].step_ms / r.step_ms
    text = f"{speedup:.3g}x" if speedup >= 1 else f"{speedup:.2g}x\n({1 / speedup:,.0f}x slower)"
    time_ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center",
                 va="bottom", fontsize=8)
time_ax.set_yscale("log")
time_ax.set_ylim(top=ms.max() * 20)
time_ax.set_ylabel("median decode step (ms)")
time_ax.set_title("median step, speedup over off on each bar")
for ax in (count_ax, time_ax):
    ax.grid(alpha=0.3, axis="y")
fig.suptitle(f"unplanned decode, {MODEL}: {BENCH['rows']} rows, {BENCH['prompt_len']}-token "
             f"prompts, {BENCH['steps']} steps")
fig.tight_layout()
lab.save_figure(fig, "day49_compile_guards", label)
lab.show(fig)

# %% [markdown]
# *Figure 49.1: On the left, compare each compiled arm's graphs built with the dotted line for the
# number of decode steps: an arm that rebuilds on almost every step sits near it. On the right, the
# median step on a log axis, with each bar labelled by its speedup over eager (`off`).*

# %% [markdown]
# ## The committed GPU run beside this one
#
# Each device's table is kept under its own name in `data/day49_compilebench_<device>.csv`, so
# the committed H200 result sits beside whatever this run measured.

# %%
tables = lab.committed_tables("day49_compilebench")
for slug, table in tables.items():
    first = table.iloc[0]
    print(f"{slug}: {first.device}, {first.model} ({first.weights} weights), {first['dtype']}, "
          f"{first.date}")
    lab.show(table[[c for c in df.columns if c in table.columns]].round(ROUND))
if all(slug == "cpu" for slug in tables):
    print("No GPU table is committed yet; this chapter's GPU run will add "
          "data/day49_compilebench_<gpu>.csv.")

# %% [markdown]
# ## What Day 50 does about it
#
# The bounds fix was real but narrow: it took one device sync out of the read and with it the
# graph breaks. The rebuilds are untouched, because the thing dynamo keeps guarding on is not in
# the read at all. It is the forward deciding, while it runs, where this step's tokens go:
# growing the tables, listing the slots, building the read rectangle. As long as that happens
# inside the traced region, some Python int that changes every step is visible to the tracer,
# and it will be specialised and guarded whichever way it is passed around.
#
# Day 50 moves that work out of the forward. The host builds the step's addressing before the
# call, as tensors (`DecodePlan`: `write_slots`, `slot_mapping`, `context_lens`, `positions`),
# and the forward only reads them. What changes from step to step then reaches dynamo as a tensor
# size, which is what `dynamic=True` can make symbolic. `check_graph_reused`, which fails in this
# chapter by design, is the gate that tells whether that worked.
