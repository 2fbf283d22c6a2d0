"""Model shapes: `ModelConfig`, read from a Hugging Face `config.json`, and the named presets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3's piecewise frequency scaling (`rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shapes of a Llama-family decoder; field names follow `LlamaConfig`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        o = self.num_attention_heads * self.head_dim * h
        per_layer = qkv + o + 3 * h * f + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    @classmethod
    def from_hf(cls, raw: dict) -> ModelConfig:
        """Parse a `config.json` dict. Rope settings may sit at the top level or, as
        transformers 5 writes them, under `rope_parameters`."""
        arch = raw.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model_type {arch!r} is not a Llama-family decoder")
        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or rope
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            rope_scaling = None
        else:
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default' and 'llama3')")
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        try:
            raw = json.loads(file.read_text())
        except ValueError as e:
            raise ValueError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_hf(raw)
        except KeyError as e:
            raise ValueError(f"{file}: missing {e.args[0]!r}") from None
        except (TypeError, AttributeError, ZeroDivisionError) as e:  # a field of the wrong type or size
            raise ValueError(f"{file}: a field is malformed ({type(e).__name__}: {e})") from None

    def to_hf(self) -> dict:
        """The `config.json` that transformers' `LlamaForCausalLM` reads back to this config."""
        raw = {k: v for k, v in asdict(self).items() if k not in ("rope_scaling", "eos_token_id")}
        raw.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                   attention_bias=False, mlp_bias=False, torch_dtype="bfloat16")
        eos = list(self.eos_token_id)
        raw["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        raw["rope_scaling"] = (
            None if self.rope_scaling is None else {"rope_type": "llama3", **asdict(self.rope_scaling)}
        )
        return raw


# The named presets. `tiny` is for tests; the others are real shapes whose weights are
# either found on disk or synthesized in the same layout (see `nanolab.model.weights`).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,),
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=(128001, 128008, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=(128001, 128008, 128009),
    ),
}
