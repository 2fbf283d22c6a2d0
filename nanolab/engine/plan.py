"""Where a forward's K/V goes and what it reads, decided on the host before it runs.

`DecodePlan` and `VarlenPlan` (chunked prefill). The forward only reads their
tensors: nothing inside it grows a table or reads a length that changes from step to step. The
read rectangle `slot_mapping` [rows, width] (vLLM's name; `write_slots` is the per-token half
vLLM's `reshape_and_cache` takes) is derived on the device from the persistent block table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from nanolab.gates import Gate


def derive_slot_mapping(block_table: torch.Tensor, table_rows: torch.Tensor, context_lens: torch.Tensor,
                        width: int, block_size: int) -> torch.Tensor:
    """The read rectangle [batch, width] int64 from the device block table, -1 (the sink) past
    each row's length. block_table [max_rows + 1, max_blocks] int32, table_rows and context_lens
    [batch] int64. Device ops only: nothing here reads a value back to the host."""
    p = torch.arange(width, device=block_table.device)
    blocks = block_table[table_rows[:, None], (p // block_size)[None, :]].long()  # [batch, width]
    slots = blocks * block_size + p % block_size
    return torch.where((p < context_lens[:, None]) & (blocks >= 0), slots, -1)


def mapping_bytes(rows: int, width: int, itemsize: int = 8) -> int:
    """Bytes of a [rows, width] slot mapping (int64 by default)."""
    return rows * width * itemsize


@dataclass(frozen=True)
class VarlenPlan:
    """One forward over every token of a step that is not decode-only, laid end to end with no
    padding: input_ids and positions [1, num_tokens], and one segment per sequence, its new tokens
    (a whole prompt, a chunk of one, or a decode row's single token). Chunked prefill.

    vLLM's attention metadata for the same batch: `query_start_loc` is its name (flash-attn's
    cu_seqlens_q), `context_lens` its `seq_lens`, `write_slots` its `slot_mapping`.

    A padded plan (`padded`, for a captured step) is laid out for a token count and not for its
    segments: its tensors are views of the cache's fixed varlen buffers, every token past the real
    ones writes the sink at position 0, and every one of the cache's rows is a segment, those past
    the real ones empty (starting where the real tokens end) over the all-sink table row. It also
    carries the step's input ids [1, num_tokens], from the same upload."""

    table_rows: torch.Tensor  # [segments] int64: each segment's block-table row
    write_slots: torch.Tensor  # [num_tokens] int64: pool slot of each new token
    query_start_loc: torch.Tensor  # [segments + 1] int64: segment s is tokens query_start_loc[s] .. [s + 1] - 1
    context_lens: torch.Tensor  # [segments] int64: tokens each row holds after this forward
    positions: torch.Tensor  # [1, num_tokens] int64: a chunk's positions continue from the tokens before it
    logits_index: torch.Tensor  # [sampled] int64: the last token of each segment sampled this step
    block_table: torch.Tensor  # [max_rows + 1, max_blocks] int32: the cache's persistent table, whole
    # Host only: nothing inside the forward may read these from the device.
    block_size: int
    query_lens: tuple[int, ...]  # tokens of each segment
    planned_lens: tuple[int, ...]  # context length of each row after this forward
    rows: tuple[int, ...]  # the cache rows, in segment order
    input_ids: torch.Tensor | None = None  # [1, num_tokens] int64, a padded plan's
    padded: bool = False
    epoch: int = 0  # a padded plan: the cache's varlen plan count when built (its buffers hold the newest)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward runs: the real ones and, in a padded plan, the padding after them."""
        return self.write_slots.shape[0]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)  # 0: a padded plan of padding alone (a capture's)

    @property
    def whole_prompts(self) -> bool:
        """Whether every segment is a prompt from position 0: no row held a token before this
        forward. A padded plan never counts as one: its read must not depend on its segments."""
        return self.planned_lens == self.query_lens and not self.padded

    @property
    def host_query_start_loc(self) -> list[int]:
        return list(itertools.accumulate(self.query_lens, initial=0))


@dataclass(frozen=True)
class DecodePlan:
    """One decode step: a new token for each batch row, and rows padded up to a capture bucket. A
    verify step is one too: a cache row that feeds several tokens is a batch row a token, each
    reading the row's keys up to its own position (`KVCache.plan_decode`'s `query_lens`)."""

    # Views of the cache's fixed buffers: the same addresses every step.
    table_rows: torch.Tensor  # [batch] int64: each batch row's block-table row; padded rows the all-sink one
    write_slots: torch.Tensor  # [batch] int64: the pool slot this step's K/V goes to; -1 (the sink) when padded
    context_lens: torch.Tensor  # [batch] int64: tokens per row, this step's included; 1 when padded
    positions: torch.Tensor  # [batch, 1] int64: the new token's position, read before the tables grew
    block_table: torch.Tensor  # [max_rows + 1, max_blocks] int32: the cache's persistent table, whole
    # Host only: nothing inside the forward may read these.
    block_size: int
    width: int  # the read rectangle's width: the longest row, or the capture bucket's width
    planned_lens: tuple[int, ...]  # context length of each real batch row when planned
    rows: tuple[int, ...]  # the cache row of each real batch row, in batch order; padding rows follow them
    epoch: int  # the cache's plan count when this one was built; a newer plan makes it stale

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[batch, width] int64, derived on the device each time it is read; `KVCache.view` derives
        it once per step for every layer."""
        return derive_slot_mapping(self.block_table, self.table_rows, self.context_lens, self.width, self.block_size)

    @property
    def min_ctx(self) -> int:
        return min(self.planned_lens)

    @property
    def max_ctx(self) -> int:
        return max(self.planned_lens)

    @property
    def batch_size(self) -> int:
        """Rows the forward runs: the real ones and any padding up to a bucket."""
        return self.write_slots.shape[0]

    @property
    def padding_rows(self) -> int:
        return self.batch_size - len(self.rows)

    @property
    def cells(self) -> int:
        return self.batch_size * self.width

    @property
    def real_cells(self) -> int:
        return sum(self.planned_lens)

    @property
    def padding_cells(self) -> int:
        return self.cells - self.real_cells

    @property
    def padding_share(self) -> float:
        return self.padding_cells / self.cells

    @property
    def mapping_bytes(self) -> int:
        """Bytes of the int64 read rectangle the forward derives."""
        return mapping_bytes(self.batch_size, self.width)

    def render(self, max_width: int = 24) -> str:
        """The plan as text: one line per row, its write slot, and its mapping ('.' for padding)."""
        lines = [f"DecodePlan: {self.batch_size} rows x {self.width} wide, {self.padding_cells} of {self.cells} "
                 f"cells padding ({self.padding_share:.0%}), {self.mapping_bytes} B of mapping"]
        mapping, lens = self.slot_mapping.cpu(), self.planned_lens
        for i, row in enumerate(self.rows):
            cells = [str(int(mapping[i, p])) if p < lens[i] else "." for p in range(min(self.width, max_width))]
            more = " ..." if self.width > max_width else ""
            lines.append(f"  row {row}: pos {int(self.positions[i, 0])} -> slot {int(self.write_slots[i])} | "
                         + " ".join(cells) + more)
        return "\n".join(lines)


# Gates.

def check_plan_addressing(cache, plan: DecodePlan) -> Gate:
    """Every write slot and every real mapping cell names the slot the tables give."""
    mapping, slots, lens = plan.slot_mapping.cpu(), plan.write_slots.cpu(), plan.context_lens.cpu()
    wrong = 0
    for i, row in enumerate(plan.rows):
        table = cache.blocks.table(row)
        wrong += int(slots[i]) != table.slot(int(lens[i]) - 1)
        wrong += sum(int(mapping[i, p]) != table.slot(p) for p in range(int(lens[i])))
        wrong += int((mapping[i, int(lens[i]):] != -1).sum())  # past its length, a row names only the sink
    # A padded row writes to the sink and reads the sink alone: never a live row's slot.
    wrong += int((slots[len(plan.rows):] != -1).sum()) + int((mapping[len(plan.rows):] != -1).sum())
    return Gate("check_plan_addressing", wrong == 0, {"cells_checked": plan.cells + plan.batch_size,
                                                      "wrong": wrong})


def check_plan_rows(plan: DecodePlan, rows) -> Gate:
    """The plan covers exactly these rows, in this order, and every tensor has one entry per row."""
    rows = tuple(rows)
    sizes = {plan.table_rows.shape[0], plan.write_slots.shape[0], plan.context_lens.shape[0],
             plan.positions.shape[0]}
    ok = plan.rows == rows and len(sizes) == 1 and min(sizes) >= len(rows)
    return Gate("check_plan_rows", ok, {"plan_rows": len(plan.rows), "batch_rows": len(rows),
                                        "tensor_rows": sorted(sizes)})


def check_plan_current(cache, plan: DecodePlan) -> Gate:
    """A plan is current while it is the newest the cache built (its epoch) and the tables still
    hold exactly the lengths it planned. Planning again fills the same buffers with other write
    slots, so an older plan would write over the newer one's."""
    planned = {}  # each cache row's length after the plan (its last batch row's): host copies, since
    for row, n in zip(plan.rows, plan.planned_lens, strict=True):  # the device buffers hold the newest plan
        planned[row] = max(n, planned.get(row, 0))
    actual = [cache.blocks.table(row).num_tokens for row in planned]
    stale = sum(p != a for p, a in zip(planned.values(), actual, strict=True))
    return Gate("check_plan_current", stale == 0 and plan.epoch == cache.plan_epoch,
                {"rows": len(actual), "stale_rows": stale, "epoch": plan.epoch, "newest": cache.plan_epoch})
