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


def test_idle_costs_time_a_round_trip_and_a_pass_at_each_gap():
    idle = frontcosts.idle_costs((0.0, 1.0), samples=3, prompt_len=64)
    assert list(zip(idle.gap_ms, idle.what)) == [(0.0, "pipe round trip"), (0.0, "stages"),
                                                 (1.0, "pipe round trip"), (1.0, "stages")]
    assert (idle.us_p50 > 0).all() and (idle.us_p90 >= idle.us_p50).all() and (idle.samples == 3).all()
    assert set(idle[idle.what == "stages"].prompt_len) == {64}


def test_idle_costs_with_a_polling_peer_time_both_round_trips():
    idle = frontcosts.idle_costs((0.0,), samples=2, prompt_len=64, polling=True)
    assert idle.what.tolist() == ["pipe round trip", "pipe round trip, peer polling", "stages"]
    assert (idle.us_p50 > 0).all()


def test_bad_gaps_are_refused_by_name_before_anything_runs():
    for gaps in ((-1.0,), (float("nan"),), (float("inf"),), ()):
        with pytest.raises(ValueError, match="gaps"):
            frontcosts.idle_costs(gaps)
    with pytest.raises(ValueError, match="prompt_len: 16"):
        frontcosts.idle_costs(prompt_len=16)
    with pytest.raises(ValueError, match="samples"):
        frontcosts.idle_costs(samples=0)
    for gaps in ("1,x", "-5", "nan"):
        with pytest.raises(ValueError, match="--gaps"):
            frontcosts.main(argparse.Namespace(lengths="64", repeats="1", gaps=gaps, prefix="never"))
    with pytest.raises(ValueError, match="--parts"):
        frontcosts.main(argparse.Namespace(lengths="64", repeats="1", gaps="0", parts="front,nap", prefix="never"))


class _Inbox:
    """A pipe end that is empty for `empty` polls, then holds `messages`, then None."""

    def __init__(self, empty: int, messages):
        self.empty, self.polls, self.messages = empty, 0, list(messages) + [None]

    def poll(self):
        self.polls += 1
        return self.polls > self.empty

    def recv(self):
        return self.messages.pop(0)


class _Outbox(list):
    def send(self, message):
        self.append(message)


def test_the_polling_peer_polls_and_the_other_blocks():
    for poll_s, polled in ((0.0, False), (5.0, True)):
        inbox, outbox = _Inbox(empty=3, messages=[1, 2]), _Outbox()
        frontcosts._echo(inbox, outbox, poll_s)
        assert outbox == [1, 2] and (inbox.polls > 3) == polled
