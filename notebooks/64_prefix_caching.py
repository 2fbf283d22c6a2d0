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
# # Day 64: prefix caching
#
# Until today nanolab computed every prompt from its first token. A chat's second turn paid again
# for the first turn. Every request behind one system prompt paid for that prompt again. Each
# engine a user might pick instead keeps the K/V of prompts it has seen:
#
# - nano-vllm's block manager hashes full blocks;
# - vLLM v1's automatic prefix caching is on by default, and its announcement reports under 1%
#   throughput lost when nothing hits;
# - SGLang's RadixAttention reports up to 5x to 6.4x throughput on agent, few-shot and multi-turn
#   workloads.
#
# This chapter asks two questions. How much of a request's time to first token goes when its
# prefix is already in the pool? What does keeping prefixes cost when nothing repeats?
#
# The design is vLLM's:
#
# - **A key per full block.** Block i's key is a SHA-256 over block i-1's key and block i's own
#   token ids (`block_key`). Two blocks share a key only when they and everything before them
#   hold the same tokens. The keys computed last are kept, one for each block of the pool
#   (`KeyMemo`), so a prompt behind a prefix keyed before compares its blocks' bytes instead of
#   hashing them again.
# - **Keyed once written.** A block is keyed after the forward that writes it has been launched.
#   A step that fails leaves no findable block with K/V that were never written.
# - **Shared by reference count.** An admitted request looks up its prompt's keys and starts
#   after the longest run of cached full blocks. Those blocks join its table, and their count of
#   holders goes up. It always leaves at least one prompt token to compute, and a partial block is
#   never shared. Admission counts only the blocks a request adds: the shared ones that a running
#   request holds already take nothing more from the pool.
# - **Kept until needed.** A keyed block that no table holds stays findable, in least recently
#   released order. It is evicted only when a block is needed and no unkeyed one is free.
#
# Since today it is on by default (`enable_prefix_caching`; `--no-enable-prefix-caching` turns it
# off).

# %%
import os
import time

import pandas as pd

import nanolab.lab as lab
from nanolab import LLM, Engine, SamplingParams
from nanolab.engine.block_manager import block_key

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))
llm = LLM(str(path), device=str(DEVICE), dtype=DTYPE)

# %% [markdown]
# ## The hash chain
#
# Blocks of four tokens here. The block of tokens 21 to 24 follows block a in one sequence and
# block c in the other. Its tokens are the same, but its K/V are not: each token's key and value
# depend on every token before it. The chain gives it two keys.

# %%
a, b, c = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]
rows = []
for name, blocks in (("a, b", [a, b]), ("c, b", [c, b]), ("a, b again", [a, b])):
    parent = None
    for i, tokens in enumerate(blocks):
        parent = block_key(parent, tokens)
        rows.append({"sequence": name, "block": i, "tokens": tokens, "key": parent.hex()[:16] + "..."})
chain = pd.DataFrame(rows)
lab.show(chain)
keys = chain.set_index(["sequence", "block"]).key
assert keys["a, b", 1] != keys["c, b", 1], "a block's key ignores what comes before it"
assert keys["a, b", 1] == keys["a, b again", 1]

# %% [markdown]
# ## Three requests and a second turn
#
# SmolLM2's chat template, one system prompt, and blocks of 16 tokens. Request A runs first and
# finishes. Then B and C (the same system prompt and other questions) arrive together with D, the
# second turn of A's conversation: A's prompt, A's reply and a new question. The figure shows
# each table's pool blocks after its first step.

# %%
system = ("You are a careful assistant for a small library. Answer in one short sentence, name the shelf "
          "where the book is kept, and never invent a title. The fiction shelves are A to F, history is G, "
          "science is H and J, and the children's corner holds everything for readers under twelve.")
chat = lambda *turns: llm.tokenizer.encode_chat(  # noqa: E731
    [{"role": "system", "content": system}] + [{"role": r, "content": t} for r, t in turns])
engine = Engine(llm.model, llm.engine_config.replace(block_size=16, num_blocks=96, max_num_batched_tokens=512),
                detokenize=llm.tokenizer.decode, progress=False)
greedy = SamplingParams(temperature=0, max_tokens=24)
snapshots, pool = [], []


def snapshot(seqs, names) -> None:
    for seq, name in zip(seqs, names, strict=True):
        table = engine.block_manager.table(seq.row)
        snapshots.extend({"request": name, "index": i, "block": blk, "keyed": i < len(table.keys)}
                         for i, blk in enumerate(table.blocks))


def pool_state(moment: str) -> None:
    allocator = engine.block_manager.allocator
    pool.extend({"moment": moment, "state": state, "blocks": n} for state, n in (
        ("held", allocator.num_used), ("cached (free, findable)", allocator.num_evictable),
        ("free", allocator.num_free - allocator.num_evictable)))


A = engine.add_request(chat(("user", "Where are the books about volcanoes?")), greedy)
engine.step()
snapshot([A], [f"A: {len(A.prompt_token_ids)} prompt tokens"])
pool_state("A running")
while engine.has_unfinished_requests():
    engine.step()
pool_state("A done")
later = [chat(("user", "Where would I find a history of Rome?")),
         chat(("user", "Is there a shelf for picture books?")),
         chat(("user", "Where are the books about volcanoes?"), ("assistant", llm.tokenizer.decode(A.output_token_ids)),
              ("user", "And books about earthquakes?"))]
hits = engine.scheduler.prefix_cache_hits
B, C, D = engine.add_requests(later, [greedy] * 3)
engine.step()
snapshot([B, C, D], [f"{n}: {len(s.prompt_token_ids)} prompt tokens" for n, s in zip("BCD", (B, C, D))])
pool_state("B, C, D admitted")
while engine.has_unfinished_requests():
    engine.step()
pool_state("all done")
tables = pd.DataFrame(snapshots)
tables["refs"] = tables.groupby("block").request.transform("count")
fig = lab.plot_shared_blocks(tables, pd.DataFrame(pool))
lab.save_figure(fig, "day64_shared_blocks", label)
lab.show(fig)
print(f"prompt tokens found cached: {engine.scheduler.prefix_cache_hits - hits} "
      f"of {sum(len(p) for p in later)}; all blocks free or cached: "
      f"{engine.block_manager.allocator.num_free == engine.num_blocks}")
assert engine.block_manager.allocator.num_free == engine.num_blocks
shared_len = len(os.path.commonprefix([later[0], later[1]]))  # the system prompt and the template's head
assert engine.scheduler.prefix_cache_hits - hits >= 3 * (shared_len // 16) * 16, "a request missed the system prompt"

# %% [markdown]
# B and C share the system prompt's full blocks with A, coloured, and each computes only from
# the first block where its question begins. D shares all of A's full blocks: the system prompt,
# the question, and the block A's reply filled. That block was A's partial last block when A's row
# was drawn, and it was keyed once A's reply filled it. Each hatched last block is partial. It
# holds the request's own tokens and is never shared. When A finished, its blocks did not go back
# to plain free: they became cached, free to take but still findable, and B, C and D found them
# there.
#
# ## Real text on this machine
#
# The same model with caching on and off, one request at a time. The first request carries the
# system prompt cold. Each later one shares it and asks its own question. The first token's wall
# time is one call of `generate` with one new token.

# %%
questions = ["Where are the atlases?", "Do you keep poetry?", "Where is the science fiction?",
             "Can I find cookbooks here?", "Where are the dictionaries?", "Is there a shelf for comics?"]
greedy1 = SamplingParams(temperature=0, max_tokens=1)
rows, tokens = [], {}
for caching in (False, True):
    run = LLM.from_config(llm.engine_config.replace(enable_prefix_caching=caching)) if caching != \
        llm.engine_config.enable_prefix_caching else llm
    for i, question in enumerate(questions):
        prompt = {"prompt_token_ids": chat(("user", question))}
        start = time.perf_counter()
        run.generate(prompt, greedy1, use_tqdm=False)
        rows.append({"caching": "on" if caching else "off", "request": "cold" if i == 0 else "warm",
                     "prompt_tokens": len(prompt["prompt_token_ids"]), "ttft_ms": 1e3 * (time.perf_counter() - start)})
    outs = run.generate([{"prompt_token_ids": chat(("user", q))} for q in questions],
                        SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    tokens[caching] = [o.token_ids for o in outs]
    if caching:
        cached_run = run
local = pd.DataFrame(rows)
summary = local.groupby(["request", "caching"]).ttft_ms.median().unstack()
summary["off / on"] = summary["off"] / summary["on"]
lab.show(summary.round(2))
assert tokens[True] == tokens[False], "prefix caching changed a greedy token"
assert cached_run.engine.scheduler.prefix_cache_hits > 0

# %% [markdown]
# The tokens with caching on are the tokens with it off. The unit tests hold the logits to 1e-4
# against a one-shot forward of HF transformers: full hits, partial ones, hits inside a chunk, a
# hit on a request still writing its last block, and eviction under a tiny pool
# (`tests/test_prefix_cache.py`).
#
# ## The H200: a shared system prompt and a chat's second turn
#
# `python -m nanolab prefixbench` (`scripts/gpu_run.sh prefix`) at Llama-3.2-1B shapes with
# random bf16 weights, on the server's defaults (this first run's tables are kept as
# `day64first_*`; a third run, further down, is `day64_*`): every step graphed, chunked prefill of 512
# tokens a step. Two servers, caching off and on, each sent requests one at a time, so a TTFT
# is the request's alone:
#
# - **shared prefix:** 20 requests with one 2,048-token system prompt and a suffix of their own;
#   the first is cold;
# - **multi-turn:** 8 conversations, turn 1 over a 4,096-token history and turn 2 over turn 1's
#   prompt, a 32-token reply and a question. The reply is random ids of the reply's length (random
#   weights' text does not re-encode to the same ids), so turn 2 finds turn 1's prompt cached and
#   not the reply.

# %%
ttft = lab.load_table("day64first_ttft", "h200")
fig = lab.plot_prefix_ttft(ttft)
if not lab.figure_path("day64first_ttft", "h200").exists():
    lab.save_figure(fig, "day64first_ttft", lab.table_label(ttft))
lab.show(fig)
ttft["outside_steps_ms"] = ttft.ttft_p50_ms - ttft.server_prefill_ms
lab.show(ttft[["part", "phase", "arm", "prompt_len", "cached_tokens", "server_prefill_tokens", "ttft_p50_ms",
               "server_prefill_ms", "outside_steps_ms"]].round(2))

# %% [markdown]
# A cold request costs the same with caching on as off (20.15 against 20.20 ms): looking up 130
# blocks and keying them costs nothing visible. A warm hit at the shared prefix takes 7.9 ms
# against 20.4, 2.6x faster. A second turn over 4,096 tokens takes 13.2 against 41.3 ms, 3.1x.
#
# The aim was 5x, and it is not met. The last two columns show why. `server_prefill_ms` is what
# the engine's prompt steps took, read from the server's step log. With caching off, the five
# chunks of 512 tokens take 16.3 ms of 20.4. With caching on, one step of 50 tokens takes 3.9 ms.
# That is more than one 512-token chunk without caching (about 3.3 ms), because those 50 queries
# read 2,098 tokens of context each. The rest of the TTFT is outside the engine's steps: about
# 4 ms at 2,048 tokens and 6 to 8 ms at 4,096, in both arms. It grows with the prompt. Caching
# removes the prompt's compute, and what is left is these two costs.
#
# To find where the outside time goes, the step log now records when the engine's process takes
# a request and when each step call begins, and prefixbench splits a request's TTFT with them:
# front (the HTTP request, the server's checks, the pipe to the engine's process), the core's
# wait, host work inside the step call, the steps, and back (the token's way to the client). The
# H200 tables above predate it; the second run below (`day64split_*`) fills those columns.
#
# ## The cost when nothing hits
#
# Graphbench's workload (prompts of 64 to 512 random tokens) through two engines in one process
# that differ only in `enable_prefix_caching`, alternating over ten repeats. Every full block is
# still keyed, and every admission still looks its prompt up.

# %%
nohit = lab.load_table("day64first_nohit", "h200")
fig = lab.plot_nohit_throughput(nohit)
if not lab.figure_path("day64first_nohit", "h200").exists():
    lab.save_figure(fig, "day64first_nohit", lab.table_label(nohit))
lab.show(fig)
pairs = nohit.pivot_table(index="repeat", columns="arm", values="tokens_per_s")
nohit_ratio = float((pairs["on"] / pairs["off"]).median())
print(f"on / off, median of {len(pairs)} repeats: {nohit_ratio:.3f}; "
      f"hits found: {int(nohit.prefix_hits.sum())}")

# %% [markdown]
# With caching on the engine kept 99.4% of its throughput at the median: about 0.6% lost. Nine
# repeats fell between 0.988 and 0.996, and one at 0.928. One repeat can land far from the median,
# so the verdict rests on the median of ten, and it sits close to the 1% line. The later runs
# below did not reproduce it.
#
# ## The hit rate, from `/metrics`
#
# Sixteen system prompts of 1,024 tokens, requests at 16 a second for 8 s, each picking one at
# random and adding a suffix. The rate is read from the server's Prometheus counters
# (`nanolab:prefix_cache_hits_total` over `nanolab:prefix_cache_queries_total`). The ideal is
# what a cache that never evicts finds: every request after the first of its prompt finds that
# prompt's full blocks.

# %%
hitrate = lab.load_table("day64_hitrate", "h200")
lab.show(hitrate[["systems", "system_len", "rate", "requests", "completed", "queried_tokens", "hit_tokens",
                  "hit_rate", "ideal_hit_rate", "ttft_first_p50_ms", "ttft_repeat_p50_ms"]].round(3))

# %% [markdown]
# /metrics reports 83.6% of prompt tokens found, which is the ideal: with a pool of tens of
# thousands of blocks nothing was evicted.
#
# ## The requests that use it
#
# A request's `n` samples share its prompt: they go to the engine together, the first runs the
# prompt, and the others wait for it and then share its blocks. Sample i is seeded with seed + i.
# Log-probabilities come from the logits the sampler saw, as an fp32 log-softmax before
# temperature. `echo` with `logprobs` scores the prompt's tokens, which is what lm-eval's
# multiple-choice tasks read. `tests/test_lm_eval.py` runs lm-eval through the server and gets
# the scores of lm-eval's own HF backend on the same weights, loglikelihoods to 1e-3.

# %%
(out,) = cached_run.generate({"prompt_token_ids": chat(("user", "Where are the atlases?"))},
                             SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=8, logprobs=3), use_tqdm=False)
text = lambda t: cached_run.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
lab.show(pd.DataFrame([{"token": text(t), "logprob": round(lp, 3),
                        "top 3": ", ".join(f"{text(i)!r} {v:.2f}" for i, v in top)}
                       for t, (lp, top) in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]))
for sample in out.outputs:
    print(repr(sample.text))
assert len({tuple(s.token_ids) for s in out.outputs}) > 1, "the samples are the same"

# %% [markdown]
# ## A second run, with the split read
#
# The warm step above runs 32 programs for the H200's 132 SMs, each walking the whole context.
# Since then the varlen read can cut each walk into shares and fold them (`splits`, chosen so the
# grid fills the SMs). prefixbench ran again on that code, and its tables are kept beside the
# first run's as `day64split_*`. This time the TTFT split's columns are filled.

# %%
split = lab.measured_table("day64split_ttft", "scripts/gpu_run.sh prefix (then renamed day64split_*)")
lab.show(split[["part", "phase", "arm", "ttft_p50_ms", "front_ms", "core_wait_ms", "step_host_ms",
                "server_prefill_ms", "between_steps_ms", "back_ms"]].round(2))
lab.show(lab.load_table("day64split_ratios", "h200")[["ratio", "value", "aim", "met"]].round(3))

# %% [markdown]
# The second turn over 4,096 tokens went from 13.2 to 9.5 ms, 4.1x faster than without caching.
# The warm hit at 2,048 tokens did not move: 7.8 ms, 2.5x. Its one 50-token step still takes
# 3.8 ms, about what the 64-token step at 4,096 tokens takes. So that step's time no longer grows
# with the context; where its 3.8 ms go, these tables do not say. The split does show where the
# rest of the TTFT goes. Front (HTTP, checks, the pipe to the core) costs 2.6 ms and back 0.7 ms, with less
# than 1 ms of host work in the step call.
#
# The no-hit pass in this run spread from 0.82 to 1.16 between repeats, with a median of 0.968.
# A spread that wide cannot resolve a 1% cost.
#
# ## Where the 50-token step goes
#
# `prefixsteps` (`scripts/gpu_run.sh prefixsteps`) sends requests one at a time to an `LLM` in
# one process, each behind the same cached 2,048-token system prompt, and times every step. Then
# it profiles the 50-token one's kernels beside a decode step's. This run came after the read's
# grid stopped at the step's tokens, the varlen graphs began capturing the compiled model
# (chapter 65), and the fix to the grid below.

# %%
steps = lab.measured_table("day64_prefix_steps", "scripts/gpu_run.sh prefixsteps")
lab.show(steps.groupby(["case", "suffix", "phase"]).agg(steps=("ms", "size"), ms=("ms", "median"),
                                                        graphed=("graph", "mean")).round(3))
hit_kernels = lab.measured_table("day64_prefix_kernels", "scripts/gpu_run.sh prefixsteps")
by_class = hit_kernels.pivot_table(index="arm", columns="class", values="us_per_step", aggfunc="sum",
                                  sort=False).fillna(0)
lab.show(by_class.round(0))
print(f"kernels of the 50-token step: {by_class.loc['prefix hit + 50'].sum() / 1e3:.2f} ms")

# %% [markdown]
# The 50-token step takes 2.5 ms at the engine, of which 1.7 ms is kernels: 0.89 ms of
# projections, the cuBLAS reading of every weight once, and 0.64 ms of attention read, 36 us a
# layer. Before the grid's fix it took 2.7 ms, with a read of 67 us a layer.
#
# The fix came from `varlenbench`, which reads the same shape alone, L2 flushed, in 37 us with
# the engine's tiles, and timed it in the layouts a captured step hands it (`--cases verify,50
# --no-sweep`): 70 us, as long again over a 4 GiB pool (`day65readbefore_*`, chapter 65). A
# captured step cannot know how many of its segments hold tokens, so its flat grid has a slot for
# each 16-query tile of its 56 tokens and one for every segment that could start one, min(64
# rows, 56 tokens): 59 slots for each KV head and share, 3,776 programs, most of which searched
# for a segment and exited. Alone the case has one segment and 320 programs. The grid keeps its
# size, since a captured step's lengths change from replay to replay, but its programs no longer
# search: each loads the step's segment starts once, numbers the query tiles from them without
# gaps, and exits at once past the step's last tile. The same bench after the fix, with the two
# halves of the step's layout apart (a table row for each of the 64 rows; q read out of the fused
# projection's output):

# %%
reads = lab.measured_table("day65read_bfloat16_varlen_sweep", "python -m nanolab varlenbench --cases verify,50 "
                           "--no-sweep --prefix day65read_bfloat16")
lab.show(reads[reads.read == "varlen"].pivot_table(index="case", columns="layout", values="us", sort=False).round(1))

# %% [markdown]
# In the step's layout the read takes 44 us, against 70 before; the table rows cost the 7 us
# left over reading alone, and q's layout 1 us.
#
# `scripts/gpu_run.sh varlen` sweeps the read's launch over five steps: on the H200 before the
# fix (2026-12-04) and on an H100 after it (2026-12-05, no H200 could be started). Each row is a
# case read alone, at the engine's 64-row tiles, its walk unsplit or cut into the engine's shares,
# by software-pipelining stages (0: Triton's default, three):

# %%
sweeps = pd.concat([lab.measured_table("day64_varlen_sweep", "scripts/gpu_run.sh varlen", slug=slug).assign(card=card)
                    for card, slug in (("H200", "h200"), ("H100", "h100-80gb-hbm3"))], ignore_index=True)
tiles64 = sweeps[(sweeps.layout.fillna("alone") == "alone") & (sweeps.read.fillna("varlen") == "varlen")
                 & (sweeps.block_m == 64) & (sweeps.block_n == 64) & (sweeps.num_warps == 4)
                 & (sweeps.share_tiles == 4) & sweeps.num_stages.isin([0, 2]) & sweeps.splits.isin([1, 4, 8])]
stages = tiles64.pivot_table(index=["card", "case"], columns=["splits", "num_stages"], values="us", sort=False)
lab.show(stages.round(1))
unsplit = stages[1]
print(f"unsplit, two stages over the default: {(unsplit[2] / unsplit[0]).min():.2f}x to "
      f"{(unsplit[2] / unsplit[0]).max():.2f}x")

# %% [markdown]
# Unsplit, two stages beat the default on every case and both cards, by 7 to 13%, so the engine
# now launches an unsplit walk with two (`UNSPLIT_STAGES`). Split into shares the result goes
# both ways (two stages won on the H200 and lost on the H100 at four shares, and eight were not
# swept), so a split walk keeps the default. A prompt step's split count follows its token count,
# so the 50-token step above is split and keeps its read; a 512-token chunk is not. Tiles of 32
# rows would halve the mixed step's read's waste on its one-token decode rows (65 against 83 us
# on the H100) but read a long chunk 1.5x slower, and a captured step cannot tell the two apart
# from its token count, so the tiles stay at 64.
#
# ## A third run
#
# prefixbench again (2026-12-05), after the flat grid's fix and two changes to the server's fixed
# costs: the engine core no longer checks every prompt id again after the server has, and the
# bench's requests share one kept-alive connection per part, as an SDK client's do, so a TTFT
# holds no TCP handshake.

# %%
ttft3 = lab.measured_table("day64_ttft", "scripts/gpu_run.sh prefix")
fig = lab.plot_prefix_ttft(ttft3)
if ON_GPU or not lab.figure_path("day64_ttft", "h200").exists():
    lab.save_figure(fig, "day64_ttft", lab.table_label(ttft3))
lab.show(fig)
lab.show(ttft3[["part", "phase", "arm", "ttft_p50_ms", "front_ms", "core_wait_ms", "step_host_ms",
                "server_prefill_ms", "between_steps_ms", "back_ms"]].round(2))
fixed = ttft3.set_index(["part", "phase", "arm"]).loc[("shared prefix", "warm", "on")]
outside = fixed[["front_ms", "core_wait_ms", "step_host_ms", "between_steps_ms", "back_ms"]].sum()
off_warm = ttft3.set_index(["part", "phase", "arm"]).loc[("shared prefix", "warm", "off"), "ttft_p50_ms"]
print(f"outside the prompt step: {outside:.2f} ms; with a step of no time, TTFT off / on would be at most "
      f"{off_warm / outside:.2f}x; with the step at its kernels' time, "
      f"{off_warm / (outside + by_class.loc['prefix hit + 50'].sum() / 1e3):.2f}x")
nohit3 = lab.measured_table("day64_nohit", "scripts/gpu_run.sh prefix")
ratios = {run: t.pivot_table(index="repeat", columns="arm", values="tokens_per_s").pipe(lambda p: p["on"] / p["off"])
          for run, t in (("first", nohit), ("third", nohit3))}
medians = {run: float(r.median()) for run, r in ratios.items()}
for run, r in ratios.items():
    lo, hi = lab.median_interval(r)
    print(f"no hits, {run} run: on / off {medians[run]:.3f}, median of {len(r)} repeats "
          f"(95% bootstrap interval {lo:.3f} to {hi:.3f})")

# %% [markdown]
# The warm hit went from 7.8 to 5.6 ms, and the second turn from 9.5 to 7.9 ms. Without caching the
# same requests got faster too (17.4 ms against 19.6 at 2,048 tokens), since the 512-token chunks
# read their context through the same fixed grid, so the ratios moved less: 3.1x at the shared
# prefix, 0.62 of the 5x aim, and 4.5x at the second turn, 0.91 of it.
#
# Outside the step, front, core wait, host work and back now come to 2.8 ms, against 4.2 in the
# second run. The front fell from 2.6 to 1.6 ms. Even so, 5x needs the warm hit under 3.5 ms, and
# the 50-token step's kernels alone take 1.7 ms: the aim asks for both the step's host work and
# the server's path around it to be about halved again.
#
# The no-hit pass kept 98.5% of the throughput at the median, with repeats from 0.956 to 1.040.
# Over three runs the medians were 0.994, 0.968 and 0.985. Only the first met the 1% aim, and the
# other two spread too widely to resolve it either way: the aim is not shown. Resampling the ten
# repeats puts the third run's median anywhere from about 0.97 to 1.01, an interval wider than the
# 1% in question, so the bench now runs thirty a side.
#
# ## The gates
#
# The invariants are asserted: caching changes no token, a no-hit pass finds nothing, every request
# of the hit-rate stream completes, the hit rate matches the ideal, and a cached prefix at least
# halves TTFT. The aims that are missed are shown as ratios to their targets.

# %%
ratios = lab.load_table("day64_ratios", "h200")
lab.show(ratios[["ratio", "value", "aim", "met"]].round(3))
hit = hitrate.iloc[0]
assert int(nohit.prefix_hits.sum()) == 0 and int(nohit3.prefix_hits.sum()) == 0, "a no-hit pass found a cached block"
assert min(medians.values()) >= 0.95, f"caching with no hits cost over 5%: {medians}"
print(f"no hits: {medians['third']:.3f} of off's throughput in the latest run, against at least 0.99 "
      f"({'met' if medians['third'] >= 0.99 else 'missed'})")
assert hit.completed == hit.requests and hit.failed == 0 and hit.token_mismatches == 0
assert hit.hit_rate >= 0.9 * hit.ideal_hit_rate, f"hit rate {hit.hit_rate:.3f}, ideal {hit.ideal_hit_rate:.3f}"
warm = ttft3.set_index(["part", "phase", "arm"]).ttft_p50_ms
for part, phase in (("shared prefix", "warm"), ("multi-turn", "turn 2")):
    speedup = warm[part, phase, "off"] / warm[part, phase, "on"]
    print(f"{part}, {phase}: {speedup:.2f}x faster with caching, {speedup / 5:.2f} of the 5x aim")
    assert speedup > 2, f"{part}: a cached prefix no longer halves TTFT"

# %% [markdown]
# ## Summary
#
# - Full KV blocks are keyed by a hash chain and shared by reference count. Freed keyed blocks
#   stay findable in least recently used order until the pool needs them. Prefix caching is on by
#   default.
# - On the H200 a warm hit at a 2,048-token shared prompt took 5.6 ms against 17.4 ms, 3.1x. A
#   second turn over 4,096 tokens took 7.9 against 35.9 ms, 4.5x. The aim was 5x. What is left is
#   a 50-token step of 2.5 ms, 1.7 of it kernels, and 2.8 ms of the server's path around it.
# - With nothing to hit, caching kept 99.4%, 96.8% and 98.5% of the throughput in three runs: the
#   1% aim is not shown.
# - The server's `/metrics` reports the hit rate, and it matched the ideal: 83.6%.
# - Requests can now ask for n samples, log-probabilities and echoed prompt scores, so lm-eval
#   runs through the server unchanged.
