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
# # Day 62: two GPUs
#
# A decode step reads every weight once. Chapter 61 brought that read close to one GPU's bandwidth
# floor, so a step can only get much shorter if each GPU reads less. Tensor parallelism does that.
# It splits every weight matrix across the GPUs of a group, so each GPU streams its share and they
# all stream at once. What the split costs is communication: the GPUs must add up their partial
# results, twice a layer, every step. A 16 GB model split over two GPUs reads 8 GB a GPU, but also
# waits for 65 all-reduces a step. This chapter builds the split, checks that it computes what one
# process computes, and then measures both sides of that trade on two H200s of one host.
#
# - **The split** (`nanolab.model.parallel`) follows Megatron-LM, as vLLM and gpt-fast do. q/k/v and
#   gate/up are split by columns, so each rank computes its own heads and its own slice of the MLP
#   alone. o and down are split by rows: each rank multiplies its share of the inputs, and an
#   all-reduce sums the partial outputs. The embedding and the LM head are split by vocabulary. The
#   KV cache follows the heads, so each rank stores only its own KV heads' history.
# - **The group** (`nanolab.engine.parallel`) is one process per GPU. Rank 0 is the caller's process
#   and runs the whole engine: the scheduler, the block manager, sampling, the API. Each worker holds
#   its shard, its share of the cache and a `ModelRunner`, and runs the forward rank 0 tells it to.
#   Nothing is decided twice. Rank 0 plans each step, then sends a `StepCall` down each worker's
#   stdin pipe with the rows, their block tables as rank 0 left them, and a prompt step's token
#   ids. A decode step's ids follow by a broadcast over the group, queued on the GPU's stream, so
#   rank 0 can launch the next step before the last one's tokens reach the host (asynchronous
#   scheduling). The worker's `FollowerBlockManager` adopts those tables and never allocates a
#   block, so both ranks write the same slots. Each rank compiles its own decode step and captures
#   its own CUDA graphs, with the collectives inside them.

# %%
import dataclasses

import torch

import nanolab.lab as lab

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## What one rank holds
#
# Splits are contiguous and as even as the counts allow. A shape that does not divide still
# shards: SmolLM2 has 3 KV heads, so at TP = 2 rank 0 takes two with their six query heads and
# rank 1 takes one with its three. The one thing a share cannot be is empty, so a group larger than
# the model's KV head count is refused by name (`check_shardable`).

# %%
import pandas as pd

from nanolab.model.config import PRESETS
from nanolab.model.parallel import TensorParallel

shares = []
for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"):
    config = PRESETS[name]
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        (k0, k1), (q0, q1) = tp.kv_heads(config), tp.q_heads(config)
        (i0, i1), (v0, v1) = tp.intermediate(config), tp.vocab(config)
        shares.append({"model": name, "rank": rank, "kv heads": f"{k0}..{k1 - 1}", "query heads": f"{q0}..{q1 - 1}",
                       "intermediate": f"{i0}..{i1 - 1}", "vocabulary": f"{v0}..{v1 - 1}"})
lab.show(pd.DataFrame(shares).set_index(["model", "rank"]))
collectives = lab.collectives_per_step(PRESETS["llama-3.1-8b"])
print(f"a Llama-3.1-8B decode step at TP=2: {collectives['all_reduce']} all-reduces "
      f"(2 a layer, 1 for the embedding) and {collectives['all_gather']} all-gather (the head's logits)")

# %% [markdown]
# ## Two ranks compute what one process computes
#
# The experiment this chapter runs wherever it is run: a group of two ranks against one process on
# the same weights, greedy decoding of three prompts, with the prefill logits compared as well.
# With two GPUs it is NCCL in bf16. Elsewhere it is two processes on the CPU over gloo, in fp32,
# SmolLM2's real weights. Real weights matter here: each token then depends on what every layer
# reads, so a wrong shard or a missing all-reduce would change the text, not just the numbers.
#
# The gates: in fp32, every greedy token equal and the logits' relative error below 1e-5. The only difference
# there is the order of the all-reduce's additions. In bf16 the sums round differently, so near-tied
# tokens may part, and the gate is on the logits' relative error.

# %%
from nanolab.model.weights import resolve_weights, weights_kind

TWO_GPUS = ON_GPU and torch.cuda.device_count() >= 2
group = dict(device="cuda", dtype="bfloat16", model=MODEL) if TWO_GPUS else \
    dict(device="cpu", dtype="float32", model="smollm2-135m")
group_label = label if TWO_GPUS else lab.run_label(
    "cpu", "smollm2-135m", torch.float32, weights=weights_kind(resolve_weights("smollm2-135m")))
agreement = lab.group_agreement(group["model"], device=group["device"], dtype=group["dtype"], num_blocks=256,
                                max_num_batched_tokens=8)
print("measured on:", group_label.caption().replace("; ", ";\n  "))
lab.show(agreement.drop(columns=["tp"]).round(8))
print("wrote", lab.save_table(agreement, "day62_agreement", group_label))

# %% [markdown]
# The 8-token step budget (`max_num_batched_tokens=8`) splits every prompt into chunks, so the
# workers adopt block tables in the middle of a prompt and beside decode rows. That is the hardest
# case for the follower.

# %%
if group["dtype"] == "float32":
    assert agreement.tokens_equal.all(), agreement
    assert (agreement.logits_rel_err < 1e-5).all(), agreement.logits_rel_err
else:
    assert (agreement.logits_rel_err < 5e-2).all(), agreement.logits_rel_err
print(f"gate: {int(agreement.tokens_equal.sum())} of {len(agreement)} prompts' greedy tokens equal; "
      f"logits within {agreement.logits_max_abs_diff.max():.1e} (abs), {agreement.logits_rel_err.max():.1e} (rel)")

# %% [markdown]
# ## One GPU and two, measured
#
# `python -m nanolab tpbench` times each model's decode step at TP = 1 and TP = 2 from outside, as
# the floorbench times nanolab: 257 new tokens minus 1, over 256. Every arm runs CUDA graphs, over
# the eager step (`tp1`, `tp2`), over inductor's (`tp1-inductor`, `tp2-inductor`), or over
# inductor's with asynchronous scheduling, the engine's defaults (`tp1-default`, `tp2-default`).
# The floor of a step is now per GPU: its shard of the weights and its heads' share of the history,
# over the copy bandwidth. A profile of rank 0 gives the time its NCCL kernels took per step. That
# time includes any wait for the other rank, so it bounds the communication from above.
#
# Issue 15's target: Llama-3.1-8B at batch 1 at least 1.5x faster at TP = 2 than at TP = 1.

# %%
two = lab.load_table("day62_tp", "h200x2")
one = lab.load_table("day62_tp", "h200")
measured_tp = two if two is not None else one
if measured_tp is not None:
    print("measured on:", lab.table_label(measured_tp).caption().replace("; ", ";\n  "))
    shown = ["model", "label", "batch", "ms_per_step", "floor_ms", "x_floor", "nccl_us_per_step",
             "nccl_calls_per_step", "error"]
    lab.show(measured_tp[[c for c in shown if c in measured_tp]].round(3))
    fig = lab.plot_tp_steps(measured_tp)
    tp_label = dataclasses.replace(lab.table_label(measured_tp), model=" and ".join(dict.fromkeys(measured_tp.model)))
    if ON_GPU or not lab.figure_path("day62_tp", tp_label.device_slug).exists():
        lab.save_figure(fig, "day62_tp", tp_label)
    lab.show(fig)
if two is None:
    print("data/day62_tp_h200x2.csv is not committed: TP=2 has not run on two GPUs yet.\n"
          "  `scripts/gpu_run.sh tp` on nvidia-h200-x2 makes it (the NCCL tests, then `python -m nanolab tpbench\n"
          "  --models llama-3.2-1b,llama-3.1-8b`, whose engines opt into the NCCL path with unverified_nccl=True);\n"
          "  the rows above are TP=1 on one H200.")
else:
    lab.show(lab.speedups(two).round(3))
    print(lab.target_line(two))

# %% [markdown]
# *Figure 62.1: ms per decode step by batch. Each bar is an arm; the black tick on it is that arm's
# floor per GPU.*
#
# On one H200, TP = 1 with an eager step is already close to its floor for the 8B model (about
# 1.3x at batch 1): at 16 GB, the weights dwarf the fixed costs of a step. The 1B model is further
# from its floor, because its step's fixed costs, the launches and the small kernels between the
# projections, weigh more next to 2.5 GB of weights. That already says where a second GPU can pay:
# only the weights' share of a step halves.

# %% [markdown]
# ## Beyond one host, on paper
#
# The group joins the standard way, `init_process_group("env://")` with `MASTER_ADDR`, `MASTER_PORT`,
# `RANK` and `WORLD_SIZE` as torchrun sets them. So the collectives would span hosts unchanged.
# Two things tie it to one host now. `Workers` starts the workers itself, and the step calls travel
# down pipes. A rank on another host would take its calls from a socket instead.
#
# The harder question is whether a group across hosts would be worth it. A step's collectives are
# small at decode: an all-reduce at batch 1 moves one hidden vector, 8 KB for the 8B model. So what
# counts is each call's latency, not bandwidth, and that is where a network differs from NVLink.
# The arithmetic below puts each GPU's shard over HBM bandwidth and adds the step's collectives
# over a link, as a latency per call plus the bytes over the link's bandwidth. NVLink's 5 us is in
# the range measured on H100 and H200 machines; the two network rows are orders of magnitude, not
# measurements. Llama-3.1-70B is the case that needs more than one GPU in any event: 141 GB in bf16
# does not fit one H200.

# %%
paper = lab.predicted_steps(bandwidth_tb_s=4.2)
lab.show(paper.pivot_table(index=["model", "batch"], columns="link", values="speedup", sort=False).round(2))
lab.show(paper[paper.batch == 1][["model", "link", "tp1_ms", "tp2_weights_ms", "tp2_collectives_ms",
                                  "tp2_ms"]].round(3))
fig = lab.plot_paper_speedup(paper)
# Arithmetic, not a measurement: the caption says so, and where it was drawn.
lab.save_figure(fig, "day62_paper", dataclasses.replace(
    label, model="on paper: Llama-3.2-1B, 3.1-8B and 3.1-70B shapes", weights="no", dtype="bfloat16"))
lab.show(fig)

# %% [markdown]
# *Figure 62.2: TP = 2's predicted speedup over one GPU at batch 1, for each model and each link.
# The dashed line is what two GPUs' bandwidth alone would give.*
#
# On NVLink the split pays more the larger the model, about 1.27x, 1.70x and 1.91x for the three:
# a step's collectives (33 all-reduces for 1B, 161 for 70B) grow more slowly than its weights.
# Across two hosts each call costs four to ten times as much. The 1B model then runs at half
# speed or worse. The 8B model gains a little over InfiniBand (1.18x) and loses over Ethernet. Only
# the 70B model keeps most of its gain. So more hosts are used in other ways:
#
# - **Pipeline stages.** Each host holds a contiguous run of layers and sends one hidden vector per
#   token to the next: one small message per stage per step, not two per layer. A lone request
#   gains no latency, since its token still passes through every layer in turn. What it buys is
#   memory (a model too large for one host) and, with several requests in flight at different
#   stages, throughput.
# - **Replicas behind a router.** Each host serves a whole copy of the model, tensor-parallel
#   inside the host over NVLink if it needs more than one GPU, and a router spreads the requests.
#   Throughput scales with hosts, latency stays one host's, and nothing crosses the network per step.
#
# The usual layout combines them: tensor parallelism within a host, pipeline stages or replicas
# across hosts. Nothing in this section was measured on more than one host.
