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
# # Day 65: below the bf16 floor
#
# At batch 1, a decode step must read every weight once. Day 61 took nanolab's step at
# Llama-3.2-1B shapes to 0.93 ms, 1.6x the 0.58 ms it takes an H200 to stream 2.47 GB of bf16
# weights. What is left in that step is mostly the projections, which already run at about
# 2.9 TB/s. The peers that go below the floor do one of two things. They read fewer bytes
# (gpt-fast's int8 and int4 weights), or they run the big model fewer times per token
# (speculative decoding: gpt-fast's draft model, vLLM's prompt lookup).
#
# This chapter tries the first, and asks how far below the bf16 floor it takes a step; the
# {doc}`next <65b_speculative_decoding>` tries the second.
#
# **FP8 weights** (`quantization="fp8"`). Every decoder layer's projections are held as e4m3, with
# one fp32 scale per output channel, quantized from the checkpoint at load. A decode step's
# projections read one byte a weight and scale in registers (the GEMV of Day 60, taught e4m3).
# Longer steps widen the weight to the activations' dtype, which holds every e4m3 value exactly,
# multiply, and scale each output channel after.

# %%
import pandas as pd
import torch

import nanolab.lab as lab
from nanolab import LLM
from nanolab.model.layers import Linear
from nanolab.model.quant import dequantize_fp8, fp8_error_bound

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## What fp8 storage reads
#
# The embedded model, loaded twice: as its checkpoint's dtype and with its layers in fp8. The
# embedding and the LM head stay as they were (the quality section says why). The first layer's
# fused gate and up projection reads back within e4m3's bound of the original.

# %%
dense = LLM(str(path), device=str(DEVICE), dtype=DTYPE, enable_prefix_caching=False)
quantized = LLM(str(path), device=str(DEVICE), dtype=DTYPE, quantization="fp8", enable_prefix_caching=False)
before, after = lab.stored_weight_bytes(dense.model), lab.stored_weight_bytes(quantized.model)
original = dense.model.layers[0].mlp.gate_up_proj.weight
held = quantized.model.layers[0].mlp.gate_up_proj
error = (dequantize_fp8(held.qweight, held.scale) - original.float()).abs()
within = bool((error <= fp8_error_bound(original, held.scale)).all())
layers = sum(m.qweight.numel() for m in quantized.model.modules() if isinstance(m, Linear) and m.qweight is not None)
print(f"{MODEL}: {before / 1e6:.1f} MB of weights in {DTYPE}, {after / 1e6:.1f} MB with the layers in fp8 "
      f"({after / before:.2f}x); {layers / 1e6:.1f}M weights quantized")
print(f"gate_up of layer 0: largest error {error.max():.2e}, within e4m3's bound: {within}")

# %% [markdown]
# ## The decode step on the H200
#
# `python -m nanolab fp8bench --parts steps` (`scripts/gpu_run.sh fp8`) at Llama-3.2-1B shapes,
# with random bf16 weights. One process holds two engines, bf16 and fp8. Each is timed the way
# floorbench times an engine, from whole `generate` calls: 257 new tokens minus 1, over 256. Each
# arm's floor is the bytes its step must read over the copy bandwidth measured in the same run.

# %%
steps = lab.measured_table("day65_fp8_steps", "scripts/gpu_run.sh fp8")
fig = lab.plot_fp8_steps(steps)
if ON_GPU or not lab.figure_path("day65_fp8_steps", "h200").exists():
    lab.save_figure(fig, "day65_fp8_steps", lab.table_label(steps))
lab.show(fig)
lab.show(steps[["arm", "batch", "weight_bytes", "ms_per_step", "floor_ms", "x_floor", "speedup_over_bf16"]]
         .round(3))
print("\n".join(lab.step_lines(steps)))

# %% [markdown]
# FP8 cuts what a step must read from 2.47 GB to 1.50 GB, and the floor falls from 0.59 to
# 0.36 ms. The measured step barely moves. At both batches fp8 is 1.03x bf16, where the aims were
# 1.7x (and at most 0.55 ms) at batch 1 and 1.5x at batch 8. The fp8 step sits at 2.9x its floor.
# Bytes are not what sets this step's pace, so the next two sections look inside it.
#
# ## Where the step's time goes
#
# `fp8bench --parts profile` runs the profiler over 64 steps of whole `generate` calls and sorts
# the GPU's kernels into classes. This profile was taken before today's one change to the step,
# which it led to.

# %%
profile = lab.measured_table("day65_fp8_profile", "python -m nanolab fp8bench --parts profile")
by_class = profile.groupby(["arm", "batch", "class"]).us_per_step.sum().unstack().round(1)
by_class["all kernels"] = by_class.sum(axis=1)
lab.show(by_class)
silu_down = profile[(profile.arm == "bf16") & (profile.batch == 1) & profile.kernel.str.contains("mul_silu")]
print(f"bf16 batch 1, down with SwiGLU fused in: {silu_down.us_per_step.sum() / 16:.1f} us a layer")

# %% [markdown]
# At batch 1 the bf16 step is inductor's code: each projection is a reduction with its
# neighbours fused in. The largest kernel was `down` with SwiGLU fused into it, 19.5 us a layer.
# The next section times the same product alone at 10 us. Fused, the reduction recomputes
# silu(gate) * up for each of its 2,048 output channels, so it reads gate and up 2,048 times.
# The step now writes the activation once, with its own small kernel, before `down` reads it.
# That took bf16 at batch 1 from 1.154 ms (this table's first run, on 2026-12-03, in the
# repository's history) to the 1.093 ms above.
#
# The fp8 arm has no such fusion to lose: its projections are the Triton GEMV, opaque to
# inductor. Its projections took 784 us a step at batch 1 against bf16's 970.
#
# The profile also holds the generate call's prompt step, spread over its 64 decode steps (63
# here, by the LM head's calls). For bf16 that is a few us a step. For fp8 it is not: three
# elementwise kernels ran 64 more times in fp8's profile than in bf16's, once for each quantized
# layer's weight, which the prompt step widens to bf16 before its matmul.

# %%
widening = profile[profile.kernel.str.contains("direct_copy|gpu_kernel_impl_nocast|bfloat16_copy")]
extra = widening.pivot_table(index="kernel", columns=["arm", "batch"], values=["calls", "gpu_us"], aggfunc="sum")
for batch in (1, 8):
    calls = extra["calls"]["fp8", batch] - extra["calls"]["bf16", batch]
    ms = (extra["gpu_us"]["fp8", batch] - extra["gpu_us"]["bf16", batch]).sum() / 1e3
    print(f"batch {batch}: {calls.min():.0f} more calls of each in fp8's profile (at most {calls.max():.0f}), "
          f"{ms:.1f} ms in all, {ms * 1e3 / 63:.0f} us a decode step of the table")

# %% [markdown]
# So fp8's prompt step of 128 tokens spends about 7.5 ms widening weights, as long as seven
# decode steps, and the per-step sums above overstate fp8's decode step by about 120 us. A prompt
# chunk pays it again for every chunk. `fp8bench --parts profile` now profiles a call of one
# new token as well and takes its kernels out (`stepparts.decode_kernels`); this table predates
# that. A prompt step that reads e4m3 bytes itself, instead of widening them first, is not built.
#
# ## The projections alone
#
# `fp8bench --parts tiles` times each layer projection as the step runs it: 16 launches back to
# back in one CUDA graph, each with its own weight, so none is warm in L2. For the e4m3 weight it
# sweeps every GEMV tile, and at batch 1 it also tries inductor's reduction over the widened
# bytes. The tick on each bar is the time its weight's bytes take at the copy bandwidth.

# %%
tiles = lab.measured_table("day65_fp8_tiles", "python -m nanolab fp8bench --parts tiles")
fig = lab.plot_fp8_tiles(tiles, float(steps.bandwidth_tb_s.iloc[0]))
if ON_GPU or not lab.figure_path("day65_fp8_tiles", "h200").exists():
    lab.save_figure(fig, "day65_fp8_tiles", lab.table_label(tiles))
lab.show(fig)
best = tiles.dropna(subset=["us"]).assign(kind=lambda t: t.arm.str.split(" ").str[:2].str.join(" "))
lab.show(best.groupby(["rows", "projection", "kind"]).us.min().unstack().round(2))

# %% [markdown]
# Only `gate_up` (67 MB in bf16) and `down` (34 MB) are big enough for their bytes to show.
# `qkv` and `o` take 5 to 7 us a launch whatever they read, where their e4m3 bytes alone would take 1 to
# 1.5 us. Summed over a layer at batch 1, the best fp8 path is about 35 us against bf16's 45.
# Across 16 layers that is at most 0.17 ms a step, and the step measured gains less.
#
# At batch 1, inductor's reduction over the widened bytes beats the GEMV alone for every
# projection narrower than gate/up (6.2 us against 7.1 for `qkv`), but a trial that sent those
# projections through it inside the step made fp8's step slower, so the engine keeps the GEMV.
#
# Getting under 0.55 ms needs fewer, larger launches, not fewer bytes: the fixed cost of a
# projection's launch, about 5 us, times the 64 projections of a step is most of what separates
# it from the floor. That is the megakernel's lever, and fp8 would help it.
#
# A line through each GEMV's `o` and `gate_up` launches (the narrowest and widest weight, one
# share of K each) splits a launch into a fixed part and a part per weight.

# %%
gemv_rows = {"bf16, 8 rows": (8, "bf16 gemv (step_config)"), "fp8, 8 rows": (8, "fp8 gemv"),
             "fp8, 1 row": (1, "fp8 gemv")}
fits = []
for name, (rows, arm) in gemv_rows.items():
    t = tiles[(tiles.rows == rows) & tiles.arm.str.startswith(arm) & tiles.arm.str.contains("step_config")]
    t = t.set_index("projection")
    slope = (t.us["gate_up"] - t.us["o"]) / (t.n * t.k).pipe(lambda w: w["gate_up"] - w["o"]) * 1e6
    fits.append({"GEMV": name, "fixed_us": t.us["o"] - slope * t.n["o"] * t.k["o"] / 1e6,
                 "us_per_million_weights": slope})
fits = pd.DataFrame(fits).set_index("GEMV")
lab.show(fits.round(3))
per_weight = fits.us_per_million_weights
print(f"per weight, fp8 at 8 rows takes {per_weight['fp8, 8 rows'] / per_weight['bf16, 8 rows']:.2f}x bf16's time, "
      "where its bytes alone would take 0.5x")

# %% [markdown]
# Past the fixed part, an e4m3 weight costs about seven tenths of a bf16 one, not half. That is
# what a kernel bound by widening, not by reading, would show: on Hopper an e4m3 pair becomes an
# fp16 pair in one convert instruction, but a bf16 pair takes that and two more (fp16 to bf16,
# one each). The GEMV can multiply in fp16 instead (`gemv`'s `dot="mma_f16"`: the weight widened
# by the one convert, each row taken as x / 256 so fp16 holds it, the sum scaled back in fp32),
# or, for one row, add fp32 products without tensor cores (`dot="fma"`). `fp8bench --parts dots`
# times the three over the tiles that led the sweep. No H200 could be started on the day it was
# written, so it ran on an H100 (`FP8_ARGS="--parts dots" scripts/gpu_run.sh fp8`), each dot at
# `step_config`'s tiles:

# %%
dots = lab.measured_table("day65_fp8_dots", "FP8_ARGS=\"--parts dots\" scripts/gpu_run.sh fp8", slug="h100-80gb-hbm3")
chosen = dots[dots.arm.str.contains("step_config")].assign(
    dot=lambda t: t.arm.str.extract(r"(bf16|mma_f16|fma)", expand=False).fillna("mma"))
by_dot = chosen.pivot_table(index=["rows", "projection"], columns="dot", values="us", sort=False)
lab.show(by_dot.round(2))
layer = by_dot.groupby("rows").sum(min_count=1)
lab.show(layer.round(1))
for rows in (1, 8):
    print(f"{rows} row(s): a layer's four fp8 projections take {layer.loc[rows, 'mma_f16']:.1f} us with the fp16 dot "
          f"against {layer.loc[rows, 'mma']:.1f} with the bf16 one "
          f"({layer.loc[rows, 'mma_f16'] / layer.loc[rows, 'mma']:.3f}x)")
wide = chosen[chosen.rows == 8].set_index(["dot", "projection"])
weights = (wide.n * wide.k).xs("mma")
for dot in ("bf16", "mma", "mma_f16"):
    slope = (wide.us[dot, "gate_up"] - wide.us[dot, "o"]) / (weights["gate_up"] - weights["o"]) * 1e6
    print(f"8 rows, {dot}: {slope:.3f} us a million weights past the fixed part")

# %% [markdown]
# *`us` a launch of each layer projection on the H100, 16 launches chained in a graph, at each
# dot's `step_config` tiles; `bf16` is the bf16 weight's GEMV, at 8 rows only (one row runs
# inductor's reduction, in the tiles table above). The second table sums a layer.*
#
# Multiplying in fp16 is faster at every projection and both batch sizes: a layer's projections
# take 0.95x as long at one row and 0.96x at eight. The fp32 products of `fma` lose at these
# tiles. So the engine's step now multiplies bf16 rows in fp16 (`fp8_linear`). On the H100 the
# per-weight cost of e4m3 at 8 rows is already about half of bf16's, as a read-bound kernel's
# would be: its memory is 30% slower than the H200's, and the conversions hide behind it. On the
# H200, where they did not, the fp16 dot should gain more. At about 5% of the projections'
# time, neither card's gain comes near the 0.55 ms aim.
#
# ## What fp8 costs in quality
#
# `fp8bench --parts quality` on SmolLM2, the only real weights here. It measures the perplexity of
# a text shipped in `tests/data/perplexity.txt` from the engine's own prompt logprobs. It also
# measures how many of the first 32 greedy tokens agree with bf16's on the twelve prompts of the
# speculation sets. Two rows are lab variants of the loaded model. One quantizes the LM head too.
# The other runs prompt steps W8A8, as vLLM's dynamic fp8 does: each activation row is quantized
# to e4m3 with its own scale and multiplied on fp8 tensor cores (`torch._scaled_mm`).

# %%
quality = lab.measured_table("day65_fp8_quality", "python -m nanolab fp8bench --parts quality "
                             "--model smollm2-135m --device cpu", slug="cpu")
lab.show(quality[["variant", "text_tokens", "perplexity", "perplexity_change", "prompts", "prompts_agreeing",
                  "mean_agreed_prefix"]].round(4))

# %% [markdown]
# With its layers in fp8, SmolLM2's perplexity moves by 0.43%, inside the 1% gate (here it
# happens to fall). Quantizing the tied head as well costs 1.53%, which is over the gate, so the
# head stays bf16. At Llama-3.2-1B shapes that head is 525 MB of the 1.50 GB an fp8 step reads.
#
# W8A8 prompt steps cost 1.85%, also over the gate. Perplexity here is scored from prompt steps
# alone, so this row is the activations' rounding. The engine's prompt steps therefore keep bf16
# activations: they widen the e4m3 weight to bf16, which holds every e4m3 value exactly, multiply,
# and scale each output channel after, as the GEMV scales its sum.
#
# Greedy text is touchier: five of the twelve prompts keep all 32 tokens, and the average prompt
# agrees for its first 20, the point where two runs part at a near tie and never meet again.
#
# ## The gates
#
# These are asserted on the committed tables and on this run. Each aim that is missed is printed
# as a ratio to its target.

# %%
fp8_rows = quality.set_index("variant")
assert within, "the fp8 round trip left e4m3's bound"
shrink = 0.5 if DTYPE == torch.float32 else 0.7  # 4 or 2 bytes a layer weight down to 1; the embedding stays
assert after < shrink * before, f"fp8 left {after / before:.2f} of the weights' bytes"
assert abs(fp8_rows.loc["fp8 layers", "perplexity_change"]) < 0.01, "fp8 layers moved perplexity over 1%"
one = steps.set_index(["arm", "batch"]).ms_per_step
assert one["fp8", 1] < one["bf16", 1], "fp8 is slower than bf16 at batch 1"
print(f"fp8 at batch 1: {one['fp8', 1]:.3f} ms, {one['fp8', 1] / 0.55:.2f}x the 0.55 ms aim (missed); "
      f"{one['bf16', 1] / one['fp8', 1]:.2f}x bf16 against 1.7x (missed)")
print(f"fp8 at batch 8: {one['bf16', 8] / one['fp8', 8]:.2f}x bf16 against 1.5x (missed)")

# %% [markdown]
# ## What the fp8 GEMV holds (2026-12-06)
#
# Why the fp8 GEMV streams gate/up at about 2.2 TB/s is for a kernel profile to say, but one cause
# can be read without a GPU. `kernelres` has Triton compile the GEMV for sm_90 on a CPU machine, as
# `fp8_linear` launches it at `step_config`'s tiles for each projection, and reads the binary's
# registers a thread and the bytes it spills (the compile used that machine's Triton, 3.9.0, not
# the GPU image's 3.6.0):

# %%
resources = lab.measured_table("day65_gemv_resources", "python -m nanolab kernelres --kernels gemv", slug="cpu",
                               where="any machine with Triton (a compile for sm_90, no GPU needed)")
if resources is not None:
    lab.show(resources.pivot_table(index=["projection", "rows"], columns="num_warps",
                                   values=["registers", "stack_bytes"], sort=False))

# %% [markdown]
# At the engine's 4 warps, the qkv, o and gate/up GEMVs hold 255 registers a thread, the most a
# thread may have, and spill 32 to 56 bytes to the stack; `down`, in four shares of narrower
# tiles, does not. At 8 warps each thread holds half the tile and none spills. Day 65's sweep of
# the fp8 tiles (`day65_fp8_tiles_h200`) ran every tile at 4 warps.
#
# An H100 timed both on 2026-12-06: each projection alone at the engine's tiles at 4 and 8
# warps (`FP8_ARGS="--parts dots --prefix day65f" scripts/gpu_run.sh fp8`), then the whole step
# twice, in two processes, each beside its own bf16 arm: once as the engine runs it, once with
# `step_config` returning `num_warps=8` when `element_size == 1` (a one-line change, applied on
# the GPU machine for that run and not kept).

# %%
warps = lab.measured_table("day65f_fp8_dots", 'FP8_ARGS="--parts dots --prefix day65f" scripts/gpu_run.sh fp8',
                           slug="h100-80gb-hbm3")
engine_tiles = warps[warps.arm.str.contains(r"\(step_config\)|warps 8")].assign(
    dot=lambda t: t.arm.str.extract(r"(mma_f16|fma)", expand=False).fillna("mma"),
    warps=lambda t: t.arm.str.contains("warps 8").map({True: 8, False: 4}))
engine_tiles = engine_tiles[engine_tiles.arm.str.startswith("fp8")]
by_warps = engine_tiles.pivot_table(index=["rows", "projection"], columns=["dot", "warps"], values="us", sort=False)
lab.show(by_warps.round(2))
f16 = by_warps["mma_f16"]
print(f"the engine's dot (mma_f16): 8 warps take {(f16[8] / f16[4]).min():.2f}x to {(f16[8] / f16[4]).max():.2f}x "
      "the time of 4, projection by projection")
step_runs = {}
for w, stem in ((4, "day65f_fp8_steps"), (8, "day65f8w_fp8_steps")):
    t = lab.measured_table(stem, "scripts/gpu_run.sh fp8 (8 warps: step_config patched on the GPU machine)",
                           slug="h100-80gb-hbm3")
    step_runs[w] = t.pivot_table(index="batch", columns="arm", values="ms_per_step")
warp_steps = pd.concat(step_runs, axis=1, names=["fp8 warps"])
lab.show(warp_steps.round(3))
for batch in (1, 8):
    four, eight = step_runs[4].loc[batch], step_runs[8].loc[batch]
    print(f"batch {batch}: fp8 at 8 warps {eight.fp8:.3f} ms against {four.fp8:.3f} at 4 "
          f"({eight.fp8 / four.fp8:.2f}x); at 4, fp8 is {four.bf16 / four.fp8:.2f}x bf16 in its process")

# %% [markdown]
# *`us` a launch of each layer projection at the engine's tiles, on the H100, by dot and warps
# (`fma` only at one row), then ms a step with bf16 and fp8 weights, a column pair for each of
# the two processes.*
#
# Whatever the spill costs, 8 warps cost more. On the engine's fp16 dot, 8 warps are slower for
# every projection at both batch sizes, most of all for `down`, which did not spill at 4. The
# whole step went from 1.08 to 1.23 ms at batch 1 and from 1.12 to 1.27 ms at batch 8. Only
# `fma` at one row gained from 8 warps, and it still lost to the fp16 dot at 4. So the engine
# keeps 4 warps.
#
# The same run also timed the step on the H100 as the engine now runs it, fp16 dot included.
# There fp8 is 1.07x bf16 at batch 1 and 1.19x at batch 8, against aims of 1.7x and 1.5x on the
# H200. These H100 numbers are not comparable with the H200 table at the top of this chapter, and
# no H200 has yet run the step with today's code.
#
# %% [markdown]
# ## Summary
#
# - FP8 weights work end to end: every decoder layer in e4m3, a scale per channel, SmolLM2's
#   perplexity moved 0.43% (the head and W8A8 prompt steps would cost 1.53% and 1.85%).
# - A step's bytes fall from 2.47 to 1.50 GB, which bought 1.03x at both batches on the H200: the
#   small projections take 5 to 7 us whatever they read, and the fp8 GEMV streams gate/up at
#   about 2.2 TB/s. The aims, 0.55 ms at batch 1 and 1.5x at batch 8, are missed.
# - The profile found a bf16 loss, SwiGLU recomputed inside `down`'s reduction; writing it once
#   took bf16 at batch 1 to 1.093 ms.
# - The fp8 GEMV now multiplies bf16 rows on fp16 tensor cores, one conversion a weight pair
#   instead of three: 0.95x and 0.96x a layer's projection time at batches 1 and 8 on an H100.
#   The step has not been timed with it on the H200.
# - An fp8 prompt step widens every layer's weight before its matmul, about 7.5 ms at 128 tokens
#   on the H200, paid again by every chunk.
# - Compiled for sm_90 without a GPU (2026-12-06), the fp8 GEMV spills at the engine's 4 warps for
#   qkv, o and gate/up, and not at 8. Timed on an H100 the same day, 8 warps were slower for every
#   projection, and the step slowed from 1.08 to 1.23 ms at batch 1, so the engine keeps 4. On that
#   H100 the step with fp8 weights was 1.07x bf16 at batch 1 and 1.19x at batch 8.
# - Not yet built: a step of fewer, larger launches, where fp8's fewer bytes would show. A prompt
#   step that reads the e4m3 bytes itself was written the same day as a lab candidate;
#   {doc}`Day 65d <65d_prompt_bytes>` timed it on a GPU and moved it into the engine.
