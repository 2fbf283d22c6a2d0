"""The streamed-read bench's plumbing at a toy size on the CPU (the kernels in Triton's
interpreter, fp32; compiled on a GPU): every arm answers the reference's question, and bandwidth counts only the
K/V the batch holds. Its numbers come from the H200."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from nanolab.kernels.paged_attention import BLOCK, choose_launch
from nanolab.lab.streambench import ARMS, launch_rule, read_batch, run_streambench

# On a CUDA machine the compiled kernels run, timed through CUDA graphs as the bench times them.
TOY = dict(heads=4, kv_heads=2, head_dim=16, page=4, dtype=torch.float32,
           device="cuda" if torch.cuda.is_available() else "cpu")


def test_read_batch_scatters_blocks_and_lays_out_the_same_history():
    batch = read_batch([9, 3, 16], seed=1, **{k: v for k, v in TOY.items()})
    assert batch.block_table.shape == (3, 4) and (batch.block_table[1, 1:] == -1).all()
    used = batch.block_table[batch.block_table >= 0]
    assert sorted(used.tolist()) == list(range(3 + 1 + 4))  # every pool block used once
    k, v = batch.contiguous()
    assert k.shape == (3, 2, 16, 16)
    torch.testing.assert_close(k[0, :, 8], batch.k_pool[batch.slot_mapping[0, 8]])
    assert (k[1, :, 3:] == 0).all()
    assert batch.kv_bytes == (9 + 3 + 16) * 2 * 2 * 16 * 4


def test_every_arm_agrees_with_the_reference():
    shapes = {"uniform": [12, 12], "ragged": [13, 2, 7]}
    df = run_streambench(shapes, repeats=1, **TOY)
    assert list(df.arm.unique()) == list(ARMS) and len(df) == 2 * len(ARMS)
    for _, row in df.iterrows():
        if row.arm == "sdpa" and row["shape"] == "ragged":
            assert math.isnan(row.max_err)  # a contiguous rectangle answers another question
        else:
            assert row.max_err < 1e-4, row.to_dict()
    assert (df.tb_s > 0).all() and (df.x_reference > 0).all()
    assert (df[df.arm == "reference"].x_reference == 1).all()


def test_launch_rule_reads_the_rules_launch_out_of_a_sweep():
    # 16 rows x 2,048: the rule takes 8 shares at 2 stages; give the sweep that launch and two others
    variant, splits, warps, stages = choose_launch(16, 32, 8, 2048)
    runs = [(variant, splits, BLOCK, warps, stages, 40.0), (variant, splits, BLOCK, warps, 5 - stages, 44.0),
            ("gqa", 1, BLOCK, warps, stages, 32.0)]
    sweep = pd.DataFrame([{"shape": "16 x 2048", "rows": 16, "width": 2048, "variant": v, "splits": n, "block": b,
                           "num_warps": w, "num_stages": s, "us": us} for v, n, b, w, s, us in runs])
    rule = launch_rule(sweep, heads=32, kv_heads=8)
    assert rule.to_dict("records") == [{"shape": "16 x 2048", "variant": "split", "splits": 8, "num_stages": 2,
                                        "us": 40.0, "best_us": 32.0, "of_best": 1.25}]
    with pytest.raises(ValueError, match="16 x 2048: the sweep has 0 runs of the rule's launch"):
        launch_rule(sweep.iloc[1:], heads=32, kv_heads=8)
