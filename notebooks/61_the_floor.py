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
# # Day 61: the floor
#
# A decode step at batch 1 reads every weight once and does almost no arithmetic with it. The
# bytes it must read, over the bandwidth the card actually delivers, give a time that no engine
# beats without reading fewer bytes. That time is **the floor**. By Day 60 nanolab's step replayed
# one CUDA graph over the streamed read, and it still took several times the floor. This chapter
# asks where the rest of the time goes, and pulls one lever at a time to take it back. For each
# lever it says what should change, changes it, measures it, and then looks back at the prediction:
#
# - **pinned step inputs**: every step copies its small host tables (positions, slots, the block
#   table's new cells) to the GPU. From pageable memory such a copy makes the host wait. Staged in
#   pinned memory it is queued on the stream and the host moves on (`kv_cache.stage`).
# - **inductor over the graphed step**: `torch.compile` fuses the rotary embedding, the K/V writes,
#   the residual adds and the activations into a few Triton kernels. The graph then captures the
#   compiled step (`runner.compile_decode`), with the streamed read kept as one opaque op.
# - **asynchronous scheduling**: the engine launches step t + 1 before it reads back step t's
#   tokens. It gathers t + 1's input ids on the device, so the host's scheduling and planning for
#   the next step run while the GPU works (`Engine(async_scheduling=True)`, vLLM's name for it).
# - **one kernel for the rotation and the K/V write**: inductor leaves q's rotation, k's rotation
#   with its cache write, and v's cache write as three kernels a layer. `kernels.elementwise`
#   does all three in one (`CacheView.write_rotated`).
# - **a Triton GEMV for the projections**: measured alone against cuBLAS, and not kept; nor were
#   fused projections with programmatic dependent launch, or inductor's own matmul templates.
# - **batch 1 with tuned reductions**: the batch-1 graph compiled with inductor's
#   coordinate-descent tuning, which turns each one-row projection into a Triton reduction with
#   the norm before it folded in (`runner.DecodeForward`).
# - **the read's shares folded in one kernel**, measured and not kept, and **PDL in the compiled
#   step**, not kept at first. Measuring them showed how far the tuning of one compile lands from
#   another's.
# - **the LM head back on cuBLAS**: the one projection whose tuned reduction varied most between
#   compiles, now left to cuBLAS.
# - **empty shares return at once**: at a short context most of the read's split grid walks
#   nothing, and those programs now end as soon as they know it.
# - **PDL over the kept step**, measured again with the LM head's draw gone, and kept.
# - **the batch-1 tuning timed after a warm-up**: inductor's tuner times each candidate config
#   with a benchmark that first runs the kernel for 25 ms (`runner.steady_tuning`).
# - **the Triton GEMV again, under PDL**: a batch's layer projections, up to 16 rows, in a kernel
#   that can launch as a programmatic dependent, which cuBLAS's cannot.
# - **the read in one kernel**: a short row's walk in a single share that writes its own output,
#   a long row's shares folded in the read, and no merge kernel. Measured beside it and not kept:
#   weights asked of L2 ahead of the PDL wait, and split-K's halves added in the GEMV's kernel.
# - **the norms, residual adds and SwiGLU inside the GEMVs**, measured and not kept.
# - **between two steps**: the next plan's four per-row vectors go up in one kernel that reads
#   them from pinned host memory (`kernels.step_inputs`), and the tokens come back on a stream of
#   their own.
#
# Then the result stands beside its peers: gpt-fast, and HF transformers with a static cache, both
# compiled and eager. Two more measurements follow: time to first token, and the Day 58 server
# with chunked prefill on and off. The H200 numbers come from committed tables. On a CPU the
# chapter reruns what a CPU can check: asynchronous scheduling and chunked prefill change when
# the work runs, so neither may change a single token.

# %%
import nanolab.lab as lab

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The H200 tables
#
# Two benches made them, on one H200 at Llama-3.2-1B shapes in bf16 with synthesized random weights.
# `python -m nanolab levers` builds one graphed engine per lever and times its decode step.
# `python -m nanolab floorbench` times every engine from outside, as whole `generate` calls, and
# measures time to first token. The graphbench with chunked prefill on and off is Day 58's bench.
# Every row carries the label of the run that measured it.

# %%
import pandas as pd

STEMS = ("levers", "parts", "lever_agreement", "projections", "floor", "roofline", "ttft",
         "prefill_levers", "graphbench", "fp32_agreement")
h200 = {stem: lab.load_table(f"day61_{stem}", "h200") for stem in STEMS}
missing = [f"data/day61_{stem}_h200.csv" for stem, table in h200.items() if table is None]
assert set(missing) <= {"data/day61_projections_h200.csv"}, \
    f"missing: {missing} (python -m nanolab levers and floorbench on an H200)"
labels = pd.DataFrame([{"table": f"day61_{stem}", **lab.table_label(t).as_columns()}
                       for stem, t in h200.items() if t is not None])
lab.show(labels.drop(columns=["device_slug"]))
measured = lab.table_label(h200["levers"])
print("measured on:", measured.caption().replace("; ", ";\n  "))

# %% [markdown]
# ## The floor
#
# A step's floor is the bytes it must read over the bandwidth of a device-to-device copy measured
# in the same run. Those bytes are every weight once, the tied head counted once, plus the K and V
# of the history each row attends to. At batch 1 and a short context the weights are nearly all
# of it.

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

# %% [markdown]
# Each bench measures its own bandwidth, and the copy measures a little differently from one
# process to the next. So each table's `x_floor` is over its own run's floor. The two floors
# differ by the ratio printed here:

# %%
levers = h200["levers"]
bw = {"levers": levers.bandwidth_tb_s.iloc[0], "floorbench": h200["floor"].bandwidth_tb_s.iloc[0]}
print(", ".join(f"{name}: {v:.3f} TB/s" for name, v in bw.items())
      + f"; the levers' floor is {bw['floorbench'] / bw['levers']:.3f}x the floorbench's")

# %% [markdown]
# ## Five arms, one lever added at a time
#
# Each arm keeps every lever before it, so the arms read as a waterfall. "graphs (before)" is Day
# 60's engine: graphs over the streamed read, with step inputs copied from pageable memory. Each
# step is timed as `LLM.generate` runs it, host work included. The table gives ms per step at each
# batch and context, then the same over the floor. All five arms ran in one process.

# %%
order = list(dict.fromkeys(levers.arm))
step_ms = levers.pivot_table(index=["batch", "context"], columns="arm", values="ms_per_step")[order]
lab.show(step_ms.round(3))
lab.show(levers.pivot_table(index=["batch", "context"], columns="arm", values="x_floor")[order]
         .round(2))

# %% [markdown]
# ### Where a batch-1 step's time goes
#
# At batch 1 and context 128 the bench also profiled 32 graphed steps of each arm. It sorted
# every kernel into a class (`levers.kernel_class`) and called the rest of the measured step the
# host's, time when the GPU sat idle. The black tick over each bar is the graph's replay timed
# alone with events: the GPU's part of the step, gaps between kernels included.

# %%
parts = h200["parts"]
b1 = levers[(levers.batch == 1) & (levers.context == 128)].set_index("arm")
floor_b1 = b1.floor_ms.iloc[0]
target_b1 = float(roofline[(roofline.batch == 1) & (roofline.context == 128)].target_ms.iloc[0])
by_part = parts.pivot_table(index="part", columns="arm", values="ms", aggfunc="sum")[order]
by_part = by_part.fillna(0.0)
lab.show(by_part.sort_values(order[-1], ascending=False).round(3))  # 0: no kernel of that class ran
fig = lab.plot_lever_waterfall(parts, floor_b1, target_b1, replay_ms=b1.replay_ms.to_dict())
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
# The prediction was modest. The synchronous engine waits for each step's tokens anyway, so a
# copy that no longer stalls the host only moves the wait elsewhere. The measurement agrees: the
# step and the replay did not get faster. The host's planning (`plan_step`) took longer in this
# arm at every shape, most at the larger batches. `stage` now copies each input into a pinned
# block on the host before queueing it, and that extra work lands in the planning. The lever
# earns its place later: a pageable copy makes the host wait on the stream, which would undo the
# next lever's overlap. Pinned staging also changes no number: the arm decodes exactly the logits
# of the arm before it.

# %%
anatomy = ["schedule_us", "plan_step_us", "replay_us", "sampler_us", "rest_us"]
before, pinned = order[0], order[1]
by_shape = {arm: levers[levers.arm == arm].set_index(["batch", "context"])
            for arm in (before, pinned)}
lab.show(pd.DataFrame({f"{col}, pinned over before": by_shape[pinned][col] / by_shape[before][col]
                       for col in ("ms_per_step", "replay_ms", "plan_step_us")}).round(2))
agreement = h200["lever_agreement"].set_index("arm")
print(f"pinned against before: {agreement.loc[pinned, 'rows equal to the first arm']} of "
      f"{agreement.loc[pinned, 'rows']} rows equal, logits rel err "
      f"{agreement.loc[pinned, 'logits rel err to the first arm']:.1e}")

# %% [markdown]
# ### Inductor: the small kernels fold together
#
# Between the projections, a Llama layer runs a string of small kernels for the rotary
# embedding, the cache writes, the residual adds and the SiLU. At batch 1 each one reads and
# writes a few kilobytes, and each still costs a kernel's start-up inside the graph. The
# prediction was that fusing them would remove most of that time and leave the projections and
# the attention read alone. It did. Copies and indexing, and the other elementwise kernels,
# became a few fused kernels, and the RMS norms took the residual adds into themselves. The
# replay got shorter at every shape. The step got shorter too, but at most shapes by less than
# the replay: in a synchronous engine the host's part still comes on top of every replay, and at
# batch 1 it did not shrink.

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
# After inductor, the grey block was the host's whole step: scheduling, planning, launching the
# replay, reading the tokens back and appending them. During all of it the GPU waited. The
# prediction was that launching step t + 1 before reading back step t would hide that time
# behind the replay, so a step would take about the replay and no more. That is what the table
# shows, at every shape. Most of the grey block that is left lies under the replay's tick: it is
# the gaps between kernels inside the graph, not the host.
#
# The step anatomy (`levers.step_anatomy`) confirms it from the host's side. It wraps the
# engine's own methods and times each one, and it synchronizes the device before every step it
# times. In the synchronous arms, `rest_us` includes waiting for the GPU's tokens. Under
# asynchronous scheduling the step before has already finished when a timed step begins, so the
# anatomy adds up to the host's own work. That work is shorter than the replay it now runs beside.

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
# The profile of the asynchronous arm still held three inductor kernels a layer before the read:
# q's rotation, k's rotation fused with its scatter into the K pool, and v's scatter into the V
# pool. Inductor does not fuse two scatters into different buffers, and at batch 1 each kernel is
# a launch of about a microsecond plus its gap in the graph. `rope_write` does all three in one
# Triton kernel, one program a token over all of its heads, and the compiled step calls it as one
# opaque operator that declares its writes to the pools (`rope_write_op`). The prediction was
# about two launches a layer saved: 32 kernels a step, a few tens of microseconds, at every batch.

# %%
rope = order[4]
saved = pd.DataFrame({"step saved (ms)": step_ms[overlapped] - step_ms[rope],
                      "replay saved (ms)": replay[overlapped] - replay[rope]})
lab.show(saved.round(3))
print(f"batch 1, small kernels (copies, elementwise, norms, inductor's): "
      f"{by_part.loc[small, overlapped].sum() * 1000:.0f} us -> "
      f"{by_part.loc[small, rope].sum() * 1000:.0f} us a step;\n"
      f"  the rope_write kernel itself: {by_part.loc['other elementwise', rope] * 1000:.0f} us a step")
print(f"rope_write against the arm before: "
      f"{agreement.loc[rope, 'logits rel err to the first arm']:.3f} logits rel err to the first arm, "
      f"where the arm before has {agreement.loc[overlapped, 'logits rel err to the first arm']:.3f}")

# %% [markdown]
# The step and the replay shrank at every shape, by a few tens of microseconds, as predicted.
# The new kernel rotates in fp32 and rounds once, where the torch ops round after each product in
# bf16, so its logits differ from the arm before by about as much as any two bf16 paths do (the
# agreement table at the end of the chapter). On the CPU the model keeps the torch ops, and in
# Triton's interpreter the kernel is tested against them, the sink slot of a padded row included.

# %% [markdown]
# ## What is left: the projections
#
# After the three levers, a batch-1 step is nearly all GPU time, and most of that is cuBLAS
# running the projections. Their bytes are almost the whole weight, so they can be set against
# the weights' own floor:

# %%
gpu_ms = b1.replay_ms[order[-1]]
proj_ms = by_part.loc["projections", order[-1]]
print(f"batch 1 after the levers: step {b1.ms_per_step[order[-1]]:.3f} ms, "
      f"replay {gpu_ms:.3f} ms, of which projections {proj_ms:.3f} ms ({proj_ms / gpu_ms:.0%});\n"
      f"  the weights at the copy bandwidth: {weights_ms:.3f} ms; the projections stream them at "
      f"{first.weight_bytes / (proj_ms * 1e-3) / 1e12:.2f} TB/s\n"
      f"  ({weights_ms / proj_ms:.0%} of the copy's rate)")

# %% [markdown]
# ### A Triton GEMV, measured and not kept
#
# With one row, or a few, against a weight matrix, a projection is a matrix-vector product, and a
# GEMV tiled for that shape can in principle stream the weight faster than a general GEMM.
# `nanolab.kernels.gemv` is one, in Triton. `levers.projection_table` timed each projection alone,
# cuBLAS (`F.linear`) against the GEMV, at 1 to 16 rows, with the L2 flushed before every launch.
# The GEMV ran with its default tiles everywhere, and at 1 and 16 rows with every tiling of a sweep
# as well. The times include each launch, so they compare the arms with each other and not with
# the step. cuBLAS's kernels inside the graph run back to back.

# %%
from nanolab import PRESETS

projections = h200["projections"]
if projections is not None:
    print("measured on:", lab.table_label(projections).caption().replace("; ", ";\n  "))
    best = lab.best_of_sweep(projections)
    lab.show(best.round(3))
    # each projection once a layer, the head once a step
    layers = PRESETS[measured.model].num_hidden_layers
    calls = best.projection.map(lambda p: 1 if p == "lm_head" else layers)
    weighted = best[["cublas", "gemv", "best gemv"]].mul(calls, axis=0).assign(rows=best.rows)
    totals = weighted[weighted.rows.isin((1, 16))].groupby("rows").sum() / 1000
    print("every projection of one step, timed alone and summed (ms):")
    lab.show(totals.round(3))
    fig = lab.plot_projections(projections)
    if ON_GPU or not lab.figure_path("day61_projections", "h200").exists():
        lab.save_figure(fig, "day61_projections", lab.table_label(projections))
    lab.show(fig)
else:
    print("data/day61_projections_h200.csv is not committed: "
          "`python -m nanolab levers --only projections` on an H200 makes it")

# %% [markdown]
# *Figure 61.2: Each bar is a projection's time alone over cuBLAS's, so 1 is a tie. The orange
# bars, the GEMV with its default tiles, lose on the small projections; the red bars, the best
# tiling of the sweep, land on cuBLAS's line.*
#
# With the best of its sweep the GEMV ties cuBLAS, winning slightly on some shapes and losing
# slightly on others. With its default tiles it loses on most of them. Alone, a kernel that at
# best matches cuBLAS buys nothing, and at this point it was not kept. It came back later in the
# chapter, once PDL was in the compiled step: a Triton kernel can be launched as a programmatic
# dependent and cuBLAS's cannot, and at batch 8 that paid (the section on batch 8 below).
#
# ### Fused projections with programmatic dependent launch, measured and not kept
#
# A second try at the projections went further than a GEMV: fold everything between two
# projections into them, so a layer is five kernels, and launch each one as a programmatic
# dependent of the one before (Hopper's PDL), so it can start while its predecessor drains.
# `nanolab.lab.projections` holds it: RMSNorm inside the q/k/v projection together with RoPE and
# the K/V write, the residual adds inside the o and down projections, SwiGLU inside gate/up, the
# final norm inside the head (`FusedDecode`). The prediction was a shorter replay: about 0.15 ms
# of small kernels gone, and most of the in-graph gaps hidden by PDL. The bench's `day61_fused`
# run put it beside the asynchronous arm, at 1, 8 and 16 rows.

# %%
fused = lab.show_lever_run("day61_fused", "replay_ms", "python -m nanolab levers --only levers --arms 3,7,8 "
                          "--shapes 1@128,8@128,16@128 --stem day61_fused")
if fused is not None:
    fl, _, f_order = fused
    one = fl[fl.batch == 1].set_index("arm").replay_ms
    print(f"batch 1 replay: {one[f_order[0]]:.3f} ms compiled, {one[f_order[1]]:.3f} ms fused, "
          f"{one[f_order[2]]:.3f} ms fused with PDL")

# %% [markdown]
# The small kernels did go, and PDL did shorten the replay of the fused step. But the fused step
# started slower than the compiled one and PDL did not close the gap. The projections class tells
# why: the fused kernels read the big matrices (gate/up, 67 MB a layer, and the 525 MB head) well
# below cuBLAS's bandwidth, and that costs more than every small kernel saved. The tiles in
# `projections.TILES` are the best of a sweep run on the H200 while the kernels were written (its
# numbers are not committed); in that sweep, prefetching each program's weight rows into L2 before
# its wait made the step slower. So the engine keeps inductor around cuBLAS, and the fused step
# stays in the lab.
#
# One piece of that run did pay, and the engine kept it. torch's argmax reduces a row in one block
# of threads: an earlier profile of the asynchronous arm (this table as committed at 2a6b4ef)
# put 27.1 us of every batch-1 step in the "sampling" class, longer than a layer's projections.
# `kernels.argmax` picks the token in two passes: chunks of 4,096 logits, one program each, then
# the best chunk. Every arm of the waterfall above runs it now:

# %%
print(", ".join(f"{arm}: {by_part.loc['sampling', arm] * 1000:.1f} us" for arm in order)
      + " of sampling a step")

# %% [markdown]
# ### Inductor's own matmul templates at batch 1, measured and not kept
#
# A third try asked inductor to choose. With `max_autotune_gemm`, inductor times each matmul of a
# graph as cuBLAS and as each of its Triton matmul templates, and keeps the fastest; a template can
# also carry the norm or the activation next to it. The batch-1 step gets a graph of its own in
# any case, so `levers.autotuned_batch_1` compiles that one with autotuning and leaves the other
# batches' graph as it was. The prediction was a faster batch 1 and an unchanged batch 8.

# %%
lab.show_lever_run("day61_autotune", "ms_per_step", "python -m nanolab levers --only levers --arms 4,5 "
                   "--shapes 1@128,8@128 --stem day61_autotune")

# %% [markdown]
# Batch 8 did not move, as predicted, but batch 1 got slower, not faster. The profile shows where:
# the templates inductor chose run the projections about a third slower than cuBLAS did, and
# down, at about 1.5 TB/s, is the worst. The likely reason is how inductor chose: it times each
# candidate alone, many times over on the same inputs, so every weight but gate/up's (67 MB) can
# stay in the 60 MB L2 between runs, while inside the step each weight comes from HBM once. This
# run did not test that. The engine keeps cuBLAS, and the arm stays in the lab.

# %% [markdown]
# ### Batch 1 with tuned reductions, kept
#
# gpt-fast compiles with inductor's coordinate-descent tuning on, and inductor's source says why:
# with it on, a matmul of one row is lowered to a multiply and a sum, a Triton reduction that
# inductor fuses with its neighbours and tunes for the shape. Its comment says its matrix-vector
# products reach peak bandwidth only that way. `runner.DecodeForward` now compiles the batch-1
# graph with `coordinate_descent_tuning` (`BATCH_1_OPTIONS`) and leaves the batched graph as it
# was. The prediction was a shorter batch-1 step, for one of two reasons: reductions that stream
# the weights faster than cuBLAS, or fewer kernels, since each norm and activation can then fold
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
# The step got shorter and batch 8 did not move, but the first reason was wrong. The reductions
# read the weights a little slower than cuBLAS: the projections class grew. What shrank was
# everything between the projections. The norms and inductor's separate fused kernels are almost
# gone, folded into the projection after them, and with them went their launches and the gaps
# between kernels inside the graph. That shows as the host-and-gaps part halving. The engine keeps
# the lever: it compiles one graph more at start, at batch 1 only.

# %% [markdown]
# ### The read's shares folded in one kernel, measured and not kept
#
# At batch 1 and at batch 8 the streamed read cuts each row's walk into 16 shares, chosen for the
# table's capacity rather than this step's context, and a second kernel (`_merge_splits`) folds
# the shares into the output. That is two launches a layer. With `paged_attention.FOLD_SHARES`,
# each share takes a ticket when its partial is written, and the program that takes the last
# ticket folds all of them itself. The prediction was the merge kernel's 21 to 28 us a step gone
# at batch 1 and at batch 8, and with it 16 gaps. The run compiled one engine per arm, in one
# process, and profiled batches 1, 8 and 32.

# %%
step = lab.show_lever_run("day61_step", "ms_per_step", "python -m nanolab levers --only levers --arms 6,9,10 "
                          "--profile 1@128,8@128,32@128 --stem day61_step")
if step is not None:
    step_parts = lab.load_table("day61_step_parts", "h200")
    read = step_parts[step_parts.part == "attention read"].pivot_table(index="batch", columns="arm", values="ms")
    lab.show(read[step[2]].add_suffix(": attention read, ms").round(3))

# %% [markdown]
# The read got slower at every batch. The merge kernel went, but the read's own kernel grew by
# more than the merge had cost. A merge kernel runs one program per (row, query head), all at
# once. The fold runs in one program per (row, KV head), and only after the slowest share of that
# row has finished. So the fold's loads wait behind the whole walk instead of overlapping it. The
# switch stays in the kernel, off, for the lab to measure.
#
# The run's third arm added PDL to the compiled step on top of the fold (the lab's PDL arm has since
# dropped the fold, as the next section measures it), and at batch 1 it was the fastest arm of the
# three by far. Its profile says why, and it is not PDL. The LM head's
# reduction took about 115 us a step there, and about 215 in the two arms before. Every arm
# compiles its own batch-1 graph, and inductor tunes that graph's kernels afresh each time.

# %% [markdown]
# ### The tuning's spread, and the LM head back on cuBLAS, kept
#
# Coordinate-descent tuning walks each kernel's launch settings one step at a time and keeps any
# step that times 0.1% faster. Where it stops depends on where it started and on the noise of
# each timing, so two compiles of one graph can keep different settings. `levers --only spread`
# measures that spread. It compiles each arm's batch-1 engine afresh several times, with
# inductor's caches off, and times and profiles each compile. Trials alternate between arms, so
# drift on the card falls on every arm. Two runs, on two H200s of the kind:
#
# - the engine's step against the same with PDL in the compiled step (inductor's
#   `triton.enable_pdl` and the engine's ops as programmatic dependents);
# - the step with the LM head left to cuBLAS (`layers.Linear.opaque`, one `linear_op` that
#   inductor does not lower), the same with the down projection too, and the engine's step again.

# %%
spread_runs = [lab.load_table(stem, "h200") for stem in ("day61_tuning_spread", "day61_opaque_tuning_spread")]
spread_profiles = [lab.load_table(stem, "h200") for stem in ("day61_spread_profile", "day61_opaque_spread_profile")]
if any(t is None for t in spread_runs + spread_profiles):
    print("the tuning-spread tables are not committed:\n  `python -m nanolab levers --only spread --trials 3` "
          "and `--only spread --trials 3 --arms 11,12,6 --stem day61_opaque` on an H200 make them")
else:
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
# *Figure 61.3: left, the batch-1 step of each arm, one dot per fresh compile and a bar at the
# median, against the target. Right, the LM head of the same compiles: inductor's tuned reduction
# as dots, cuBLAS as squares. Follow the dots: the same code lands anywhere in a band wider than
# the gap to the target.*
#
# - **The spread is the tuning's.** One code, compiled six times, ran its batch-1 step anywhere in
#   a band of about 0.19 ms. The last stop's batch-1 row (1.073 ms) was one draw from this band,
#   near its bottom.
# - **PDL does not pay.** Its median sits with the engine's. What looked like PDL's gain in the
#   lever run was the tuning's draw.
# - **The LM head is the worst draw.** Its reduction read the 525 MB head in 125 to 328 us
#   across compiles, and cuBLAS read it in about 120 us in every compile that used it. The engine
#   now leaves the LM head to cuBLAS whenever it tunes the batch-1 graph
#   (`runner.compile_decode`). The final norm goes back to being a kernel of its own, a few
#   microseconds.
# - **The down projection on cuBLAS does not pay.** Its SwiGLU can no longer fold into it, and
#   its median was no better. It stays tuned.
#
# What is left of the band comes from the down, q/k/v and o reductions, whose tuning still varies.
# A batch-1 step from one process is one draw. The floor table's row below is one too, and the
# median above is the fairer number.

# %% [markdown]
# ### Empty shares return at once, kept
#
# At context 128 a row has one tile of 128 keys, so 15 of its 16 shares walk nothing. Each still
# loads its queries and writes a partial of 16 heads by 64 floats, and the merge reads them all.
# At batch 8 that is 1,024 programs a layer, where one per KV head and row would do. With
# `paged_attention.SKIP_EMPTY_SHARES` a share past its row's last tile returns as soon as it has
# read the row's length, and the merge reads only the shares a row has. The prediction was a
# shorter read at batches 8 and 32, where empty shares are most of the grid, and nothing at
# context 2,048, where every share walks.
#
# A first version only masked the empty shares' stores off. Its read kernel took the same time
# (117 us a step at batch 8 either way), which said the cost was the programs themselves, not
# what they wrote; git history keeps that run. This version returns early. It was measured in its
# own process against the step with the LM head on cuBLAS, both arms sharing one compile.

# %%
skip = lab.show_lever_run("day61_skip", "ms_per_step", "python -m nanolab levers --only levers --arms 11,13 "
                          "--shapes 1@128,8@128,32@128,32@2048 --profile 8@128 --stem day61_skip")
if skip is not None:
    skip_profile = lab.load_table("day61_skip_lever_profile", "h200")
    lab.show(skip_profile[skip_profile.kernel.isin(["_paged_decode_group", "_merge_splits"])]
             .pivot_table(index=["batch", "kernel"], columns="arm", values="us_per_step")[skip[2]].round(1))

# %% [markdown]
# At batch 8 the read's kernel lost a third of its time, the merge gained a little (each of its
# programs now loads its row's length before anything else), and the step got shorter by about
# 2%; batch 32 by as much, and context 2,048 did not move. Batch 1 got slightly longer. Its grid is
# 128 programs, under one per SM, so no live share ever waited behind an empty one, and the
# merge's extra load was all that changed. The engine keeps the lever where the grid is more than
# one program per SM, which leaves batch 1 as it was.
#
# Batch 64 was not in that run. A second process ran both arms at batches 32 and 64, to check
# that the lever does not cost the largest batch what it saves the middle ones:

# %%
skip64 = lab.show_lever_run("day61_skip64", "ms_per_step", "python -m nanolab levers --only levers --arms 11,13 "
                            "--shapes 32@128,64@128 --profile 64@128 --stem day61_skip64")

# %% [markdown]
# Batch 32 got shorter by about 2% again, and batch 64 did not move: at 64 rows the grid is
# already mostly live shares. The floor table below was measured with the lever on.

# %% [markdown]
# ## Every kept lever, end to end
#
# Figure 61.1 stops at the fifth arm, and each lever after it was measured against the arm before
# it, in a process of its own. One last run put the whole chain in one process: Day 60's engine,
# then each kept lever added in the order the chapter took them (`levers.DEFAULT_ARMS`, which ends
# at the engine's defaults). The levers measured and not kept are left out of it. It ran before
# the last three kept levers (PDL, the warmed-up tuning and the batch-8 GEMV, in the sections after
# it); `DEFAULT_ARMS` now holds them too.

# %%
kept = lab.show_lever_run("day61_kept", "ms_per_step", "python -m nanolab levers --only levers "
                          "--shapes 1@128,8@128,32@128 --profile 1@128,8@128 --stem day61_kept")
if kept is not None:
    kept_levers, kept_parts, kept_order = kept
    fig = lab.lever_run_waterfall(kept_levers, kept_parts, target_b1)
    if ON_GPU or not lab.figure_path("day61_kept_waterfall", "h200").exists():
        lab.save_figure(fig, "day61_kept_waterfall", lab.table_label(kept_levers))
    lab.show(fig)
    first, last = kept_order[0], kept_order[-1]
    by_batch = kept_levers.pivot_table(index="batch", columns="arm", values="ms_per_step")
    for batch, row in by_batch.iterrows():
        print(f"batch {batch}: {row[first]:.3f} -> {row[last]:.3f} ms a step ({row[first] / row[last]:.2f}x)")
    agreement = lab.load_table("day61_kept_lever_agreement", "h200")
    lab.show(agreement[["arm", "rows", "steps", "rows equal to the first arm", "logits rel err to the first arm"]]
             .round(3))

# %% [markdown]
# *Figure 61.4: A batch-1 step of each kept lever, from Day 60's engine on the left to today's
# defaults on the right, all in one process. The host's hatched block goes with asynchronous
# scheduling, and the small kernels fold with inductor and the rotation kernel. The tuned batch-1
# reductions fold the norms and what was left of the small kernels into the projections, so the
# blue grows as the rest goes, and the LM head back on cuBLAS takes about 0.13 ms off the blue.*
#
# In one process the chain took a batch-1 step from 1.65 to 1.07 ms, batch 8 from 1.65 to 1.18 and
# batch 32 from 1.92 to 1.28. The tuned batch-1 arm landed at 1.15 ms in this process, a draw from
# the upper half of the spread above, and the LM head on cuBLAS took it to 1.08. The agreement
# table compares each arm's first decode logits with Day 60's engine's: the eager arms agree
# exactly, and every compiled arm differs by the same 2 to 3% that bf16 rounding in a different
# order gives (the section on bf16 against fp32 below measures how far each is from fp32), which on
# random weights with nearly flat logits is enough to change greedy picks.

# %% [markdown]
# ## Two more levers for batch 1: PDL, and tuning timed after a warm-up
#
# With the LM head on cuBLAS and the empty shares skipped, what was left of the batch-1 band came
# from the down, q/k/v and o reductions. `levers --only spread` now also records, for every fresh
# compile, the config coordinate descent settled on for each kernel and the fastest time its
# benchmarker gave that config while tuning (`levers.recording_tuning`). Two runs, on two H200s of
# the kind:
#
# - the kept step against it with PDL in the compiled step (`--only spread --arms 13,14 --trials 4
#   --stem day61_pdlspread`);
# - PDL with the batch-1 tuning timed after a warm-up (`--only spread --arms 15 --trials 4 --stem
#   day61_dobench`): inductor's default benchmarker times a config as the fastest of at most 100
#   calls, after one untimed call and five that estimate its length, and `runner.steady_tuning`
#   swaps in Triton's `do_bench`, which runs the kernel for 25 ms first and takes the median of 40
#   ms of calls.
#
# Two predictions. PDL had not paid in the first spread run, but there each compile's LM head
# moved the step by up to 0.2 ms; with the head fixed on cuBLAS, PDL should take part of the
# 0.07 ms a step the GPU spends between kernels. And if the band comes from the tuning's timings
# rather than from the step, one kernel's time in the step should follow the config it was given,
# and a steadier timing should give the same config more often.

# %%
draw_stems = ("day61_pdlspread", "day61_dobench")
draws = {kind: [lab.load_table(f"{stem}_{kind}", "h200") for stem in draw_stems]
         for kind in ("tuning_spread", "spread_profile", "configs")}
if any(t is None for tables in draws.values() for t in tables):
    print("the tables of the two spread runs are not committed: `python -m nanolab levers --only spread --arms "
          "13,14 --trials 4 --stem day61_pdlspread` and `--arms 15 --trials 4 --stem day61_dobench` on an H200")
else:
    draw_spread, draw_profile, draw_configs = (pd.concat(t, ignore_index=True) for t in draws.values())
    lab.show(draw_spread.groupby("arm", sort=False).ms_per_step.agg(["count", "min", "median", "max"]).round(3))
    # The down projection's reduction: the SwiGLU product folds into it, so its name carries "silu".
    is_down = draw_profile.kernel.str.startswith("triton_red") & draw_profile.kernel.str.contains("mul_silu")
    down = (draw_profile[is_down][["arm", "trial", "kernel", "us_per_step"]]
            .merge(draw_configs, on=["arm", "trial", "kernel"]))
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
# *Figure 61.5: left, the batch-1 step of each arm, one dot per fresh compile and a bar at the
# median, against the target. Right, the down projection's reduction in the same compiles: green
# squares where tuning chose the config printed above, orange dots where it chose another. Read
# the right panel first: the squares sit on one line and the dots scatter above it.*
#
# - **PDL pays now.** Over four compiles each, its median step is about 0.08 ms shorter than the
#   kept step's, and its slowest compile is faster than two of the kept step's four. This reverses the first spread
#   run, where the LM head's draws were larger than PDL's gain and hid it.
# - **The down projection's time is its config's.** One config ran about 185 us a step every time
#   tuning chose it, and every other config 225 us or more. The default benchmarker settled on it in
#   three compiles of eight and on six different configs in all; timed after a warm-up, it settled
#   on it in three of four. The tuning's own timings show why (`day61_pdlspread_tuning_timings`,
#   every config each compile timed): with the default benchmarker, each of the three configs that
#   every compile timed came out anywhere between 30 and 50 us from one compile to the next, so its
#   early steps went wherever the noise pointed, and it reached that config in only three compiles
#   of eight. Timed after a warm-up, the same config timed about 15 us rather than 25.
# - **Both are kept.** `runner.compile_decode` now compiles with PDL wherever the GPU has it (the
#   engine's own ops launch as programmatic dependents inside the compiled step), and tunes batch
#   1 inside `steady_tuning`. With both, two compiles of four ran under the 1.00 ms target, and
#   their median, 1.0005 ms, sits on it.
# - **The band is narrower, not gone.** The third compile with the steadier timing drew a slower
#   down config, and the fourth a q/k/v reduction about three times slower than the others'.
#
# The last run timed the three arms in one process at every shape, with the batch-1 profile of
# each (`levers --only levers --arms 13,14,15 --profile 1@128 --stem day61_final`). That run
# still let arms share inductor's caches, and the third arm's graph is the second's, so it reused
# the second's tuned kernels and did not tune at all (its `build_s`, a third of a second, says so):
# in that table, the third arm measures the second's draw again. `levers` now compiles every arm
# afresh with the caches off.

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
# *Figure 61.6: the batch-1 step of the last three arms in one process, by kernel class. PDL takes
# most of the grey block, the GPU's idle time between kernels, and the third arm is the second's
# compile timed again.*
#
# This process ran slow: the kept step took 1.18 ms at batch 1 here, against 1.07 in the kept
# chain's process and a median of 1.11 over the four fresh compiles above. Within it, PDL took
# the batch-1 step down by about 0.07 ms, two thirds of it from the GPU's idle time between kernels.
# At batches 8 to 64 the three arms run one batched graph, whose projections are cuBLAS's and
# whose tuning none of these levers touches. Their differences there, up to 12% at batch 64,
# are this process's noise, the same that moves a whole `generate` at batch 64 between floorbench
# processes. The profile of the last arm is the engine's batch-1 profile as it stood after these
# levers (`data/day61_final_lever_profile_h200.csv`). The levers below changed batch 1's read and
# what runs between its steps; the upload run in "Between two steps" profiles the engine as it
# now stands.

# %% [markdown]
# ## Batch 8: the projections in Triton, under PDL
#
# PDL moved the batch-1 step and left batches 8 to 64 where they were. In the batched graph the
# projections are cuBLAS's, and a cuBLAS kernel is not launched as a programmatic dependent, so
# the chain of early launches breaks four times a layer and each projection starts only once the
# kernel before it has drained. The GEMV that tied cuBLAS alone (above) can be launched that way.
# `kernels.gemv.step_linear` runs it inside the compiled step for 2 to 16 rows with fixed tiles
# per weight shape (`gemv.step_config`, the best of the 16-row sweep), and `F.linear` past that.
#
# The prediction had two parts. Launch by launch, the GEMV should still only tie cuBLAS. The step
# should get shorter by some of the GPU's idle time between kernels, as batch 1's did with PDL.
#
# A first instrument checks the tie where it matters, back to back rather than alone. Each
# projection runs sixteen times in one CUDA graph, each time against a weight of its own, so nothing
# is warm in L2 and each launch follows another as in the step (`levers --only chain`).

# %%
chain = lab.measured_table("day61_chain_chained_projections",
                           "python -m nanolab levers --only chain --stem day61_chain")
if chain is not None:
    picked = chain[chain.arm.str.contains("step_config")].set_index("projection")
    fastest = chain[chain.arm != "cublas"].sort_values("us").groupby("projection").head(1).set_index("projection")
    cublas = chain[chain.arm == "cublas"].set_index("projection")
    per_launch = pd.DataFrame({"rows": cublas.rows, "cuBLAS us": cublas.us, "GEMV, step tiles, us": picked.us,
                               "best tiles of the sweep": fastest.arm.str.removeprefix("gemv "),
                               "best us": fastest.us, "step tiles TB/s": picked.tb_s}).loc[cublas.index]
    lab.show(per_launch.round(2))
    print(f"one layer's four projections: cuBLAS {cublas.us.sum():.1f} us, the GEMV with the step's tiles "
          f"{picked.us.sum():.1f} us ({picked.us.sum() / cublas.us.sum():.3f}x)")

# %% [markdown]
# Back to back, the four projections of a layer take about as long either way, within 4%. The
# GEMV's step tiles are the sweep's fastest, or within 5% of it, on every shape. The small q/k/v
# and o weights still stream at under 2 TB/s, whichever kernel reads them: at 8 to 13 MB, a launch
# is mostly its own start and drain.
#
# The lever run put the engine's step (`+ tuning timed after a warm-up`) beside three arms: the
# GEMV for up to 16 rows, for up to 64, and for up to 64 with each program's first weight tile
# loaded ahead of its PDL wait, so the weight would start streaming under the previous kernel's
# tail (`levers --only levers --arms 15,16,17,18 --shapes 8@128,32@128,64@128 --profile 8@128
# --stem day61_gemv`).

# %%
gemv_run = lab.show_lever_run("day61_gemv", "ms_per_step", "python -m nanolab levers --only levers "
                              "--arms 15,16,17,18 --shapes 8@128,32@128,64@128 --profile 8@128 --stem day61_gemv")
target_b8 = float(roofline[(roofline.batch == 8) & (roofline.context == 128)].target_ms.iloc[0])
if gemv_run is not None:
    gemv_levers, gemv_parts, gemv_order = gemv_run
    fig = lab.lever_run_waterfall(gemv_levers, gemv_parts, target_b8, batch=8)
    if ON_GPU or not lab.figure_path("day61_gemv_waterfall", "h200").exists():
        lab.save_figure(fig, "day61_gemv_waterfall", lab.table_label(gemv_levers))
    lab.show(fig)
    gemv_agreement = lab.load_table("day61_gemv_lever_agreement", "h200")
    if gemv_agreement is not None:
        lab.show(gemv_agreement.set_index("arm")[["rows equal to the first arm",
                                                   "logits rel err to the first arm"]].round(4))

# %% [markdown]
# *Figure 61.7: the batch-8 step of the four arms in one process, by kernel class, against the
# batch-8 target. The projections' block is the same height in the first three arms, and the grey
# block, the GPU idle in the engine's loop, is lower in the second and third. The fourth arm's
# projections are a third longer. The black bars, each graph replayed alone from an idle GPU, do
# not follow the steps here: the same arm's replay took 1.08 ms in another process.*
#
# - **It pays at batch 8, a little.** In this process the step went from 1.171 to 1.134 ms (-3%),
#   with the same time in the projections' kernels. One draw of each would not settle 3%, but the
#   day's runs do not overlap: every arm of the day's lever runs with the batched projections on
#   cuBLAS, from the rotation-and-write kernel on and the folded-shares read aside (sixteen of
#   them), put batch 8 at 1.171 to 1.208 ms, and every run with the GEMV (two arms here, three in
#   the grid run below, and the floor table) at 1.115 to 1.138. The chained table agrees from the
#   other side: about 1.6 us a layer, 26 us over sixteen layers.
# - **At 32 and 64 rows it is noise.** Taking those rows too moved the step by +1% and -1%, inside
#   the run-to-run spread of these lever runs. The engine keeps cuBLAS past 16 rows
#   (`gemv.STEP_ROWS`).
# - **The weight ahead of the wait does not pay.** Carrying a loaded tile from one iteration to
#   the next costs Triton its software pipelining of the loop, and the projections took 1.05 ms
#   a step instead of 0.67. It stays off (`gemv.STEP_PREFETCH`).
# - **The tokens agree as bf16 paths do.** Against the first arm, the first decode step's logits
#   differ by 1.4%. Two correct bf16 paths of this model differ by 2 to 2.5% (the bf16 against fp32
#   section below), and the fp32 tests hold the GEMV to the reference at 1e-3.
#
# So the GEMV is now the engine's for the layers' projections of 2 to 16 rows, wherever the step
# has PDL (`runner.compile_decode` marks them, `layers.Linear.step_kernel`): without PDL it only
# ties cuBLAS. Batch 1 keeps inductor's tuned reductions, and the LM head stays cuBLAS's.
#
# What is left at batch 8 is in the same profile. The projections stream about 2.9 TB/s averaged
# over a layer, against 4.2 for a copy. The paged read and its merge take about 0.11 ms a step to
# read at most 34 MB of K and V, 8 us at the copy's rate. The read's time does not follow its
# grid: aimed at 4 or 2 programs per SM instead of 8, it kept the same 77 us in the read kernel and
# moved its merge from 35 to 32 us; the batch-8 step did not get shorter, and batch 64's got longer
# (1.64 and 1.83 ms against 1.39; `levers --arms 16,19,20 --stem day61_grid`). At sixteen layers,
# a read kernel of 4.8 us that moves 2 MB is mostly its own launch and drain.

# %% [markdown]
# ## Batch 8: the read in one kernel
#
# The GEMV section ends with two places the batch-8 step still waits: small kernels that are
# mostly their own start and drain, and a read whose time does not follow its grid. Two ideas for
# each were measured, one process a run, against the engine's step at the time
# (`+ Triton projections to 16 rows`).
#
# **Weights asked of L2 while the step waits.** Under PDL a kernel can start before its
# predecessor has finished, but it may not read the activations until its wait returns. A weight
# is written by no kernel, so a GEMV could ask L2 for its share of the weight before the wait
# (`prefetch.global.L2`, one request a 128-byte line; `gemv.STEP_L2_AHEAD`). For that to overlap
# anything, the kernels before it must let it start early, so the engine's own kernels (the
# rotation, the read and its merge, the GEMV) can release their dependents as they start instead of
# as they exit (`pdl.EARLY_RELEASE`). The prediction: the q/k/v and o weights, 8 to 13 MB, would
# come from L2 under the read and the norms, and their kernels would stop being latency-bound.
# Three arms: the early release alone, then with 16 MiB of each weight asked of L2, then with the
# whole weight (`levers --only levers --arms 16,21,22,23 --shapes 8@128,64@128 --stem day61_l2`).

# %%
l2_run = lab.show_lever_run("day61_l2", "ms_per_step", "python -m nanolab levers --only levers "
                            "--arms 16,21,22,23 --shapes 8@128,64@128 --profile 8@128 --stem day61_l2")

# %% [markdown]
# Neither paid. The early release left batch 8 where it was (1.123 ms against 1.129). Asking L2
# for the weights made it slower: 1.208 ms with 16 MiB a weight and 1.295 with all of it. The
# requests compete with the running kernel for the same DRAM, and every byte is still read once,
# so nothing moves off the critical path. Batch 64 runs its projections on cuBLAS, so it shows only
# this process's spread (1.46 to 1.97 ms over the four arms). The parts do not add up to the step
# here: with an early release, a kernel is on the GPU while it waits, so its measured time includes
# its predecessor's, and the host's share comes out negative. Both switches stay off.
#
# **One read kernel, not two.** The split read cuts every row's walk into the table capacity's 16
# shares. At a context of 128 to 385 keys a row has one to four tiles of 128, so at most four
# shares are live, each walks one tile, and `_merge_splits` folds them in a second kernel: 35 us a
# step at batch 8, for 16 launches of 2 us that mostly start and drain. Folding every share in the
# read by the last one to finish was measured earlier and lost (the read grew by more than the
# merge). This time shares walk at least four tiles (`paged_attention.SHARE_TILES`), so at this
# context each row has a single live share, which writes its output itself, with no partials and
# no ticket. Longer rows still fold their live shares, and only those, in the read
# (`FOLD_SHARES`). The prediction: the merge's 35 us gone, and a read kernel no slower, since a
# walk of four pipelined tiles should cost about the latency of one.
#
# One more arm in the same run takes the same idea to the projections: the down projection
# splits K in two, and `_sum_splits` adds the halves in a kernel of its own, 19 us a step. With
# `gemv.STEP_FIX_UP` the last half to finish adds them (`levers --arms 16,25,26,27 --shapes
# 1@128,8@128 --profile 8@128 --stem day61_fold`).

# %%
fold_run = lab.show_lever_run("day61_fold", "ms_per_step", "python -m nanolab levers --only levers "
                              "--arms 16,25,26,27 --shapes 1@128,8@128 --profile 8@128 --stem day61_fold")
if fold_run is not None:
    fold_levers, fold_parts, fold_order = fold_run
    fig = lab.lever_run_waterfall(fold_levers, fold_parts, target_b8, batch=8)
    if ON_GPU or not lab.figure_path("day61_fold_waterfall", "h200").exists():
        lab.save_figure(fig, "day61_fold_waterfall", lab.table_label(fold_levers))
    lab.show(fig)
    fold_profile = lab.load_table("day61_fold_lever_profile", "h200")
    small = fold_profile[fold_profile.kernel.isin(["_paged_decode_group", "_merge_splits", "_gemv", "_sum_splits"])]
    lab.show(small.pivot_table(index="kernel", columns="arm", values="us_per_step")[fold_order]
             .add_suffix(": us a step").round(1))

# %% [markdown]
# *Figure 61.8: the batch-8 step of the four arms in one process, by kernel class, against the
# batch-8 target. Here the second and third arms each branch off the first, and the fourth takes
# both. The read's block (green) loses its merge in the second and fourth arms; the projections'
# block does not move in any of them.*
#
# - **The read in one kernel pays.** Batch 8 went from 1.149 to 1.096 ms (-4.6%). The profile
#   says why: `_merge_splits` is gone (35.4 us a step), and the read's own kernel took 78.1 us
#   against 77.7 for a walk of one tile. A walk of four tiles costs what one does, as predicted.
# - **The fix-up does not.** `_sum_splits`' 18.8 us went, and the GEMV grew by 21 us: each
#   column block's last half now waits for its ticket, re-reads both halves from L2 and writes
#   the sum. Batch 8 measured 1.143 ms, the same as the engine's. It stays off.
# - **Batch 1 in this run follows its compile's draw, not the levers.** The fix-up arm cannot touch
#   batch 1 (its projections are inductor's reductions, not the GEMV), and it still measured 1.198
#   ms against the first arm's 1.018. Every arm tunes its batch-1 graph afresh. The floor table
#   below has batch 1 at 0.980 ms, inside the band of fresh compiles measured before it (0.954
#   to 1.061).
# - **The tokens do not change.** Each arm's greedy rows and first-step logits equal the first
#   arm's exactly (the agreement table of the run, `data/day61_fold_lever_agreement_h200.csv`).
#
# So the read now runs in one kernel at every batch (`FOLD_SHARES` on, `SHARE_TILES` = 4). A row
# of up to 512 keys is one share that writes its own output. A longer row's live shares are
# folded in the read by the last to finish. The tests in `test_paged_attention` poison the
# partials with NaN: a fold that read a share no program wrote, or a short row that wrote a
# partial, fails them. On the H200 they repeat each read 50 times, where the ticket race is real.

# %% [markdown]
# ## Batch 8: the norms inside the GEMVs, measured and not kept
#
# With the merge gone, the smallest kernels left in the batch-8 step are the ones between the
# projections: two norm-and-add kernels a layer (74 us a step at batch 8) and SwiGLU's (21 us).
# Each moves about 32 KB and is mostly its own launch. `lab.folds.step_projection` folds each into
# the projection next to it, through the engine's GEMV (`gemv`'s `norm`, `residual` and `swiglu`):
# - the q/k/v and gate/up GEMVs read the residual stream itself, not its normed copy. Each x tile
#   is multiplied by the norm's weight on its way to the dot, its squares are summed from the same
#   tile, and each row of the product is scaled by 1 / rms at the end;
# - the o and down GEMVs add the residual to their fp32 sums before the one rounding (down's in
#   `_sum_splits`, since it splits K in two);
# - down reads gate and up from the fused gate/up output and applies SwiGLU as it loads them.
#
# A layer is then four GEMVs around the attention (`lab.folds.FoldedStep`, a forward the lab hands
# the engine), and the residual stream never passes through a kernel of its own. At 32 and 64
# rows the fold also moves the projections from cuBLAS to the GEMV, which alone measured
# within 1% of cuBLAS there. The prediction: about 0.09 ms off the batch-8 step, provided each
# fold costs the GEMV almost nothing. Each fold touches only the activation tile, a few KB beside
# the weight's megabytes. One run put the engine's step beside the fold, in one process
# (`levers --arms 25,28`).

# %%
fused_step = lab.show_lever_run("day61_fused_step", "ms_per_step", "python -m nanolab levers --only levers "
                                "--arms 25,28 --shapes 8@128,32@128,64@128 --profile 8@128 --stem day61_fused_step")
if fused_step is not None:
    fs_levers, fs_parts, fs_order = fused_step
    fs_agree = lab.load_table("day61_fused_step_lever_agreement", "h200")
    lab.show(fs_agree[["arm", "rows", "steps", "rows equal to the first arm", "logits rel err to the first arm"]])

# %% [markdown]
# The fold lost, by far more than it could ever have won. Batch 8 went from 1.083 to 2.798 ms,
# 32 rows from 1.236 to 2.558 and 64 rows from 1.449 to 3.518. The parts show both halves of what
# happened:
# - the norms class did go, from 0.074 ms a step to 0.002;
# - the GEMV kernels went from 0.67 to 2.46 ms a step, and took the projections class with them.
#
# The tokens are not the problem. The folded step rounds in other places than inductor's kernels
# do: it scales the product by 1 / rms rather than the input, and rounds o's and down's sums once
# with the residual in them. So its logits sit 2.5% from the first arm's, and 2 of the 8 greedy
# rows stay equal. That is the distance between any two bf16 paths here: bf16 against fp32 is
# 2.5% eagerly and 2.2% compiled (the "bf16 against fp32" section below). In fp32 the folded
# step equals the one-shot reference to 1e-3 on the H200
# (`test_folded_step_matches_the_reference_on_cuda`), and in the interpreter the engine's
# compiled step to 1e-4.
#
# The 1.8 ms went into the GEMVs themselves, so the next bench takes them fold by fold.
# `levers --only folds` times each projection as the step runs it: sixteen launches back to back
# in one CUDA graph, each against a weight of its own, as programmatic dependents. Each one runs
# plain, then with each of its folds.

# %%
folds = lab.measured_table("day61_folds", "python -m nanolab levers --only folds")
if folds is not None:
    lab.show(folds[folds.fold != "none"].pivot_table(index=["projection", "fold"], columns="rows", values="us_added")
             .round(1)
             .add_prefix("us added at rows = "))
    from nanolab.lab.levers import kernel_class

    fs_order = list(dict.fromkeys(lab.load_table("day61_fused_step_levers", "h200").arm))
    fs_profile = lab.load_table("day61_fused_step_lever_profile", "h200")
    kept = fs_profile[(fs_profile.arm == fs_order[0]) & (fs_profile.kernel.map(kernel_class) == "norms")]
    norm_us = kept.gpu_us.sum() / kept.calls.sum()  # a norm kernel's mean time
    per_step = kept.calls.sum() * kept.us_per_step.sum() / kept.gpu_us.sum()
    silu = fs_profile[(fs_profile.arm == fs_order[0]) & fs_profile.kernel.str.contains("silu")]
    silu_us = silu.gpu_us.sum() / silu.calls.sum()
    print(f"the engine's batch-8 step: {per_step:.0f} norm kernels a step, {kept.us_per_step.sum():.1f} us in all, "
          f"{norm_us:.1f} us each; SwiGLU's kernel {silu_us:.1f} us")
    # what each fold takes out of the step: a norm's kernel, SwiGLU's, and for a residual add none
    # (the norm after it keeps its kernel)
    removed = {"norm": norm_us, "residual": 0.0, "swiglu": silu_us, "swiglu + residual": silu_us}
    fig = lab.plot_folds(folds, removed)
    if ON_GPU or not lab.figure_path("day61_folds", "h200").exists():
        lab.save_figure(fig, "day61_folds", lab.table_label(folds))
    lab.show(fig)

# %% [markdown]
# *Figure 61.9: each layer projection's GEMV, us per launch, alone (grey) and with a fold inside
# it (red), at 8 and 64 rows. The figure over each red bar is what the fold added. The dashed line
# over each grey bar adds the kernel the fold takes out of the step: a 2.3 us norm-and-add for a
# norm, SwiGLU's 1.3 us kernel, and nothing for a residual add, whose norm keeps its kernel. A fold
# pays where its red bar stays under that line.*
#
# None fits under its line. The residual add comes closest, at 0.3 to 0.4 us. The norm adds 9 to
# 23 us to its GEMV, and SwiGLU 84 to 103 us, 6.5 to 7.4 times down's own time. The norm and
# SwiGLU do their work on the activation tile between its load and the dot. The residual add
# works after the loop and costs almost nothing, but it takes no launch out of the step: the norm
# after it still needs its own kernel. This run does not show what inside the loop costs so much
# (the registers SwiGLU's two tiles need, or a pipeline the loop no longer keeps); a kernel
# profile would. The engine keeps its step as it was, and the folded step stays in the lab
# (`lab.folds`).

# %% [markdown]
# ## Between two steps: the plan's upload and the read-back
#
# Every lever so far worked inside the graph. The floor bench times whole `generate` calls, and a
# step there is the graph's replay and whatever the GPU runs before the next one. With
# asynchronous scheduling the host runs ahead, so what the GPU runs between two replays is what
# the engine queued there, eight operations a step:
# - the two kernels of the greedy pick (`kernels.argmax`);
# - the read-back of the tokens, a device-to-host copy;
# - the next plan's four per-row vectors (table row, write slot, context length, position), one
#   host-to-device copy each, since each lives in a buffer of its own (a view of one shared buffer
#   let dynamo tie a size to another, and recompile);
# - the copy of the tokens into the graph's input.
#
# Each copy moves a few hundred bytes; what it costs is the copy engine starting and handing back
# around it, in stream order with everything else. The prediction: with four copies folded
# into one kernel and the read-back out of the way, 10 to 15 us less a step at every batch, about
# the 12 us the batch-8 step lacked against its target. The engine now does two things
# differently:
# - **The plan goes up in one kernel.** `KVCache.plan_decode` writes the four vectors into a
#   pinned host buffer, and `kernels.step_inputs.upload_step_inputs` loads them from there (the
#   GPU addresses pinned host memory directly) and stores them into the four device buffers. No
#   copy engine is involved. Three pinned slots take turns, each with an event after the kernel
#   that read it, so a plan never overwrites one the GPU has yet to read.
# - **The read-back runs on a stream of its own.** The device-to-host copy waits for the pick
#   and no step waits for it. The host waits for its event, as before.
#
# The kernel loads all four vectors before its first store. The compiler cannot move a load above
# a store that might alias it, so in the order load, store, load, store each trip over PCIe would
# wait for the one before. A CUDA test builds plans faster than a held-back GPU runs their
# kernels, and checks each plan's vectors as its kernel left them.
#
# `levers --only between` (`lab.steploop.between_steps_ab`) builds the engine once and times it
# both ways: `levers.between_steps_before` puts the four copies and the read-back on the step's
# stream back for as long as it holds. Both ways replay the same graphs with the same tuned
# kernels, so the tuning's draw (above) falls on neither. Eight rounds time every batch both
# ways, the way that goes first alternating, and the cell below pairs them round by round. The
# run then profiles both ways at batches 1 and 8, and `lab.steploop` cuts the GPU's timeline at
# each replay: what runs between two replays, and for how long. The floor table below is the
# end-to-end measure.

# %%
between = lab.measured_table("day61_between_ab", "python -m nanolab levers --only between")
if between is not None:
    ways = list(dict.fromkeys(between.variant))
    print(f"{between.trial.nunique()} rounds; prompts of {between.prompt_len.iloc[0]} tokens, "
          f"{between.steps.iloc[0]} steps timed")
    rounds = between.pivot_table(index=["batch", "trial"], columns="variant", values="ms_per_step")[ways]
    paired = ((rounds[ways[1]] - rounds[ways[0]]) * 1000).groupby("batch")
    table = rounds.groupby("batch").median()
    table["difference, median (us)"] = paired.median()
    table["range (us)"] = paired.apply(lambda d: f"{d.min():.1f} to {d.max():.1f}")
    table["rounds faster"] = paired.apply(lambda d: f"{(d < 0).sum()} of {len(d)}")
    lab.show(table.round(4))
    between_loop = lab.load_table("day61_between_loop", "h200")  # the same run's profiles
    between_ops = lab.load_table("day61_between_loop_ops", "h200")
    assert between_loop is not None and between_ops is not None, "day61_between_ab's run also writes its profiles"
    lab.show(between_loop.set_index(["variant", "batch"])[["outside_ops", "outside_busy_us", "between_us",
                                                            "period_us", "graph_span_us"]].round(1))
    fig = lab.plot_between_steps(between_ops, between_loop, batch=8)
    if ON_GPU or not lab.figure_path("day61_between_steps", "h200").exists():
        lab.save_figure(fig, "day61_between_steps", lab.table_label(between_loop))
    lab.show(fig)

# %% [markdown]
# *Figure 61.10: what the GPU ran between two batch-8 replays in the middle of a profiled
# `generate`, the old way (top) and the engine's (bottom), each operation on its stream's lane:
# kernels blue, the read-back green, the plan's copies orange, the copy of the ids grey. The
# dashed line is where the next replay started, the median over the call's steps. Look at the
# orange run of copies in the top panel: the one `_upload` kernel below replaces all four.*
#
# The change took a median of 12.7 us off a step at batch 1, 13.4 at 8, 14.8 at 32 and 13.6 at 64:
# the 10 to 15 us predicted. Every round was faster at batches 1 to 32, and seven of eight at 64.
# At batches 1 and 8 the rounds agree to within 1.5 us. At 32 and 64 they spread from 7 to 20 us
# faster, and one round at 64 was 2.3 us slower. The profiles show where the time went. Between
# two replays the GPU ran eight operations and now runs five, 1.3 us less work in all; the wait
# from one replay's end to the next one's start fell from 29.1 to 14.2 us at batch 1 and from 37.5
# to 14.4 at batch 8. Under the old way, at batch 8, the read-back and the first copy each started
# 7 to 8 us after the operation before them (at batch 1, 3.6 and 3.8 us), and each later copy
# about 2 us after the one before at either batch. The upload kernel starts about 1 us after the pick, and the
# read-back now runs on its own stream beside the next replay's first kernels. The replay itself
# did not change: its graph spans 1079 us at batch 8 both ways. In this run's own timing the
# engine's batch-8 step is 1.084 ms, under its 1.10 target.
#
# The first run of this comparison, `levers --arms 25,29`, built the engine twice, once per arm,
# and could not settle it. Its second arm is the engine's defaults, and its batch-1 profile
# (`data/day61_upload_lever_profile_h200.csv`) is the engine's batch-1 profile as it now
# stands.

# %%
upload_run = lab.show_lever_run("day61_upload", "ms_per_step", "python -m nanolab levers --only levers "
                                "--arms 25,29 --shapes 1@128,8@128,32@128,64@128 --profile 1@128,8@128 "
                                "--stem day61_upload")
if upload_run is not None:
    upload_levers = upload_run[0]
    lab.show(upload_levers.pivot_table(index="batch", columns="arm", values="replay_ms")[upload_run[2]].round(3))

# %% [markdown]
# Its rows moved both ways, by up to 0.40 ms, and the replay alone (the last table), which the
# change does not touch, was 0.14 ms slower at batch 1 in the second build. Two compiles draw
# two sets of tuned kernels, and this draw's projections took 1.02 ms of the batch-1 step
# against 0.94 ms in the first. At batch 8 the second arm's host was slow as well: its planning,
# the replay's launch and the rest of its step took 20 to 32% longer than the first arm's, its
# sampling 10%, and its step
# (1.41 ms) ran 0.24 ms past its own replay. The one-engine run above shows nothing like it at
# batch 8 (1.084 ms). Timing one engine both ways takes both effects out.

# %% [markdown]
# ## Against the peers
#
# The floorbench times every arm from outside, as a user would call it: a whole `generate` of 257
# new tokens minus one of 1, over 256. Prompts are random token ids and decoding is greedy. The
# arms are:
#
# - **nanolab**: `LLM.generate` with graphs over the streamed read and every lever above.
# - **gpt-fast**: its own `generate()` with `decode_one_token` compiled as its `--compile` does
#   (`mode="reduce-overhead"`), on the same weights, at batches 1 and 8.
# - **HF static, default**: transformers' `generate` with a static cache. On CUDA it compiles the
#   decode forward itself, so this is the headline peer. Batches 1 and 8.
# - **HF static, eager**: the same with `disable_compile=True`, labelled as such.
#
# Each row carries a `run` stamp: which process measured it.

# %%
floor = h200["floor"]
runs = floor.groupby("run").agg(arms=("arm", lambda a: ", ".join(dict.fromkeys(a))),
                                batches=("batch", lambda b: ", ".join(map(str, sorted(set(b))))))
lab.show(runs)
stamps = pd.to_datetime(pd.Series(runs.index))
print(f"{len(runs)} processes on an {measured.device}, started "
      + ", ".join(f"{(t - stamps.min()).total_seconds() / 60:.0f}" for t in sorted(stamps))
      + " minutes after the first")
notes = floor.dropna(subset=["note"]).drop_duplicates("arm")
for row in notes.itertuples():
    print(f"{row.label}:\n  {row.note}")

# %% [markdown]
# The rows came from five processes. nanolab and gpt-fast at batches 1 and 8 ran in one, on
# 2026-12-02, with the engine's defaults as they now stand: PDL and the tuning timed after a
# warm-up at batch 1, the Triton GEMV for a batch's projections, the read in one kernel, the plan
# uploaded in one kernel and the tokens read back on a stream of their own. nanolab's rows at
# batches 32 and 64 and at 2,048 tokens are from the process right after it on the same machine,
# which measured a copy bandwidth 2% above the first's (4.19 TB/s against 4.11), so its floors
# are shorter too. gpt-fast's step moves between processes as well: at batch 8 it took 1.665 ms
# in this one and 1.921 ms in the table before (2026-12-01, below). HF's default path at batch 8 is
# from a process of 2026-11-30, and at batch 1, with every TTFT row but HF eager's, from one half
# an hour later on a second H200 of the same kind. HF's eager arm ran hours before those, on
# another H200 of the kind; at ten times nanolab's step, a few percent between two cards does not
# move its place. The batch-1 row is one draw of the band above, whose median over four compiles,
# 1.0005 ms, is the fairer number. A whole `generate` at batch 64 also moves between processes:
# floorbench processes of 2026-12-01 measured 1.431, 1.517, 1.489 and 1.450 ms there, and the
# lever runs, which time the step inside one process, 1.37 to 1.97. The floorbench saves its
# tables after every row, and `--append` keeps the rows of arms a later process did not run. Each
# process measured its own bandwidth, so each row's `x_floor` is over its own floor, and the floor
# column beside the times is the latest process's.
#
# The table before this one (`data/day61_floor_before_upload_h200.csv`, 2026-12-01) measured the
# same arms with the plan's four copies and the read-back on the step's stream. The cell below
# sets the two side by side, with each process's copy bandwidth, and what that bandwidth alone
# would move a step that streams at it.

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
# bandwidth was 2% below the earlier one's, more than the 10 to 15 us predicted. Batch 1 moved
# by its compile's draw. The rows at 32 and 64 rows and at 2,048 tokens ran in a process about
# 4% faster at copying than the one before; that alone would have taken 47 to 69 us off them, and
# they moved by 36 to 89, so they say little about the change. gpt-fast, untouched, moved by
# -149 us at batch 1 and -256 at batch 8 between the same two processes: a whole `generate` moves
# this much from one process to the next. The one-engine run above settles the change: 12.7 to
# 14.8 us a step, every round faster at batches 1 to 32 and seven of eight at 64.

# %%
side = floor.pivot_table(index=["batch", "context"], columns="label", values="ms_per_step")
side = side[list(dict.fromkeys(floor.label))]
side["floor"] = roofline.set_index(["batch", "context"]).floor_ms
side["target"] = roofline.set_index(["batch", "context"]).target_ms
lab.show(side.round(3))
lab.show(floor.pivot_table(index=["batch", "context"], columns="label", values="x_floor")
         [side.columns[:-2]].round(2))

# %%
fig = lab.plot_floor_roofline(floor, roofline)
if ON_GPU or not lab.figure_path("day61_roofline", "h200").exists():
    lab.save_figure(fig, "day61_roofline", lab.table_label(floor))
lab.show(fig)

# %% [markdown]
# *Figure 61.11: ms per decode step, and the same over the floor, against batch for every arm of
# the floor bench. Follow the blue line against the black dashed floor and the red targets: it
# sits under every peer at every batch, at a nearly constant distance above the floor.*
#
# The issue set its targets in milliseconds, one per shape. They are printed here as measured over
# target, so 1 or less meets the target. Nothing asserts a time.

# %%
ours = floor[floor.arm == "nanolab"].set_index(["batch", "context"])
lab.show(pd.DataFrame({"ms": ours.ms_per_step, "target ms": ours.target_ms,
                       "ms / target": ours.ms_per_step / ours.target_ms,
                       "target": (ours.ms_per_step <= ours.target_ms)
                       .map({True: "met", False: "missed"}),
                       "x floor": ours.x_floor}).round(3))
stretch = roofline.dropna(subset=["stretch_ms"])
for row in stretch.itertuples():
    print(f"stretch at batch {row.batch}, context {row.context}: {row.stretch_ms:.2f} ms "
          f"({ours.loc[(row.batch, row.context)].ms_per_step / row.stretch_ms:.2f}x)")
peers = floor[floor.arm != "nanolab"].set_index(["batch", "context"])
lab.show(peers.pivot_table(index=["batch", "context"], columns="label", values="nanolab_speedup")
         .add_suffix(" / nanolab's step").round(2))

# %% [markdown]
# ## Time to first token
#
# TTFT is a `generate` of one new token, warmed up, median of five. There are two cases: one
# prompt of 2,048 tokens, and eight of 1,024. transformers' default path compiles the decode
# forward, not the prefill, so at batch 1 its two TTFT rows time much the same eager prefill. The
# target (`floorbench.TTFT_TARGET`, printed below) was a batch-1 TTFT that many times shorter than
# HF's default path's.

# %%
from nanolab.lab.floorbench import TTFT_TARGET

ttft = h200["ttft"]
lab.show(ttft.pivot_table(index=["batch", "prompt_len"], columns="label", values="ttft_ms")
         .round(2))
cases = ttft.groupby(["batch", "prompt_len"]).arm.apply(set)
for (b, n), arms in cases.items():
    absent = [a for a in dict.fromkeys(ttft.arm) if a not in arms]
    if absent:
        print(f"{b} x {n} tokens: no row for {', '.join(absent)}")
t = ttft.set_index(["arm", "batch"]).ttft_ms
ratio = t[("hf-default", 1)] / t[("nanolab", 1)]
eager_ratio = t[("hf-eager", 1)] / t[("nanolab", 1)]
print(f"batch 1: HF default / nanolab = {ratio:.2f}x (target {TTFT_TARGET:g}x: "
      f"{'met' if ratio >= TTFT_TARGET else 'missed'}); HF eager / nanolab = {eager_ratio:.2f}x")
print(f"batch 8: HF eager / nanolab = {t[('hf-eager', 8)] / t[('nanolab', 8)]:.2f}x")

# %% [markdown]
# A 2,048-token prefill is one large batch of matmuls, and both engines hand those to cuBLAS. What
# nanolab could lose was the work around them, which runs eagerly:
#
# - The rotary embedding was five strided kernels over the fused q/k/v output, and SwiGLU two more
#   over halves of gate/up. `kernels.elementwise` does each in one Triton kernel when the model
#   runs eagerly on a GPU; together they took about 2 ms off this TTFT (measured before this
#   table, in a direct A/B that is not committed).
# - The rotation and the two cache scatters then became the one `rope_write` kernel, as in decode.
# - The streamed varlen read took about a third of the prefill's GPU time in a profile. It walks
#   the paged pool for every query tile, which a chunk on top of earlier tokens needs. A step of
#   whole prompts does not: each prompt attends over its own keys alone, and those are in hand.
#   So for such a step `CacheView.read` hands each prompt's own q, k and v to torch's
#   `scaled_dot_product_attention` (`prompt_attention`), which picks cuDNN's flash kernel on the
#   H200. A chunk, or a step that mixes decode rows in, keeps the streamed read.
#
# The bench below (`python -m nanolab levers --only prefill`) adds them in turn on one engine.
# It times a step loop, so its times run a little above the floorbench's TTFT.

# %%
pl = h200["prefill_levers"]
print("measured on:", lab.table_label(pl).caption().replace("; ", ";\n  "))
pl_order = list(dict.fromkeys(pl.arm))
lab.show(pl.pivot_table(index=["batch", "prompt_len"], columns="arm", values="ttft_ms")[pl_order]
         .round(2))
lab.show(pl.pivot_table(index=["batch", "prompt_len"], columns="arm",
                        values="logits rel err to the first arm")[pl_order].round(3))

# %% [markdown]
# The one kernel saved nothing measurable here: at 2,048 tokens the rotation and the scatters were
# a few hundred microseconds of a 14 ms prefill, and both cases moved by less than the run's
# noise. The fused attention took about 3 ms off one 2,048-token prompt and about 4 ms off eight
# 1,024-token ones, and brought the batch-1 TTFT under the target. Its logits differ from the
# streamed read's by 2.5%, the size of any two bf16 paths' difference on these near-flat random
# logits (the fp32 table below has bf16 itself at 2.5% from fp32); in fp32, `prompt_attention`
# matches naive attention to 1e-5 in the tests, on grouped and ungrouped heads.
#
# ## Under load: chunked prefill
#
# Day 58 left one aim unmet: under load, ITL p99 over p50 should be at most 3. A newly arrived
# prompt's prefill stopped every running decode for its whole length. With chunked prefill (vLLM
# v1's rule, decode rows first) a step carries the decode rows and then fills its token budget
# with prompt chunks. A decode row then waits behind one mixed step at most, never behind a
# run of whole prefills. The graphbench ran the real server at 16 and 32 requests/s with chunked
# prefill on (`graphs-chunked`) and off (`graphs-whole`), on Day 58's workload.

# %%
import textwrap

gb = h200["graphbench"]
print("measured on:", lab.table_label(gb).caption().replace("; ", ";\n  "))
gate = lab.check_requests(gb)
print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
assert gate, gate
cols = ["arm", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "tpot_p50_ms",
        "decode_steps", "prefill_steps", "prefill_p50_ms", "mixed_steps", "mixed_p50_ms",
        "server_step_p50_ms"]
lab.show(gb[cols].round(2))

# %%
fig = lab.plot_chunked_itl(gb)
if ON_GPU or not lab.figure_path("day61_chunked_itl", "h200").exists():
    lab.save_figure(fig, "day61_chunked_itl", lab.table_label(gb))
lab.show(fig)

# %% [markdown]
# *Figure 61.12: ITL at p50 (left) and p99 (right) on the server, with chunked prefill on and off,
# at each offered rate. Compare the p99 bars at each rate: chunking cuts the tail, and cuts it
# more at the higher rate, yet both arms stay far above the black ticks that mark the aim.*

# %%
by = gb.set_index(["arm", "rate"])
chunking = []
for rate in sorted(gb.rate.unique()):
    whole, chunked = by.loc[("graphs-whole", rate)], by.loc[("graphs-chunked", rate)]
    chunking.append({"rate (req/s)": rate,
                     "ITL p99 whole (ms)": whole.itl_p99_ms,
                     "ITL p99 chunked (ms)": chunked.itl_p99_ms,
                     "ITL p50 whole (ms)": whole.itl_p50_ms,
                     "ITL p50 chunked (ms)": chunked.itl_p50_ms,
                     "p99 / p50 chunked (aim <= 3)": chunked.itl_p99_ms / chunked.itl_p50_ms,
                     "mixed steps": int(chunked.mixed_steps),
                     "mixed step p50 (ms)": chunked.mixed_p50_ms,
                     "mixed step / decode step": chunked.mixed_p50_ms / chunked.server_step_p50_ms})
lab.show(pd.DataFrame(chunking).round(2))

# %% [markdown]
# Chunking cut the tail and left the median alone, as predicted. The aim is still missed, and
# the table shows why: a mixed step carries decode rows beside prompt chunks, it runs eagerly
# with no CUDA graph, and it costs several decode steps' time. p99 now lands on those steps. To
# close the gap, the mixed step needs a faster path of its own: a graph, or inductor, over the
# varlen step.
#
# Two such levers are now measured, each a server beside the engine's own:
# - **The mixed steps compiled.** `LLM(compile_varlen=True)` (`serve --compile-varlen`) compiles
#   them into one graph whose token count is symbolic. The varlen read is one opaque op whose grid
#   is cut for the step's tokens rather than its longest segment, so no host value of the plan
#   enters the graph. On the CPU, and now on the H200 in fp32, mixed steps of several token counts
#   and mixes give the reference's logits through it, and no mix compiles a graph of its own. The
#   graphbench arm `graphs-compiled` ran beside `graphs-chunked`, in one process (`day61_varlen`).
# - **A smaller token budget.** A step of fewer tokens should take less time, so the budget (vLLM's
#   `max_num_batched_tokens`, 2,048 here) was cut to 512 (`graphbench --max-num-batched-tokens
#   512`, `day61_budget512`, the next process on the same H200).

# %%
varlen_runs = {name: lab.load_table(f"{name}_graphbench", "h200") for name in ("day61_varlen", "day61_budget512")}
if any(t is None for t in varlen_runs.values()):
    print("data/day61_varlen_* or day61_budget512_* is not committed:\n  `scripts/gpu_run.sh varlen` and "
          "`python -m nanolab graphbench --arms graphs-chunked --max-num-batched-tokens 512 --prefix day61_budget512 "
          "--rates 16,32 --max-rate 32 --no-offline` on an H200 make them")
else:
    from nanolab.lab.graphbench import SERVER_TOKEN_BUDGET

    # The varlen run predates the table's budget column: its servers ran the default budget.
    varlen_runs = {name: t if "token_budget" in t else t.assign(token_budget=SERVER_TOKEN_BUDGET)
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
# steps), its time against the tokens it fed, beside the servers' median step (dashed), nearly
# all of whose steps decode. No cloud rises with the tokens, and none comes down to that line.*
#
# Neither lever took the mixed step near a decode step's time:
# - **Compiled**, its median was 8.49 ms against 8.47 eagerly at 32 requests/s, and 11.96 against
#   13.51 at 16: no change at the higher rate, 11% shorter at the lower.
# - **A budget of 512 tokens**, in the next process, gave 11.57 ms at 32 requests/s (longer than
#   either 2,048-token server's 8.5) and 13.03 at 16 (against their 12.0 and 13.5).
#
# The figure shows why neither could do much. In the eager server's trace, mixed steps of 79 to
# 153 tokens took 7.4 to 8.5 ms, and those of 444 to 502 tokens 7.5 to 8.6. About 7 ms of every
# mixed step is a cost that follows neither its token count nor whether it is compiled. The
# arithmetic is not it: 500 tokens through Llama-3.2-1B's layers are about 1 TFLOP, a millisecond
# or two at this card's dense bf16 rate, and 80 tokens a sixth of that.
#
# ITL p99 over p50 at 32 requests/s was 7.8 for the eager server and 13.6 for the compiled one in
# this run. The same eager server measured 12.3 in the run above it, so the two tails sit inside
# one server's spread from run to run, and this run cannot rank them. So both levers stay off:
# `COMPILE_VARLEN` is False, and the budget stays 2,048.
#
# Then one mixed step was taken apart (`levers --only mixed`, `lab.mixedsteps`). Sixteen rows
# decode at about 512 tokens each, a prompt of 64, 512 or 2,048 tokens arrives, and each step
# that carries its chunks is split into the host's time inside the varlen forward (planning it
# and launching its kernels), the forward's span on the GPU (between events recorded as the
# forward is called and as it returns), sampling with its read-back, and the rest of the step.
# A profile of the 512-token prompt's step gives its kernels' time.

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
# step (grey). The black tick is the forward's span on the GPU, the red one the summed time of
# the 512-token prompt's kernels, and the dashed line a decode step of the same rows. Compare
# the blue bars with the black ticks: they end together.*
#
# The forward is host-bound. For 80 tokens and for 528, eager or compiled, the host spent 9.8 to
# 10.2 ms inside the forward (9.6 to 10.0 for the 32-token second chunk), and the forward's span
# on the GPU ended within 0.05 ms of it: the GPU ran each kernel as soon as it was launched, then
# waited for the next. The kernels of the 528-token step add up to 3.3 ms eagerly and 3.2
# compiled, a third of the span. Only the first chunk of the 2,048-token prompt (2,048 tokens)
# kept the GPU busier than the host: its forward ran 14.6 ms, 3.5 to 3.9 of them after the host
# had returned, which the timed sampling waits for. Sampling itself and the rest of the step take
# about half a millisecond. Compiling did not shorten the host's part, so that time is not in
# what inductor fuses; which calls inside the forward hold it is for a profile of the host, not
# of the GPU, to say.
#
# This run's mixed steps are longer than the server's (7.4 to 8.6 ms in the traces above): its
# rows, its events and the waits of its timed sampler are its own. Neither the server's steps nor
# these grow with their tokens, and here the host sets their length.
#
# ### The host's time, by part
#
# `levers --only mixedhost` (`lab.mixedsteps.mixed_host_parts`) splits it. The same sixteen rows
# run, a prompt of 64, 512 or 1,536 tokens arrives (each fits one step), and timers on every
# module of the model, on the planning, on the rotation and K/V write and on the attention read
# charge each part its own time, with what it calls that is timed too taken out. The timers cost
# something themselves, so as many steps again ran without them (`plain_us`).

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
# *Figure 61.15: the host's time inside an eager mixed step, by part, for each prompt, the
# largest at the top, with each part's calls a step in brackets. Read the top three rows: each
# holds one Triton launch a layer.*
#
# With its timers the forward took 14.2 to 15.0 ms, and 11.4 or 11.5 without them at 64 and 512
# tokens: the step's 183 timed calls cost 15 to 20 us each, so every part includes about that
# much a call. At 1,536 tokens the untimed step was the longer one, 17.0 ms against 15.0. There
# the GPU's forward takes longer than the host's, and something inside `run_varlen` waited for
# it; this table does not say what.
# - The three parts that launch a Triton kernel each layer come first: the attention read (137
#   to 147 us a call), the rotation and K/V write (116 to 122), and the MLP's own time, which is
#   `silu_mul`'s launch (99 to 107). Together they take 5.7 to 6.0 ms, 38 to 41% of the timed
#   step, for 48 launches.
# - A projection costs 37 to 62 us a call on the host, a layer norm 30 to 37, and a layer's two
#   residual adds, with what else the layer does itself, 82 to 86. Each is one eager torch op,
#   or two, on this machine's host.
# - Planning grows with the tokens, from 0.59 to 1.36 ms: in this run `plan_varlen` built each
#   token's write slot and position in Python lists and made tensors of them one element at a
#   time. It now slices a long segment's slots from its blocks in tensor ops and makes its int64
#   tensors through `array`, with the same six copies to the GPU; that change has not been timed
#   on the H200 yet. A version that also staged the six vectors in pinned memory, as six queued
#   copies, ran once in another process (`data/day61_mixed_host_staged_h200.csv`): its plan took
#   0.83, 0.75 and 0.95 ms at the three prompts: slower at 64 tokens, faster at 512 and 1,536.
#   One run against another, in two processes, does not settle that, so the copies stay as they
#   were until one process times both.
#
# So the lever is to take the host out of the forward, and which way matters. A piecewise graph
# with the varlen read left outside it (vLLM's default) would still pay the read's sixteen
# launches, about 2 ms a step here. A graph over the whole mixed step would take all of it, with
# the token count padded to a bucket and the read's grid cut for the bucket. Launching the Triton
# kernels through a cached launcher would take the larger part of the three. Neither is built
# yet.
#
# ## bf16 against fp32
#
# Every arm runs in bf16, and the bench checked how far each is from fp32. On random weights the
# logits are nearly flat, so two correct bf16 paths round differently, pick different tokens
# within a few steps, and then follow different histories. Greedy rows therefore part early for
# any two bf16 paths. The relative error of the first decode step's logits against fp32 is the
# measure that separates a rounding difference from a wrong answer.

# %%
lab.show(h200["fp32_agreement"].drop(columns=list(measured.as_columns())).round(4))
lab.show(h200["lever_agreement"].drop(columns=list(measured.as_columns())).round(4))

# %% [markdown]
# Compiled bf16 is no further from fp32 than eager bf16. The pinned arm decodes exactly what the
# arm before it decodes. Asynchronous scheduling replays the same compiled graph, so it matches
# the inductor arm, and both sit at the bf16 rounding distance from the eager graphs.
#
# ## On this machine: the schedule changes, the tokens must not
#
# Of the levers, two change the engine's schedule on every device: asynchronous scheduling, and
# chunked prefill under a token budget. On a CPU there is no stream for the host to run ahead
# of, and nothing here is timed. What can be checked anywhere is that neither changes what the
# engine decodes. A few prompts of different lengths, each with its own number of tokens to
# generate, run through four engines on the chapter's model. The model is loaded in fp32 on any
# device, because bf16 rounding could flip a near-tie. The first engine is synchronous and
# prefills whole prompts, and it is the reference. The gates below require the same greedy
# tokens and finish reasons from each of the others. They also require that each lever really
# ran: a step left in flight for asynchronous scheduling, and mixed steps within the budget for
# chunked prefill. When the tokenizer has a chat template, one request is a chat turn that may
# stop at EOS, so a stop token that arrives while a step is in flight is part of the check.

# %%
import torch

from nanolab import Engine, SamplingParams, load_model
from nanolab.model.tokenizer import Tokenizer

BUDGET = 16
model = load_model(path, dtype=torch.float32, device=DEVICE)
tokenizer = Tokenizer.from_dir(path)
texts = ["The capital of France is", "def fibonacci(n):",
         "A paged KV cache keeps every request's keys and values in fixed-size blocks, so that",
         "Three facts about the Moon: it is about a quarter of the Earth's width, "
         "it always shows us one face, and"]
prompts = [tokenizer.encode(t) for t in texts]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 9, 12, 14)]
if tokenizer.chat_template is not None:
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    prompts.append(tokenizer.encode_chat(turn))
    params.append(SamplingParams(temperature=0, max_tokens=24))
ARMS = {"synchronous, whole prompts": dict(enable_chunked_prefill=False),
        "asynchronous scheduling": dict(enable_chunked_prefill=False, async_scheduling=True),
        f"chunked prefill, {BUDGET}-token budget": dict(max_num_batched_tokens=BUDGET),
        "both": dict(max_num_batched_tokens=BUDGET, async_scheduling=True)}
print(f"prompt lengths {[len(p) for p in prompts]}, "
      f"new tokens at most {[p.max_tokens for p in params]}")


def decode(engine: Engine) -> tuple[list, pd.DataFrame]:
    """Every request's (tokens, finish reason), and what each step ran."""
    seqs = engine.add_requests(prompts, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        ran = engine.last_step  # None for a step that only launched the next decode
        steps.append({"phase": ran.phase if ran else "launch", "tokens": ran.tokens if ran else 0,
                      "in_flight": engine.in_flight})
    return [(s.output_token_ids, s.finish_reason) for s in seqs], pd.DataFrame(steps)


decoded = {arm: decode(Engine(model, num_blocks=64, **kw)) for arm, kw in ARMS.items()}
reference, _ = decoded["synchronous, whole prompts"]
lab.show(pd.DataFrame({"prompt tokens": [len(p) for p in prompts],
                       "new tokens": [len(t) for t, _ in reference],
                       "finish": [f for _, f in reference],
                       "completion": [tokenizer.decode(t) for t, _ in reference]}))

# %%
gates, rows = [], []
for arm, kw in list(ARMS.items())[1:]:
    outcome, steps = decoded[arm]
    numbers = {"requests": len(outcome),
               "equal": sum(a == b for a, b in zip(outcome, reference, strict=True)),
               "steps": len(steps), "steps left in flight": int(steps.in_flight.sum()),
               "mixed steps": int((steps.phase == "mixed").sum()),
               "most tokens a step": int(steps.tokens.max())}
    passed = numbers["equal"] == numbers["requests"]
    if kw.get("async_scheduling"):
        passed &= numbers["steps left in flight"] > 0
    if kw.get("enable_chunked_prefill", True):
        passed &= numbers["mixed steps"] > 0 and numbers["most tokens a step"] <= BUDGET
    gates.append(lab.Gate(f"{arm}: the synchronous whole-prompt engine's greedy tokens", passed,
                          numbers))
    rows.append({"arm": arm, **numbers, "passed": passed})
parity = pd.DataFrame(rows)
lab.save_table(parity, "day61_parity", label)
lab.show(parity)
for gate in gates:
    print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
    assert gate, gate

# %% [markdown]
# ## The CPU target
#
# The issue also asks for twice HF's speed at batch 1 on a 2-core CPU, SmolLM2 in fp32. A profile
# of the eager step put about 70% of its time in the projections, and a microbenchmark of them
# alone found two things:
#
# - MKL's GEMV, which `F.linear` runs for one row, streams the weights on one core at about
#   12 GB/s. oneDNN's prepacked matmul (`layers.Linear.prepack`, the engine's CPU default since
#   earlier days) uses both, at 20 to 25 GB/s.
# - The packing had been for exactly one row. Packed for any number of rows, the LM head ran in
#   2.5 ms rather than 3.3, and SmolLM2's 8-row step went from 67.7 to 47.1 ms.
#
# The rest of the step, about 10 ms of norms, rotations, reads and Python between the matmuls, is
# what inductor removes. It could not see the packed matmuls before: their weight is a oneDNN
# tensor dynamo cannot fake, so a compiled model used to keep plain weights and MKL's GEMV, and ran
# slower than eager (45 against 37 ms). Now each packed matmul reaches the graph as one operator
# (`layers.packed_linear_op`) that takes the plain weight, a graph input like any parameter, and
# looks its packed copy up by it. Inductor's wrapper is C++ on the CPU (`runner.CPU_OPTIONS`),
# which took about 1.5 ms of Python calls out of each step. A profile of the compiled step puts
# about 22 of its 28 ms in the matmuls.
#
# That left the compiled step at 1.73 to 2.00x HF's over five runs, the matmuls streaming at half
# of what a two-core sum reads. One more microbenchmark, on one row, found the way past it: written
# as a product and a sum, a matmul becomes inductor's own reduction, vectorised and spread over
# both cores, and it read SmolLM2's gate-up weights at 22.6 GB/s against the packed matmul's 18.4,
# and its LM head at 30.5 against 16.2 (a plain sum over 512 MB reads 34). Inductor lowers a
# one-row matmul this way on a GPU when it tunes, never on a CPU. So on the CPU, a compiled
# `Linear` of one row now writes it that way (`layers.ONE_ROW_REDUCTION`), and more rows, or the
# eager step, keep the packed matmul: at 8 rows the reduction ran at a third of its speed. Five
# alternated runs of the compiled one-row step took 36.6 to 44.5 ms before and 22.4 to 25.5 after,
# with the same tokens.
#
# The floorbench ran nanolab's compiled step, its eager step and HF's default arm side by side, in
# one process (`python -m nanolab floorbench --model smollm2-135m --device cpu --batches 1,8
# --contexts none --arms nanolab,hf-default --ttft none --compile on --eager-beside`). The floor is
# the same arithmetic as on the H200: every weight read once, at the copy bandwidth the process
# measured. In nanolab's labels "eager" means without CUDA graphs, which a CPU does not have, and
# "inductor" marks the compiled step.

# %%
from nanolab.lab.floorbench import FloorBench, cpu_target_line

cpu_tables = [lab.load_table(f"day61_{stem}", "cpu") for stem in ("floor", "roofline")]
if any(t is None for t in cpu_tables):
    print("data/day61_floor_cpu.csv is not committed: the floorbench command above makes it")
else:
    cpu_floor, cpu_roofline = cpu_tables
    print("measured on:", lab.table_label(cpu_floor).caption())
    lab.show(cpu_floor.pivot_table(index="batch", columns="label", values="ms_per_step")
             .join(cpu_roofline.set_index("batch").floor_ms).round(2))
    print(cpu_target_line(FloorBench(cpu_floor, cpu_roofline, pd.DataFrame())))

# %% [markdown]
# The target is met, by more than this machine's run-to-run spread. The command ran twice that
# afternoon, and the compiled step came out at 3.12x and then 3.41x HF's at batch 1; the second
# run is the one committed. The machine was slower for HF than in the morning: its step took
# about 80 ms at batch 1, where the morning's five runs had it at 57 to 60, and nanolab's eager
# step slowed with it. Alone in a process of its own, right after, HF's step took 74 ms, so most
# of that was the machine's. The compiled step, whose one-row matmuls are now inductor's
# reductions, took 23.6 ms in the committed run and 25.9 in the first; against the morning's HF
# times it would still be above 2x. At batch 8 the step keeps the packed matmuls, and it slowed
# with the machine (57.5 ms against the morning's 49.3); its ratio rose to 2.22x only because HF's
# slowed more. At batch 1 the compiled step now sits under twice its floor.

# %% [markdown]
# ## Looking back
#
# - **Pinned step inputs** changed nothing on their own, as predicted. They are what lets the
#   host stop waiting on the stream, and no logits moved.
# - **Inductor** folded the small kernels between the projections into a few fused ones. The
#   replay got shorter and the host's share did not move.
# - **Asynchronous scheduling** hid the host under the replay: a step now takes about as long as
#   its graph. On this machine it decoded exactly the synchronous engine's tokens.
# - **One kernel for the rotation and the K/V write** took two launches a layer out of the graph
#   and a few tens of microseconds out of every step, at every batch.
# - **A Triton GEMV** at best roughly tied cuBLAS, so it stays a measurement. The
#   projections are now the bulk of the step, and they stream the weights below the copy's rate.
# - **Fused projections with PDL** removed the small kernels and shortened their own replay, but
#   read the big matrices too slowly to beat the compiled step; they stay in the lab. The
#   **two-pass argmax** from the same run took the greedy pick from 27 us a step to 3, and stays.
# - **Inductor's matmul templates** at batch 1 were chosen by timings that are not the step's, and
#   made it slower. **Tuned reductions** at batch 1 made it shorter, by folding the norms into the
#   projections rather than by reading faster, and stay.
# - **Folding the read's shares in its own kernel** made the read slower: the fold waits behind
#   the slowest share, where the merge kernel it replaced ran wide. **PDL in the compiled step**
#   did not move the median of fresh compiles while the LM head's draw moved the step more; once
#   the head was on cuBLAS, it took about 0.08 ms off the median and stays.
# - **Empty shares returning at once** took a third off the read at batch 8 and about 2% off the
#   steps at batches 8 and 32. Masking their stores alone had changed nothing: the cost was the
#   programs, not what they wrote.
# - **The tuning is a draw.** One batch-1 graph, compiled afresh, ran anywhere in a band of about
#   0.19 ms, wider than its distance to the target. The LM head was the worst of it and is back on
#   cuBLAS, which took the median step down by about 0.08 ms. The down projection's draw was the
#   tuner's noise: its in-graph time follows the config it gets, and the tuner reached the best
#   config in three compiles of eight, or three of four once it timed after a warm-up. With PDL
#   and the warmed-up tuning, the median fresh compile sits on the 1.00 ms target (1.0005), and
#   half of them under it. The rest of the
#   band (a q/k/v draw, a down draw in one compile of four) is still there; choosing configs by
#   their time in the step, not alone, is the next lever for batch 1.
# - **On the CPU** the matmuls packed for any number of rows, the step compiled around them, and
#   inductor's wrapper in C++ took nanolab's batch-1 step to between 1.73x and 2.00x HF's over five
#   runs. Its one-row matmuls written as inductor's own reductions, which stream the weights over
#   both cores, took it past the 2x target (the ratio printed in the CPU section).
# - **The GEMV, under PDL**, tied cuBLAS launch by launch and still took 3% off the batch-8 step,
#   from the time between kernels: a Triton kernel can wait in-kernel for its predecessor and a
#   cuBLAS one cannot. It runs a batch's layer projections up to 16 rows. Past that, and with its
#   weight loaded ahead of the wait, it did not pay.
# - **The read in one kernel** took the merge's 35 us a step off batch 8 (1.149 to 1.096 ms in
#   one process): a short row is now one share that writes its own output, and a walk of four
#   tiles costs what one did. Asking L2 for the weights ahead of the PDL wait made the step
#   slower, and adding split-K's halves inside the GEMV cost the GEMV what the second kernel had.
# - **Between two steps**, the plan's four copies became one kernel that reads them from pinned
#   host memory, and the read-back moved to a stream of its own: three operations fewer between
#   two replays, and a fourth off the next step's path. No kernel of the graph changed. One engine
#   timed both ways, in eight alternating rounds, gained 12.7 to 14.8 us a step (medians, batches
#   1 to 64), as predicted; the GPU's wait between two batch-8 replays fell from 37.5 to 14.4 us.
#   Comparing two builds could not show it: two compiles draw two sets of tuned kernels.
# - **Against the peers**, nanolab's step is the fastest measured at every batch, 1.23x gpt-fast's
#   at batch 1 and 1.53x at batch 8 in one process. It meets every step target of the issue in the
#   floor table (the printed ratios): batch 8, 1% short of its target in the table before the
#   upload changed (1.112 ms against 1.10), measured 1.088. Batch 1's row is one draw; the median
#   of four fresh compiles sits on its target (1.0005 ms). Whole-generate times move by a few
#   percent between processes, with the copy bandwidth each one measures. At batch 8 what is
#   left is the projections' 2.9 TB/s and two norm-and-add kernels a layer (0.075 ms a step),
#   each mostly its own launch. Folding those norms, the residual adds and SwiGLU into the GEMVs
#   took the kernels away and made the step 2.6 times longer: only the residual add fits inside a
#   GEMV for less than the 2.3 us kernel it removes.
# - **Time to first token** meets its target since whole prompts attend through torch's fused
#   attention instead of the streamed read.
# - **Chunked prefill** cut the server's ITL tail without moving the median. On this machine it
#   decoded the whole-prompt engine's tokens. The tail aim is still missed, and p99 lands on the
#   mixed steps. Compiling them, or cutting the budget to 512 tokens, did not shorten them. Taken
#   apart, a mixed step is about 10 ms of the host inside its forward, with the GPU busy for a
#   third of it. Timed part by part, three Triton launches a layer, at 100 to 150 us each, take
#   about 40% of the timed step's host time: the next lever is a graph over the whole mixed
#   step, read included, or cheaper launches.
