"""The streamed decode read over the paged pool: Triton kernels that never build the rectangle.

Introduced on Day 59. `paged_attention_batched_reference` gathers the whole [rows, max_ctx]
mapping and scores a [rows, heads, 1, max_ctx] rectangle before it masks. These kernels walk each
row's own history a tile of `block` keys at a time and fold every tile into an online softmax
(running max, denominator, accumulator), so nothing they hold has max_ctx in it
(`nanolab.captured.streamed_workspace_bytes`), and a short row walks only its own tiles
(`nanolab.captured.streamed_work`).

Three variants of one idea:
- "head": the seed's design and vLLM's paged-attention grid, one program per (row, query head).
- "gqa": one program per (row, KV head); the query heads sharing that KV head are the rows of the
  tile, so each K/V tile is loaded once per group instead of once per query head.
- "split": "gqa" with the walk cut into `splits` contiguous shares (split-K, vLLM's v2 /
  flash-decoding), each writing a partial (max, denominator, accumulator) that torch merges. For
  batches whose (row, KV head) programs cannot fill the GPU.

A padding cell of `slot_mapping` is never dereferenced: the slot is masked on load and then
neutralised (`tl.where(valid, slot, 0)`) before it forms an address, and the K/V loads are masked
with `other=0`. So padding may be -1 and the slot it names may hold NaN, which the reference
cannot survive. Tiles are cast to fp32 before `tl.dot` and the softmax runs in fp32 (the Triton
interpreter computes bf16 dots wrongly and refuses tl.exp on bf16; see ENVIRONMENT.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanolab.paged_attention import check_read_inputs, paged_attention_batched_reference

VARIANTS = ("head", "gqa", "split")


@triton.jit
def _slots(map_ptr, rows_ptr, r, stride_mr, w, valid, PAGE: tl.constexpr):
    """Pool slots of keys w of batch row r, neutralised to 0 where not `valid` before they form an
    address (padding may be -1). PAGE == 0: map_ptr is the [rows, width] slot mapping. PAGE > 0:
    map_ptr is the [table_rows, max_blocks] block table, row r's table row is rows_ptr[r], and the
    slot is table[row, w // PAGE] * PAGE + w % PAGE, so the read has no width axis (Day 60)."""
    if PAGE == 0:
        slot = tl.load(map_ptr + r * stride_mr + w, mask=valid, other=0)
    else:
        row = tl.load(rows_ptr + r)
        block = tl.load(map_ptr + row * stride_mr + w // PAGE, mask=valid, other=0)
        slot = block.to(tl.int64) * PAGE + w % PAGE
    return tl.where(valid, slot, 0)


@triton.jit
def _paged_decode_head(
    q_ptr, k_ptr, v_ptr, map_ptr, rows_ptr, lens_ptr, out_ptr, tiles_ptr,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mr, stride_or, stride_oh,
    scale, head_dim,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, COUNT: tl.constexpr,
):
    """One program: row r, query head h. Live state: a [BLOCK, D] K tile, the same of V, m, l, acc[D]."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    kv = h // GROUP
    d = tl.arange(0, D)
    dmask = d < head_dim
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    ctx = tl.load(lens_ptr + r)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    walked = 0
    for b in range(tl.cdiv(ctx, BLOCK)):  # the run-time bound: a short row walks only its own tiles
        w = b * BLOCK + tl.arange(0, BLOCK)
        valid = w < ctx
        slot = _slots(map_ptr, rows_ptr, r, stride_mr, w, valid, PAGE)
        tile_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=tile_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
        walked += 1
    out = acc / l
    tl.store(out_ptr + r * stride_or + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
    if COUNT:
        tl.atomic_add(tiles_ptr + r, walked)


@triton.jit
def _paged_decode_group(
    q_ptr, k_ptr, v_ptr, map_ptr, rows_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, tiles_ptr,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mr, stride_or, stride_oh,
    scale, head_dim,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    PAGE: tl.constexpr, IEEE: tl.constexpr, COUNT: tl.constexpr,
):
    """One program: row r, KV head kv, share s of the walk. The GROUP query heads of kv are the
    first rows of a [G, D] query tile (G a power of two >= 16 for tl.dot), so each K/V tile is
    loaded once for all of them. With SPLITS == 1 the output is written normalised; otherwise the
    program writes its partial acc with its m and l, and `_merge_splits` folds the shares."""
    r = tl.program_id(0)
    kv = tl.program_id(1)
    sp = tl.program_id(2)
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    gmask = g < GROUP
    dmask = d < head_dim
    heads = kv * GROUP + g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    q = q.to(tl.float32)
    ctx = tl.load(lens_ptr + r)
    n_tiles = tl.cdiv(ctx, BLOCK)
    per_split = tl.cdiv(n_tiles, SPLITS)
    first = sp * per_split
    last = tl.minimum(first + per_split, n_tiles)
    m = tl.full([G], float("-inf"), tl.float32)
    l = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    walked = 0
    for b in range(first, last):
        w = b * BLOCK + tl.arange(0, BLOCK)
        valid = w < ctx
        slot = _slots(map_ptr, rows_ptr, r, stride_mr, w, valid, PAGE)
        tile_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=tile_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)))
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [G, BLOCK]
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=tile_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v.to(tl.float32))
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
        walked += 1
    if SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # partials: out [rows, heads, SPLITS, D] fp32, m and l [rows, heads, SPLITS]
        part = (r * GROUP * tl.num_programs(1) + heads) * SPLITS + sp
        tl.store(out_ptr + part[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(m_ptr + part, m, mask=gmask)
        tl.store(l_ptr + part, l, mask=gmask)
    if COUNT:
        tl.atomic_add(tiles_ptr + r, walked)


def _merge_splits(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Fold split partials: acc [rows, heads, S, D], m and l [rows, heads, S] -> [rows, heads, D].
    An empty share has m = -inf and l = acc = 0, so its weight exp(m - max) is exactly 0."""
    top = m.amax(dim=-1, keepdim=True)
    weight = torch.exp(m - top)
    return (acc * weight[..., None]).sum(dim=-2) / (l * weight).sum(dim=-1)[..., None]


def choose_variant(rows: int, heads: int, kv_heads: int, max_ctx: int, num_sms: int = 132,
                   block: int = 64) -> str:
    """The variant for a shape.

    - "split" when the (row, KV head) programs cannot fill the SMs and each row has enough tiles
      to share out: a decode step is bandwidth-bound, and a program streams its history serially,
      so with rows * kv_heads < num_sms most of the card would idle through one long walk.
    - "head" when heads == kv_heads: with no group to share a tile, packing one query head into a
      16-row tl.dot tile wastes 15/16 of the dot, and the (row, head) grid is already wide.
    - "gqa" otherwise: each K/V tile is read once per group instead of once per query head, which
      divides the bytes moved (the whole cost of decode) by heads / kv_heads.
    """
    if rows * kv_heads < num_sms and triton.cdiv(max_ctx, block) >= 8:
        return "split"
    if heads == kv_heads:
        return "head"
    return "gqa"


def choose_splits(rows: int, kv_heads: int, max_ctx: int, num_sms: int = 132, block: int = 64) -> int:
    """Shares per row for "split": enough programs to cover the SMs, at least 4 tiles a share."""
    return max(1, min(triton.cdiv(num_sms, rows * kv_heads), triton.cdiv(max_ctx, block) // 4))


def tile_lanes(variant: str, heads: int, kv_heads: int) -> int:
    """Programs per row whose walks `tile_counts` adds up: every query head for "head", every KV
    head for "gqa" and "split" (the splits of a KV head share one walk between them)."""
    return heads if variant == "head" else kv_heads


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_attention_batched_kernel(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    context_bounds: tuple[int, int] | None = None,
    validated: bool = False,
    block: int = 64,
    variant: str = "auto",
    splits: int | None = None,
    num_sms: int = 132,
    tile_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The decode read of `paged_attention_batched_reference`, streamed. Same arguments and refusals.

    q             [rows, 1, heads, head_dim]   decode only: T > 1 is refused
    k_pool/v_pool [slots, kv_heads, head_dim]  one layer's pool
    slot_mapping  [rows, max_ctx] int64        padding may be any value, -1 included: it is never read
    context_lens  [rows] int64                 tokens each row holds, this step's included
    positions     [rows, 1] int64 or None      a row reads keys w <= position (decode: ctx - 1)
    tile_counts   [rows] int32 or None         if given, every program adds the tiles it walked to
                                               its row: tile_lanes(variant) * cdiv(len, block)
    returns       [rows, 1, heads, head_dim]   in q's dtype
    """
    check_read_inputs(slot_mapping, context_lens, q, context_bounds, validated)
    if slot_mapping.stride(1) != 1:
        raise ValueError("slot_mapping must be contiguous along its width")
    return _launch(q, k_pool, v_pool, slot_mapping, context_lens, context_lens, positions, 0,
                   slot_mapping.shape[1], block, variant, splits, num_sms, tile_counts)


def paged_attention_table_kernel(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    context_lens: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    block: int = 64,
    variant: str = "auto",
    splits: int | None = None,
    num_sms: int = 132,
    tile_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The streamed read addressed through the block table itself (Day 60): no slot mapping, so
    no width. Row r reads slot `block_table[table_rows[r], p // block_size] * block_size + p %
    block_size` for its keys p < context_lens[r]. Always a validated read: the plan that filled
    table_rows and context_lens checked them on the host.

    block_table   [table rows, max_blocks] int32 or int64   the cache's persistent table
    table_rows    [rows] int64                              each batch row's table row
    The variant is chosen for the table's capacity, which is fixed, so a captured graph's choice
    holds for every context length; a split share is cut from each row's own tiles at run time.
    """
    rows = q.shape[0]
    if table_rows.shape != (rows,) or context_lens.shape != (rows,):
        raise ValueError(f"table_rows {tuple(table_rows.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must describe the {rows} rows of q")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be a [table rows, max_blocks] tensor, contiguous along a row")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return _launch(q, k_pool, v_pool, block_table, table_rows, context_lens, positions, block_size,
                   block_table.shape[1] * block_size, block, variant, splits, num_sms, tile_counts)


def _launch(q, k_pool, v_pool, addresses, table_rows, context_lens, positions, page: int, width: int, block: int,
            variant: str, splits: int | None, num_sms: int, tile_counts: torch.Tensor | None) -> torch.Tensor:
    """Launch a variant. addresses is the slot mapping (page 0) or the block table (page > 0)."""
    rows, t, heads, d = q.shape
    if t != 1:
        raise ValueError(f"the streamed read is decode only (one query per row), got T = {t}")
    kv_heads = k_pool.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if variant == "auto":
        variant = choose_variant(rows, heads, kv_heads, width, num_sms, block)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS} or 'auto'")
    lens = context_lens if positions is None else torch.minimum(context_lens, positions[:, 0] + 1)
    if tile_counts is not None and (tile_counts.shape != (rows,) or tile_counts.dtype != torch.int32):
        raise ValueError("tile_counts must be a [rows] int32 tensor")
    count = tile_counts is not None
    tiles = tile_counts if count else lens  # a placeholder pointer when not counting
    group = heads // kv_heads
    q3 = q[:, 0]  # [rows, heads, d]
    out = torch.empty((rows, heads, d), dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(d)
    D = _pow2(d, 16)
    strides = (q3.stride(0), q3.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
               addresses.stride(0), out.stride(0), out.stride(1))
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and q3.stride(2) == 1
    if variant == "head":
        _paged_decode_head[(rows, heads)](
            q3, k_pool, v_pool, addresses, table_rows, lens, out, tiles, *strides, scale, d,
            GROUP=group, BLOCK=block, D=D, PAGE=page, COUNT=count)
        return out[:, None]
    n_splits = 1 if variant == "gqa" else (splits or choose_splits(rows, kv_heads, width, num_sms, block))
    ieee = k_pool.dtype == torch.float32
    if n_splits == 1:
        _paged_decode_group[(rows, kv_heads, 1)](
            q3, k_pool, v_pool, addresses, table_rows, lens, out, lens, lens, tiles, *strides, scale, d,
            GROUP=group, G=_pow2(group, 16), BLOCK=block, D=D, SPLITS=1, PAGE=page, IEEE=ieee, COUNT=count)
        return out[:, None]
    acc = torch.empty((rows, heads, n_splits, D), dtype=torch.float32, device=q.device)
    m = torch.empty((rows, heads, n_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _paged_decode_group[(rows, kv_heads, n_splits)](
        q3, k_pool, v_pool, addresses, table_rows, lens, acc, m, l, tiles, *strides, scale, d,
        GROUP=group, G=_pow2(group, 16), BLOCK=block, D=D, SPLITS=n_splits, PAGE=page, IEEE=ieee, COUNT=count)
    return _merge_splits(acc[..., :d], m, l).to(q.dtype)[:, None]


@dataclass(frozen=True)
class Agreement:
    """The streamed read against the reference on one batch: the worst |kernel - oracle| per row."""

    label: str
    variant: str
    per_row: tuple[float, ...]

    @property
    def worst(self) -> float:
        return max(self.per_row)

    @property
    def line(self) -> str:
        return f"{self.label:<10} {len(self.per_row)} rows: worst |kernel - oracle| {self.worst:.2e}"


def kernel_agreement(label: str, q, k_pool, v_pool, slot_mapping, context_lens, positions, *,
                     variant: str = "auto", block: int = 64, splits: int | None = None) -> Agreement:
    """Run the kernel and the reference on one batch and measure them row by row (as the seed prints)."""
    oracle = paged_attention_batched_reference(q, k_pool, v_pool, slot_mapping, context_lens, positions)
    kernel = paged_attention_batched_kernel(q, k_pool, v_pool, slot_mapping, context_lens, positions,
                                            block=block, variant=variant, splits=splits)
    diff = (kernel.float() - oracle.float()).abs().flatten(1).amax(dim=1)
    return Agreement(label, variant, tuple(float(x) for x in diff))
