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
# # The engine before the compiler
#
# Every later chapter changes one piece of this engine and measures what the change bought, so
# this one takes stock of it as it stands on the eve of Day 49, with nothing compiled, captured or
# hand-written in Triton yet:
#
# - a Llama-family decoder (`nanolab/model/`) loaded from safetensors in the Hugging Face layout;
# - a paged KV cache (`nanolab/engine/kv_cache.py`): one K/V pool per layer cut into fixed-size
#   blocks, and a `BlockTable` per running request listing its blocks in order
#   (`nanolab/engine/block_manager.py`);
# - continuous batching (`nanolab/engine/scheduler.py`): requests join and leave between steps, are
#   admitted while free blocks last, and are preempted and later recomputed when the pool runs dry;
# - a vLLM-shaped front door, `LLM` and `SamplingParams`.
#
# The chapter generates text, draws the cache's bookkeeping for a ragged batch, checks the greedy
# tokens against HF transformers on the same weights, and times decoding against transformers'
# eager path in the same process, then against its default, compiled path as Day 61 measured it on
# the H200. On a CPU it runs the embedded SmolLM2-135M-Instruct in fp32; on a GPU it runs
# Llama-3.2-1B shapes in bf16 (random weights unless you point `NANOLAB_MODEL` at a real folder).

# %%
import nanolab.lab as lab
from nanolab import LLM, SamplingParams

DEVICE, MODEL, DTYPE = lab.chapter_target(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
# The engine before the compiler, CUDA graphs (Days 54-56) and the streamed read (Day 59).
llm = LLM(MODEL, device=DEVICE, dtype=DTYPE, enforce_eager=True, read="reference")
label = lab.run_label(DEVICE, MODEL, DTYPE, weights=llm.weights_kind)
print(label.caption().replace("; ", ";\n"))
kv = llm.engine.kv_cache
print(f"KV pool: {kv.num_blocks} blocks of {kv.block_size} tokens")

# %% [markdown]
# ## Generating text
#
# `generate` takes a list of prompts and returns one result per prompt, in order. All three run
# in one continuously batched loop: one ragged prefill step, then one decode step per token for
# the whole batch.

# %%
import pandas as pd

prompts = ["The capital of France is", "A paged KV cache stores", "def fibonacci(n):"]
outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
lab.show(pd.DataFrame({
    "prompt": prompts,
    "completion": [o.text for o in outputs],
    "new tokens": [len(o.token_ids) for o in outputs],
    "finish": [o.finish_reason for o in outputs],
}))

# %% [markdown]
# `chat` renders the model's own chat template (ChatML for SmolLM2) and stops at the end-of-turn
# token; `stream` yields the text as each token arrives.

# %%
question = [{"role": "user", "content": "What is the capital of France?"}]
(answer,) = llm.chat(question, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
print(repr(answer.text), answer.finish_reason)
if llm.weights_kind == "real" and MODEL == "smollm2-135m":
    assert "Paris" in answer.text and answer.finish_reason == "stop"

moon = SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=40)
for delta in llm.stream("Three facts about the Moon:", moon):
    print(delta, end="", flush=True)
print()

# %% [markdown]
# ## What the cache holds for a ragged batch
#
# Three requests of different lengths, small 4-token blocks so the picture has several per row.
# After a few decode steps the middle request is aborted and a fourth joins: it takes the blocks
# the aborted one gave back, so a row's blocks need not be contiguous in the pool. The read
# rectangle on the right is what the reference attention gathers every step: each row is padded
# to the longest row's length, and the padding cells name slot -1 (the sink, one slot past the
# pool's last block), are loaded, and are masked afterwards. Day 50 prices rebuilding this
# rectangle; Day 59 stops building it.

# %%
from nanolab import Engine, EngineConfig

demo = Engine(llm.model, EngineConfig(num_blocks=48, block_size=4, enforce_eager=True))
texts = ["Paged attention splits",
         "Blocks return to the pool when a request ends, however it ends.", "Hi"]
greedy32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
seqs = [demo.add_request(llm.tokenizer.encode(t), greedy32) for t in texts]
for _ in range(4):
    demo.step()
demo.abort_request(seqs[1].request_id)
late = demo.add_request(llm.tokenizer.encode("A late request joins mid-flight"), greedy32)
for _ in range(3):
    demo.step()
live = [seqs[0], seqs[2], late]
fig = lab.plot_block_tables(demo.kv_cache, [s.row for s in live],
                            ["request 0", "request 2", "request 3 (late)"])
lab.save_figure(fig, "engine_block_tables", label)
lab.show(fig)

# %% [markdown]
# *Figure 00.1: On the left, the pool's blocks, coloured by the request that owns them; on the
# right, the read rectangle, one row per request. The late request's row names blocks that the
# aborted one gave back, and the shorter row's hatched cells are padding that points at the sink.*

# %%
# Every block is owned once, and everything returns to the pool when the requests end.
owned = [b for s in live for b in demo.kv_cache.blocks.table(s.row).blocks]
assert len(owned) == len(set(owned)) == demo.block_manager.allocator.num_used
for s in live:
    demo.abort_request(s.request_id)
assert demo.block_manager.allocator.num_free == demo.kv_cache.num_blocks

# %% [markdown]
# ## The gate: nanolab's greedy tokens are HF transformers' greedy tokens
#
# Same folder of weights, loaded by transformers' `LlamaForCausalLM`, in fp32 on both sides (bf16
# rounding differs between any two implementations and would flip near-ties on random weights).
# Each prompt decodes greedily; nanolab decodes all of them together in one ragged batch and
# transformers one at a time.

# %%
import gc

import torch

from nanolab import load_model

PARITY_TOKENS = 32 if ON_GPU else 24
parity_model = llm.model if llm.dtype == torch.float32 else \
    load_model(llm.path, dtype=torch.float32, device=DEVICE)
hf = lab.load_hf(llm.path, torch.float32, DEVICE)
parity_prompts = [llm.tokenizer.encode(p) for p in prompts] + [llm.tokenizer.encode_chat(question)]
ours = lab.nanolab_greedy(parity_model, parity_prompts, PARITY_TOKENS)
theirs = [lab.hf_greedy(hf, p, PARITY_TOKENS) for p in parity_prompts]


def first_difference(a: list[int], b: list[int]) -> str:
    return next((str(i) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), "none")


lab.show(pd.DataFrame({
    "prompt tokens": [len(p) for p in parity_prompts],
    "new tokens": [len(t) for t in ours],
    "first differing token": [first_difference(a, b) for a, b in zip(ours, theirs, strict=True)],
}))
assert ours == theirs, "nanolab's greedy tokens differ from HF transformers'"
del hf, parity_model
gc.collect()
if ON_GPU:
    torch.cuda.empty_cache()

# %% [markdown]
# ## Decode speed against HF transformers' eager path, same machine, same run
#
# Every arm decodes greedily from the same random prompts. nanolab is timed step by step through
# `Engine.step`; transformers' `generate` is timed as the difference between generating
# `1 + steps` tokens and generating 1, which leaves its prefill out. Both HF arms are
# transformers' eager path, as this engine is eager: "HF static, eager" is `generate` with a static
# cache and `disable_compile=True`, and "HF dynamic, eager" is `generate` with its default dynamic
# cache, which transformers does not compile. Nothing is compiled on either side. That is not
# what a user of transformers gets on a GPU: there its static cache compiles the decode forward by
# default (on a CPU it does not). The last section sets nanolab against that default path.

# %%
# CPU sizes keep the chapter inside CI's budget on two cores; the GPU sizes are the real ones.
BENCH = dict(batches=[1, 4, 16], prompt_len=128, steps=64, repeats=5) if ON_GPU else \
    dict(batches=[1, 4, 16], prompt_len=32, steps=12, repeats=2)
# What each HF arm of the decode bench runs: transformers' eager path, both (`lab.timing.time_hf`).
HF_ARMS = {"hf-static": "HF static, eager (disable_compile=True)",
           "hf-dynamic": "HF dynamic, eager (default cache)"}
df = lab.decode_table(llm, BENCH["batches"], BENCH["prompt_len"], BENCH["steps"],
                      repeats=BENCH["repeats"], progress=False)
path = lab.save_table(df, "engine_decode", label)
columns = ["engine", "batch", "prompt_len", "steps", "ms_per_step", "tokens_per_s",
           "nanolab_speedup"]
lab.show(df[columns].replace({"engine": HF_ARMS}).round(2))
for arm, name in HF_ARMS.items():
    ratios = df[df.engine == arm].set_index("batch").nanolab_speedup
    print(f"nanolab tokens/s over {name}:\n  "
          + ", ".join(f"batch {b}: {r:.2f}x" for b, r in ratios.items()))

# %% [markdown]
# The committed GPU run sits beside whatever this run measured: each panel is one device's table
# from `data/engine_decode_<device>.csv`, titled with the device, model, dtype and date that made
# it. Both HF lines are transformers' eager path, on the GPU as on the CPU.

# %%
tables = lab.committed_tables("engine_decode")
for slug, table in tables.items():
    first = table.iloc[0]
    print(f"{slug}: {first.device}, {first.model} ({first.weights} weights), {first['dtype']}, "
          f"{first.date}")
fig = lab.plot_decode_speed(tables)
for ax in fig.axes:  # the lab's legend names an arm by its table key; say what ran
    for text in ax.get_legend().get_texts():
        text.set_text(HF_ARMS.get(text.get_text(), text.get_text()))
lab.save_figure(fig, "engine_decode", label)
lab.show(fig)

# %% [markdown]
# *Figure 00.2: Decode tokens per second against batch size, one panel per device. Look at the gap
# between nanolab's line and the two HF eager lines in each panel: both sides run eagerly here.*

# %%
both = pd.concat([t.assign(device=slug) for slug, t in tables.items()])
lab.show(both.replace({"engine": HF_ARMS}).pivot_table(index=["device", "batch"], columns="engine",
                                                       values="tokens_per_s").round(1))

# %% [markdown]
# ## Against HF's default path, on the H200 (Day 61)
#
# The baseline a user of transformers gets on a GPU is its default static-cache path, which
# compiles the decode forward. Day 61's floor bench (`python -m nanolab floorbench`) timed it on
# the H200 beside the eager path, gpt-fast and nanolab, every arm from outside as whole `generate`
# calls: 257 new tokens minus 1 (gpt-fast: 258 minus 2), over 256. Its nanolab row is the engine
# of that day, with CUDA graphs over the streamed read, not this chapter's eager engine. The
# ratios against HF are those against its default path; the eager path stands beside them.
# `x_floor` is the step over the bytes it must read at the copy bandwidth that its own process
# measured; the first table below says which arms shared a process.

# %%
floor = lab.load_table("day61_floor", "h200")
print("measured on:", lab.table_label(floor).caption().replace("; ", ";\n  "))
day61 = floor[floor.batch.isin([1, 8]) & (floor.context == floor.context.min())]
processes = day61.groupby("run").label.unique().map(", ".join)
with pd.option_context("display.max_colwidth", None):
    lab.show(processes.rename("arms measured in the process").to_frame())
compiled = day61[day61.arm == "hf-default"].graphs_compiled
assert (compiled > 0).all(), "HF's default arm did not compile"
lab.show(day61.pivot_table(index="label", columns="batch", values=["ms_per_step", "x_floor"])
         .sort_values(("ms_per_step", 1)).round(3))
speedups = day61[day61.arm != "nanolab"].pivot_table(index="label", columns="batch",
                                                      values="nanolab_speedup")
lab.show(speedups.sort_values(1).add_prefix("nanolab speedup, batch ").round(2))

# %% [markdown]
# ## What this sets up
#
# The engine above already decides where each step's K/V goes on the host, before the forward
# runs (Day 50's `DecodePlan`). On the eve of Day 49 it did not: layer 0's `write` grew the block
# tables with a Python loop over the rows, every later layer reused the slots layer 0 chose, and
# the read rebuilt the `[rows, max_ctx]` rectangle from the tables every step. Neither cost much
# eagerly. `nanolab.lab.history` keeps that design as a runner the engine accepts, and Day 49
# hands it to `torch.compile` to find that both are values a tracer must guard on.

# %%
assert llm.engine.block_manager.allocator.num_free == llm.engine.kv_cache.num_blocks
assert not llm.engine.has_unfinished_requests()
