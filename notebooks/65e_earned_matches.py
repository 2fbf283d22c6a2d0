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
# # Day 65e: one-token matches, after a draft has been kept
#
# Under graphbench's load at 32 requests a second, chained speculation's ITL p50 was 1.016x
# plain decoding's, on two runs before and after plain links ({doc}`Day 65d <65d_prompt_bytes>`).
# The aim is at most 1x. A round ran about 243 verify steps and kept 2 of 7,842 drafts: roughly
# one verify step for each request, on text that never repeats. Prompt lookup still matches a
# request's last token somewhere in its context now and then, and each such draft costs a verify
# step in which the whole batch keeps nothing.
#
# Day 65d replayed a stricter lookup on SmolLM2's outputs: matches of at least two tokens. It cut
# verify steps by 23% to 42%, but it traded summaries for code edits. This chapter asks whether a
# rule can keep real text's speed and still stop paying for one-token matches on text that does
# not repeat.
#
# The rule: **until one of a request's drafts has been kept, its lookups need a match of at least
# two tokens**. After that, one token is enough again (`prompt_lookup_min`). A request on real text
# keeps a draft early and then looks up as before. A request on text that never repeats keeps
# none, so its one-token matches never become drafts. It is a field of `SpeculativeConfig`,
# `prompt_lookup_min_until_kept`: None, the default, means two, or `prompt_lookup_min` if that is
# larger. Setting it to 1 gives the old rule.
#
# No GPU was lent on 2026-12-05. The replay below prices steps with Day 65c's H100 medians, and
# the live check runs on this CPU.

# %%
import pandas as pd

import nanolab.lab as lab
from nanolab import LLM
from nanolab.config import SpeculativeConfig
from nanolab.model.weights import resolve_weights

SLUG = "h100-80gb-hbm3"
print("the default rule: matches of at least", SpeculativeConfig().min_until_kept, "tokens until a draft is kept")

# %% [markdown]
# ## The rule replayed on real text
#
# At temperature 0, plain greedy's output fixes every step a lookup rule takes, so the rule can be
# replayed on Day 65c's SmolLM2 outputs (`replay_chained`, `min_until_kept`). The same replay
# counts the engine's own steps exactly: `tests/test_specbench.py` checks both rules against the
# engine on the sharp models. Each step is priced at that run's H100 medians: a plain step at
# off's, a verify step at the k = 31 arm's. Three rules sit side by side: one token throughout
# (the old default), two tokens throughout, and two until a draft is kept (the new default).

# %%
spec_runs = lab.measured_table("day65c_spec", 'SPEC_ARGS="--prefix day65c" scripts/gpu_run.sh smollm2 smolspec',
                               slug=SLUG)
smol, prompt_ids, plain_ms, verify_ms = lab.replay_inputs(spec_runs, lab.load_table("day65c_spec_summary", SLUG),
                                                     lab.lookup_arm(31, 2))
RULES = {"one token (old default)": (1, 1), "two tokens": (2, 2), "two until a draft is kept (new)": (1, 2)}
rules = pd.concat([
    lab.chained_settings(spec_runs, prompt_ids, plain_ms=plain_ms, verify_ms=verify_ms,
                         settings=[(k, min_n, until) for k in (4, 8, 31)]).assign(rule=rule)
    for rule, (min_n, until) in RULES.items()], ignore_index=True)
fig = lab.plot_lookup_rules(rules)
if not lab.figure_path("day65e_lookup_rules", SLUG).exists():  # a replay: the same figure wherever it runs
    lab.save_figure(fig, "day65e_lookup_rules", lab.table_label(spec_runs))
lab.show(fig)
table = rules.pivot_table(index=["set", "k"], columns="rule", values=["verify_steps", "speedup_chained"],
                          sort=False)
lab.show(table.round(3))

# %% [markdown]
# *Replayed chained speculation on Day 65c's SmolLM2 outputs (H100 step times): predicted speedup
# over plain greedy by set, k and rule, with verify steps above each bar.*

# %%
speed = rules.pivot_table(index=["set", "k"], columns="rule", values="speedup_chained", sort=False)
new, old, strict = speed["two until a draft is kept (new)"], speed["one token (old default)"], speed["two tokens"]
print(f"new over old: {(new / old).min():.3f}x to {(new / old).max():.3f}x; "
      f"two tokens throughout over old: {(strict / old).min():.3f}x to {(strict / old).max():.3f}x")
steps = rules.pivot_table(index=["set", "k"], columns="rule", values="verify_steps", sort=False)
print("verify steps, new over old: " + ", ".join(
    f"{s} k={k} {v:.2f}" for (s, k), v in (steps["two until a draft is kept (new)"]
                                           / steps["one token (old default)"]).items()))

# %% [markdown]
# On real text the new rule stays within 1% of the old one at every k: ahead on code edits, level
# on summaries. Requiring two tokens throughout moves further both ways, up on code edits and down
# on summaries. The new rule binds a request only until its first kept draft. Most prompts here
# keep one within their first few steps; one code-editing prompt keeps its first only about 17
# tokens in. At k = 31 on code edits the rule saves five verify steps, four of them on that prompt,
# which gives up one kept draft for them.
#
# The replay, like the live check below, runs without pauses. With the default pauses
# (`max_draft_backoff`), an engine whose steps do not chain (sampled rows, or no asynchronous
# scheduling) counts a lookup that finds only a one-token match, before anything is kept, as a
# miss and pauses the request. Greedy requests on a GPU chain, and a chained step never pauses on
# a miss, so the GPU numbers above are unaffected.
#
# What the rule does under load can only be measured there. Almost nothing is kept in the rounds
# (2 drafts in 7,842), so every lookup of theirs runs under the two-token rule, and the question
# is how often text that never repeats repeats two tokens in a row. The rounds did not record
# their requests' tokens, so it cannot be replayed. The next rounds put the three servers on the
# same streams: `fullgraphs`, `fullgraphs+ngram` (the new default) and
# `fullgraphs+ngram:prompt_lookup_min_until_kept=1` (the old rule).
#
# ## The rule in the engine, on this machine
#
# One code-editing prompt on SmolLM2, greedy, 40 tokens at k = 4, with no pauses
# (`max_draft_backoff` 0) so every step looks up. It runs once under each rule, and each run's
# verify steps, plain steps and kept drafts are checked against what the synchronous replay counts
# from plain greedy's output.

# %%
code_edit = lab.load_prompt_set("code_edit")[1]
path = resolve_weights("smollm2-135m")
live = {}
for rule, until in (("plain", None), ("old rule", 1), ("new rule", None)):
    spec = None if rule == "plain" else {"num_speculative_tokens": 4, "max_draft_backoff": 0,
                                         "prompt_lookup_min_until_kept": until}
    run = LLM(str(path), device="cpu", speculative_config=spec, enable_prefix_caching=False)
    live[rule] = lab.run_prompt(run, code_edit, max_tokens=40)
    run.close()
out, ids = live["plain"]["token_ids"], smol.encode_chat(code_edit)
rows = []
for rule, until in (("old rule", 1), ("new rule", 2)):
    want = lab.replay_lookup(ids, out, 4, 1, 4, max_tokens=40, min_until_kept=until)
    got = live[rule]
    rows.append({"rule": rule, "verify_steps": got["verify_steps"], "replay_verify_steps": want["verify_steps"],
                 "plain_steps": got["steps"] - 1 - got["verify_steps"], "replay_plain_steps": want["plain_steps"],
                 "accepted_tokens": got["accepted_tokens"], "replay_accepted_tokens": want["accepted_tokens"],
                 "same_tokens": got["token_ids"] == out})
live_table = pd.DataFrame(rows)
lab.show(live_table)

# %% [markdown]
# Under both rules the engine takes the steps the replay counts, and it emits plain greedy's
# tokens. On this prompt the new rule skips one verify step: its draft came from a one-token match
# before anything had been kept, and the old rule's verify step kept nothing from it. The kept drafts
# are the same under both rules.
#
# ## Under load, on an H100 (2026-12-06)
#
# The three servers then ran on one H100, four rounds at 32 requests a second, each round one
# Poisson stream sent to each server in turn (`SPECLOAD_ARGS="--arms fullgraphs,fullgraphs+ngram,`
# `fullgraphs+ngram:prompt_lookup_min_until_kept=1 --prefix day65e" SPECROUNDS=4 scripts/gpu_run.sh
# specrounds`).

# %%
under_load = lab.measured_table("day65e_rounds", "SPECROUNDS=4 scripts/gpu_run.sh specrounds (three arms)",
                                slug=SLUG)
fig = lab.plot_round_ratios(under_load)
if not lab.figure_path("day65e_rounds", SLUG).exists():
    lab.save_figure(fig, "day65e_rounds", lab.table_label(under_load))
lab.show(fig)
load_ratios = lab.round_ratios(under_load)
lab.show(load_ratios[["ratio", "arm", "rounds", "value", "lo", "hi", "detail"]].round(3))
lab.show(under_load.pivot_table(index="round", columns="arm", values=["verify_steps", "place"]))

# %% [markdown]
# *Each speculating server's ITL p50 and TPOT p50 over the plain server's on the same stream, a
# dot a round and the median a bar; then the medians with 95% bootstrap intervals (over four
# rounds, the smallest and largest of them), and each round's verify steps and the place each
# server took in its round.*
#
# Under the new rule the speculating server ran 0 to 2 verify steps a round, against 217 to 310
# under the old one: on text that never repeats, two-token matches almost never occur. Its ITL
# p50 was 1.008x the plain server's (0.993 to 1.027), and the old rule's 1.004x (0.987 to
# 1.007). Neither median is at or below 1, so the aim is not shown met; both intervals hold 1, so
# no cost is shown either. Four rounds cannot tell these apart, and one more thing confounds
# them: the new rule's server took the middle place in every round.
#
# The rounds had a flaw. graphbench reversed the order of the arms on odd rounds (AB, BA), which
# with three arms keeps the middle one in the middle, and the new rule's server was in the middle
# every time. graphbench now turns the order by one place a round (ABC, BCA, CAB), so that over
# three rounds each arm takes each place once.
#
# ## The gates
#
# The gates check the replay against the engine, require the same tokens, and require that the new
# rule never takes more verify steps than the old one on real text. They do not check timings.

# %%
assert live_table.same_tokens.all(), "speculation changed a greedy token"
for r in live_table.itertuples():
    assert (r.verify_steps, r.plain_steps, r.accepted_tokens) == (
        r.replay_verify_steps, r.replay_plain_steps, r.replay_accepted_tokens), f"{r.rule}: the engine left the replay"
assert (steps["two until a draft is kept (new)"] <= steps["one token (old default)"]).all(), \
    "the new rule took more verify steps than the old on real text"
print("the engine's steps are the replay's under both rules; the new rule never adds a verify step here")

# %% [markdown]
# ## Summary
#
# - Prompt lookup now takes matches of at least two tokens until one of a request's drafts has been
#   kept (`prompt_lookup_min_until_kept`, default two; 1 restores the old rule).
# - Replayed on SmolLM2's outputs at H100 step times, without pauses, it stays within 1% of the
#   old rule on both prompt sets at k = 4, 8 and 31, and never takes more verify steps.
# - Under load on an H100, the new rule cut verify steps from 217 to 310 a round to 0 to 2. ITL
#   p50 was 1.008x plain decoding's (0.993 to 1.027 over four rounds), against 1.004x under the
#   old rule: the aim of at most 1x is not shown met, and neither is a cost. graphbench now turns
#   the order of the arms each round, so that no arm always runs in the same place.
