"""The KV cache on the device: per-layer K/V pools, the persistent block table, and the plans that
address them.

Pools are `[num_blocks * block_size + 1, kv_heads, head_dim]`. The last slot is the sink (slot -1):
padded writes land there and the reference read's padding loads it. The device block table is
`[max_rows + 1, max_blocks_per_row]` int32 (vLLM v1's `BlockTable`); its last row (`pad_row`) is
all -1, and rows padded up to a capture bucket point at it. `plan_decode` and `plan_varlen` (chunked
prefill) grow the host tables (`BlockManager`), copy the new entries into the device table, and hand
the forward a plan; the forward reads the pools through a `CacheView` of that plan. The read is
chosen once, when the cache is built: the streamed Triton kernels (`paged_attention` for decode,
`varlen_attention` for varlen steps) or their torch references.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab.config import READS
from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.plan import DecodePlan, VarlenPlan
from nanolab.kernels import INTERPRETED
from nanolab.kernels.chain import shift_step
from nanolab.kernels.elementwise import rope_write, rope_write_op
from nanolab.kernels.paged_attention import paged_attention, paged_attention_op, sm_count
from nanolab.kernels.reference import attention_mask_bias, reference_read
from nanolab.kernels.step_inputs import upload_step_inputs
from nanolab.kernels.varlen_attention import (
    captured_programs,
    captured_splits,
    choose_varlen_splits,
    prompt_attention,
    varlen_attention,
    varlen_attention_op,
    varlen_reference,
)

SINK = -1  # the pool slot past the last block
# Pinned host slots a decode plan's step inputs go up from, in turn (`KVCache._upload`). Asynchronous
# scheduling builds a plan while the step before it is still queued, so two would do; the third is
# margin, and a plan waits for its slot only when the host is three plans ahead of the GPU.
UPLOAD_SLOTS = 3


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> int:
    """Bytes one block costs across every layer's K and V pools: what a pool budget is divided by."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def stage(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on its way to `device`: in pinned memory when that is a CUDA device, so the
    copy that follows (`copy_(..., non_blocking=True)`) is queued on the stream instead of
    stalling the host for a round trip. torch's caching host allocator keeps a pinned block until the copies reading it
    have run, so the next step cannot overwrite it early."""
    return t.pin_memory() if device.type == "cuda" else t


def host_int64(values: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A host int64 tensor [n] of `values`, made through `array.array`: several times faster than
    `torch.tensor` over a long list."""
    buffer = array.array("q", values)
    if not buffer:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(buffer, dtype=torch.int64)  # shares the array's memory, and keeps it alive


def default_read(device: torch.device) -> str:
    """"streamed" on a CUDA device Triton compiles for whose tensor cores take bf16 (sm_80 on);
    "reference" elsewhere (a CPU has only Triton's interpreter)."""
    if device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (8, 0):
        return "streamed"
    return "reference"


class KVCache:
    """K/V pools and the persistent addressing for `blocks`' rows. Every tensor a decode plan hands
    the forward is a view of a buffer allocated here once, which is what a CUDA graph replay needs."""

    def __init__(self, blocks: BlockManager, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_model_len: int | None = None, dtype=torch.float32, device="cpu", read: str = "auto") -> None:
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.num_sms = sm_count(self.device)  # what the varlen read's split count aims to fill
        self.dtype = dtype
        if read == "auto":
            read = default_read(self.device)
        if read not in READS:
            raise ValueError(f"read must be 'auto' or one of {READS}, got {read!r}")
        if read == "streamed" and self.device.type != "cuda" and not INTERPRETED:
            raise ValueError("read='streamed' needs a CUDA cache, or Triton's interpreter for a CPU one: on a "
                             "machine with CUDA the interpreter is off unless TRITON_INTERPRET=1 is set before "
                             "nanolab is imported")
        self.read = read
        self._decode_reader = _streamed if read == "streamed" else _reference
        self._varlen_reader = _varlen_streamed if read == "streamed" else _varlen_reference
        # Zeroed, not empty: the reference read loads padding slots and masks them afterwards, and
        # 0 * NaN from uninitialised memory would still poison the row.
        shape = (blocks.num_blocks * self.block_size + 1, num_kv_heads, head_dim)
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        capacity = blocks.num_blocks * self.block_size
        max_len = capacity if max_model_len is None else min(max_model_len, capacity)
        self.max_blocks_per_row = cdiv(max_len, self.block_size)
        self.block_table = torch.full((blocks.max_rows + 1, self.max_blocks_per_row), SINK, dtype=torch.int32,
                                      device=self.device)  # [max_rows + 1, max_blocks_per_row]
        # One buffer per field, each its own allocation: a view of a shared [4, max_rows] buffer let
        # dynamo's duck sizing tie the read's width to that 4.
        self.step_inputs = {name: torch.zeros(shape, dtype=torch.int64, device=self.device) for name, shape in (
            ("table_rows", (blocks.max_rows,)), ("write_slots", (blocks.max_rows,)),
            ("context_lens", (blocks.max_rows,)), ("positions", (blocks.max_rows, 1)))}
        self.host_cells = 0  # block-table entries written from the host, ever (the rebuild gate)
        self._plans = 0
        # On CUDA, pinned host slots [4 * max_rows] int64 the step inputs go up from (`_upload`), each
        # with the event recorded after the kernel that last read it: a slot is written again only
        # once that kernel has run. (An event never recorded is complete.)
        slots = UPLOAD_SLOTS if self.device.type == "cuda" else 0
        self._upload_slots = [torch.empty(4 * blocks.max_rows, dtype=torch.int64).pin_memory() for _ in range(slots)]
        self._upload_done = [torch.cuda.Event() for _ in range(slots)]
        # Padded varlen plans' fixed buffers, made by `reserve_varlen`.
        self._varlen_inputs: torch.Tensor | None = None
        self._varlen_capacity = 0
        self._varlen_plans = 0

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def varlen_reader(self) -> Callable[..., torch.Tensor]:
        """What a varlen step's layers read through: (view, layer, q, positions) -> the attention
        output (`_varlen_streamed` or `_varlen_reference`, as `read` chose)."""
        return self._varlen_reader

    @varlen_reader.setter
    def varlen_reader(self, reader: Callable[..., torch.Tensor]) -> None:
        """Another read for varlen steps (the lab's candidate launches, timed beside the engine's),
        handed over before any varlen buffer is reserved: a graph captured on the old read would
        go on replaying it."""
        if not callable(reader):
            raise ValueError(f"varlen_reader must be callable, got {type(reader).__name__}")
        if self._varlen_capacity:
            raise RuntimeError("varlen_reader: the varlen buffers are reserved, and graphs may already replay the "
                               "read they were captured with; hand it over before")
        self._varlen_reader = reader

    @property
    def max_rows(self) -> int:
        return self.blocks.max_rows

    @property
    def pad_row(self) -> int:
        """The block table's all-sink row, which rows padded up to a bucket point at."""
        return self.max_rows

    @property
    def max_width(self) -> int:
        """The widest read rectangle a plan can ask for: a row's whole block-table row."""
        return self.max_blocks_per_row * self.block_size

    @property
    def plan_epoch(self) -> int:
        """How many decode plans have been built; the newest one's epoch."""
        return self._plans

    def _grow(self, tables, rows, new_tokens) -> None:
        """Grow the host tables and copy their new entries into the device table, one index_put.
        Refuses (CacheFull) before anything changes when the pool cannot hold the new tokens, and
        (ValueError) a row that would outgrow its block-table row."""
        longest = max((t.num_tokens + n for t, n in zip(tables, new_tokens, strict=True)), default=0)
        if longest > self.max_width:
            raise ValueError(f"a row would hold {longest} tokens, more than its block-table row's {self.max_width}")
        self.blocks.grow(rows, new_tokens)
        new = self.blocks.take_new_entries()
        if not new:
            return
        (rows_, cols), blocks = zip(*new.keys(), strict=True), array.array("i", new.values())
        # Through array.array, not torch.tensor: a prompt behind a cached prefix stages an entry a shared block.
        index = stage(host_int64(rows_ + cols), self.device).to(self.device, non_blocking=True).view(2, -1)
        values = stage(torch.frombuffer(blocks, dtype=torch.int32), self.device).to(self.device, non_blocking=True)
        self.block_table[index[0], index[1]] = values
        self.host_cells += len(blocks)

    def plan_varlen(self, rows, token_counts, sampled=None, *, input_ids=None, num_tokens: int | None = None,
                    all_logits=None) -> VarlenPlan:
        """Grow row i by token_counts[i] tokens (a prompt, a chunk of one, everything a row holds
        after a preemption, or a decode row's one token) and plan the flattened forward that writes
        them, [1, sum(token_counts)]. `sampled[i]` (default: every row) says whether row i's last
        token gives logits: a chunk that leaves part of its prompt for a later step is not sampled.
        `all_logits[i]` (default: none) makes every token of row i give logits, in order (a
        prompt's logprobs, or a verify step's drafts), its last token's among them whether sampled
        or not. A padded plan gives at most `max_rows` rows of logits (its `logits_index` buffer).

        `num_tokens` pads the plan to that many tokens (a capture size, at most the size
        `reserve_varlen` made room for) in the cache's fixed buffers, `input_ids` (host ints, one
        a token) included: see `VarlenPlan`. Such a plan is stale once the next padded one is built."""
        rows, counts = tuple(rows), [int(n) for n in token_counts]
        sampled = [True] * len(rows) if sampled is None else [bool(x) for x in sampled]
        if not rows or len(counts) != len(rows) or len(sampled) != len(rows) or min(counts) < 1:
            raise ValueError(f"a varlen step needs at least one row and at least one token a row, got {counts}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows {rows} name a row twice: a row's tokens are one segment")
        all_logits = [False] * len(rows) if all_logits is None else [bool(x) for x in all_logits]
        if len(all_logits) != len(rows):
            raise ValueError(f"all_logits takes one flag a row, got {len(all_logits)} for {len(rows)} rows")
        if num_tokens is not None:
            if not sum(counts) <= num_tokens <= self._varlen_capacity:  # 0 until `reserve_varlen`
                raise ValueError(f"num_tokens {num_tokens} must hold the step's {sum(counts)} tokens and fit the "
                                 f"{self._varlen_capacity} the varlen buffers were reserved for")
            if input_ids is None or len(input_ids) != sum(counts):
                raise ValueError(f"a padded plan takes the step's {sum(counts)} input ids")
            wanted = sum(n if every else due for n, due, every in zip(counts, sampled, all_logits, strict=True))
            if wanted > self.max_rows:
                raise ValueError(f"a padded plan gives at most {self.max_rows} rows of logits, this step asks "
                                 f"{wanted}")
        tables = [self.blocks.table(row) for row in rows]
        starts = [t.num_tokens for t in tables]
        self._grow(tables, rows, counts)
        slots, positions = self._varlen_slots(tables, starts, counts)
        loc = list(itertools.accumulate(counts, initial=0))
        logits_index = []
        for start, end, due, every in zip(loc[:-1], loc[1:], sampled, all_logits, strict=True):
            logits_index += range(start, end) if every else [end - 1] if due else []
        lens = tuple(t.num_tokens for t in tables)
        if num_tokens is not None:
            return self._padded_varlen(rows, counts, lens, loc, slots, positions, logits_index, input_ids, num_tokens)
        n = loc[-1]
        # Six copies from pageable memory, each a device tensor of its own (pinned staging did not
        # measure faster at every size).
        host = torch.cat([host_int64(rows), *slots, host_int64(loc), host_int64(lens), *positions,
                          host_int64(logits_index)])
        table_rows, write_slots_, loc_, lens_, positions_, logits_index_ = (
            part.to(self.device) for part in host.split([len(rows), n, len(loc), len(lens), n, len(logits_index)]))
        return VarlenPlan(
            table_rows=table_rows, write_slots=write_slots_, query_start_loc=loc_, context_lens=lens_,
            positions=positions_[None], logits_index=logits_index_, block_table=self.block_table,
            block_size=self.block_size, query_lens=tuple(counts), planned_lens=lens, rows=rows)

    def reserve_varlen(self, max_tokens: int) -> None:
        """Make the fixed buffers padded varlen plans live in, for steps of up to `max_tokens`
        tokens over up to every row: one int64 device buffer holding, in order, table_rows,
        query_start_loc, context_lens and logits_index ([max_rows], [max_rows + 1], [max_rows],
        [max_rows]), then write_slots, positions and input_ids ([max_tokens] each), so a step's
        inputs go up in one copy. On CUDA the copy leaves from one of `UPLOAD_SLOTS` pinned host
        buffers in turn, each reused only once the copy that last read it has run. Reserving again
        at the same size keeps the buffers (a graph captured on them still reads them); at another
        size it is refused."""
        if self._varlen_inputs is not None:
            if max_tokens != self._varlen_capacity:
                raise RuntimeError(f"the varlen buffers are reserved for {self._varlen_capacity} tokens; graphs may "
                                   f"read them, so they are not remade for {max_tokens}")
            return
        rows = self.max_rows
        self._varlen_capacity = max_tokens
        self._varlen_sizes = (rows, rows + 1, rows, rows, max_tokens, max_tokens, max_tokens)
        total = sum(self._varlen_sizes)
        self._varlen_inputs = torch.zeros(total, dtype=torch.int64, device=self.device)
        slots = UPLOAD_SLOTS if self.device.type == "cuda" else 1
        self._varlen_staging = [stage(torch.empty(total, dtype=torch.int64), self.device) for _ in range(slots)]
        self._varlen_done = [torch.cuda.Event() if self.device.type == "cuda" else None for _ in range(slots)]

    def _padded_varlen(self, rows, counts, lens, loc, slots, positions, logits_index, input_ids, num_tokens
                       ) -> VarlenPlan:
        """The padded plan of `plan_varlen`: every field of the fixed buffer written whole, real
        entries then padding, so nothing an earlier step left there is read."""
        segments, n = len(rows), loc[-1]
        size = self._varlen_capacity
        pad_segments, pad_tokens = self.max_rows - segments, size - n
        i = self._varlen_plans % len(self._varlen_staging)
        if self._varlen_done[i] is not None:
            self._varlen_done[i].synchronize()  # long past, unless the host is that many steps ahead
        host = self._varlen_staging[i]
        torch.cat([
            host_int64(list(rows) + [self.pad_row] * pad_segments),  # table_rows: the padding reads the sink row
            host_int64(loc + [n] * pad_segments),  # query_start_loc: empty segments where the real tokens end
            host_int64(list(lens) + [0] * pad_segments),  # context_lens
            host_int64(logits_index + [0] * (self.max_rows - len(logits_index))),  # logits_index
            *slots, torch.full((pad_tokens,), SINK, dtype=torch.int64),  # write_slots: padding writes the sink
            *positions, torch.zeros(pad_tokens, dtype=torch.int64),  # positions
            host_int64(list(input_ids) + [0] * pad_tokens),  # input_ids
        ], out=host)
        self._varlen_inputs.copy_(host, non_blocking=True)
        if self._varlen_done[i] is not None:
            self._varlen_done[i].record()
        self._varlen_plans += 1
        table_rows, loc_, lens_, logits_index_, write_slots, positions_, ids = self._varlen_inputs.split(
            self._varlen_sizes)
        return VarlenPlan(
            table_rows=table_rows, write_slots=write_slots[:num_tokens], query_start_loc=loc_, context_lens=lens_,
            positions=positions_[:num_tokens][None], logits_index=logits_index_, block_table=self.block_table,
            block_size=self.block_size, query_lens=tuple(counts), planned_lens=lens, rows=rows,
            # [1, num_tokens] views whose strides are a contiguous tensor's, so that a compiled step
            # (whose token count is symbolic) has no stride of the buffer's to guard on
            input_ids=ids[:num_tokens][None], padded=True, epoch=self._varlen_plans)

    def plan_varlen_padding(self, num_tokens: int) -> VarlenPlan:
        """A padded plan of `num_tokens` tokens and no real segment, touching no row: what a
        varlen graph is captured on. Every token writes the sink."""
        if not 1 <= num_tokens <= self._varlen_capacity:
            raise ValueError(f"num_tokens {num_tokens} must be in 1..{self._varlen_capacity}, the size the varlen "
                             "buffers were reserved for")
        return self._padded_varlen((), [], (), [0], [], [], [], [], num_tokens)

    def require_current_varlen(self, plan: VarlenPlan) -> None:
        """Refuse a padded plan that a newer one has replaced: the buffers now hold the newer plan."""
        if plan.padded and plan.epoch != self._varlen_plans:
            raise RuntimeError(f"stale padded VarlenPlan: built as plan {plan.epoch}, but plan {self._varlen_plans} "
                               "exists")

    def _varlen_slots(self, tables, starts, counts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pool slot and the position of every token of a varlen step, segment after segment,
        as host int64 pieces to concatenate: a segment longer than a block (a prompt's chunk) in
        tensor ops over its blocks, the short ones (decode rows) as ints, gathered between them."""
        bs = self.block_size
        slots, positions, short_slots, short_positions = [], [], [], []

        def gather_short() -> None:
            if short_slots:
                slots.append(host_int64(short_slots))
                positions.append(host_int64(short_positions))
                short_slots.clear()
                short_positions.clear()

        for t, a, n in zip(tables, starts, counts, strict=True):
            if n <= bs:
                short_slots.extend(t.slot(p) for p in range(a, a + n))
                short_positions.extend(range(a, a + n))
                continue
            gather_short()
            first = a // bs  # the segment's slots are its blocks' slots, from a's offset in the first
            blocks = host_int64(t.blocks[first:(a + n - 1) // bs + 1])  # [blocks]
            every = (blocks[:, None] * bs + torch.arange(bs)).view(-1)  # [blocks * bs]
            slots.append(every[a - first * bs: a - first * bs + n])
            positions.append(torch.arange(a, a + n))
        gather_short()
        return slots, positions

    def plan_decode(self, rows, *, batch_size: int | None = None, width: int | None = None,
                    query_lens=None) -> DecodePlan:
        """Grow every row's table by this step's token and return where everything goes.

        Positions are read before the tables grow: a new token's position is the number of tokens
        before it. `batch_size` pads the batch up to a capture bucket: the extra rows point at the
        all-sink table row, write to the sink and read one sink slot. `width` is the read
        rectangle's width, at least the longest row (default: exactly the longest row).

        `query_lens[i]` (default 1) feeds row i that many tokens (a verify step's pending token and
        drafts): each is a batch row of the plan, in order, over the same table row, writing its own
        slot and reading the row's keys up to its own position, as a one-token decode row would.
        The forward writes every row's K/V before it reads, so a later token sees the earlier ones.

        The host writes four scalars per row into `step_inputs` and one block-table entry for each
        row that crossed into a new block. The plan's tensors are views of those fixed buffers, so
        a plan is stale the moment the next one is built; `view` and `check_plan_current` refuse it.
        """
        rows = tuple(rows)
        tables = [self.blocks.table(row) for row in rows]
        empty = [row for row, t in zip(rows, tables, strict=True) if t.num_tokens == 0]
        if empty:
            raise ValueError(f"decode over empty rows {empty}: a row needs its prompt before it can decode")
        counts = [1] * len(rows) if query_lens is None else [int(n) for n in query_lens]
        if len(counts) != len(rows) or min(counts, default=1) < 1:
            raise ValueError(f"query_lens must give each of the {len(rows)} rows at least one token, got {query_lens}")
        real = sum(counts)  # batch rows: one a fed token
        batch = real if batch_size is None else batch_size
        if not real <= batch <= self.max_rows:
            raise ValueError(f"batch_size {batch} must hold the {real} fed tokens and fit the {self.max_rows} "
                             "rows of the cache")
        longest = max((t.num_tokens + n for t, n in zip(tables, counts, strict=True)), default=0)
        width = max(longest, 1) if width is None else width
        if not longest <= width <= self.max_width:
            raise ValueError(f"width {width} must hold the longest row ({longest} tokens with this step's) "
                             f"and fit the block table ({self.max_width} tokens a row)")
        # A batch row per fed token: its cache row and its position (tokens before it).
        token_rows = [row for row, n in zip(rows, counts, strict=True) for _ in range(n)]
        positions = [t.num_tokens + j for t, n in zip(tables, counts, strict=True) for j in range(n)]
        slot_tables = [t for t, n in zip(tables, counts, strict=True) for _ in range(n)]
        self._grow(tables, rows, counts)
        pad = batch - real
        step = torch.tensor([
            token_rows + [self.pad_row] * pad,  # table row of each batch row
            [t.slot(p) for t, p in zip(slot_tables, positions, strict=True)] + [SINK] * pad,  # write slot
            [p + 1 for p in positions] + [1] * pad,  # context length, this token included
            positions + [0] * pad,  # position of the new token
        ], dtype=torch.int64)
        views = {name: buffer[:batch] for name, buffer in self.step_inputs.items()}
        self._upload(step, [view.view(-1) for view in views.values()])
        self._plans += 1
        return DecodePlan(**views, block_table=self.block_table, block_size=self.block_size, width=width,
                          planned_lens=tuple(p + 1 for p in positions), rows=tuple(token_rows), epoch=self._plans)

    def shift_decode_plan(self, plan: DecodePlan, src: torch.Tensor, head: torch.Tensor, shift: torch.Tensor,
                          last: torch.Tensor, ids: torch.Tensor) -> None:
        """Move the newest decode plan's fed tokens back by what the step before it, still on the
        device, left unkept, and give each row its first token from that step. Token i of the plan
        continues row src[i] of the step before (src and head [real tokens] int64 on the device;
        head[i] 1 for a row's first token): its position and context length change by shift[src[i]]
        (shift [rows of the step before] int64 on the device, each at most 0), its write slot is read again from
        the block table at its new position, and a first token becomes last[src[i]] in `ids`
        ([tokens or more] int64 on the device, changed in place). Device ops queued after the plan's
        upload and before its forward, nothing read back: how a verify step is planned before the
        one ahead of it is read back (`Engine`'s chained speculation), its tables grown as if every
        draft ahead were kept, so that its new positions lie in blocks it holds. One Triton kernel
        with the streamed read (`kernels.chain.shift_step`), torch ops with the reference read."""
        self.require_current(plan)
        n = src.numel()
        positions, lens, rows, slots = (plan.positions.view(-1)[:n], plan.context_lens[:n], plan.table_rows[:n],
                                        plan.write_slots[:n])
        if self.read == "streamed":
            shift_step(src, head, shift, last, positions, lens, rows, slots, ids, self.block_table, self.block_size)
            return
        step = shift[src]  # [tokens]
        positions += step
        lens += step
        slots.copy_(self.block_table[rows, positions // self.block_size].long() * self.block_size
                    + positions % self.block_size)
        ids[:n].copy_(torch.where(head != 0, last[src], ids[:n]))

    def _upload(self, step: torch.Tensor, dsts: list[torch.Tensor]) -> None:
        """step [4, batch] int64 on the host -> the four device views `dsts`. On CUDA one kernel
        reads it from the next of `UPLOAD_SLOTS` pinned slots (`upload_step_inputs`), once the
        kernel that read that slot before has run; elsewhere, four copies."""
        if self.device.type != "cuda":
            for dst, values in zip(dsts, step, strict=True):
                dst.copy_(values)
            return
        i = self._plans % UPLOAD_SLOTS
        done = self._upload_done[i]
        done.synchronize()  # long past, unless the host is UPLOAD_SLOTS plans ahead of the GPU
        src = self._upload_slots[i][: step.numel()].view_as(step)
        src.copy_(step)
        upload_step_inputs(src, dsts, validated=True)  # the cache's own slots and buffers
        done.record()

    def require_current(self, plan: DecodePlan) -> None:
        """Refuse a decode plan that a newer one has replaced: its buffers now hold the newer plan."""
        if plan.epoch != self.plan_epoch:
            raise RuntimeError(f"stale DecodePlan: built as plan {plan.epoch}, but plan {self.plan_epoch} exists; "
                               "its slots have been handed out again")

    def view(self, plan: DecodePlan | VarlenPlan) -> CacheView:
        """The cache as the forward of `plan` sees it. A decode plan must be the newest.

        For the reference decode read the view derives the step's slot mapping [rows, width] and
        mask [rows, 1, width] here, once for every layer, on the device: a CUDA graph that captures
        the view with the forward replays the derivation too. The streamed reads walk the block
        table themselves and need neither; the varlen reference read takes each segment's slots from
        the block table as it goes."""
        if isinstance(plan, VarlenPlan):
            self.require_current_varlen(plan)
            return CacheView(self, plan, self._varlen_reader)
        self.require_current(plan)
        if self._decode_reader is _streamed:
            return CacheView(self, plan, _streamed)
        mask = attention_mask_bias(plan.context_lens, plan.positions, plan.width, self.dtype)
        return CacheView(self, plan, _reference, plan.slot_mapping, mask)


def _streamed(view: CacheView, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    plan, kv = view.plan, view.cache
    if torch.compiler.is_compiling():  # one opaque node for dynamo; eagerly, no dispatcher hop
        return paged_attention_op(q, kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                                  plan.context_lens, positions, plan.block_size)
    return paged_attention(q, kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                           plan.block_size, plan.context_lens, positions)


def _varlen_streamed(view: CacheView, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    plan, kv = view.plan, view.cache
    if torch.compiler.is_compiling():  # one opaque node, with no host value of the plan's to guard on
        return varlen_attention_op(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                                   plan.query_start_loc, plan.context_lens, positions[0], plan.block_size,
                                   num_sms=kv.num_sms)[None]
    kv_heads = kv.k_pools[layer].shape[1]
    # A short step over a long context cuts each walk into shares. A padded (captured) step's split
    # count is its size's: the graph holds it for whatever lengths it replays.
    group = q.shape[2] // kv_heads
    splits = (captured_splits(plan.num_tokens, kv_heads, group, kv.num_sms) if plan.padded else
              choose_varlen_splits(plan.num_tokens, len(plan.query_lens), kv_heads, group, kv.num_sms,
                                   max_context=max(plan.planned_lens)))
    # A padded step's flat grid is cut for the most tiles its size could fill; where its walks are
    # shared out, a fixed grid of persistent programs loops over the tiles it does fill instead.
    return varlen_attention(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                            plan.block_size, plan.query_start_loc, plan.context_lens, positions[0],
                            plan.max_query_len, grid_tokens=plan.num_tokens if plan.padded else None,
                            splits=splits,
                            programs=captured_programs(kv_heads, splits, kv.num_sms) if plan.padded else None)[None]


def _varlen_reference(view: CacheView, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    plan, kv = view.plan, view.cache
    return varlen_reference(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                            plan.block_size, plan.query_start_loc, plan.context_lens, positions[0],
                            host=(plan.host_query_start_loc, list(plan.planned_lens)))[None]


def _reference(view: CacheView, layer: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    kv = view.cache
    return reference_read(q, kv.k_pools[layer], kv.v_pools[layer], view.slot_mapping, view.plan.context_lens,
                          positions, validated=True, mask_bias=view.mask_bias)


@dataclass(slots=True)
class CacheView:
    """What one forward's attention layers see of the cache: where to write this forward's K/V and
    how to read. The model carries it and never names the cache's internals."""

    cache: KVCache
    plan: DecodePlan | VarlenPlan
    reader: Callable[..., torch.Tensor]
    slot_mapping: torch.Tensor | None = None  # [rows, width] int64, the reference decode read's, once per step
    mask_bias: torch.Tensor | None = None  # [rows, 1, width], the reference decode read's mask, once per step

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [rows, T, kv_heads, head_dim] into the plan's write slots, one index_put each: a
        decode plan's [batch] (T = 1), a varlen plan's [num_tokens] (rows = 1)."""
        slots = self.plan.write_slots.reshape(-1)  # [rows * T]; padding names the sink
        self.cache.k_pools[layer][slots] = k.reshape(-1, *k.shape[2:])
        self.cache.v_pools[layer][slots] = v.reshape(-1, *v.shape[2:])

    def write_rotated(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int) -> torch.Tensor:
        """qkv [rows, T, heads + 2 kv_heads, head_dim], cos and sin [rows, T, 1, head_dim]: q and k
        rotated, k and v written to the plan's write slots, in one kernel (`rope_write`) -> q
        [rows, T, heads, head_dim]. Eagerly, k is rotated in place in qkv too, so qkv's K/V heads
        are this forward's K/V as written; compiling, one operator inductor does not trace, which
        leaves qkv as it was."""
        rows, t, total, d = qkv.shape
        args = (qkv.view(rows * t, total, d), cos.reshape(rows * t, d), sin.reshape(rows * t, d),
                self.cache.k_pools[layer], self.cache.v_pools[layer], self.plan.write_slots.reshape(-1), heads)
        if torch.compiler.is_compiling():
            return rope_write_op(*args).view(rows, t, heads, d)
        return rope_write(*args, k_in_place=True).view(rows, t, heads, d)

    def read(self, layer: int, q: torch.Tensor, positions: torch.Tensor, k: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [rows, T, heads, head_dim] over layer `layer` -> [rows, T, heads, head_dim].
        k, v [rows, T, kv_heads, head_dim], this forward's own K/V as written, let a streamed
        varlen step of whole prompts skip the pools: each prompt attends over its own keys alone,
        through torch's fused attention (`prompt_attention`)."""
        plan = self.plan
        # Never in a compiled step: whole prompts run eagerly (`ModelRunner.run_varlen`), and asking
        # would guard the graph on every segment's length.
        if (k is not None and self.cache.read == "streamed" and isinstance(plan, VarlenPlan)
                and not torch.compiler.is_compiling() and plan.whole_prompts):
            return prompt_attention(q[0], k[0], v[0], plan.query_lens)[None]
        return self.reader(self, layer, q, positions)
