"""specbench's pieces: the shipped prompt sets load as conversations, and the summary's
acceptance, tokens a verify step, speedup and output check come out as worked by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from nanolab.lab.specbench import PROMPT_SETS, load_prompt_set, spec_summary


def test_the_prompt_sets_are_conversations():
    for name in PROMPT_SETS:
        conversations = load_prompt_set(name)
        assert len(conversations) == 6
        assert all(m[0]["role"] == "user" and len(m[0]["content"]) > 80 for m in conversations)
    with pytest.raises(FileNotFoundError, match="no prompt set 'poems'"):
        load_prompt_set("poems")


def test_the_summary_is_worked_by_hand():
    rows = [  # two prompts: off takes 10 tokens in 1.0 s each; on, 0.5 s and 0.25 s
        ("off", 0, [1] * 10, 1.0, 0, 0, 0), ("off", 1, [2] * 10, 1.0, 0, 0, 0),
        ("on", 0, [1] * 10, 0.5, 4, 12, 6), ("on", 1, [2] * 9 + [3], 0.25, 2, 8, 2),
    ]
    table = pd.DataFrame([{"set": "s", "arm": a, "prompt": p, "token_ids": t, "output_tokens": len(t), "seconds": s,
                           "verify_steps": v, "draft_tokens": d, "accepted_tokens": k,
                           "decode_step_ms": 2.0 + p, "verify_step_ms": 3.0 + 2 * p if v else float("nan")}
                          for a, p, t, s, v, d, k in rows])
    on = spec_summary(table).set_index("arm").loc["on"]
    assert on.ms_per_token == pytest.approx(37.5)  # 0.75 s over 20 tokens
    assert on.acceptance_rate == pytest.approx(8 / 20)
    assert on.tokens_per_verify_step == pytest.approx((8 + 6) / 6)
    assert on.speedup_over_off == pytest.approx(100 / 37.5)
    assert not on.outputs_equal_off  # prompt 1's last token differs
    assert (on.decode_step_ms, on.verify_step_ms) == (2.5, 4.0)  # medians over the two prompts
    assert on.prompts_repeats_differ == 0  # a table from before `distinct_outputs`
    table["distinct_outputs"] = [1, 1, 2, 1]
    by_arm = spec_summary(table).set_index("arm").prompts_repeats_differ
    assert (by_arm["off"], by_arm["on"]) == (0, 1)


def test_the_switch_off_batch_is_where_speculation_stops_paying():
    from nanolab.lab.specbench import switch_off_batch

    table = pd.DataFrame({"arm": ["off"] * 3 + ["ngram k=4"] * 3, "batch": [1, 4, 16] * 2,
                          "speedup_over_off": [1.0, 1.0, 1.0, 1.6, 1.0, 0.7]})
    assert switch_off_batch(table) == 4  # no faster is not faster
    table.loc[4, "speedup_over_off"] = 1.01
    assert switch_off_batch(table) == 16
    table.loc[5, "speedup_over_off"] = 1.2
    assert switch_off_batch(table) is None


def test_a_replayed_lookup_is_worked_by_hand():
    from nanolab.lab.specbench import lookup_settings, replay_lookup

    prompt, out = [5, 6, 7, 5, 6, 7], [5, 6, 7, 8, 5, 6]
    # k = 2: after 5 the suffix 5, 6, 7, 5 matches, drafts 6, 7 both kept; after 8 no match; the
    # last token has no room for a draft. k = 1: draft 6 kept, then after 7 draft 5, not 8
    assert replay_lookup(prompt, out, k=2) == {"verify_steps": 1, "plain_steps": 2, "accepted_tokens": 2}
    assert replay_lookup(prompt, out, k=1) == {"verify_steps": 2, "plain_steps": 2, "accepted_tokens": 1}
    # no token repeats: every step after the prompt's is a plain one
    assert replay_lookup([11, 12, 13], [1, 2, 3, 4, 5], k=4) == {"verify_steps": 0, "plain_steps": 4,
                                                                 "accepted_tokens": 0}
    # priced with the table's medians: off's decode step 1 ms, the speculating arm's verify 2, sync decode 1.5
    table = pd.DataFrame([{"set": "s", "arm": "off", "prompt": 0, "token_ids": out, "decode_step_ms": 1.0,
                           "verify_step_ms": float("nan")},
                          {"set": "s", "arm": "on", "prompt": 0, "token_ids": out, "decode_step_ms": 1.5,
                           "verify_step_ms": 2.0}])
    row = lookup_settings(table, {"s": [prompt]}, ks=(2,), min_ns=(1,), max_tokens=6).iloc[0]
    assert row.ms_per_token_overlapped == pytest.approx((2.0 + 2 * 1.0) / 5)
    assert row.ms_per_token_synchronous == pytest.approx((2.0 + 2 * 1.5) / 5)
    assert row.tokens_per_verify_step == pytest.approx(3.0)


def test_lookup_settings_are_parsed_and_named():
    from nanolab.lab.specbench import lookup_arm, parse_lookups

    assert parse_lookups("4, 8:2,16:3,4:1:1") == [(4, 1), (8, 2), (16, 3), (4, 1, 1)]
    assert [lookup_arm(*s) for s in parse_lookups("4,8:2,4:1:1")] == ["ngram k=4", "ngram k=8 min_n=2",
                                                                      "ngram k=4 until_kept=1"]
    for text, needle in (("0", "at least 1"), ("4:5", "at most 4"), ("4,4:1", "twice"), (",", "no setting"),
                         ("x", "not an integer"), ("4:2:1", "until_kept at least min_n"), ("4:1:5", "at most 4"),
                         ("4:1:2:3", "k:min_n:until_kept")):
        with pytest.raises(ValueError, match=needle):
            parse_lookups(text)


def test_lookup_settings_price_the_arm_asked_for():
    from nanolab.lab.specbench import lookup_settings

    out = [5, 6, 7, 8]
    table = pd.DataFrame([{"set": "s", "arm": a, "prompt": 0, "token_ids": out, "decode_step_ms": d,
                           "verify_step_ms": v} for a, d, v in (("off", 1.0, float("nan")), ("ngram k=4", 1.5, 2.0),
                                                                ("ngram k=8 min_n=2", 1.5, 4.0))])
    first, second = (lookup_settings(table, {"s": [[1, 2]]}, ks=(2,), min_ns=(1,), max_tokens=4, arm=arm).iloc[0]
                     for arm in (None, "ngram k=8 min_n=2"))
    assert (first.verify_step_ms, second.verify_step_ms) == (2.0, 4.0)


def test_a_replayed_lookup_counts_the_engines_own_steps(sharp_gqa24):
    """Greedy speculation never paused (`max_draft_backoff` 0), one request at a time: its verify
    steps, its plain decode steps and the drafts it kept are what `replay_lookup` counts from
    plain greedy's output, for each k and shortest match, on prompts that repeat a phrase."""
    from conftest import run_until_done
    from test_spec_decode import repetitive_prompts, spec_engine

    from nanolab import SamplingParams
    from nanolab.lab.specbench import replay_lookup

    prompts = repetitive_prompts(2, n=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = spec_engine(sharp_gqa24, None)
    outs = [s.output_token_ids for s in plain.add_requests(prompts, [params] * len(prompts))]
    run_until_done(plain)
    kept_any = rules_differ = False
    for k, min_n, until in ((2, 1, None), (2, 1, 1), (4, 2, None)):  # None: the default, two until a draft is kept
        engine = spec_engine(sharp_gqa24, k, speculative_config={
            "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_min_until_kept": until,
            "max_draft_backoff": 0})
        until = engine.config.speculative_config.min_until_kept
        for prompt, out in zip(prompts, outs, strict=True):
            verified, steps = engine.spec_steps, 0
            seq = engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            assert seq.output_token_ids == out
            want = replay_lookup(prompt, out, k, min_n, 4, max_tokens=20, min_until_kept=until)
            verify = engine.spec_steps - verified
            got = {"verify_steps": verify, "plain_steps": steps - 1 - verify,  # the first step: the prompt's
                   "accepted_tokens": seq.num_accepted_tokens}
            assert got == want, (k, min_n, until, prompt)
            kept_any |= want["accepted_tokens"] > 0
            rules_differ |= want != replay_lookup(prompt, out, k, min_n, 4, max_tokens=20)
    assert kept_any and rules_differ, "no prompt tells the rule until a draft is kept from min_n's"


def test_a_chained_replay_counts_the_engines_own_steps(sharp_gqa24):
    """The same under asynchronous scheduling, where greedy speculation chains: each request's
    verify steps, plain steps (its calls but the prompt's and the last read-back, less the verify
    steps) and kept drafts are what `replay_chained` counts from plain greedy's output."""
    from conftest import run_until_done
    from test_spec_decode import repetitive_prompts, spec_engine

    from nanolab import SamplingParams
    from nanolab.lab.specbench import replay_chained

    prompts = repetitive_prompts(0, n=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = spec_engine(sharp_gqa24, None)
    outs = [s.output_token_ids for s in plain.add_requests(prompts, [params] * len(prompts))]
    run_until_done(plain)
    kept_any = lost_any = rules_differ = False
    for k, min_n, until in ((2, 1, None), (2, 1, 1), (4, 2, None)):
        engine = spec_engine(sharp_gqa24, k, async_scheduling=True, speculative_config={
            "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_min_until_kept": until,
            "max_draft_backoff": 0})
        until = engine.config.speculative_config.min_until_kept
        for prompt, out in zip(prompts, outs, strict=True):
            before = (engine.spec_steps, engine.spec_draft_tokens)
            seq, calls = engine.add_request(prompt, params), 0
            while engine.has_unfinished_requests():
                engine.step()
                calls += 1
            assert seq.output_token_ids == out
            want = replay_chained(prompt, out, k, min_n, 4, max_tokens=20, min_until_kept=until)
            verify = engine.spec_steps - before[0]
            got = {"verify_steps": verify, "plain_steps": calls - 2 - verify,
                   "accepted_tokens": seq.num_accepted_tokens}
            assert got == want, (k, min_n, until, prompt)
            kept_any |= want["accepted_tokens"] > 0
            lost_any |= engine.spec_draft_tokens - before[1] > want["accepted_tokens"]
            rules_differ |= want != replay_chained(prompt, out, k, min_n, 4, max_tokens=20)
    assert kept_any and lost_any and rules_differ, "no prompt tells the rule until a draft is kept from min_n's"


def test_a_chained_replay_is_worked_by_hand():
    from nanolab.lab.specbench import chained_settings, replay_chained

    prompt, out = [5, 6, 7, 5, 6, 7], [5, 6, 7, 8, 5, 6]
    # k = 2. Step 1 (after 5, known): drafts 6, 7. Step 2, launched before step 1 is read back: the
    # lookup over ..., 5, 6, 7 gives 5, 6, 7: guess 5 (wrong: step 1 adds 8), drafts 6, 7. Step 1
    # keeps 6, 7 and adds 8: step 2 is stale. Step 3 (over the known ..., 8 alone): no match, plain.
    # Step 2, fed 8 then 6, 7, keeps none and adds 5. Step 3 adds 6, the last: nothing follows.
    assert replay_chained(prompt, out, k=2) == {"verify_steps": 2, "plain_steps": 1, "accepted_tokens": 2}
    # priced: a plain step 1 ms, a verify step 1.5; off emits the 5 tokens after the first in 5 plain steps
    table = pd.DataFrame([{"set": "s", "arm": "off", "prompt": 0, "token_ids": out}])
    row = chained_settings(table, {"s": [prompt]}, 1.0, 1.5, settings=((2, 1),), max_tokens=6).iloc[0]
    steps = (row.verify_steps, row.plain_steps, row.verify_steps_synchronous, row.plain_steps_synchronous)
    assert steps == (2, 1, 1, 2)
    assert row.speedup_chained == pytest.approx(5 / (2 * 1.5 + 1.0))


def test_a_replay_until_a_draft_is_kept_is_worked_by_hand():
    from nanolab.lab.specbench import chained_settings, replay_lookup

    prompt, out = [9, 5, 3], [5, 3, 8, 5, 3, 8]
    # One token throughout, k = 2: after 5, [5] matched at 1 drafts 3, 5 (keeps 3, adds 8); after 8
    # nothing; after 5 again, 3 (room for one, kept): two verify steps, one plain, two kept.
    assert replay_lookup(prompt, out, 2, max_tokens=6) == {"verify_steps": 2, "plain_steps": 1, "accepted_tokens": 2}
    # Two tokens until a draft is kept: after 5, [3, 5] never occurred: plain. After 3, [5, 3] drafts
    # 5, 3 and keeps none (out has 8, 5); after 8 and after 5 no two-token match; after the last 3 no
    # room: one verify step, four plain, nothing kept.
    assert replay_lookup(prompt, out, 2, max_tokens=6, min_until_kept=2) == {
        "verify_steps": 1, "plain_steps": 4, "accepted_tokens": 0}
    table = pd.DataFrame([{"set": "s", "arm": "off", "prompt": 0, "token_ids": out}])
    rows = chained_settings(table, {"s": [prompt]}, 1.0, 1.5, settings=((2, 1), (2, 1, 2)), max_tokens=6)
    assert rows.min_until_kept.isna().tolist() == [True, False] and rows.min_until_kept.iloc[1] == 2
    assert rows.verify_steps_synchronous.tolist() == [2, 1]


def test_divergences_find_where_each_output_first_parts_from_off():
    from nanolab.lab.specbench import divergences

    rows = [("off", 0, [5, 6, 7, 8]), ("off", 1, [9, 9]), ("on", 0, [5, 6, 1, 8]), ("on", 1, [9, 9, 3]),
            ("k8", 0, [5, 6, 7, 8]), ("k8", 1, [9])]
    table = pd.DataFrame([{"set": "s", "arm": a, "prompt": p, "token_ids": t} for a, p, t in rows])
    got = divergences(table)
    assert got[["arm", "prompt", "position", "off_token", "arm_token"]].values.tolist() == [
        ["on", 0, 2, 7, 1], ["on", 1, 2, -1, 3], ["k8", 1, 1, 9, -1]]


def test_tie_margins_are_the_log_probabilities_where_outputs_part(tiny_path):
    """The margin is off's token's log-probability minus the arm's at the first position where they
    part, as a plain greedy run asked for its top log-probabilities gives them there."""
    from nanolab import LLM, SamplingParams
    from nanolab.lab.specbench import tie_margins

    llm = LLM(str(tiny_path), device="cpu", enable_prefix_caching=False)
    prompt = llm.tokenizer.encode("The capital of France is")
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                          use_tqdm=False)
    greedy = out.token_ids
    chosen, top = out.outputs[0].logprobs[2]  # at position 2: greedy's token and the runner-up
    runner_up, runner_lp = next((t, lp) for t, lp in top if t != greedy[2])
    table = pd.DataFrame([{"set": "s", "arm": "off", "prompt": 0, "token_ids": greedy},
                          {"set": "s", "arm": "on", "prompt": 0, "token_ids": greedy[:2] + [runner_up]}])
    (row,) = tie_margins(llm, table, {"s": [prompt]}).itertuples()
    assert (row.position, row.off_token, row.arm_token) == (2, greedy[2], runner_up)
    assert row.off_logprob == pytest.approx(chosen, abs=1e-4)
    assert row.arm_logprob == pytest.approx(runner_lp, abs=1e-4)
    assert row.margin == pytest.approx(chosen - runner_lp, abs=1e-4) and row.margin >= 0
    llm.close()


def test_a_prompts_row_is_its_run_of_median_time():
    from nanolab.lab.specbench import median_run

    runs = [{"seconds": s, "token_ids": [5, 6], "steps": n} for s, n in ((0.30, 1), (0.10, 2), (0.20, 3))]
    row = median_run(runs)
    assert (row["seconds"], row["steps"], row["repeats"], row["distinct_outputs"]) == (0.20, 3, 3, 1)
    assert (row["seconds_min"], row["seconds_max"]) == (0.10, 0.30)
    assert median_run(runs[:2])["seconds"] == 0.10  # the lower middle of an even count
    assert median_run([runs[0], {**runs[1], "token_ids": [5, 7]}, runs[2]])["distinct_outputs"] == 2
    with pytest.raises(ValueError, match="no run"):
        median_run([])
