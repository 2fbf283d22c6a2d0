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
# Every new GPU number below comes from one H100 host on 2026-12-06, and every run there used the
# engine as committed in d1571f9, its servers with or without the polling below. Runs i and j of
# chapter 64d ran at e5a1fb1, before a step's ids came from `Sequence.span` (998a136), a host
# change of a few microseconds a step.

# %%
from dataclasses import replace

import pandas as pd

import nanolab.lab as lab
from nanolab.lab.prefixbench import PREFIX_SIZES, run_prefixbench
from nanolab.lab.prefixsteps import PROFILED_SUFFIX
from nanolab.llm import DEFAULT_MODEL

H100, H200 = "h100-80gb-hbm3", "h200"
AIM = 5.0
SYSTEM_LEN, HISTORY_TOKENS = 2048, 4128  # what a warm hit and a second turn find cached
SPLIT_COLUMNS = ["step_ms", "schedule_ms", "forward_host_ms", "sample_ms", "rest_ms", "graph_gpu_ms"]
PART_COLUMNS = ["ttft_p50_ms", "front_ms", "core_wait_ms", "step_host_ms", "server_prefill_ms", "back_ms"]
TTFT_COMMAND = 'PREFIXSTEPS_ARGS="--prefix day64d" scripts/gpu_run.sh prefixsteps'
NOHIT_COMMAND = "python -m nanolab prefixbench --model llama-3.2-1b --parts nohit --prefix day64l"


def warm_hits(table: pd.DataFrame, arm: str = "on") -> pd.DataFrame:
    """A TTFT table's warm shared-prefix row for `arm`, or a shared table's warm requests."""
    part = table.part == "shared prefix" if "part" in table else True
    return table[(table.phase == "warm") & part & (table.arm == arm)]

# %% [markdown]
# ## The engine alone
#
# `prefixsteps` times the request inside the process (`engine_ttft`), from `add_request` to the
# first token on the host. Caching on means the engine that holds the 2,048-token system prompt;
# off means an engine of its own over the same model and pool. The two arms take turns. No HTTP,
# pipe or event loop is in this number. Beside it is the warm hit's prompt step, split on the host,
# on this host and on run i's:

# %%
gpu_ttft = lab.measured_table("day64d_prefix_ttft", TTFT_COMMAND, slug=H100)
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
# Inside the process the aim is met on this host: 14.52 ms off against 2.62 ms on, 5.5x. Run i's
# host never ran this comparison. The prompt step alone is within 3% on the two hosts: 2.43
# against 2.49 ms, with a 1.80 and a 1.76 ms graph and 0.59 against 0.65 ms of host work before it.
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
runs, tables = lab.ratio_runs(RUNS)
lab.show(runs.pivot_table(index=["run", "card"], columns="ratio", values="value", sort=False).round(2))
fig = lab.plot_ratio_runs(runs, AIM)
lab.save_figure(fig, "day64e_ratio_runs", replace(lab.table_label(pd.concat(tables)), device_slug="h200-h100"))
lab.show(fig)

# %% [markdown]
# The first run on the fresh machine was slower in every part, caching off as well: 16.7 ms off
# against 15.4 to 15.5 in the three after it. Those three gave the shared prefix 4.52x, 4.58x and
# 4.60x, the best so far and 0.90 to 0.92 of the aim. The second turn gave 7.4x to 8.0x in all
# four. On this host a warm hit took 3.4 ms through the server, against 5.3 and 6.0 ms in runs f
# and j.
#
# ## Where the server's time went
#
# `warm_hit_ledger` splits a warm hit's server TTFT into parts, with the prompt step cut at its
# graph by the split of the same step on the same host. Run j (with run i's split) stands against
# the fourth run here (with this host's split):

# %%
PAIRS = (("run j, H100", "day64j", split_i), ("64e 4th, H100", "day64e2_nopoll", split))
ledger, ttfts = lab.warm_hit_ledgers(((run, lab.load_table(f"{stem}_ttft", H100), split_table)
                                      for run, stem, split_table in PAIRS), aim=AIM)
if ledger is not None:
    lab.show(ledger.pivot_table(index=["part", "side"], columns="run", values="ms", sort=False).round(2))
    lab.show(lab.ledger_summary(ledger).round(2))
    fig = lab.plot_warm_hit_ledger(ledger)
    lab.save_figure(fig, "day64e_warm_hit_ledger", lab.table_label(ttfts))
    lab.show(fig)

# %% [markdown]
# The GPU's part is the same 1.8 ms on both hosts. The host's parts fell from 4.2 to 1.6 ms: the
# front from 1.66 to 0.65 ms, the core's wait from 0.26 to 0.05, the step's host work around the
# forward from 0.50 to 0.19, the prompt step's host share from 1.16 to 0.47, and the way back from
# 0.63 to 0.21. The host's budget at 5x is 1.31 ms here, so the host is at 1.2x its budget,
# against 2.2x in run j. The parts around the step moved, and so did the prompt step's host share
# inside the server, although alone that step's host work differs by 0.06 ms between the hosts.
# All of that is consistent with one machine crossing between processes and waking them faster
# than the other. With one host of each kind measured, it is a reading, not a proof.
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
# Polling is the obvious lever against the pause, and SGLang's scheduler polls by default: users
# found it holding a core at 100% while idle (sgl-project/sglang issue 1730), and `--sleep-on-idle`
# (PR 6026) turns that off. So for these runs the engine got a field, `idle_poll_s`
# (d1571f9). Once idle, the server's engine core polled its pipe for that long before it slept,
# and the server's event loop polled its selector for as long after each request and each of the
# core's messages. By default it polled for 1 s on CUDA. Each pair of runs ran once with the
# default and once with `--idle-poll-s 0`, the second pair in reverse order. A server's row
# records the value asked for: blank for the default (1 s at d1571f9), 0 for none:

# %%
POLL_RUNS = (("1st, sleeping", "day64e_nopoll"), ("2nd, polling", "day64e"), ("3rd, polling", "day64e2"),
             ("4th, sleeping", "day64e2_nopoll"))
warm = []
for run, stem in POLL_RUNS:
    ttft, servers = lab.load_table(f"{stem}_ttft", H100), lab.load_table(f"{stem}_servers", H100)
    if ttft is not None and servers is not None:
        polled = servers.idle_poll_s.fillna(1.0).unique()  # blank: the default, 1 s on CUDA
        warm.append(warm_hits(ttft)[PART_COLUMNS].assign(run=run, idle_poll_s=polled[0] if len(polled) == 1 else None))
warm = pd.concat(warm).set_index("run") if warm else None
if warm is not None:
    lab.show(warm.round(3))

# %% [markdown]
# In the second pair, run in reverse, the warm hit took 3.36 ms with the core polling and 3.38
# with it sleeping. The parts polling should shrink, the core's wait and the way back, moved by
# 9 and 5 us. The first pair's gap, 3.44 against 4.35 ms, coincides with the first run on a
# fresh machine, whose off arm and prompt steps were slower too. On this host polling buys
# nothing a reader could see, and it costs a CPU core that spins after every request. The design
# left the engine in e40705d. Its runs stay in `data/`, under the stems `day64e_nopoll`, `day64e`,
# `day64e2` and `day64e2_nopoll` (tables `ratios`, `servers`, `shared`, `ttft` and `turns`; the older
# `day64e_prefix_*` and `day64e_varlen_sweep` tables are another run's). Whether polling would pay
# on a host like run i's, where a pause costs 8.9x, is still open, and needs such a host again.
#
# ## No hits
#
# The no-hit part ran once more on this host, caching on and off in one process, 30 passes a side:

# %%
nohit = lab.measured_table("day64l_ratios", NOHIT_COMMAND, slug=H100)
if nohit is not None:
    row = nohit.iloc[0]
    print(f"{row.ratio}: {row.value:.3f} (aim {row.aim}); {row.detail.split(';')[0]}")

# %% [markdown]
# The median pass ran at 0.990 of caching off, with a bootstrap interval of 0.990 to 0.991. Run
# i's host gave 0.980 (0.970 to 0.992). So the 1% aim is met on this host. On that one the median
# missed it, and its interval includes it.
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
lab.show(bench.summary[["phase", "arm", "cached_tokens", *PART_COLUMNS]].round(2))
cpu_engine = lab.load_table("day64d_prefix_ttft", "cpu")
if cpu_engine is not None:
    p50 = cpu_engine.groupby("arm").ttft_ms.median()
    print(f"on this CPU: {server:.1f}x through the server, {p50['off'] / p50['on']:.1f}x inside the process "
          "(chapter 64d's run)")

# %% [markdown]
# ## The gates
#
# Every table this chapter reads is committed. In each of the four runs, each arm sent one cold and
# 19 warm requests and eight second turns, and every one completed with its tokens. With caching on
# every warm request found the 2,048 tokens of the system prompt cached and every second turn its
# 4,128 tokens of history; with caching off none found any. Each run's ratios are its TTFT table's
# medians. The sleeping runs asked for no polling, and the polling runs for the default. Inside the
# process every hit fed exactly its 50 new tokens and every request without caching its whole
# prompt, and the split steps each fed 50 tokens through a graph. Each ledger's parts add up to
# within 10% of the TTFT p50 they split. The figures the prose leans on hold: the engine's ratio
# above the aim, the reversed pair within 1% of each other, and the no-hit median at the aim. On
# this CPU each warm hit found its 512 cached tokens, and every request completed with its tokens.

# %%
for name, table in (("day64d_prefix_ttft", gpu_ttft), ("day64d_prefix_split", split), ("day64l_ratios", nohit),
                    ("day64i_prefix_split", split_i)):
    assert table is not None, f"data/{name}_{H100}.csv is not committed"
assert ledger is not None and ledger.run.nunique() == len(PAIRS), "a ledger's TTFT table is not committed"
for _, stem in POLL_RUNS:
    shared, turns = lab.load_table(f"{stem}_shared", H100), lab.load_table(f"{stem}_turns", H100)
    ttft, ratios = lab.load_table(f"{stem}_ttft", H100), lab.load_table(f"{stem}_ratios", H100)
    assert not any(t is None for t in (shared, turns, ttft, ratios)), f"a table of {stem} is not committed"
    for table in (shared, turns):
        assert (table.ok.astype(bool) & (table.output_tokens > 0)).all(), f"{stem}: a request failed"
    counts = shared.groupby(["arm", "phase"]).size().to_dict()
    assert counts == {(a, p): n for a in ("off", "on") for p, n in (("cold", 1), ("warm", 19))}, (stem, counts)
    assert (warm_hits(shared).cached_tokens == SYSTEM_LEN).all(), f"{stem}: a warm hit missed the system prompt"
    assert (shared[shared.arm == "off"].cached_tokens == 0).all() and (shared[shared.phase == "cold"].cached_tokens
                                                                        == 0).all(), stem
    second = turns[turns.turn == 2]
    assert (second.groupby("arm").size() == 8).all() and len(second) == 16, stem
    assert (second[second.arm == "on"].cached_tokens == HISTORY_TOKENS).all(), f"{stem}: a second turn missed"
    off, on = warm_hits(ttft, "off").ttft_p50_ms.iloc[0], warm_hits(ttft).ttft_p50_ms.iloc[0]
    stated = ratios[ratios.ratio.str.startswith("shared prefix")].value.iloc[0]
    assert abs(stated - off / on) < 1e-6, f"{stem}: its ratios table is not its TTFT table's"
    polled = lab.load_table(f"{stem}_servers", H100).idle_poll_s
    assert (polled == 0).all() if stem.endswith("_nopoll") else polled.isna().all(), f"{stem}: idle_poll_s"
assert engine_ratio > AIM, f"in the process {engine_ratio:.2f}x"
assert (gpu_ttft[gpu_ttft.arm == "on"].fed_tokens == PROFILED_SUFFIX).all()
off_rows = gpu_ttft[gpu_ttft.arm == "off"]
assert (off_rows.fed_tokens == off_rows.prompt_len).all(), "without caching a request fed less than its prompt"
assert (split.tokens == PROFILED_SUFFIX).all() and split.graph.astype(bool).all(), "a split step was not a graphed hit"
reversed_pair = warm.loc["3rd, polling"].ttft_p50_ms / warm.loc["4th, sleeping"].ttft_p50_ms
assert abs(reversed_pair - 1) < 0.01, f"polling against sleeping: {reversed_pair:.3f}"
assert nohit.value.iloc[0] >= 0.99, nohit.value.iloc[0]
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
# - The prompt step alone is within 3% on the two H100 hosts measured: 2.43 and 2.49 ms, with a
#   1.8 ms graph. Through the server, though, the host's parts of a warm hit took 1.6 ms on this
#   host against 4.2 ms on run j's. The shared prefix reached 4.52x to 4.60x here (0.90 to 0.92
#   of the aim), against 3.35x and 3.11x in runs i and j there, and the second turn 7.4x to 8.0x.
#   With one host of each kind, this reads as the server's distance from 5x depending on the
#   machine more than on what the engine changed between the runs.
# - This host pays 3.5x for a pipe round trip after a pause, against run i's host's 8.9x. An
#   engine core and event loop that polled instead of sleeping gave the same TTFT here (3.36
#   against 3.38 ms), so that design was measured and taken out again.
# - At a 0% hit rate, caching cost 1.0% of throughput here (0.990, interval 0.990 to 0.991), just
#   inside the aim. On run i's host the median cost 2%, with an interval that reaches the aim.
