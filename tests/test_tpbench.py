"""The tensor-parallel bench (`lab.tpbench`) runs its arms end to end on the CPU as gloo groups:
rows for each arm and batch, rank 0's shard half the weights' matrices, and the speedup table.
The measurement itself is the H200s' (nvidia-h200-x2)."""

from __future__ import annotations

import pandas as pd
import pytest

from nanolab.lab import tpbench


def test_the_bench_runs_tp1_and_tp2_and_tabulates_the_speedup():
    # 16 steps, two pairs: on a busy 2-core machine 4 steps of the tiny model were not always
    # longer than 1, and the bench refuses a time it cannot measure.
    df = tpbench.run_tpbench(["tiny"], ["tp1", "tp2"], [1, 2], steps=16, repeats=2, device="cpu")
    assert (df.error == "").all(), df.error.tolist()
    assert sorted(zip(df.arm, df.batch)) == [("tp1", 1), ("tp1", 2), ("tp2", 1), ("tp2", 2)]
    assert (df.ms_per_step > 0).all() and (df.floor_ms > 0).all()
    shard = df.groupby("arm").shard_gb.first()
    assert 0.4 < shard.tp2 / shard.tp1 < 0.75  # norms stay whole on every rank
    s = tpbench.speedups(df)
    assert list(s.batch) == [1, 2] and (s.tp2_speedup > 0).all()
    assert tpbench.target_line(df) is None  # the target is the 8B model's


def test_the_target_line_reads_the_8b_rows():
    df = pd.DataFrame({"model": ["llama-3.1-8b"] * 2, "arm": ["tp1", "tp2"], "batch": [1, 1],
                       "ms_per_step": [4.0, 2.5], "error": ["", ""]})
    assert tpbench.target_line(df) == ("llama-3.1-8b at batch 1 (eager step): TP=2 is 1.60x TP=1 "
                                       "(target 1.5x: met, 1.07 of it)")
    inductor = pd.concat([df, df.assign(arm=df.arm + "-inductor", ms_per_step=[3.0, 1.5])])
    assert tpbench.target_line(inductor).startswith("llama-3.1-8b at batch 1 (inductor): TP=2 is 2.00x TP=1")


def test_an_unknown_arm_is_refused_by_name():
    with pytest.raises(ValueError, match="--arms: 'tp2-fast'"):
        tpbench.arm("tp2-fast")
    assert tpbench.arm("tp2-inductor") == tpbench.Arm("tp2-inductor", 2, compile=True)
    assert tpbench.arm("tp1-default").label() == "TP=1 (graphs, inductor, async scheduling)"
