"""The host bench's arms on the CPU: each emits every token it was asked for, speculation keeps
the stand-in's cycle (a verify step gives up to k + 1 tokens), and bad settings are refused by
name."""

from __future__ import annotations

import pytest
import torch

from nanolab.lab.hostbench import ARMS, CYCLE, LONG_CYCLE, CycleForward, host_summary, run_hostbench


def test_the_stand_in_forward_follows_its_cycle():
    forward = CycleForward(512, torch.device("cpu"))
    ids = torch.tensor([[100], [100 + CYCLE - 1], [7]])
    assert forward(ids, None)[:, -1].argmax(-1).tolist() == [101, 100, 100]
    long = CycleForward(512, torch.device("cpu"), LONG_CYCLE)
    assert long(torch.tensor([[100 + CYCLE - 1], [99 + LONG_CYCLE]]), None)[:, -1].argmax(-1).tolist() == [
        100 + CYCLE, 100]
    with pytest.raises(ValueError, match="^cycle="):
        CycleForward(512, torch.device("cpu"), 413)


def test_every_arm_emits_its_tokens_and_speculation_keeps_every_draft():
    table = run_hostbench("cpu", k=4, tokens=40, prompt_len=CYCLE + 8, repeats=1, log=lambda _: None)
    steps = dict(zip(table.arm, table.steps))
    assert list(table.arm) == list(ARMS) and set(table.tokens) == {40}
    assert steps["decode"] == 40
    # Drafts kept but a few after the first token (the tiny model's, off the cycle): up to k + 1 = 5
    # tokens a verify step
    spec = table[table.arm.isin(["sync verify", "chained"])]
    assert (spec.drafts >= 24).all() and (spec.kept >= 0.75 * spec.drafts).all(), spec
    assert steps["sync verify"] <= 12 and steps["chained"] <= 12, steps
    # Over the long cycle no lookup finds a draft: a step a token, as plain decoding takes.
    unmatched = table.set_index("arm").loc["chained, no match"]
    assert unmatched.drafts == 0 and unmatched.steps == 40, unmatched
    summary = host_summary(table)
    assert summary.set_index("arm").loc["decode", "step_over_decode"] == 1.0


@pytest.mark.parametrize(("kwargs", "field"), [({"k": 0}, "k"), ({"tokens": 0}, "tokens"), ({"repeats": -1}, "repeats"),
                                               ({"prompt_len": CYCLE}, "prompt_len"),
                                               ({"tokens": 1952}, "tokens")])  # 96 + 1952 + 1 > 2,048
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        run_hostbench("cpu", **kwargs)
