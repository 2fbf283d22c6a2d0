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
# # Day 64b: what a warm hit pays the host
#
# {doc}`Day 64 <64_prefix_caching>` left prefix caching short of its 5x aim on the H200. A warm
# hit on a shared 2,048-token prompt took 5.6 ms against 17.4 ms with caching off, 3.1x. A chat's
# second turn over 4,096 tokens took 7.9 against 35.9 ms, 4.5x. About half of the warm hit's time
# was outside the engine's prompt step. This chapter asks which of those host costs grow with the
# prompt, and how much of them the server can stop paying.
#
# No GPU was lent on 2026-12-05, so the first run of this chapter measured everything on this
# repository's 2-core CPU machine, took the H200's numbers from Day 64's committed tables, and
# labelled what it said the H200 would gain as a prediction. On 2026-12-06 an H100 ran the server
# bench with the changes; its numbers are the chapter's last section.

# %%
import json

import orjson
import pandas as pd

import nanolab.lab as lab
from nanolab.entrypoints.openai import protocol

SPLIT = ["front_ms", "core_wait_ms", "step_host_ms", "server_prefill_ms", "between_steps_ms", "back_ms"]

# %% [markdown]
# ## The split on the H200
#
# prefixbench splits each request's TTFT using the server's step log. **Front** runs from the
# client's send to the engine core taking the request. **Core wait** runs from there to the first
# prompt step. **Step host** is the host work inside the step calls: scheduling, the prefix
# lookup, and emitting the token. **Prefill** is the prompt steps' own time, and **back** is the
# token's way to the client. These are the warm requests of Day 64's third run:

# %%
h200 = lab.measured_table("day64_ttft", "scripts/gpu_run.sh prefix")
warm = h200[h200.phase.isin(["warm", "turn 2"])].set_index(["part", "arm"])
lab.show(warm[["prompt_len", "ttft_p50_ms", *SPLIT]].round(2))
on = warm.xs("on", level="arm")
slope = (on.front_ms["multi-turn"] - on.front_ms["shared prefix"]) / (
    on.prompt_len["multi-turn"] - on.prompt_len["shared prefix"]) * 1e3
print(f"front, caching on: {on.front_ms['shared prefix']:.2f} ms at {on.prompt_len['shared prefix']:,.0f} ids and "
      f"{on.front_ms['multi-turn']:.2f} ms at {on.prompt_len['multi-turn']:,.0f}: {slope:.2f} us an id")
for part in ("shared prefix", "multi-turn"):
    aim = warm.ttft_p50_ms[part, "off"] / 5
    print(f"{part}: 5x needs {aim:.2f} ms, {warm.ttft_p50_ms[part, 'on'] - aim:.2f} ms under today's")

# %% [markdown]
# Front grows by about half a microsecond for each prompt id. At 4,192 ids it is 2.7 ms, a third
# of the second turn's TTFT. Step host grows too, from 0.6 to 1.1 ms, because a hit looks up and
# shares one block for every 16 ids. Prefill and back hardly change with the prompt's length.
#
# A prompt sent as token ids is thousands of numbers. The client writes them as JSON text, and the
# server parses that text back into Python ints. It checks each id's type and range, and packs
# the ids for the engine's process. The engine then turns them back into a list. The prefix lookup
# packed the ids into bytes once more to key its blocks. None of this depends on the GPU, so this
# CPU can time each stage.
#
# ## Stage by stage
#
# `frontcosts` times each stage of a request's host work alone, in one process, over random ids
# of Llama 3's vocabulary. No pipe, socket or step is involved, so these numbers are the CPU work
# each stage does, without the wake-ups between processes. Two stages changed today. For each,
# the design it replaced runs beside it as the "before" arm:
#
# - **parse:** the server now reads the body with `orjson` rather than the standard `json`
#   module.
# - **lookup:** the engine keeps each prompt as the bytes its check packed
#   (`Sequence.prompt_bytes`), and a new request's blocks are keyed from those bytes. The old
#   lookup re-packed the prompt's list of ids.
#
# The client's encoding ("encode") is the client's work, and no change to the server makes it
# faster. It stays in TTFT, which counts from just before the POST, as `vllm bench serve` counts
# it. prefixbench now also records it for each request (`encode_ms`).

# %%
costs = lab.front_costs((512, 2048, 4096))
fig = lab.plot_front_costs(costs)
front_label = lab.front_label()
lab.save_table(costs, "day64b_front", front_label)
lab.save_figure(fig, "day64b_front", front_label)
lab.show(fig)
lab.show(costs.pivot_table(index=["stage", "arm"], columns="prompt_len", values="us", sort=False).round(1))
totals = lab.front_totals(costs).set_index("prompt_len")
lab.show(totals.round(1))
by = costs.set_index(["prompt_len", "stage", "arm"]).us
for stage in ("parse", "lookup"):
    print(f"{stage}: the old design over the new, " + ", ".join(
        f"{by[n, stage, 'before'] / by[n, stage, 'now']:.1f}x at {n:,} ids" for n in (512, 2048, 4096)))

# %% [markdown]
# On this machine, encoding, parsing and checking dominate the per-id work. For the parse,
# `orjson` is about three times faster than `json`: 2.8x at the longer prompts on the machine that
# wrote this. A lookup from the packed bytes is about 1.7 times faster, because it skips a re-pack
# that was two fifths of the old lookup. At 4,096 ids the two changes save about 0.2 ms of a
# request's host work.
#
# The two parsers do not accept exactly the same inputs. `orjson` refuses NaN, infinities and lone
# UTF-16 surrogates, all of which the standard module lets through. It refuses nesting deeper than
# 1,024 levels as a syntax error, rather than running out of recursion. It reads an integer too big
# for 64 bits as a float. The server already refused each of these, either as bad JSON or when it
# checked the field, so each still gets a 400. `tests/test_server.py` sends every one. On a valid
# request the two parsers agree:

# %%
ids = list(range(0, 128_000, 31))
body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0.5, "stop": ["\u00e9"],
                   "logprobs": 2, "echo": True, "seed": 2**63 - 1}).encode()
assert orjson.loads(body) == json.loads(body), "orjson and json read a request differently"
assert protocol.parse_request(orjson.loads(body), chat=False, model="m") == \
    protocol.parse_request(json.loads(body), chat=False, model="m")
print(f"a body of {len(ids):,} ids and every kind of field: the same request from both parsers")

# %% [markdown]
# ## The warm hit through the server, before and after
#
# prefixbench ran twice on this CPU with SmolLM2-135M's real weights: once at the commit before
# these changes, and once after. Each run sent requests one at a time over one kept-alive
# connection. The shared part had a 2,048-token system prompt, and the chat part had a 4,096-token
# history. On a CPU the prompt step itself takes hundreds of milliseconds, so these runs' TTFT
# ratios say nothing about a GPU, and only the host columns mean anything here. Each column is the
# median of 9 warm requests, or of 5 second turns.

# %%
command = ("python -m nanolab prefixbench --model smollm2-135m --device cpu --parts shared,turns "
           "--system-len 2048 --suffix-len 32,64 --shared-requests 10 --max-tokens 4 --history-len 4096 "
           "--question-len 32 --turn1-tokens 32 --conversations 5 --prefix {}")
runs = {"before": lab.measured_table("day64hostbefore_ttft", command.format("day64hostbefore") + " (at 8d395b3)",
                                     slug="cpu", where="the 2-core CPU machine"),
        "after": lab.measured_table("day64host_ttft", command.format("day64host"), slug="cpu",
                                    where="the 2-core CPU machine")}
cpu = pd.concat({run: t.set_index(["part", "phase", "arm"]) for run, t in runs.items()}, names=["run"])
hits = cpu.xs("on", level="arm")[cpu.xs("on", level="arm").cached_tokens > 0]
lab.show(hits[["prompt_len", "cached_tokens", "front_ms", "core_wait_ms", "step_host_ms", "back_ms",
               "encode_ms"]].round(3))
host = hits.front_ms + hits.core_wait_ms + hits.step_host_ms
for part, phase in (("shared prefix", "warm"), ("multi-turn", "turn 2")):
    before, after = host["before", part, phase], host["after", part, phase]
    print(f"{part}, {phase}: front, core wait and step host {before:.2f} ms before, {after:.2f} after "
          f"({before - after:.2f} ms less), of which the client's encoding "
          f"{runs['after'].set_index(['part', 'phase', 'arm']).encode_ms[part, phase, 'on']:.2f} ms")

# %% [markdown]
# Before the step, the host's share of a warm hit fell by 0.33 ms at the shared prefix and by
# 0.14 ms at the second turn. The stage table predicts about 0.1 and 0.2 ms: the parse and the
# re-pack. With nine requests per run, or five second turns, the difference is within the spread.
# With caching off, where only the parse changed, front fell by 0.30 ms at the shared prefix and
# did not move at the second turn. The client's encoding is in front in both runs: 0.18 ms at
# 2,096 ids and 0.37 ms at 4,192 in the second. Back cannot be compared on this machine. Across
# the rows of both runs it ranged from 0.6 to 5.7 ms, because three processes share two cores, and
# after each step the core's compute threads hold the cores for a while.
#
# ## What is left: the host after it idles
#
# The stage table times each stage as the fastest of warm loops. A served request meets each stage
# once, after a wait: between two of these requests the core waits for the client, and the
# server's event loop waits for both. A request also wakes three processes in turn (the client,
# the server's event loop and the engine core), and no stage above counts a wake-up.
# `idle_costs` times both after the host has idled for 0 to 50 ms: a round trip through a pipe to
# a process blocked reading it (two wake-ups, as a post to the core and the core's reply make),
# and one pass of the engine's stages at 2,048 ids (the stage table's "now" and "both" arms
# without the client's encode), each timed once; the median of 40 of each.

# %%
idle = lab.idle_costs()
lab.save_table(idle, "day64b_idle", front_label)
lab.show(idle.pivot_table(index="what", columns="gap_ms", values=["us_p50", "us_p90"], sort=False).round(0))
fastest = costs[(costs.prompt_len == 2048) & costs.arm.isin(["now", "both"]) & (costs.stage != "encode")].us.sum()
passes = idle[idle.what == "stages"].set_index("gap_ms").us_p50
trips = idle[idle.what == "pipe round trip"].set_index("gap_ms").us_p50
print(f"the stages at 2,048 ids, the fastest warm loops summed: {fastest:.0f} us; a single pass's median "
      + ", ".join(f"{passes[g] / fastest:.1f}x that after {g:g} ms idle" for g in passes.index))
print("a pipe round trip's median: " + ", ".join(f"{trips[g]:.0f} us after {g:g} ms" for g in trips.index)
      + f"; after 10 ms, {trips[10.0] / trips[1.0]:.1f}x and a pass {passes[10.0] / passes[1.0]:.1f}x "
        "what they took after 1 ms")
for slug, table in lab.committed_tables("day64b_idle").items():
    if slug != "cpu":  # a GPU host's run (`scripts/gpu_run.sh prefix` runs frontcosts)
        print(f"{slug}'s host:")
        lab.show(table.pivot_table(index="what", columns="gap_ms", values="us_p50", sort=False).round(0))

# %% [markdown]
# Both grew with the gap. In the run committed with this chapter (`data/day64b_idle_cpu.csv`), a
# single pass of the stages took 1.4 times the fastest warm loops summed with no gap, 2.4 times
# after 1 ms, and 4.1 to 4.5 times after 10 or 50 ms. Part of the first ratio is only how each is
# taken: a median of single passes against the fastest of seven loops. A pipe round trip took
# 0.07 ms with no gap, 0.11 ms after 1 ms, and 0.38 to 0.39 ms after 10 ms or more. The round trip
# includes waking the peer; a likely cause of its growth is the hypervisor halting an idle virtual
# CPU, which then costs more to wake than a process on a running one. The pass's timer starts
# after the sleep has returned, so its growth is something else, such as caches or a clock that
# slowed while idle; this run cannot tell which.
#
# Under `scripts/test.sh` another notebook's kernel runs on the second core meanwhile, so the
# numbers printed above move from run to run. `python -m nanolab frontcosts` writes the same
# table from a quiet machine.
#
# What this suggests for front, without measuring it: a request to an idle server pays such costs
# in the client, the server and the core, a part of a millisecond that the stage table does not
# count and that fewer bytes would not obviously shrink. A core that polled its pipe instead of
# blocking on it would keep its CPU awake, at the price of a core spinning. On this 2-core machine
# that core would take half the CPU from the server and the client, so only a GPU host's many
# cores can say whether it pays. The engine core still blocks.
#
# ## What this predicts for the H200
#
# The H200 host's front grew by 0.50 us an id. On this CPU, the stages that run before the core
# takes a request (encode, parse, fields, check and post) grow by several times less (printed
# below). So either the H200 host does this work more slowly, or it does more work than these
# stages count. The saving predicted below takes the stages' savings twice: at this CPU's speed,
# and scaled by the ratio of the two slopes, so that the per-id work matches the H200's front.
# Both are models, not measurements. With caching off a request saves the parse; with caching on
# it also saves the re-pack before its lookup. `scripts/gpu_run.sh prefix` now also runs
# `frontcosts` on the GPU's host, and that run will replace the scaling with the host's own numbers.

# %%
front_stages = ["encode", "parse", "fields", "check", "post"]
per_id = (costs[costs.stage.isin(front_stages) & costs.arm.isin(["before", "both"])]
          .groupby("prompt_len").us.sum())
cpu_slope = (per_id[4096] - per_id[512]) / (4096 - 512)
scale = slope / cpu_slope
print(f"before the core, a request's stages grow {cpu_slope:.2f} us an id on this machine; the H200's front "
      f"{slope:.2f}: scaled {scale:.1f}x")
saved = by.xs("before", level="arm") - by.xs("now", level="arm")
rows = []
for part, n in (("shared prefix", 2048), ("multi-turn", 4096)):
    off_us = saved[n, "parse"] + saved[n, "post"]  # us at n ids on this CPU; caching on saves the re-pack too
    on_us = off_us + saved[n, "lookup"]
    for model, f in (("at this CPU's speed", 1.0), (f"scaled {scale:.1f}x to the H200's front", scale)):
        on_ms = warm.ttft_p50_ms[part, "on"] - f * on_us / 1e3
        off_ms = warm.ttft_p50_ms[part, "off"] - f * off_us / 1e3
        rows.append({"part": part, "model": model, "on_ms": on_ms, "off_ms": off_ms, "off_over_on": off_ms / on_ms,
                     "of_the_5x_aim": off_ms / on_ms / 5})
prediction = pd.DataFrame(rows)
lab.show(prediction.round(2))

# %% [markdown]
# Neither part reaches the aim. The second turn comes closest: about 4.65x at this CPU's speed and
# about 4.9x scaled, 0.93 to 0.98 of 5x, on the machine that wrote this. The shared prefix moves
# only to about 3.1x to 3.2x. What remains there is the 50-token step, 2.5 ms of which 1.7 ms is
# kernels, and the fixed path of wake-ups around it. The host cannot close that gap alone. The next
# lever is the step itself. Its attention read takes 36 us a layer for about 4 MB of K/V
# (chapter 64), far more than those bytes need.
#
# ## Measured on an H100
#
# On 2026-12-06 a device machine started, an H100 rather than an H200, and `scripts/gpu_run.sh
# prefix` ran there with these changes (`--prefix day64b`). The ratios are each taken in one run,
# caching on against off; the H200's above came from another machine, whose host is not this one,
# so the two runs' host columns compare only loosely.

# %%
H100 = "h100-80gb-hbm3"
ratios = lab.measured_table("day64b_ratios", 'PREFIX_ARGS="--prefix day64b" scripts/gpu_run.sh prefix', slug=H100)
if ratios is not None:
    lab.show(ratios[["ratio", "value", "aim", "met"]].round(3))
    h100 = lab.load_table("day64b_ttft", H100)
    after = h100[h100.phase.isin(["warm", "turn 2"])].set_index(["part", "arm"])
    lab.show(pd.concat({"H200, before (Day 64)": warm[["ttft_p50_ms", *SPLIT]],
                        "H100, after": after[["ttft_p50_ms", *SPLIT]]}, names=["run"]).round(2))
    by_ratio = ratios.set_index("ratio").value
    print(f"the second turn: {by_ratio['multi-turn, turn 2: TTFT p50 off / on']:.2f}x on the H100, "
          f"{by_ratio['multi-turn, turn 2: TTFT p50 off / on'] / 5:.2f} of the 5x aim; the shared prefix "
          f"{by_ratio['shared prefix, warm: TTFT p50 off / on']:.2f}x, "
          f"{by_ratio['shared prefix, warm: TTFT p50 off / on'] / 5:.2f} of it")

# %% [markdown]
# On the H100 the second turn reached 5.99x, past the 5x aim, and the shared prefix 3.49x, 0.70 of
# it. With no hits, caching kept a median 0.989 of the throughput, just under the 0.99 aim; its 95%
# interval over 30 repeats (0.988 to 0.993) includes the aim, so this run cannot say it was missed.
# Against the H200's run before these changes, the on arm's front fell from 2.67 to 1.36 ms at the
# second turn and its step host from 1.14 to 0.48 ms; the prompt steps took about what they took
# there (3.39 and 3.38 ms). Part of that fall is the change, and part is another host: the off
# arm's front fell too, from 2.27 to 1.96 ms, and the change saves the off arm only the parse. With
# these changes the second turn passed 5x on an H100; with no run before them on that machine, this
# cannot say how much of it the changes made, and the aim names the H200, where they have not run
# yet. The idle table above now has the H100 host's rows as well: a pipe round trip there took
# 0.03 ms back to back and 0.15 to 0.20 ms after 10 ms or more.
#
# ## The gates
#
# Gates check correctness, never timings. They assert that the packed and listed prompts find the
# same cached blocks at every length (`frontcosts` asserts it as it builds each stage), that both
# parsers read a request the same way (above), and that every request of both CPU runs completed
# with the tokens it asked for.

# %%
for run, table in runs.items():
    assert (table.completed == table.requests).all(), f"{run}: a request did not complete"
shared_rows = {run: lab.load_table(f"{stem}_shared", "cpu") for run, stem in
               (("before", "day64hostbefore"), ("after", "day64host"))}
for run, table in shared_rows.items():
    assert table.ok.all(), f"{run}: a shared-prefix request got the wrong tokens"
print("every request of both runs completed with its tokens; the lookups agreed at every length")

# %% [markdown]
# ## Summary
#
# - On the H200, a warm hit's front grows by about 0.5 us for each prompt id: 1.6 ms at 2,098 ids
#   and 2.7 ms at 4,192, a third of the second turn's TTFT.
# - The server now parses bodies with `orjson`, about three times faster than `json`, and still
#   answers every bad input with a 400. The engine keys a new prompt from the bytes its check
#   packed, so it skips a re-pack of every id. prefixbench records the client's JSON encoding,
#   which TTFT counts as `vllm bench serve` does.
# - On this CPU, the host's work before a warm hit's step fell by 0.33 ms at the shared prefix and
#   by 0.14 ms at the second turn, where the stages predict about 0.1 and 0.2 ms; with so few
#   requests a run, the gap is within the spread. What the stages leave out grows when the host
#   idles: in the committed run on this virtual machine, a pipe round trip took 3.3 times as long
#   after 10 ms idle as after 1 ms, and a single pass of the stages 1.9 times as long.
# - Predicted for the H200, and not yet measured there: the second turn at about 4.65x to 4.9x,
#   short of 5x, and the shared prefix at about 3.1x to 3.2x.
# - Measured on an H100 with these changes (2026-12-06): the second turn at 5.99x, past 5x, the
#   shared prefix at 3.49x, and no hits at a median 0.989 of caching off's throughput (its 95%
#   interval 0.988 to 0.993). The prompt step's
#   attention read is the next lever for the shared prefix ({doc}`Day 64c <64c_the_read_after_a_hit>`).
