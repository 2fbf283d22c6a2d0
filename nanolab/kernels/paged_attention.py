"""`paged_attention`: the decode read over the paged pool, streamed in Triton.

Each program walks its row's own history a tile of `block` keys at a time and folds every tile
into an online softmax (running max, denominator, accumulator), so nothing it holds grows with the
context, and a short row walks only its own tiles. Three variants of that loop:
- "head": one program per (row, query head), vLLM's paged-attention grid;
- "gqa": one program per (row, KV head); the query heads sharing that KV head are the rows of one
  tile, so each K/V tile is loaded once per group;
- "split": "gqa" with the walk cut into contiguous shares (split-K, flash-decoding), for grids too
  small to fill the GPU. A share walks at least `share_tiles` tiles, and a share past its row's
  last tile returns at once: the split count is the table capacity's, so at a short context most
  shares are empty. A row with one live share writes its output from it; a longer row's partials
  (max, denominator, accumulator) are folded in the same kernel by the last of its shares to
  finish, one launch a layer where a second merge kernel would add one.
`choose_launch` picks the variant, shares, warps and pipeline depth for a shape; its rule was read
off the sweep in `data/day59_launch_sweep_h200.csv`.

Padding is never dereferenced: a key past its row's length, or whose block is negative, has its
address neutralised before the load and is masked out of the softmax, so a padded batch row reads
nothing and returns zeros. The softmax and both accumulations run in fp32; on a GPU a 16-bit pool's
tiles go to `tl.dot` as they are (tensor cores, fp32 accumulation), elsewhere they are cast to fp32
first (`_dot_mode`). `kernels.reference.reference_read` is the oracle it is tested against.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanolab.kernels import INTERPRETED
from nanolab.kernels.pdl import dependent_launch, ops_pdl
from nanolab.kernels.tickets import tickets

VARIANTS = ("head", "gqa", "split")
# Launch settings when the caller names none, from the sweep (`data/day59_launch_sweep_h200.csv`):
# 128-key tiles and 4 warps at every shape; the pipeline depth is `choose_stages`'.
BLOCK = 128
NUM_WARPS = 4
# The fewest tiles a split share walks when the caller names none: a row of at most this many
# tiles is read by one share, which writes its output with no fold.
SHARE_TILES = 4


@triton.jit
def _slots(table_ptr, rows_ptr, r, stride_tr, w, valid, PAGE: tl.constexpr):
    """Pool slots of keys w of batch row r, and which of them are live: row r's table row is
    rows_ptr[r], and key w lives at table[row, w // PAGE] * PAGE + w % PAGE. A slot is neutralised
    to 0 before it forms an address wherever it is not live: past the row's length, or where the
    block is negative (a padded batch row's table row is all -1)."""
    row = tl.load(rows_ptr + r)
    block = tl.load(table_ptr + row * stride_tr + w // PAGE, mask=valid, other=0)
    valid = valid & (block >= 0)
    slot = block.to(tl.int64) * PAGE + w % PAGE
    return tl.where(valid, slot, 0), valid


@triton.jit
def _tiles_per_share(n_tiles, SPLITS: tl.constexpr, SHARE_TILES: tl.constexpr):
    """Tiles each of SPLITS shares walks of a row's n_tiles, at least SHARE_TILES (and 1): shares
    are contiguous and the last ones may be short or empty."""
    return tl.maximum(tl.cdiv(n_tiles, SPLITS), SHARE_TILES)


@triton.jit
def _row_length(lens_ptr, pos_ptr, r, stride_pr, HAS_POS: tl.constexpr):
    """Keys row r reads: its context length, or fewer if its position says so (w <= position)."""
    ctx = tl.load(lens_ptr + r)
    if HAS_POS:
        ctx = tl.minimum(ctx, tl.load(pos_ptr + r * stride_pr) + 1)
    return ctx


@triton.jit
def _softmax_tile(q, k, seen, m, scale, DOT: tl.constexpr):
    """The online softmax's step over one K tile [N, D]: q's scores against it, -inf where not
    `seen`, and from the running max m [M] the new max, the old terms' rescale and the tile's
    weights p [M, N]."""
    if DOT == 0:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif DOT == 1:
        s = tl.dot(q, tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k))  # fp32 accumulation
    s = tl.where(seen, s * scale, float("-inf"))  # [M, N]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0, not NaN
    return m_new, tl.exp(m - m_use), tl.exp(s - m_use[:, None])


@triton.jit
def _accumulate_tile(p, v, alpha, l, acc, DOT: tl.constexpr):
    """The weights p [M, N] of one V tile [N, D] added to the rescaled denominator and accumulator."""
    if DOT == 0:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        pv = tl.dot(p, v.to(tl.float32))
    else:
        pv = tl.dot(p.to(v.dtype), v)  # p rounded to 16 bits, as flash attention does
    return l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv


@triton.jit
def _attend_tile(q, k_ptr, v_ptr, slot, kv, d, dmask, valid, seen, m, l, acc, scale,
                 stride_ks, stride_kh, stride_vs, stride_vh, DOT: tl.constexpr):
    """Fold one tile of keys into an online softmax: q [M, D] (M query rows sharing KV head kv),
    the tile's pool slots [N] and which are live (`valid`, [N]), which (row, key) pairs may be read
    (`seen`, [M, N]), and the running max m [M], denominator l [M] and accumulator acc [M, D], all
    fp32. Returns the new (m, l, acc). DOT is `_dot_mode`'s: 0 and 1 multiply fp32 tiles (at IEEE
    or default precision), 2 the pool's own 16-bit tiles with fp32 accumulation."""
    tile_mask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=tile_mask, other=0.0)
    m_new, alpha, p = _softmax_tile(q, k, seen, m, scale, DOT)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=tile_mask, other=0.0)
    l, acc = _accumulate_tile(p, v, alpha, l, acc, DOT)
    return m_new, l, acc


@triton.jit
def _attend_kv(q, k, v, seen, m, l, acc, scale, DOT: tl.constexpr):
    """`_attend_tile` over K and V tiles [N, D] its caller loaded."""
    m_new, alpha, p = _softmax_tile(q, k, seen, m, scale, DOT)
    l, acc = _accumulate_tile(p, v, alpha, l, acc, DOT)
    return m_new, l, acc


@triton.jit
def _paged_decode_head(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr, pos_ptr, out_ptr, tiles_ptr,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_pr, stride_or, stride_oh,
    scale, head_dim,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, HAS_POS: tl.constexpr,
    COUNT: tl.constexpr, PDL: tl.constexpr,
):
    """One program: row r, query head h. Live state: a [BLOCK, D] K tile, the same of V, m, l, acc[D]."""
    dependent_launch(PDL)
    r = tl.program_id(0)
    h = tl.program_id(1)
    kv = h // GROUP
    d = tl.arange(0, D)
    dmask = d < head_dim
    q = tl.load(q_ptr + r * stride_qr + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    ctx = _row_length(lens_ptr, pos_ptr, r, stride_pr, HAS_POS)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    walked = 0
    for b in range(tl.cdiv(ctx, BLOCK)):  # the run-time bound: a short row walks only its own tiles
        w = b * BLOCK + tl.arange(0, BLOCK)
        valid = w < ctx
        slot, valid = _slots(table_ptr, rows_ptr, r, stride_tr, w, valid, PAGE)
        tile_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv * stride_kh + d[None, :], mask=tile_mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no live key yet: exp(-inf - 0) = 0, not NaN
        alpha = tl.exp(m - m_use)
        p = tl.exp(s - m_use)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv * stride_vh + d[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
        walked += 1
    out = acc / tl.where(l == 0.0, 1.0, l)  # a row with no live key (padding) reads zeros
    tl.store(out_ptr + r * stride_or + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)
    if COUNT:
        tl.atomic_add(tiles_ptr + r, walked)


@triton.jit
def _paged_decode_group(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, lens_ptr, pos_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, ticket_ptr, tiles_ptr,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_pr, stride_or, stride_oh,
    scale, head_dim,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    PAGE: tl.constexpr, HAS_POS: tl.constexpr, DOT: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr,
    SHARE_TILES: tl.constexpr = 1,
):
    """One program: row r, KV head kv, share s of the walk. The GROUP query heads of kv are the
    first rows of a [G, D] query tile (G a power of two >= 16 for tl.dot), so each K/V tile is
    loaded once for all of them. With SPLITS == 1 the output is written normalised. Otherwise a
    share past the row's last tile returns as soon as it has read the row's length, and writes
    nothing; share 0 always runs, so a row with no key still reads zeros. A row with a single live
    share (every row of at most SHARE_TILES tiles) writes its output normalised from it, as
    SPLITS == 1 does. A row with more writes each live share's partial acc with its m and l, then
    takes a ticket for its (row, KV head); the share that takes the last one folds every live
    share's partials into the output (`_fold_shares`) and puts the ticket back to 0."""
    dependent_launch(PDL)
    r = tl.program_id(0)
    kv = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = _row_length(lens_ptr, pos_ptr, r, stride_pr, HAS_POS)
    n_tiles = tl.cdiv(ctx, BLOCK)
    per_split = _tiles_per_share(n_tiles, SPLITS, SHARE_TILES)
    first = sp * per_split
    last = tl.minimum(first + per_split, n_tiles)
    # Live: a share that starts before the row's last tile, a row without keys counting as one
    # tile (its share 0 writes the zeros it reads).
    live = tl.cdiv(tl.maximum(n_tiles, 1), per_split)
    if SPLITS > 1:
        if sp >= live:
            return
    g = tl.arange(0, G)
    d = tl.arange(0, D)
    gmask = g < GROUP
    dmask = d < head_dim
    heads = kv * GROUP + g
    qmask = gmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if DOT != 2:  # fp32 tiles; DOT == 2 keeps q, K and V in the pool's 16-bit dtype
        q = q.to(tl.float32)
    m = tl.full([G], float("-inf"), tl.float32)
    l = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    walked = 0
    for b in range(first, last):
        w = b * BLOCK + tl.arange(0, BLOCK)
        valid = w < ctx
        slot, valid = _slots(table_ptr, rows_ptr, r, stride_tr, w, valid, PAGE)
        m, l, acc = _attend_tile(q, k_ptr, v_ptr, slot, kv, d, dmask, valid, valid[None, :], m, l, acc, scale,
                                 stride_ks, stride_kh, stride_vs, stride_vh, DOT)
        walked += 1
    if SPLITS == 1 or live == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # partials: acc [rows, heads, SPLITS, D] fp32, m and l [rows, heads, SPLITS]
        first_part = (r * GROUP * tl.num_programs(1) + heads) * SPLITS  # [G]: share 0 of each head
        part = first_part + sp
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(m_ptr + part, m, mask=gmask)
        tl.store(l_ptr + part, l, mask=gmask)
        # Every thread's partial stores are issued before the ticket, whose release (gpu scope)
        # publishes them; the last taker's acquire makes every share's visible to it.
        tl.debug_barrier()
        ticket = ticket_ptr + r * tl.num_programs(1) + kv
        if tl.atomic_add(ticket, 1, sem="acq_rel") == live - 1:
            out = _fold_shares(acc_ptr, m_ptr, l_ptr, first_part, gmask, qmask, d, live, SPLITS, D)
            tl.store(out_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=qmask)
            tl.atomic_xchg(ticket, 0)  # ready for the next launch (a graph replays this one)
    if COUNT:
        tl.atomic_add(tiles_ptr + r, walked)


@triton.jit
def _fold_shares(acc_ptr, m_ptr, l_ptr, first_part, gmask, qmask, d, live, SPLITS: tl.constexpr,
                 D: tl.constexpr):
    """The normalised output [G, D] of the query heads whose share-0 partials sit at first_part [G],
    from their first `live` shares (the rest are not read): each share's acc weighted by
    exp(m - max m), over the shares' weighted l. An empty share has m = -inf and l = acc = 0, so
    its weight is exactly 0; a row with no live key reads zeros. Loads go to L2 (".cg"): the other
    shares' partials were written by other SMs."""
    top = tl.load(m_ptr + first_part, mask=gmask, other=float("-inf"), cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        smask = tl.where(live > s, gmask, False)  # share s of each head, if live
        top = tl.maximum(top, tl.load(m_ptr + first_part + s, mask=smask, other=float("-inf"), cache_modifier=".cg"))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros(top.shape, tl.float32)
    out = tl.zeros(qmask.shape, tl.float32)
    for s in tl.static_range(SPLITS):
        smask = tl.where(live > s, gmask, False)
        weight = tl.exp(tl.load(m_ptr + first_part + s, mask=smask, other=float("-inf"), cache_modifier=".cg") - top)
        total += weight * tl.load(l_ptr + first_part + s, mask=smask, other=0.0, cache_modifier=".cg")
        part = tl.load(acc_ptr + (first_part + s)[:, None] * D + d[None, :], mask=qmask & smask[:, None], other=0.0,
                       cache_modifier=".cg")
        out += weight[:, None] * part
    return out / tl.where(total == 0.0, 1.0, total)[:, None]


def choose_variant(rows: int, heads: int, kv_heads: int, max_ctx: int, num_sms: int = 132,
                   block: int = BLOCK) -> str:
    """The variant for a shape, read off the sweep (`data/day59_launch_sweep_h200.csv`).

    - "split" whenever `choose_splits` shares the walk out: a decode read is bandwidth-bound and a
      program streams its tiles one after another, so a grid of few programs leaves most of the
      card idle through the longest walk.
    - "head" when heads == kv_heads: with no group to share a tile, one query head would fill a
      16-row tl.dot tile alone.
    - "gqa" otherwise: each K/V tile is loaded once per group, where "head" loads it once per
      query head.
    """
    if choose_splits(rows, kv_heads, max_ctx, num_sms, block) > 1:
        return "split"
    if heads == kv_heads:
        return "head"
    return "gqa"


# The grid `choose_splits` aims for, in programs per SM (`data/day59_launch_sweep_h200.csv`).
PROGRAMS_PER_SM = 8


def choose_splits(rows: int, kv_heads: int, max_ctx: int, num_sms: int = 132, block: int = BLOCK) -> int:
    """Shares per row: the power of two that brings the grid nearest, from below, to
    `PROGRAMS_PER_SM` programs per SM, at most 16 and at most one per tile. The sweep's time
    flattens there."""
    target = PROGRAMS_PER_SM * num_sms // (rows * kv_heads)
    if target < 2:
        return 1
    return max(1, min(1 << (target.bit_length() - 1), 16, triton.cdiv(max_ctx, block)))


def choose_stages(programs: int, tiles: int, num_sms: int = 132) -> int:
    """Software-pipeline depth (num_stages) for a grid of `programs`, each walking at most `tiles`
    tiles. Every stage holds one more K and V tile in shared memory: deeper keeps more loads in
    flight behind the current tile's dots, shallower lets more programs share an SM. A short grid
    wants depth (3); a grid of more than two programs per SM whose walks are at most 16 tiles
    wants residency (2). Longer walks on a crowded grid keep 3, the safer side on the sweep: a long
    tail of rows loses more at 2 than uniform long rows, which the same capacity cannot tell apart,
    lose at 3."""
    return 2 if programs > 2 * num_sms and tiles <= 16 else 3


class Launch(NamedTuple):
    variant: str
    splits: int  # shares per row: 1 unless "split"
    num_warps: int
    num_stages: int


def choose_launch(rows: int, heads: int, kv_heads: int, max_ctx: int, num_sms: int = 132, block: int = BLOCK,
                  variant: str = "auto", splits: int | None = None) -> Launch:
    """The whole default launch for a shape: the variant (unless named), its shares (unless given),
    NUM_WARPS and `choose_stages`' depth for the grid and walk that follow."""
    if variant == "auto":
        variant = choose_variant(rows, heads, kv_heads, max_ctx, num_sms, block)
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {VARIANTS} or 'auto'")
    n_splits = 1 if variant != "split" else (splits or choose_splits(rows, kv_heads, max_ctx, num_sms, block))
    programs = rows * (heads if variant == "head" else kv_heads * n_splits)
    tiles = triton.cdiv(triton.cdiv(max_ctx, block), n_splits)
    return Launch(variant, n_splits, NUM_WARPS, choose_stages(programs, tiles, num_sms))


def tile_lanes(variant: str, heads: int, kv_heads: int) -> int:
    """Programs per row whose walks `tile_counts` adds up: every query head for "head", every KV
    head for "gqa" and "split" (the splits of a KV head share one walk between them)."""
    return heads if variant == "head" else kv_heads


@functools.cache
def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; on a CPU (Triton's interpreter), the H200's 132, so the choice is the
    one that card makes."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    context_lens: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
    variant: str = "auto",
    splits: int | None = None,
    num_sms: int | None = None,
    tile_counts: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    share_tiles: int = SHARE_TILES,
    pdl: bool = False,
) -> torch.Tensor:
    """Decode attention of q over each row's history in the paged pool, streamed, addressed
    through the block table. Row r reads slot `block_table[table_rows[r], p // block_size]
    * block_size + p % block_size` for its keys p < context_lens[r] (and p <= positions[r]). A slot
    mapping [rows, width] is the block table of block_size 1. The plan that filled table_rows and
    context_lens checked them on the host; nothing here reads them back.

    q             [rows, 1, heads, head_dim]                decode only: T > 1 is refused
    k_pool/v_pool [slots, kv_heads, head_dim]               one layer's pool

    block_table   [table rows, max_blocks] int32 or int64   the cache's persistent table
    table_rows    [rows] int64                              each batch row's table row
    context_lens  [rows] int64                              at most the table's capacity (the plan's bound)
    positions     [rows, 1] int64 or None                   a row reads keys p <= position (decode: ctx - 1)
    tile_counts   [rows] int32 or None                      if given, every program adds the tiles it walked
                                                            to its row: tile_lanes(variant) * cdiv(len, block)
    returns       [rows, 1, heads, head_dim]                in q's dtype
    `share_tiles`: the fewest tiles a "split" share walks. `pdl` launches the kernel as a
    programmatic dependent (`kernels.pdl`), waiting for the one before it.
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
    if share_tiles < 1:
        raise ValueError(f"share_tiles must be positive, got {share_tiles}")
    return _launch(q, k_pool, v_pool, block_table, table_rows, context_lens, positions, block_size,
                   block_table.shape[1] * block_size, block, variant, splits, num_sms, tile_counts, num_warps,
                   num_stages, share_tiles, pdl)


def _launch(q, k_pool, v_pool, addresses, table_rows, context_lens, positions, page: int, width: int, block: int,
            variant: str, splits: int | None, num_sms: int | None, tile_counts: torch.Tensor | None,
            num_warps: int | None, num_stages: int | None, share_tiles: int, pdl: bool) -> torch.Tensor:
    """Launch the variant `choose_launch` picks over the block table `addresses` of page `page`."""
    rows, t, heads, d = q.shape
    if t != 1:
        raise ValueError(f"the streamed read is decode only (one query per row), got T = {t}")
    kv_heads = k_pool.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    num_sms = num_sms or sm_count(q.device)
    launch = choose_launch(rows, heads, kv_heads, width, num_sms, block, variant, splits)
    if tile_counts is not None and (tile_counts.shape != (rows,) or tile_counts.dtype != torch.int32):
        raise ValueError("tile_counts must be a [rows] int32 tensor")
    if positions is not None and positions.shape != (rows, 1):
        raise ValueError(f"positions must be [rows, 1], got {tuple(positions.shape)}")
    if q.dtype != k_pool.dtype or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"q, K and V must share a dtype, got {q.dtype}, {k_pool.dtype} and {v_pool.dtype}")
    if any(t is not None and t.stride(0) != 1 for t in (context_lens, table_rows, tile_counts)):
        raise ValueError("context_lens, table_rows and tile_counts must be contiguous: the kernel indexes them by row")
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and q.stride(3) == 1
    count = tile_counts is not None
    has_pos = positions is not None
    tiles = tile_counts if count else context_lens  # placeholder pointers when unused
    pos = positions if has_pos else context_lens
    group = heads // kv_heads
    q3 = q[:, 0]  # [rows, heads, d]
    out = torch.empty((rows, heads, d), dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(d)
    D = _pow2(d, 16)
    strides = (q3.stride(0), q3.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
               addresses.stride(0), pos.stride(0), out.stride(0), out.stride(1))
    tuning = dict(num_warps=num_warps or launch.num_warps, num_stages=num_stages or launch.num_stages, PDL=pdl)
    if pdl:
        tuning["launch_pdl"] = True
    if launch.variant == "head":
        _paged_decode_head[(rows, heads)](
            q3, k_pool, v_pool, addresses, table_rows, context_lens, pos, out, tiles, *strides, scale, d,
            GROUP=group, BLOCK=block, D=D, PAGE=page, HAS_POS=has_pos, COUNT=count, **tuning)
        return out[:, None]
    n_splits = launch.splits
    meta = dict(GROUP=group, G=_pow2(group, 16), BLOCK=block, D=D, PAGE=page, HAS_POS=has_pos,
                DOT=_dot_mode(k_pool.dtype), COUNT=count, **tuning)
    if n_splits == 1:  # out stands in for the partials and tickets it never touches
        _paged_decode_group[(rows, kv_heads, 1)](
            q3, k_pool, v_pool, addresses, table_rows, context_lens, pos, out, out, out, out, out, tiles, *strides,
            scale, d, SPLITS=1, **meta)
        return out[:, None]
    acc, m, l = _partials(rows, heads, n_splits, D, q.device)
    _paged_decode_group[(rows, kv_heads, n_splits)](
        q3, k_pool, v_pool, addresses, table_rows, context_lens, pos, out, acc, m, l,
        tickets(q.device, rows * kv_heads), tiles, *strides, scale, d, SPLITS=n_splits, SHARE_TILES=share_tiles, **meta)
    return out[:, None]


def _partials(rows: int, heads: int, splits: int, d: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split read's partials, uninitialised: acc [rows, heads, splits, d], m and l [rows, heads,
    splits], all fp32."""
    m = torch.empty((rows, heads, splits), dtype=torch.float32, device=device)
    return torch.empty((rows, heads, splits, d), dtype=torch.float32, device=device), m, torch.empty_like(m)


def _dot_mode(dtype: torch.dtype) -> int:
    """How the group kernel's tl.dot multiplies: 0 fp32 tiles at IEEE precision (an fp32 pool),
    1 fp32 tiles at the default precision (16-bit pools in Triton's interpreter, whose bf16 dots
    are wrong), 2 the pool's own 16-bit tiles on the tensor cores with
    fp32 accumulation (a GPU)."""
    if dtype == torch.float32:
        return 0
    return 1 if INTERPRETED else 2


@torch.library.custom_op("nanolab::paged_attention", mutates_args=())
def paged_attention_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                       table_rows: torch.Tensor, context_lens: torch.Tensor, positions: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """`paged_attention` with the default launch, as one opaque operator: what a compiled forward
    calls, so dynamo records the read as a single node instead of tracing its launch logic, and
    inductor fuses the work around it. The launch is still chosen from the shapes alone, and is a
    programmatic dependent where `kernels.pdl.ops_pdl` says so."""
    return paged_attention(q, k_pool, v_pool, block_table, table_rows, block_size, context_lens, positions,
                           pdl=ops_pdl(q.device))


@paged_attention_op.register_fake
def _(q, k_pool, v_pool, block_table, table_rows, context_lens, positions, block_size):
    return torch.empty_like(q)
