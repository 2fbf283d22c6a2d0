"""Day 61's floor bench on a CPU: the timing arithmetic on a fake clock, the floor's bytes against
hand counts, the tables and their ratios, an arm's failure kept in its rows, the CLI's refusals,
and the gpt-fast adaptor's weight mapping checked logit for logit (when a checkout is present)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import make_cache, prefill_logits

import nanolab.__main__ as cli
from nanolab import LLM, Engine, EngineConfig, load_model
from nanolab.lab import report
from nanolab.lab.costs import kv_read_bytes, step_read_bytes, weight_bytes
from nanolab.lab.floorbench import (
    STEMS,
    Arm,
    FloorBench,
    Shape,
    check_context,
    cpu_target_line,
    decode_row,
    decode_shapes,
    floor_columns,
    floor_tables,
    merge_tables,
    nanolab_generate,
    parse_arms,
    parse_pairs,
    ratio_lines,
    roofline_table,
    run_floorbench,
    ttft_row,
)
from nanolab.lab.reference import engine_greedy
from nanolab.lab.timing import random_prompts, time_generate
from nanolab.model.config import PRESETS, ModelConfig, RopeScaling
from nanolab.model.weights import synthesize_weights

GPT_FAST = Path(__file__).resolve().parents[1] / "third_party" / "gpt-fast"
needs_gpt_fast = pytest.mark.skipif(not (GPT_FAST / "model.py").is_file(),
                                    reason="no gpt-fast checkout in third_party/gpt-fast (CI has none; the user "
                                           "supplies one)")


class FakeClock:
    """A clock that only `run` advances: a call of n new tokens takes prefill + n * per_token."""

    def __init__(self, prefill: float, per_token: float) -> None:
        self.now, self.prefill, self.per_token, self.calls = 0.0, prefill, per_token, []

    def __call__(self) -> float:
        return self.now

    def run(self, new: int) -> None:
        self.calls.append(new)
        self.now += self.prefill + new * self.per_token


@pytest.mark.parametrize("short", [1, 2])
def test_time_generate_is_long_minus_short_over_steps(short):
    clock = FakeClock(prefill=0.030, per_token=0.002)
    ms = time_generate(clock.run, 256, repeats=3, short=short, warmup=2, clock=clock)
    assert ms == pytest.approx(2.0)
    long = short + 256
    assert clock.calls == [long, long] + [long, short] * 3  # warm-up, then interleaved pairs


def test_floor_bytes_by_hand(tiny_model):
    c = PRESETS["tiny"]
    per_layer = 64 * 64 + 2 * (32 * 64) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q, k and v, o, mlp, two norms
    params = 512 * 64 + 2 * per_layer + 64  # the tied embedding once, the layers, the final norm
    assert step_read_bytes(c, 1, 0, torch.float32) == params * 4 == weight_bytes(tiny_model)
    kv = 2 * 2 * 16 * 2 * 4  # layers x kv heads x head_dim x (K, V) x fp32, one token
    assert step_read_bytes(c, 3, 10, torch.float32) == params * 4 + 3 * 10 * kv

    llama = PRESETS["llama-3.2-1b"]
    weights = step_read_bytes(llama, 1, 0, torch.bfloat16)
    assert weights == 2_471_628_800 and round(weights / 1e9, 3) == 2.472  # REFERENCES' 2.472 GB, head once
    assert kv_read_bytes(llama, 32, 2048, torch.bfloat16) == 32 * 2048 * 16 * 8 * 64 * 2 * 2


def test_shapes_decode_near_their_context():
    shapes = decode_shapes([1, 8], 128, [(32, 2048)], 256)
    assert shapes == [Shape(1, 128, 128), Shape(8, 128, 128), Shape(32, 2048, 1920)]
    assert shapes[-1].kv_tokens(256) == 2048 and shapes[0].kv_tokens(256) == 256
    with pytest.raises(ValueError, match="too short"):
        decode_shapes([], 128, [(4, 100)], 256)
    # a call past the model's context is refused before any arm runs, naming its flags
    check_context(shapes, [(1, 2047)], 256, context=2048 + 128 + 2)  # the longest fits exactly
    with pytest.raises(ValueError, match="--contexts/--prompt-len/--steps: a call at context 2048"):
        check_context(shapes, [], 256, context=2048 + 128 + 1)
    with pytest.raises(ValueError, match="--ttft 1x2048"):
        check_context(shapes[:1], [(1, 2048)], 256, context=2048)


def _bench(ms: dict[str, float], bandwidth: float = 4e12, targets: bool = True) -> FloorBench:
    shapes = [Shape(1, 128, 128), Shape(8, 128, 128)]
    roofline = roofline_table(PRESETS["llama-3.2-1b"], shapes, 256, torch.bfloat16, bandwidth, targets)
    rows = []
    for arm, base in ms.items():
        for s in shapes:
            row = {**decode_row(arm, f"{arm} label", s, 256), "ms_per_step": base * (1 if s.batch == 1 else 1.1)}
            rows.append({**row, **floor_columns(row, roofline)})
    ttft = [{**ttft_row(arm, arm, 1, 2048, 5), "ttft_ms": 10 * base} for arm, base in ms.items()]
    return floor_tables(pd.DataFrame(rows), pd.DataFrame(ttft), roofline)


def test_x_floor_targets_and_speedups():
    bench = _bench({"nanolab": 1.2, "hf-default": 2.4})
    roof = bench.roofline.set_index("batch")
    floor1 = (2_471_628_800 + 256 * 32768) / 4e12 * 1000
    assert roof.floor_ms[1] == pytest.approx(floor1)
    assert roof.target_ms[1] == 1.0 and roof.stretch_ms[1] == 0.8 and roof.target_ms[8] == 1.1
    d = bench.decode.set_index(["arm", "batch"])
    assert d.x_floor["nanolab", 1] == pytest.approx(1.2 / floor1)
    assert d.x_target["nanolab", 1] == pytest.approx(1.2) and d.x_target["nanolab", 8] == pytest.approx(1.2)
    assert d.nanolab_speedup["hf-default", 8] == pytest.approx(2.0) and d.nanolab_speedup["nanolab", 1] == 1.0
    assert roof["x_floor_hf-default"][1] == pytest.approx(2.4 / floor1)
    lines = ratio_lines(bench)
    assert lines[0].startswith("batch 1 @ 128: floor") and "1.20x target 1.00 ms" in lines[0]
    assert "1.50x stretch 0.80 ms" in lines[0] and "(nanolab speedup 2.00x)" in lines[0]
    assert "1.20x target 1.10 ms" in lines[1]
    assert lines[2] == "TTFT 1 x 2048: nanolab 12.0 ms, hf-default 24.0 ms (nanolab speedup 2.00x, target 1.5x)"


def test_append_keeps_earlier_arms_and_redoes_the_comparisons():
    earlier = _bench({"nanolab": 1.2, "hf-default": 2.4})
    earlier.decode["run"] = "earlier"
    now = _bench({"nanolab": 1.0, "gpt-fast": 1.5})
    merged = merge_tables(now, earlier)
    d = merged.decode.set_index(["arm", "batch"])
    assert sorted(set(merged.decode.arm)) == ["gpt-fast", "hf-default", "nanolab"] and len(d) == 6
    assert d.ms_per_step["nanolab", 1] == 1.0 and d.run["hf-default", 1] == "earlier"
    assert d.nanolab_speedup["hf-default", 1] == pytest.approx(2.4) and d.nanolab_speedup["gpt-fast", 1] == 1.5
    assert {"x_floor_nanolab", "x_floor_hf-default", "x_floor_gpt-fast"} <= set(merged.roofline.columns)
    assert len(merged.roofline) == 2 and sorted(merged.ttft.arm) == ["gpt-fast", "hf-default", "nanolab"]
    # A run of one shape (the rest of a run cut off by a time limit) replaces that shape's rows only.
    again = _bench({"gpt-fast": 3.0})
    at8 = FloorBench(again.decode[again.decode.batch == 8], again.roofline[again.roofline.batch == 8],
                     again.ttft.iloc[:0])
    d = merge_tables(at8, merged).decode.set_index(["arm", "batch"])
    assert len(d) == 6 and d.ms_per_step["gpt-fast", 8] == pytest.approx(3.3) and d.ms_per_step["gpt-fast", 1] == 1.5


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("tiny", device="cpu", max_num_seqs=8, num_blocks=64)


def test_a_run_on_the_cpu_says_what_ran(tiny_llm, one_thread, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DATA_DIR", tmp_path)
    shapes = decode_shapes([1, 2], 16, [(2, 40)], 8)
    seen = []
    bench = run_floorbench(tiny_llm, shapes, steps=8, repeats=1, warmup=1, arms=["nanolab", "hf-default", "hf-eager"],
                           ttft_cases=[(1, 24), (2, 12)], ttft_repeats=2, bandwidth=1e10,
                           on_row=lambda b: seen.append((len(b.decode), len(b.ttft))), progress=False)
    assert seen[:5] == [(1, 0), (2, 0), (3, 0), (3, 1), (3, 2)] and seen[-1] == (9, 6)  # saved after each row
    d = bench.decode
    assert len(d) == 9 and (d.error == "").all() and (d.ms_per_step > 0).all()
    assert set(d.label) == {"nanolab (eager, reference read)", "hf static (default, not compiled)",
                            "hf static (disable_compile=True, eager)"}  # transformers compiles on accelerators only
    assert "on cpu" in d[d.arm == "hf-default"].note.iloc[0]
    t = bench.ttft
    assert len(t) == 6 and list(t.groupby(["batch", "prompt_len"], sort=False).size()) == [3, 3]
    assert (t.ttft_ms > 0).all() and (t[t.arm == "nanolab"].nanolab_speedup == 1).all()
    label = report.run_label("cpu", "tiny", torch.float32, weights=tiny_llm.weights_kind)
    for stem, table in bench.tables().items():
        back = pd.read_csv(report.save_table(table, stem, label))
        assert back.device_slug.eq("cpu").all() and back.weights.eq("synthesized random").all()
        assert back.model.eq("tiny").all() and len(back) == len(table)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{s}_cpu.csv" for s in STEMS)


def test_an_arms_failure_is_kept_in_its_rows(tiny_llm, one_thread):
    def runner(prompts):
        if len(prompts) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return nanolab_generate(tiny_llm, prompts)

    flaky = Arm("flaky", "flaky arm", runner)
    bench = run_floorbench(tiny_llm, [Shape(1, 16, 16), Shape(2, 16, 16)], steps=4, repeats=1, warmup=0,
                           arms=["gpt-fast"], gpt_fast="/no/such/checkout", extra_arms=[flaky],
                           ttft_cases=[(2, 8)], ttft_repeats=1, bandwidth=1e10, progress=False)
    d = bench.decode.set_index(["arm", "batch"])
    assert "not a gpt-fast checkout" in d.error["gpt-fast", 1] and math.isnan(d.ms_per_step["gpt-fast", 2])
    assert d.error["flaky", 1] == "" and d.ms_per_step["flaky", 1] > 0
    assert d.error["flaky", 2].startswith("OutOfMemoryError: CUDA out of memory")
    assert list(bench.ttft.arm) == ["flaky"] and "OutOfMemoryError" in bench.ttft.error.iloc[0]
    assert any("flaky arm: failed" in line for line in ratio_lines(bench))


def test_the_command_writes_labelled_tables_and_appends(tmp_path, monkeypatch, capsys, one_thread):
    monkeypatch.setattr(report, "DATA_DIR", tmp_path)
    base = ["floorbench", "--model", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "1@12", "--steps",
            "4", "--repeats", "1", "--warmup", "0", "--ttft", "1x8"]
    assert cli.main([*base, "--arms", "nanolab,hf-eager"]) == 0
    first = pd.read_csv(tmp_path / "day61_floor_cpu.csv")
    assert cli.main([*base, "--arms", "nanolab", "--append"]) == 0
    out = capsys.readouterr().out
    assert "batch 1 @ 12: floor" in out and "gpt-fast: not run (no --gpt-fast PATH)" in out
    floor = pd.read_csv(tmp_path / "day61_floor_cpu.csv")
    assert sorted(floor.arm) == ["hf-eager", "hf-eager", "nanolab", "nanolab"]
    hf = floor[floor.arm == "hf-eager"]
    assert list(hf.ms_per_step) == list(first[first.arm == "hf-eager"].ms_per_step)  # kept from the first run
    assert floor.run.nunique() == 2 and floor.device_slug.eq("cpu").all() and floor.model.eq("tiny").all()
    assert sorted(pd.read_csv(tmp_path / "day61_ttft_cpu.csv").arm) == ["hf-eager", "nanolab"]
    assert "error: nan" not in out.lower() and (floor.error.isna() | (floor.error == "")).all()


def test_the_eager_step_can_run_beside_the_compiled_one(tmp_path, monkeypatch, capsys, one_thread):
    """`--compile on --eager-beside`: nanolab's compiled step and its eager one, two arms of one
    process, each labelled with what ran; without --compile on the option is refused by name."""
    monkeypatch.setattr(report, "DATA_DIR", tmp_path)
    base = ["floorbench", "--model", "tiny", "--device", "cpu", "--batches", "1", "--contexts", "none", "--steps",
            "4", "--repeats", "1", "--warmup", "0", "--ttft", "none", "--arms", "nanolab"]
    assert cli.main([*base, "--eager-beside"]) == 2
    assert "--eager-beside: needs --compile on" in capsys.readouterr().err
    assert cli.main([*base, "--compile", "on", "--eager-beside"]) == 0
    floor = pd.read_csv(tmp_path / "day61_floor_cpu.csv").set_index("arm")
    assert sorted(floor.index) == ["nanolab", "nanolab-eager"] and floor.run.nunique() == 1
    assert "inductor" in floor.label["nanolab"] and "inductor" not in floor.label["nanolab-eager"]
    assert (floor.ms_per_step > 0).all()


def test_parsers():
    assert parse_pairs("32@2048, 8@4096", "--contexts", "@") == [(32, 2048), (8, 4096)]
    assert parse_pairs("none", "--contexts", "@") == [] == parse_pairs("", "--ttft", "x")
    assert parse_arms("all", None) == ["nanolab", "hf-default", "hf-eager"]
    assert parse_arms("all", "x") == ["nanolab", "hf-default", "hf-eager", "gpt-fast"]
    assert parse_arms("hf-eager,nanolab", None) == ["nanolab", "hf-eager"]


@pytest.mark.parametrize("args,needle", [
    (["--batches", "1,x"], "--batches: 'x' is not an integer"),
    (["--batches", "0"], "--batches: 0 must be at least 1"),
    (["--contexts", "32:2048"], "not BATCH@TOKENS"),
    (["--contexts", "4@100"], "context 100 is too short for 256 steps"),
    (["--ttft", "2048"], "--ttft: '2048' is not BATCHxTOKENS"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup: -1 must be at least 0"),
    (["--arms", "vllm"], "choose from nanolab, hf-default, hf-eager, gpt-fast"),
    (["--arms", "gpt-fast"], "needs --gpt-fast PATH"),
    (["--gpt-fast", "/no/such/checkout"], "no such folder"),
    (["--batches", "", "--contexts", "none"], "no shapes"),
])
def test_cli_refuses_bad_input_in_one_line(capsys, args, needle):
    assert cli.main(["floorbench", "--model", "tiny", *args]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and not out.strip()
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert needle in line, err


# --- the gpt-fast adaptor ----------------------------------------------------------------------

LLAMA3_TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                          rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 64), rms_norm_eps=1e-5,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,))


def test_interleave_rope_rows():
    from nanolab.lab.gptfast import interleave_rope_rows

    rows = torch.arange(8.0)[:, None]  # two heads of head_dim 4: halves (0, 1 | 2, 3) pair up as (0, 2), (1, 3)
    assert interleave_rope_rows(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@needs_gpt_fast
@pytest.mark.filterwarnings("ignore:.*sdp_kernel:FutureWarning")  # gpt-fast's decode loop uses the old context
@pytest.mark.parametrize("name", ["tiny", "llama3-untied"])
def test_gpt_fast_logits_equal_nanolabs(name, tmp_path_factory, one_thread):
    from nanolab import resolve_weights
    from nanolab.lab.gptfast import build_transformer, gpt_fast_generate, import_gpt_fast

    if name == "tiny":
        path = resolve_weights("tiny")
    else:  # GQA 4:1, an untied head and llama3 rope scaling that bends the low frequencies
        path = synthesize_weights(LLAMA3_TINY, tmp_path_factory.mktemp(name), dtype=torch.float32, seed=5,
                                  progress=False, preset=name)
    model = load_model(path, dtype=torch.float32)
    c = model.config
    before = torch._inductor.config.get_config_copy()
    gf = import_gpt_fast(GPT_FAST)
    assert torch._inductor.config.get_config_copy() == before  # its settings stay with its own calls
    theirs = build_transformer(gf, c, path, torch.float32, "cpu")
    tied = theirs.output.weight.data_ptr() == theirs.tok_embeddings.weight.data_ptr()
    assert tied == c.tie_word_embeddings

    prompt = random_prompts(1, 37, c.vocab_size, seed=2)
    cache = make_cache(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                       num_blocks=8)
    ours = prefill_logits(model, cache, [cache.blocks.open_row()], prompt.tolist())[0]
    with torch.device("cpu"):
        theirs.setup_caches(1, 40)
    with torch.no_grad():
        logits = theirs(prompt, torch.arange(37))[0]
    torch.testing.assert_close(logits, ours, atol=1e-5, rtol=1e-5)

    # Its generate loop, uncompiled, decodes nanolab's greedy tokens for every row.
    new = 6
    expected = engine_greedy(Engine(model, EngineConfig(num_blocks=16)), prompt.repeat(2, 1).tolist(), new)
    run = gpt_fast_generate(gf, theirs, prompt.repeat(2, 1), compile=False)
    torch.manual_seed(0)
    out, _ = run(new)
    assert out[:, 37:].tolist() == expected


@needs_gpt_fast
def test_gpt_fast_refuses_shapes_it_cannot_hold():
    from nanolab.lab.gptfast import import_gpt_fast, model_args

    wide = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    with pytest.raises(ValueError, match="heads x head_dim == hidden"):
        model_args(import_gpt_fast(GPT_FAST), wide)


def test_a_cpu_run_has_no_h200_targets_and_states_the_cpu_one_against_its_floor():
    # 30 GB/s: the floor of batch 1 is (weights + 256 tokens of K/V) / bandwidth, about 82.7 ms.
    bench = _bench({"nanolab": 100.0, "hf-default": 150.0}, bandwidth=30e9, targets=False)
    floor1 = (2_471_628_800 + 256 * 32768) / 30e9 * 1000
    assert bench.roofline.target_ms.isna().all() and bench.roofline.stretch_ms.isna().all()
    assert "target" not in ratio_lines(bench)[0]
    line = cpu_target_line(bench)
    assert "nanolab 1.50x as fast as HF's default path (target 2.0x)" in line
    assert f"2.0x would be 75.0 ms a step, {75.0 / floor1:.2f}x the floor" in line
    assert cpu_target_line(_bench({"nanolab": 1.0}, targets=False)) is None
