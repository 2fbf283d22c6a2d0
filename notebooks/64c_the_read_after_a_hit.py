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
# # Day 64c: the attention read after a cached prefix
#
# After a prefix hit, the prompt step feeds a few new tokens and reads every cached key before
# them. At a 2,048-token shared system prompt the step's attention read took 36 us a layer on the
# H200 ({doc}`Day 64 <64_prefix_caching>`), for about 4 MB of K and V. At a chat's second turn,
# 64 tokens after 4,128, it reads twice the keys. This chapter asks what that read is waiting on,
# and what two changes to it buy: cutting each walk into more shares, and addressing K and V
# through narrower offsets.
#
# The read (`varlen_attention`) runs one program for each query tile and KV head, and cuts each
# program's walk over the keys into shares (split-K), which a second kernel folds. A step of 50
# new tokens has only four query tiles, so for eight KV heads it has 32 programs before any
# sharing, on a GPU of 132 SMs. `choose_varlen_splits` picked the fewest shares that reached one
# program an SM.

# %%
import torch

import nanolab.lab as lab
from nanolab.kernels.varlen_attention import WAVES, choose_varlen_splits, varlen_attention, varlen_reference

H100 = "h100-80gb-hbm3"
COMMAND = 'VARLEN_ARGS="--narrow-only --cases tokens --prefix day64c" scripts/gpu_run.sh varlen'
sweep = lab.measured_table("day64c_varlen_sweep", COMMAND, slug=H100)

# %% [markdown]
# ## What the kernel holds
#
# A GPU is not needed to see what the read's kernel holds on one. `kernelres` has Triton compile
# it for sm_90 (the H100's and the H200's architecture) on this machine, and the `cuobjdump` that
# Triton's wheel ships reads the binary's registers a thread and the bytes it spills. Here at the
# engine's tiles (64 x 64, 4 warps) and Llama-3.2-1B's heads, with 64-bit addresses for K and V
# apart ("wide", the kernel as it was) and with one tensor of int32 offsets that K and V share
# ("narrow"):

# %%
resources = lab.varlen_resources()
lab.save_table(resources, "day64c_kernel_resources", lab.resources_label())
lab.show(resources.drop(columns=["kernel", "arch"]))
wide, narrow = (resources[resources.narrow == n].set_index("splits") for n in (False, True))
print(f"wide: {wide.registers.max()} registers a thread and {wide.stack_bytes.max()} bytes spilled; narrow: "
      f"{narrow.registers.max()} registers and {narrow.stack_bytes.max()} bytes")

# %% [markdown]
# The wide kernel holds 255 registers a thread, the most a thread may have, and spills the rest
# to the stack. A [64, 64] tile of 64-bit addresses takes 64 registers a thread at 4 warps, and the
# wide kernel holds two, one for K and one for V; a shared tile of int32 offsets takes 32. The
# narrow kernel spills nothing. These are the compiler's numbers, from this machine's Triton, which
# may not be the GPU image's (3.6.0); whether the spill costs time is for the timings below to say.
#
# On 2026-12-06 a device machine started, an H100 rather than an H200: `varlenbench
# --narrow-only` timed both cases, each read alone in a CUDA graph with L2 flushed, at 4, 8 and 16
# shares, at three pipeline depths, with wide and narrow offsets.

# %% [markdown]
# ## Shares and offsets, measured
#
# The rows below are each case's read alone, by shares and pipeline stages (0: the engine's
# default), wide offsets against narrow. A captured step cuts the read's grid for its capture size:
# 56 tokens for 50, and 64 for 64. There the engine chose 8 shares for the first case and 4 for
# the second.

# %%
alone = None
if sweep is not None:
    alone = sweep[(sweep.layout == "alone") & (sweep.read == "varlen")].copy()
    alone["narrow"] = alone.narrow.astype(bool)
    lab.show(alone.pivot_table(index=["case", "splits", "num_stages"], columns="narrow", values="us", sort=False)
             .round(1).rename(columns={False: "wide us", True: "narrow us"}))
    # the grid a captured step of the case is cut for: the engine's capture size, in the step's layout
    grids = sweep[sweep.layout == "step"].groupby("case").grid_tokens.first().astype(int)
    chosen = {case: choose_varlen_splits(grids[case], 1, 8, 4) for case in grids.index}
    # the rule before: one program an SM, the same as two on half the SMs
    before = {case: choose_varlen_splits(grids[case], 1, 8, 4, num_sms=132 // WAVES) for case in grids.index}
    print("shares in a captured step, before and now:", {c: (before[c], chosen[c]) for c in grids.index})
    fig = lab.plot_read_shares(alone, chosen)
    lab.save_figure(fig, "day64c_read_shares", lab.table_label(sweep))
    lab.show(fig)

# %% [markdown]
# *The read after a cached prefix, alone, by shares (H100, Llama-3.2-1B's heads, bf16). Grey:
# 64-bit addresses for K and V apart; blue: int32 offsets they share. The dotted line is the
# share count the engine now chooses.*
#
# Eight shares are the fastest count for both cases, by far more than the offsets move anything:
# 50 tokens after 2,048 went from 36.7 us at 4 shares to 28.1 at 8, and 64 tokens after 4,128
# from 59.3 to 40.1. At 16 both were slower again, each share's walk then too short to pay for the
# programs and the fold. Narrow offsets were faster in each of the 18 pairs, by 1% to 9%.
#
# ## What the engine now does
#
# - `choose_varlen_splits` cuts walks until the grid holds two programs an SM (`WAVES`), not one.
#   The second turn's step of 64 tokens then takes 8 shares, as the 50-token step already did.
#   Steps of 512 tokens already hold 264 programs unshared and stay at one share, and a row known
#   to be short still reads in one (the rule's `max_context`).
# - `varlen_attention` addresses K and V through one tensor of int32 offsets wherever the pools
#   allow it: the same strides, and fewer than 2**31 elements (`narrow_fits`). A larger pool, like
#   the bench's 4 GiB one, keeps 64-bit addresses.

# %%
print(f"two programs an SM (WAVES = {WAVES}) on 132 SMs: " + ", ".join(
    f"{n} tokens -> {choose_varlen_splits(n, 1, 8, 4)} shares" for n in (16, 56, 64, 128, 256, 512)))
if alone is not None:
    for case, g in alone.groupby("case", sort=False):
        old = g[(g.splits == before[case]) & (g.num_stages == 0) & ~g.narrow].us.min()
        new = g[(g.splits == chosen[case]) & (g.num_stages == 0) & g.narrow].us.min()
        print(f"{case}: the engine's read {old:.1f} us before, {new:.1f} us now ({old / new:.2f}x), "
              f"about {16 * (old - new) / 1e3:.2f} ms off a 16-layer prompt step (predicted, not measured)")

# %% [markdown]
# At 8 shares each share of these two cases walks at least five 64-key tiles, so the engine's
# fewest tiles a share (four) and the bench's (one) cut the same walks.
#
# The prediction, made from the read alone: almost nothing off the shared prefix's 2.9 ms prompt
# step, whose read already took 8 shares and gains only the offsets, and about 0.3 ms off the
# second turn's 3.4 ms on the H100. Read inside a graphed step, the same launch has taken longer
# than alone (Day 64), so the step may gain more or less than this; the next
# `scripts/gpu_run.sh prefix` measures it.
#
# ## The gates
#
# Every read the bench timed matched the reference to bf16's rounding, narrow or wide, except the
# narrow read of the 4 GiB pool, which the read refuses by name. Here, on any machine, a small step
# of both kinds reads what the reference reads: two segments after cached keys, in the interpreter
# on a CPU.

# %%
if sweep is not None:
    refused = sweep[sweep.error.fillna("") != ""]
    assert refused.error.str.contains("narrow offsets need").all() and (refused.layout == "step, large pool").all()
    ok = sweep[sweep.error.fillna("") == ""]
    assert (ok.max_err < 4e-3).all(), "a timed read differs from the reference past bf16's rounding"
    print(f"{len(ok)} timed reads matched the reference (largest error {ok.max_err.max():.4f}); "
          f"{len(refused)} narrow reads of the 4 GiB pool were refused")

g = torch.Generator().manual_seed(0)
page, kv_heads, heads, d = 4, 2, 4, 16
lens, new = [70, 23], [5, 3]
k_pool, v_pool = (torch.randn(64 * page + 1, kv_heads, d, generator=g) for _ in range(2))
table = torch.randperm(64, generator=g)[:40].view(2, 20).to(torch.int32)
case = dict(q=torch.randn(sum(new), heads, d, generator=g), k_pool=k_pool, v_pool=v_pool, block_table=table,
            table_rows=torch.arange(2), block_size=page, query_start_loc=torch.tensor([0, new[0], sum(new)]),
            context_lens=torch.tensor(lens),
            positions=torch.tensor([p for n, c in zip(new, lens) for p in range(c - n, c)]))
ref = varlen_reference(**case)
for narrow in (False, True):
    got = varlen_attention(**case, max_query_len=max(new), splits=2, share_tiles=1, narrow=narrow, block_m=16,
                           block_n=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
print("wide and narrow offsets, two shares: the reference's output")

# %% [markdown]
# ## Summary
#
# - After a cached prefix, the read's share count mattered far more than its addressing: on an
#   H100, 8 shares read 64 tokens after 4,128 in 40.1 us, where the engine's 4 took about 59; 50 tokens
#   after 2,048, which a captured step already read in 8, took 28.1.
# - The engine now cuts walks until the grid holds two programs an SM, and addresses K and V
#   through shared int32 offsets where its pools allow: measured 1% to 9% faster alone.
# - Predicted from the read alone, and not yet measured in a step: about 0.3 ms off the second
#   turn's prompt step, and almost nothing off the shared prefix's.
