"""`time_hf`'s decode estimate on a machine that disturbs it: a fake `generate` whose durations are
scripted, so the estimate is checked against known numbers."""

from __future__ import annotations

import time

import pytest
import torch

from nanolab.lab.timing import time_hf


class ScriptedGenerate:
    """`generate` taking scripted seconds: `durations[n]` is the list of times for max_new_tokens=n,
    used in order (the last repeats)."""

    device = torch.device("cpu")

    def __init__(self, durations: dict[int, list[float]]) -> None:
        self.durations = {n: list(d) for n, d in durations.items()}

    def generate(self, ids, max_new_tokens: int, **kwargs):
        queue = self.durations[max_new_tokens]
        time.sleep(queue.pop(0) if len(queue) > 1 else queue[0])


def test_the_medians_when_they_are_measurable():
    model = ScriptedGenerate({5: [0.06, 0.05, 0.05, 0.05], 1: [0.01]})
    timing = time_hf(model, torch.zeros(1, 4, dtype=torch.long), steps=4, cache="static", repeats=3)
    assert timing.ms_per_step == pytest.approx(10.0, abs=2.0)  # (50 ms - 10 ms) / 4


def test_a_busy_spell_falls_back_to_the_fastest_runs():
    # A busy spell slows the short runs: the medians cross, and more pairs are timed until the
    # fastest of each side separate.
    model = ScriptedGenerate({5: [0.05, 0.05, 0.05, 0.05], 1: [0.08, 0.08, 0.08, 0.01]})
    timing = time_hf(model, torch.zeros(1, 4, dtype=torch.long), steps=4, cache="static", repeats=2)
    assert timing.ms_per_step == pytest.approx(10.0, abs=2.0)


def test_never_measurable_raises():
    model = ScriptedGenerate({5: [0.01], 1: [0.02]})
    with pytest.raises(RuntimeError, match="not measurable"):
        time_hf(model, torch.zeros(1, 4, dtype=torch.long), steps=4, cache="static", repeats=1)
