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
#   Longer steps read the weight back into the activations' dtype and multiply.
# - **Speculative decoding** (`speculative_config`, method `ngram`). Each decoding row gets up to
#   k draft tokens by prompt lookup: the tokens that followed the latest earlier occurrence of the
#   row's last few tokens. One forward over the row's pending token and its drafts scores them
#   all. Greedy rows keep the drafts the model would have chosen anyway, and sampled rows keep
#   them by rejection sampling, which leaves the output distribution the model's own. Either way
#   the row gets one more token from the model, and the blocks past what it kept go back.

# %%
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
# FP8 cuts what a step must read from 2.47 GB to 1.50 GB. The floor falls from 0.60 to 0.36 ms.
# The measured step fell far less. At batch 1 it went from 1.154 to 1.022 ms, 1.13x. The aim was
# 1.7x and at most 0.55 ms, and the result is 1.86x that time. At batch 8 fp8 was no faster
# (0.98x, aim 1.5x).
#
# Two things in this table say the step is no longer bound by its weight bytes.
#
# - The bf16 arm took 1.154 ms a step. Day 61's floorbench measured 0.927 ms on the same shapes,
#   with one engine in the process.
# - Both arms sit near 1.0 to 1.1 ms at both batches. Bytes decide the difference between them,
#   and that difference is small.
#
# Something that does not scale with the bytes now sets the pace, either the host loop or fixed
# GPU work in each step. Until that is found, fp8's saving cannot show. This is the next thing to
# measure. Nothing here shows the fp8 GEMV itself at its floor either, because it has not been
# timed alone.
#
# ## What fp8 costs in quality
#
# `fp8bench --parts quality` on SmolLM2, the only real weights here. It measures the perplexity of
# a text shipped in `tests/data/perplexity.txt` from the engine's own prompt logprobs. It also
# measures how many of the first 32 greedy tokens agree with bf16's on the twelve prompts of the
# speculation sets. The third row quantizes the LM head too, as a lab variant of the loaded
# model.

# %%
quality = lab.measured_table("day65_fp8_quality", "python -m nanolab fp8bench --parts quality "
                             "--model smollm2-135m --device cpu", slug="cpu")
lab.show(quality[["variant", "text_tokens", "perplexity", "perplexity_change", "prompts", "prompts_agreeing",
                  "mean_agreed_prefix"]].round(4))

# %% [markdown]
# With its layers in fp8, SmolLM2 loses 0.14% in perplexity, inside the 1% gate. Quantizing the
# tied head as well costs 1.57%, which is over the gate. So the head stays bf16. At Llama-3.2-1B
# shapes that head is 525 MB of the 1.50 GB an fp8 step reads.
#
# Greedy text is touchier than perplexity. Five of the twelve prompts keep all 32 tokens, and the
# average prompt agrees for its first 20. Once two greedy runs part at a near tie they do not
# meet again, so the agreement number is better read as where they part.
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
# About 40% of the drafts are kept, and a verify step yields 2.5 to 2.7 tokens. On this CPU the
# step costs about what one token's step costs, so per-token latency falls 1.6 to 1.7x. The aim
# is 1.8x on the code-editing set on the H200, and no H200 table is committed yet.
#
# ## What a verify step costs on the H200
#
# A verify step is a varlen step of k + 1 tokens a row with logits at each of them. Since today it
# replays a varlen graph whenever those logits fit the graph's rows. Eager, it would pay
# Python's launch cost on every layer. `specbench --parts verify` (`scripts/gpu_run.sh verify`)
# times a decode step and a verify step of 4 drafts a row at the runner, each planned, run and
# its argmax read back, on the same rows, alternating.

# %%
verify = lab.measured_table("day65_spec_verify", "scripts/gpu_run.sh verify")
lab.show(verify[["batch", "k", "verify_tokens", "decode_ms", "verify_ms", "verify_over_decode", "decode_graphed",
                 "verify_graphed"]].round(3))
for r in verify.itertuples():
    print(f"batch {r.batch}: verify {r.verify_over_decode:.2f}x a decode step, "
          f"{r.verify_over_decode / 1.2:.2f} of the 1.2x allowed")

# %% [markdown]
# A verify step of 5 tokens a row costs 1.23x a decode step at batch 1 and 1.25x at batch 8,
# just over the 1.2x allowed. That is the synchronous cost, with nothing overlapped. The engine's
# plain decode steps overlap the host's next step with the GPU's current one (asynchronous
# scheduling). A speculative step cannot do that yet, because its next drafts depend on what this
# step keeps. Against an overlapped decode step the gap is wider. Both runner times are also well
# above the step time floorbench measures, which again points at the host.
#
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
where = lab.switch_off_batch(batches)
print("speculation pays at every batch measured" if where is None else f"speculation stops paying at batch {where}")

# %% [markdown]
# On this CPU speculation's gain falls as the batch grows: 1.60x at batch 1, 1.08x at batch 8.
# A step's cost grows with the tokens it carries, and a verify step carries up to five times a
# decode step's. The crossing lies just past 8 rows, which is where the engine's default
# switch-off point, `speculative_config.max_num_seqs`, stands. The H200's own point is not yet
# measured.
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
assert fp8_rows.loc["fp8 layers", "perplexity_change"] < 0.01, "fp8 layers cost over 1% in perplexity"
assert off["token_ids"] == on["token_ids"], "speculation changed a greedy token"
assert on["steps"] < off["steps"] and on["accepted_tokens"] > 0, "no draft was kept"
assert summary.outputs_equal_off.all(), "a speculative output differs from plain greedy"
assert verify.verify_graphed.all() and verify.decode_graphed.all(), "a step ran eagerly"
one = steps.set_index(["arm", "batch"]).ms_per_step
assert one["fp8", 1] < one["bf16", 1], "fp8 is slower than bf16 at batch 1"
print(f"fp8 at batch 1: {one['fp8', 1]:.3f} ms, {one['fp8', 1] / 0.55:.2f}x the 0.55 ms aim (missed); "
      f"{one['bf16', 1] / one['fp8', 1]:.2f}x bf16 against 1.7x (missed)")
print(f"fp8 at batch 8: {one['bf16', 8] / one['fp8', 8]:.2f}x bf16 against 1.5x (missed)")
print(f"verify at k = 4: {verify.verify_over_decode.max():.2f}x a decode step against 1.2x (missed)")

# %% [markdown]
# ## Summary
#
# - FP8 weights work end to end. Every decoder layer is e4m3 with a scale per channel. SmolLM2
#   loses 0.14% in perplexity, while an fp8 head would cost 1.57%, so the head stays bf16.
#   At Llama-3.2-1B shapes a step's bytes fall from 2.47 to 1.50 GB.
# - On the H200 that bought 1.13x at batch 1 and nothing at batch 8. Both arms stay near 1 ms, far
#   above their floors, so something besides the bytes sets the pace. The bf16 arm was also slower
#   than Day 61's 0.93 ms. Finding that comes first.
# - Prompt lookup keeps about 40% of its drafts on real text and gives the same greedy tokens.
#   A verify step now replays a varlen graph and costs 1.23 to 1.25x a decode step, synchronously.
# - Not yet measured or built: speculation on SmolLM2 on the H200, speculation under graphbench's
#   load, and tensor parallelism with speculation.
