"""The paged KV cache: block tables over one shared K/V pool per layer.

Introduced with the engine core (before Day 49). The pool is cut into fixed-size blocks; a
sequence owns a `BlockTable` (vLLM: one row of its block table) listing its blocks in order, so
token p of a sequence lives in pool slot `blocks[p // block_size] * block_size + p % block_size`.

Two ways to address a step. Unplanned (the engine as it stood on the eve of Day 49, kept for
prefill and as the comparison arm): the forward decides where this step's K/V goes while it
runs. `write` on layer 0 grows the tables and stashes the slots it chose, layers 1.. scatter to
the same places (the layer-0 handshake), and the read's `[rows, max_ctx]` `slot_mapping`
rectangle is rebuilt from the tables. Planned (Day 50, decode): `plan_decode` does all of that on
the host before the forward, and the forward only reads the plan's tensors.

Day 51 made the planned addressing persistent. The cache keeps a device block table
`[max_rows + 1, max_blocks_per_row]` (vLLM v1's `BlockTable`) and a per-step buffer for each
row's table row, write slot, context length and position, both allocated once. The host writes
one table entry when a row gains a block and four scalars per row per step; the read's
`[rows, width]` slot mapping is derived from the table on the device, once per step, by `view`
(which a captured graph records, so a replay derives it again). Every tensor a plan hands the
forward lives at a fixed address, which is what a CUDA graph replay needs (Day 54).

Slot -1 is the sink: every pool has one slot past its last block, owned by no block. Padding
cells of a planned slot mapping and the write slots of rows padded up to a capture bucket name
it, so a padded row's write lands there and the reference read's padding loads a finite value
that the mask then removes. The last table row (`pad_row`) is all -1: padded rows point at it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from nanolab.kernels import INTERPRETED
from nanolab.kernels.paged_attention import paged_attention_table_kernel
from nanolab.paged_attention import attention_mask_bias, paged_attention_batched_reference
from nanolab.plan import DecodePlan

SINK = -1  # the pool slot past the last block: padded writes land there, padded reads load it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """Bytes one block costs across every layer's K and V pools: what a pool budget is divided by."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class CacheFull(RuntimeError):
    """The pool has no free block left. The scheduler preempts before this can happen."""


class BlockAllocator:
    """The free list of the pool's blocks. Every block is either free or owned, never both.
    Released blocks are handed out first again (last in, first out)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise CacheFull(f"all {self.num_blocks} blocks of the KV pool are in use")
        block = self._free.popleft()
        self._used.add(block)
        return block

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            assert block in self._used, f"block {block} released but not owned"
            self._used.remove(block)
            self._free.appendleft(block)


class BlockTable:
    """One sequence's blocks, in order, and how many tokens it holds."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0

    def slot(self, p: int) -> int:
        """Flat pool slot of token p."""
        if not 0 <= p < self.num_tokens:
            raise IndexError(f"token {p} is outside a table of {self.num_tokens} tokens")
        return self.blocks[p // self.block_size] * self.block_size + p % self.block_size

    def blocks_needed(self, new_tokens: int) -> int:
        """Blocks this table must gain to hold `new_tokens` more."""
        return max(0, cdiv(self.num_tokens + new_tokens, self.block_size) - len(self.blocks))


@dataclass(slots=True)
class _StepSlots:
    """What layer 0 decided for this forward, read by layers 1.. (the handshake)."""

    rows: tuple[int, ...]
    slots: torch.Tensor  # [new_tokens] int64: pool slot of each new token, rows concatenated
    source: torch.Tensor | None  # [new_tokens] int64 index into the flat [rows * T] K/V; None when all real
    slot_mapping: torch.Tensor  # [rows, max_ctx] int64, padding slot 0
    context_lens: torch.Tensor  # [rows] int64
    context_bounds: tuple[int, int]  # (min_ctx, max_ctx) as host ints, from the tables
    next_layer: int
    mask_bias: torch.Tensor | None = None  # [rows, T, max_ctx], built by the first read


def _streamed_by_default(device: torch.device) -> bool:
    """The streamed read's default: on for a CUDA cache that Triton compiles for (not its
    interpreter, which a CUDA machine runs only if TRITON_INTERPRET=1 was set by hand) on a card
    whose tensor cores take bf16 (sm_80 on); off elsewhere."""
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (8, 0)


class BatchedPagedKVCache:
    """Per-layer K/V pools `[num_blocks * block_size + 1, kv_heads, head_dim]` (the last slot is
    the sink) and a block table per row. Rows are the engine's batch slots; a request holds one row while it runs."""

    # Day 49's fix: the unplanned read gets (min_ctx, max_ctx) from the tables as host ints.
    # False restores the read deriving them itself with int(context_lens.min()) (a device sync).
    bounds_from_cache = True
    # Day 60: a planned decode reads through the streamed Triton kernel, addressed by the block
    # table (`kernels.paged_attention.paged_attention_table_kernel`), instead of the reference's
    # rectangle. Prefill (several queries a row) always reads through the reference. None picks
    # by device: on for a CUDA cache, where the H200 measured the engine's graphed decode step
    # faster at every batch and context (notebooks/59_streamed_kernel.py); off on a CPU, where
    # Triton has only its interpreter.
    streamed_read: bool | None = None

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, max_rows: int = 64, max_model_len: int | None = None,
                 dtype=torch.float32, device="cpu", streamed_read: bool | None = None) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.allocator = BlockAllocator(num_blocks)
        # Zeroed, not empty: the reference read loads padding slots and masks them afterwards,
        # and 0 * NaN from uninitialised memory would still poison the row. The last slot is the sink.
        shape = (num_blocks * block_size + 1, num_kv_heads, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.tables: list[BlockTable | None] = [None] * max_rows
        self._step: _StepSlots | None = None
        self._plans = 0  # plans built so far; a plan whose epoch is older is stale
        # Day 51: the persistent addressing. A row can never hold more blocks than the pool has.
        max_len = num_blocks * block_size if max_model_len is None else min(max_model_len, num_blocks * block_size)
        self.max_blocks_per_row = cdiv(max_len, block_size)
        self.block_table = torch.full((max_rows + 1, self.max_blocks_per_row), SINK, dtype=torch.int32,
                                      device=self.device)  # [max_rows + 1, max_blocks_per_row]; last row pads
        # One buffer per field, each its own allocation: a plan hands out views of them, and a view
        # of a shared [4, max_rows] buffer let dynamo's duck sizing tie the read's width to that 4.
        self.step_inputs = {name: torch.zeros(shape, dtype=torch.int64, device=self.device) for name, shape in (
            ("table_rows", (max_rows,)), ("write_slots", (max_rows,)), ("context_lens", (max_rows,)),
            ("positions", (max_rows, 1)))}
        self._staged: dict[tuple[int, int], int] = {}  # (row, column) -> block, not yet on the device
        self.host_cells = 0  # block-table entries written from the host, ever (Day 51's rebuild gate)
        if streamed_read is None:
            streamed_read = type(self).streamed_read
        self.streamed_read = _streamed_by_default(self.device) if streamed_read is None else streamed_read
        if self.streamed_read and self.device.type != "cuda" and not INTERPRETED:
            raise ValueError("the streamed read needs a CUDA cache, or Triton's interpreter for a CPU one: on a "
                             "machine with CUDA the interpreter is off unless TRITON_INTERPRET=1 is set before "
                             "nanolab is imported")

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def max_rows(self) -> int:
        return len(self.tables)

    @property
    def pad_row(self) -> int:
        """The block table's all-sink row, which rows padded up to a bucket point at."""
        return self.max_rows

    @property
    def plan_epoch(self) -> int:
        """How many plans have been built; the newest plan's epoch."""
        return self._plans

    @property
    def max_width(self) -> int:
        """The widest read rectangle a plan can ask for: a row's whole block-table row."""
        return self.max_blocks_per_row * self.block_size


    # Rows: the scheduler opens one per running request and frees it when the request leaves.

    def free_row_count(self) -> int:
        return sum(table is None for table in self.tables)

    def open_row(self) -> int:
        for row, table in enumerate(self.tables):
            if table is None:
                self.tables[row] = BlockTable(self.block_size)
                return row
        raise CacheFull(f"all {self.max_rows} rows are in use")

    def free_row(self, row: int) -> None:
        """Return a row and every block it owns to the pool."""
        table = self.tables[row]
        if table is None:
            raise ValueError(f"row {row} is not open")
        self.allocator.release(table.blocks)
        self.tables[row] = None

    def table(self, row: int) -> BlockTable:
        table = self.tables[row]
        if table is None:
            raise ValueError(f"row {row} is not open")
        return table

    def context_bounds(self, rows) -> tuple[int, int]:
        """(min_ctx, max_ctx) over `rows`, read from the tables as host ints (Day 49)."""
        lens = [self.table(row).num_tokens for row in rows]
        return min(lens), max(lens)

    def view(self, rows, lengths=None, plan: DecodePlan | None = None) -> BatchedCacheRows:
        """The cache as one forward over `rows` sees it; `lengths` are the new tokens per row
        (all 1 in decode, ragged in prefill). A plan is checked here, on the host: it must be the
        newest one and cover exactly these rows.

        Given a plan, the view also derives the step's read inputs on the device, once for every
        layer: the slot mapping [batch, width] from the persistent block table, and the mask. They
        are derived here and not in `plan_decode` so that a CUDA graph that captures the view and
        the forward together replays the derivation too (Day 54)."""
        rows = tuple(rows)
        if plan is None:
            return BatchedCacheRows(self, rows, tuple(lengths) if lengths is not None else (1,) * len(rows))
        self.require_current(plan)
        if plan.rows != rows:
            raise ValueError(f"the plan covers rows {plan.rows}, not {rows}")
        if self.streamed_read:  # the kernel reads the block table itself: nothing to derive
            return BatchedCacheRows(self, rows, (1,) * len(rows), plan)
        mapping = plan.slot_mapping
        mask = attention_mask_bias(plan.context_lens, plan.positions, plan.width, self.dtype)
        return BatchedCacheRows(self, rows, (1,) * len(rows), plan, mapping, mask)

    def require_current(self, plan: DecodePlan) -> None:
        """Refuse a plan that a newer one has replaced: its buffers now hold the newer plan."""
        if plan.epoch != self.plan_epoch:
            raise RuntimeError(f"stale DecodePlan: built as plan {plan.epoch}, but plan {self._plans} exists; "
                               "its slots have been handed out again")

    def plan_decode(self, rows, device=None, *, batch_size: int | None = None, width: int | None = None
                    ) -> DecodePlan:
        """Grow every row's table by this step's token and return where everything goes.

        Positions are read before the tables grow: a new token's position is the number of tokens
        before it. A row with no tokens is refused: its decode would attend over its own token
        and nothing else, a fluent continuation of nothing.

        `batch_size` pads the batch up to a capture bucket (Day 52): the extra rows point at the
        all-sink table row, write to the sink and read one sink slot. `width` is the read
        rectangle's width, at least the longest row (default: exactly the longest row).

        The host work is O(rows): four scalars per row into `step_inputs` (a copy to the device
        per field), plus one block-table entry for each row that crossed into a new block. The
        plan's tensors are views of those two fixed buffers, so a plan is stale the moment the
        next one is built; `view` and `check_plan_current` refuse it.
        """
        rows = tuple(rows)
        device = torch.device(device) if device is not None else self.device
        if device != self.device:
            raise ValueError(f"a plan lives in the cache's buffers on {self.device}, not on {device}")
        tables = [self.table(row) for row in rows]
        empty = [row for row, t in zip(rows, tables, strict=True) if t.num_tokens == 0]
        if empty:
            raise ValueError(f"decode over empty rows {empty}: a row needs its prompt before it can decode")
        batch = len(rows) if batch_size is None else batch_size
        if not len(rows) <= batch <= self.max_rows:
            raise ValueError(f"batch_size {batch} must hold the {len(rows)} rows and fit the {self.max_rows} "
                             "rows of the cache")
        longest = max((t.num_tokens for t in tables), default=0) + 1
        width = longest if width is None else width
        if not longest <= width <= self.max_width:
            raise ValueError(f"width {width} must hold the longest row ({longest} tokens with this step's) "
                             f"and fit the block table ({self.max_width} tokens a row)")
        needed = sum(t.blocks_needed(1) for t in tables)
        if needed > self.allocator.num_free:
            raise CacheFull(f"this step needs {needed} blocks, the pool has {self.allocator.num_free} free")
        positions = [t.num_tokens for t in tables]
        for row, t in zip(rows, tables, strict=True):
            self._grow(t, 1, row)
        pad = batch - len(rows)
        step = torch.tensor([
            list(rows) + [self.pad_row] * pad,  # table row of each batch row
            [t.slot(p) for t, p in zip(tables, positions, strict=True)] + [SINK] * pad,  # write slot
            [p + 1 for p in positions] + [1] * pad,  # context length, this step's token included
            positions + [0] * pad,  # position of the new token
        ], dtype=torch.int64)
        self.flush_block_table()
        views = {name: buffer[:batch] for name, buffer in self.step_inputs.items()}
        for view, values in zip(views.values(), step, strict=True):
            view.view(-1).copy_(values)
        self._plans += 1
        return DecodePlan(
            **views,
            block_table=self.block_table,
            block_size=self.block_size,
            width=width,
            planned_lens=tuple(p + 1 for p in positions),
            rows=rows,
            epoch=self._plans,
        )

    def _grow(self, table: BlockTable, new_tokens: int, row: int) -> None:
        for _ in range(table.blocks_needed(new_tokens)):
            block = self.allocator.allocate()
            self._staged[row, len(table.blocks)] = block
            table.blocks.append(block)
        table.num_tokens += new_tokens

    def flush_block_table(self) -> None:
        """Write the staged entries into the device block table: one index_put for all of them.
        Staging is a dict, so a row freed and reopened before a flush keeps only its newest entry."""
        if not self._staged:
            return
        (rows, cols), blocks = zip(*self._staged.keys(), strict=True), list(self._staged.values())
        index = torch.tensor([rows, cols], dtype=torch.int64).to(self.device)
        self.block_table[index[0], index[1]] = torch.tensor(blocks, dtype=torch.int32).to(self.device)
        self.host_cells += len(blocks)
        self._staged.clear()

    def slot_mapping(self, rows, plan: DecodePlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The read rectangle: slot_mapping [rows, max_ctx] int64 and context_lens [rows] int64 on
        the cache's device. Given a plan, the plan's: its mapping derived on the device from the
        block table (padding -1, the sink) and its own context_lens. Otherwise rebuilt from the
        tables on the host, padding slot 0 (the unplanned path, before Day 50)."""
        if plan is not None:
            return plan.slot_mapping, plan.context_lens
        tables = [self.table(row) for row in rows]
        lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int64)
        width = max(t.num_tokens for t in tables)
        blocks = torch.zeros((len(tables), cdiv(width, self.block_size)), dtype=torch.int64)
        for i, t in enumerate(tables):
            blocks[i, : len(t.blocks)] = torch.tensor(t.blocks, dtype=torch.int64)
        p = torch.arange(width)
        mapping = blocks[:, p // self.block_size] * self.block_size + p % self.block_size
        mapping = torch.where(p < lens[:, None], mapping, 0)
        return mapping.to(self.device), lens.to(self.device)

    def write(self, layer: int, rows: tuple[int, ...], k: torch.Tensor, v: torch.Tensor, lengths,
              plan: DecodePlan | None = None) -> None:
        """Store this forward's K/V, k and v [rows, T, kv_heads, head_dim], of which the first
        lengths[i] tokens of row i are real.

        Given a plan (decode, T = 1), one index_put over the batch: no table grows, no slot is
        computed, and no layer waits for layer 0. Otherwise layer 0 grows the tables, chooses the
        slots and stashes them; every later layer must name the same rows and reuses the choice.
        """
        if plan is not None:
            self.k_pools[layer][plan.write_slots] = k[:, 0]
            self.v_pools[layer][plan.write_slots] = v[:, 0]
            return
        if layer == 0:
            t = k.shape[1]
            needed = sum(self.table(row).blocks_needed(n) for row, n in zip(rows, lengths, strict=True))
            if needed > self.allocator.num_free:
                # Refuse before any table grows, so a failed step leaves the cache as it was.
                raise CacheFull(f"this forward needs {needed} blocks, the pool has {self.allocator.num_free} free")
            slots: list[int] = []
            for row, n in zip(rows, lengths, strict=True):
                table = self.table(row)
                start = table.num_tokens
                self._grow(table, n, row)
                slots.extend([table.slot(p) for p in range(start, table.num_tokens)])
            source = None
            if any(n != t for n in lengths):
                source = torch.tensor([i * t + j for i, n in enumerate(lengths) for j in range(n)],
                                      dtype=torch.int64, device=self.device)
            mapping, context_lens = self.slot_mapping(rows)
            self._step = _StepSlots(
                rows=rows,
                slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
                source=source,
                slot_mapping=mapping,
                context_lens=context_lens,
                context_bounds=self.context_bounds(rows),
                next_layer=0,
            )
        step = self._step
        if step is None or step.next_layer != layer:
            raise RuntimeError(f"layer {layer} wrote before layer 0 of this forward chose the slots")
        if step.rows != rows:
            raise RuntimeError(f"layer {layer} names rows {rows} but layer 0 wrote rows {step.rows}")
        step.next_layer = layer + 1
        k = k.reshape(-1, *k.shape[2:])  # [rows * T, kv_heads, head_dim]
        v = v.reshape(-1, *v.shape[2:])
        if step.source is not None:
            k, v = k[step.source], v[step.source]
        self.k_pools[layer].index_copy_(0, step.slots, k)
        self.v_pools[layer].index_copy_(0, step.slots, v)

    def paged_attention(self, layer: int, rows: tuple[int, ...], q: torch.Tensor,
                        positions: torch.Tensor, plan: DecodePlan | None = None, *,
                        slot_mapping: torch.Tensor | None = None, mask_bias: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """Read layer `layer` for q [rows, T, heads, head_dim] -> [rows, T, heads, head_dim].

        Given a plan, the read is `validated`: the plan checked its bounds on the host, so the
        traced region observes no value that changes from step to step. `slot_mapping` and
        `mask_bias` are the view's, derived once per step; without them they are derived here."""
        if plan is not None and self.streamed_read:
            return paged_attention_table_kernel(q, self.k_pools[layer], self.v_pools[layer], plan.block_table,
                                                plan.table_rows, self.block_size, plan.context_lens, positions)
        if plan is not None:
            mapping = plan.slot_mapping if slot_mapping is None else slot_mapping
            return paged_attention_batched_reference(
                q, self.k_pools[layer], self.v_pools[layer], mapping, plan.context_lens, positions,
                validated=True, mask_bias=mask_bias)
        step = self._step
        if step is None or step.rows != rows or step.next_layer != layer + 1:
            raise RuntimeError(f"layer {layer} read before writing this forward's K/V")
        if step.mask_bias is None:
            step.mask_bias = attention_mask_bias(step.context_lens, positions, step.slot_mapping.shape[1], q.dtype)
        return paged_attention_batched_reference(
            q, self.k_pools[layer], self.v_pools[layer], step.slot_mapping, step.context_lens, positions,
            context_bounds=step.context_bounds if self.bounds_from_cache else None, mask_bias=step.mask_bias,
        )


@dataclass(slots=True)
class BatchedCacheRows:
    """The cache as one forward sees it: which rows, and how many new tokens each brings. It is
    what `model.py` and `layers.py` carry, so they never name the cache's internals."""

    cache: BatchedPagedKVCache
    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    plan: DecodePlan | None = None
    slot_mapping: torch.Tensor | None = None  # [batch, width] int64, the plan's, derived once per step
    mask_bias: torch.Tensor | None = None  # [batch, 1, width], the plan's mask, built once per step

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(layer, self.rows, k, v, self.lengths, self.plan)

    def paged_attention(self, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.cache.paged_attention(layer, self.rows, q, positions, self.plan,
                                          slot_mapping=self.slot_mapping, mask_bias=self.mask_bias)
