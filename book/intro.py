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
# # nanolab
#
# nanolab is an inference engine for Llama-family language models, written from scratch in
# PyTorch and Triton, and this book is its engineering log. It loads real weights from
# safetensors, keeps the KV cache in fixed-size blocks, batches requests continuously, plans each
# decode step on the host, replays it as a CUDA graph, reads the cache with its own Triton
# kernel, and serves an OpenAI-compatible API. Each chapter is one day of the log: it asks a
# question, reruns the experiment that answers it, and asserts its gates.
#
# ## Where it stands
#
# One decode step, on one NVIDIA H200 with Llama-3.2-1B's shapes in bf16, against the engines
# a user would otherwise reach for, and against the floor: the time to read every weight once at
# the bandwidth the card delivers.

# %% tags=["remove-input"]
import nanolab.lab as lab

floor = lab.load_table("day61_floor", "h200")
roofline = lab.load_table("day61_roofline", "h200")
assert floor is not None and roofline is not None, "data/day61_*_h200.csv"
label = lab.table_label(floor[floor.arm == "nanolab"])
print(f"measured on: {label.caption()}")

# %% tags=["remove-input"]
fig = lab.caption_figure(lab.plot_headline(floor, roofline), label)
if not lab.figure_path("headline", "h200").exists():
    lab.save_figure(fig, "headline", label)  # drawn from the H200 tables
lab.show(fig)

# %% [markdown]
# *Figure 1: Read each line from left to right: the step's time as more sequences share it. The
# blue line is nanolab; the dashed black line is the floor no engine can beat without reading
# fewer bytes. The numbers at the left are each engine's step at batch 1.*

# %% tags=["remove-input"]
at_128 = floor[floor.context == 128]
ours = at_128[at_128.arm == "nanolab"].set_index("batch")
peers = at_128[(at_128.arm != "nanolab") & (at_128.batch == 1)]
table = peers.set_index("label")[["ms_per_step", "nanolab_speedup"]]
table.index.name = "peer at batch 1"
lab.show(table.rename(columns={"ms_per_step": "ms per step",
                               "nanolab_speedup": "its step / nanolab's"}).round(2))
print(f"nanolab at batch 1: {ours.ms_per_step[1]:.3f} ms a step, "
      f"{ours.x_floor[1]:.2f}x the floor")

# %% [markdown]
# Every number in this book was measured by code in the repository, and every table and figure
# carries the label of the run that produced it: device, model, dtype, date and library versions.
# The {doc}`results page <results>` gathers each chapter's headline numbers with their labels.
#
# ## The days
#
# - {doc}`The engine before the compiler <../notebooks/00_engine>`: the model, the paged cache and
#   continuous batching, checked against HF transformers.
# - {doc}`Day 49 <../notebooks/49_compile_guards>`: `torch.compile` over the unplanned step, and
#   why it keeps rebuilding.
# - {doc}`Day 50 <../notebooks/50_decode_plan>`: the `DecodePlan`, built on the host, moves the
#   addressing out of the forward.
# - {doc}`Days 51 to 56 <../notebooks/54_capture_buckets>`: a persistent block table, capture
#   buckets and CUDA graphs.
# - {doc}`Day 58 <../notebooks/58_graphbench>`: the real server under Poisson load, with graphs and
#   without.
# - {doc}`Days 59 and 60 <../notebooks/59_streamed_kernel>`: a paged-attention kernel in Triton
#   that streams the cache.
# - Day 61, in four chapters: {doc}`the floor and batch 1 <../notebooks/61_the_floor>`, how close a
#   decode step gets to the bandwidth floor, one lever at a time;
#   {doc}`batch 8 and the step-to-step upload <../notebooks/61b_batch_eight>`;
#   {doc}`against the peers, TTFT and chunked prefill <../notebooks/61c_against_the_peers>`; and
#   {doc}`bf16 against fp32, and the CPU <../notebooks/61d_the_cpu>`.
# - {doc}`Day 62 <../notebooks/62_two_gpus>`: tensor parallelism over two GPUs, checked against one
#   process; measured so far on one H200, with what two would give worked out from it.
# - {doc}`Day 63 <../notebooks/63_serving_tail>`: the serving tail, where the longest gaps between a
#   stream's tokens come from, and every step in a graph.
# - Day 64, in five chapters: {doc}`prefix caching <../notebooks/64_prefix_caching>`, and the
#   OpenAI surface real clients use; {doc}`what a warm hit pays the host <../notebooks/64b_the_host_path>`;
#   {doc}`the attention read after a cached prefix <../notebooks/64c_the_read_after_a_hit>`;
#   {doc}`what a warm hit is made of <../notebooks/64d_what_a_warm_hit_is_made_of>`; and
#   {doc}`the engine or the machine <../notebooks/64e_the_engine_or_the_machine>`.
# - Day 65, in five chapters: {doc}`fp8 weights <../notebooks/65_below_the_floor>`, fewer bytes a
#   step; {doc}`speculative decoding <../notebooks/65b_speculative_decoding>`, fewer steps a
#   token; {doc}`chained speculation, measured again <../notebooks/65c_chained_again>`;
#   {doc}`an fp8 prompt step that reads its bytes <../notebooks/65d_prompt_bytes>`; and
#   {doc}`one-token matches, after a draft has been kept <../notebooks/65e_earned_matches>`.
#
# ## Rerunning it
#
# `scripts/book.sh` sets up the environment, reruns every chapter on this machine and builds this
# book; `scripts/test.sh` runs the tests and every chapter's gates. On a machine without a GPU the
# chapters run the embedded SmolLM2-135M and show the committed H200 results beside the local run.
