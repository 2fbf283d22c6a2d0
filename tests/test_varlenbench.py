"""`lab.varlenbench` on the CPU, the kernel in Triton's interpreter: a small case laid over a
shuffled pool reads what the reference reads under every config swept, and each row says which
launch it timed."""

from __future__ import annotations

import pytest
import torch

from nanolab.kernels import INTERPRETED
from nanolab.lab.varlenbench import DEFAULT, VarlenCase, VarlenConfig, capture_tokens, sweep_configs, time_case
from nanolab.model.config import ModelConfig


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="the kernel in Triton's interpreter: CPU only")
def test_every_config_reads_what_the_reference_reads(tiny_path, one_thread):
    config = ModelConfig.from_dir(tiny_path)
    case = VarlenCase("a chunk after a cached prefix, and a decode row", ((40, 9), (23, 1)))
    configs = [VarlenConfig(32, 32, 4, 2, 1), VarlenConfig(32, 32, 4, None, 2, share_tiles=1)]
    rows = time_case(case, config, configs, repeats=1, sms=4, device="cpu", dtype=torch.float32)
    assert [r["error"] for r in rows] == ["", ""]
    assert all(r["max_err"] < 1e-4 and r["us"] > 0 and r["tokens"] == 10 for r in rows)
    assert [(r["splits"], r["share_tiles"]) for r in rows] == [(1, 4), (2, 1)]


def test_the_sweep_holds_the_engines_launch_and_sizes_pad_as_captured():
    configs = sweep_configs()
    assert configs[0] == DEFAULT and len(configs) == len(set(configs)) > 30
    assert [capture_tokens(n) for n in (1, 8, 9, 50, 512)] == [8, 8, 16, 64, 512]
