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
# # Days 59 and 60: the streamed kernel
#
# Every decode step ends in the same read, and since the engine core that read has been
# `paged_attention_batched_reference`. It gathers K and V for the whole `[rows, width]` slot
# mapping and scores a `[rows, heads, 1, width]` rectangle before it masks. Days 52 to 56 were
# built around that rectangle. The width axis of the capture list exists because the rectangle
# grows with it, the shared pool is sized by it, and the warm-up captures 36 shapes of it. Day 59
# writes the read that never builds it, in Triton (`nanolab/kernels/paged_attention.py`):
#
# - **"head"**: the seed's grid and vLLM's, with one program per (row, query head);
# - **"gqa"**: one program per (row, KV head), with the query heads that share the KV head packed
#   into the tile, so each K/V tile is loaded once per group;
# - **"split"**: "gqa" with each row's walk cut into shares (split-K, as in flash-decoding), for
#   batches too small to fill the GPU.
#
# Each program walks `cdiv(ctx, BLOCK)` tiles of its own row and folds every tile into an online
# softmax (running max, denominator, accumulator). Day 60 wires it in: the kernel reads the
# block table directly, so the read has no width at all, and the cache chooses the read.
#
# On a CPU the kernels run in Triton's interpreter (fp32), so everything below except the
# device timings runs in CI.

# %%
import pandas as pd
import torch

from nanolab import Engine, SamplingParams, load_model, resolve_weights
from nanolab.bench import random_prompts, time_nanolab
from nanolab.buckets import DecodeBuckets
from nanolab.captured import (
    SEED_STREAMBENCH,
    render_streambench,
    spread_lengths,
    streambench_table,
    streamed_work,
    streamed_workspace_bytes,
    workspace_bytes,
)
from nanolab.kernels.paged_attention import (
    choose_variant,
    kernel_agreement,
    paged_attention_batched_kernel,
    paged_attention_table_kernel,
    tile_lanes,
)
from nanolab.paged_attention import paged_attention_batched_reference
from nanolab.plots import plot_streamed_read
from nanolab.report import chapter_target, load_table, run_label, save_figure, save_table, show
from nanolab.streambench import read_batch
from nanolab.weights import weights_kind

DEVICE, MODEL, DTYPE = chapter_target(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
path = resolve_weights(MODEL)
label = run_label(DEVICE, MODEL, DTYPE, weights=weights_kind(path))
print(label.caption())

# %% [markdown]
# ## What each read holds
#
# The rectangle is `rows * heads * width` fp32 scores. One streamed program holds a `[BLOCK]`
# score tile instead, so the two differ by `width / BLOCK` and nothing else: rows and heads appear
# in both and cancel. The streamed read also walks only each row's own tiles, while the rectangle
# charges every row the widest row's history. The seed's host-only table is rebuilt below from
# that arithmetic (`nanolab.captured`), and it must match the seed's print exactly.

# %%
table = streambench_table()
save_table(table, "day59_streambench_host", label)
print(render_streambench(table))
assert render_streambench(table) == SEED_STREAMBENCH
assert workspace_bytes(256, 32, 8192) / streamed_workspace_bytes(256, 32, 128) == 64

# %% [markdown]
# The uniform rows stay in the table. Their walk saving is exactly 1.00x, and that is the point:
# the memory saving holds for every batch, while the walk saving is the spread of lengths, which
# continuous batching creates.
#
# ## The kernel against the oracle
#
# Three batches at the chapter's head shape (32 query heads over 8 KV heads, head_dim 64, fp32),
# with 128-key tiles. Every batch's blocks are scattered through the pool at random, as a server
# leaves them. Agreement is printed row by row's worst, as the seed printed it, for the variant
# `choose_variant` picks and for each of the others.

# %%
HEADS, KV_HEADS, HEAD_DIM, TILE = 32, 8, 64, 128
kernel_dtype = torch.float32 if not ON_GPU else torch.bfloat16
batches = {"uniform": [300, 300, 300], "ragged": [700, 40, 260, 129], "long tail": spread_lengths(8, 512, "long tail")}
agreement = []
for name, lengths in batches.items():
    b = read_batch(lengths, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=kernel_dtype, device=DEVICE)
    auto = choose_variant(len(lengths), HEADS, KV_HEADS, max(lengths), block=TILE)
    for variant in ("head", "gqa", "split"):
        a = kernel_agreement(name, b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                             variant=variant, block=TILE)
        if variant == auto:
            print(a.line, f"({variant}, chosen)")
        agreement.append({"batch": name, "rows": len(lengths), "variant": variant, "chosen": variant == auto,
                          "worst": a.worst})
agreement = pd.DataFrame(agreement)
save_table(agreement, "day59_agreement", label)
show(agreement.pivot(index="batch", columns="variant", values="worst"))
assert (agreement.worst < (1e-5 if kernel_dtype == torch.float32 else 2e-2)).all()

# %% [markdown]
# ## A load that did not happen
#
# The reference needs its padding to name a legal slot: it really loads it and masks the result
# afterwards. Poison every slot outside the batch's histories with NaN, the sink that the padding
# `-1` names included, and the reference's short rows turn NaN. The kernel neutralises an offset
# before it forms an address, so it never issues those loads. Its output stays finite, and it
# equals the clean answer.

# %%
b = read_batch(batches["ragged"], heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=kernel_dtype,
               device=DEVICE)
clean = paged_attention_batched_reference(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                                          validated=True)
live = set(b.slot_mapping[b.slot_mapping >= 0].tolist())
dead = [s for s in range(b.k_pool.shape[0]) if s not in live]
b.k_pool[dead], b.v_pool[dead] = float("nan"), float("nan")
oracle = paged_attention_batched_reference(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                                           validated=True)
kernel = paged_attention_batched_kernel(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                                        validated=True, block=TILE, variant="gqa")
table_read = paged_attention_table_kernel(b.q, b.k_pool, b.v_pool, b.block_table, b.table_rows, 16,
                                          b.context_lens, b.positions, block=TILE, variant="gqa")
short = b.context_lens < b.context_lens.max()
print(f"reference: {int(oracle.isnan().any(dim=(1, 2, 3)).sum())} of {len(short)} rows NaN; "
      f"kernel: {int(kernel.isnan().any(dim=(1, 2, 3)).sum())}; table-addressed kernel: "
      f"{int(table_read.isnan().any(dim=(1, 2, 3)).sum())}")
assert oracle[short].isnan().all() and kernel.isfinite().all() and table_read.isfinite().all()
tolerance = dict(rtol=1e-5, atol=1e-5) if kernel_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
torch.testing.assert_close(kernel, clean, **tolerance)
torch.testing.assert_close(table_read, clean, **tolerance)

# %% [markdown]
# ## The walk, counted by the loop
#
# `streamed_work` is host arithmetic, and the loop is the kernel; nothing forces them to agree. So
# the kernel counts: with `tile_counts`, every program adds the tiles it walked to its row. On the
# seed's long-tail batch (one row at 2,048 tokens, seven at 256), the loop must walk 30 tiles where
# the rectangle scores 128.

# %%
lengths = spread_lengths(8, 2048, "long tail")
b = read_batch(lengths, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=kernel_dtype, device=DEVICE)
counts = torch.zeros(len(lengths), dtype=torch.int32, device=DEVICE)
paged_attention_batched_kernel(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                               validated=True, block=TILE, variant="gqa", tile_counts=counts)
work = streamed_work(lengths, TILE)
walked = int(counts.sum()) // tile_lanes("gqa", HEADS, KV_HEADS)
print(f"the loop walked {walked} tiles; streamed_work says {work.walked}; the rectangle scores {work.rect_tiles} "
      f"({work.ragged_saving:.2f}x)")
assert walked == work.walked == 30 and work.rect_tiles == 128

# %% [markdown]
# ## Day 60: the wiring
#
# `paged_attention_table_kernel` addresses each key as `block_table[row, p // B] * B + p % B`
# inside the kernel, so a planned step hands it the cache's persistent block table (Day 51) and
# nothing of any width. `BatchedPagedKVCache.streamed_read` picks the read. A streamed view derives
# no slot mapping and no mask, and prefill, which has several queries a row, stays on the
# reference. The acceptance test is the engine's own output: the same greedy tokens through
# either read.

# %%
model = load_model(path, dtype=DTYPE, device=DEVICE)
prompts = random_prompts(3, 24, model.config.vocab_size, seed=3).tolist()
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def greedy(engine: Engine) -> list[list[int]]:
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [s.output_token_ids for s in seqs]


reference_tokens = greedy(Engine(model, num_blocks=32))
streamed_tokens = greedy(Engine(model, num_blocks=32, streamed_read=True))
print(f"{MODEL}, {DTYPE}: streamed read decodes the reference's tokens: {streamed_tokens == reference_tokens}")
if DTYPE == torch.float32:  # in bf16 the two reads round differently, and random weights have near-ties
    assert streamed_tokens == reference_tokens

# %% [markdown]
# ### The default, per device
#
# The seed kept the streamed read off by default because its kernel was a Python loop. This kernel
# is Triton, but on a CPU Triton has only its interpreter, which runs each program as Python. Here
# is what that costs per decode step, measured now:

# %%
steps = 3
arms = {"reference": Engine(model, num_blocks=32), "streamed": Engine(model, num_blocks=32, streamed_read=True)}
timing = pd.DataFrame([{"read": name, "ms_per_step": time_nanolab(engine, random_prompts(2, 24,
                        model.config.vocab_size), steps, repeats=1).ms_per_step} for name, engine in arms.items()])
save_table(timing, "day60_read_cost", label)
show(timing)

# %% [markdown]
# On the CPU the reference stays the default. On a GPU the answer comes from the measurement
# below. Until the H200 has measured the streamed read against the rectangle inside the engine,
# `streamed_read` stays off there too.
#
# ### The capture list loses an axis
#
# With no width in the read, a captured graph serves every context length. `DecodeBuckets` keeps
# its batch axis alone, so the seed's 36 shapes become 6. The pool no longer holds a rectangle.

# %%
full, narrow = DecodeBuckets.default(), DecodeBuckets.default().without_width()
print(f"capture list: {len(full)} shapes with the rectangle, {len(narrow)} without: {narrow.shapes}")
assert (len(full), len(narrow)) == (36, 6)
print(f"largest bucket's scores: {workspace_bytes(32, 32, 8192) / 1e6:.1f} MB as a rectangle, "
      f"{streamed_workspace_bytes(32, 32, TILE) / 1e6:.2f} MB as tiles")

# %% [markdown]
# ## On the H200
#
# `python -m nanolab streambench` times one layer's read at bf16, 32/8 heads, head_dim 64. It
# runs the reference, each variant, the table-addressed read, and torch's SDPA flash kernel over
# an equivalent contiguous cache. The shapes are 64 x 8,192, 8 x 2,048, 256 x 1,024 and a long-tail
# batch. Bandwidth counts only the K/V bytes the batch holds.

# %%
measured = load_table("day59_streambench", "h200")
if measured is None:
    print("not measured yet: data/day59_streambench_h200.csv is absent (run scripts/gpu_run.sh stream on a GPU)")
else:
    show(measured.pivot(index="shape", columns="arm", values="us").round(1))

# %%
fig = plot_streamed_read(table, spread_lengths(8, 2048, "long tail"))
save_figure(fig, "day59_streamed_read", label)
show(fig)
