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
# # Day 61: batch 8 and the step-to-step upload
#
# The {doc}`first chapter of Day 61 <61_the_floor>` brought the batch-1 step to its target. At
# batch 8 the step reads the same weights and eight rows of history, and its target is 1.10 ms.
# Two things there are not batch 1's: the batched graph's projections are cuBLAS's, which no
# kernel can launch as a programmatic dependent, and at a short context most of the read's split
# grid walks nothing. This chapter asks what keeps batch 8 above its target: the read, the
# projections, and the work between two graphs. What was kept and what was not is listed at the end.

# %%
import nanolab.lab as lab

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The H200 tables
#
# Every table here was measured on one H200 at Llama-3.2-1B shapes in bf16 with synthesized random
# weights and is read from `data/`; a CPU re-measures nothing. Most are lever runs (`python -m
# nanolab levers --stem STEM`, one process, one engine per arm); each cell names its table. A command
# printed for a missing table is the lab's as of commit 6849349, which made these runs; most of their
# arms are designs the engine no longer has.

# %%
import pandas as pd

roofline = lab.load_table("day61_roofline", "h200")
assert roofline is not None, "data/day61_roofline_h200.csv (python -m nanolab floorbench on an H200)"
target_b8 = float(roofline[(roofline.batch == 8) & (roofline.context == 128)].target_ms.iloc[0])
print(f"the batch-8 target at context 128: {target_b8:.2f} ms")


def show_waterfall(run: tuple, stem: str) -> None:
    """A lever run's batch-8 step by kernel class against the target (`figures/<stem>_h200.png`)."""
    levers, parts, _ = run
    fig = lab.lever_run_waterfall(levers, parts, target_b8, batch=8)
    if ON_GPU or not lab.figure_path(stem, "h200").exists():
        lab.save_figure(fig, stem, lab.table_label(levers))
    lab.show(fig)

# %% [markdown]
# ## The read's shares folded in one kernel, measured and not kept
#
# At batches 1 and 8 the streamed read cuts each row's walk into 16 shares, chosen for the table's
# capacity rather than the step's context, and a second kernel (`_merge_splits`) folds them into
# the output: two launches a layer. In the design measured here each share took a ticket when its
# partial was written, and the program with the last ticket folded them all. The prediction: the
# merge's 21 to 28 us a step gone at batches 1 and 8, and 16 gaps with it. Batches 1, 8 and 32 were
# profiled.

# %%
step = lab.show_lever_run("day61_step", "ms_per_step", "python -m nanolab levers --only levers --arms 6,9,10 "
                          "--profile 1@128,8@128,32@128 --stem day61_step")
if step is not None:
    step_parts = lab.load_table("day61_step_parts", "h200")
    read = step_parts[step_parts.part == "attention read"].pivot_table(index="batch", columns="arm", values="ms")
    lab.show(read[step[2]].add_suffix(": attention read, ms").round(3))

# %% [markdown]
# The read got slower at every batch: the merge went, but the read's own kernel grew by more than
# the merge had cost. A merge runs one program per (row, query head), all at once; the fold ran in
# one per (row, KV head), only after the row's slowest share, so its loads waited behind the walk
# instead of overlapping it. The read kept its merge. The third arm added PDL over the fold; its
# fast batch-1 step was the LM head's tuning, not PDL ({doc}`61_the_floor`).
#
# ## Empty shares return at once, kept
#
# At context 128 a row has one tile of 128 keys, so 15 of its 16 shares walk nothing, yet each
# loads its queries and writes a partial of 16 heads by 64 floats for the merge to read: at batch 8,
# 1,024 programs a layer where one per KV head and row would do. Now a share past its row's last
# tile returns once it has read the row's length, and the merge reads only the shares a row has.
# The prediction: a shorter read at batches 8 and 32, where empty shares are most of the grid, and
# nothing at context 2,048. A first version only masked the empty shares' stores off, and its read
# took the same 117 us a step at batch 8 (git history keeps that run): the cost was the programs,
# not their writes. This version returns early, measured against the step with the LM head on
# cuBLAS, both arms sharing one compile.

# %%
skip = lab.show_lever_run("day61_skip", "ms_per_step", "python -m nanolab levers --only levers --arms 11,13 "
                          "--shapes 1@128,8@128,32@128,32@2048 --profile 8@128 --stem day61_skip")
if skip is not None:
    skip_profile = lab.load_table("day61_skip_lever_profile", "h200")
    lab.show(skip_profile[skip_profile.kernel.isin(["_paged_decode_group", "_merge_splits"])]
             .pivot_table(index=["batch", "kernel"], columns="arm", values="us_per_step")[skip[2]].round(1))

# %% [markdown]
# At batch 8 the read's kernel lost a third of its time, the merge gained a little (its programs
# now load the row's length first), and the step got about 2% shorter; batch 32 as much, context
# 2,048 unmoved. Batch 1 got slightly longer: its 128 programs are under one per SM, so no live
# share waited behind an empty one, and only the merge's extra load changed. The engine keeps the
# lever where the grid is over one program per SM, leaving batch 1 as it was. A second process
# checked that it does not cost batch 64 what it saves the middle batches:

# %%
skip64 = lab.show_lever_run("day61_skip64", "ms_per_step", "python -m nanolab levers --only levers --arms 11,13 "
                            "--shapes 32@128,64@128 --profile 64@128 --stem day61_skip64")

# %% [markdown]
# Batch 32 got shorter by about 2% again, and batch 64 did not move: at 64 rows the grid is already
# mostly live shares.
#
# ## The projections in Triton
#
# With a few rows against a weight matrix a projection is a matrix-vector product, and a GEMV tiled
# for that shape can in principle stream the weight faster than a general GEMM. `kernels.gemv` is
# one, in Triton. `gemvbench.projection_table` timed each projection alone, cuBLAS (`F.linear`)
# against the GEMV at 1 to 16 rows, the L2 flushed before every launch: the GEMV's default tiles
# everywhere, and every tiling of a sweep at 1 and 16 rows. The times include each launch, so they
# compare the arms with each other, not with the step, where cuBLAS's kernels run back to back.

# %%
from nanolab import PRESETS

projections = lab.measured_table("day61_projections", "python -m nanolab levers --only projections")
if projections is not None:
    best = lab.best_of_sweep(projections)
    lab.show(best.round(3))
    # each projection once a layer, the head once a step
    layers = PRESETS[lab.table_label(projections).model].num_hidden_layers
    calls = best.projection.map(lambda p: 1 if p == "lm_head" else layers)
    weighted = best[["cublas", "gemv", "best gemv"]].mul(calls, axis=0).assign(rows=best.rows)
    print("every projection of one step, timed alone and summed (ms):")
    lab.show((weighted[weighted.rows.isin((1, 16))].groupby("rows").sum() / 1000).round(3))
    fig = lab.plot_projections(projections)
    if ON_GPU or not lab.figure_path("day61_projections", "h200").exists():
        lab.save_figure(fig, "day61_projections", lab.table_label(projections))
    lab.show(fig)

# %% [markdown]
# *Figure 61.5: Each bar is a projection's time alone over cuBLAS's, so 1 is a tie. The orange
# bars, the GEMV with its default tiles, lose on the small projections; the red bars, the best
# tiling of the sweep, land on cuBLAS's line.*
#
# Alone, a kernel that at best matches cuBLAS buys nothing, and it was not kept then. But PDL
# moved batch 1 and left batches 8 to 64 where they were: a cuBLAS kernel is not launched as a
# programmatic dependent, so in the batched graph the chain of early launches breaks four times a
# layer, each projection waiting for the kernel before it to drain. The GEMV can be launched that
# way. `gemv.step_linear` runs it in the compiled step for 2 to 16 rows with fixed tiles per weight
# shape (`gemv.step_config`, the best of the 16-row sweep), `F.linear` past that. The prediction:
# launch by launch still a tie, but a step shorter by some of the GPU's idle time between kernels,
# as batch 1's was with PDL.
#
# A first instrument checks the tie back to back rather than alone: each projection runs sixteen
# times in one CUDA graph, each against a weight of its own, so nothing is warm in L2 and each
# launch follows another as in the step (`levers --only chain`).

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
# Back to back, a layer's four projections take about as long either way, within 4%, and the
# step's tiles are the sweep's fastest or within 5% of it on every shape. The small q/k/v and o
# weights stream at under 2 TB/s whichever kernel reads them: at 8 to 13 MB a launch is mostly its
# own start and drain. The lever run put the engine's step (`+ tuning timed after a warm-up`) beside
# the GEMV for up to 16 rows, for up to 64, and for up to 64 with each program's first weight tile
# loaded ahead of its PDL wait, to start streaming under the previous kernel's tail.

# %%
gemv_run = lab.show_lever_run("day61_gemv", "ms_per_step", "python -m nanolab levers --only levers "
                              "--arms 15,16,17,18 --shapes 8@128,32@128,64@128 --profile 8@128 --stem day61_gemv")
gemv_agreement = lab.load_table("day61_gemv_lever_agreement", "h200")
if gemv_run is not None:
    show_waterfall(gemv_run, "day61_gemv_waterfall")
    lab.show(gemv_agreement.set_index("arm")[["rows equal to the first arm",
                                               "logits rel err to the first arm"]].round(4))

# %% [markdown]
# *Figure 61.6: the batch-8 step of the four arms in one process, by kernel class, against the
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
# - **At 32 and 64 rows it is noise**, +1% and -1%, inside the run-to-run spread of these lever
#   runs. The engine keeps cuBLAS past 16 rows.
# - **The weight ahead of the wait does not pay.** Carrying a loaded tile from one iteration to the
#   next costs Triton its software pipelining of the loop, and the projections took 1.05 ms a step
#   instead of 0.67. It was not kept.
# - **The tokens agree as bf16 paths do.** Against the first arm, the first decode step's logits
#   differ by 1.4%. Two correct bf16 paths of this model differ by 2 to 2.5% ({doc}`61d_the_cpu`),
#   and the fp32 tests hold the GEMV to the reference at 1e-3.
#
# So the GEMV is the engine's for the layers' projections of 2 to 16 rows, wherever the step has
# PDL (`runner.compile_decode` marks them, `layers.Linear.step_kernel`): without PDL it only ties
# cuBLAS. Batch 1 keeps inductor's tuned reductions, and the LM head stays cuBLAS's.
#
# What is left at batch 8 is in the same profile. The projections stream about 2.9 TB/s over a
# layer, against 4.2 for a copy, and the paged read and its merge take about 0.11 ms a step to read
# at most 34 MB of K and V, 8 us at the copy's rate. The read's time does not follow its grid:
# aimed at 4 or 2 programs per SM instead of 8, it kept 77 us in the read kernel and moved its merge
# from 35 to 32 us; batch 8 did not get shorter and batch 64 got longer (1.64 and 1.83 ms against
# 1.39; `levers --arms 16,19,20 --stem day61_grid`). At sixteen layers, a read kernel of 4.8 us
# that moves 2 MB is mostly its own launch and drain.
#
# ## The read in one kernel
#
# So the batch-8 step waits on small kernels that are mostly start and drain, and on a read whose
# time does not follow its grid. Two ideas for each were measured, one process a run, against the
# engine's step then (`+ Triton projections to 16 rows`).
#
# **Weights asked of L2 while the step waits.** Under PDL a kernel may start before its predecessor
# ends but not read the activations until its wait returns. No kernel writes a weight, so a GEMV
# could ask L2 for its share before the wait (`prefetch.global.L2`, a request a 128-byte line). To
# overlap anything, the engine's kernels before it (the rotation, the read and its merge, the GEMV)
# would release their dependents as they start instead of as they exit. The prediction: the 8 to
# 13 MB q/k/v and o weights would come from L2 under the read and the norms, and their kernels
# stop being latency-bound. Three arms: the early release alone, then with 16 MiB of each weight
# asked of L2, then the whole weight.

# %%
l2_run = lab.show_lever_run("day61_l2", "ms_per_step", "python -m nanolab levers --only levers "
                            "--arms 16,21,22,23 --shapes 8@128,64@128 --profile 8@128 --stem day61_l2")

# %% [markdown]
# Neither paid. The early release left batch 8 where it was (1.123 ms against 1.129); asking L2 made
# it slower, 1.208 ms with 16 MiB a weight and 1.295 with all of it: the requests compete with the
# running kernel for the same DRAM, and every byte is still read once. Batch 64 runs cuBLAS, so it
# shows only this process's spread (1.46 to 1.97 ms). The parts do not add up here: released early,
# a kernel is on the GPU while it waits, its time includes its predecessor's, and the host's share
# comes out negative. Neither was kept.
#
# **One read kernel, not two.** At 128 to 385 keys a row has one to four tiles of 128, so at most
# four of its 16 shares are live, each walking one tile, and `_merge_splits` folds them in a second
# kernel: 35 us a step at batch 8, 16 launches of 2 us that mostly start and drain. Folding every
# share in the read lost (above). Now shares walk at least four tiles, so here each row has one
# live share, which writes its output itself, no partials, no ticket; longer rows fold their live
# shares, only those, in the read. The prediction: the merge's 35 us gone, the read no slower, a
# walk of four pipelined tiles costing about one's latency. A fourth arm takes the idea to the down
# projection, which splits K in two and adds the halves in `_sum_splits`, 19 us a step: in a
# split-K fix-up the last half to finish adds them.

# %%
fold_run = lab.show_lever_run("day61_fold", "ms_per_step", "python -m nanolab levers --only levers "
                              "--arms 16,25,26,27 --shapes 1@128,8@128 --profile 8@128 --stem day61_fold")
if fold_run is not None:
    show_waterfall(fold_run, "day61_fold_waterfall")
    fold_order = fold_run[2]
    fold_profile = lab.load_table("day61_fold_lever_profile", "h200")
    small = fold_profile[fold_profile.kernel.isin(["_paged_decode_group", "_merge_splits", "_gemv", "_sum_splits"])]
    lab.show(small.pivot_table(index="kernel", columns="arm", values="us_per_step")[fold_order]
             .add_suffix(": us a step").round(1))

# %% [markdown]
# *Figure 61.7: the batch-8 step of the four arms in one process, by kernel class, against the
# batch-8 target. The second and third arms each branch off the first, and the fourth takes both.
# The read's block (green) loses its merge in the second and fourth arms; the projections' block
# does not move in any of them.*
#
# - **The read in one kernel pays.** Batch 8 went from 1.149 to 1.096 ms (-4.6%): `_merge_splits`
#   is gone (35.4 us a step), and the read's kernel took 78.1 us against 77.7 for a walk of one
#   tile. Four tiles cost what one does, as predicted.
# - **The fix-up does not.** `_sum_splits`' 18.8 us went and the GEMV grew by 21 us: each column
#   block's last half waits for its ticket, re-reads both halves from L2 and writes the sum. Batch 8
#   measured 1.143 ms, the engine's time. It was not kept.
# - **Batch 1 follows its compile's draw** (1.198 against 1.018 ms): the fix-up cannot touch its
#   reductions. The floor table's 0.980 ms sits in the band of fresh compiles (0.954 to 1.061).
# - **The tokens do not change**: every arm's greedy rows and first-step logits equal the first's.
#
# So the read runs in one kernel at every batch: a row of up to 512 keys is one share that writes
# its own output, and a longer row's live shares are folded by the last to finish. The tests in
# `test_paged_attention` poison the partials with NaN, so a fold that read a share no program wrote,
# or a short row that wrote a partial, fails them; on the H200 they repeat each read 50 times,
# where the ticket race is real.
#
# ## The norms inside the GEMVs, measured and not kept
#
# With the merge gone, the smallest kernels left at batch 8 sit between the projections: two
# norm-and-add kernels a layer (74 us a step) and SwiGLU's (21 us), each moving about 32 KB, mostly
# launch. `lab.folds.step_projection` folds each into the projection next to it, through the
# engine's GEMV (`gemv`'s `norm`, `residual` and `swiglu`):
# - the q/k/v and gate/up GEMVs read the residual stream itself: each x tile is multiplied by the
#   norm's weight on its way to the dot, its squares are summed from the same tile, and each row of
#   the product is scaled by 1 / rms at the end;
# - the o and down GEMVs add the residual to their fp32 sums before the one rounding (down's in
#   `_sum_splits`, since it splits K in two);
# - down reads gate and up from the fused gate/up output and applies SwiGLU as it loads them.
#
# A layer is then four GEMVs around the attention (`lab.folds.FoldedStep`, a forward the lab hands
# the engine), and the residual stream never passes through a kernel of its own. At 32 and 64 rows
# the fold also moves the projections from cuBLAS to the GEMV, alone within 1% of cuBLAS there.
# The prediction: about 0.09 ms off the batch-8 step, if each fold costs the GEMV almost nothing,
# touching only the activation tile, a few KB beside the weight's megabytes.

# %%
fused_step = lab.show_lever_run("day61_fused_step", "ms_per_step", "python -m nanolab levers --only levers "
                                "--arms 25,28 --shapes 8@128,32@128,64@128 --profile 8@128 --stem day61_fused_step")
if fused_step is not None:
    fs_agree = lab.load_table("day61_fused_step_lever_agreement", "h200")
    lab.show(fs_agree[["arm", "rows", "steps", "rows equal to the first arm", "logits rel err to the first arm"]])

# %% [markdown]
# The fold lost, by far more than it could have won: batch 8 went from 1.083 to 2.798 ms, 32 rows
# from 1.236 to 2.558 and 64 rows from 1.449 to 3.518. The norms class went from 0.074 ms a step to
# 0.002, and the GEMV kernels from 0.67 to 2.46 ms, taking the projections class with them. The
# tokens are not the problem: the folded step scales the product by 1 / rms rather than the input
# and rounds o's and down's sums once with the residual in them, so its logits sit 2.5% from the
# first arm's and 2 of the 8 greedy rows stay equal, the distance between any two bf16 paths here
# (bf16 against fp32 is 2.5% eagerly, 2.2% compiled). In fp32 the folded step equals the one-shot
# reference to 1e-3 on the H200 (`test_folded_step_matches_the_reference_on_cuda`), and the
# engine's compiled step to 1e-4 in the interpreter. The 1.8 ms went into the GEMVs, so `levers
# --only folds` takes them fold by fold: sixteen launches of each projection back to back in one
# CUDA graph, each against its own weight, as programmatic dependents, plain and with each fold.

# %%
folds = lab.measured_table("day61_folds", "python -m nanolab levers --only folds")
if folds is not None:
    lab.show(folds[folds.fold != "none"].pivot_table(index=["projection", "fold"], columns="rows", values="us_added")
             .round(1).add_prefix("us added at rows = "))
    fs_profile = lab.load_table("day61_fused_step_lever_profile", "h200")
    engine_arm = fs_profile[fs_profile.arm == fused_step[2][0]]
    norms = engine_arm[engine_arm.kernel.map(lab.kernel_class) == "norms"]
    norm_us = norms.gpu_us.sum() / norms.calls.sum()  # a norm kernel's mean time
    silu = engine_arm[engine_arm.kernel.str.contains("silu")]
    silu_us = silu.gpu_us.sum() / silu.calls.sum()
    print(f"the engine's batch-8 step: {norms.calls.sum() * norms.us_per_step.sum() / norms.gpu_us.sum():.0f} "
          f"norm kernels a step, {norms.us_per_step.sum():.1f} us in all, {norm_us:.1f} us each; "
          f"SwiGLU's kernel {silu_us:.1f} us")
    # what each fold takes out of the step: a norm's kernel, SwiGLU's, and for a residual add none
    # (the norm after it keeps its kernel)
    removed = {"norm": norm_us, "residual": 0.0, "swiglu": silu_us, "swiglu + residual": silu_us}
    fig = lab.plot_folds(folds, removed)
    if ON_GPU or not lab.figure_path("day61_folds", "h200").exists():
        lab.save_figure(fig, "day61_folds", lab.table_label(folds))
    lab.show(fig)

# %% [markdown]
# *Figure 61.8: each layer projection's GEMV, us per launch, alone (grey) and with a fold inside
# it (red), at 8 and 64 rows, with what the fold added over each red bar. The dashed line over
# each grey bar adds the kernel the fold takes out of the step: a 2.3 us norm-and-add for a norm,
# SwiGLU's 1.3 us kernel, and nothing for a residual add, whose norm keeps its kernel. A fold pays
# where its red bar stays under that line.*
#
# None fits under its line. The residual add comes closest, at 0.3 to 0.4 us, but takes no launch
# out of the step: the norm after it still needs its own kernel. The norm adds 9 to 23 us to its
# GEMV, and SwiGLU 84 to 103 us, 6.5 to 7.4 times down's own time: both work on the activation tile
# between its load and the dot, where the residual add works after the loop. What inside the loop
# costs so much (the registers SwiGLU's two tiles need, or a pipeline the loop no longer keeps) is
# for a kernel profile to say. The engine keeps its step, and the folded step stays in the lab.
#
# ## Between two steps: the plan's upload and the read-back
#
# Every lever so far worked inside the graph. The floor bench times whole `generate` calls, where a
# step is the graph's replay and whatever the GPU runs before the next one. With asynchronous
# scheduling the host runs ahead, so between two replays the GPU runs what the engine queued there,
# eight operations a step: the greedy pick's two kernels (`kernels.argmax`); the tokens' read-back,
# a device-to-host copy; the next plan's four per-row vectors (table row, write slot, context
# length, position), a host-to-device copy each, each in a buffer of its own (a view of one shared
# buffer let dynamo tie a size to another, and recompile); and the tokens' copy into the graph's
# input. Each copy moves a few hundred bytes; its cost is the copy engine starting and handing back
# around it, in stream order. The prediction: with four copies folded into one kernel and the
# read-back out of the way, 10 to 15 us less a step at every batch, about the 12 us batch 8 lacked
# against its target. The engine now does two things differently:
# - **The plan goes up in one kernel.** `KVCache.plan_decode` writes the four vectors into a pinned
#   host buffer, and `kernels.step_inputs.upload_step_inputs` loads them from there (the GPU
#   addresses pinned host memory directly) and stores them into the four device buffers, with no
#   copy engine. Three pinned slots take turns, each with an event after the kernel that read it, so
#   a plan never overwrites one the GPU has yet to read. The kernel loads all four vectors before its
#   first store: the compiler cannot move a load above a store that might alias it, so in the order
#   load, store, load, store each trip over PCIe would wait for the one before. A CUDA test builds
#   plans faster than a held-back GPU runs their kernels, and checks each plan's vectors as its
#   kernel left them.
# - **The read-back runs on a stream of its own.** The device-to-host copy waits for the pick and no
#   step waits for it. The host waits for its event, as before.
#
# The run built the engine once and timed it both ways, the old way putting the four copies and
# the read-back back on the step's stream. Both replay the same graphs with the same tuned kernels,
# so the tuning's draw falls on neither. Eight rounds time every batch both ways, alternating which
# goes first, and the cell pairs them round by round. Both ways were then profiled at batches 1
# and 8, and `lab.steploop` cuts the GPU's timeline at each replay: what runs between two replays,
# and for how long.

# %%
between = lab.measured_table("day61_between_ab", "python -m nanolab levers --only between")
between_loop = lab.load_table("day61_between_loop", "h200")  # the same run's profiles
between_ops = lab.load_table("day61_between_loop_ops", "h200")
assert between_loop is not None and between_ops is not None, "day61_between_ab's run also writes its profiles"
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
lab.show(between_loop.set_index(["variant", "batch"])[["outside_ops", "outside_busy_us", "between_us",
                                                        "period_us", "graph_span_us"]].round(1))
fig = lab.plot_between_steps(between_ops, between_loop, batch=8)
if ON_GPU or not lab.figure_path("day61_between_steps", "h200").exists():
    lab.save_figure(fig, "day61_between_steps", lab.table_label(between_loop))
lab.show(fig)

# %% [markdown]
# *Figure 61.9: what the GPU ran between two batch-8 replays in the middle of a profiled
# `generate`, the old way (top) and the engine's (bottom), each operation on its stream's lane:
# kernels blue, the read-back green, the plan's copies orange, the copy of the ids grey. The dashed
# line is where the next replay started, the median over the call's steps. The one `_upload`
# kernel below replaces the orange run of four copies above.*
#
# The change took a median of 12.7 us off a step at batch 1, 13.4 at 8, 14.8 at 32 and 13.6 at 64:
# the 10 to 15 us predicted. Every round was faster at batches 1 to 32, and seven of eight at 64. At
# batches 1 and 8 the rounds agree to within 1.5 us; at 32 and 64 they spread from 7 to 20 us
# faster, and one round at 64 was 2.3 us slower. Between two replays the GPU ran eight operations
# and now runs five, 1.3 us less work in all; the wait from one replay's end to the next one's start
# fell from 29.1 to 14.2 us at batch 1 and from 37.5 to 14.4 at batch 8. The old way, at batch 8,
# started the read-back and the first copy each 7 to 8 us after the operation before them (at batch
# 1, 3.6 and 3.8 us), and each later copy about 2 us after the one before at either batch. The
# upload kernel starts about 1 us after the pick, and the read-back runs on its own stream beside
# the next replay's first kernels. The replay did not change: its graph spans 1079 us at batch 8
# both ways. In this run's own timing the engine's batch-8 step is 1.084 ms, under its 1.10 target.
#
# The first run of this comparison, `levers --arms 25,29`, built the engine twice, once per arm,
# and could not settle it. Its second arm is the engine's defaults, and its batch-1 profile
# (`data/day61_upload_lever_profile_h200.csv`) is the engine's batch-1 profile as it now stands.

# %%
upload_run = lab.show_lever_run("day61_upload", "ms_per_step", "python -m nanolab levers --only levers "
                                "--arms 25,29 --shapes 1@128,8@128,32@128,64@128 --profile 1@128,8@128 "
                                "--stem day61_upload")
if upload_run is not None:
    lab.show(upload_run[0].pivot_table(index="batch", columns="arm", values="replay_ms")[upload_run[2]].round(3))

# %% [markdown]
# Its rows moved both ways, by up to 0.40 ms, and the replay alone (the last table), which the
# change does not touch, was 0.14 ms slower at batch 1: two compiles draw two sets of tuned kernels
# (projections 1.02 against 0.94 ms of the batch-1 step). At batch 8 the second arm's host was 20 to
# 32% slower too, and its step (1.41 ms) ran 0.24 ms past its own replay, where the one-engine run
# above took 1.084 ms. Timing one engine both ways takes both effects out.
#
# ## Looking back, and the gates
#
# - **The read**: folding its shares in its own kernel made it slower; **empty shares returning
#   at once** took a third off it at batch 8, and **the read in one kernel** its merge's 35 us a
#   step (1.149 to 1.096 ms). Weights asked of L2 ahead of the PDL wait, and split-K's halves added
#   inside the GEMV, did not pay.
# - **The GEMV, under PDL**, tied cuBLAS launch by launch and still took 3% off the batch-8 step,
#   from the time between kernels: a Triton kernel can wait in-kernel for its predecessor and a
#   cuBLAS one cannot. What is left at batch 8 is the projections' 2.9 TB/s and two norm-and-add
#   kernels a layer (0.075 ms a step); folding them into the GEMVs made the step 2.6 times longer.
# - **Between two steps**, one upload kernel and a read-back on its own stream took three
#   operations from between two replays and 12.7 to 14.8 us from a step (medians, batches 1 to 64),
#   as predicted, in one engine timed both ways; two builds could not show it.

# %%
import textwrap

exact = {stem: lab.load_table(f"day61_{stem}_lever_agreement", "h200") for stem in ("skip", "skip64", "fold", "upload")}
fp32 = lab.load_table("day61_fp32_agreement", "h200").set_index("arm")["logits rel err to fp32"]
old, new = (between_loop[between_loop.variant == v].set_index("batch").outside_ops
            for v in dict.fromkeys(between_loop.variant))
gates = [lab.Gate(f"day61_{stem}: every arm decodes the first arm's tokens and logits exactly",
                  bool((t["rows equal to the first arm"] == t.rows).all()
                       and (t["logits rel err to the first arm"] == 0).all()),
                  {"arms": len(t), "rows equal": t["rows equal to the first arm"].tolist()})
         for stem, t in exact.items()]
gemv_err = float(gemv_agreement["logits rel err to the first arm"].max())
gates.append(lab.Gate("the GEMV's logits are closer to cuBLAS's than eager bf16's are to fp32",
                      bool(gemv_err < fp32["bfloat16 eager graphs"]),
                      {"GEMV rel err": round(gemv_err, 4), "bf16 rel err": round(fp32["bfloat16 eager graphs"], 4)}))
gates.append(lab.Gate("between two replays the GPU runs fewer operations, at every profiled batch",
                      bool((new < old).all()), {"before": old.to_dict(), "now": new.to_dict()}))
for gate in gates:
    print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
    assert gate, gate
