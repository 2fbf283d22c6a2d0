"""`reference_read`: the decode read that gathers the whole rectangle (and, one segment at a time,
a varlen step's: `varlen_attention.varlen_reference`), and the oracle the Triton read is tested
against.

It materialises K and V for every cell of `slot_mapping` [rows, width] and a [rows, heads, T,
width] score rectangle before it masks (the seed's `paged_attention_batched_reference`). Padding
cells are really loaded and only masked afterwards, so they must name a slot holding finite
values: -1 wraps onto the pool's last slot, the sink.
"""

from __future__ import annotations

import math

import torch


def attention_mask_bias(context_lens: torch.Tensor, positions: torch.Tensor, width: int, dtype) -> torch.Tensor:
    """Additive mask [rows, T, width]: 0 where key w may be read by the query at positions[r, t]
    (w < context_lens[r] and w <= positions[r, t]), -inf elsewhere. One mask serves every layer
    of a step."""
    w = torch.arange(width, device=positions.device)
    allowed = (w < context_lens[:, None, None]) & (w <= positions[:, :, None])
    # Python scalars, not device tensors: building a tensor from a Python float is a host-to-device
    # copy, once per layer on the planned path.
    return torch.where(allowed, 0.0, float("-inf")).to(dtype)


def check_read_inputs(slot_mapping: torch.Tensor, context_lens: torch.Tensor, q: torch.Tensor,
                      context_bounds: tuple[int, int] | None, validated: bool) -> None:
    """The read's refusals: the shapes must agree, and unless `validated`, every row must hold
    a token and the mapping be exactly as wide as the longest row.

    `validated=True` means the caller (a host-built plan) has already checked the bounds, so
    nothing here reads a value that changes from step to step. Otherwise the bounds come from
    `context_bounds` (host ints) or, failing that, from `context_lens` itself: a device sync,
    and a value a tracer must guard on.
    """
    rows = q.shape[0]
    if slot_mapping.dim() != 2 or slot_mapping.shape[0] != rows or context_lens.shape != (rows,):
        raise ValueError(
            f"slot_mapping {tuple(slot_mapping.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must describe the {rows} rows of q"
        )
    if validated:
        if context_bounds is not None:
            raise ValueError("pass context_bounds or validated=True, not both: a validated read checks nothing")
        return
    if context_bounds is None:
        context_bounds = (int(context_lens.min()), int(context_lens.max()))
    min_ctx, max_ctx = context_bounds
    if min_ctx < 1:
        raise ValueError("a row has no context: its query would attend over nothing but padding")
    if slot_mapping.shape[1] != max_ctx:
        raise ValueError(f"slot_mapping is {slot_mapping.shape[1]} wide but the longest row holds {max_ctx} tokens")


def reference_read(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    context_bounds: tuple[int, int] | None = None,
    validated: bool = False,
    mask_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over each row's history in the pool.

    q             [rows, T, heads, head_dim]   this forward's queries (T = 1 in decode)
    k_pool/v_pool [slots, kv_heads, head_dim]  one layer's pool
    slot_mapping  [rows, max_ctx] int64        pool slot of each row's token p, padding legal
    context_lens  [rows] int64                 tokens each row holds, this forward's included
    positions     [rows, T] int64              absolute position of each query
    mask_bias     [rows, T, max_ctx]           optional precomputed `attention_mask_bias`
    returns       [rows, T, heads, head_dim]
    """
    check_read_inputs(slot_mapping, context_lens, q, context_bounds, validated)
    rows, t, heads, d = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    width = slot_mapping.shape[1]
    k = k_pool[slot_mapping].permute(0, 2, 3, 1)  # [rows, kv_heads, d, max_ctx]
    v = v_pool[slot_mapping].transpose(1, 2)  # [rows, kv_heads, max_ctx, d]
    # Query heads sharing a KV head are stacked so K and V are never repeated:
    # [rows, kv_heads, T * group, d], head h = kv_head * group + g.
    qg = q.view(rows, t, kv_heads, group, d).permute(0, 2, 1, 3, 4).reshape(rows, kv_heads, t * group, d)
    scores = torch.matmul(qg, k).mul_(1.0 / math.sqrt(d))  # the rectangle: [rows, kv_heads, T * group, max_ctx]
    if mask_bias is None:
        mask_bias = attention_mask_bias(context_lens, positions, width, scores.dtype)
    scores = scores.view(rows, kv_heads, t, group, width).add_(mask_bias[:, None, :, None, :])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(rows, kv_heads, t * group, width), v)  # [rows, kv_heads, T * group, d]
    return out.view(rows, kv_heads, t, group, d).permute(0, 2, 1, 3, 4).reshape(rows, t, heads, d)
