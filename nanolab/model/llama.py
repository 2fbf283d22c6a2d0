"""`LlamaModel`: a Llama-family decoder over the paged cache, loaded from the Hugging Face layout.
Checkpoints keep q/k/v and gate/up as separate
matrices; `load_model` concatenates them into one matmul each, which is the only way this
module's parameters differ from `LlamaForCausalLM`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from nanolab.model.attention import Attention
from nanolab.model.config import ModelConfig
from nanolab.model.layers import MLP, Linear, RMSNorm, rope_cos_sin, rope_inv_freq
from nanolab.model.parallel import TensorParallel, check_shardable, shard_state
from nanolab.model.weights import load_checkpoint


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x, cos, sin, positions, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        """`tp` makes this rank's shard of the model (`model.parallel`): its heads, its intermediate
        share and its vocabulary rows, with the collectives that join them; `config` stays the
        whole model's."""
        super().__init__()
        self.config = config
        self.tp = tp
        k0, k1 = tp.kv_heads(config) if tp else (0, config.num_key_value_heads)
        self.num_kv_heads = k1 - k0  # the KV heads this rank's cache holds
        self.vocab_start, vocab_stop = tp.vocab(config) if tp else (0, config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab_stop - self.vocab_start, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, vocab_stop - self.vocab_start)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [rows, T] int64 (a decode step's [batch, 1], a varlen step's
        [1, num_tokens]); cache a `CacheView` of this forward's plan.

        logits_index [n] picks n tokens of the flattened [rows * T] token axis (the last token of
        each sampled segment of a varlen step) and returns logits [n, vocab]; None returns every
        position, [rows, T, vocab]. Logits are fp32 whatever the model's dtype.
        """
        x = self.embed(input_ids)  # [rows, T, hidden]
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, cache)
        if logits_index is not None:
            x = x.flatten(0, 1)[logits_index]  # [n, hidden]: only the sampled tokens reach the head
        logits = self.lm_head(self.norm(x)).float()
        return self.tp.gather_vocab(logits, self.config.vocab_size) if self.tp else logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; a shard looks up its own vocabulary rows, zeros elsewhere, and sums."""
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine[..., None]
        return self.tp.all_reduce(x)


def _fuse(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF tensors to this module's and concatenate q/k/v and gate/up."""
    out = {
        "embed_tokens.weight": state["model.embed_tokens.weight"],
        "norm.weight": state["model.norm.weight"],
    }
    # A tied head is the embedding itself; `load_model` re-ties it after assignment.
    tied = config.tie_word_embeddings
    out["lm_head.weight"] = out["embed_tokens.weight"] if tied else state["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat(
            [state.pop(attn + f"{n}_proj.weight") for n in "qkv"], dim=0)
        out[dst + "self_attn.o_proj.weight"] = state[attn + "o_proj.weight"]
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [state.pop(mlp + "gate_proj.weight"), state.pop(mlp + "up_proj.weight")], dim=0)
        out[dst + "mlp.down_proj.weight"] = state[mlp + "down_proj.weight"]
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "post_attention_layernorm.weight"]
    return out


def load_model(path: Path, *, dtype: torch.dtype = torch.float32, device="cpu", prepack: bool | None = None,
               tp: TensorParallel | None = None, quantization: str | None = None) -> LlamaModel:
    """Build the model on the meta device and fill it straight from the checkpoint, so a
    model is never initialised twice. `tp`: this rank's shard only (`parallel.shard_state`).
    `quantization="fp8"`: every decoder layer's projections are held as e4m3 with a scale per
    output channel (`Linear.quantize_fp8_`); the embedding and the LM head stay in `dtype`.

    `prepack` (default: on for fp32 on the CPU, where oneDNN is available) routes every matmul
    through oneDNN with prepacked weights; see `layers.Linear`."""
    config = ModelConfig.from_dir(path)
    state = _fuse(load_checkpoint(path, config, dtype=dtype, device=device), config)
    if tp is not None:
        check_shardable(config, tp.world_size)
        state = shard_state(state, config, tp)
    with torch.device("meta"):
        model = LlamaModel(config, tp)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config).to(device)
    model.eval().requires_grad_(False)
    if quantization == "fp8":
        for layer in model.layers:
            for module in layer.modules():
                if isinstance(module, Linear):
                    module.quantize_fp8_()
    elif quantization is not None:
        raise ValueError(f"quantization={quantization!r}: must be None or 'fp8'")
    if prepack is None:
        prepack = torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if prepack:
        for module in model.modules():
            if isinstance(module, Linear) and module.qweight is None:
                module.prepack()
    return model
