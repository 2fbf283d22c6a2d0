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


def test_the_switch_off_batch_is_where_speculation_stops_paying():
    from nanolab.lab.specbench import switch_off_batch

    table = pd.DataFrame({"arm": ["off"] * 3 + ["ngram k=4"] * 3, "batch": [1, 4, 16] * 2,
                          "speedup_over_off": [1.0, 1.0, 1.0, 1.6, 1.0, 0.7]})
    assert switch_off_batch(table) == 4  # no faster is not faster
    table.loc[4, "speedup_over_off"] = 1.01
    assert switch_off_batch(table) == 16
    table.loc[5, "speedup_over_off"] = 1.2
    assert switch_off_batch(table) is None
