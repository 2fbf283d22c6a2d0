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
# # Day 63: the serving tail
#
# By Day 62 a decode step was close to the bandwidth floor, and a server's median token came
# within a few percent of it. The tail did not. Under graphbench's load on one H200 (Llama-3.2-1B
# shapes, prompts of 16 to 128 tokens, 32 to 256 new ones), one gap in a hundred between two
# tokens of a stream was 8 to 15 times the median. The first requests after a start also waited
# seconds. This chapter asks where those gaps come from, and whether graphing every step brings
# ITL p99 within 3x of p50.
#
# The culprit is the **mixed step**: a step that carries a new prompt's chunk beside the decode
# rows. Chunked prefill keeps a prompt from stalling the running streams for its whole length,
# but until today that step ran eagerly. Chapter 61 timed it at about 10 ms of host time for
# about 3 ms of GPU work, so every stream in the batch waited 10 ms for one token whenever a
# request arrived. At 32 requests a second, that is about 4% of all steps.
#
# vLLM's answer is to capture that step too (its default mode, `FULL_AND_PIECEWISE`, keeps a
# graph per padded token count). nanolab now does the same, its own way:
#
# - **A padded varlen plan.** `KVCache.plan_varlen(..., num_tokens=n)` writes the step's inputs
#   (ids, positions, slots, segment starts, lengths, the rows to sample) into fixed device
#   buffers, in one copy. Tokens past the real ones are padding: they write the sink slot at
#   position 0 and belong to no segment. Every row of the cache is a segment, and those past the
#   real ones are empty and point at the all-sink table row.
# - **A fixed grid.** The Triton varlen read takes `grid_tokens=n`: its grid is cut for n tokens
#   and at most n segments. Each program numbers its tile from a prefix sum of the segments' tile
#   counts, and one past the step's last tile exits. The grid no longer depends on the step's
#   longest segment, a host value a graph cannot follow.
# - **A graph per size** (`VarlenGraphs`), at vLLM's capture sizes up to 512 tokens, over the
#   decode graphs' one memory pool. A step of n tokens replays the smallest size that holds it.
#   A bigger step runs eagerly.
# - **A warm start.** `Engine.warm_up` runs requests down every path a request can reach before
#   `/health` says 200: long prompts in chunks, 16 and 17 rows at once, every sampling path.
#
# `cudagraph_mode="full"` (the default now) turns the varlen graphs on; `"full_decode_only"` is
# Day 58's engine, where only decode steps replay a graph.

# %%
import textwrap

import pandas as pd

import nanolab.lab as lab
from nanolab.engine.block_manager import BlockManager
from nanolab.engine.graphs import capture_sizes
from nanolab.engine.kv_cache import SINK, KVCache
from nanolab.lab.report import DATA_DIR

DEVICE, MODEL, DTYPE, path, label = lab.chapter_run(cpu_model="smollm2-135m")
ON_GPU = DEVICE.type == "cuda"
print(label.caption().replace("; ", ";\n"))

# %% [markdown]
# ## The capture list, and what a padded step holds
#
# The sizes are vLLM's: 1, 2 and 4 tokens, then every 8 up to 248, then every 16 up to the
# largest. The largest is the step's token budget, at most 512. With the default budget of 512
# that is 51 graphs, and every step the scheduler can build fits one.

# %%
sizes = capture_sizes(512)
print(f"{len(sizes)} sizes: {sizes[:6]} ... {sizes[30:35]} ... {sizes[-3:]}")
padding = pd.DataFrame({"step tokens": range(1, 513)})
padding["graph"] = [next(s for s in sizes if s >= n) for n in padding["step tokens"]]
padding["padding share"] = 1 - padding["step tokens"] / padding["graph"]
lab.show(padding.groupby(pd.cut(padding["step tokens"], [0, 8, 64, 256, 512]), observed=True)
         ["padding share"].agg(["mean", "max"]).round(3))

# %% [markdown]
# Past 8 tokens a step pads by at most 7 or 15 tokens, and by about 3% of its tokens on average.
#
# Below, a cache of 4 rows is reserved for steps of up to 16 tokens, and one step is planned at
# 16: a 5-token prompt chunk, and two decode rows of one token each. The first 7 tokens are the
# step's; the other 9 write the sink and sit in no segment. Segment 3 of the buffers is empty: it
# begins and ends where the real tokens end, and reads the all-sink table row (row 4).

# %%
demo = KVCache(BlockManager(num_blocks=16, block_size=4, max_rows=4), num_layers=1, num_kv_heads=1, head_dim=8)
demo.reserve_varlen(16)
rows = [demo.blocks.open_row() for _ in range(3)]
demo.plan_varlen(rows[1:], (6, 3), input_ids=list(range(101, 110)), num_tokens=16)  # two rows' history
plan = demo.plan_varlen(rows, (5, 1, 1), input_ids=[11, 12, 13, 14, 15, 21, 31], num_tokens=16)
starts = plan.query_start_loc.tolist()
tokens = pd.DataFrame({
    "input id": plan.input_ids[0].tolist(), "position": plan.positions[0].tolist(),
    "write slot": ["sink" if s == SINK else s for s in plan.write_slots.tolist()],
    "segment": [next((i for i in range(len(starts) - 1) if starts[i] <= t < starts[i + 1]), "none")
                for t in range(plan.num_tokens)]})
lab.show(tokens.T)
lab.show(pd.DataFrame({"table row": plan.table_rows.tolist(), "starts at": starts[:-1],
                       "context length": plan.context_lens.tolist()}).T)
assert (plan.write_slots[7:] == SINK).all() and starts[3:] == [7, 7]

# %% [markdown]
# The tests (`tests/test_varlen_graphs.py`) hold a padded step to the unpadded one on the sharp
# models, whose outputs depend on every key they read: logits within 1e-4 and every pool slot but
# the sink equal, step after step. On CUDA a graphed engine's logits stay within 1e-3 of the
# eager one's (fp32, TF32 off). Three deliberate breaks were run against those tests, and each
# failed them: padding that writes slot 1 instead of the sink, a copy that leaves the previous
# step's lengths in the buffer, and a replay of the size below the plan's.
#
# ## A run through the real server, on this machine
#
# graphbench starts `python -m nanolab serve` with a step log and sends Poisson arrivals, as in
# Day 58. On a CPU the budget here is 32 tokens a step, so most prompts arrive in chunks beside
# running decodes, and there are no graphs: the run below is the eager server, and it shows the
# same effect. The mixed steps are the long ones, and they make the tail. On a GPU it runs both graph
# modes.

# %%
ARMS = ("graphs", "fullgraphs") if ON_GPU else ("eager",)
WORKLOAD = lab.Workload((64, 512), (32, 128), duration_s=3.0, min_requests=8, max_requests=96) \
    if ON_GPU else lab.Workload((16, 64), (8, 24), duration_s=2.5, min_requests=4, max_requests=12)
RATES = (16.0, 32.0) if ON_GPU else (2.0, 4.0)


def log(message: str) -> None:
    for line in message.splitlines():
        print(textwrap.fill(line, 100, subsequent_indent="    "))


live = lab.run_graphbench(MODEL, DEVICE.type, arms=ARMS, rates=RATES, max_rate=max(RATES), workload=WORKLOAD,
                          slo=lab.SLOS[DEVICE.type], warmup=0, offline=False,
                          max_num_batched_tokens=None if ON_GPU else 32, log=log)
lab.save_table(live.rates, "day63_live_graphbench", label)
lab.save_table(live.itl, "day63_live_itl", label)
COLUMNS = ["arm", "rate", "completed", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "first_ttft_x_steady",
           "mixed_steps", "mixed_p50_ms", "server_step_p50_ms", "server_ready_s", "engine_build_s"]
lab.show(live.rates[[c for c in COLUMNS if c in live.rates]].round(2))
gates = [lab.check_requests(live.rates)]
for arm in ARMS:
    gates.append(lab.check_compaction(live.steps[live.steps.arm == arm], lab.capture_batch_sizes(64),
                                      expect_graphs=ON_GPU))
for gate in gates:
    print(textwrap.fill(str(gate), 100, subsequent_indent="  "))
    assert gate, gate
assert (live.rates.mixed_steps > 0).all(), "no step carried a chunk beside decode rows"

# %%
fig = lab.plot_itl_cdf(live.itl)
lab.save_figure(fig, "day63_live_itl", label)
lab.show(fig)

# %% [markdown]
# *Figure 63.1: This run's inter-token gaps from the median up, as the share of gaps longer than
# each time. The dot is p99, and the tick on the dotted line is 3x p50.*
#
# Every request completed with its tokens and the server stopped cleanly. A CPU's steps are
# compute: tens of milliseconds, and a mixed step costs what its extra tokens cost, so its tail
# says little about a GPU's. On the GPU the mixed step's extra cost is host time, and the H200's
# tables below show it.
#
# ## The mixed step, before and after (H200)
#
# `python -m nanolab levers --only mixed --cudagraph-modes full_decode_only,full` times mixed
# steps in-process. Sixteen decode rows hold 512 tokens each, and one prompt joins them, under a
# budget of 2,048 tokens a step. The bars are the host's time, and the black tick is the
# forward's span on the GPU.

# %%
anatomy = lab.load_table("day63_mixed_anatomy", "h200")
kernels = lab.load_table("day63_mixed_kernels", "h200")
print("measured on:", lab.table_label(anatomy).caption().replace("; ", ";\n  "))
lab.show(anatomy[["arm", "phase", "prompt_len", "chunk", "tokens", "step_ms", "forward_host_ms",
                  "forward_span_ms", "sample_ms"]].round(2))
fig = lab.plot_mixed_anatomy(anatomy, kernels)
if ON_GPU or not lab.figure_path("day63_mixed_anatomy", "h200").exists():
    lab.save_figure(fig, "day63_mixed_anatomy", lab.table_label(anatomy))
lab.show(fig)

# %% [markdown]
# *Figure 63.2: Mixed steps eager (top) and graphed (bottom): the host's time inside the forward
# (blue), sampling and its read-back (orange), and the rest (grey). The black tick is the
# forward's span on the GPU; the dashed line is a decode step of the same 16 rows.*
#
# Eagerly, every mixed step spends about 10 ms of host time, whatever its size: 16 layers of
# launches, and for a short step the GPU waits on them. A graph replays those launches in 0.6 ms
# of host time. An 80-token step falls from 10.8 ms to 2.5 ms, and the last 32-token chunk from
# 10.8 ms to 3.5 ms. Its remaining time is GPU work, and the host now waits on it while it
# samples. The 528-token step is above the largest size, so it still runs eagerly. That is why
# the budget matters.
#
# ## ITL under load, eager mixed steps against graphed ones (H200)
#
# `scripts/gpu_run.sh tailbench` ran graphbench on one H200 with both modes. Prompts were 16 to
# 128 tokens and outputs 32 to 256, at 4, 16, 32 and 48 requests/s, 8 s each, under the budget
# of 2,048 tokens then in force. No client warm-up ran, so the first requests met the server as
# it came up.

# %%
rates = lab.load_table("day63_graphbench", "h200")
itl = lab.load_table("day63_itl", "h200")
steps = lab.load_table("day63_steps", "h200")
measured = lab.table_label(rates)
print("measured on:", measured.caption().replace("; ", ";\n  "))
rates = rates.assign(itl_p99_over_p50=rates.itl_p99_ms / rates.itl_p50_ms)
lab.show(rates.pivot_table(index="rate", columns="arm", values=["itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50",
                                                                 "mixed_p50_ms", "ttft_p50_ms"]).round(2))
fig = lab.plot_itl_cdf(itl)
if ON_GPU or not lab.figure_path("day63_itl", "h200").exists():
    lab.save_figure(fig, "day63_itl", measured)
lab.show(fig)

# %% [markdown]
# *Figure 63.3: The H200's inter-token gaps at each rate, from the median up. Grey: decode steps
# graphed, mixed steps eager. Blue: every step graphed. A dot left of its tick meets the aim.*
#
# The grey curves have a shelf. Between 2% and 8% of gaps sit at 8 to 15 ms, the eager mixed
# steps, and at 16 req/s and above p99 lands on that shelf. The blue curves have no shelf: a
# mixed step is about 2.3 ms, and p99 sits at 2.5 to 2.9 ms. The median gap did not move.
#
# The steps themselves, from the server's step log, show the same at each rate. A mixed step now
# takes 1.2x to 1.3x a decode step, where it took 3.9x to 8.9x.

# %%
step_ms = (steps[steps.phase != "prefill"].assign(total=lambda d: d.ms_p50 * d.steps)
           .groupby(["arm", "rate", "phase", "graph"], as_index=False)
           .agg(steps=("steps", "sum"), total=("total", "sum")))
step_ms["ms (steps' mean of row medians)"] = step_ms.total / step_ms.steps
lab.show(step_ms.drop(columns="total").round(2))

# %% [markdown]
# ## The budget, with longer prompts (H200)
#
# With prompts of 16 to 128 tokens every mixed step fits a graph under either budget. With
# prompts of 256 to 2,048 tokens, a 2,048-token budget builds steps larger than the largest
# graph, and they run eagerly. `gpu_run.sh tailbudget` served that workload with every step
# graphed, under budgets of 2,048 and 512 tokens.

# %%
long = {budget: (lab.load_table(f"day63_long_budget{budget}_graphbench", "h200"),
                 lab.load_table(f"day63_long_budget{budget}_itl", "h200")) for budget in (2048, 512)}
budgets = pd.concat([t.assign(budget=b) for b, (t, _) in long.items()])
lab.show(budgets.pivot_table(index="rate", columns="budget", values=[
    "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "mixed_p50_ms", "output_throughput"]).round(2))
budget_itl = pd.concat([q.assign(arm=f"budget {b}") for b, (_, q) in long.items()])
fig = lab.plot_itl_cdf(budget_itl, labels={f"budget {b}": f"every step graphed, {b} tokens a step" for b in long})
if ON_GPU or not lab.figure_path("day63_long_itl", "h200").exists():
    lab.save_figure(fig, "day63_long_itl", lab.table_label(long[512][0]))
lab.show(fig)

# %% [markdown]
# *Figure 63.4: Prompts of 256 to 2,048 tokens with every step graphed, under budgets of 2,048
# and 512 tokens a step. The ratios are read off the 201 stored quantiles, so they differ a
# little from the table's exact percentiles.*
#
# Under 2,048 tokens a step, the steps that carry a long chunk run eagerly at about 10 ms, and
# p99 goes back to 12 to 13 ms. Under 512 every step replays a graph. A full 512-token step is
# about 4.4 ms of GPU work, and p99 falls to 5 ms. The price is TTFT: a long prompt now needs up
# to four steps, and the median TTFT rose from 16 ms to 19 ms at 32 req/s. Throughput was the
# same. The tail is what a user of a stream sees, so **512 is the default budget now**, with
# `cudagraph_mode="full"`. A server for long prompts at low rates, where TTFT matters more, can
# raise `--max-num-batched-tokens`, and steps past 512 tokens run eagerly.
#
# With long prompts, the tail is still 4.4x the median: a full 512-token step takes about 4 ms.
# A smaller budget would shorten those steps again, for more TTFT; it was not measured.
#
# ## The start (H200)
#
# Each server logs what its build cost, and graphbench logged those lines in its own log,
# committed as `data/day63_bench_log_h200.txt`. `startup_table` reads them back.

# %%
bench_log = DATA_DIR / "day63_bench_log_h200.txt"
startup = lab.startup_table(bench_log.read_text())
startup["server"] = [f"{a}, budget {b if isinstance(b, str) else 2048}"
                     for a, b in zip(startup.arm, startup.token_budget, strict=True)]
lab.show(startup.drop(columns=["cudagraph_mode", "token_budget"]).round(2))
fig = lab.plot_startup(startup)
if ON_GPU or not lab.figure_path("day63_startup", "h200").exists():
    lab.save_figure(fig, "day63_startup", measured)
lab.show(fig)

# %% [markdown]
# *Figure 63.5: Every server start whose log has the build's lines, from launch to `/health`
# answering 200. The first bar started on a fresh machine, with inductor's cache empty.*
#
# The varlen graphs cost little to start: 51 captures in 1.1 to 2.6 s, and 842 MiB of pool beside
# the decode graphs' 556 MiB. Decode graphs cost the most, because inductor compiles the decode
# step while it warms each bucket: 22 to 34 s with a warm cache, and 81 s on a fresh machine. The
# warm-up requests take 0.3 to 0.7 s, and 2.1 s on the fresh machine. A server is ready 36 to
# 50 s after launch. On a fresh machine it took 95 s, and 121 s for the first server of the first
# run, whose log predates the build's lines.
#
# What the warm-up buys shows at the lowest rate, whose first requests meet a server that has
# only just come up. The slowest of the first 10 TTFTs, over the median of the rest:

# %%
lab.show(rates[rates.rate == rates.rate.min()][["arm", "rate", "first_ttft_max_ms", "ttft_p50_ms",
                                                "first_ttft_x_steady"]].round(2))

# %% [markdown]
# With every step graphed, the first requests wait 6 ms, 1.2x the rest. With mixed steps eager,
# they wait 83 ms, 2.6x: their prefills are mixed steps, and an eager mixed step took 16 ms at
# the median at that rate.
#
# ## How much the runs move
#
# The same workload ran three times, on two machines: the first run, a rerun of 32 and 48 req/s
# with the arms in the other order, and the final run above. The first run's ITL p50 at 48 req/s
# with every step graphed was 1.63 ms. Its decode steps were slower, at every batch size. Neither
# later run repeated it.

# %%
runs = pd.concat([lab.load_table(stem, "h200").assign(run=name) for name, stem in
                  (("first", "day63_first_graphbench"), ("rerun", "day63_rerun_graphbench"),
                   ("final", "day63_graphbench"))])
runs = runs[runs.rate >= 16].assign(p99_over_p50=lambda d: d.itl_p99_ms / d.itl_p50_ms)
lab.show(runs.pivot_table(index=["arm", "rate"], columns="run", values=["itl_p50_ms", "p99_over_p50"]).round(2))

# %% [markdown]
# ## The gates
#
# Asserted on the final H200 tables, at the rates the issue names. "Before" is the same run's
# server with eager mixed steps.

# %%
full, before = rates[rates.arm == "fullgraphs"].set_index("rate"), rates[rates.arm == "graphs"].set_index("rate")
mixed_32 = step_ms[(step_ms.arm == "fullgraphs") & (step_ms.rate == 32) & (step_ms.phase == "mixed")]
mixed_median_32 = float(full.loc[32, "mixed_p50_ms"])
sustained = lambda t: t[~t.saturated.astype(bool)].index.max()  # noqa: E731
first = full.loc[full.index.min()]
gate_rows = [("ITL p99 / p50", rate, full.loc[rate, "itl_p99_over_p50"], 3.0) for rate in (16, 32, 48)]
gate_rows += [("ITL p50 (ms)", rate, full.loc[rate, "itl_p50_ms"], 1.1) for rate in (16, 32, 48)]
gate_rows += [("mixed step median (ms)", 32, mixed_median_32, 3.0),
              ("first 10 TTFT, slowest / steady median", first.name, first.first_ttft_x_steady, 2.0)]
table = pd.DataFrame(gate_rows, columns=["gate", "rate", "value", "at most"])
table["ratio to target"] = table.value / table["at most"]
lab.show(table.round(3))
assert (table.value <= table["at most"]).all(), table
assert all(mixed_32.graph) and len(mixed_32), "a mixed step at 32 req/s ran eagerly"
assert sustained(full) >= sustained(before), "every step graphed sustains a lower rate"
assert lab.check_requests(rates), "a request failed, or a server did not stop cleanly"
print(f"highest sustained rate: {sustained(full):g} req/s with every step graphed, "
      f"{sustained(before):g} with mixed steps eager")

# %% [markdown]
# ## Summary
#
# - Mixed steps of chunked prefill now replay CUDA graphs, one per padded token count, from
#   fixed input buffers. The varlen read's grid is cut for the padded count, and padding writes
#   the sink. A step larger than 512 tokens runs eagerly.
# - With every step graphed, ITL p99 was 2.4x, 2.7x and 2.6x p50 at 16, 32 and 48 req/s, where
#   eager mixed steps gave 14.5x, 10.7x and 12.0x. p50 stayed at 1.06 to 1.09 ms. A mixed step's
#   median fell from 7.7 to 2.4 ms at 32 req/s.
# - The server warms every path before `/health` answers. The first 10 requests' TTFT was 1.2x the
#   steady median, and a warm server starts in 36 to 50 s.
# - The default budget is 512 tokens a step, so every step fits a graph. With prompts up to 2,048
#   tokens that took p99 from 12.7 ms to 5.4 ms, for 3 ms more median TTFT.
