"""Day 59's device measurement: the decode read alone, the rectangle against the streamed kernel.

Day 59 (the seed's streambench.py was host-only; `lab.costs.streambench_table` is that table).
This times one layer's decode read at bf16, 32 query heads over 8 KV heads, head_dim 64:

- "reference": `kernels.reference.reference_read`, which gathers the [rows, width] rectangle;
- `paged_attention` addressed through the slot mapping (a block table of block size 1), at each
  variant ("head", "gqa", "split"), and "table": through the block table, as the engine calls it
  (Day 60's wiring, variant chosen by shape);
- "sdpa": torch's scaled_dot_product_attention (flash on CUDA at 16 bits) over an equivalent
  contiguous cache [rows, kv_heads, width, head_dim]. It has no per-row lengths without a mask, and
  a mask takes flash away, so on a ragged batch it reads the whole rectangle.

Bandwidth counts the K and V bytes the batch really holds (each row's own length), over the time,
for every arm: a read that loads padding gets no credit for it. Every arm is timed as a CUDA graph
replay, as the engine runs it, so Python's launch cost is not in the time, and every replay is
preceded by a write of a buffer larger than the L2 cache, so no arm reads K/V that a previous
replay left there.
Blocks are scattered over the pool, as a long-running server leaves them.

    python -m nanolab streambench
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanolab.engine.block_manager import cdiv
from nanolab.engine.plan import derive_slot_mapping
from nanolab.kernels.paged_attention import BLOCK, choose_launch, paged_attention
from nanolab.kernels.reference import check_read_inputs, reference_read
from nanolab.lab.costs import spread_lengths
from nanolab.lab.timing import time_us

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 64, 16
# The shapes: (label, row lengths).
SHAPES = {
    "64 x 8192": [8192] * 64,
    "8 x 2048": [2048] * 8,
    "256 x 1024": [1024] * 256,
    "long tail 64 x 8192": spread_lengths(64, 8192, "long tail"),
}
ARMS = ("reference", "head", "gqa", "split", "table", "sdpa")


@dataclass(frozen=True)
class ReadBatch:
    """One layer's decode read: a scattered paged pool and the same history laid out contiguously."""

    q: torch.Tensor  # [rows, 1, heads, head_dim]
    k_pool: torch.Tensor  # [slots + 1, kv_heads, head_dim]; the last slot is the sink
    v_pool: torch.Tensor
    block_table: torch.Tensor  # [rows, max_blocks] int32
    table_rows: torch.Tensor  # [rows] int64: row r reads table row r
    context_lens: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows, 1] int64
    slot_mapping: torch.Tensor  # [rows, width] int64, -1 past each row's length

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the batch holds: what a read must load at least once."""
        per_token = 2 * self.k_pool.shape[1] * self.k_pool.shape[2] * self.k_pool.element_size()
        return int(self.context_lens.sum()) * per_token

    def contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as a contiguous cache [rows, kv_heads, width, head_dim], zero past each row."""
        safe = self.slot_mapping.clamp(min=0)
        keep = (self.slot_mapping >= 0)[..., None, None]
        k = torch.where(keep, self.k_pool[safe], 0).transpose(1, 2).contiguous()
        v = torch.where(keep, self.v_pool[safe], 0).transpose(1, 2).contiguous()
        return k, v


def read_batch(lengths: list[int], *, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM,
               page: int = PAGE, dtype=torch.bfloat16, device="cuda", seed: int = 0) -> ReadBatch:
    """A batch whose rows hold `lengths` tokens, in blocks of `page` drawn at random from the pool."""
    g = torch.Generator().manual_seed(seed)
    blocks = [cdiv(n, page) for n in lengths]
    num_blocks = sum(blocks)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lengths), max(blocks)), -1, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[start:start + n].to(torch.int32)
        start += n
    shape = (num_blocks * page + 1, kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    v_pool = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    table = table.to(device)
    rows = torch.arange(len(lengths), device=device)
    mapping = derive_slot_mapping(table, rows, lens, max(lengths), page)
    q = torch.randn((len(lengths), 1, heads, head_dim), generator=g).to(device=device, dtype=dtype)
    return ReadBatch(q, k_pool, v_pool, table, rows, lens, (lens - 1)[:, None], mapping)


def mapping_read(q, k_pool, v_pool, slot_mapping, context_lens, positions=None, **launch) -> torch.Tensor:
    """`paged_attention` addressed by a slot mapping [rows, width]: the block table of block size 1,
    row r reading table row r. It refuses what `reference_read` refuses (`check_read_inputs`: every
    row non-empty, the mapping as wide as the longest row), since no plan has checked the lengths.
    `launch` goes to `paged_attention` (variant, block, splits, ...)."""
    check_read_inputs(slot_mapping, context_lens, q, None, validated=False)
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    return paged_attention(q, k_pool, v_pool, slot_mapping, rows, 1, context_lens, positions, **launch)


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
                     variant: str = "auto", block: int = BLOCK, splits: int | None = None) -> Agreement:
    """Run the kernel and the reference on one batch and measure them row by row (as the seed prints)."""
    oracle = reference_read(q, k_pool, v_pool, slot_mapping, context_lens, positions)
    kernel = mapping_read(q, k_pool, v_pool, slot_mapping, context_lens, positions, block=block, variant=variant,
                          splits=splits)
    diff = (kernel.float() - oracle.float()).abs().flatten(1).amax(dim=1)
    return Agreement(label, variant, tuple(float(x) for x in diff))


def read_fn(arm: str, batch: ReadBatch, page: int = PAGE):
    """The read `arm` performs on `batch`, as a no-argument callable returning [rows, 1, heads, d]."""
    b = batch
    if arm == "reference":
        return lambda: reference_read(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.context_lens, b.positions,
                                      validated=True)
    if arm in ("head", "gqa", "split"):  # the mapping as a block table of block size 1; row r reads row r
        return lambda: paged_attention(b.q, b.k_pool, b.v_pool, b.slot_mapping, b.table_rows, 1, b.context_lens,
                                       b.positions, variant=arm)
    if arm == "table":
        return lambda: paged_attention(b.q, b.k_pool, b.v_pool, b.block_table, b.table_rows, page, b.context_lens,
                                       b.positions)
    if arm == "sdpa":
        k, v = b.contiguous()
        q = b.q.transpose(1, 2)  # [rows, heads, 1, d]

        def sdpa():
            if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):  # flash has no fp32 kernel
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return out.transpose(1, 2)

        return sdpa
    raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")


def run_streambench(shapes: dict[str, list[int]] = SHAPES, arms=ARMS, device="cuda", dtype=torch.bfloat16,
                    repeats: int = 20, page: int = PAGE, **batch_kwargs) -> pd.DataFrame:
    """One row per (shape, arm): microseconds, achieved K/V bandwidth, and the worst difference from
    the reference."""
    device = torch.device(device)
    records = []
    for label, lengths in shapes.items():
        batch = read_batch(lengths, dtype=dtype, device=device, page=page, **batch_kwargs)
        oracle = read_fn("reference", batch, page)().float()
        ragged = min(lengths) != max(lengths)
        for arm in arms:
            fn = read_fn(arm, batch, page)
            if arm == "sdpa" and ragged:
                err = float("nan")  # the contiguous rectangle has no lengths: it answers another question
            else:
                err = float((fn().float() - oracle).abs().max())
            us = time_us(fn, device, repeats)
            records.append({"shape": label, "rows": len(lengths), "width": max(lengths), "arm": arm, "us": us,
                            "kv_bytes": batch.kv_bytes, "tb_s": batch.kv_bytes / us / 1e6, "max_err": err})
        del batch
    df = pd.DataFrame(records)
    ref = df[df.arm == "reference"].set_index("shape").us
    df["x_reference"] = [ref[s] / us for s, us in zip(df["shape"], df.us, strict=True)]
    return df


# Day 60's read runs at every batch the engine captures, so the sweep adds the small batches
# whose (row, KV head) programs cannot fill the card, and 64 x 2,048, the largest step the
# capture bench profiles inside the engine.
TUNE_SHAPES = {**SHAPES, "1 x 2048": [2048], "1 x 8192": [8192], "16 x 2048": [2048] * 16,
               "64 x 2048": [2048] * 64}


def launch_grid(variant: str, rows: int, kv_heads: int = KV_HEADS, num_sms: int = 132):
    """The launch settings the sweep tries for one variant: (block, num_warps, num_stages, splits).
    Splits are tried only while the split programs stay within eight waves of the card."""
    blocks, warps, stages = (32, 64, 128), (2, 4, 8), (1, 2, 3, 4)
    if variant == "head":
        return [(b, w, s, 1) for b in blocks for w in (1, 2, 4) for s in (1, 2, 3)]
    splits = [1] if variant == "gqa" else [n for n in (2, 4, 8, 16) if rows * kv_heads * n <= 8 * num_sms]
    return [(b, w, s, n) for n in splits for b in blocks for w in warps for s in stages]


def tune(shapes: dict[str, list[int]] = TUNE_SHAPES, variants=("head", "gqa", "split"), device="cuda",
         dtype=torch.bfloat16, repeats: int = 10, page: int = PAGE, progress: bool = True) -> pd.DataFrame:
    """Time the table-addressed read (the engine's) at every launch setting of `launch_grid`: one row
    per (shape, variant, block, num_warps, num_stages, splits). The default launch,
    `kernels.paged_attention.choose_launch`, is read off this table."""
    from nanolab.progress import progress_bar

    device = torch.device(device)
    jobs = [(label, v, cfg) for label, lengths in shapes.items() for v in variants
            for cfg in launch_grid(v, len(lengths))]
    records, b, batch_label = [], None, None
    for label, variant, (block, warps, stages, splits) in progress_bar(jobs, desc="launch sweep", enabled=progress):
        if label != batch_label:  # jobs come shape by shape: one batch in memory at a time
            b, batch_label = None, label
            b = read_batch(shapes[label], dtype=dtype, device=device, page=page)

        def fn(b=b, variant=variant, block=block, warps=warps, stages=stages, splits=splits):
            return paged_attention(b.q, b.k_pool, b.v_pool, b.block_table, b.table_rows, page, b.context_lens,
                                   b.positions, variant=variant, block=block,
                                   splits=splits if variant == "split" else None, num_warps=warps,
                                   num_stages=stages)
        try:
            us = time_us(fn, device, repeats)
        except Exception as e:  # a setting the compiler cannot fit (shared memory, registers): record it
            print(f"{label} {variant} block {block} warps {warps} stages {stages} splits {splits}: "
                  f"{type(e).__name__}: {str(e)[:120]}")
            us = float("nan")
        records.append({"shape": label, "rows": len(b.context_lens), "width": int(b.context_lens.max()),
                        "variant": variant, "block": block, "num_warps": warps, "num_stages": stages,
                        "splits": splits, "us": us, "tb_s": b.kv_bytes / us / 1e6})
    return pd.DataFrame(records)


def launch_rule(sweep: pd.DataFrame, heads: int = HEADS, kv_heads: int = KV_HEADS) -> pd.DataFrame:
    """For each shape of a `tune` table: the launch the default rule picks (`choose_launch`, at
    `BLOCK`), its time, and that time over the fastest the sweep found.
    Raises ValueError where the sweep did not try the rule's setting."""
    records = []
    for shape, runs in sweep.groupby("shape", sort=False):
        rows, width = int(runs.rows.iloc[0]), int(runs.width.iloc[0])
        variant, splits, warps, stages = choose_launch(rows, heads, kv_heads, width)
        pick = runs[(runs.variant == variant) & (runs.splits == splits) & (runs.block == BLOCK)
                    & (runs.num_warps == warps) & (runs.num_stages == stages)]
        if len(pick) != 1:
            raise ValueError(f"{shape}: the sweep has {len(pick)} runs of the rule's launch ({variant}, {splits} "
                             f"shares, block {BLOCK}, {warps} warps, {stages} stages), not one")
        us = float(pick.us.iloc[0])
        records.append({"shape": shape, "variant": variant, "splits": splits, "num_stages": stages, "us": us,
                        "best_us": runs.us.min(), "of_best": us / runs.us.min()})
    return pd.DataFrame(records)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tune", action="store_true",
                        help="sweep the table read's launch settings instead (day59_launch_sweep)")


def main(args: argparse.Namespace) -> int:
    from nanolab.lab.report import run_label, save_table

    if not torch.cuda.is_available():
        raise ValueError("the streamed-read bench needs a CUDA device")
    label = run_label(torch.device("cuda"), "decode read, 32/8 heads, head_dim 64", torch.bfloat16,
                      weights="synthesized random")
    if args.tune:
        sweep = tune()
        best = sweep.loc[sweep.groupby(["shape", "variant"]).us.idxmin()]
        print(best.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print(f"wrote {save_table(sweep, 'day59_launch_sweep', label)}")
        return 0
    df = run_streambench(repeats=args.repeats)
    print(df.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {save_table(df, 'day59_streambench', label)}")
    return 0
