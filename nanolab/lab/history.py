"""The decode the engine replaced, as a runner the engine accepts: Day 49's subject, Day 50's "before".

Before Day 50 the forward decided where a decode step's K/V went while it ran. Layer 0's `write`
grew the block tables and chose the slots; layers 1.. reused that choice (the layer-0 handshake);
and the read rebuilt the [rows, max_ctx] slot mapping from the host tables every step. The read
took its (min_ctx, max_ctx) bounds as host ints from the tables (Day 49's fix) or, before the fix,
from the device (`bounds="device"`). `Engine(model, ..., runner=unplanned_runner())` decodes this
way; prefill stays the engine's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.runner import ModelRunner
from nanolab.engine.sequence import Sequence
from nanolab.kernels.reference import attention_mask_bias, reference_read

BOUNDS = ("cache", "device")


def context_bounds(blocks: BlockManager, rows) -> tuple[int, int]:
    """(min_ctx, max_ctx) over `rows`, read from the host tables."""
    lens = [blocks.table(row).num_tokens for row in rows]
    return min(lens), max(lens)


def host_slot_mapping(blocks: BlockManager, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The read rectangle rebuilt from the host tables: slot_mapping [rows, max_ctx] int64 (padding
    slot 0) and context_lens [rows] int64, on the CPU."""
    tables = [blocks.table(row) for row in rows]
    lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int64)
    width = max(t.num_tokens for t in tables)
    table = torch.zeros((len(tables), cdiv(width, blocks.block_size)), dtype=torch.int64)
    for i, t in enumerate(tables):
        table[i, : len(t.blocks)] = torch.tensor(t.blocks, dtype=torch.int64)
    p = torch.arange(width)
    mapping = table[:, p // blocks.block_size] * blocks.block_size + p % blocks.block_size
    return torch.where(p < lens[:, None], mapping, 0), lens


@dataclass(slots=True)
class _StepSlots:
    """What layer 0 decided for this forward, read by layers 1.. (the handshake)."""

    slots: torch.Tensor  # [rows] int64: pool slot of each row's new token
    slot_mapping: torch.Tensor  # [rows, max_ctx] int64, padding slot 0
    context_lens: torch.Tensor  # [rows] int64
    context_bounds: tuple[int, int]  # (min_ctx, max_ctx) as host ints, from the tables
    next_layer: int
    mask_bias: torch.Tensor | None = None  # [rows, 1, max_ctx], built by the first read


class UnplannedView:
    """The cache as an unplanned decode forward sees it. `cache` is the block manager: the forward
    grows its tables itself, which is what dynamo guards on."""

    def __init__(self, cache: BlockManager, kv: KVCache, rows: tuple[int, ...], bounds: str) -> None:
        self.cache, self.kv, self.rows, self.bounds = cache, kv, rows, bounds
        self.plan = None
        self._step: _StepSlots | None = None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [rows, 1, kv_heads, head_dim]. Layer 0 grows the tables and chooses the slots."""
        if layer == 0:
            tables = [self.cache.table(row) for row in self.rows]
            starts = [t.num_tokens for t in tables]
            self.cache.grow(self.rows, [1] * len(self.rows))
            # This decode never reads the device block table (it predates it), so the entries are
            # dropped rather than copied: the table is stale for rows this runner grew.
            self.cache.take_new_entries()
            slots = [t.slot(p) for t, start in zip(tables, starts, strict=True) for p in range(start, t.num_tokens)]
            mapping, lens = host_slot_mapping(self.cache, self.rows)
            dev = self.kv.device
            self._step = _StepSlots(torch.tensor(slots, dtype=torch.int64, device=dev), mapping.to(dev),
                                    lens.to(dev), context_bounds(self.cache, self.rows), next_layer=0)
        step = self._step
        if step is None or step.next_layer != layer:
            raise RuntimeError(f"layer {layer} wrote before layer 0 of this forward chose the slots")
        step.next_layer = layer + 1
        self.kv.k_pools[layer].index_copy_(0, step.slots, k[:, 0])
        self.kv.v_pools[layer].index_copy_(0, step.slots, v[:, 0])

    def read(self, layer: int, q: torch.Tensor, positions: torch.Tensor, k: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> torch.Tensor:
        """`CacheView.read`'s signature; this forward's k and v are already in the pools, read from there."""
        step = self._step
        if step is None or step.next_layer != layer + 1:
            raise RuntimeError(f"layer {layer} read before writing this forward's K/V")
        if step.mask_bias is None:
            step.mask_bias = attention_mask_bias(step.context_lens, positions, step.slot_mapping.shape[1], q.dtype)
        return reference_read(q, self.kv.k_pools[layer], self.kv.v_pools[layer], step.slot_mapping,
                              step.context_lens, positions, mask_bias=step.mask_bias,
                              context_bounds=step.context_bounds if self.bounds == "cache" else None)


class UnplannedRunner(ModelRunner):
    """A `ModelRunner` whose decode step is unplanned (`UnplannedView`); no buckets, no graphs."""

    def __init__(self, model, kv_cache: KVCache, *, bounds: str = "cache", **kwargs) -> None:
        if bounds not in BOUNDS:
            raise ValueError(f"bounds must be one of {BOUNDS}, got {bounds!r}")
        if kwargs.get("buckets") is not None or kwargs.get("cuda_graphs"):
            raise ValueError("capture buckets and graphs pad a DecodePlan; the unplanned decode has none")
        super().__init__(model, kv_cache, **kwargs)
        self.bounds = bounds

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        blocks = self.kv_cache.blocks
        rows = tuple(s.row for s in seqs)
        ids = torch.tensor([[s.output_token_ids[-1]] for s in seqs], device=self.device)
        positions = torch.tensor([[blocks.table(row).num_tokens] for row in rows], device=self.device)
        view = UnplannedView(blocks, self.kv_cache, rows, self.bounds)
        self.last_decode = (len(seqs), False)
        return self.forward(ids, positions, cache=view)[:, -1]


def unplanned_runner(bounds: str = "cache"):
    """The `runner=` argument that makes an `Engine` decode unplanned, with `bounds` from the host
    tables ("cache", Day 49's fix) or from the device ("device", before it)."""
    return functools.partial(UnplannedRunner, bounds=bounds)
