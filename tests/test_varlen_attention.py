"""The varlen read (chunked prefill): the Triton kernel against its torch reference, and the
reference against naive attention.

Each case lays ragged segments end to end, as a varlen step does: a segment holds `history` keys
from earlier steps and `q_len` new ones (a whole prompt, a chunk, or a decode row's single token),
and its row's blocks are scattered over the pool. Every slot that no segment may read (other rows'
blocks, the tail of a row's last block, the sink) holds NaN, so a read of one poisons the result.
On a CPU the kernel runs in Triton's interpreter: small shapes, 16-wide tiles so that a chunk spans
several query tiles and a context several key tiles.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.engine.block_manager import cdiv
from nanolab.kernels import varlen_attention as varlen_attention_module
from nanolab.kernels.varlen_attention import (
    captured_programs,
    captured_splits,
    choose_varlen_splits,
    narrow_fits,
    persistent_programs,
    prompt_attention,
    varlen_attention,
    varlen_attention_op,
    varlen_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 4  # the cache's block_size
TILES = dict(block_m=16, block_n=16)
# query heads : KV heads, head_dim
SHAPES = {"gqa 4:2 d24": (4, 2, 24), "mha 2:2 d16": (2, 2, 16), "gqa 6:2 d16": (6, 2, 16), "mqa 8:1 d16": (8, 1, 16)}


def varlen_case(segments, heads, kv_heads, head_dim, *, dtype=torch.float32, seed=0):
    """Inputs for `segments` [(history, q_len), ...]: (kwargs for both reads, max_query_len)."""
    g = torch.Generator().manual_seed(seed)
    lens = [h + n for h, n in segments]
    num_blocks = sum(cdiv(n, PAGE) for n in lens) + 3  # three blocks nobody owns
    k_pool = torch.full((num_blocks * PAGE + 1, kv_heads, head_dim), float("nan"))
    v_pool = torch.full_like(k_pool, float("nan"))
    order = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(segments) + 1, max(cdiv(n, PAGE) for n in lens) + 1), -1, dtype=torch.int32)
    for s, ctx in enumerate(lens):
        blocks = [order.pop() for _ in range(cdiv(ctx, PAGE))]
        table[s, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = [blocks[p // PAGE] * PAGE + p % PAGE for p in range(ctx)]
        k_pool[slots] = torch.randn(ctx, kv_heads, head_dim, generator=g)
        v_pool[slots] = torch.randn(ctx, kv_heads, head_dim, generator=g)
    starts = [0]
    for _, n in segments:
        starts.append(starts[-1] + n)
    positions = [p for h, n in segments for p in range(h, h + n)]
    q = torch.randn(starts[-1], heads, head_dim, generator=g)
    tensors = dict(q=q.to(dtype), k_pool=k_pool.to(dtype), v_pool=v_pool.to(dtype), block_table=table,
                   table_rows=torch.arange(len(segments)), block_size=PAGE, query_start_loc=torch.tensor(starts),
                   context_lens=torch.tensor(lens), positions=torch.tensor(positions))
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}, max(
        n for _, n in segments)


def naive(case) -> torch.Tensor:
    """float64, one query at a time: softmax over keys 0..position of its row."""
    q, k_pool, v_pool = case["q"].double().cpu(), case["k_pool"].double().cpu(), case["v_pool"].double().cpu()
    table, starts = case["block_table"].cpu(), case["query_start_loc"].tolist()
    heads, kv_heads, d = q.shape[1], k_pool.shape[1], q.shape[2]
    out = torch.zeros_like(q)
    for s in range(len(starts) - 1):
        for t in range(starts[s], starts[s + 1]):
            p = torch.arange(int(case["positions"][t]) + 1)
            slots = table[s, p // PAGE].long() * PAGE + p % PAGE
            for h in range(heads):
                kv = h // (heads // kv_heads)
                w = torch.softmax(k_pool[slots, kv] @ q[t, h] / math.sqrt(d), dim=0)
                out[t, h] = w @ v_pool[slots, kv]
    return out


MIXED = [(0, 9), (13, 1), (5, 7), (0, 1), (30, 1), (2, 18)]  # prompts, chunks on history, decode rows


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_reference_equals_naive_fp32(shape):
    heads, kv_heads, d = SHAPES[shape]
    case, max_q = varlen_case(MIXED, heads, kv_heads, d)
    ref = varlen_reference(**case)
    assert not ref.isnan().any(), "the reference read a poisoned slot"
    torch.testing.assert_close(ref.double().cpu(), naive(case), rtol=1e-5, atol=1e-5)
    got = varlen_attention(**case, max_query_len=max_q, **TILES)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_kernel_in_16_bits(dtype, atol):
    """16-bit pools against the fp32 reference of the same (rounded) values: the kernel accumulates
    in fp32 and rounds once, at the store (the interpreter's fp32-to-bf16 cast truncates)."""
    case, max_q = varlen_case(MIXED, 4, 2, 24, dtype=dtype, seed=1)
    oracle = varlen_reference(**{k: v.float() if k in ("q", "k_pool", "v_pool") else v for k, v in case.items()})
    got = varlen_attention(**case, max_query_len=max_q, **TILES)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), oracle, rtol=2e-2, atol=atol)


def padded(case, extra_tokens: int, extra_segments: int):
    """`case` laid out as a captured step's plan is: `extra_tokens` padding tokens after the real
    ones (position 0), and `extra_segments` empty segments where the real tokens end, over an
    all-sink table row."""
    n = case["q"].shape[0]
    table = torch.cat([case["block_table"], torch.full_like(case["block_table"][:1], -1)])
    pad_row = table.shape[0] - 1
    grow = lambda t, value, k: torch.cat([t, torch.full((k,), value, dtype=t.dtype, device=t.device)])
    return {**case, "q": torch.cat([case["q"], torch.randn_like(case["q"][:1]).expand(extra_tokens, -1, -1)]),
            "block_table": table, "table_rows": grow(case["table_rows"], pad_row, extra_segments),
            "query_start_loc": grow(case["query_start_loc"], n, extra_segments),
            "context_lens": grow(case["context_lens"], 0, extra_segments),
            "positions": grow(case["positions"], 0, extra_tokens)}


@pytest.mark.parametrize("segments", [MIXED, [(0, 1)], [(40, 1), (3, 16), (0, 17)]], ids=["mixed", "one", "tiles"])
def test_a_flat_grid_over_padding_equals_the_reference(segments):
    """A captured step's read: the grid cut for the padded token count (`grid_tokens`), every
    program finding its segment in the tile map, empty segments and padding tokens after the real
    ones. The real tokens read what the reference reads; the padding reads nothing."""
    case, _ = varlen_case(segments, 4, 2, 24, seed=3)
    n = case["q"].shape[0]
    ref = varlen_reference(**case)
    step = padded(case, extra_tokens=13, extra_segments=5)
    got = varlen_attention(**step, max_query_len=1, grid_tokens=n + 13, **TILES)
    torch.testing.assert_close(got[:n], ref, rtol=1e-5, atol=1e-5)
    assert not got[n:].any(), "a padding token was attended"
    with pytest.raises(ValueError, match="grid_tokens"):
        varlen_attention(**step, max_query_len=1, grid_tokens=n, **TILES)


def record_grids(monkeypatch) -> list[tuple[int, int, int]]:
    """Every grid `_varlen_group` is launched on, in order; the launches still run."""
    grids, kernel = [], varlen_attention_module._varlen_group

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(varlen_attention_module, "_varlen_group", Recorder())
    return grids


@pytest.mark.parametrize("splits", [1, 2])
def test_a_captured_grid_counts_the_tokens_not_the_table_rows(splits, monkeypatch):
    """A captured step's plan has a segment per table row, 64 here, and three decode rows of one
    token each: the grid, the tile map and the fold look at the first grid_tokens segments alone
    (every real one, since each holds a token), so the flat grid is 3 // tile + 3 programs a KV
    head and share, not 3 // tile + 64, and the last real segment is still read."""
    grids = record_grids(monkeypatch)
    case, _ = varlen_case([(7, 1), (0, 1), (21, 1)], 4, 2, 24, seed=7)
    n = case["q"].shape[0]
    step = padded(case, extra_tokens=0, extra_segments=61)
    got = varlen_attention(**step, max_query_len=1, grid_tokens=n, splits=splits, share_tiles=1, **TILES)
    torch.testing.assert_close(got, varlen_reference(**case), rtol=1e-5, atol=1e-5)
    block_q = TILES["block_m"] // 2  # a group of two query heads
    assert grids == [(n // block_q + n, 1, 2 * splits)]


def test_default_tiles_and_one_token_segments_only():
    """Decode rows alone (every segment one token), at the default 64-wide tiles."""
    case, max_q = varlen_case([(7, 1), (0, 1), (21, 1)], 4, 2, 24, seed=2)
    torch.testing.assert_close(varlen_attention(**case, max_query_len=max_q), varlen_reference(**case),
                               rtol=1e-5, atol=1e-5)


def test_inputs_are_checked():
    case, max_q = varlen_case([(0, 3)], 4, 2, 16)
    with pytest.raises(ValueError, match="segments"):
        varlen_attention(**{**case, "query_start_loc": case["query_start_loc"][:1]}, max_query_len=max_q)
    with pytest.raises(ValueError, match="positions"):
        varlen_attention(**{**case, "positions": case["positions"][:2]}, max_query_len=max_q)
    with pytest.raises(ValueError, match="power of two"):
        varlen_attention(**case, max_query_len=max_q, block_m=24)
    with pytest.raises(ValueError, match="splits"):
        varlen_attention(**case, max_query_len=max_q, splits=0)
    with pytest.raises(ValueError, match="share_tiles"):
        varlen_attention(**case, max_query_len=max_q, splits=2, share_tiles=0)


# Contexts far apart, at 16-key tiles: a short query after 70 cached keys (5 tiles, several live
# shares), a chunk over two query tiles, a short row of one tile (every share but the first empty),
# a decode row of 3 tiles.
UNEVEN = [(70, 3), (20, 12), (2, 2), (40, 1)]


def poison_partials(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Make every split read's partials NaN until written, and keep them: a fold that read a
    partial no share wrote returns NaN."""
    partials, made = varlen_attention_module._partials, []

    def poisoned(*shape_and_device):
        made.append(tuple(t.fill_(float("nan")) for t in partials(*shape_and_device)))
        return made[-1]

    monkeypatch.setattr(varlen_attention_module, "_partials", poisoned)
    return made


@pytest.mark.parametrize("splits", [2, 4])
def test_split_walks_equal_the_reference(splits, monkeypatch):
    """Each program's key walk cut into `splits` one-tile-minimum shares and folded: the
    reference's output. Every share writes its partials for every real token, an empty share
    m = -inf and l = 0: the short row's shares past its one tile are empty."""
    made = poison_partials(monkeypatch)
    case, max_q = varlen_case(UNEVEN, 4, 2, 24, seed=4)
    got = varlen_attention(**case, max_query_len=max_q, splits=splits, share_tiles=1, **TILES)
    torch.testing.assert_close(got, varlen_reference(**case), rtol=1e-5, atol=1e-5)
    (_, m, l), = made  # m, l [num_tokens, heads, splits]
    assert not m.isnan().any() and not l.isnan().any(), "a share left a real token's partials unwritten"
    short = slice(*case["query_start_loc"][2:4].tolist())  # the (2, 2) segment's tokens: one tile, share 0's
    assert short.stop - short.start == 2
    assert (m[short, :, 0] > float("-inf")).all()
    assert (m[short, :, 1:] == float("-inf")).all() and not l[short, :, 1:].any()


def test_split_walks_of_at_least_share_tiles(monkeypatch):
    """The default share minimum (4 tiles): of 8 shares, the 5-tile row's first two are live (4
    tiles and 1), every shorter row's first alone."""
    made = poison_partials(monkeypatch)
    case, max_q = varlen_case(UNEVEN, 4, 2, 24, seed=5)
    got = varlen_attention(**case, max_query_len=max_q, splits=8, **TILES)
    torch.testing.assert_close(got, varlen_reference(**case), rtol=1e-5, atol=1e-5)
    (_, m, _), = made
    live = (m > float("-inf")).all(dim=1)  # [num_tokens, splits]: a share that saw a key, for every head
    assert live.tolist() == [[True, True] + [False] * 6] * 3 + [[True] + [False] * 7] * 15


@pytest.mark.parametrize("splits", [2, 4])
def test_a_flat_grid_of_split_walks_over_padding_equals_the_reference(splits, monkeypatch):
    """A captured step's split read: shares cut inside the kernel from each tile's own keys, the
    fold's grid one program a token. Padding tokens have no partials (they stay NaN) and read
    zeros."""
    made = poison_partials(monkeypatch)
    case, _ = varlen_case(UNEVEN, 4, 2, 24, seed=6)
    n = case["q"].shape[0]
    step = padded(case, extra_tokens=13, extra_segments=5)
    got = varlen_attention(**step, max_query_len=1, grid_tokens=n + 13, splits=splits, share_tiles=1, **TILES)
    torch.testing.assert_close(got[:n], varlen_reference(**case), rtol=1e-5, atol=1e-5)
    assert not got[n:].any(), "a padding token was attended"
    (_, m, _), = made
    assert not m[:n].isnan().any() and m[n:].isnan().all()


@pytest.mark.parametrize("programs, splits", [(1, 1), (4, 2), (40, 1)])
def test_persistent_programs_read_every_tile_of_a_flat_grid(programs, splits, monkeypatch):
    """`programs`: a flat grid of that many programs a KV head and share, each reading every
    programs-th query tile of the step (9 tiles here, one segment empty between others: one
    program reads them all, or four read two or three each, or the grid is cut to the 18 tiles
    it could need), over padding and in shares: what the reference reads, every real token's
    partials written, the padding's output and partials left alone."""
    made = poison_partials(monkeypatch)
    grids = record_grids(monkeypatch)
    case, _ = varlen_case([*MIXED[:2], (6, 0), *MIXED[2:]], 4, 2, 24, seed=11)
    n = case["q"].shape[0]
    step = padded(case, extra_tokens=13, extra_segments=5)
    got = varlen_attention(**step, max_query_len=1, grid_tokens=n + 13, splits=splits, share_tiles=1,
                           programs=programs, **TILES)
    torch.testing.assert_close(got[:n], varlen_reference(**case), rtol=1e-5, atol=1e-5)
    assert not got[n:].any(), "a padding token was attended"
    block_q = TILES["block_m"] // 2  # a group of two query heads
    assert grids == [(min(programs, (n + 13) // block_q + len(step["table_rows"])), 1, 2 * splits)]
    if splits > 1:
        (_, m, _), = made
        assert not m[:n].isnan().any() and m[n:].isnan().all()
    for bad in ({"programs": 0, "grid_tokens": n}, {"programs": 2}, {"programs": 2.0, "grid_tokens": n}):
        with pytest.raises(ValueError, match="programs"):
            varlen_attention(**case, max_query_len=18, **bad, **TILES)


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_narrow_offsets_read_what_the_reference_reads(splits, monkeypatch):
    """`narrow`: K and V addressed through one tensor of int32 offsets. Whole walks and shares, in a
    flat grid over padding and in 16 bits: what the reference reads, every real token's partials
    written and the padding's left alone."""
    made = poison_partials(monkeypatch)
    for segments in (MIXED, UNEVEN):
        case, max_q = varlen_case(segments, 6, 2, 16, seed=9)
        ref = varlen_reference(**case)
        got = varlen_attention(**case, max_query_len=max_q, splits=splits, share_tiles=1, narrow=True, **TILES)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        n = case["q"].shape[0]
        step = padded(case, extra_tokens=5, extra_segments=3)
        got = varlen_attention(**step, max_query_len=1, grid_tokens=n + 5, splits=splits, share_tiles=1,
                               narrow=True, **TILES)
        torch.testing.assert_close(got[:n], ref, rtol=1e-5, atol=1e-5)
        assert not got[n:].any(), "a padding token was attended"
        if splits > 1:
            (_, m, _), (_, m_step, _) = made[-2:]
            assert not m.isnan().any() and not m_step[:n].isnan().any(), "a real token's partials were not written"
            assert m_step[n:].isnan().all(), "a padding token's partials were written"
    assert len(made) == (4 if splits > 1 else 0)
    half = {k: v.half() if k in ("q", "k_pool", "v_pool") else v for k, v in case.items()}
    got = varlen_attention(**half, max_query_len=max_q, splits=splits, share_tiles=1, narrow=True, **TILES)
    torch.testing.assert_close(got.float(), varlen_reference(**{**half, **{k: half[k].float() for k in
                                                                          ("q", "k_pool", "v_pool")}}),
                               rtol=2e-2, atol=4e-3)


def test_narrow_offsets_need_pools_they_can_address():
    """Narrow offsets are shared by K and V and are int32: pools that are views (whose offsets may
    pass their element count), of other shapes, or of more elements than an int32 reaches, are
    refused by name rather than read wrong; the engine's choice reads them with wide offsets."""
    case, max_q = varlen_case(MIXED, 4, 2, 24)

    def strided(pool):  # the pool's values in a view of a wider buffer: not contiguous
        view = torch.zeros(pool.shape[0], pool.shape[1], 32, device=pool.device)[:, :, :pool.shape[2]]
        return view.copy_(pool)

    v_wide = strided(case["v_pool"])
    with pytest.raises(ValueError, match="narrow offsets need contiguous K and V pools of one shape"):
        varlen_attention(**{**case, "v_pool": v_wide}, max_query_len=max_q, narrow=True, **TILES)
    torch.testing.assert_close(varlen_attention(**{**case, "v_pool": v_wide}, max_query_len=max_q, **TILES),
                               varlen_reference(**case), rtol=1e-5, atol=1e-5)
    # views of equal strides: an element's offset is the same in each, but may pass their count
    k_view = strided(case["k_pool"])
    views = {**case, "k_pool": k_view, "v_pool": v_wide}
    assert k_view.stride() == v_wide.stride()
    with pytest.raises(ValueError, match="narrow offsets need contiguous"):
        varlen_attention(**views, max_query_len=max_q, narrow=True, **TILES)
    torch.testing.assert_close(varlen_attention(**views, max_query_len=max_q, **TILES), varlen_reference(**case),
                               rtol=1e-5, atol=1e-5)
    # a pool an int32 cannot address all of: the same test, at a limit this pool reaches
    assert narrow_fits(case["k_pool"], case["v_pool"])
    assert not narrow_fits(case["k_pool"], case["v_pool"], limit=case["k_pool"].numel())


def test_the_operator_passes_splits_through(monkeypatch):
    """The compiled step's operator, at the default 64-key tiles: a 5-tile context read in two
    shares (4 tiles and 1); its schema and fake agree with it (`opcheck`)."""
    made = poison_partials(monkeypatch)
    case, _ = varlen_case([(300, 3), (2, 2)], 4, 2, 24, seed=7)
    args = [case[k] for k in ("q", "k_pool", "v_pool", "block_table", "table_rows", "query_start_loc",
                              "context_lens", "positions", "block_size")]
    torch.testing.assert_close(varlen_attention_op(*args, splits=2), varlen_reference(**case), rtol=1e-5, atol=1e-5)
    (_, m, _), = made
    assert (m[:3] > float("-inf")).all(), "the long row's two shares both read keys"
    torch.library.opcheck(varlen_attention_op, args, {"splits": 2}, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("num_sms", [132, 4, 1])
def test_the_operator_over_a_padded_step(num_sms, monkeypatch):
    """The compiled step's operator over a captured step's plan (a segment per table row, padding
    tokens after the real ones): the flat grid cut for q's tokens reads what the reference reads,
    the split count chosen inside for them (`captured_splits`: 8 with 132 SMs to fill, 4 with 4,
    where the unpadded rule would take 2, and 1 with one SM, whose two programs the two KV heads
    fill unsplit), its shares looped over by persistent programs."""
    made = poison_partials(monkeypatch)
    launches, real = [], varlen_attention_module.varlen_attention

    def spy(*a, **kw):
        launches.append((kw["splits"], kw["programs"]))
        return real(*a, **kw)

    monkeypatch.setattr(varlen_attention_module, "varlen_attention", spy)
    case, _ = varlen_case([(300, 3), (2, 2), (40, 1)], 4, 2, 24, seed=8)
    n = case["q"].shape[0]
    step = padded(case, extra_tokens=3, extra_segments=20)
    args = [step[k] for k in ("q", "k_pool", "v_pool", "block_table", "table_rows", "query_start_loc",
                              "context_lens", "positions", "block_size")]
    got = varlen_attention_op(*args, num_sms=num_sms)
    # the captured step's rule for its 9 tokens (2 KV heads, one tile of 32 tokens)
    splits = {132: 8, 4: 4, 1: 1}[num_sms]
    assert launches == [(splits, captured_programs(2, splits, num_sms))], launches
    assert num_sms != 4 or choose_varlen_splits(n + 3, 1, 2, 2, num_sms) == 2
    torch.testing.assert_close(got[:n], varlen_reference(**case), rtol=1e-5, atol=1e-5)
    assert not got[n:].any(), "a padding token was attended"
    assert len(made) == (num_sms > 1), "the split read runs where the SMs want more programs"


def test_a_flat_grid_launches_persistent_programs_only_where_its_walks_are_split():
    """`captured_programs`: a split step's flat grid is mostly tiles its tokens do not fill, and
    loops persistent programs over the ones they do; an unsplit one launches a program a tile."""
    assert captured_programs(8, 8) == persistent_programs(8, 8) == 4
    assert captured_programs(8, 2) == 16 and captured_programs(8, 4, num_sms=16) == 1
    assert captured_programs(8, 1) is None


def test_persistent_programs_fill_the_sms_once():
    """Two programs an SM: 264 on 132 SMs, shared among the KV heads and shares, at least one."""
    assert persistent_programs(8, 8) == 4  # 256 programs: 4 query tiles after a cached prefix, one pass
    assert persistent_programs(8, 1) == 33 and persistent_programs(8, 1, num_sms=4) == 1
    assert persistent_programs(64, 16) == 1
    for bad in ({"kv_heads": 0}, {"splits": True}, {"num_sms": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            persistent_programs(**{"kv_heads": 8, "splits": 8, **bad})


def test_a_captured_step_splits_as_finely_as_one_wave_of_persistent_programs_allows():
    """`captured_splits`: the most shares (up to 8) that keep one segment's query tiles, each in
    its shares, within two programs an SM (Llama-3.2-1B: 8 KV heads, 16 tokens a tile)."""
    assert captured_splits(56, 8, 4) == 8  # 4 tiles x 8 heads x 8 shares = 256 of 264
    assert captured_splits(64, 8, 4) == 8 and captured_splits(72, 8, 4) == 4  # 4 tiles, then 5
    assert captured_splits(128, 8, 4) == 4 and captured_splits(136, 8, 4) == 2
    assert captured_splits(256, 8, 4) == 2 and captured_splits(272, 8, 4) == 1
    assert captured_splits(512, 8, 4) == 1 and captured_splits(1, 8, 4) == 8
    assert captured_splits(64, 8, 4, num_sms=66) == 4 and captured_splits(64, 8, 4, max_splits=2) == 2


def test_choose_varlen_splits():
    # Llama-3.2-1B shapes (8 KV heads, groups of 4, 16-token query tiles): 50 new tokens are 4 tiles
    # of 8 KV heads, 32 programs; 8 shares bring them past 132 SMs
    assert choose_varlen_splits(50, 1, 8, 4) == 8
    assert choose_varlen_splits(50, 1, 8, 4, num_sms=64) == 2
    assert choose_varlen_splits(50, 1, 8, 4, max_splits=4) == 4
    assert choose_varlen_splits(64, 1, 8, 4) == 4  # 40 programs: 4 shares fill the SMs
    assert choose_varlen_splits(512, 1, 8, 4) == 1  # 33 tiles x 8 KV heads fill the SMs unshared
    assert choose_varlen_splits(4, 4, 8, 4) == 8  # four decode rows: 4 tiles x 8 KV heads, capped


SEGMENT = st.tuples(st.integers(0, 24), st.integers(1, 20))  # (history, q_len)


@settings(max_examples=25, deadline=None)
@given(segments=st.lists(SEGMENT, min_size=1, max_size=5), shape=st.sampled_from(sorted(SHAPES)),
       seed=st.integers(0, 1000))
def test_kernel_equals_reference_on_random_segments(segments, shape, seed):
    heads, kv_heads, d = SHAPES[shape]
    case, max_q = varlen_case(segments, heads, kv_heads, d, seed=seed)
    ref = varlen_reference(**case)
    assert not ref.isnan().any()
    torch.testing.assert_close(varlen_attention(**case, max_query_len=max_q, **TILES), ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(segments=st.lists(SEGMENT, min_size=1, max_size=4), splits=st.sampled_from([2, 3, 4]),
       share_tiles=st.integers(1, 2), seed=st.integers(0, 1000))
def test_split_walks_equal_the_reference_on_random_segments(segments, splits, share_tiles, seed):
    case, max_q = varlen_case(segments, 6, 2, 16, seed=seed)
    got = varlen_attention(**case, max_query_len=max_q, splits=splits, share_tiles=share_tiles, **TILES)
    torch.testing.assert_close(got, varlen_reference(**case), rtol=1e-5, atol=1e-5)


def write_slots(case) -> torch.Tensor:
    """Each query's own slot: where a varlen step wrote its K/V."""
    table, starts, pos = case["block_table"], case["query_start_loc"].tolist(), case["positions"]
    segment = torch.repeat_interleave(torch.arange(len(starts) - 1, device=pos.device),
                                      torch.tensor(starts, device=pos.device).diff())
    return table[segment, pos // PAGE].long() * PAGE + pos % PAGE


@pytest.mark.parametrize("shape", SHAPES)
def test_prompt_attention_of_whole_prompts_equals_naive(shape):
    heads, kv_heads, d = SHAPES[shape]
    prompts = [(0, 9), (0, 1), (0, 23), (0, 4)]
    case, _ = varlen_case(prompts, heads, kv_heads, d)
    slots = write_slots(case)  # the forward's own K/V: what it wrote at these slots
    out = prompt_attention(case["q"], case["k_pool"][slots], case["v_pool"][slots], tuple(n for _, n in prompts))
    torch.testing.assert_close(out.double().cpu(), naive(case), atol=1e-5, rtol=1e-5)


def test_prompt_attention_refuses_lengths_that_do_not_cover_the_queries():
    case, _ = varlen_case([(0, 5), (0, 3)], 4, 2, 16)
    with pytest.raises(ValueError, match="query_lens"):
        slots = write_slots(case)
        prompt_attention(case["q"], case["k_pool"][slots], case["v_pool"][slots], (5, 2))
