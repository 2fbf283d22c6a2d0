"""gpt-fast as a peer arm: its `Transformer` and its generate loop, imported from a checkout the
user supplies, built at a nanolab model's shapes and filled with the same weights. Day 61.

No gpt-fast code is in this repo. `import_gpt_fast(path)` imports `model.py` and `generate.py`
from a checkout of github.com/pytorch-labs/gpt-fast; `build_transformer` maps a nanolab weights
folder (Hugging Face names) onto gpt-fast's names, as its own `convert_hf_checkpoint` script would:
q, k and v fused into `wqkv`, and the rows of q and k reordered from the rotate-half rope layout
to gpt-fast's interleaved pairs. A tied head shares the embedding's tensor, so a step reads it once.
`gpt_fast_generate` runs its `generate()` as its `--compile` flag does (`decode_one_token`
compiled with mode="reduce-overhead", fullgraph=True), under the inductor settings its
`generate.py` chooses, which are kept to its own calls.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nanolab.model.config import ModelConfig
from nanolab.model.weights import load_checkpoint


@dataclass(frozen=True)
class GptFast:
    path: Path
    model: types.ModuleType  # its model.py: Transformer, ModelArgs
    generate: types.ModuleType  # its generate.py: prefill, decode_one_token, decode_n_tokens, generate
    decode_one_token: Callable  # generate.py's own, before any compile
    inductor: dict  # the inductor settings generate.py makes on import, by flat name
    functorch: dict  # and functorch's

    @contextlib.contextmanager
    def settings(self, decode_one_token: Callable):
        """gpt-fast's compiler settings, and `decode_one_token` in its generate loop, for the calls
        made inside only."""
        self.generate.decode_one_token = decode_one_token
        try:
            with torch._inductor.config.patch(self.inductor), torch._functorch.config.patch(self.functorch):
                yield
        finally:
            self.generate.decode_one_token = self.decode_one_token


def _load(path: Path, name: str) -> types.ModuleType:
    file = path / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == file.resolve():
            return loaded
        raise ValueError(f"a module named {name!r} is already imported (from {getattr(loaded, '__file__', None)}); "
                         f"gpt-fast's {file} cannot be imported beside it")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _tokenizer_stand_in() -> types.ModuleType:
    # generate.py imports its tokenizer module, which needs sentencepiece and tiktoken; the bench
    # feeds token ids and never tokenizes.
    module = types.ModuleType("tokenizer")

    def get_tokenizer(*args, **kwargs):
        raise RuntimeError("gpt-fast's tokenizer needs sentencepiece and tiktoken, which are not installed")

    module.get_tokenizer = get_tokenizer
    return module


def _changed(before: dict, after: dict) -> dict:
    return {k: v for k, v in after.items() if before.get(k) != v}


_IMPORTED: dict[Path, GptFast] = {}  # a checkout's modules are imported once a process


def import_gpt_fast(path: Path | str) -> GptFast:
    """gpt-fast's modules from a checkout at `path`. Its generate.py sets inductor options when
    imported; they are undone for the rest of the process and kept in `GptFast.settings()`.
    Raises ValueError for a folder that is not a gpt-fast checkout."""
    path = Path(path).expanduser().resolve()
    if path in _IMPORTED:
        return _IMPORTED[path]
    missing = [f"{name}.py" for name in ("model", "generate") if not (path / f"{name}.py").is_file()]
    if missing:
        raise ValueError(f"--gpt-fast {path}: not a gpt-fast checkout (no {', '.join(missing)})")
    inductor, functorch = torch._inductor.config.get_config_copy(), torch._functorch.config.get_config_copy()
    model = _load(path, "model")
    try:
        _load(path, "tokenizer")
    except ModuleNotFoundError as e:
        if e.name not in ("sentencepiece", "tiktoken"):
            raise
        sys.modules["tokenizer"] = _tokenizer_stand_in()
    generate = _load(path, "generate")
    ours = _changed(inductor, torch._inductor.config.get_config_copy())
    theirs_functorch = _changed(functorch, torch._functorch.config.get_config_copy())
    torch._inductor.config.load_config(inductor)
    torch._functorch.config.load_config(functorch)
    _IMPORTED[path] = GptFast(path, model, generate, generate.decode_one_token, ours, theirs_functorch)
    return _IMPORTED[path]


def model_args(gf: GptFast, config: ModelConfig):
    """gpt-fast's `ModelArgs` at `config`'s shapes. Raises ValueError for shapes it cannot hold
    (its attention assumes heads x head_dim == hidden)."""
    if config.num_attention_heads * config.head_dim != config.hidden_size:
        raise ValueError(f"gpt-fast needs heads x head_dim == hidden; this model has {config.num_attention_heads} x "
                         f"{config.head_dim} != {config.hidden_size}")
    return gf.model.ModelArgs(
        block_size=config.max_position_embeddings, vocab_size=config.vocab_size, n_layer=config.num_hidden_layers,
        n_head=config.num_attention_heads, dim=config.hidden_size, intermediate_size=config.intermediate_size,
        n_local_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_base=config.rope_theta,
        norm_eps=config.rms_norm_eps,
        rope_scaling=None if config.rope_scaling is None else asdict(config.rope_scaling))


def interleave_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads * head_dim, hidden] rows of q or k, reordered within each head from the rotate-half
    layout (dims j and j + head_dim/2 rotate together) to interleaved pairs (2j and 2j + 1)."""
    head_dim = w.shape[0] // heads
    return w.unflatten(0, (heads, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


def gpt_fast_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """gpt-fast's state dict from nanolab's checkpoint `state` (Hugging Face names). A tied head is
    the embedding tensor itself."""
    out = {"tok_embeddings.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"]}
    out["output.weight"] = state["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        hf, gf = f"model.layers.{i}.", f"layers.{i}."
        q = interleave_rope_rows(state[hf + "self_attn.q_proj.weight"], config.num_attention_heads)
        k = interleave_rope_rows(state[hf + "self_attn.k_proj.weight"], config.num_key_value_heads)
        out[gf + "attention.wqkv.weight"] = torch.cat([q, k, state[hf + "self_attn.v_proj.weight"]])
        out[gf + "attention.wo.weight"] = state[hf + "self_attn.o_proj.weight"]
        out[gf + "feed_forward.w1.weight"] = state[hf + "mlp.gate_proj.weight"]
        out[gf + "feed_forward.w3.weight"] = state[hf + "mlp.up_proj.weight"]
        out[gf + "feed_forward.w2.weight"] = state[hf + "mlp.down_proj.weight"]
        out[gf + "attention_norm.weight"] = state[hf + "input_layernorm.weight"]
        out[gf + "ffn_norm.weight"] = state[hf + "post_attention_layernorm.weight"]
    return out


def build_transformer(gf: GptFast, config: ModelConfig, weights: Path | str, dtype: torch.dtype,
                      device: torch.device | str):
    """gpt-fast's `Transformer` at `config`'s shapes holding the weights in folder `weights`, in
    `dtype` on `device`, in eval mode."""
    args = model_args(gf, config)
    state = gpt_fast_state(load_checkpoint(weights, config, dtype=dtype, device=device), config)
    with torch.device("meta"):
        model = gf.model.Transformer(args)
    model.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def reset_caches(model) -> None:
    """Make gpt-fast's next `generate` build its KV caches afresh, sized for that call."""
    model.max_batch_size = -1
    model.max_seq_length = -1


def gpt_fast_generate(gf: GptFast, model, prompts: torch.Tensor, compile: bool = True) -> Callable[[int], object]:
    """`run(new_tokens)`: gpt-fast's `generate()` for len(prompts) rows, with its sampler at
    temperature 0 and no top-k (its greedy). Its batch support repeats one prompt over the batch, so
    every row decodes `prompts[0]`. `compile` is its `--compile`. The caches are rebuilt at the first
    call, sized for it: call the longest first."""
    decode = gf.decode_one_token
    if compile:
        decode = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    prompt = prompts[0].to(next(model.parameters()).device)  # [len] int64
    batch = len(prompts)
    reset_caches(model)

    def run(new: int):
        with gf.settings(decode):
            return gf.generate.generate(model, prompt, new, batch_size=batch, interactive=False, draft_model=None,
                                        temperature=0.0, top_k=None)

    return run
