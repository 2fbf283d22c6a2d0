# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Day 61: against the peers, TTFT and chunked prefill
#
# The {doc}`first <61_the_floor>` and {doc}`second <61b_batch_eight>` chapters of Day 61 took the
# decode step apart lever by lever, each timed inside one process against the arm before it. This
# chapter asks where the result stands from outside, as a user would call it: against gpt-fast and
# HF transformers with a static cache, compiled and eager, over whole `generate` calls. Then two
# measurements beyond a decode step: the time to first token, and Day 58's server under load with
# chunked prefill on and off, where one aim is still unmet and a mixed step is taken apart to see
# why.

# %%
import nanolab.lab as lab

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The H200 tables
#
# Every table here was measured on one H200 at Llama-3.2-1B shapes in bf16 with synthesized random
# weights, and is read from `data/`; on a CPU the chapter re-measures nothing. Each cell names its
# table and the command that made it (`floorbench`, `levers`, or Day 58's bench for the server). A
# command printed for a missing table is the lab's as of commit 6849349, which made these runs.

# %%
import pandas as pd

FLOORBENCH = "python -m nanolab floorbench"
floor = lab.measured_table("day61_floor", FLOORBENCH)
roofline = lab.load_table("day61_roofline", "h200")  # the same runs'
assert floor is not None and roofline is not None, "data/day61_floor_h200.csv and day61_roofline_h200.csv"
roofline = roofline.sort_values(["context", "batch"]).reset_index(drop=True)
target_b1 = float(roofline[(roofline.batch == 1) & (roofline.context == 128)].target_ms.iloc[0])

# %% [markdown]
# ## Every kept lever, end to end
#
# Each lever of the first two chapters was measured against the arm before it, in a process of its
# own. One run put the whole chain in one process: Day 60's engine, then each kept lever added in
# the order the chapters took them (`leverarms.DEFAULT_ARMS` as it then stood, ending at the
# engine's defaults), the levers not kept left out. It ran before the last three kept levers (PDL,
# the warmed-up tuning and the batch-8 GEMV); `DEFAULT_ARMS` now holds them too, and no longer the
# pinned inputs, the rotation kernel or the skipped shares, which the engine can no longer turn off.

# %%
kept = lab.show_lever_run("day61_kept", "ms_per_step", "python -m nanolab levers --only levers "
                          "--shapes 1@128,8@128,32@128 --profile 1@128,8@128 --stem day61_kept")
kept_agreement = lab.load_table("day61_kept_lever_agreement", "h200")
if kept is not None:
    kept_levers, kept_parts, kept_order = kept
    fig = lab.lever_run_waterfall(kept_levers, kept_parts, target_b1)
    if ON_GPU or not lab.figure_path("day61_kept_waterfall", "h200").exists():
        lab.save_figure(fig, "day61_kept_waterfall", lab.table_label(kept_levers))
    lab.show(fig)
    by_batch = kept_levers.pivot_table(index="batch", columns="arm", values="ms_per_step")
    for batch, row in by_batch.iterrows():
        print(f"batch {batch}: {row[kept_order[0]]:.3f} -> {row[kept_order[-1]]:.3f} ms a step "
              f"({row[kept_order[0]] / row[kept_order[-1]]:.2f}x)")
    lab.show(kept_agreement[["arm", "rows", "steps", "rows equal to the first arm",
                             "logits rel err to the first arm"]].round(3))

# %% [markdown]
# *Figure 61.10: A batch-1 step of each kept lever, from Day 60's engine on the left to the
# defaults of the time on the right, all in one process. The host's hatched block goes with
# asynchronous scheduling, and the small kernels fold with inductor and the rotation kernel. The
# tuned batch-1 reductions fold the norms and what was left of the small kernels into the
# projections, so the blue grows as the rest goes, and the LM head back on cuBLAS takes about 0.13
# ms off the blue.*
#
# In one process the chain took a batch-1 step from 1.65 to 1.07 ms, batch 8 from 1.65 to 1.18 and
# batch 32 from 1.92 to 1.28. The tuned batch-1 arm landed at 1.15 ms here, a draw from the upper
# half of the tuning's spread, and the LM head on cuBLAS took it to 1.08. The agreement table
# compares each arm's first decode logits with Day 60's engine's: the eager arms agree exactly, and
# every compiled arm differs by the same 2 to 3% that bf16 rounding in a different order gives
# ({doc}`61d_the_cpu` measures how far each is from fp32), which on random weights with nearly flat
# logits is enough to change greedy picks.
#
# ## Against the peers
#
# The floorbench times every arm as a user would call it: a whole `generate` of 257 new tokens
# minus one of 1, over 256. Prompts are random token ids and decoding is greedy. The arms:
#
# - **nanolab**: `LLM.generate` with graphs over the streamed read and every kept lever.
# - **gpt-fast**: its own `generate()` with `decode_one_token` compiled as its `--compile` does
#   (`mode="reduce-overhead"`), on the same weights, at batches 1 and 8.
# - **HF static, default**: transformers' `generate` with a static cache. On CUDA it compiles the
#   decode forward itself, so this is the headline peer. Batches 1 and 8.
# - **HF static, eager**: the same with `disable_compile=True`, labelled as such.
#
# Each row carries a `run` stamp: which process measured it.

# %%
measured = lab.table_label(floor)
runs = floor.groupby("run").agg(arms=("arm", lambda a: ", ".join(dict.fromkeys(a))),
                                batches=("batch", lambda b: ", ".join(map(str, sorted(set(b))))))
lab.show(runs)
stamps = pd.to_datetime(pd.Series(runs.index))
print(f"{len(runs)} processes on an {measured.device}, started "
      + ", ".join(f"{(t - stamps.min()).total_seconds() / 60:.0f}" for t in sorted(stamps))
      + " minutes after the first")
for row in floor.dropna(subset=["note"]).drop_duplicates("arm").itertuples():
    print(f"{row.label}:\n  {row.note}")

# %% [markdown]
# The rows came from five processes. nanolab and gpt-fast at batches 1 and 8 ran in one, on
# 2026-12-02, with the engine's defaults as they now stand: PDL and the tuning timed after a
# warm-up at batch 1, the Triton GEMV for a batch's projections, the read in one kernel, the plan
# uploaded in one kernel and the tokens read back on a stream of their own. nanolab's rows at
# batches 32 and 64 and at 2,048 tokens are from the process right after it on the same machine,
# which measured a copy bandwidth 2% above the first's (4.19 TB/s against 4.11), so its floors are
# shorter too. gpt-fast's step moves between processes as well: at batch 8 it took 1.665 ms in
# this one and 1.921 ms in the table before (2026-12-01, below). HF's default path at batch 8 is
# from a process of 2026-11-30, and at batch 1, with every TTFT row but HF eager's, from one half an
# hour later on a second H200 of the same kind. HF's eager arm ran hours before those, on another
# H200 of the kind; at ten times nanolab's step, a few percent between two cards does not move its
# place. A whole `generate` at batch 64 also moves between processes: floorbench
# processes of 2026-12-01 measured 1.431, 1.517, 1.489 and 1.450 ms there, and the lever runs,
# which time the step inside one process, 1.37 to 1.97. The floorbench saves its tables after every
# row, and `--append` keeps the rows of arms a later process did not run. Each process measured its
# own bandwidth, so each row's `x_floor` is over its own floor, and the floor column beside the
# times is the latest process's.
#
# The table before this one (`data/day61_floor_before_upload_h200.csv`, 2026-12-01) measured the
# same arms with the plan's four copies and the read-back on the step's stream. The cell below sets
# the two side by side, with each process's copy bandwidth, and what that bandwidth alone would
# move a step that streams at it.

# %%
before = lab.load_table("day61_floor_before_upload", "h200")
if before is not None:
    keys, cols = ["arm", "batch", "context"], ["ms_per_step", "bandwidth_tb_s"]
    pair = before[keys + cols].merge(floor[keys + cols], on=keys, suffixes=(" before", " now")).set_index(keys)
    pair["difference (us)"] = (pair["ms_per_step now"] - pair["ms_per_step before"]) * 1000
    # a step that streamed every byte at its process's copy rate moves with that rate alone
    pair["from the bandwidth alone (us)"] = (pair["ms_per_step before"] * pair["bandwidth_tb_s before"]
                                             / pair["bandwidth_tb_s now"] - pair["ms_per_step before"]) * 1000
    lab.show(pair.round(3))

# %% [markdown]
# These are different processes on different days, so each difference carries both processes'
# spread as well as the change. At batch 8 nanolab's step lost 24 us in a process whose copy
# bandwidth was 2% below the earlier one's, more than the 10 to 15 us predicted. Batch 1 moved by
# its compile's draw. The rows at 32 and 64 rows and at 2,048 tokens ran in a process about 4%
# faster at copying than the one before; that alone would have taken 47 to 69 us off them, and they
# moved by 36 to 89, so they say little about the change. gpt-fast, untouched, moved by -149 us at
# batch 1 and -256 at batch 8 between the same two processes: a whole `generate` moves this much
# from one process to the next. The one-engine run of the {doc}`second chapter <61b_batch_eight>`
# settles the change: 12.7 to 14.8 us a step, every round faster at batches 1 to 32 and seven of
# eight at 64.

# %%
side = floor.pivot_table(index=["batch", "context"], columns="label", values="ms_per_step")
side = side[list(dict.fromkeys(floor.label))]
side["floor"] = roofline.set_index(["batch", "context"]).floor_ms
side["target"] = roofline.set_index(["batch", "context"]).target_ms
lab.show(side.round(3))
lab.show(floor.pivot_table(index=["batch", "context"], columns="label", values="x_floor")[side.columns[:-2]].round(2))
fig = lab.plot_floor_roofline(floor, roofline)
if ON_GPU or not lab.figure_path("day61_roofline", "h200").exists():
    lab.save_figure(fig, "day61_roofline", lab.table_label(floor))
lab.show(fig)

# %% [markdown]
# *Figure 61.11: ms per decode step, and the same over the floor, against batch for every arm of
# the floor bench. The blue line sits under every peer at every batch, at a nearly constant
# distance above the black dashed floor; the red marks are the targets.*
#
# The issue set its targets in milliseconds, one per shape. They are printed here as measured over
# target, so 1 or less meets the target. Nothing asserts a time.

# %%
ours = floor[floor.arm == "nanolab"].set_index(["batch", "context"])
lab.show(pd.DataFrame({"ms": ours.ms_per_step, "target ms": ours.target_ms,
                       "ms / target": ours.ms_per_step / ours.target_ms,
                       "target": (ours.ms_per_step <= ours.target_ms).map({True: "met", False: "missed"}),
                       "x floor": ours.x_floor}).round(3))
for row in roofline.dropna(subset=["stretch_ms"]).itertuples():
    print(f"stretch at batch {row.batch}, context {row.context}: {row.stretch_ms:.2f} ms "
          f"({ours.loc[(row.batch, row.context)].ms_per_step / row.stretch_ms:.2f}x)")
peers = floor[floor.arm != "nanolab"].set_index(["batch", "context"])
lab.show(peers.pivot_table(index=["batch", "context"], columns="label", values="nanolab_speedup")
         .add_suffix(" / nanolab's step").round(2))

# %% [markdown]
# ## Time to first token
#
# TTFT is a `generate` of one new token, warmed up, median of five. There are two cases: one prompt
# of 2,048 tokens, and eight of 1,024. transformers' default path compiles the decode forward, not
# the prefill, so at batch 1 its two TTFT rows time much the same eager prefill. The target
# (`floorbench.TTFT_TARGET`, printed below) was a batch-1 TTFT that many times shorter than HF's
# default path's.

# %%
from nanolab.lab.floorbench import TTFT_TARGET

ttft = lab.measured_table("day61_ttft", FLOORBENCH)
assert ttft is not None, "data/day61_ttft_h200.csv"
lab.show(ttft.pivot_table(index=["batch", "prompt_len"], columns="label", values="ttft_ms").round(2))
for (b, n), arms in ttft.groupby(["batch", "prompt_len"]).arm.apply(set).items():
    absent = [a for a in dict.fromkeys(ttft.arm) if a not in arms]
    if absent:
        print(f"{b} x {n} tokens: no row for {', '.join(absent)}")
t = ttft.set_index(["arm", "batch"]).ttft_ms
ratio = t[("hf-default", 1)] / t[("nanolab", 1)]
print(f"batch 1: HF default / nanolab = {ratio:.2f}x (target {TTFT_TARGET:g}x: "
      f"{'met' if ratio >= TTFT_TARGET else 'missed'}); HF eager / nanolab = "
      f"{t[('hf-eager', 1)] / t[('nanolab', 1)]:.2f}x")
print(f"batch 8: HF eager / nanolab = {t[('hf-eager', 8)] / t[('nanolab', 8)]:.2f}x")

# %% [markdown]
# A 2,048-token prefill is one large batch of matmuls, and both engines hand those to cuBLAS. What
# nanolab could lose was the work around them, which runs eagerly:
#
# - The rotary embedding was five strided kernels over the fused q/k/v output, and SwiGLU two more
#   over halves of gate/up. `kernels.elementwise` does each in one Triton kernel when the model runs
#   eagerly on a GPU; together they took about 2 ms off this TTFT (measured before this table, in a
#   direct A/B that is not committed).
# - The rotation and the two cache scatters then became the one `rope_write` kernel, as in decode.
# - The streamed varlen read took about a third of the prefill's GPU time in a profile. It walks
#   the paged pool for every query tile, which a chunk on top of earlier tokens needs. A step of
#   whole prompts does not: each prompt attends over its own keys alone, and those are in hand. So
#   for such a step `CacheView.read` hands each prompt's own q, k and v to torch's
#   `scaled_dot_product_attention` (`prompt_attention`), which picks cuDNN's flash kernel on the
#   H200. A chunk, or a step that mixes decode rows in, keeps the streamed read.
#
# The bench below (`python -m nanolab levers --only prefill`) adds them in turn on one engine. It
# times a step loop, so its times run a little above the floorbench's TTFT.

# %%
pl = lab.measured_table("day61_prefill_levers", "python -m nanolab levers --only prefill")
assert pl is not None, "data/day61_prefill_levers_h200.csv"
pl_order = list(dict.fromkeys(pl.arm))
lab.show(pl.pivot_table(index=["batch", "prompt_len"], columns="arm", values="ttft_ms")[pl_order].round(2))
lab.show(pl.pivot_table(index=["batch", "prompt_len"], columns="arm",
                        values="logits rel err to the first arm")[pl_order].round(3))

# %% [markdown]
# The one kernel saved nothing measurable here: at 2,048 tokens the rotation and the scatters were
# a few hundred microseconds of a 14 ms prefill, and both cases moved by less than the run's noise.
# The fused attention took about 3 ms off one 2,048-token prompt and about 4 ms off eight 1,024-token
# ones, and brought the batch-1 TTFT under the target. Its logits differ from the streamed read's
# by 2.5%, the size of any two bf16 paths' difference on these near-flat random logits (bf16 itself
# is 2.5% from fp32); in fp32, `prompt_attention` matches naive attention to 1e-5 in the tests, on
# grouped and ungrouped heads.
#
# ## Under load: chunked prefill
#
# Day 58 left one aim unmet: under load, ITL p99 over p50 should be at most 3. A newly arrived
# prompt's prefill stopped every running decode for its whole length. With chunked prefill (vLLM
# v1's rule, decode rows first) a step carries the decode rows and then fills its token budget with
# prompt chunks, so a decode row waits behind one mixed step at most, never behind a run of whole
# prefills. The graphbench ran the real server at 16 and 32 requests/s with chunked prefill on
# (`graphs-chunked`) and off (`graphs-whole`), on Day 58's workload.

# %%
import textwrap

gb = lab.measured_table("day61_graphbench",
                        "python -m nanolab graphbench --arms graphs-chunked,graphs-whole --prefix day61")
assert gb is not None, "data/day61_graphbench_h200.csv"
served = lab.check_requests(gb)
print(textwrap.fill(str(served), 100, subsequent_indent="  "))
lab.show(gb[["arm", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tpot_p50_ms", "decode_steps",
             "prefill_steps", "prefill_p50_ms", "mixed_steps", "mixed_p50_ms", "server_step_p50_ms"]].round(2))
fig = lab.plot_chunked_itl(gb)
if ON_GPU or not lab.figure_path("day61_chunked_itl", "h200").exists():
    lab.save_figure(fig, "day61_chunked_itl", lab.table_label(gb))
lab.show(fig)

# %% [markdown]
# *Figure 61.12: ITL at p50 (left) and p99 (right) on the server, with chunked prefill on and off,
# at each offered rate. Chunking cuts the p99 bars, more at the higher rate, yet both arms stay far
# above the black ticks that mark the aim.*

# %%
by = gb.set_index(["arm", "rate"])
chunking = []
for rate in sorted(gb.rate.unique()):
    whole, chunked = by.loc[("graphs-whole", rate)], by.loc[("graphs-chunked", rate)]
    chunking.append({"rate (req/s)": rate, "ITL p99 whole (ms)": whole.itl_p99_ms,
                     "ITL p99 chunked (ms)": chunked.itl_p99_ms, "ITL p50 whole (ms)": whole.itl_p50_ms,
                     "ITL p50 chunked (ms)": chunked.itl_p50_ms,
                     "p99 / p50 chunked (aim <= 3)": chunked.itl_p99_ms / chunked.itl_p50_ms,
                     "mixed steps": int(chunked.mixed_steps), "mixed step p50 (ms)": chunked.mixed_p50_ms,
                     "mixed step / decode step": chunked.mixed_p50_ms / chunked.server_step_p50_ms})
lab.show(pd.DataFrame(chunking).round(2))

# %% [markdown]
# Chunking cut the tail and left the median alone, as predicted. The aim is still missed, and the
# table shows why: a mixed step carries decode rows beside prompt chunks, runs eagerly with no CUDA
# graph, and costs several decode steps' time, and p99 now lands on those steps. Closing the gap
# needs a faster path for the mixed step. Two were measured, each a server beside the engine's own:
# - **The mixed steps compiled** into one graph whose token count is symbolic, with the varlen read
#   as one opaque op whose grid is cut for the step's tokens rather than its longest segment, so no
#   host value of the plan entered the graph. On the CPU, and on the H200 in fp32, mixed steps of
#   several token counts and mixes gave the reference's logits through it, and no mix compiled a
#   graph of its own. The graphbench arm `graphs-compiled` ran beside `graphs-chunked`, in one
#   process (`day61_varlen`).
# - **A smaller token budget.** A step of fewer tokens should take less time, so the budget (vLLM's
#   `max_num_batched_tokens`, 2,048 here) was cut to 512 (`graphbench --max-num-batched-tokens 512`,
#   `day61_budget512`, the next process on the same H200).

# %%
varlen_runs = {name: lab.load_table(f"{name}_graphbench", "h200") for name in ("day61_varlen", "day61_budget512")}
assert not any(t is None for t in varlen_runs.values()), "data/day61_varlen_* and day61_budget512_*"
# The varlen run predates the table's budget column: its servers ran the default budget then, 2,048.
varlen_runs = {name: t if "token_budget" in t else t.assign(token_budget=2048)
               for name, t in varlen_runs.items()}
budgets = pd.concat([t.assign(run=name) for name, t in varlen_runs.items()], ignore_index=True)
print("measured on:", lab.table_label(budgets).caption().replace("; ", ";\n  "))
lab.show(budgets[["run", "arm", "token_budget", "rate", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "mixed_steps",
                  "mixed_p50_ms", "server_step_p50_ms"]].round(2))
traces = {}
for name, t in varlen_runs.items():
    trace = lab.load_table(f"{name}_trace", "h200")
    for arm, budget in t.groupby("arm", sort=False).token_budget.first().items():
        traces[f"{arm}, {budget:,} tokens"] = trace[(trace.arm == arm) & (trace.rate == 32)]
mixed = pd.concat([t[t.phase == "mixed"].assign(trace=name) for name, t in traces.items()])
print("mixed steps in the traces, 32 req/s: "
      + "; ".join(f"{n}: {g.ms.min():.1f} to {g.ms.max():.1f} ms over {g.tokens.min()} to {g.tokens.max()} tokens"
                  for n, g in mixed.groupby("trace", sort=False)))
fig = lab.plot_mixed_steps(traces, step_ms=float(budgets.server_step_p50_ms.median()))
if ON_GPU or not lab.figure_path("day61_mixed_steps", "h200").exists():
    lab.save_figure(fig, "day61_mixed_steps", lab.table_label(budgets))
lab.show(fig)

# %% [markdown]
# *Figure 61.13: every mixed step of each server's step trace at 32 requests/s (a window of its
# steps), its time against the tokens it fed, beside the servers' median step (dashed), nearly all
# of whose steps decode. No cloud rises with the tokens, and none comes down to that line.*
#
# Neither lever took the mixed step near a decode step's time:
# - **Compiled**, its median was 8.49 ms against 8.47 eagerly at 32 requests/s, and 11.96 against
#   13.51 at 16: no change at the higher rate, 11% shorter at the lower.
# - **A budget of 512 tokens**, in the next process, gave 11.57 ms at 32 requests/s (longer than
#   either 2,048-token server's 8.5) and 13.03 at 16 (against their 12.0 and 13.5).
#
# In the eager server's trace, mixed steps of 79 to 153 tokens took 7.4 to 8.5 ms, and those of 444
# to 502 tokens 7.5 to 8.6. About 7 ms of every mixed step is a cost that follows neither its token
# count nor whether it is compiled. The arithmetic is not it: 500 tokens through Llama-3.2-1B's
# layers are about 1 TFLOP, a millisecond or two at this card's dense bf16 rate, and 80 tokens a
# sixth of that. ITL p99 over p50 at 32 requests/s was 7.8 for the eager server and 13.6 for the
# compiled one in this run; the same eager server measured 12.3 in the run above, so the two tails
# sit inside one server's spread and this run cannot rank them. Neither lever was kept then: the
# budget stayed 2,048. (Day 63 captured the whole mixed step in graphs, over the compiled model, and
# lowered the budget to 512, once every step of that size replayed one.)
#
# Then one mixed step was taken apart (`levers --only mixed`, `lab.mixedsteps`). Sixteen rows
# decode at about 512 tokens each, a prompt of 64, 512 or 2,048 tokens arrives, and each step that
# carries its chunks is split into the host's time inside the varlen forward (planning it and
# launching its kernels), the forward's span on the GPU (between events recorded as the forward is
# called and as it returns), sampling with its read-back, and the rest of the step. A profile of the
# 512-token prompt's step gives its kernels' time.

# %%
anatomy = lab.measured_table("day61_mixed_anatomy", "python -m nanolab levers --only mixed")
mixed_kernels = lab.load_table("day61_mixed_kernels", "h200")  # the same run's
if anatomy is not None:
    lab.show(anatomy[["arm", "phase", "prompt_len", "chunk", "tokens", "step_ms", "forward_host_ms",
                      "forward_span_ms", "sample_ms", "rest_ms", "steps"]].round(2))
    busy = mixed_kernels.groupby("arm", sort=False).us_per_step.sum() / 1000
    span = anatomy[(anatomy.phase == "mixed") & (anatomy.prompt_len == mixed_kernels.prompt_len.iloc[0])
                   & (anatomy.chunk == 0)].set_index("arm").forward_span_ms
    lab.show(pd.DataFrame({"kernels' summed time (ms)": busy, "forward's span (ms)": span,
                           "GPU busy share": busy / span}).round(2))
    fig = lab.plot_mixed_anatomy(anatomy, mixed_kernels)
    if ON_GPU or not lab.figure_path("day61_mixed_anatomy", "h200").exists():
        lab.save_figure(fig, "day61_mixed_anatomy", lab.table_label(anatomy))
    lab.show(fig)

# %% [markdown]
# *Figure 61.14: each mixed step of the run, eagerly (top) and compiled (bottom), as the host's
# time inside the varlen forward (blue), sampling with its read-back (orange) and the rest of the
# step (grey). The black tick is the forward's span on the GPU, the red one the summed time of the
# 512-token prompt's kernels, and the dashed line a decode step of the same rows. The blue bars
# and the black ticks end together.*
#
# The forward is host-bound. For 80 tokens and for 528, eager or compiled, the host spent 9.8 to
# 10.2 ms inside the forward (9.6 to 10.0 for the 32-token second chunk), and the forward's span on
# the GPU ended within 0.05 ms of it: the GPU ran each kernel as soon as it was launched, then
# waited for the next. The kernels of the 528-token step add up to 3.3 ms eagerly and 3.2 compiled,
# a third of the span. Only the first chunk of the 2,048-token prompt (2,048 tokens) kept the GPU
# busier than the host: its forward ran 14.6 ms, 3.5 to 3.9 of them after the host had returned,
# which the timed sampling waits for. Sampling and the rest of the step take about half a
# millisecond. Compiling did not shorten the host's part, so that time is not in what inductor
# fuses; which calls inside the forward hold it is for a profile of the host to say. This run's
# mixed steps are longer than the server's (7.4 to 8.6 ms in the traces above): its rows, its
# events and its timed sampler's waits are its own. Neither grows with its tokens, and here the
# host sets their length.
#
# ### The host's time, by part
#
# `levers --only mixedhost` (`lab.mixedsteps.mixed_host_parts`) splits it. The same sixteen rows
# run, a prompt of 64, 512 or 1,536 tokens arrives (each fits one step), and timers on every module
# of the model, on the planning, on the rotation and K/V write and on the attention read charge each
# part its own time, with what it calls that is timed too taken out. The timers cost something
# themselves, so as many steps again ran without them (`plain_us`).

# %%
host = lab.measured_table("day61_mixed_host", "python -m nanolab levers --only mixedhost")
if host is not None:
    by_part = host.pivot_table(index="part", columns="prompt_len", values="us", sort=False)
    by_part["calls a step"] = host.groupby("part", sort=False).calls.first()
    lab.show(by_part.round(0))
    totals = host.groupby("prompt_len").agg(tokens=("tokens", "first"), parts_us=("us", "sum"),
                                             timed_us=("run_varlen_us", "first"), untimed_us=("plain_us", "first"),
                                             timed_calls=("calls", "sum"))
    totals["timer cost a call (us)"] = (totals.timed_us - totals.untimed_us) / totals.timed_calls
    launches = ["attention read", "rotation and K/V write", "mlp: SwiGLU, the rest"]
    totals["three Triton launches a layer (share)"] = (host[host.part.isin(launches)].groupby("prompt_len").us.sum()
                                                       / totals.parts_us)
    lab.show(totals.round(2))
    fig = lab.plot_mixed_host(host)
    if ON_GPU or not lab.figure_path("day61_mixed_host", "h200").exists():
        lab.save_figure(fig, "day61_mixed_host", lab.table_label(host))
    lab.show(fig)

# %% [markdown]
# *Figure 61.15: the host's time inside an eager mixed step, by part, for each prompt, the largest
# at the top, with each part's calls a step in brackets. Each of the top three rows holds one
# Triton launch a layer.*
#
# With its timers the forward took 14.2 to 15.0 ms, and 11.4 or 11.5 without them at 64 and 512
# tokens: the step's 183 timed calls cost 15 to 20 us each, so every part includes about that much
# a call. At 1,536 tokens the untimed step was the longer one, 17.0 ms against 15.0: there the
# GPU's forward takes longer than the host's, and something inside `run_varlen` waited for it; this
# table does not say what.
# - The three parts that launch a Triton kernel each layer come first: the attention read (137 to
#   147 us a call), the rotation and K/V write (116 to 122), and the MLP's own time, which is
#   `silu_mul`'s launch (99 to 107). Together they take 5.7 to 6.0 ms, 38 to 41% of the timed step,
#   for 48 launches.
# - A projection costs 37 to 62 us a call on the host, a layer norm 30 to 37, and a layer's two
#   residual adds, with what else the layer does itself, 82 to 86. Each is one eager torch op, or
#   two, on this machine's host.
# - Planning grows with the tokens, from 0.59 to 1.36 ms: in this run `plan_varlen` built each
#   token's write slot and position in Python lists and made tensors of them one element at a time.
#   It now slices a long segment's slots from its blocks in tensor ops and makes its int64 tensors
#   through `array`, with the same six copies to the GPU. A version that also staged the six vectors
#   in pinned memory ran once in another process (`data/day61_mixed_host_staged_h200.csv`): 0.83,
#   0.75 and 0.95 ms at the three prompts, which one run in two processes cannot rank, so the copies
#   stay as they were.
#
# So the lever is to take the host out of the forward, and which way matters. A piecewise graph
# with the varlen read left outside it (vLLM's default) would still pay the read's sixteen launches,
# about 2 ms a step here. A graph over the whole mixed step would take all of it, with the token
# count padded to a bucket and the read's grid cut for the bucket. Launching the Triton kernels
# through a cached launcher would take the larger part of the three. {doc}`63_serving_tail` builds
# the graph over the whole mixed step.
#
# ## Looking back, and the gates
#
# - **Against the peers**, nanolab's step is the fastest measured at every batch, 1.23x gpt-fast's
#   at batch 1 and 1.53x at batch 8 in one process, and it meets every step target of the issue in
#   the floor table (the printed ratios): batch 8, 1% short of its target in the table before the
#   upload changed (1.112 ms against 1.10), measured 1.088. Batch 1's row is one draw; the median of
#   four fresh compiles sits on its target (1.0005 ms). Whole-generate times move by a few percent
#   between processes, with the copy bandwidth each one measures.
# - **Time to first token** meets its target since whole prompts attend through torch's fused
#   attention instead of the streamed read.
# - **Chunked prefill** cut the server's ITL tail without moving the median; {doc}`61d_the_cpu`
#   checks that it decodes the whole-prompt engine's tokens. The tail aim is still missed, and p99
#   lands on the mixed steps. Compiling them, or cutting the budget to 512 tokens, did not shorten
#   them. A mixed step is about 10 ms of the host inside its forward, with the GPU busy for a third
#   of it, and three Triton launches a layer, at 100 to 150 us each, take about 40% of the timed
#   step's host time: the next lever is a graph over the whole mixed step, read included, or
#   cheaper launches.

# %%
import dataclasses

gates = [dataclasses.replace(gate, name=f"{run}: {gate.name}") for run, gate in
         [("day61_graphbench", served)] + [(run, lab.check_requests(t)) for run, t in varlen_runs.items()]]
eager = kept_agreement.iloc[:2]  # Day 60's engine and the pinned inputs: no compiled arm yet
gates.append(lab.Gate("the kept chain's eager arms decode Day 60's tokens and logits exactly",
                      bool((eager["rows equal to the first arm"] == eager.rows).all()
                           and (eager["logits rel err to the first arm"] == 0).all()),
                      {"arms": eager.arm.tolist(), "rows equal": eager["rows equal to the first arm"].tolist()}))
rope_err = pl[pl.arm == pl_order[1]]["logits rel err to the first arm"]
gates.append(lab.Gate("the rotation-and-write kernel leaves a prefill's logits as the streamed read's",
                      bool((rope_err == 0).all()), {"cases": len(rope_err), "max rel err": float(rope_err.max())}))
for gate in gates:
    print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
    assert gate, gate
