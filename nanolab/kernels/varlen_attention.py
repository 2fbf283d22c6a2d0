"""`varlen_attention`: causal attention of a flattened batch of query segments over the paged pool,
streamed in Triton, and `varlen_reference`, its torch oracle. Chunked prefill. `prompt_attention`:
the same for segments that are whole prompts, through torch's fused attention.

A step that is not decode-only runs one forward over all its tokens, laid end to end: queries
[num_tokens, heads, head_dim], and segment s (one sequence's new tokens: a prompt, a chunk of one,
or a decode row's single token) is tokens query_start_loc[s] .. query_start_loc[s + 1] - 1
(FlashAttention's varlen layout; vLLM's `query_start_loc`, flash-attn's cu_seqlens_q). The segment's
K/V is already in the pool when the read runs, beside every earlier chunk's, so the read needs
nothing but the pool: a query at position p reads keys 0..p of its segment's row, through the
persistent block table (`_slots`).

One program per (segment, query tile, KV head). The tile is BLOCK_Q consecutive tokens times the
G query heads sharing that KV head, [BLOCK_Q * G, D], so each K/V tile is loaded once for the group
(as `_paged_decode_group` does) and the scores are one tl.dot (vLLM's unified Triton attention
tiles the same way). The walk stops at the tile's last position, so a chunk never loads keys it
cannot see, and a segment shorter than its tile (a decode row) leaves the rest of the tile masked.
Tiles past a segment's end walk nothing and store nothing.

A step of few query tiles over a long context (a short chunk after a long cached prefix) makes a
grid too small to fill the GPU, each program walking many key tiles in turn. `splits` > 1 cuts each
program's walk into that many contiguous shares, each its own program (split-K, flash-decoding, as
`paged_attention`'s "split" variant does for decode): a share writes its un-normalised partials
(max, denominator, accumulator), and a second kernel, `_varlen_fold`, folds each token's shares
into the output. A share's range is cut inside the kernel from the keys its own tile sees, so a
captured step's flat grid holds for any lengths. `choose_varlen_splits` picks the count for a shape.

A segment that is a whole prompt, with nothing cached before it, reads only its own keys, and that
is plain causal attention: `prompt_attention` hands each segment's own q, k and v (the forward's,
not the pool's) to `scaled_dot_product_attention`, which on a GPU runs a flash kernel, faster than
`_varlen_group` over a long prompt.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from nanolab.kernels.paged_attention import (
    SHARE_TILES,
    _attend_kv,
    _attend_tile,
    _dot_mode,
    _fold_shares,
    _partials,
    _pow2,
    _slots,
    _tiles_per_share,
)
from nanolab.kernels.reference import reference_read

BLOCK_M = 64  # query-tile rows: BLOCK_Q tokens x G heads
BLOCK_N = 64  # keys per tile
# Software-pipelining stages of an unsplit walk (a split one keeps Triton's default): two beat the
# default three on every unsplit case of the varlen sweeps (`data/day64_varlen_sweep_*`).
UNSPLIT_STAGES = 2
# `narrow` offsets are int32: every element of a pool must be reachable by one.
NARROW_LIMIT = 2**31
# Programs of the read an SM holds at once: 4 warps of 232 to 255 registers a thread take half an
# SM's 64K registers each (`python -m nanolab kernelres`).
RESIDENT = 2


@triton.jit
def _tile_map(starts_ptr, segments, BLOCK_Q: tl.constexpr, SEG: tl.constexpr):
    """A flat grid's query tiles, numbered across segments with no gaps, from one vector load of
    the segments' starts: [SEG] lanes, each segment's first tile's number (a prefix sum of their
    tile counts), and each segment's tiles (0 past `segments`)."""
    seg = tl.arange(0, SEG)
    real = seg < segments
    first_tok = tl.load(starts_ptr + seg, mask=real, other=0)
    tiles = tl.where(real, tl.cdiv(tl.load(starts_ptr + seg + 1, mask=real, other=0) - first_tok, BLOCK_Q), 0)
    return seg, tl.cumsum(tiles, 0) - tiles, tiles


@triton.jit
def _locate(seg, first, j):
    """Tile j of `_tile_map`'s numbering: (its segment, its tile there). It belongs to the last
    segment whose first number is at most j (an empty segment's first number is the next one's,
    so the last is never empty)."""
    s = tl.max(tl.where(first <= j, seg, -1), 0)
    return s, j - tl.sum(tl.where(seg == s, first, 0), 0)


@triton.jit
def _tile_of(starts_ptr, j, segments, BLOCK_Q: tl.constexpr, SEG: tl.constexpr):
    """Query tile j of a flat grid: (segment, its tile, live). j is live while below the tiles'
    total; a program past it (the grid is cut for the most tiles any lengths could need) finds
    that in this one load and exits."""
    seg, first, tiles = _tile_map(starts_ptr, segments, BLOCK_Q, SEG)
    s, qb = _locate(seg, first, j)
    return s, qb, j < tl.sum(tiles, 0)


@triton.jit
def _varlen_group(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, starts_ptr, lens_ptr, pos_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_ot, stride_oh,
    scale, head_dim, segments,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, DOT: tl.constexpr, FLAT: tl.constexpr, SPLITS: tl.constexpr = 1,
    SHARE_TILES: tl.constexpr = 1, SEG: tl.constexpr = 1, NARROW: tl.constexpr = False,
    PERSISTENT: tl.constexpr = False,
):
    """One program: segment s, query tile qb, KV head kv, share sp of the walk. Row i of the
    [BLOCK_Q * G, D] query tile is token qb * BLOCK_Q + i // G of the segment and query head
    kv * GROUP + i % G. On a FLAT grid axis 0 numbers query tiles across all segments (`_tile_of`,
    over SEG >= segments lanes), and a program past the step's tiles exits; a PERSISTENT flat
    program j instead reads tiles j, j + P, j + 2P, ... of the step's (P the grid's axis 0), so a
    grid of few programs covers any lengths. With SPLITS == 1 the program walks every tile its
    queries can see and writes the output normalised. Otherwise axis 2 is kv * SPLITS + sp: share
    sp walks its contiguous part of those tiles (`_tiles_per_share`) and writes its un-normalised
    acc with its m and l for every live row, an empty share m = -inf and l = acc = 0;
    `_varlen_fold` folds them. With NARROW a key tile's K and V are read through one [BLOCK_N, D]
    tensor of int32 offsets, which K and V share (their pools are contiguous, of one shape, and of
    fewer than 2**31 elements, as the host checks), instead of two of 64-bit pointers."""
    kv = tl.program_id(2) // SPLITS
    sp = tl.program_id(2) % SPLITS
    if PERSISTENT:
        seg, first, tiles = _tile_map(starts_ptr, segments, BLOCK_Q, SEG)
        for j in range(tl.program_id(0), tl.sum(tiles, 0), tl.num_programs(0)):
            s, qb = _locate(seg, first, j)
            _read_tile(q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, starts_ptr, lens_ptr, pos_ptr, out_ptr, acc_ptr,
                       m_ptr, l_ptr, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
                       stride_ot, stride_oh, scale, head_dim, s, qb, kv, sp, GROUP, G, BLOCK_Q, BLOCK_N, D, PAGE,
                       DOT, SPLITS, SHARE_TILES, NARROW)
    else:
        if FLAT:
            s, qb, live_tile = _tile_of(starts_ptr, tl.program_id(0), segments, BLOCK_Q, SEG)
            if not live_tile:
                return
        else:
            s = tl.program_id(0)
            qb = tl.program_id(1)
        _read_tile(q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, starts_ptr, lens_ptr, pos_ptr, out_ptr, acc_ptr,
                   m_ptr, l_ptr, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr,
                   stride_ot, stride_oh, scale, head_dim, s, qb, kv, sp, GROUP, G, BLOCK_Q, BLOCK_N, D, PAGE, DOT,
                   SPLITS, SHARE_TILES, NARROW)


@triton.jit
def _read_tile(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, starts_ptr, lens_ptr, pos_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_tr, stride_ot, stride_oh,
    scale, head_dim, s, qb, kv, sp,
    GROUP: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, DOT: tl.constexpr, SPLITS: tl.constexpr, SHARE_TILES: tl.constexpr, NARROW: tl.constexpr,
):
    """`_varlen_group`'s work for one query tile: segment s, its tile qb, KV head kv, share sp."""
    start = tl.load(starts_ptr + s)
    q_len = tl.load(starts_ptr + s + 1) - start
    i = tl.arange(0, BLOCK_Q * G)
    tok = qb * BLOCK_Q + i // G
    g = i % G
    d = tl.arange(0, D)
    dmask = d < head_dim
    live = (tok < q_len) & (g < GROUP)  # [M]: a real token and a real head of the group
    t = start + tok  # the token's place on the flattened axis
    heads = kv * GROUP + g
    qmask = live[:, None] & dmask[None, :]
    q = tl.load(q_ptr + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    if DOT != 2:
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + t, mask=live, other=-1)  # [M]; -1 reads nothing
    # Keys this tile can see: up to its last position, and never past the row's length. A tile past
    # the segment's end has every pos at -1, so it walks nothing.
    n_keys = tl.minimum(tl.load(lens_ptr + s), tl.max(pos, axis=0) + 1)
    n_tiles = tl.cdiv(n_keys, BLOCK_N)
    # This share's tiles, cut from the tile's own n_keys so that the grid need not follow them;
    # with SPLITS == 1 the one share is every tile.
    per_share = _tiles_per_share(n_tiles, SPLITS, SHARE_TILES)
    first = sp * per_share
    last = tl.minimum(first + per_share, n_tiles)
    m = tl.full([BLOCK_Q * G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * G], tl.float32)
    acc = tl.zeros([BLOCK_Q * G, D], tl.float32)
    for b in range(first, last):
        w = b * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = w < n_keys
        slot, valid = _slots(table_ptr, rows_ptr, s, stride_tr, w, valid, PAGE)
        seen = valid[None, :] & (w[None, :] <= pos[:, None])  # causal by position
        if NARROW:
            off = slot.to(tl.int32)[:, None] * stride_ks + kv * stride_kh + d[None, :]  # [N, D]: K's and V's
            tile_mask = valid[:, None] & dmask[None, :]
            k = tl.load(k_ptr + off, mask=tile_mask, other=0.0)
            v = tl.load(v_ptr + off, mask=tile_mask, other=0.0)
            m, l, acc = _attend_kv(q, k, v, seen, m, l, acc, scale, DOT)
        else:
            m, l, acc = _attend_tile(q, k_ptr, v_ptr, slot, kv, d, dmask, valid, seen, m, l, acc, scale,
                                     stride_ks, stride_kh, stride_vs, stride_vh, DOT)
    if SPLITS == 1:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + t[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # partials: acc [num_tokens, query heads, SPLITS, D] fp32, m and l [num_tokens, query heads, SPLITS]
        part = (t * (GROUP * (tl.num_programs(2) // SPLITS)) + heads) * SPLITS + sp  # [M]
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=qmask)
        tl.store(m_ptr + part, m, mask=live)
        tl.store(l_ptr + part, l, mask=live)


@triton.jit
def _varlen_fold(
    acc_ptr, m_ptr, l_ptr, starts_ptr, out_ptr, stride_ot, stride_oh, heads, head_dim, segments,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
):
    """One program: token t, all its query heads as the rows of an [H, D] tile. The output of each
    head is its SPLITS shares' acc, each weighted by exp(m - max m), over their weighted l
    (`_fold_shares`); a head no share saw a key for reads zeros. A token of no segment (a captured
    step's padding, past the last) has no partials and leaves its output as it is: zeros."""
    t = tl.program_id(0).to(tl.int64)  # int64: t * heads * SPLITS * D indexes the partials
    if (t < tl.load(starts_ptr)) | (t >= tl.load(starts_ptr + segments)):
        return
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    hmask = h < heads
    qmask = hmask[:, None] & (d < head_dim)[None, :]
    first_part = (t * heads + h) * SPLITS  # [H]: share 0 of each head
    every = tl.full([], SPLITS, tl.int32)  # every share wrote its partials, empty or not
    out = _fold_shares(acc_ptr, m_ptr, l_ptr, first_part, hmask, qmask, d, every, SPLITS, D)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=qmask)


def _check_inputs(q, k_pool, v_pool, table_rows, query_start_loc, context_lens, positions) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, heads, head_dim], got {tuple(q.shape)}")
    n, heads, _ = q.shape
    segments = table_rows.shape[0]
    if query_start_loc.shape != (segments + 1,) or context_lens.shape != (segments,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} and context_lens "
                         f"{tuple(context_lens.shape)} must describe the {segments} segments of table_rows")
    if positions.shape != (n,):
        raise ValueError(f"positions must be [num_tokens] = [{n}], got {tuple(positions.shape)}")
    if heads % k_pool.shape[1]:
        raise ValueError(f"{heads} query heads do not share {k_pool.shape[1]} KV heads evenly")
    if q.dtype != k_pool.dtype or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"q, K and V must share a dtype, got {q.dtype}, {k_pool.dtype} and {v_pool.dtype}")


def varlen_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    max_query_len: int,
    *,
    grid_tokens: int | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    splits: int = 1,
    share_tiles: int = SHARE_TILES,
    num_warps: int = 4,
    num_stages: int | None = None,
    narrow: bool | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """Causal attention of every segment's queries over its row of the paged pool, in Triton.

    q               [num_tokens, heads, head_dim]   the step's queries, segments end to end
    k_pool/v_pool   [slots, kv_heads, head_dim]     one layer's pool, this step's K/V already written
    block_table     [table rows, max_blocks] int32  the cache's persistent table
    table_rows      [segments] int64                each segment's table row
    query_start_loc [segments + 1] int64            segment s is tokens query_start_loc[s] .. [s + 1] - 1
    context_lens    [segments] int64                tokens each row holds, this step's included
    positions       [num_tokens] int64              a query at position p reads keys 0..p of its row
    max_query_len   host int, the longest segment: the grid's query-tile axis
    grid_tokens     host int or None: cut a flat grid for this many tokens instead, whatever the
                    segments hold (a captured step, whose grid cannot follow the step's lengths):
                    grid_tokens // tile + min(segments, grid_tokens) programs a KV head, each finding
                    its segment; segments past the first grid_tokens must be empty (a padded plan's
                    padding, after its real segments)
    splits          host int >= 1: shares each program's key walk is cut into, each its own program,
                    folded by `_varlen_fold` (`choose_varlen_splits` picks it); 1 walks it whole
    returns         [num_tokens, heads, head_dim]   in q's dtype
    `block_m` is the query tile's rows (tokens x the group's heads, at least 16 for tl.dot), `block_n`
    the keys per tile; both powers of two. `share_tiles` is the fewest key tiles a share walks.
    `num_warps` and `num_stages` are the group kernel's launch; `num_stages` None is the engine's
    choice, `UNSPLIT_STAGES` for an unsplit walk and Triton's default for a split one. `narrow`
    addresses K and V through one tensor of int32 offsets (`_varlen_group`'s NARROW), which needs
    contiguous pools of one shape and fewer than `NARROW_LIMIT` elements (`narrow_fits`); None,
    the engine's choice, takes it wherever the pools allow. `programs`, with `grid_tokens`, cuts
    the flat grid to that many programs a KV head and share, each reading every `programs`-th of
    the step's query tiles (`_varlen_group`'s PERSISTENT); None cuts one program for each tile the
    grid could need, and those past the step's tiles exit.
    """
    _check_inputs(q, k_pool, v_pool, table_rows, query_start_loc, context_lens, positions)
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be a [table rows, max_blocks] tensor, contiguous along a row")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if splits < 1:
        raise ValueError(f"splits must be a positive int, got {splits}")
    if share_tiles < 1:
        raise ValueError(f"share_tiles must be positive, got {share_tiles}")
    if num_warps not in (1, 2, 4, 8, 16) or num_stages is not None and num_stages < 1:
        raise ValueError(f"num_warps must be a power of two up to 16 and num_stages positive or None, got "
                         f"{num_warps} and {num_stages}")
    if narrow is None:
        narrow = narrow_fits(k_pool, v_pool)
    elif narrow and not narrow_fits(k_pool, v_pool):
        raise ValueError(f"narrow offsets need contiguous K and V pools of one shape and fewer than {NARROW_LIMIT} "
                         f"elements, got shapes {tuple(k_pool.shape)} and {tuple(v_pool.shape)}, strides "
                         f"{k_pool.stride()} and {v_pool.stride()}, {k_pool.numel()} elements")
    if grid_tokens is not None and grid_tokens < q.shape[0]:
        raise ValueError(f"grid_tokens {grid_tokens} must cover the {q.shape[0]} tokens of q")
    if programs is not None and (grid_tokens is None or isinstance(programs, bool) or not isinstance(programs, int)
                                 or programs < 1):
        raise ValueError(f"programs must be a positive int, and only with grid_tokens; got programs={programs} "
                         f"and grid_tokens={grid_tokens}")
    if any(t.stride(0) != 1 for t in (table_rows, query_start_loc, context_lens, positions)):
        raise ValueError("table_rows, query_start_loc, context_lens and positions must be contiguous")
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and q.stride(2) == 1
    n, heads, d = q.shape
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    G = _pow2(group)
    block_q = _tile_tokens(group, block_m)
    out = torch.zeros_like(q)  # zeros: a token of no segment (none in a plan) reads zeros, not garbage
    segments = table_rows.shape[0]
    if n == 0 or segments == 0:
        return out
    if grid_tokens is None:
        grid = (segments, triton.cdiv(max_query_len, block_q), kv_heads * splits)
    else:
        # A captured step has a segment per table row (max_rows), but at most grid_tokens of them
        # hold a token: the rest are padding, empty, after the real ones. The tile map, the grid and
        # the fold look at those alone; a grid cut for every row launched a program a KV head and
        # share for each of them (64 rows by default), walking nothing.
        segments = min(segments, grid_tokens)
        # the most tiles any lengths of grid_tokens tokens in `segments` segments need (each segment
        # wastes less than a tile); a program past the step's own tiles exits (`_tile_of`)
        tiles = grid_tokens // block_q + segments
        grid = (min(programs, tiles) if programs else tiles, 1, kv_heads * splits)
    D = _pow2(d, 16)
    # out stands in for the partials when there are none (splits == 1 never touches them)
    acc, m, l = _partials(n, heads, splits, D, q.device) if splits > 1 else (out, out, out)
    _varlen_group[grid](
        q, k_pool, v_pool, block_table, table_rows, query_start_loc, context_lens, positions, out, acc, m, l,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), 1.0 / math.sqrt(d), d, segments,
        GROUP=group, G=G, BLOCK_Q=block_q, BLOCK_N=block_n, D=D, PAGE=block_size,
        DOT=_dot_mode(k_pool.dtype), FLAT=grid_tokens is not None, SPLITS=splits, SHARE_TILES=share_tiles,
        SEG=_pow2(segments) if grid_tokens is not None else 1, NARROW=bool(narrow), PERSISTENT=programs is not None,
        num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages is not None else
           {"num_stages": UNSPLIT_STAGES} if splits == 1 else {}))
    if splits > 1:  # one program a token, whatever the segments: a captured step's grid holds
        _varlen_fold[(n,)](acc, m, l, query_start_loc, out, out.stride(0), out.stride(1), heads, d, segments,
                           H=_pow2(heads), D=D, SPLITS=splits)
    return out


def _tile_tokens(group: int, block_m: int = BLOCK_M) -> int:
    """Tokens a query tile holds: `block_m` rows, each token's `group` query heads padded to a power
    of two."""
    return max(1, block_m // _pow2(group))


def narrow_fits(k_pool: torch.Tensor, v_pool: torch.Tensor, limit: int = NARROW_LIMIT) -> bool:
    """Whether one tensor of int32 offsets addresses both pools (`varlen_attention`'s `narrow`):
    both contiguous and of one shape (so an element's offset is the same in each, and below its
    count), with fewer than `limit` elements."""
    return (k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.shape == v_pool.shape
            and k_pool.numel() < limit)


def persistent_programs(kv_heads: int, splits: int, num_sms: int = 132) -> int:
    """`varlen_attention`'s `programs` for a persistent flat grid: as many programs a KV head and
    share as every SM's `RESIDENT` slots hold at once (at least one), each then reading every so
    many of the step's query tiles (`varlen_attention` cuts it to the tiles the grid could need)."""
    for name, value in (("kv_heads", kv_heads), ("splits", splits), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return max(1, RESIDENT * num_sms // (kv_heads * splits))


@functools.lru_cache(maxsize=4096)
def captured_splits(num_tokens: int, kv_heads: int, group: int, num_sms: int = 132, max_splits: int = 8) -> int:
    """Shares per program for a flat grid cut for `num_tokens` (a captured or compiled step, whose
    rows' contexts the grid cannot know): the most, a power of two up to `max_splits`, that keep
    every query tile of one segment of `num_tokens` tokens (a prompt after a cached prefix) in one
    wave of `captured_programs`, each program then reading one tile's share; 1 where even one
    share a tile overfills that wave, and then a program a tile (`captured_programs`). A segment's
    walk, long or short, is then cut as finely as the wave allows, at no cost in waves."""
    tiles = triton.cdiv(num_tokens, _tile_tokens(group))  # of one segment of num_tokens
    splits = 1
    while splits < max_splits and kv_heads * tiles * splits * 2 <= RESIDENT * num_sms:
        splits *= 2
    return splits


def captured_programs(kv_heads: int, splits: int, num_sms: int = 132) -> int | None:
    """`varlen_attention`'s `programs` for a flat grid (a captured or compiled step): persistent
    programs (`persistent_programs`) where the step's walks are cut into shares, None (a program for
    every tile the grid could need) where they are not. A split step is a short one over a long
    context, cut for far more tiles than its few tokens fill, so most of a flat grid's programs
    would exit at once; an unsplit step is a long chunk, whose tiles fill most of its grid and which
    a loop over tiles only slows."""
    return persistent_programs(kv_heads, splits, num_sms) if splits > 1 else None


@functools.lru_cache(maxsize=4096)
def choose_varlen_splits(num_tokens: int, segments: int, kv_heads: int, group: int, num_sms: int = 132,
                         max_splits: int = 8, max_context: int | None = None) -> int:
    """Shares per program for a varlen step: the smallest power of two, at most `max_splits`, that
    brings the grid (query tiles x kv_heads x shares, the query tiles counted as the flat grid counts
    them) to at least `num_sms` programs; 1 when the grid fills the SMs unshared, or when
    `max_context` (the longest row, where the host knows it) fits one share's `SHARE_TILES` tiles.
    The shares pay off only where each walk is long: a short context's extra shares walk nothing."""
    if max_context is not None and max_context <= SHARE_TILES * BLOCK_N:
        return 1
    block_q = _tile_tokens(group)
    programs = (num_tokens // block_q + segments) * kv_heads
    splits = 1
    while splits < max_splits and programs * splits < num_sms:
        splits *= 2
    return splits


@torch.library.custom_op("nanolab::varlen_attention", mutates_args=())
def varlen_attention_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                        table_rows: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                        positions: torch.Tensor, block_size: int, splits: int | None = None,
                        num_sms: int = 132) -> torch.Tensor:
    """`varlen_attention` as one opaque operator, for a compiled varlen step. Its grid is the flat
    one a captured step's is, cut for the step's whole token count (q's first dimension, symbolic
    in the graph) instead of the longest segment, a host value a compiled step would have to
    guard on, so one graph serves every mix of segments: segments past q's token count must be
    empty (a padded plan's padding). `splits` is `varlen_attention`'s; None chooses it here, at
    run time, for the token count on `num_sms` SMs (`captured_splits`, as a captured eager step
    does for its size), which the graph then holds. A split read launches persistent programs
    (`captured_programs`), as a captured eager step does."""
    n, heads = q.shape[0], q.shape[1]
    kv_heads = k_pool.shape[1]
    if splits is None:
        splits = captured_splits(max(n, 1), kv_heads, heads // kv_heads, num_sms)
    return varlen_attention(q, k_pool, v_pool, block_table, table_rows, block_size, query_start_loc, context_lens,
                            positions, max(n, 1), grid_tokens=max(n, 1), splits=splits,
                            programs=captured_programs(kv_heads, splits, num_sms))


@varlen_attention_op.register_fake
def _(q, k_pool, v_pool, block_table, table_rows, query_start_loc, context_lens, positions, block_size, splits=None,
      num_sms=132):
    return torch.empty_like(q)


def varlen_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    table_rows: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    host: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor:
    """`varlen_attention`'s inputs and result, in torch: segment by segment, the row's slots
    0..context_lens[s] - 1 from the block table, and `reference_read` of the segment's queries over
    them. The CPU's read, and the kernel's oracle. `host` (query_start_loc, context_lens) as host
    ints spares reading them back from the device (a plan has them)."""
    _check_inputs(q, k_pool, v_pool, table_rows, query_start_loc, context_lens, positions)
    starts, lens = host if host is not None else (query_start_loc.tolist(), context_lens.tolist())
    out = torch.zeros_like(q)
    for s, ctx in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        p = torch.arange(ctx, device=q.device)
        blocks = block_table[table_rows[s], p // block_size].long()
        slots = (blocks * block_size + p % block_size)[None]  # [1, ctx]
        out[a:b] = reference_read(q[None, a:b], k_pool, v_pool, slots, context_lens[s:s + 1], positions[None, a:b],
                                  validated=True)[0]
    return out


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_lens: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of whole prompts, each over its own keys alone.

    q          [num_tokens, heads, head_dim]      the step's queries, segments end to end
    k, v       [num_tokens, kv_heads, head_dim]   the same tokens' keys and values (any token stride)
    query_lens host ints, tokens of each segment; each segment is a prompt from position 0
    returns    [num_tokens, heads, head_dim]      in q's dtype

    One `scaled_dot_product_attention` a segment, its query heads grouped over the KV heads
    (`enable_gqa`), which on a GPU runs a flash kernel."""
    n, heads, d = q.shape
    if (sum(query_lens) != n or min(query_lens, default=1) < 1 or k.shape != v.shape or k.shape[0] != n
            or k.shape[2] != d or heads % k.shape[1]):
        raise ValueError(f"query_lens {list(query_lens)} must be positive and add up to the {n} queries, and k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)} hold the same tokens, with {heads} query heads "
                         f"a multiple of their KV heads")
    out = torch.empty_like(q)
    start = 0
    for length in query_lens:
        end = start + length
        seg = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads or kv_heads, T, head_dim]
        o = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=heads != k.shape[1])
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out
