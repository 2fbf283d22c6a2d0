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
# # Day 65: speculative decoding
#
# The {doc}`first half of Day 65 <65_below_the_floor>` read fewer bytes a step. This half runs the
# big model fewer times per token, as gpt-fast's draft model and vLLM's prompt lookup do, and asks
# how far that takes the time a token costs below what one decode step costs.
#
# **Speculative decoding** (`speculative_config`, method `ngram`). Each decoding row gets up to k
# draft tokens by prompt lookup: the tokens that followed the latest earlier occurrence of the
# row's last few tokens. Each request keeps where every token id occurs in it (`TokenIndex`), so a
# lookup tries only the earlier places of the row's last token and never walks the whole context.
# One forward over the row's pending token and its drafts scores them all.
# Greedy rows keep the drafts the model would have chosen anyway, and sampled rows keep them by
# rejection sampling, which leaves the output distribution the model's own. Either way the row
# gets one more token from the model, and the blocks past what it kept go back.

# %%
import pandas as pd

import nanolab.lab as lab
from nanolab import LLM

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
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
#    1 alone, lookups that found nothing still made their steps synchronous. (Chained steps,
#    below, never block, and have since dropped this rule.)
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
# ## Verify steps that overlap
#
# A verify step has run synchronously: the next step's drafts are looked up over its tokens, so
# the host waits for them, and the GPU waits for the host. On SmolLM2 that is 1.17 ms of wall time
# for 0.86 ms of kernels. Since these runs, greedy rows chain their steps under asynchronous
# scheduling (`Engine`'s chained speculation), as plain steps overlap:
#
# - the next step is launched before the one in flight is read back, its drafts looked up as if
#   that step kept all of its own, its tables grown so;
# - its first token per row is the in-flight step's last, taken on the device, and the device
#   moves its positions, context lengths and write slots back by what that step did not keep;
# - acceptance runs on the device, and a step reads back only each row's kept drafts and last
#   token.
#
# It pays in two ways. Drafts proposed on a premise that fails (the step in flight kept fewer than
# all, or added another token than the lookup guessed) are fed and almost surely lost. And the
# lookup runs a step behind: its first token is a guess at what the step in flight adds, so fewer
# tokens are left to draft. On the sharp models every emitted token's logits match a one-shot
# forward to 1e-4, and moving no position back, feeding the host's guess as the first token,
# keeping one draft too many or cutting a table back too far each fail a test.
#
# `replay_chained` counts the steps chained speculation takes to emit plain greedy's outputs (a
# test holds it to the engine's own counts), and `chained_settings` prices them with every step at
# its kernels' time on the H200 (`day65smollm2_spec_verify_kernels`, batch 1, k = 4): steps that
# chain leave the GPU no gap.

# %%
kernels = lab.measured_table("day65smollm2_spec_verify_kernels", "scripts/gpu_run.sh smolspec")
step_us = kernels[kernels.batch == 1].groupby("arm").us_per_step.sum()
chained = lab.chained_settings(runs, {name: [smol.encode_chat(m) for m in lab.load_prompt_set(name)]
                                      for name in runs.set.unique()},
                               plain_ms=step_us["decode"] / 1e3, verify_ms=step_us["verify"] / 1e3)
lab.show(chained.drop(columns=["tokens", "plain_step_ms", "verify_step_ms"]).round(2))
best = chained.set_index(["set", "k", "min_n"]).speedup_chained
print(f"kernels a step: decode {step_us['decode']:.0f} us, verify {step_us['verify']:.0f} us; predicted on "
      f"code editing: {best['code_edit', 16, 2]:.2f}x at k = 16 and {best['code_edit', 32, 2]:.2f}x at k = 32, "
      "over matches of two tokens or more")

# %% [markdown]
# *Predicted, not measured: steps of chained speculation (and, for comparison, synchronous
# speculation's) per set and lookup setting, and the speedup over plain greedy with each step at
# its kernels' time.*
#
# Chaining takes a few more verify steps than synchronous speculation at the same setting, for the
# two reasons above, and costs each only its kernels. The replay puts code editing at 1.80x for
# k = 16 and 1.88x for k = 32 over two-token matches, at or just past the 1.8x aim. A 33-token verify
# step costs more than the 5-token one priced here, so the k = 32 figure is an upper bound.
#
# ### Measured, on an H100
#
# No H200 could be started on the day the chain was finished, so `scripts/gpu_run.sh smollm2
# smolspec` ran on an H100 (2026-12-05), the same bench as the H200's bf16 rows above, with
# chained speculation on. The H100 runs the same kernels from slower memory: its plain decode step
# is 0.69 ms of kernels against the H200's 0.67, its verify step 0.86 ms on both.

# %%
chain_runs = lab.measured_table("day65_spec", "scripts/gpu_run.sh smollm2 smolspec", slug="h100-80gb-hbm3")
prompts_by_set = {name: [smol.encode_chat(m) for m in lab.load_prompt_set(name)]
                  for name in chain_runs.set.unique()}
chain_summary = lab.measured_table("day65_spec_summary", "scripts/gpu_run.sh smollm2 smolspec",
                                   slug="h100-80gb-hbm3")
lab.show(chain_summary[["set", "arm", "ms_per_token", "acceptance_rate", "tokens_per_verify_step",
                        "speedup_over_off", "outputs_equal_off", "decode_step_ms", "verify_step_ms"]].round(3))
h100_kernels = lab.measured_table("day65smollm2_spec_verify_kernels", "scripts/gpu_run.sh smolspec",
                                  slug="h100-80gb-hbm3")
h100_us = h100_kernels[h100_kernels.batch == 1].groupby("arm").us_per_step.sum()
h100_priced = lab.chained_settings(chain_runs, prompts_by_set, plain_ms=h100_us["decode"] / 1e3,
                                   verify_ms=h100_us["verify"] / 1e3)
measured = chain_summary.set_index(["set", "arm"]).speedup_over_off
for k in (16, 32):
    got, want = measured["code_edit", lab.lookup_arm(k, 2)], h100_priced.set_index(["set", "k", "min_n"]).loc[
        ("code_edit", k, 2), "speedup_chained"]
    print(f"code editing, k = {k} over two-token matches: {got:.2f}x measured, {want:.2f}x replayed at this card's "
          f"kernels ({got / want:.2f} of it), {got / 1.8:.2f} of the 1.8x aim")
replayed = h100_priced.set_index(["set", "k", "min_n"]).loc[("code_edit", 32, 2)]
ran = chain_runs[(chain_runs.set == "code_edit") & (chain_runs.arm == lab.lookup_arm(32, 2))]
print(f"code editing, k = 32: {int(ran.steps.sum())} steps ({int(ran.verify_steps.sum())} verify) against the "
      f"replay's {int(replayed.verify_steps + replayed.plain_steps) + len(ran)} ({int(replayed.verify_steps)}), "
      "prompt steps included")

# %% [markdown]
# Chained verify steps take 0.78 to 1.00 ms of wall time at the median, against 1.15 to 1.38 ms for
# the synchronous ones on the H200: they now cost about their kernels. Code editing at k = 32 over
# two-token matches runs 1.74x faster than plain greedy, 0.97 of the 1.8x aim and 0.92 of what the
# replay gives at this card's kernels; k = 16 runs 1.65x. The replay assumes no pauses, and the
# engine paused a request's lookups after a miss: at k = 32 it took 123 steps where the replay
# takes 115, fewer of them verify steps. Summaries gain less, 1.07x to 1.50x. In the k = 32 arm
# the first three summaries ran plain steps of 1.2 ms where the rest took 0.65 to 0.72, for a
# reason these tables do not show.
#
# A pause after a lookup that finds nothing was made for synchronous speculation, where a step
# that may carry drafts blocks. A chained step overlaps with or without drafts, so such a pause
# saves nothing there and forgoes the matches that follow; since this run a chained request
# pauses only after a verify step that kept nothing. The chain on this machine at k = 32 over
# two-token matches, a row a prompt, against the replay of its own outputs (greedy, so plain
# greedy's):

# %%
chain_llm = LLM(str(path), device=str(DEVICE), dtype=DTYPE, enable_prefix_caching=False, async_scheduling=True,
                speculative_config={"num_speculative_tokens": 32, "prompt_lookup_min": 2})
counted = []
for name in ("code_edit", "summarize"):
    for i, (messages, ids) in enumerate(zip(lab.load_prompt_set(name), prompts_by_set[name], strict=True)):
        got = lab.run_prompt(chain_llm, messages, 64)
        want = lab.replay_chained(ids, got["token_ids"], 32, 2, max_tokens=64)
        counted.append({"set": name, "prompt": i, "output_tokens": got["output_tokens"], "steps": got["steps"],
                        "replay_steps": want["verify_steps"] + want["plain_steps"] + 1,
                        "verify_steps": got["verify_steps"], "replay_verify_steps": want["verify_steps"]})
chain_llm.close()
counted = pd.DataFrame(counted)
lab.show(counted)
over = counted.steps - counted.replay_steps
code = counted[counted.set == "code_edit"]
print(f"steps over the replay's, a prompt: {over.min()} to {over.max()}; code editing {code.steps.sum()} steps in all "
      f"({code.verify_steps.sum()} verify), against the H100's 123 (17) with the old pauses")
assert over.between(0, 3).all(), "the chain takes steps the replay does not count"

# %% [markdown]
# *Steps each prompt takes, its prompt step counted, and how many were verify steps: the
# engine's chain on this machine beside the replay over the same output.*
#
# The chain now takes the replay's steps and one more a prompt: the last, launched before the
# step in flight ends the request, as a plain decode step is under asynchronous scheduling. On
# code editing that is 120 steps against the 123 the H100 took with the old pauses, 30 of them
# verify steps against 17. Priced at the H100's kernels the replay gives code editing 1.90x at
# k = 32; {doc}`Day 65c <65c_chained_again>` measures the chain without these pauses.
#
# Four outputs differ from plain greedy's, on two code-editing prompts, against one in the H200's
# synchronous run. `tie_margins` finds where each first parts from plain greedy's and asks SmolLM2
# in fp32 on this machine how close the two tokens were there: a verify step multiplies through other
# kernels than a batch-1 decode step, and bf16 keeps 8 significant bits, so a logit between 16 and
# 32 is rounded by up to 0.06.

# %%
judge = LLM(str(path), device=str(DEVICE), dtype="float32", enable_prefix_caching=False)
ties = pd.concat([lab.tie_margins(judge, table, prompts_by_set).assign(card=card)
                  for card, table in (("h200", runs), ("h100", chain_runs))], ignore_index=True)
judge.close()
lab.show(ties[["card", "set", "arm", "prompt", "position", "off_token", "arm_token", "off_logprob", "arm_logprob",
               "margin"]].round(4))

# %% [markdown]
# Each output parts from plain greedy's where the two tokens lie within 0.1 of each other in
# fp32's log-probabilities, and at one of them fp32 itself prefers the speculative output's
# token. Greedy decoding in bf16 is deterministic for a given sequence of kernels, not across
# them. In fp32 every output matched on the H200.
#
# ## The gates
#
# These are asserted on the committed tables and on this run. Each aim that is missed is printed
# as a ratio to its target.

# %%
assert off["token_ids"] == on["token_ids"], "speculation changed a greedy token"
assert on["steps"] < off["steps"] and on["accepted_tokens"] > 0, "no draft was kept"
assert summary.outputs_equal_off.all(), "a speculative output differs from plain greedy"
assert verify.verify_graphed.all() and verify.decode_graphed.all(), "a step ran eagerly"
worst = verify.verify_over_decode.max()
print(f"verify at k = 4: {worst:.2f}x a decode step at worst against 1.2x ({'met' if worst <= 1.2 else 'missed'})")
under_load = itl["fullgraphs+ngram", 32.0] / itl["fullgraphs", 32.0]
print(f"under load at 32 req/s: ITL p50 {under_load:.3f}x plain's against at most 1x "
      f"({'met' if under_load <= 1 else 'missed'})")
print(f"SmolLM2 on the H200, code editing: {code_bf16.speedup_over_off:.2f}x against 1.8x (missed); outputs equal "
      f"off's in bf16: {bool(on_gpu['bf16'].outputs_equal_off.all())}, in fp32: "
      f"{bool(on_gpu['fp32'].outputs_equal_off.all())}")
assert on_gpu["fp32"].outputs_equal_off.all(), "speculation changed a greedy token in fp32 on the H200"
assert (ties.margin.abs() < 0.25).all(), f"a bf16 output left plain greedy's where fp32 sees no near tie:\n{ties}"

# %% [markdown]
# ## Summary
#
# - Prompt lookup keeps 39 to 68% of its drafts on real text. On SmolLM2 on the H200, k = 8 over
#   matches of two tokens lowers code editing's latency 1.60x (0.89 of the 1.8x aim), as the
#   replay of plain greedy's output predicted; no setting reaches 1.8x while verify steps block.
# - A verify step is now a decode step of a batch row per fed token: 0.96x and 1.18x a decode
#   step at batches 1 and 8 (1.2x allowed). The varlen read it replaced was 3x slower in bf16 and
#   9.5x in fp32 in a captured step's layout.
# - Under load on random weights, four switch-off rules took speculation's ITL p50 at 32 req/s
#   from 1.66x plain's to 1.003x, a step without a match overlapping as a plain one does.
# - Greedy verify steps now chain instead of blocking. On an H100 they lower code editing's
#   latency 1.74x at k = 32 over two-token matches (0.97 of the aim), 0.92 of the replay's price;
#   not yet measured on the H200. A chained request no longer pauses after a lookup that finds
#   nothing, and now takes the replay's steps and one more. Every bf16 output that parts from
#   plain greedy's does so at a near tie, within 0.1 in fp32's log-probabilities. Not yet built: a
#   varlen read that fp32 does not cripple.
