"""`lab.varlenbench` on the CPU, the kernel in Triton's interpreter: a small case laid over a
shuffled pool reads what the reference reads under every config swept, and each row says which
launch it timed."""

from __future__ import annotations

import argparse

import pytest
import torch

from nanolab.kernels import INTERPRETED
from nanolab.lab.varlenbench import (
    DEFAULT,
    Layout,
    VarlenCase,
    VarlenConfig,
    capture_cases,
    capture_configs,
    capture_tokens,
    case_inputs,
    main,
    narrow_configs,
    persistent_configs,
    sweep_configs,
    time_case,
    time_decode_read,
)
from nanolab.model.config import ModelConfig


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="the kernel in Triton's interpreter: CPU only")
def test_every_config_reads_what_the_reference_reads(tiny_path, one_thread):
    config = ModelConfig.from_dir(tiny_path)
    case = VarlenCase("a chunk after a cached prefix, and a decode row", ((40, 9), (23, 1)))
    configs = [VarlenConfig(32, 32, 4, 2, 1), VarlenConfig(32, 32, 4, None, 2, share_tiles=1),
               VarlenConfig(32, 32, 4, None, 2, share_tiles=1, narrow=True)]
    rows = time_case(case, config, configs, repeats=1, sms=4, device="cpu", dtype=torch.float32)
    assert [r["error"] for r in rows] == ["", "", ""]
    assert all(r["max_err"] < 1e-4 and r["us"] > 0 and r["tokens"] == 10 for r in rows)
    # the first two at the engine's choice: narrow, the pools being small
    assert [(r["splits"], r["share_tiles"], r["narrow"]) for r in rows] == [(1, 4, True), (2, 1, True),
                                                                             (2, 1, True)]


def test_the_sweep_holds_the_engines_launch_and_sizes_pad_as_captured():
    configs = sweep_configs()
    assert configs[0] == DEFAULT and len(configs) == len(set(configs)) > 30
    narrowed = narrow_configs()
    assert all(c.narrow is None for c in configs) and DEFAULT._replace(narrow=False) in narrowed
    assert len(set(narrowed)) == 24
    assert {c._replace(narrow=False) for c in narrowed if c.narrow} == {c for c in narrowed if not c.narrow}
    captured = capture_configs()
    assert DEFAULT.persistent is None  # the engine's rule: persistent programs where the walks are split
    flat = DEFAULT._replace(persistent=False)
    assert captured[0] == flat and DEFAULT._replace(persistent=True) in captured and len(set(captured)) == 10
    assert [c.segments for c in capture_cases((64, 496), (256,))] == [((256, 64),), ((256, 496),)]
    assert capture_cases()[-1].name == "496 tokens after 4,096"
    persistent = persistent_configs()
    assert flat in persistent and DEFAULT._replace(persistent=True) in persistent and len(set(persistent)) == 8
    assert [capture_tokens(n) for n in (1, 8, 9, 50, 512)] == [8, 8, 16, 64, 512]


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="the kernel in Triton's interpreter: CPU only")
def test_the_steps_layouts_read_what_the_reference_reads(tiny_path, one_thread):
    """The layouts a step hands the read: a table row per engine row (the padding ones empty, after
    the real ones), q inside the qkv projection's output, and the blocks scattered over a larger
    pool. The engine's launch reads what the reference reads in each, over the captured size's grid."""
    config = ModelConfig.from_dir(tiny_path)
    case = VarlenCase("a chunk after a cached prefix, and a decode row", ((40, 9), (23, 1)))
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    big = Layout("step, large pool", 6, True, 0.25 / 1024)
    args = case_inputs(case, heads, kv_heads, d, dtype=torch.float32, device="cpu", layout=big)
    assert args["table_rows"].tolist() == [0, 1, 2, 2, 2, 2] and args["context_lens"].tolist() == [49, 24, 0, 0, 0, 0]
    assert args["query_start_loc"].tolist() == [0, 9, 10, 10, 10, 10, 10]
    assert args["q"].shape == (10, heads, d) and args["q"].stride(0) == (heads + 2 * kv_heads) * d
    assert args["k_pool"].shape[0] > 4 * (4 + 2) * 16, "the blocks were not scattered over a larger pool"
    launches = [VarlenConfig(32, 32, 4, None, None, persistent=p) for p in (False, True, None)]
    for layout in (Layout("step", 6, True), big):
        rows = time_case(case, config, launches, repeats=1, sms=4, device="cpu", dtype=torch.float32, layout=layout)
        # None, the engine's rule: persistent programs where the walks are split
        for row, persistent in zip(rows, (False, True, rows[2]["splits"] > 1), strict=True):
            assert row["error"] == "" and row["max_err"] < 1e-4, row
            assert (row["layout"], row["table_segments"], row["grid_tokens"], row["persistent"]) == (
                layout.name, 6, 16, persistent)


@pytest.mark.skipif(not INTERPRETED or torch.cuda.is_available(), reason="the kernel in Triton's interpreter: CPU only")
def test_the_decode_read_a_row_a_token_reads_what_the_reference_reads(tiny_path, one_thread):
    """Segments of few tokens (a verify step's rows, a chunk after a prefix) as one decode row a token,
    padded to the captured size: every real token reads what the varlen reference reads."""
    config = ModelConfig.from_dir(tiny_path)
    case = VarlenCase("two verify rows and a short chunk", ((40, 5), (23, 5), (7, 3)))
    for layout in (Layout("alone"), Layout("step", 6, True)):
        row = time_decode_read(case, config, repeats=1, sms=4, device="cpu", dtype=torch.float32, layout=layout)
        assert row["error"] == "" and row["max_err"] < 1e-4, row
        assert (row["read"], row["tokens"], row["grid_tokens"]) == ("decode, a row a token", 13, 16)


def test_the_command_line_refuses_what_it_cannot_run_by_name():
    """Before looking for a GPU: one sweep at a time, and the capture sweep makes its own cases."""
    base = dict(repeats=1, pool_gib=1.0, dtype="bfloat16", cases=None, sweep=True, narrow_only=False,
                persistent_only=False, capture_sweep=False, model="tiny", prefix="never")
    for bad, match in (({"narrow_only": True, "capture_sweep": True}, "choose one"),
                       ({"capture_sweep": True, "cases": "verify"}, "--cases"), ({"repeats": 0}, "--repeats")):
        with pytest.raises(ValueError, match=match):
            main(argparse.Namespace(**{**base, **bad}))
