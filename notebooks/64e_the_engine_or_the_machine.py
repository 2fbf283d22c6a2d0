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
# # Day 64e: the engine or the machine
#
# {doc}`Day 64d <64d_what_a_warm_hit_is_made_of>` ended with the warm hit's host work at about
# twice what the 5x aim leaves it, on the H100 host those runs had. It also found that host's
# processes much slower after a pause. This chapter asks how much of the gap is the engine's and
# how much the machine's. It times the same request inside the process, then runs the same server
# bench on another H100 host, and tests one lever against the pause: an engine core that polls
# its pipe instead of sleeping on it.
#
# Every new GPU number below comes from one H100 host, in five calls of one session. The engine was the
# same in every call, apart from the polling arm below.

# %%
from dataclasses import replace

import pandas as pd

import nanolab.lab as lab
from nanolab.lab.prefixbench import PREFIX_SIZES, run_prefixbench
from nanolab.lab.prefixsteps import LEDGER, PROFILED_SUFFIX
from nanolab.llm import DEFAULT_MODEL

H100, H200 = "h100-80gb-hbm3", "h200"
AIM = 5.0
SPLIT_COLUMNS = ["step_ms", "schedule_ms", "forward_host_ms", "sample_ms", "rest_ms", "graph_gpu_ms"]

# %% [markdown]
# ## The engine alone
#
# `prefixsteps` times the request inside the process (`engine_ttft`), from `add_request` to the
# first token on the host. Caching on means the engine that holds the 2,048-token system prompt;
# off means an engine of its own over the same model and pool. The two arms take turns. No HTTP,
# pipe or event loop is in this number. Beside it is the warm hit's prompt step, split on the host,
# on this host and on run i's:

# %%
gpu_ttft = lab.measured_table("day64d_prefix_ttft", 'PREFIXSTEPS_ARGS="--prefix day64d" scripts/gpu_run.sh '
                              "prefixsteps", slug=H100)
split = lab.load_table("day64d_prefix_split", H100)
split_i = lab.load_table("day64i_prefix_split", H100)
if gpu_ttft is not None:
    lab.show(gpu_ttft.groupby("arm")[["ttft_ms", "fed_tokens", "steps"]].median().round(3))
    p50 = gpu_ttft.groupby("arm").ttft_ms.median()
    engine_ratio = p50["off"] / p50["on"]
    print(f"in the process: TTFT p50 {p50['off']:.2f} ms off, {p50['on']:.2f} ms on: {engine_ratio:.2f}x "
          f"(aim {AIM:g}x)")
if split is not None and split_i is not None:
    hosts = pd.DataFrame({"this host": split[SPLIT_COLUMNS].median(), "run i's host": split_i[SPLIT_COLUMNS].median()})
    lab.show(hosts.round(3))

# %% [markdown]
# Inside the process the aim is met: 14.52 ms off against 2.62 ms on, 5.5x. The step itself hardly
# differs between the two hosts: 2.43 against 2.49 ms, with the same 1.8 ms graph and 0.59 against
# 0.65 ms of host work before it. So the engine's part of a warm hit is the same on both machines.
# Whatever separates them is outside the step.
#
# ## The same bench on this host
#
# `prefixbench --parts shared,turns` ran four times here, two pairs of runs (below, the pairs
# differ only in the engine core's polling). With the runs of chapter 64d, here is every run of
# the two ratios so far:

# %%
RUNS = (("12-03, first", "H200", "day64first", H200), ("12-03, split", "H200", "day64split", H200),
        ("12-05", "H200", "day64", H200), ("64b", "H100", "day64b", H100), ("64f", "H100", "day64f", H100),
        ("64i", "H100", "day64i", H100), ("64j", "H100", "day64j", H100),
        ("64e, 1st", "H100, this host", "day64e_nopoll", H100), ("64e, 2nd", "H100, this host", "day64e", H100),
        ("64e, 3rd", "H100, this host", "day64e2", H100), ("64e, 4th", "H100, this host", "day64e2_nopoll", H100))
runs, tables = [], []
for run, card, stem, slug in RUNS:
    ratios = lab.load_table(f"{stem}_ratios", slug)
    if ratios is None:
        print(f"data/{stem}_ratios_{slug}.csv is not committed")
        continue
    tables.append(ratios)
    for key, name in (("shared prefix", "shared prefix"), ("multi-turn", "second turn")):
        row = ratios[ratios.ratio.str.startswith(key)].iloc[0]
        runs.append({"run": run, "card": card, "ratio": name, "value": row.value, "date": row.date})
runs = pd.DataFrame(runs)
lab.show(runs.pivot_table(index=["run", "card"], columns="ratio", values="value", sort=False).round(2))
fig = lab.plot_ratio_runs(runs, AIM)
lab.save_figure(fig, "day64e_ratio_runs", replace(lab.table_label(pd.concat(tables)), device_slug="h200-h100"))
lab.show(fig)

# %% [markdown]
# The first run on the fresh machine was slower in every part, caching off as well: 16.7 ms off
# against 15.4 to 15.6 in the three after it. Those three gave the shared prefix 4.52x, 4.58x and
# 4.60x, the best so far and 0.92 of the aim. The second turn gave 7.4x to 8.1x in all four. On
# this host a warm hit takes 3.4 ms through the server, against 5.3 and 6.0 ms in runs f and j.
#
# ## Where the server's time went
#
# `warm_hit_ledger` splits a warm hit's server TTFT into parts, with the prompt step cut at its
# graph by the split of the same step on the same host. Run j (with run i's split) stands against
# the fourth run here (with this host's split):

# %%
PAIRS = (("run j, H100", "day64j", split_i), ("64e 4th, H100", "day64e2_nopoll", split))
ledgers, ttfts = [], []
for run, stem, steps in PAIRS:
    ttft = lab.load_table(f"{stem}_ttft", H100)
    if ttft is not None and steps is not None:
        ttfts.append(ttft)
        ledgers.append(lab.warm_hit_ledger(ttft, steps, aim=AIM).assign(run=run))
ledger = pd.concat(ledgers, ignore_index=True) if ledgers else None
if ledger is not None:
    lab.show(ledger.pivot_table(index=["part", "side"], columns="run", values="ms", sort=False).round(2))
    sides = ledger.groupby(["run", "side"]).ms.sum().unstack()
    summary = pd.DataFrame({"TTFT p50": ledger.groupby("run").ttft_p50_ms.first(), "host": sides.host,
                            "GPU": sides.GPU, "budget at 5x": ledger.groupby("run").budget_ms.first()})
    summary["host / its budget"] = summary.host / (summary["budget at 5x"] - summary.GPU)
    lab.show(summary.round(2))
    fig = lab.plot_warm_hit_ledger(ledger)
    lab.save_figure(fig, "day64e_warm_hit_ledger", lab.table_label(pd.concat(ttfts)))
    lab.show(fig)

# %% [markdown]
# The GPU's part is the same 1.8 ms on both hosts. The host's parts fell from 4.2 to 1.6 ms: the
# front from 1.66 to 0.65 ms, the core's wait from 0.26 to 0.05, the step's host work around the
# forward from 0.50 to 0.19, the prompt step's host share from 1.16 to 0.47, and the way back from
# 0.63 to 0.21. The host's budget at 5x is 1.31 ms here, so
# the host is at 1.2x its budget, against 2.2x in run j. Everything that moved lies outside the
# step that chapter 64d timed alone. It is the cost of crossing between processes, and of
# processes being woken up. That is the machine's.
#
# `frontcosts --parts idle --polling` timed that cost on this host: a pipe round trip, hot and
# after a pause, to a peer that sleeps on its pipe and to one that polls it, and a 2,048-id
# request's stages. Against run i's host:

# %%
idle_k, idle_i = lab.load_table("day64k_idle", H100), lab.load_table("day64i_idle", H100)
for name, idle in (("run i's host", idle_i), ("this host", idle_k)):
    if idle is None:
        continue
    table = idle.pivot_table(index="gap_ms", columns="what", values="us_p50").rename_axis("idle ms before")
    trip, stages = table["pipe round trip"], table["stages"]
    print(f"{name}: after 10 ms idle a pipe round trip took {trip[10.0]:.0f} us against {trip[0.0]:.0f} hot "
          f"({trip[10.0] / trip[0.0]:.1f}x), the stages {stages[10.0]:.0f} against {stages[0.0]:.0f} "
          f"({stages[10.0] / stages[0.0]:.2f}x)")
if idle_k is not None:
    lab.show(idle_k.pivot_table(index="gap_ms", columns="what", values="us_p50").rename_axis("idle ms before").round(1))

# %% [markdown]
# This host pays far less for a pause. A round trip after 10 ms idle cost 3.5x its hot time
# here, against 8.9x on run i's host. The stages cost 1.05x here, against 2.7x there. A peer that
# polls answered after a pause in 72 rather than 105 us.
#
# ## A core that does not sleep
#
# Polling is the obvious lever against the pause, and SGLang's scheduler polls by default (its
# `--sleep-on-idle` turns that off). So for these runs the engine got a field, `idle_poll_s`
# (d1571f9). Once idle, the server's engine core polled its pipe for that long before it slept,
# and the server's event loop polled its selector for as long after each request and each of the
# core's messages. By default it polled for 1 s on CUDA. Each pair of runs ran once with the
# default and once with `--idle-poll-s 0`, the second pair in reverse order:

# %%
POLL_RUNS = (("1st, sleeping", "day64e_nopoll"), ("2nd, polling", "day64e"), ("3rd, polling", "day64e2"),
             ("4th, sleeping", "day64e2_nopoll"))
parts = ["ttft_p50_ms", "front_ms", "core_wait_ms", "step_host_ms", "server_prefill_ms", "back_ms"]
warm = []
for run, stem in POLL_RUNS:
    ttft = lab.load_table(f"{stem}_ttft", H100)
    if ttft is not None:
        hit = ttft[(ttft.part == "shared prefix") & (ttft.phase == "warm") & (ttft.arm == "on")]
        warm.append(hit[parts].assign(run=run))
warm = pd.concat(warm).set_index("run") if warm else None
if warm is not None:
    lab.show(warm.round(3))

# %% [markdown]
# In the second pair, run in reverse, the warm hit took 3.37 ms with the core polling and 3.38
# with it sleeping. The parts polling should shrink, the core's wait and the way back, moved by
# 8 and 5 us. The first pair's gap, 3.44 against 4.35 ms, is the first run on a fresh machine:
# its off arm and its prompt steps were slower too. On this host polling buys nothing a reader
# could see, and it costs a CPU core that spins after every request. The design left the
# engine in e40705d, and its runs stay in `data/day64e*`. Whether it would pay on a host like
# run i's, where a pause costs 8.9x, is still open. That needs such a host again.
#
# ## No hits
#
# The no-hit part ran once more on this host, caching on and off in one process, 30 passes a side:

# %%
nohit = lab.measured_table("day64l_ratios", "python -m nanolab prefixbench --model llama-3.2-1b --parts nohit "
                           "--prefix day64l", slug=H100)
if nohit is not None:
    row = nohit.iloc[0]
    print(f"{row.ratio}: {row.value:.3f} (aim {row.aim}); {row.detail[:80]}")

# %% [markdown]
# The median pass ran at 0.990 of caching off, with a bootstrap interval of 0.990 to 0.991. Run
# i's host gave 0.980 (0.970 to 0.992). So the 1% aim is met on this host and missed on that one.
#
# ## On this machine
#
# The same comparison at CPU scale: the server bench's shared prefix on the embedded model, with
# 512 cached tokens and 50 new ones, the shape that chapter 64d timed inside the process on this
# CPU. A CPU has no graph to wait on and its forward is slow, so the forward is almost all of
# either number, and the two ratios come out close:

# %%
sizes = replace(PREFIX_SIZES["cpu"], system_len=512, suffix_len=(PROFILED_SUFFIX, PROFILED_SUFFIX),
                shared_requests=4, max_tokens=1)
bench = run_prefixbench(DEFAULT_MODEL, "cpu", sizes, parts=("shared",))
cpu_label = lab.run_label("cpu", DEFAULT_MODEL, "float32")
lab.save_table(bench.summary, "day64e_ttft", cpu_label)
cpu_summary = bench.summary.set_index(["phase", "arm"])
server = cpu_summary.loc[("warm", "off"), "ttft_p50_ms"] / cpu_summary.loc[("warm", "on"), "ttft_p50_ms"]
lab.show(bench.summary[["phase", "arm", "ttft_p50_ms", "cached_tokens", *parts[1:]]].round(2))
cpu_engine = lab.load_table("day64d_prefix_ttft", "cpu")
if cpu_engine is not None:
    p50 = cpu_engine.groupby("arm").ttft_ms.median()
    print(f"on this CPU: {server:.1f}x through the server, {p50['off'] / p50['on']:.1f}x inside the process "
          "(chapter 64d's run)")

# %% [markdown]
# ## The gates
#
# Every warm request with caching on found all 2,048 tokens of the system prompt cached, in every
# run here, and none with caching off. Inside the process a hit fed only its 50 new tokens, and a
# request without caching fed its whole prompt. Each ledger's parts add up to within 10% of the
# TTFT p50 they split. On this CPU each warm hit found the 512 cached tokens, and every request of
# the bench completed with its tokens.

# %%
for _, stem in POLL_RUNS:
    shared = lab.load_table(f"{stem}_shared", H100)
    if shared is None:
        continue
    hits = shared[(shared.arm == "on") & (shared.phase == "warm")].cached_tokens
    assert (hits == 2048).all() and (shared[shared.arm == "off"].cached_tokens == 0).all(), stem
if gpu_ttft is not None:
    fed = gpu_ttft.groupby("arm").fed_tokens
    assert fed.max()["on"] == PROFILED_SUFFIX and fed.min()["off"] == gpu_ttft.prompt_len.min()
if ledger is not None:
    assert list(ledger.part.unique()) == [name for name, _, _ in LEDGER]
    sums = ledger.groupby("run").ms.sum() / ledger.groupby("run").ttft_p50_ms.first()
    assert ((sums - 1).abs() < 0.10).all(), f"a ledger's parts do not add up to its TTFT: {sums.round(3).to_dict()}"
assert (bench.shared[(bench.shared.arm == "on") & (bench.shared.phase == "warm")].cached_tokens == 512).all()
gate = bench.gate()
print(gate)
assert gate

# %% [markdown]
# ## Summary
#
# - Inside the process, on an H100, prefix caching cut a warm hit's TTFT 5.5x (14.52 against
#   2.62 ms). The engine meets the aim before any server.
# - The prompt step is the same on both H100 hosts measured: 2.43 and 2.49 ms, with a 1.8 ms
#   graph. Through the server, though, the host's parts of a warm hit took 1.6 ms on this host
#   against 4.2 ms on run j's. The shared prefix reached 4.52x to 4.60x here (0.92 of the aim),
#   against 3.1x to 3.5x there, and the second turn 7.4x to 8.1x. How far the server is from 5x
#   depends on the machine it runs on more than on anything the engine changed between the runs.
# - This host pays 3.5x for a pipe round trip after a pause, against run i's host's 8.9x. An
#   engine core and event loop that polled instead of sleeping gave the same TTFT here (3.37
#   against 3.38 ms), so that design was measured and taken out again.
# - At a 0% hit rate, caching cost 1.0% of throughput here (0.990, interval 0.990 to 0.991), just
#   inside the aim. On run i's host it cost 2%.
