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
# # Day 64d: what a warm hit is made of
#
# {doc}`Day 64 <64_prefix_caching>` set an aim: with prefix caching, a request behind a shared
# 2,048-token system prompt should see its first token at least 5x sooner than without. Days
# {doc}`64b <64b_the_host_path>` and {doc}`64c <64c_the_read_after_a_hit>` each took time out of
# one part of that request, the host's work on the prompt's ids and the attention read after the
# cached keys. Neither reached the aim. This chapter asks where a warm hit's time goes now, split
# between the host and the GPU, and whether 5x fits in what is left once the GPU has done its part.
#
# All of today's device runs landed on an H100, including one that asked for an H200. Every
# number below names its card.

# %%
from dataclasses import replace

import numpy as np
import pandas as pd

import nanolab.lab as lab
from nanolab.lab.prefixsteps import LEDGER, PROFILED_SUFFIX, SPLIT_PARTS
from nanolab.llm import DEFAULT_MODEL

H100, H200 = "h100-80gb-hbm3", "h200"
STEPS_COMMAND = 'PREFIXSTEPS_ARGS="--prefix day64i" scripts/gpu_run.sh prefixsteps'
AIM = 5.0

# %% [markdown]
# ## Seven runs of the same two ratios
#
# The prefix bench (`prefixbench`) serves requests one at a time over a kept-alive connection,
# with caching on and off, and reports two TTFT ratios: a warm hit at the shared prefix, and a
# chat's second turn over a 4,096-token history. It has run seven times. The first three ran on
# an H200 between changes to the engine. The last four ran on H100s. Runs f, i and j ran the same
# engine for the shared prefix: the one change between them, the share rule of chapter 64c, only
# touches steps of 64, 128 and 256 tokens, and the shared prefix's 50-token step replays the
# 56-token graph.

# %%
RUNS = (("12-03, first", "H200", "day64first", H200), ("12-03, split", "H200", "day64split", H200),
        ("12-05", "H200", "day64", H200), ("64b", "H100", "day64b", H100), ("64f", "H100", "day64f", H100),
        ("64i", "H100", "day64i", H100), ("64j", "H100", "day64j", H100))
runs, tables = lab.ratio_runs(RUNS)
lab.show(runs.pivot_table(index=["run", "card", "date"], columns="ratio", values="value", sort=False).round(2))
fig = lab.plot_ratio_runs(runs, AIM)
# the caption names every run's card and date; the file, both cards
lab.save_figure(fig, "day64d_ratio_runs", replace(lab.table_label(pd.concat(tables)), device_slug="h200-h100"))
lab.show(fig)
same = runs[runs.run.isin(["64f", "64i", "64j"])].groupby("ratio").value
print("runs f, i and j: " + "; ".join(f"{r} {lo:.2f}x to {hi:.2f}x" for r, (lo, hi) in
                                      same.agg(["min", "max"]).iterrows()))

# %% [markdown]
# The shared prefix has never reached 5x. It rose from 2.6x to 3.5x over these runs, while both the
# engine and the card changed, and the last four stayed between 3.1x and 3.5x. The second turn
# crossed 5x in three of the four H100 runs. Runs i and j ran the same engine on the same machine
# (the device kept it between the two calls), minutes apart, and gave 5.07x and 4.18x. So the
# second turn's "met" sits inside the spread between runs. Between those two runs the server's own
# prompt step moved too, from 3.16 to 3.79 ms at the second turn, so the spread is in the step as
# well as around it.
#
# ## The prompt step alone
#
# `prefixsteps` now also splits the prompt step of a warm hit, in one process and with no server,
# as the engine runs it (`split_prompt_steps`). It wraps the engine's own methods on their
# instances and times four parts on the host: scheduling (the prefix lookup and the sharing of
# the cached blocks are here), the forward's host part (`run_varlen`: the plan, its upload and the
# graph's launch), sampling (which waits for the GPU and reads the token back), and the rest of
# `Engine.step`. CUDA events around the launch time the graph on the GPU. After the last
# request, the same graph is replayed back to back, with no host work between replays.

# %%
split = lab.measured_table("day64i_prefix_split", STEPS_COMMAND, slug=H100)
# the same step shape's kernels, from run f's profile (the engine has not changed for this step since)
kernels = lab.measured_table("day64f_prefix_kernels",
                             'PREFIXSTEPS_ARGS="--reads engine,flat --prefix day64f" scripts/gpu_run.sh prefixsteps',
                             slug=H100)
if split is not None:
    columns = ["step_ms", *SPLIT_PARTS, "rest_ms", "graph_gpu_ms", "replay_alone_ms"]
    lab.show(split[["request", "tokens", "size", *columns]].round(3))
    med = split[columns].median()
    before = med.schedule_ms + med.forward_host_ms
    print(f"medians: step {med.step_ms:.2f} ms; the GPU idles for the {before:.2f} ms of scheduling and "
          f"planning, then runs the graph for {med.graph_gpu_ms:.2f} ms "
          f"({med.replay_alone_ms:.2f} back to back); the forward's host part and sampling less the graph, "
          f"what the server's prompt step holds besides it: "
          f"{med.forward_host_ms + med.sample_ms - med.graph_gpu_ms:.2f} ms")
if kernels is not None:
    engine = kernels[kernels.read == "engine"]
    by_class = engine.pivot_table(index="class", columns="arm", values="us_per_step", aggfunc="sum")
    lab.show(by_class.round(1))
    hit, decode = by_class["prefix hit + 50"], by_class["decode"]
    profiled = engine[engine.arm == "prefix hit + 50"]
    launches = profiled.calls.sum() / (profiled.gpu_us.sum() / profiled.us_per_step.sum())  # calls / steps
    small = ["norms", "copies and indexing", "fused by inductor", "other elementwise"]
    print(f"the hit's kernels: {hit.sum() / 1e3:.2f} ms in {launches:.0f} launches a step; beyond a decode step's, "
          f"the attention read {(hit - decode)['attention read']:.0f} us, small kernels "
          f"{(hit - decode)[small].sum():.0f} us, the projections {(hit - decode)['projections']:+.0f} us")

# %% [markdown]
# The step took about 2.5 ms. The graph is 1.76 ms of it, and it ran as fast inside the step as
# it did back to back, so no host work stalls it once it is launched. Everything before the launch
# is the host alone, 0.65 ms, while the GPU waits.
#
# The kernels come from run f's profile of the same step. Run i's profiling pass sent prompts the
# split had already sent, so the cache held all but their last two tokens and it profiled a
# 2-token step; `prefixsteps` now gives each pass prompts of its own, and `hit_step` refuses a hit
# that fed any other count. Under the profiler the graph's kernels add up to 1.70 ms in 207
# launches. Beside a decode step's, they show what the graph spends that a decode step does not:
# 0.29 ms more in the attention read over the 2,048 cached keys, 0.15 ms more in small kernels
# (norms, copies, inductor's fused kernels and the elementwise ones, which a decode step mostly
# folds into its projections), and 0.10 ms more in the projections, which cuBLAS runs at 56 rows
# where a decode step has its own GEMV.
#
# ## The ledger
#
# The server's log splits each request's TTFT (chapter 64b): the front (the client's send, the
# HTTP request, the server's parsing and checks, and the pipe to the core's process), the core's
# wait before the step, the step's host work outside its timer, the prompt step itself, and the
# way back to the client. `warm_hit_ledger` cuts the prompt step in two with the split above:
# its graph's GPU time, and the host's rest of it. Run j's TTFT table is its own. Run i's was lost
# on the way back from the device (a call returns at most eight files), so run f stands beside it:
# the same engine for this request, on the same kind of machine, earlier the same day.

# %%
TTFT_COMMANDS = {"64f": 'PREFIX_ARGS="--prefix day64f" scripts/gpu_run.sh prefix (at eca4d9b)',
                 "64j": "python -m nanolab prefixbench --model llama-3.2-1b --parts shared,turns --prefix day64j"}
runs = ((f"run {run[2:]}, H100", lab.measured_table(f"day{run}_ttft", command, slug=H100), split)
        for run, command in TTFT_COMMANDS.items())
ledger, ttfts = lab.warm_hit_ledgers(runs, aim=AIM)
if ledger is not None:
    lab.show(ledger.pivot_table(index=["part", "side"], columns="run", values="ms", sort=False).round(2))
    lab.show(lab.ledger_summary(ledger).round(2))
    fig = lab.plot_warm_hit_ledger(ledger)
    lab.save_figure(fig, "day64d_warm_hit_ledger", lab.table_label(ttfts))
    lab.show(fig)

# %% [markdown]
# The red line is 5x: the TTFT with caching off, over five. In both runs it falls inside the
# graph. The host's parts add up to 3.5 ms in run f and 4.2 ms in run j, and 5x leaves the whole
# request 3.52 and 3.71 ms. After the graph's 1.76 ms the host would have 1.76 and 1.95 ms, about
# half of what it spends now. In run j, the host's parts alone are past the whole budget: a free
# GPU step would not reach 5x there.
#
# The host's biggest parts are the front (1.5 to 1.7 ms) and the prompt step's own host work. In
# the server that is 0.9 to 1.2 ms. The same part in one process, the forward's host part and the
# sampling less the graph, is 0.44 ms. `frontcosts`, which the prefix
# part runs after the bench, times a request's stages on a busy host and after it idles, and a pipe
# round trip between two processes. On this host both cost several times more after a pause:

# %%
idle = lab.load_table("day64i_idle", H100)
if idle is not None:
    lab.show(idle.pivot_table(index="gap_ms", columns="what", values="us_p50").rename_axis("idle ms before").round(1))
    trip = idle[idle.what == "pipe round trip"].set_index("gap_ms").us_p50
    stages = idle[idle.what == "stages"].set_index("gap_ms").us_p50
    print(f"after 10 ms idle: a pipe round trip {trip[10.0] / trip[0.0]:.1f}x its hot time, a 2,048-id request's "
          f"stages {stages[10.0] / stages[0.0]:.1f}x")

# %% [markdown]
# The bench sends one request at a time, as a chat does, so each arrives after the core has waited
# on its pipe. How long it waited is not measured. If it is milliseconds, a request pays some of
# this on its way in and on its way out. Whether a core that polls its pipe instead of sleeping
# on it would pay (chapter 64b left that to a GPU host's many cores) starts with its wake-up:
# `frontcosts --parts idle --polling` now also times a round trip to a peer that polls. Chapter
# 64e ran it on a GPU host, and tried the polling core itself.
#
# ## Before the server
#
# `prefixsteps` also times the same kind of request inside the process (`engine_ttft`): from
# `add_request` to the first token on the host, with caching on (the engine that holds the system
# prompt) and off (an engine of its own over the same model and pool), one request of each in turn.
# No HTTP, pipe or event loop is in it, so its ratio is what prefix caching gives the engine, and the
# gap to the server's ratio is the host's. It ran on a GPU later the same day, on another H100 host,
# after this chapter's runs; {doc}`chapter 64e <64e_the_engine_or_the_machine>` reads it beside that
# host's server runs:

# %%
TTFT_COMMAND = 'PREFIXSTEPS_ARGS="--prefix day64d" scripts/gpu_run.sh prefixsteps'
gpu_ttft = lab.measured_table("day64d_prefix_ttft", TTFT_COMMAND, slug=H100)
if gpu_ttft is not None:
    lab.show(gpu_ttft.groupby("arm").ttft_ms.describe().round(3))

# %% [markdown]
# ## On this machine
#
# Both run on any device. Here they time the embedded model on this CPU, at a smaller scale (512
# cached tokens). A CPU has no graph, so the forward's host part holds the whole forward, and there
# is no GPU time to report. A CPU's forward is slow enough that the host's part hardly shows:

# %%
cpu_steps, _, cpu_split, cpu_ttft = lab.run_prefix_steps(DEFAULT_MODEL, "cpu", system_len=512, suffixes=(50,),
                                                         repeats=3, decode_steps=4)
cpu_label = lab.run_label("cpu", DEFAULT_MODEL, "float32")
lab.save_table(cpu_split, "day64d_prefix_split", cpu_label)
lab.save_table(cpu_ttft, "day64d_prefix_ttft", cpu_label)
lab.show(cpu_split[["request", "tokens", "graph", "step_ms", *SPLIT_PARTS, "rest_ms"]].round(3))
lab.show(cpu_ttft.pivot_table(index="request", columns="arm", values=["ttft_ms", "fed_tokens"]).round(1))
cpu_p50 = cpu_ttft.groupby("arm").ttft_ms.median()
print(f"in process on this CPU: TTFT p50 {cpu_p50['off']:.1f} ms off, {cpu_p50['on']:.1f} ms on "
      f"({cpu_p50['off'] / cpu_p50['on']:.1f}x at 512 cached tokens)")

# %% [markdown]
# ## The gates
#
# The split's parts never add up to more than the step, and each part was seen. On the H100 the
# graph's GPU time inside the step is within 5% of its back-to-back replay, every timed prompt
# step replayed a graph, and each ledger's parts, medians of each part, add up to within 10% of
# the TTFT p50 they split. Here every hit fed exactly its 50 new tokens, and inside the process a
# request fed only those with caching on and its whole prompt with it off.

# %%
for table in (split, cpu_split):
    if table is None:
        continue
    parts = table[list(SPLIT_PARTS)]
    assert (parts > 0).all().all() and (table.rest_ms >= 0).all(), "a part of the step was not seen"
    assert np.allclose(parts.sum(axis=1) + table.rest_ms, table.step_ms), "the split does not add up to the step"
if split is not None:
    assert split.graph.astype(bool).all(), "a timed prompt step ran eagerly"
    assert (split.tokens == PROFILED_SUFFIX).all(), "a split step fed more or less than its new tokens"
    gap = split.graph_gpu_ms.median() / split.replay_alone_ms.median() - 1
    assert abs(gap) < 0.05, f"the graph inside the step took {gap:+.1%} against back to back"
if ledger is not None:
    assert list(ledger.part.unique()) == [name for name, _, _ in LEDGER]
    sums = ledger.groupby("run").ms.sum() / ledger.groupby("run").ttft_p50_ms.first()
    assert ((sums - 1).abs() < 0.10).all(), f"a ledger's parts do not add up to its TTFT: {sums.round(3).to_dict()}"
hits = cpu_steps[cpu_steps.case == "prefix hit"]
assert (hits.tokens == hits.suffix).all() and (cpu_split.tokens == PROFILED_SUFFIX).all()
for table in (cpu_ttft, gpu_ttft):
    if table is None:
        continue
    fed = table.groupby("arm").fed_tokens
    assert (fed.max()["on"] == PROFILED_SUFFIX) and (fed.min()["off"] == table.prompt_len.min()), \
        "with caching on a request fed only its new tokens, and off all of them"
print(f"{len(cpu_split) + (0 if split is None else len(split))} split steps add up; the gates hold")

# %% [markdown]
# ## Summary
#
# - In seven runs of the prefix bench the shared prefix measured 2.5x to 3.5x, never the 5x aim.
#   On the same engine and the same kind of H100 it measured 3.34x, 3.35x and 3.11x. The second
#   turn measured 5.99x, 5.11x, 5.07x and 4.18x on H100s, so its aim is met in some runs and not
#   in others.
# - A warm hit's prompt step, alone on an H100, is 0.65 ms of host work while the GPU waits, then
#   a 1.76 ms graph that runs as fast as it does back to back. The graph spends 0.29 ms more than a
#   decode step in the attention read, 0.15 ms in small kernels and 0.10 ms in the projections.
# - In the server the host's parts of a warm hit add up to 3.5 to 4.2 ms, and the GPU's to 1.76.
#   The 5x aim leaves the whole request 3.5 to 3.7 ms. On this host the aim needs the host's part
#   cut to about half, and in run j even a free GPU step would not reach it. The host's parts grow
#   after it idles: after 10 ms without work, a pipe round trip took 8.9x its hot time and a
#   2,048-id request's stages 2.7x.
