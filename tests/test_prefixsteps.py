"""`lab.prefixsteps`: a request behind a cached system prompt feeds only its suffix, in one prompt
step, and the table says so; bad sizes are refused before any engine is built."""

from __future__ import annotations

import pytest

from nanolab.lab.prefixsteps import run_prefix_steps


def test_a_hit_feeds_its_suffix_alone_in_one_step(tiny_path, one_thread):
    steps, kernels = run_prefix_steps(str(tiny_path), "cpu", system_len=64, suffixes=(10, 23), repeats=2,
                                      decode_steps=3, log=lambda _: None)
    assert kernels is None  # the profiler's kernels are CUDA's
    assert set(steps.read) == {"engine"}
    hits = steps[steps.case == "prefix hit"]
    assert set(hits.phase) == {"prefill"} and len(hits) == 4  # one prompt step a request, nothing decoded after
    assert (hits.tokens == hits.suffix).all()  # 64 cached tokens: four full blocks, none fed again
    decode = steps[(steps.case == "decode") & (steps.phase == "decode")]
    assert len(decode) == 3 and (decode.tokens == 1).all() and (steps.ms > 0).all()


def test_sizes_are_checked_first():
    with pytest.raises(ValueError, match="must be positive"):
        run_prefix_steps("tiny", "cpu", suffixes=(0,))
    for reads in ((), ("engine", "engine"), ("fast",), ("engine", "persistent")):  # the last: no streamed read here
        with pytest.raises(ValueError, match="reads"):
            run_prefix_steps("no-such-model", "cpu", reads=reads)  # refused before any model is looked for


def test_a_read_that_fails_leaves_a_row_and_the_others_go_on(tiny_path, one_thread, monkeypatch):
    """A candidate read whose engine cannot be built (here a runner that raises) is logged, leaves a
    row naming its error, and drops out; the engine's read still times every request."""
    import nanolab.lab.prefixsteps as prefixsteps
    from nanolab.engine.runner import ModelRunner

    class Broken(ModelRunner):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("no such launch")

    monkeypatch.setattr(prefixsteps, "READ_ARMS", {"engine": ModelRunner, "broken": Broken})
    monkeypatch.setattr(prefixsteps, "default_read", lambda device: "streamed")
    log = []
    steps, _ = run_prefix_steps(str(tiny_path), "cpu", system_len=32, suffixes=(5,), repeats=2, decode_steps=2,
                                reads=("broken", "engine"), log=log.append)
    failed = steps[steps.case == "failed"]
    assert failed.read.tolist() == ["broken"] and "no such launch" in failed.error.iloc[0]
    assert set(steps[steps.case != "failed"].read) == {"engine"} and len(steps[steps.case == "prefix hit"]) == 2
    assert any(line.startswith("broken: failed") for line in log)
