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
# # Day 61: the floor and batch 1
#
# A decode step at batch 1 reads every weight once and does almost no arithmetic with it. The
# bytes it must read, over the bandwidth the card actually delivers, give a time that no engine
# beats without reading fewer bytes: **the floor**. By Day 60 nanolab's step replayed one CUDA
# graph over the streamed read, and still took several times the floor. This chapter asks where
# the rest of a batch-1 step's time goes, and pulls one lever at a time to take it back, each
# with a prediction that the measurement then checks:
#
# - four levers that take the small kernels and the host out of every step: **pinned step
#   inputs** (`kv_cache.stage`), **inductor over the graphed step** (`runner.compile_decode`),
#   **asynchronous scheduling** (`EngineConfig(async_scheduling=True)`, vLLM's name) and **one
#   kernel for the rotation and the K/V write** (`CacheView.write_rotated`);
# - then the projections, which are what is left: fused projections with PDL and inductor's
#   matmul templates (not kept), a two-pass argmax, **tuned reductions**, the **LM head back on
#   cuBLAS**, **PDL** and the tuning **timed after a warm-up**.
#
# Day 61 takes four chapters: the {doc}`second <61b_batch_eight>` takes batch 8 and what runs
# between two steps, the {doc}`third <61c_against_the_peers>` sets the result beside its peers and
# under load, and the {doc}`fourth <61d_the_cpu>` measures bf16 against fp32, and the CPU.

# %%
import nanolab.lab as lab

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The H200 tables
#
# Every table here was measured on one H200 at Llama-3.2-1B shapes in bf16 with synthesized
# random weights and is read from `data/`; a CPU re-measures nothing. `python -m nanolab levers`
# builds one graphed engine per lever and times its decode step; `floorbench` gives the floor. A
# command printed for a missing table is the lab's as of commit 6849349, which made these runs.

# %%
import pandas as pd

STEMS = ("levers", "parts", "lever_agreement", "roofline", "floor")
h200 = {stem: lab.load_table(f"day61_{stem}", "h200") for stem in STEMS}
missing = [f"data/day61_{stem}_h200.csv" for stem, table in h200.items() if table is None]
assert not missing, f"missing: {missing} (python -m nanolab levers and floorbench on an H200)"
labels = pd.DataFrame([{"table": f"day61_{stem}", **lab.table_label(t).as_columns()} for stem, t in h200.items()])
lab.show(labels.drop(columns=["device_slug"]))
measured = lab.table_label(h200["levers"])

# %% [markdown]
# ## The floor
#
# A step's floor is the bytes it must read over the bandwidth of a device-to-device copy measured
# in the same run: every weight once, the tied head once, and the K and V of the history each row
# attends to. At batch 1 and a short context the weights are nearly all of it. Each bench measures
# its own bandwidth, which moves a little between processes, so each table's `x_floor` is over its
# own run's floor; the last line prints how far the levers' floor is from the floorbench's.

# %%
roofline = h200["roofline"].sort_values(["context", "batch"]).reset_index(drop=True)
first = roofline[(roofline.batch == 1) & (roofline.context == 128)].iloc[0]
weights_ms = first.weight_bytes / (first.bandwidth_tb_s * 1e12) * 1e3
print(f"weights: {first.weight_bytes / 1e9:.3f} GB; "
      f"copy bandwidth: {first.bandwidth_tb_s:.2f} TB/s; "
      f"the weights alone take {weights_ms:.3f} ms;\n"
      f"floor at batch 1, context 128: {first.floor_ms:.3f} ms")
lab.show(roofline[["batch", "context", "kv_tokens", "weight_bytes", "kv_bytes", "step_bytes",
                   "bandwidth_tb_s", "floor_ms", "target_ms", "target_x_floor"]].round(3))
levers = h200["levers"]
bw = {"levers": levers.bandwidth_tb_s.iloc[0], "floorbench": h200["floor"].bandwidth_tb_s.iloc[0]}
print(", ".join(f"{name}: {v:.3f} TB/s" for name, v in bw.items())
      + f"; the levers' floor is {bw['floorbench'] / bw['levers']:.3f}x the floorbench's")

# %% [markdown]
# ## Five arms, one lever added at a time
#
# Each arm keeps every lever before it, so the arms read as a waterfall. "graphs (before)" is Day
# 60's engine: graphs over the streamed read, step inputs copied from pageable memory. Each step is
# timed as `LLM.generate` runs it, host work included: ms per step at each batch and context, then
# over the floor. All five arms ran in one process.

# %%
order = list(dict.fromkeys(levers.arm))
step_ms = levers.pivot_table(index=["batch", "context"], columns="arm", values="ms_per_step")[order]
lab.show(step_ms.round(3))
lab.show(levers.pivot_table(index=["batch", "context"], columns="arm", values="x_floor")[order].round(2))

# %% [markdown]
# ### Where a batch-1 step's time goes
#
# At batch 1 and context 128 the bench also profiled 32 graphed steps of each arm, sorted every
# kernel into a class (`stepparts.kernel_class`) and called the rest of the step the host's, time the
# GPU sat idle. The black tick over each bar is the graph's replay timed alone with events: the
# GPU's part of the step, gaps between kernels included.

# %%
parts = h200["parts"]
b1 = levers[(levers.batch == 1) & (levers.context == 128)].set_index("arm")
target_b1 = float(roofline[(roofline.batch == 1) & (roofline.context == 128)].target_ms.iloc[0])
by_part = parts.pivot_table(index="part", columns="arm", values="ms", aggfunc="sum")[order].fillna(0.0)
lab.show(by_part.sort_values(order[-1], ascending=False).round(3))  # 0: no kernel of that class ran
fig = lab.plot_lever_waterfall(parts, b1.floor_ms.iloc[0], target_b1, replay_ms=b1.replay_ms.to_dict())
if ON_GPU or not lab.figure_path("day61_waterfall", "h200").exists():
    lab.save_figure(fig, "day61_waterfall", measured)
lab.show(fig)

# %% [markdown]
# *Figure 61.1: A batch-1 step of each arm by kernel class, read from left to right. The red and
# orange blocks fold into the small gold block once inductor fuses them, the grey host block
# shrinks once asynchronous scheduling hides it, the gold block shrinks again with the one
# rotation-and-write kernel, and the blue projections keep their height.*
#
# ### Pinned step inputs: nothing, on its own
#
# Every step copies its small host tables (positions, slots, the block table's new cells) to the
# GPU. From pageable memory a copy makes the host wait; staged in pinned memory it is queued. The
# prediction was modest, since the synchronous engine waits for each step's tokens anyway, and so
# it went: the step and replay did not get faster, and planning (`plan_step`) took longer, since
# `stage` copies each input into a pinned block first. The lever earns its place later: a pageable
# copy would undo the next lever's overlap. It decodes exactly the arm before's logits.

# %%
anatomy = ["schedule_us", "plan_step_us", "replay_us", "sampler_us", "rest_us"]
before, pinned = order[0], order[1]
by_shape = {arm: levers[levers.arm == arm].set_index(["batch", "context"]) for arm in (before, pinned)}
lab.show(pd.DataFrame({f"{col}, pinned over before": by_shape[pinned][col] / by_shape[before][col]
                       for col in ("ms_per_step", "replay_ms", "plan_step_us")}).round(2))
agreement = h200["lever_agreement"].set_index("arm")
print(f"pinned against before: {agreement.loc[pinned, 'rows equal to the first arm']} of "
      f"{agreement.loc[pinned, 'rows']} rows equal, logits rel err "
      f"{agreement.loc[pinned, 'logits rel err to the first arm']:.1e}")

# %% [markdown]
# ### Inductor: the small kernels fold together
#
# Between the projections a Llama layer runs small kernels for the rotary embedding, the cache
# writes, the residual adds and the SiLU; at batch 1 each moves a few kilobytes and still costs a
# kernel's start-up. `torch.compile` fuses them into a few Triton kernels, and the graph captures
# the compiled step, the streamed read kept as one opaque op. The prediction: most of that time
# gone, the projections and the read unmoved. So it went, the RMS norms taking in the residual
# adds. The replay got shorter at every shape; the step by less, since in a synchronous engine
# the host's part comes on top of every replay.

# %%
inductor = order[2]
small = ["copies and indexing", "other elementwise", "norms", "fused by inductor"]
host = by_part.loc["host (GPU idle)"]
print(f"batch 1: copies, elementwise and norms {by_part.loc[small, pinned].sum():.3f} ms -> "
      f"{by_part.loc[small, inductor].sum():.3f} ms;\n"
      f"  host (GPU idle) {host[pinned]:.3f} -> {host[inductor]:.3f} ms")
replay = levers.pivot_table(index=["batch", "context"], columns="arm", values="replay_ms")[order]
lab.show(replay.round(3))
lab.show(pd.DataFrame({"replay saved (ms)": replay[pinned] - replay[inductor],
                       "step saved (ms)": step_ms[pinned] - step_ms[inductor]}).round(3))

# %% [markdown]
# ### Asynchronous scheduling: the host goes under the GPU
#
# After inductor the grey block was the host's whole step (scheduling, planning, launching the
# replay, reading back and appending the tokens) while the GPU waited. Asynchronous scheduling
# launches step t + 1 before reading back step t's tokens, gathering t + 1's input ids on the
# device. The prediction: a step would take about the replay and no more. The table shows that
# at every shape; most of the grey block left lies under the replay's tick, the gaps between
# kernels inside the graph. The step anatomy (`stepparts.step_anatomy`) times the engine's own
# methods, synchronizing before every timed step. In the synchronous arms `rest_us` includes the
# wait for the GPU's tokens; asynchronously the anatomy adds up to the host's own work, shorter
# than the replay it runs beside.

# %%
overlapped = order[3]
kernels_ms = by_part[overlapped].drop("host (GPU idle)").sum()
print(f"batch 1: host (GPU idle) {host[inductor]:.3f} ms -> {host[overlapped]:.3f} ms, of which "
      f"{b1.replay_ms[overlapped] - kernels_ms:.3f} ms\n"
      "  are gaps between kernels inside the replay")
last = levers[levers.arm == overlapped].set_index(["batch", "context"])
lab.show(pd.DataFrame({"step ms": last.ms_per_step, "replay ms": last.replay_ms,
                       "step / replay": last.ms_per_step / last.replay_ms,
                       "host work ms": last[anatomy].sum(axis=1) / 1000}).round(3))
lab.show(levers.set_index(["arm", "batch", "context"])[anatomy].round(1).loc[order])

# %% [markdown]
# ### One kernel for the rotation and the K/V write
#
# The asynchronous arm still ran three inductor kernels a layer before the read: q's rotation,
# k's rotation fused with its scatter into the K pool, and v's scatter into the V pool (inductor
# does not fuse two scatters into different buffers). `rope_write` (`kernels.elementwise`) does
# all three in one Triton kernel, a program a token, called by the compiled step as one opaque
# operator that declares its writes to the pools (`rope_write_op`). The prediction: two launches
# a layer, 32 kernels a step, a few tens of microseconds, at every batch.

# %%
rope = order[4]
lab.show(pd.DataFrame({"step saved (ms)": step_ms[overlapped] - step_ms[rope],
                       "replay saved (ms)": replay[overlapped] - replay[rope]}).round(3))
print(f"batch 1, small kernels (copies, elementwise, norms, inductor's): "
      f"{by_part.loc[small, overlapped].sum() * 1000:.0f} us -> "
      f"{by_part.loc[small, rope].sum() * 1000:.0f} us a step;\n"
      f"  the rope_write kernel itself: {by_part.loc['other elementwise', rope] * 1000:.0f} us a step")
print(f"rope_write against the arm before: "
      f"{agreement.loc[rope, 'logits rel err to the first arm']:.3f} logits rel err to the first arm, "
      f"where the arm before has {agreement.loc[overlapped, 'logits rel err to the first arm']:.3f}")

# %% [markdown]
# The step and the replay shrank at every shape by a few tens of microseconds, as predicted. The
# kernel rotates in fp32 and rounds once, where the torch ops round after each bf16 product, so
# its logits differ from the arm before's as any two bf16 paths do ({doc}`61d_the_cpu`). On the
# CPU the model keeps the torch ops; the interpreter tests the kernel against them, a padded row's
# sink slot included.
#
# ## What is left: the projections
#
# A batch-1 step is now nearly all GPU time, most of it cuBLAS running the projections, whose
# bytes are almost the whole weight, so they can be set against the weights' own floor:

# %%
gpu_ms = b1.replay_ms[order[-1]]
proj_ms = by_part.loc["projections", order[-1]]
print(f"batch 1 after the levers: step {b1.ms_per_step[order[-1]]:.3f} ms, "
      f"replay {gpu_ms:.3f} ms, of which projections {proj_ms:.3f} ms ({proj_ms / gpu_ms:.0%});\n"
      f"  the weights at the copy bandwidth: {weights_ms:.3f} ms; the projections stream them at "
      f"{first.weight_bytes / (proj_ms * 1e-3) / 1e12:.2f} TB/s\n"
      f"  ({weights_ms / proj_ms:.0%} of the copy's rate)")

# %% [markdown]
# A Triton GEMV, timed alone against cuBLAS, at best tied it; it returns in the
# {doc}`next chapter <61b_batch_eight>`, where it pays at batch 8.
#
# ### Fused projections with programmatic dependent launch, measured and not kept
#
# This try folds everything between two projections into them, so a layer is five kernels, each
# launched as a programmatic dependent of the one before (Hopper's PDL) to start while its
# predecessor drains. `lab.projections` holds it (`FusedDecode`): RMSNorm inside the q/k/v
# projection with RoPE and the K/V write, the residual adds inside o and down, SwiGLU inside
# gate/up, the final norm inside the head. The prediction: about 0.15 ms of small kernels gone and
# most in-graph gaps hidden. `day61_fused` ran it beside the asynchronous arm, at 1, 8 and 16 rows.

# %%
fused = lab.show_lever_run("day61_fused", "replay_ms", "python -m nanolab levers --only levers --arms 3,7,8 "
                           "--shapes 1@128,8@128,16@128 --stem day61_fused")
if fused is not None:
    fl, _, f_order = fused
    one = fl[fl.batch == 1].set_index("arm").replay_ms
    print(f"batch 1 replay: {one[f_order[0]]:.3f} ms compiled, {one[f_order[1]]:.3f} ms fused, "
          f"{one[f_order[2]]:.3f} ms fused with PDL")

# %% [markdown]
# The small kernels went and PDL shortened the fused replay, but the fused step started slower
# than the compiled one and PDL did not close the gap: the fused kernels read the big matrices
# (gate/up, 67 MB a layer, and the 525 MB head) well below cuBLAS's bandwidth, which costs more
# than every small kernel saved. The engine keeps inductor around cuBLAS.
#
# One piece of that run paid and was kept. torch's argmax reduces a row in one block of threads:
# an earlier profile of the asynchronous arm (this table as committed at 2a6b4ef) put 27.1 us of
# every batch-1 step in "sampling", longer than a layer's projections. `kernels.argmax` picks the
# token in two passes, chunks of 4,096 logits a program and then the best chunk. Every arm of the
# waterfall above runs it now:

# %%
print(", ".join(f"{arm}: {by_part.loc['sampling', arm] * 1000:.1f} us" for arm in order) + " of sampling a step")

# %% [markdown]
# ### Inductor's own matmul templates at batch 1, measured and not kept
#
# With `max_autotune_gemm` inductor times each matmul as cuBLAS and as each of its Triton
# templates, which can also carry the norm or activation next to it, and keeps the fastest.
# `leverarms.autotuned_batch_1` compiles the batch-1 graph that way, the batched graph as it was.
# The prediction was a faster batch 1 and an unchanged batch 8.

# %%
lab.show_lever_run("day61_autotune", "ms_per_step", "python -m nanolab levers --only levers --arms 4,5 "
                   "--shapes 1@128,8@128 --stem day61_autotune")

# %% [markdown]
# Batch 8 did not move, but batch 1 got slower: the chosen templates run the projections about a
# third slower than cuBLAS, down the worst at about 1.5 TB/s. The likely reason is how inductor
# chose: it times each candidate alone, many times on the same inputs, so every weight but
# gate/up's (67 MB) can stay in the 60 MB L2, while in the step each weight comes from HBM once.
# This run did not test that. The engine keeps cuBLAS.
#
# ### Batch 1 with tuned reductions, kept
#
# gpt-fast compiles with inductor's coordinate-descent tuning, under which a one-row matmul is
# lowered to a multiply and a sum, a Triton reduction that inductor fuses with its neighbours and
# tunes for the shape (its source says matrix-vector products reach peak bandwidth only that way).
# `runner.DecodeForward` compiles the batch-1 graph with `coordinate_descent_tuning`
# (`BATCH_1_OPTIONS`), the batched graph as it was. The prediction: a shorter batch-1 step, from
# reductions that stream faster than cuBLAS or from fewer kernels, each norm and activation folded
# into the projection next to it. Batch 8 should not move.

# %%
batch1 = lab.show_lever_run("day61_batch1", "ms_per_step", "python -m nanolab levers --only levers --arms 4,6 "
                            "--shapes 1@128,8@128 --stem day61_batch1")
if batch1 is not None:
    bl, b_parts, b_order = batch1
    b1_steps = bl[bl.batch == 1].set_index("arm").ms_per_step
    print(f"batch 1: {b1_steps[b_order[0]]:.3f} -> {b1_steps[b_order[1]]:.3f} ms "
          f"({1 - b1_steps[b_order[1]] / b1_steps[b_order[0]]:.1%} shorter); GPU kernels "
          f"{b_parts[b_order[0]].drop('host (GPU idle)').sum():.3f} -> "
          f"{b_parts[b_order[1]].drop('host (GPU idle)').sum():.3f} ms")

# %% [markdown]
# The step got shorter and batch 8 did not move, but the first reason was wrong: the reductions
# read a little slower than cuBLAS, and the projections class grew. The norms and inductor's other
# fused kernels are almost gone, folded into the next projection with their launches and gaps: the
# host-and-gaps part halved. The engine keeps the lever, one graph more compiled at start.
#
# ### The tuning's spread, and the LM head back on cuBLAS, kept
#
# A lever run of the read (`day61_step`, {doc}`next chapter <61b_batch_eight>`) added PDL in its
# third arm, the fastest at batch 1 by far, and not for PDL: its LM head's reduction took about 115
# us a step, against about 215 in the two arms before. Each arm compiles its own batch-1 graph, and
# inductor tunes it afresh each time.
#
# Coordinate-descent tuning walks each kernel's launch settings a step at a time and keeps any
# step that times 0.1% faster; where it stops depends on where it started and on each timing's
# noise. `levers --only spread` compiles each arm's batch-1 engine afresh several times, inductor's
# caches off, and times and profiles each compile, alternating arms so drift on the card falls on
# every arm. Two runs, on two H200s of the kind:
#
# - the engine's step against the same with PDL in the compiled step (inductor's
#   `triton.enable_pdl` and the engine's ops as programmatic dependents);
# - the step with the LM head left to cuBLAS (`layers.Linear.opaque`, one `linear_op` that
#   inductor does not lower), the same with the down projection too, and the engine's step again.

# %%
spread_runs = [lab.load_table(stem, "h200") for stem in ("day61_tuning_spread", "day61_opaque_tuning_spread")]
spread_profiles = [lab.load_table(stem, "h200") for stem in ("day61_spread_profile", "day61_opaque_spread_profile")]
assert not any(t is None for t in spread_runs + spread_profiles), \
    "`python -m nanolab levers --only spread --trials 3` and `--arms 11,12,6 --stem day61_opaque` on an H200"
spread = pd.concat(spread_runs, ignore_index=True)
head = pd.concat([lab.once_a_step(p) for p in spread_profiles], ignore_index=True)
summary = spread.groupby("arm", sort=False).ms_per_step.agg(["count", "min", "median", "max"])
summary = summary.join(head.groupby("arm").us_per_step.agg(["min", "max"]).add_prefix("LM head us, "))
lab.show(summary.round(3))
fig = lab.plot_tuning_spread(spread, head, target_ms=1.0)
if ON_GPU or not lab.figure_path("day61_tuning_spread", "h200").exists():
    lab.save_figure(fig, "day61_tuning_spread", lab.table_label(spread_runs[0]))
lab.show(fig)
tuned = spread[spread.arm == "+ tuned batch-1 reductions"].ms_per_step
cublas_head = spread[spread.arm == "+ cuBLAS LM head"].ms_per_step
print(f"tuned step over {len(tuned)} compiles: {tuned.min():.3f} to {tuned.max():.3f} ms, median "
      f"{tuned.median():.3f}; with the LM head on cuBLAS ({len(cublas_head)} compiles): median "
      f"{cublas_head.median():.3f} ms, {tuned.median() / cublas_head.median():.2f}x shorter")

# %% [markdown]
# *Figure 61.2: left, the batch-1 step of each arm, one dot per fresh compile and a bar at the
# median, against the target. Right, the LM head of the same compiles: inductor's tuned reduction
# as dots, cuBLAS as squares. The same code lands anywhere in a band wider than the gap to the
# target.*
#
# - **The spread is the tuning's.** One code, compiled six times, ran its batch-1 step anywhere in
#   a band of about 0.19 ms; the last stop's batch-1 row (1.073 ms) was one draw, near its bottom.
# - **PDL does not pay**: its median sits with the engine's. Its gain in the lever run was a draw.
# - **The LM head is the worst draw.** Its reduction read the 525 MB head in 125 to 328 us across
#   compiles, cuBLAS in about 120 us every time. The engine leaves the LM head to cuBLAS whenever
#   it tunes the batch-1 graph (`runner.compile_decode`).
# - **The down projection on cuBLAS does not pay**: its SwiGLU can no longer fold into it. It
#   stays tuned.
#
# The rest of the band comes from the down, q/k/v and o reductions. One process's batch-1 step is
# one draw; the median is the fairer number.

# %% [markdown]
# ## Two more levers for batch 1: PDL, and tuning timed after a warm-up
#
# From here the kept step also skips the read's empty shares, which leaves batch 1 as it was
# ({doc}`61b_batch_eight`). `levers --only spread` now also records, for every fresh compile, the
# config coordinate descent settled on for each kernel and its benchmarker's time for it
# (`tuningspread.recording_tuning`). Two runs, on two H200s: the kept step against it with PDL
# (`--only spread --arms 13,14 --trials 4 --stem day61_pdlspread`), and PDL with the batch-1
# tuning timed after a warm-up (`--arms 15 --trials 4 --stem day61_dobench`). Inductor's default
# benchmarker takes the fastest of at most 100 calls after six short ones; `runner.steady_tuning`
# swaps in Triton's `do_bench`, which runs the kernel for 25 ms first and takes the median of 40
# ms of calls.
#
# Two predictions. With the head on cuBLAS, PDL should take part of the 0.07 ms a step the GPU
# spends between kernels. And if the band comes from the tuning's timings, a kernel's time in the
# step should follow the config it was given, and a steadier timing should pick one more often.

# %%
draw_stems = ("day61_pdlspread", "day61_dobench")
draws = {kind: [lab.load_table(f"{stem}_{kind}", "h200") for stem in draw_stems]
         for kind in ("tuning_spread", "spread_profile", "configs")}
assert not any(t is None for tables in draws.values() for t in tables), \
    "`python -m nanolab levers --only spread --arms 13,14 --trials 4 --stem day61_pdlspread` and `--arms 15 " \
    "--trials 4 --stem day61_dobench` on an H200"
draw_spread, draw_profile, draw_configs = (pd.concat(t, ignore_index=True) for t in draws.values())
lab.show(draw_spread.groupby("arm", sort=False).ms_per_step.agg(["count", "min", "median", "max"]).round(3))
# The down projection's reduction: the SwiGLU product folds into it, so its name carries "silu".
is_down = draw_profile.kernel.str.startswith("triton_red") & draw_profile.kernel.str.contains("mul_silu")
down = draw_profile[is_down][["arm", "trial", "kernel", "us_per_step"]].merge(draw_configs,
                                                                              on=["arm", "trial", "kernel"])
lab.show(down.drop(columns=["kernel"])[["arm", "trial", "config", "tuning_us", "us_per_step"]].round(1))
best_config = down.groupby("config").us_per_step.max().idxmin()
fig = lab.plot_kernel_draws(draw_spread, down, target_b1, "down projection", best_config)
if ON_GPU or not lab.figure_path("day61_kernel_draws", "h200").exists():
    lab.save_figure(fig, "day61_kernel_draws", lab.table_label(draws["tuning_spread"][0]))
lab.show(fig)
chose = down.config == best_config
print(f"{best_config}: {down[chose].us_per_step.min():.0f} to {down[chose].us_per_step.max():.0f} us a step in "
      f"all {int(chose.sum())} compiles that chose it; the other configs "
      f"{down[~chose].us_per_step.min():.0f} to {down[~chose].us_per_step.max():.0f}")
for arm, rows in down.groupby("arm", sort=False):
    print(f"{arm}: chose it in {int((rows.config == best_config).sum())} compiles of {len(rows)}")
medians = draw_spread.groupby("arm", sort=False).ms_per_step.median()
print("batch-1 median over the compiles: " + ", ".join(f"{a.removeprefix('+ ')} {m:.3f} ms"
                                                       for a, m in medians.items()))

# %% [markdown]
# *Figure 61.3: left, the batch-1 step of each arm, one dot per fresh compile and a bar at the
# median, against the target. Right, the down projection's reduction in the same compiles: green
# squares where tuning chose the config printed above, orange dots where it chose another. The
# squares sit on one line and the dots scatter above it.*
#
# - **PDL pays now.** Over four compiles each, its median step is about 0.08 ms shorter than the
#   kept step's, and its slowest compile beats two of the kept step's four. The LM head's larger
#   draws had hidden it in the first spread run.
# - **The down projection's time is its config's.** One config ran about 185 us a step every time
#   tuning chose it, every other 225 us or more. The default benchmarker settled on it in three
#   compiles of eight (six configs in all); timed after a warm-up, in three of four. The tuning's
#   own timings (`day61_pdlspread_tuning_timings`) show why: by default each of the three configs
#   every compile timed came out anywhere from 30 to 50 us, so the early steps went wherever the
#   noise pointed. After a warm-up the same config timed about 15 us, not 25.
# - **Both are kept.** `runner.compile_decode` compiles with PDL wherever the GPU has it (the
#   engine's own ops launch as programmatic dependents) and tunes batch 1 inside `steady_tuning`.
#   With both, two compiles of four ran under the 1.00 ms target, and their median, 1.0005 ms,
#   sits on it.
# - **The band is narrower, not gone.** The third compile with the steadier timing drew a slower
#   down config, and the fourth a q/k/v reduction about three times slower than the others'.
#
# The last run timed the three arms in one process at every shape, profiling batch 1 (`levers
# --arms 13,14,15 --profile 1@128 --stem day61_final`). Its arms shared inductor's caches, so the
# third reused the second's tuned kernels (its `build_s`, a third of a second, says so) and
# measures the second's draw again; `levers` now compiles every arm afresh with the caches off.

# %%
final = lab.show_lever_run("day61_final", "ms_per_step", "python -m nanolab levers --only levers --arms 13,14,15 "
                           "--profile 1@128 --stem day61_final")
if final is not None:
    final_levers, final_parts, final_order = final
    lab.show(final_levers.drop_duplicates("arm").set_index("arm").build_s.round(1).to_frame())
    fig = lab.lever_run_waterfall(final_levers, final_parts, target_b1)
    if ON_GPU or not lab.figure_path("day61_final_waterfall", "h200").exists():
        lab.save_figure(fig, "day61_final_waterfall", lab.table_label(final_levers))
    lab.show(fig)

# %% [markdown]
# *Figure 61.4: the batch-1 step of the last three arms in one process, by kernel class. PDL takes
# most of the grey block, the GPU's idle time between kernels; the third arm is the second's
# compile timed again.*
#
# This process ran slow: the kept step took 1.18 ms at batch 1, against 1.07 in the kept chain's
# process ({doc}`61c_against_the_peers`) and a median of 1.11 over the four fresh compiles above.
# Within it PDL took about 0.07 ms off, two thirds from the GPU's idle time between kernels. At
# batches 8 to 64 the three arms run one batched graph that these levers do not touch; their
# differences there, up to 12% at batch 64, are this process's noise. The last arm's profile
# (`data/day61_final_lever_profile_h200.csv`) is the engine's batch-1 profile after these levers.
#
# ## Looking back, and the gates
#
# - **Pinned step inputs** changed nothing alone; they let the host stop waiting on the stream.
#   **Inductor**, **asynchronous scheduling** and **one rotation-and-write kernel** then took the
#   small kernels and the host out of the step, which now takes about as long as its graph.
# - **Fused projections with PDL** and **inductor's matmul templates** read the weights slower
#   than cuBLAS and were not kept; the **two-pass argmax** (27 us a step to 3) and the **tuned
#   reductions**, which fold the norms into the projections, stay.
# - **The tuning is a draw**, in a band of about 0.19 ms. With the LM head on cuBLAS, PDL and the
#   warmed-up tuning, the median fresh compile sits on the 1.00 ms target (1.0005). Choosing
#   configs by their time in the step, not alone, is the next lever for batch 1.

# %%
import textwrap

import torch

from nanolab import PRESETS
from nanolab.lab.costs import step_read_bytes

bytes_ok = [step_read_bytes(PRESETS[r.model], r.batch, r.kv_tokens, torch.bfloat16) == r.step_bytes
            for r in roofline.itertuples()]
floors_ok = (roofline.floor_ms - roofline.step_bytes / (roofline.bandwidth_tb_s * 1e9)).abs() < 1e-9
final_agreement = lab.load_table("day61_final_lever_agreement", "h200")
cols = ["rows", "rows equal to the first arm", "logits rel err to the first arm"]
exact = final_agreement.iloc[1:].set_index("arm")[cols]  # PDL and the warmed-up tuning, against the kept step
exact.loc[pinned] = agreement.loc[pinned, cols]  # against Day 60's engine
gates = [lab.Gate("the floor is every weight and the attended K/V once, over the run's copy bandwidth",
                  all(bytes_ok) and bool(floors_ok.all()),
                  {"shapes": len(roofline), "bytes equal": sum(bytes_ok), "floors equal": int(floors_ok.sum())})]
gates += [lab.Gate(f"{arm}: its run's first arm's tokens and logits, exactly", bool(equal == rows and err == 0),
                   {"rows": int(rows), "equal": int(equal), "logits rel err": float(err)})
          for arm, (rows, equal, err) in exact.iterrows()]
for gate in gates:
    print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
    assert gate, gate
