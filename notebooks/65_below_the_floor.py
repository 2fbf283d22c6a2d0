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
# This chapter tries both and asks how far below the bf16 floor each takes a step.
#
# - **FP8 weights** (`quantization="fp8"`). Every decoder layer's projections are held as e4m3,
#   with one fp32 scale per output channel, quantized from the checkpoint at load. A decode step's
#   projections read one byte a weight and scale in registers (the GEMV of Day 60, taught e4m3).
#   Longer steps widen the weight to the activations' dtype, which holds every e4m3 value exactly,
#   multiply, and scale each output channel after.
# - **Speculative decoding** (`speculative_config`, method `ngram`). Each decoding row gets up to
#   k draft tokens by prompt lookup: the tokens that followed the latest earlier occurrence of the
#   row's last few tokens. One forward over the row's pending token and its drafts scores them
#   all. Greedy rows keep the drafts the model would have chosen anyway, and sampled rows keep
#   them by rejection sampling, which leaves the output distribution the model's own. Either way
#   the row gets one more token from the model, and the blocks past what it kept go back.

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
# ## Speculation on real text, on this machine
#
# One of the code-editing prompts, greedy, 40 tokens: once without speculation and once with
# k = 4 drafts a step.

# %%
code_edit = lab.load_prompt_set("code_edit")[0]
spec_runs = {}
for k in (None, 4):
    spec = None if k is None else {"num_speculative_tokens": k}
    run = LLM(str(path), device=str(DEVICE), dtype=DTYPE, speculative_config=spec, enable_prefix_caching=False)
    spec_runs[k] = lab.run_prompt(run, code_edit, max_tokens=40)
    run.close()
off, on = spec_runs[None], spec_runs[4]
print(f"off: {off['output_tokens']} tokens in {off['steps']} steps; on: {on['output_tokens']} tokens in "
      f"{on['steps']} steps, {on['verify_steps']} of them verify steps keeping {on['accepted_tokens']} of "
      f"{on['draft_tokens']} drafts")
print("the same tokens:", off["token_ids"] == on["token_ids"])

# %% [markdown]
# The same tokens come out in fewer steps. The unit tests hold speculation to more than the same
# tokens.
#
# - Every emitted token's logits match a one-shot forward to 1e-4 on the sharp models, eagerly
#   and through the padded step a varlen graph replays.
# - Rejection sampling's output distribution equals the target's (a chi-square test over 20,000
#   seeded trials).
# - The pool's accounting holds under random rejections (hypothesis).
#
# `python -m nanolab specbench` runs both prompt sets, six prompts each, with speculation off and
# on, one prompt at a time. The table is from this project's 2-core CPU, with SmolLM2 in fp32.

# %%
summary = lab.measured_table("day65_spec_summary", "python -m nanolab specbench --device cpu", slug="cpu")
lab.show(summary[["set", "arm", "output_tokens", "ms_per_token", "acceptance_rate", "tokens_per_verify_step",
                  "speedup_over_off", "outputs_equal_off"]].round(3))

# %% [markdown]
# On this CPU 47% of the drafts are kept, and a verify step yields about 2.9 tokens. A verify
# step takes 53 ms against a decode step's 44, so per-token latency falls 1.5 to 1.6x. Before the
# engine paused a request's drafts after a verify step that kept none (the switch-off rules
# under load, below), 40% were kept and latency fell 1.6 to 1.7x. Here a verify step that keeps
# nothing costs only a fifth of a step more, so a pause forgoes more than it saves.
#
# The same bench on the H200 (`scripts/gpu_run.sh smollm2 smolspec smolfp32`, after two calls carry
# the GGUF there in two pieces), in bf16 and in fp32. The bf16 run also gives each prompt's median
# step by kind (overlapped, a step's wall time is its host's; the steps add up to the request's
# time either way):

# %%
on_gpu = {dtype: lab.measured_table(stem, f"scripts/gpu_run.sh {part}") for dtype, stem, part in
          (("bf16", "day65_spec_summary", "smolspec"), ("fp32", "day65fp32_spec_summary", "smolfp32"))}
both = pd.concat([t.assign(dtype=d) for d, t in on_gpu.items()], ignore_index=True)
lab.show(both.reindex(columns=["dtype", "set", "arm", "ms_per_token", "acceptance_rate", "tokens_per_verify_step",
                               "speedup_over_off", "outputs_equal_off", "decode_step_ms", "verify_step_ms"]).round(3))
BEST = "ngram k=8 min_n=2"  # the best of the three lookup settings measured on code editing
code_bf16 = on_gpu["bf16"].set_index(["set", "arm"]).loc[("code_edit", BEST)]
print(f"code editing, bf16, {BEST}: {code_bf16.speedup_over_off:.2f}x lower latency, "
      f"{code_bf16.speedup_over_off / 1.8:.2f} of the 1.8x aim; outputs equal off's: {code_bf16.outputs_equal_off}")

# %% [markdown]
# The bf16 rows are three lookup settings measured together on 2026-12-05: k = 4 (the default),
# k = 8 over matches of two tokens or more, and k = 16 over three. On code editing they lower
# per-token latency 1.33x, 1.60x and 1.55x; on summaries 1.26x, 1.49x and 1.38x. The aim is 1.8x on
# code editing, and the best setting reaches 0.89 of it. The first H200 run, with k = 4 alone,
# gave 1.05x: its steps without drafts ran synchronously, at 0.98 ms. Since a request whose lookup
# finds nothing pauses its drafts, such a step runs overlapped, at 0.56 to 0.61 ms against off's
# 0.62. A verify step still takes 1.15 to 1.38 ms and runs synchronously, since the next drafts
# need its accepted tokens on the host. This model is far from its bytes: 270 MB in bf16 take
# under 0.1 ms to read, so a step pays for its launches and host work.
#
# At temperature 0 a verify step keeps exactly the drafts that match plain greedy's output, so
# that output alone fixes the steps any lookup setting takes (`replay_lookup`; a test holds it to
# the engine's own counts). `lookup_settings` prices them with the best arm's medians: a verify
# step at 1.17 ms whatever its k, and a plain step overlapped, at off's 0.62 ms.

# %%
from nanolab.model.tokenizer import Tokenizer
from nanolab.model.weights import resolve_weights

runs = lab.measured_table("day65_spec", "scripts/gpu_run.sh smolspec")
smol = Tokenizer.from_dir(resolve_weights("smollm2-135m"))
settings = lab.lookup_settings(runs, {name: [smol.encode_chat(m) for m in lab.load_prompt_set(name)]
                                      for name in runs.set.unique()}, arm=BEST)
lab.show(settings.pivot_table(index=["set", "k"], columns="min_n", values="speedup_overlapped", sort=False).round(2))
priced = settings.set_index(["set", "k", "min_n"])
print(f"k = 8, min_n = 2 on code editing: predicted {priced.loc[('code_edit', 8, 2), 'speedup_overlapped']:.2f}x, "
      f"measured {code_bf16.speedup_over_off:.2f}x")

# %% [markdown]
# *Predicted speedup over off, every plain step overlapped, by set, k (rows) and the shortest
# match `prompt_lookup_min` (columns).*
#
# The replay predicted the run before it was made: from the first run's steps it gave 1.45x for
# k = 8 over two tokens and 1.66x for k = 16 over three. Priced with today's steps it gives 1.61x
# for the first, against 1.60x measured. Its best setting, k = 16 over two tokens, gives 1.75x:
# short of 1.8x, since a 17-token verify step costs 1.35 ms. At these step costs no lookup setting
# reaches the aim; the verify step itself has to overlap with the host's work, as plain steps do.
# Its kernels take 0.86 ms at batch 1 against 1.17 ms of wall time (`day65smollm2_spec_verify*`).
# Larger k also costs under load: 8 rows of 9 tokens outgrow a decode step's 64 rows. The default
# stays at k = 4 until a load run measures another.
#
# One code-editing output at k = 16 differs from plain greedy: a verify step of several rows
# multiplies through the GEMV, a batch-1 decode step through inductor's tuned reduction, and at a
# near tie their bf16 rounding can flip the argmax. At k = 8 and in fp32 every output matches. The
# fp32 rows predate this chapter's verify-step changes; the next section finds the cause of their
# 14 ms verify steps.
#
# ## What a verify step costs on the H200
#
# A verify step feeds each row its pending token and k drafts, and needs logits at every one.
# `specbench --parts verify` (`scripts/gpu_run.sh verify`) times a decode step and a verify step
# of 4 drafts a row at the runner, at Llama-3.2-1B shapes over 128-token rows. Each step is planned,
# run and its argmax read back, on the same rows, alternating, and both steps' kernels are
# profiled.
#
# A verify step used to run as a varlen step (a segment of k + 1 tokens a row), through a varlen
# graph of the compiled model. Its attention read was most of what it cost over a decode step:
# 278 us at batch 1 and 664 at batch 8, against the decode step's 96 and 103. `varlenbench`
# (`--cases verify,50 --no-sweep`) timed that read alone and in the layouts a captured step hands
# it, beside the engine's decode read given one decode row per token, each token's context ending
# at its own position:

# %%
reads = pd.concat([lab.measured_table(f"day65{run}_{d}_varlen_sweep", "python -m nanolab varlenbench --cases "
                                      f"verify,50 --no-sweep --dtype {d} --prefix day65{run}_{d}").assign(dtype=d)
                   for run, d in (("readbefore", "bfloat16"), ("read", "float32"))], ignore_index=True)
lab.show(reads.pivot_table(index=["dtype", "case"], columns=["read", "layout"], values="us", sort=False).round(1))

# %% [markdown]
# For 8 rows of 5 tokens over 256 keys, the decode read takes 15 us and the varlen read 23 us
# alone and 50 in the step's layout. Each token rereads its row's keys, but from L2 after the
# first. Neither the pool's size nor the step's share count explains the layout's doubling; its
# flat grid does, with a slot for every segment that could hold a token: 2,688 programs over the
# KV heads and shares, against 768 alone. Chapter 64 works the same for a prompt step; since the
# grid's fix the step's layout reads this case in 35 us (`day65read_bfloat16_varlen_sweep`). In
# fp32 the varlen read is a disaster, 718 to 1,770 us, against 86 to 398 for the decode read.
# That is where the fp32 verify steps' 14 ms went.
#
# So a verify step is now a decode step (`ModelRunner.verify`): `plan_decode` gives each fed token
# a batch row of its own over its row's table entry, with its own write slot and position. The
# forward writes every row's K/V before it reads, so a later draft sees the earlier ones. The step
# replays the decode graph of the smallest bucket holding its tokens; more tokens than the cache
# has rows fall back to the varlen step. On the sharp models every emitted token's logits match a
# one-shot forward to 1e-4 through every path (shifting the fed positions by one fails it), and a
# CUDA test checks that the verify steps replay decode graphs.

# %%
verify = lab.measured_table("day65_spec_verify", "scripts/gpu_run.sh verify")
lab.show(verify[["batch", "k", "verify_tokens", "decode_ms", "verify_ms", "verify_over_decode", "decode_graphed",
                 "verify_graphed"]].round(3))
for r in verify.itertuples():
    print(f"batch {r.batch}: verify {r.verify_over_decode:.2f}x a decode step, "
          f"{r.verify_over_decode / 1.2:.2f} of the 1.2x allowed")

# %% [markdown]
# A verify step of 5 tokens a row now costs 0.96x a decode step at batch 1 and 1.18x at batch 8,
# inside the 1.2x allowed. The batch-1 figure flatters it: this run's batch-1 decode step came out
# of inductor's tuning slow (kernels 1,202 us, projections 1,012, against the run before's 990
# and 799: Day 61's tuning spread). Against the faster compile, the verify step's 1,081 us of
# kernels is 1.09x. At batch 8 the 40 fed tokens pad to the 64-row bucket, and the read is 195 us
# against the decode step's 103. The kernel tables, the morning's run on the old path beside this:

# %%
kernels = pd.concat([lab.measured_table(stem, "scripts/gpu_run.sh verify").assign(run=run)
                     for run, stem in (("morning", "day65before_spec_verify_kernels"),
                                       ("varlen, fixed", "day65varlen_spec_verify_kernels"),
                                       ("decode path", "day65_spec_verify_kernels"))], ignore_index=True)
fig = lab.plot_verify_kernels(kernels)
if ON_GPU or not lab.figure_path("day65_verify_kernels", "h200").exists():
    lab.save_figure(fig, "day65_verify_kernels", lab.table_label(kernels))
lab.show(fig)
lab.show(kernels.pivot_table(index=["batch", "arm", "run"], columns="class", values="us_per_step", aggfunc="sum",
                             sort=False).fillna(0).round(0))

# %% [markdown]
# *GPU kernels a step by class at Llama-3.2-1B shapes, a decode step beside a verify step of 4
# drafts a row, in three runs: the morning's, with verify as a varlen step; a varlen step again
# after the varlen path's two fixes below ("varlen, fixed", `day65varlen_spec_verify`, 1.27x and
# 1.44x a decode step); and verify as a decode step. The attention read is what shrank.*

# %% [markdown]
# Between the morning's run and the "varlen, fixed" one, two changes to the varlen path, which
# still serves prompt steps. The read's grid had launched programs for all 64 of a captured
# step's segments, most of them empty; the grid now stops at the step's tokens, which a test
# counts. And the varlen graphs had captured the model eagerly, a dozen small kernels a layer;
# with compilation on they now capture the compiled model, its token count symbolic, which a CPU
# test checks against the eager step within 1e-4 in one graph. They took the verify step's
# kernels from 1,948 to 1,354 us at batch 1; the decode path takes them to 1,081.
#
# ## Under load
#
# `scripts/gpu_run.sh specload` runs graphbench's random workload against two servers, speculation
# off and on, at 4, 16 and 32 requests a second. The weights are random, so prompt lookup's drafts
# are almost never kept, and the run measures what speculation costs when it does not pay. The aim
# is that it never makes ITL p50 worse at 32 req/s.

# %%
load = lab.measured_table("day65specload_graphbench", "scripts/gpu_run.sh specload")
lab.show(load[["arm", "rate", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "ttft_p50_ms", "median_rows",
               "verify_steps", "draft_tokens", "accepted_tokens", "output_throughput"]].round(2))
fig = lab.plot_graphbench(load)
if ON_GPU or not lab.figure_path("day65specload_graphbench", "h200").exists():
    lab.save_figure(fig, "day65specload_graphbench", lab.table_label(load))
lab.show(fig)
itl = load.set_index(["arm", "rate"]).itl_p50_ms
print(f"at 32 req/s, speculating over plain ITL p50: {itl['fullgraphs+ngram', 32.0] / itl['fullgraphs', 32.0]:.3f}x "
      "(aim: at most 1)")

# %% [markdown]
# The first run, with no switch-off rule, made ITL p50 1.57x to 1.70x worse at every rate: every
# step could carry drafts, so every step ran synchronously. Three rules came next, one at a time,
# each measured under the same load the same day, and a fourth later (`day65specload_rules`):
#
# 1. A request whose verify step kept none of its drafts gets none for the next step, then for
#    twice as many steps after each such verify step in a row, up to
#    `speculative_config.max_draft_backoff` (32 by default). A verify step that keeps one ends the
#    pause. Steps that can carry no drafts overlap again.
# 2. A lookup that finds no match is a miss too, and pauses the request the same way. After rule
#    1 alone, lookups that found nothing still made their steps synchronous.
# 3. A pause of b steps ends on a step numbered a multiple of b. Requests paused for as long
#    then look up on the same steps, not each on its own.
#
# The rules back off rather than switch a request off for good: a first version that did lost
# the code-editing prompt all its speculation, as the model writes prose before it copies code.

# %%
rules = lab.measured_table("day65specload_rules", "scripts/gpu_run.sh specload, once per rule set")
fig = lab.plot_specload_rules(rules)
if not lab.figure_path("day65specload_rules", "h200").exists():
    lab.save_figure(fig, "day65specload_rules", lab.table_label(rules))
lab.show(fig)
by_run = rules.pivot_table(index=["run", "rules", "rate"], columns="arm", values="itl_p50_ms")
lab.show((by_run["fullgraphs+ngram"] / by_run["fullgraphs"]).unstack("rate").round(2))

# %% [markdown]
# *ITL p50 of the speculating server over the plain one's at each offered rate, in the five runs.*
#
# With all three rules the speculating server is 1.00x plain at 4 req/s, 1.05x at 16 and 1.04x at
# 32. The aim is still missed, by 0.05 ms. At 32 req/s only 16 verify steps ran, so the rest of
# the cost is synchronous steps whose lookup found nothing. New requests arrive about every 25
# steps, and each one looks up at its first steps, before any pause has grown.
#
# A fourth change followed: whether a step runs synchronously is decided by a lookup over the
# tokens each request already has, one behind while a step is in flight. A match makes the step
# synchronous, and it looks up again; no match pauses the request and the step overlaps. A test
# holds it (a request that never matches leaves every decode step in flight). Under the same load
# (run 4, the table above the rules) the speculating server is 0.99x plain at 4 req/s, 1.00x at 16
# and 1.003x at 32, where no verify step ran: both servers ran the same steps, 1.15 ms apart by
# 0.004 ms, inside the spread between two servers. The aim is missed by 0.3% at 32 req/s.
#
# The tests feed one request only wrong drafts, another only right ones, and a third no match at
# all: each pause ends at a multiple of its length, the right one keeps speculating, and the
# tokens stay plain greedy's. Removing any rule or the alignment fails them.

# %% [markdown]
# ## Against batch size
#
# `specbench --parts batches`: the sets' prompts, cycled to the batch, all sent at once. The
# speculating arm never switches off here, so the table shows where verifying stops paying.

# %%
batches = lab.measured_table("day65_spec_batches", "python -m nanolab specbench --parts batches --device cpu",
                             slug="cpu")
fig = lab.plot_spec_batches(batches)
if not lab.figure_path("day65_spec_batches", "cpu").exists():
    lab.save_figure(fig, "day65_spec_batches", lab.table_label(batches))
lab.show(fig)
lab.show(batches[["arm", "batch", "tokens_per_s", "verify_steps", "accepted_tokens", "speedup_over_off"]].round(2))
for slug, table in (("cpu", batches), ("h200", lab.load_table("day65_spec_batches", "h200"))):
    where = None if table is None else lab.switch_off_batch(table)
    print(f"{slug}: " + ("no stop measured" if where is None else f"speculation stops paying at batch {where}"))

# %% [markdown]
# On this CPU speculation's gain falls as the batch grows: 1.58x at batch 1, 1.03x at batch 8.
# A step's cost grows with the tokens it carries, and a verify step carries up to five times a
# decode step's. The crossing lies just past 8 rows, which is where the engine's default
# switch-off point, `speculative_config.max_num_seqs`, stands. On the H200 (`day65_spec_batches`,
# SmolLM2 in bf16, k = 4) the gain peaks at 1.35x at batch 2 and is 0.88x at batch 8: the crossing
# lies between 4 and 8 rows, under the default. It stays 8 until a load on real text measures it.
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
assert off["token_ids"] == on["token_ids"], "speculation changed a greedy token"
assert on["steps"] < off["steps"] and on["accepted_tokens"] > 0, "no draft was kept"
assert summary.outputs_equal_off.all(), "a speculative output differs from plain greedy"
assert verify.verify_graphed.all() and verify.decode_graphed.all(), "a step ran eagerly"
one = steps.set_index(["arm", "batch"]).ms_per_step
assert one["fp8", 1] < one["bf16", 1], "fp8 is slower than bf16 at batch 1"
print(f"fp8 at batch 1: {one['fp8', 1]:.3f} ms, {one['fp8', 1] / 0.55:.2f}x the 0.55 ms aim (missed); "
      f"{one['bf16', 1] / one['fp8', 1]:.2f}x bf16 against 1.7x (missed)")
print(f"fp8 at batch 8: {one['bf16', 8] / one['fp8', 8]:.2f}x bf16 against 1.5x (missed)")
worst = verify.verify_over_decode.max()
print(f"verify at k = 4: {worst:.2f}x a decode step at worst against 1.2x ({'met' if worst <= 1.2 else 'missed'})")
under_load = itl["fullgraphs+ngram", 32.0] / itl["fullgraphs", 32.0]
print(f"under load at 32 req/s: ITL p50 {under_load:.3f}x plain's against at most 1x "
      f"({'met' if under_load <= 1 else 'missed'})")
print(f"SmolLM2 on the H200, code editing: {code_bf16.speedup_over_off:.2f}x against 1.8x (missed); outputs equal "
      f"off's in bf16: {bool(on_gpu['bf16'].outputs_equal_off.all())}, in fp32: "
      f"{bool(on_gpu['fp32'].outputs_equal_off.all())}")
assert on_gpu["fp32"].outputs_equal_off.all(), "speculation changed a greedy token in fp32 on the H200"

# %% [markdown]
# ## Summary
#
# - FP8 weights work end to end: every decoder layer in e4m3, a scale per channel, SmolLM2's
#   perplexity moved 0.43% (the head and W8A8 prompt steps would cost 1.53% and 1.85%). A step's
#   bytes fall from 2.47 to 1.50 GB, which bought 1.03x at both batches on the H200: the small
#   projections take 5 to 7 us whatever they read. The profile found a bf16 loss, SwiGLU
#   recomputed inside `down`'s reduction; writing it once took bf16 at batch 1 to 1.093 ms.
# - Prompt lookup keeps 39 to 68% of its drafts on real text. On SmolLM2 on the H200, k = 8 over
#   matches of two tokens lowers code editing's latency 1.60x (0.89 of the 1.8x aim), as the
#   replay of plain greedy's output predicted; no setting reaches 1.8x while verify steps block.
# - A verify step is now a decode step of a batch row per fed token: 0.96x and 1.18x a decode
#   step at batches 1 and 8 (1.2x allowed). The varlen read it replaced was 3x slower in bf16 and
#   9.5x in fp32 in a captured step's layout.
# - Under load on random weights, four switch-off rules took speculation's ITL p50 at 32 req/s
#   from 1.66x plain's to 1.003x, a step without a match overlapping as a plain one does.
# - Not yet built: overlapped verify steps, and a varlen read that fp32 does not cripple.
