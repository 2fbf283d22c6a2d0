"""Day 64b's frontcosts: every stage of a request's host work runs at each length, the packed and
listed prompts find the same cached prefix, and bad lengths are refused by name."""

from __future__ import annotations

import argparse

import pytest

from nanolab.lab import frontcosts
from nanolab.lab.frontcosts import STAGES, front_costs, front_totals


def test_every_stage_is_timed_at_every_length_and_the_totals_add_up():
    costs = front_costs((32, 100), repeats=1, inner=1)
    assert set(costs.stage) == set(STAGES) and set(costs.prompt_len) == {32, 100}
    assert (costs.us > 0).all()
    assert set(costs[costs.stage == "parse"].arm) == {"before", "now"} == set(costs[costs.stage == "lookup"].arm)
    totals = front_totals(costs).set_index("prompt_len")
    for n in (32, 100):
        now = costs[(costs.prompt_len == n) & costs.arm.isin(["now", "both"])].us.sum()
        assert totals.now[n] == pytest.approx(now) and totals.saved_us[n] == pytest.approx(totals.before[n] - now)


def test_bad_lengths_are_refused_by_name():
    with pytest.raises(ValueError, match="lengths: 16"):
        front_costs((16,))
    with pytest.raises(ValueError, match="--lengths"):
        frontcosts.main(argparse.Namespace(lengths="64,8", repeats="1", prefix="never"))
