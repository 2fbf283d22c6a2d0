"""A decode step whose norms, residual adds and SwiGLU run inside its projections' GEMVs: Day 61's
lever that did not pay, a backend the lab hands to the engine (`leverarms.ARMS`' "+ norms,
residual adds and SwiGLU inside the GEMVs").

`step_projection` is one layer projection with its neighbours folded into the engine's GEMV
(`kernels.gemv.gemv`'s `norm`, `residual` and `swiglu`); `FoldedStep` is the model's forward
with each layer as four of them around the attention, for the decode steps of 2 rows or more;
`folded_decode` compiles it as the engine compiles the model (`runner.compile_decode`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanolab.engine.runner import DecodeForward, compile_decode
from nanolab.kernels.gemv import MAX_ROWS, gemv, step_config
from nanolab.kernels.pdl import ops_pdl
from nanolab.model.layers import rope_cos_sin


@torch.library.custom_op("nanolab::step_projection", mutates_args=())
def step_projection(x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-5,
                    residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """`residual + F.linear(a, weight)`, where a is x RMS-normed by `norm` and `eps` when given, or
    silu(gate) * up of x = [gate, up] [..., 2K] when `swiglu`, else x. Up to MAX_ROWS rows, one
    `gemv` with `step_config`'s tiles (one share of K with a norm), launched as a programmatic
    dependent where `kernels.pdl.ops_pdl` says so; past that, or where the tiles do not divide K,
    the same in torch's ops. One operator inductor does not look into."""
    k = weight.shape[1]
    if x.shape[-1] != (2 * k if swiglu else k) or (residual is not None and residual.shape != (*x.shape[:-1],
                                                                                                weight.shape[0])):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} do not make a projection"
                         + (" of [gate, up]" if swiglu else ""))
    m = x.numel() // x.shape[-1]
    cfg = step_config(weight.shape[0], k, m, swiglu, x.element_size(), norm=norm is not None)
    if m <= MAX_ROWS and not k % (cfg.split_k * cfg.block_k) and x.is_contiguous() and weight.is_contiguous() \
            and (residual is None or residual.is_contiguous()):
        return gemv(x, weight, cfg, pdl=ops_pdl(x.device), norm=norm, eps=eps, residual=residual, swiglu=swiglu)
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    if norm is not None:
        x = F.rms_norm(x, (k,), norm, eps)
    out = F.linear(x, weight)
    return out if residual is None else residual + out


@step_projection.register_fake
def _(x, weight, norm=None, eps=1e-5, residual=None, swiglu=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def folded_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache
                 ) -> torch.Tensor:
    """`llama.DecoderLayer.forward` as four `step_projection`s around the attention: each norm inside
    the projection after it, each residual add inside the projection before it and SwiGLU inside
    down, so the residual stream x [rows, 1, hidden] never passes through a kernel of its own."""
    attn, mlp, pre, post = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
    qkv = step_projection(x, attn.qkv_proj.weight, pre.weight, pre.eps)
    x = step_projection(attn.attend(qkv, cos, sin, positions, cache), attn.o_proj.weight, residual=x)
    gate_up = step_projection(x, mlp.gate_up_proj.weight, post.weight, post.eps)
    return step_projection(gate_up, mlp.down_proj.weight, residual=x, swiglu=True)


class FoldedStep(nn.Module):
    """The model's forward, with a decode step of 2 rows or more (input_ids [rows, 1]) run layer by
    layer through `folded_layer`; batch 1 and varlen steps are the model's own forward. The model's
    modules are shared, not copied."""

    def __init__(self, model) -> None:
        super().__init__()
        if model.tp is not None:
            raise ValueError("FoldedStep: one process only; a tensor-parallel shard's projections all-reduce")
        self.model = model
        self.lm_head = model.lm_head  # what `DecodeForward` marks opaque

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        if input_ids.shape[0] == 1 or input_ids.shape[1] != 1:  # no guard on a symbolic batch (at least 2)
            return m(input_ids, positions, cache, logits_index)
        x = m.embed(input_ids)  # [rows, 1, hidden]
        cos, sin = rope_cos_sin(positions, m.inv_freq, x.dtype)
        for layer in m.layers:
            x = folded_layer(layer, x, cos, sin, positions, cache)
        if logits_index is not None:
            x = x.flatten(0, 1)[logits_index]
        return m.lm_head(m.norm(x)).float()


def folded_decode(model, **compile_kwargs) -> DecodeForward:
    """`FoldedStep(model)` compiled as `runner.compile_decode(model, **compile_kwargs)` compiles the
    model: the same graphs, options, PDL and tuning."""
    plain = compile_decode(model, **compile_kwargs)
    return DecodeForward(FoldedStep(model), plain.batch_1_options, pdl=plain.pdl, opaque_head=model.lm_head.opaque,
                         options=plain.options or None, steady=plain.steady)
