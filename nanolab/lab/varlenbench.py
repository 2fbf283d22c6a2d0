"""The varlen read alone (`kernels.varlen_attention`), swept over its tiles and launch: the steps
that are not decode-only (a prompt's chunk, a short prompt after a cached prefix, a verify step's
few tokens a row) read the paged pool through it, and on the H200 its kernel took 35% of a
512-token mixed step (`data/day63_mixed_kernels_h200.csv`). CUDA only.

Each case lays its segments' K/V over a pool of `block_size`-token blocks in a shuffled order (as
a served pool holds them), at a model's head shapes. Every config of `sweep_configs` is checked
against `varlen_reference` and timed alone in a CUDA graph with L2 flushed (`timing.time_us`), a
captured step's flat grid included (`grid_tokens`, the case's tokens rounded up to a capture
size). TB/s counts the K/V the case must read once.

Inside a graphed step the engine's launch has read the same shapes in about twice the time it
takes here, so the engine's launch is also timed in the layouts a step hands it (`LAYOUTS`):
`step` gives the read what a captured step does, a table row per engine row (the padding rows
empty, after the real ones) and q as a view of the fused qkv projection's output; `table rows` and
`fused q` each give it one of the two; `step, large pool` also scatters the case's blocks over a
pool of `--pool-gib` GiB a layer (K and V each), as a served pool of many rows holds them. Each
row of the table names its layout.

With `--persistent-only` the engine's tiles are timed as a program for every tile a captured
step's flat grid could need against persistent programs (`varlen_attention`'s `programs`,
`persistent_programs` of them a KV head and share), whose grid does not grow with the rows a
captured step might hold, in every layout; the engine takes the second where the walks are split
(`captured_programs`). With `--capture-sweep` one segment of 64 to 496 tokens after a short and a
long cached context (`capture_cases`) is read in a captured step's layout at 1 to 8 shares, both
ways.

Cases whose segments are short (a verify step, a short prompt after a cached prefix) are also read
by the engine's decode read, a decode row a token over the captured size's rows, in every layout
(`read`): each token reads its keys again, but from L2 after the first, through the kernel a decode
step already runs.

    python -m nanolab varlenbench --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import pandas as pd
import torch
import triton

from nanolab.config import resolve_device
from nanolab.engine.graphs import capture_sizes
from nanolab.kernels.paged_attention import SHARE_TILES, paged_attention
from nanolab.kernels.varlen_attention import (
    BLOCK_M,
    BLOCK_N,
    captured_programs,
    captured_splits,
    choose_varlen_splits,
    narrow_fits,
    persistent_programs,
    varlen_attention,
    varlen_reference,
)
from nanolab.lab.cliargs import positive_float
from nanolab.lab.report import run_label, save_table
from nanolab.lab.timing import time_us
from nanolab.model.config import ModelConfig
from nanolab.model.weights import resolve_weights, weights_kind
from nanolab.progress import progress_bar

NAN = float("nan")


class VarlenCase(NamedTuple):
    name: str
    segments: tuple[tuple[int, int], ...]  # (cached history, new tokens) a segment


# The steps a served engine runs through the read, at Llama-3.2-1B's budget of 512 tokens a step.
CASES = (
    VarlenCase("prompt chunk 512, nothing cached", ((0, 512),)),
    VarlenCase("prompt chunk 512 after 1,536", ((1536, 512),)),
    VarlenCase("50 tokens after a cached 2,048", ((2048, 50),)),
    VarlenCase("64 tokens after a cached 4,128", ((4128, 64),)),
    VarlenCase("verify: 8 rows of 5 over 256", tuple((256, 5) for _ in range(8))),
    VarlenCase("mixed: chunk 448 + 64 decode rows over 512", ((0, 448),) + tuple((512, 1) for _ in range(64))),
)


# The share rule's question: one segment of each of these capture sizes' tokens after a short and a
# long cached context, read in a captured step (`--capture-sweep`).
CAPTURE_TOKENS = (64, 128, 256, 496)
CAPTURE_HISTORY = (256, 4096)


def capture_cases(tokens: Sequence[int] = CAPTURE_TOKENS, history: Sequence[int] = CAPTURE_HISTORY
                  ) -> tuple[VarlenCase, ...]:
    """A case for each cached context and each token count: that many new tokens after it."""
    return tuple(VarlenCase(f"{n} tokens after {h:,}", ((h, n),)) for h in history for n in tokens)


class Layout(NamedTuple):
    name: str
    table_rows: int | None = None  # segments in the table, the padding ones empty; None: the case's own
    fused_q: bool = False  # q a view of [tokens, heads + 2 kv_heads, head_dim], as the qkv projection writes it
    pool_gib: float | None = None  # K (and V) pool per layer, the case's blocks scattered over it; None: just fits


ENGINE_ROWS = 64  # EngineConfig.max_num_seqs' default: a captured step's table rows
DECODE_READ_MAX_QUERY = 64  # the decode read a row a token is timed on cases of segments up to this long
# "step" changes two things at once; "table rows" and "fused q" each change one of them.
LAYOUTS = (Layout("alone"), Layout("table rows", ENGINE_ROWS), Layout("fused q", fused_q=True),
           Layout("step", ENGINE_ROWS, True), Layout("step, large pool", ENGINE_ROWS, True, 4.0))


class VarlenConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int | None
    splits: int | None  # None: the engine's count for the case (`captured_splits` in a step's layout)
    share_tiles: int = SHARE_TILES  # the fewest key tiles a share walks
    narrow: bool | None = None  # K and V through one int32 offset tensor; None: where the pools allow (the engine)
    # `persistent_programs` programs loop over the tiles of a flat grid; False: a program a tile;
    # None: the engine's choice (`captured_programs` in a captured step's layout: persistent where the
    # walks are split; alone, a program a tile, as an unpadded step launches)
    persistent: bool | None = None


DEFAULT = VarlenConfig(BLOCK_M, BLOCK_N, 4, None, None)  # what the engine launches
NARROWED, WIDE = DEFAULT._replace(narrow=True), DEFAULT._replace(narrow=False)
PERSISTENT = DEFAULT._replace(persistent=True)


def sweep_configs() -> list[VarlenConfig]:
    """The engine's launch; at its tiles, share counts from 1 to 32 with the engine's fewest tiles a
    share and with one (a short step over a long context walks its keys in turn, so more, shorter
    shares shorten the walk); then tiles, warps and stages, each with the engine's share count and
    with none."""
    out = [DEFAULT] + [DEFAULT._replace(splits=s, share_tiles=t)
                       for s in (1, 2, 4, 8, 16, 32) for t in (SHARE_TILES, 1)]
    for block_m in (32, 64, 128):
        for block_n in (32, 64):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for splits in (None, 1):
                        out.append(VarlenConfig(block_m, block_n, warps, stages, splits))
    return list(dict.fromkeys(out))


def narrow_configs() -> list[VarlenConfig]:
    """The engine's tiles and warps with narrow offsets off and on, at its share count and at 4, 8
    and 16 of one tile or more, each at its default stages and at 1 and 3 (`--narrow-only`)."""
    return [DEFAULT._replace(splits=s, share_tiles=1 if s else SHARE_TILES, num_stages=st, narrow=n)
            for n in (False, True) for s in (None, 4, 8, 16) for st in (None, 1, 3)]


def persistent_configs() -> list[VarlenConfig]:
    """The engine's tiles as a program a tile and as persistent programs, at its share count and at
    4, 8 and 16 of one tile or more (`--persistent-only`)."""
    return [DEFAULT._replace(splits=s, share_tiles=1 if s else SHARE_TILES, persistent=p)
            for p in (False, True) for s in (None, 4, 8, 16)]


def capture_configs() -> list[VarlenConfig]:
    """The engine's tiles at its own share count and at 1, 2, 4 and 8 (its fewest tiles a share), as
    a program a tile and as persistent programs (`--capture-sweep`)."""
    return [DEFAULT._replace(splits=s, persistent=p) for p in (False, True) for s in (None, 1, 2, 4, 8)]


def case_inputs(case: VarlenCase, heads: int, kv_heads: int, head_dim: int, block_size: int = 16,
                dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0,
                layout: Layout = LAYOUTS[0]) -> dict:
    """The read's arguments for `case`: a pool holding every segment's keys in shuffled blocks,
    the persistent table, and the queries, laid out as `layout` says (padding segments, after the
    real ones, hold no token and read nothing)."""
    g = torch.Generator().manual_seed(seed)
    lens = [h + n for h, n in case.segments]
    per_row = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(per_row) + 1
    if layout.pool_gib is not None:
        slot_bytes = kv_heads * head_dim * torch.finfo(dtype).bits // 8
        num_blocks = max(num_blocks, int(layout.pool_gib * (1 << 30)) // (block_size * slot_bytes))
    order = torch.randperm(num_blocks, generator=g)[:sum(per_row)].tolist()
    segments = max(len(lens), layout.table_rows or 0)
    pad = segments - len(lens)
    table = torch.full((len(lens) + 1, max(per_row)), -1, dtype=torch.int32)  # the last row: the padding's
    for s, n in enumerate(per_row):
        table[s, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    starts = [0]
    for _, n in case.segments:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    positions = [p for h, n in case.segments for p in range(h, h + n)]
    # Random K/V in the slots the case reads; a large pool stays zeros elsewhere (it is GiBs).
    used = torch.tensor([b for row, n in zip(table.tolist(), per_row) for b in row[:n]])
    slots = (used[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    pools = []
    for _ in range(2):
        pool = torch.zeros(num_blocks * block_size + 1, kv_heads, head_dim, dtype=dtype, device=device)
        pool[slots.to(device)] = torch.randn(len(slots), kv_heads, head_dim, generator=g).to(device, dtype)
        pools.append(pool)
    # q [tokens, heads, head_dim], inside the qkv projection's output when the layout says so
    width = heads + 2 * kv_heads if layout.fused_q else heads
    q = torch.randn(tokens, width, head_dim, generator=g).to(device, dtype)[:, :heads]
    out = dict(block_table=table, table_rows=torch.tensor(list(range(len(lens))) + [len(lens)] * pad),
               query_start_loc=torch.tensor(starts + [tokens] * pad), context_lens=torch.tensor(lens + [0] * pad),
               positions=torch.tensor(positions))
    out = {k: v.to(device) for k, v in out.items()}
    return {**out, "q": q, "k_pool": pools[0], "v_pool": pools[1], "block_size": block_size}


def capture_tokens(tokens: int) -> int:
    """The captured size a step of `tokens` pads to: the next power of two, at least 8."""
    return max(8, triton.next_power_of_2(tokens))


def engine_capture_size(tokens: int) -> int:
    """The engine's capture size for a step of `tokens` (`graphs.capture_sizes`, past its default
    512 when the step is longer)."""
    return next(size for size in capture_sizes(max(tokens, 512)) if size >= tokens)


def time_case(case: VarlenCase, config, configs: Sequence[VarlenConfig], repeats: int = 30,
              sms: int | None = None, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
              layout: Layout = LAYOUTS[0]) -> list[dict]:
    """A row per config: its error against the reference and us a call, flat (captured) grid. Laid
    out alone, the grid is cut for the case's tokens rounded up to a power of two and a share count
    chosen knowing the longest context; in a step's layout, as a captured step cuts it: the engine's
    capture size and the count chosen for that size alone (`kv_cache._varlen_streamed`)."""
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    args = case_inputs(case, heads, kv_heads, d, dtype=dtype, device=device, layout=layout)
    n = args["q"].shape[0]
    step = layout.table_rows is not None
    grid_tokens = engine_capture_size(n) if step else capture_tokens(n)
    ref = varlen_reference(**args).float()
    sms = sms or torch.cuda.get_device_properties(args["q"].device).multi_processor_count
    kv_bytes = 2 * sum(h + q for h, q in case.segments) * kv_heads * d * args["k_pool"].element_size()
    fits = narrow_fits(args["k_pool"], args["v_pool"])  # the engine's narrow (config narrow None)
    rows = []
    for c in configs:
        group = heads // kv_heads
        splits = c.splits or (captured_splits(grid_tokens, kv_heads, group, sms) if step else
                              choose_varlen_splits(grid_tokens, len(case.segments), kv_heads, group, sms,
                                                   max_context=max(h + q for h, q in case.segments)))
        # None: as the engine launches, persistent programs only in a captured step's layout (an
        # unpadded step, which the alone layout stands for, launches a program a tile)
        programs = ((captured_programs(kv_heads, splits, sms) if step else None) if c.persistent is None else
                    persistent_programs(kv_heads, splits, sms) if c.persistent else None)
        run = lambda splits=splits, c=c, programs=programs: varlen_attention(  # noqa: E731
            **args, max_query_len=max(q for _, q in case.segments), grid_tokens=grid_tokens, block_m=c.block_m,
            block_n=c.block_n, splits=splits, share_tiles=c.share_tiles, num_warps=c.num_warps,
            num_stages=c.num_stages, narrow=c.narrow, programs=programs)
        row = {"case": case.name, "layout": layout.name, "read": "varlen", "tokens": n, "grid_tokens": grid_tokens,
               "segments": len(case.segments), "table_segments": len(args["table_rows"]), "block_m": c.block_m,
               "block_n": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages or 0, "splits": splits,
               "share_tiles": c.share_tiles,
               "narrow": fits if c.narrow is None else c.narrow, "persistent": programs is not None,
               "engine_default": (c._replace(narrow=None, persistent=None) == DEFAULT and c.narrow in (None, fits)
                                  and c.persistent in (None, step and splits > 1))}
        try:
            err = float((run().float() - ref).abs().max())
            us = time_us(run, args["q"].device, repeats)
        except Exception as e:  # a tile the card cannot hold: recorded, and the sweep goes on
            rows.append({**row, "max_err": NAN, "us": NAN, "tb_s": NAN, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append({**row, "max_err": err, "us": us, "tb_s": kv_bytes / us / 1e6, "error": ""})
    return rows


def per_token_inputs(args: dict, segments: Sequence[tuple[int, int]], grid_tokens: int) -> dict:
    """`case_inputs`' arguments as the decode read takes them, a row per token padded to
    `grid_tokens` rows: token t of a segment is a decode row of the segment's table row, reading
    keys 0..its position (its context the position + 1). Padding rows are a padded decode step's:
    the all-sink table row, context 1, position 0."""
    n = args["q"].shape[0]
    pad_row = args["block_table"].shape[0] - 1
    rows = [s for s, (_, q_len) in enumerate(segments) for _ in range(q_len)] + [pad_row] * (grid_tokens - n)
    positions = args["positions"].tolist() + [0] * (grid_tokens - n)
    device = args["q"].device
    q = torch.zeros((grid_tokens, *args["q"].shape[1:]), dtype=args["q"].dtype, device=device)
    q[:n] = args["q"]
    return dict(q=q[:, None], k_pool=args["k_pool"], v_pool=args["v_pool"], block_table=args["block_table"],
                table_rows=torch.tensor(rows, device=device), block_size=args["block_size"],
                context_lens=torch.tensor([p + 1 for p in positions], device=device),
                positions=torch.tensor(positions, device=device)[:, None])


def time_decode_read(case: VarlenCase, config, repeats: int = 30, sms: int | None = None, device: str = "cuda",
                     dtype: torch.dtype = torch.bfloat16, layout: Layout = LAYOUTS[0]) -> dict:
    """The case read by the engine's decode read (`paged_attention`, its default launch) as one
    decode row per token, over the captured size's rows: a candidate for steps of few tokens a
    segment (a verify step), each token's keys read from L2 after the first. Its error against the
    reference and us a call, as `time_case`'s rows."""
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    args = case_inputs(case, heads, kv_heads, d, dtype=dtype, device=device, layout=layout)
    n = args["q"].shape[0]
    grid_tokens = engine_capture_size(n)
    ref = varlen_reference(**args).float()
    sms = sms or torch.cuda.get_device_properties(args["q"].device).multi_processor_count
    inputs = per_token_inputs(args, case.segments, grid_tokens)
    run = lambda: paged_attention(**inputs, num_sms=sms)  # noqa: E731
    kv_bytes = 2 * sum(h + q for h, q in case.segments) * kv_heads * d * args["k_pool"].element_size()
    row = {"case": case.name, "layout": layout.name, "read": "decode, a row a token", "tokens": n,
           "grid_tokens": grid_tokens, "segments": len(case.segments), "table_segments": grid_tokens,
           "engine_default": False}
    try:
        err = float((run()[:n, 0].float() - ref).abs().max())
        us = time_us(run, args["q"].device, repeats)
    except Exception as e:
        return {**row, "max_err": NAN, "us": NAN, "tb_s": NAN, "error": f"{type(e).__name__}: {e}"[:200]}
    return {**row, "max_err": err, "us": us, "tb_s": kv_bytes / us / 1e6, "error": ""}


def run_varlenbench(model: str, cases: Sequence[VarlenCase] = CASES, configs: Sequence[VarlenConfig] | None = None,
                    repeats: int = 30, layouts: Sequence[Layout] = LAYOUTS, dtype: torch.dtype = torch.bfloat16,
                    log: Callable[[str], None] = print) -> pd.DataFrame:
    """Every config of the sweep on every case alone; then the engine's launch in each other layout.
    `dtype` is the pool's and the queries' (an fp32 pool multiplies at IEEE precision)."""
    config = ModelConfig.from_dir(resolve_weights(model))
    configs = list(configs or sweep_configs())
    rows = []
    for case in progress_bar(cases, desc="varlen cases", unit="case"):
        part = time_case(case, config, configs, repeats, dtype=dtype, layout=layouts[0])
        rows += part
        ok = [r for r in part if r["us"] == r["us"]]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        default = next((r for r in part if r["engine_default"]), None)
        if best and default:
            log(f"{case.name}: engine {default['us']:.1f} us, best {best['us']:.1f} us (block_m {best['block_m']}, "
                f"block_n {best['block_n']}, warps {best['num_warps']}, stages {best['num_stages']}, "
                f"splits {best['splits']} of at least {best['share_tiles']} tiles, narrow {best['narrow']})")
        launches = [WIDE, NARROWED] if any(c.narrow is not None for c in configs) else [DEFAULT]
        if any(c.persistent is not None for c in configs):  # each launch a program a tile and persistent
            launches = [c._replace(persistent=p) for c in launches for p in (False, True)]
        for layout in layouts[1:]:
            for r in time_case(case, config, launches, repeats, dtype=dtype, layout=layout):
                rows.append(r)
                log(f"  the engine's tiles, {'narrow' if r['narrow'] else 'wide'} offsets"
                    f"{', persistent' if r['persistent'] else ''}, {layout.name}: "
                    f"{r['us']:.1f} us ({r['splits']} shares, {r['table_segments']} table rows, grid for "
                    f"{r['grid_tokens']} tokens)")
        if max(q for _, q in case.segments) <= DECODE_READ_MAX_QUERY:
            for layout in layouts:
                r = time_decode_read(case, config, repeats, dtype=dtype, layout=layout)
                rows.append(r)
                log(f"  the decode read, a row a token, {layout.name}: {r['us']:.1f} us")
    return pd.DataFrame(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset name or a model folder (its head shapes)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--pool-gib", type=float, default=next(t.pool_gib for t in LAYOUTS if t.pool_gib),
                        help="the large pool's K (and V) GiB a layer, for the last layout")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="the pool's and the queries' dtype")
    parser.add_argument("--prefix", default="day64", help="the table goes to data/<prefix>_varlen_sweep_<device>.csv")
    parser.add_argument("--cases", default=None,
                        help="comma-separated words; only the cases whose name holds one (e.g. verify,50 tokens)")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false",
                        help="time only the engine's launch (and the decode read), not the sweep of tiles")
    parser.add_argument("--narrow-only", action="store_true",
                        help="sweep only narrow offsets against the engine's (`narrow_configs`), not every tile")
    parser.add_argument("--persistent-only", action="store_true",
                        help="sweep only persistent programs against the engine's launch (`persistent_configs`), "
                             "in every layout")
    parser.add_argument("--capture-sweep", action="store_true",
                        help="the share rule's sweep: 64 to 496 tokens after 256 and 4,096 cached (`capture_cases`), "
                             "read in a captured step's layout at 1 to 8 shares, with and without persistent programs")


def main(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError("--repeats must be positive")
    positive_float(args.pool_gib, "--pool-gib")
    layouts = tuple(t._replace(pool_gib=args.pool_gib) if t.pool_gib else t for t in LAYOUTS)
    dtype = getattr(torch, args.dtype)
    cases = CASES
    if args.cases is not None:
        words = [w.strip() for w in args.cases.split(",") if w.strip()]
        cases = tuple(c for c in CASES if any(w in c.name for w in words))
        if not cases:
            raise ValueError(f"--cases {args.cases!r} names none of: {'; '.join(c.name for c in CASES)}")
    if args.narrow_only + args.persistent_only + args.capture_sweep > 1:
        raise ValueError("--narrow-only, --persistent-only and --capture-sweep: choose one")
    configs = (narrow_configs() if args.narrow_only else persistent_configs() if args.persistent_only
               else None if args.sweep else [DEFAULT])
    if args.capture_sweep:
        if args.cases is not None:
            raise ValueError("--capture-sweep makes its own cases: leave out --cases")
        cases, configs = capture_cases(), capture_configs()
        layouts = tuple(t for t in layouts if t.name == "step")  # every config where a captured step reads
    device = resolve_device(None)
    if device.type != "cuda":
        raise ValueError("varlenbench times the Triton kernel on a GPU: no CUDA device here")
    table = run_varlenbench(args.model, cases, configs, repeats=args.repeats, layouts=layouts, dtype=dtype)
    label = run_label(device, args.model, dtype, weights=weights_kind(resolve_weights(args.model)))
    print(table.dropna(subset=["us"]).sort_values("us").groupby(["case", "layout", "read"]).head(3)
          .to_string(index=False))
    print(f"{args.prefix}_varlen_sweep: {save_table(table, f'{args.prefix}_varlen_sweep', label)}")
    return 0
