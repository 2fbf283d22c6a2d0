"""`lab.prefixsteps`: a request behind a cached system prompt feeds only its suffix, in one prompt
step, and the table says so; bad sizes are refused before any engine is built."""

from __future__ import annotations

import pytest

from nanolab import SamplingParams
from nanolab.lab.prefixsteps import PROFILED_SUFFIX, SPLIT_PARTS, run_prefix_steps


def test_a_hit_feeds_its_suffix_alone_in_one_step(tiny_path, one_thread):
    steps, kernels, split, ttft = run_prefix_steps(str(tiny_path), "cpu", system_len=64, suffixes=(10, 23),
                                                   repeats=2, decode_steps=3, log=lambda _: None)
    assert kernels is None  # the profiler's kernels are CUDA's
    assert set(steps.read) == {"engine"}
    hits = steps[steps.case == "prefix hit"]
    assert set(hits.phase) == {"prefill"} and len(hits) == 4  # one prompt step a request, nothing decoded after
    assert (hits.tokens == hits.suffix).all()  # 64 cached tokens: four full blocks, none fed again
    decode = steps[(steps.case == "decode") & (steps.phase == "decode")]
    assert len(decode) == 3 and (decode.tokens == 1).all() and (steps.ms > 0).all()
    # The split: one prompt step a request, of PROFILED_SUFFIX tokens; its timed parts fit in the step
    # and leave a rest; no graph replays on a CPU, so no GPU time.
    assert len(split) == 2 and (split.tokens == PROFILED_SUFFIX).all() and set(split.phase) == {"prefill"}
    parts = split[list(SPLIT_PARTS)]
    assert (parts > 0).all().all() and (split.rest_ms >= 0).all()
    assert ((parts.sum(axis=1) + split.rest_ms - split.step_ms).abs() < 1e-9).all()
    assert split.graph_gpu_ms.isna().all() and "replay_alone_ms" not in split
    # Inside them: the hit's lookup and sharing in scheduling, its plan in the forward's host part,
    # and no launch (an eager step).
    assert (split[["prefix_lookup_ms", "prefix_share_ms", "plan_ms"]] > 0).all().all() and (split.launch_ms == 0).all()
    assert (split.prefix_lookup_ms + split.prefix_share_ms < split.schedule_ms).all()
    assert (split.plan_ms < split.forward_host_ms).all() and (split.table_ms > 0).all()
    assert (split.table_ms < split.plan_ms).all() and (split.inputs_ms == 0).all()  # an eager plan is not padded
    # In process, on and off in turn: with caching on a request feeds its suffix in one step; off, it
    # feeds every prompt token (the tiny engine's budget takes 114 in one step).
    assert ttft.arm.tolist() == ["on", "off", "off", "on"] and (ttft.ttft_ms > 0).all()  # each first in turn
    by_arm = ttft.set_index("arm")
    assert (by_arm.loc["on"].fed_tokens == PROFILED_SUFFIX).all() and (by_arm.loc["on"].steps == 1).all()
    assert (by_arm.loc["off"].fed_tokens == 64 + PROFILED_SUFFIX).all()


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
    steps, _, split, _ = run_prefix_steps(str(tiny_path), "cpu", system_len=32, suffixes=(5,), repeats=2,
                                          decode_steps=2, reads=("broken", "engine"), log=log.append)
    failed = steps[steps.case == "failed"]
    assert failed.read.tolist() == ["broken"] and "no such launch" in failed.error.iloc[0]
    assert set(steps[steps.case != "failed"].read) == {"engine"} and len(steps[steps.case == "prefix hit"]) == 2
    assert any(line.startswith("broken: failed") for line in log)
    assert set(split.read) == {"engine"}


def test_the_ledger_cuts_the_prompt_step_at_its_graph():
    """`warm_hit_ledger`: the server's split in order, the prompt step cut into the split's median
    graph time (GPU) and the host's rest of it, and the budget at the aim from caching off."""
    import pandas as pd

    from nanolab.lab.prefixsteps import LEDGER, warm_hit_ledger

    on = dict(front_ms=1.5, core_wait_ms=0.2, step_host_ms=0.4, server_prefill_ms=2.6, back_ms=0.5)
    off = dict(front_ms=9.1, core_wait_ms=9.2, step_host_ms=9.3, server_prefill_ms=14.0, back_ms=9.5)
    ttft = pd.DataFrame([
        {"part": "shared prefix", "phase": "warm", "arm": "on", "ttft_p50_ms": 5.3, **on},
        {"part": "shared prefix", "phase": "warm", "arm": "off", "ttft_p50_ms": 18.0, **off},
        {"part": "shared prefix", "phase": "cold", "arm": "on", "ttft_p50_ms": 99.0, **off},
    ])
    # the engine's read: a median of 1.8 (a mean would be 2.03); a candidate read's graph is not counted
    split = pd.DataFrame({"read": ["engine"] * 3 + ["flat"], "graph_gpu_ms": [1.7, 1.8, 2.6, 0.1]})
    ledger = warm_hit_ledger(ttft, split, aim=4.0).set_index("part")
    assert list(ledger.index) == [name for name, _, _ in LEDGER]
    assert ledger.loc["prompt step, graph", "ms"] == 1.8 and ledger.loc["prompt step, graph", "side"] == "GPU"
    assert abs(ledger.loc["prompt step, host", "ms"] - 0.8) < 1e-12
    assert ledger.loc["front", "ms"] == 1.5 and (ledger.drop("prompt step, graph").side == "host").all()
    assert (ledger.budget_ms == 4.5).all() and (ledger.ttft_p50_ms == 5.3).all()  # the warm rows, not the cold
    with pytest.raises(ValueError, match="does not fit"):
        warm_hit_ledger(ttft, split.assign(graph_gpu_ms=3.0))
    with pytest.raises(ValueError, match="both arms"):
        warm_hit_ledger(ttft[ttft.arm == "on"], split)

    from nanolab.lab.prefixsteps import ledger_summary

    two = pd.concat([ledger.reset_index().assign(run="b"),
                     warm_hit_ledger(ttft, split.assign(graph_gpu_ms=1.0), aim=4.0).assign(run="a")])
    summary = ledger_summary(two)
    assert list(summary.index) == ["b", "a"]  # in the order given
    b = summary.loc["b"]
    assert abs(b.host - (1.5 + 0.2 + 0.4 + 0.8 + 0.5)) < 1e-12 and b.GPU == 1.8 and b["budget at the aim"] == 4.5
    assert abs(b["host's budget"] - 2.7) < 1e-12 and abs(b["host / its budget"] - 3.4 / 2.7) < 1e-12
    assert summary.loc["a", "GPU"] == 1.0 and abs(summary.loc["a", "host"] - 4.2) < 1e-12

    from nanolab.lab.prefixsteps import warm_hit_ledgers

    both, tables = warm_hit_ledgers([("b", ttft, split), ("gone", None, split), ("a", ttft, split.assign(
        graph_gpu_ms=1.0)), ("no split", ttft, None)], aim=4.0)
    pd.testing.assert_frame_equal(both, two.reset_index(drop=True))
    assert len(tables) == 2 * len(ttft) and warm_hit_ledgers([("gone", None, split)]) == (None, None)


def test_a_hit_seen_before_is_refused(tiny_path, one_thread):
    """`hit_step` times a prompt step only when it fed the suffix alone: the same prompt again is
    cached past its system prompt, and refused rather than timed as a hit of the suffix's size."""
    from nanolab import LLM
    from nanolab.lab.prefixsteps import hit_step

    llm = LLM(str(tiny_path), device="cpu")
    try:
        system = list(range(1, 65))
        prompt = system + list(range(100, 120))  # a full block past the system prompt: cached once fed
        llm.engine.add_request(system + [7], SamplingParams(temperature=0, max_tokens=1))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert hit_step(llm.engine, prompt, suffix=20)[0]["tokens"] == 20
        with pytest.raises(RuntimeError, match="fed 4 tokens, not its 20 new ones"):
            hit_step(llm.engine, prompt, suffix=20)
    finally:
        llm.close()


def test_each_pass_sends_prompts_no_other_pass_sent(tiny_path, one_thread, monkeypatch):
    """With the profiler's pass on (here a stand-in that runs it), every pass's hits still feed their
    suffix alone: `hit_step` would refuse one that an earlier pass had already cached."""
    import pandas as pd

    import nanolab.lab.prefixsteps as prefixsteps

    def profiled(run, steps, arm):
        run()
        return pd.DataFrame([{"arm": arm, "kernel": "k", "calls": 1, "gpu_us": 1.0, "us_per_step": 1.0,
                              "share": 1.0, "class": "projections"}])

    monkeypatch.setattr(prefixsteps, "profiled_kernels", profiled)
    log = []
    steps, kernels, split, ttft = run_prefix_steps(str(tiny_path), "cpu", system_len=32, suffixes=(5,), repeats=2,
                                                   decode_steps=2, profile=True, log=log.append)
    assert not any("failed" in line for line in log), log
    assert "failed" not in set(steps.case) and set(kernels.arm) == {f"prefix hit + {PROFILED_SUFFIX}", "decode"}
    assert (split.tokens == PROFILED_SUFFIX).all() and len(ttft) == 4


def test_patched_methods_come_off_after_an_error():
    from nanolab.lab.stepparts import timed_methods

    class Thing:
        def work(self):
            return 1

    thing, spent = Thing(), {}
    with pytest.raises(RuntimeError, match="inside"), timed_methods([(thing, "work")], spent):
        assert "work" in vars(thing) and thing.work() == 1
        raise RuntimeError("inside")
    assert "work" not in vars(thing) and spent["work"] > 0
