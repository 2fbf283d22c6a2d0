"""The decode step's addressing, decided on the host before the forward runs: `DecodePlan`.

Introduced on Day 50. Before it, the forward decided where a decode step's K/V went while it
ran: layer 0's `write` grew the block tables and the read rebuilt its rectangle from them, so a
traced forward observed `tables[row].num_tokens`, a Python int that grows every step, and
rebuilt on every step. A plan is built by `plan_decode` (the cache's `plan_decode` is where the
tables grow), and the forward only reads its tensors. Nothing inside the forward reads
`min_ctx` or `max_ctx`: they are host ints that change every step.

`slot_mapping` is what vLLM also calls the slot mapping; its write half, `write_slots`, is the
per-token slot list vLLM's `reshape_and_cache` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanolab.gates import Gate


@dataclass(frozen=True)
class DecodePlan:
    write_slots: torch.Tensor  # [rows] int64: the pool slot this step's K/V goes to
    slot_mapping: torch.Tensor  # [rows, max_ctx] int64: the read rectangle, padding slot 0
    context_lens: torch.Tensor  # [rows] int64: tokens per row, this step's included
    positions: torch.Tensor  # [rows, 1] int64: the new token's position, read before the tables grew
    min_ctx: int  # host only
    max_ctx: int  # host only
    rows: tuple[int, ...]  # the cache rows, in batch order (host only)
    epoch: int  # the cache's plan count when this one was built; a newer plan makes it stale

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return self.max_ctx

    @property
    def cells(self) -> int:
        return self.batch_size * self.width

    @property
    def real_cells(self) -> int:
        return int(self.context_lens.sum())

    @property
    def padding_cells(self) -> int:
        return self.cells - self.real_cells

    @property
    def padding_share(self) -> float:
        return self.padding_cells / self.cells

    @property
    def mapping_bytes(self) -> int:
        return self.slot_mapping.numel() * self.slot_mapping.element_size()

    def render(self, max_width: int = 24) -> str:
        """The plan as text: one line per row, its write slot, and its mapping ('.' for padding)."""
        lines = [f"DecodePlan: {self.batch_size} rows x {self.width} wide, {self.padding_cells} of {self.cells} "
                 f"cells padding ({self.padding_share:.0%}), {self.mapping_bytes} B of mapping"]
        mapping, lens = self.slot_mapping.cpu(), self.context_lens.cpu()
        for i, row in enumerate(self.rows):
            cells = [str(int(mapping[i, p])) if p < lens[i] else "." for p in range(min(self.width, max_width))]
            more = " ..." if self.width > max_width else ""
            lines.append(f"  row {row}: pos {int(self.positions[i, 0])} -> slot {int(self.write_slots[i])} | "
                         + " ".join(cells) + more)
        return "\n".join(lines)


def plan_decode(cache, rows, device=None) -> DecodePlan:
    """Plan one decode step over `rows` of `cache`: grows each row's table by one token."""
    return cache.plan_decode(rows, device)


# The price of a rectangle rebuilt every step (host arithmetic, no tensors).

def mapping_cells(rows: int, width: int) -> int:
    return rows * width


def mapping_bytes(rows: int, width: int, itemsize: int = 8) -> int:
    return mapping_cells(rows, width) * itemsize


def rebuild_cells(rows: int, prompt_len: int, steps: int) -> int:
    """Cells of the [rows, max_ctx] mapping rebuilt over `steps` decode steps from a prompt of
    `prompt_len`: step i is rows * (prompt_len + i) wide, so the sum is quadratic in steps."""
    return rows * (steps * prompt_len + steps * (steps + 1) // 2)


def appended_cells(rows: int, steps: int) -> int:
    """Cells that actually change: one new token per row per step."""
    return rows * steps


def rebuild_ratio(rows: int, prompt_len: int, steps: int) -> float:
    return rebuild_cells(rows, prompt_len, steps) / appended_cells(rows, steps)


# Gates.

def check_plan_addressing(cache, plan: DecodePlan) -> Gate:
    """Every write slot and every real mapping cell names the slot the tables give."""
    mapping, slots, lens = plan.slot_mapping.cpu(), plan.write_slots.cpu(), plan.context_lens.cpu()
    wrong = 0
    for i, row in enumerate(plan.rows):
        table = cache.table(row)
        wrong += int(slots[i]) != table.slot(int(lens[i]) - 1)
        wrong += sum(int(mapping[i, p]) != table.slot(p) for p in range(int(lens[i])))
    return Gate("check_plan_addressing", wrong == 0, {"cells_checked": plan.real_cells + plan.batch_size,
                                                      "wrong": wrong})


def check_plan_rows(plan: DecodePlan, rows) -> Gate:
    """The plan covers exactly these rows, in this order, and every tensor has one entry per row."""
    rows = tuple(rows)
    sizes = {plan.write_slots.shape[0], plan.slot_mapping.shape[0], plan.context_lens.shape[0],
             plan.positions.shape[0]}
    ok = plan.rows == rows and sizes == {len(rows)}
    return Gate("check_plan_rows", ok, {"plan_rows": len(plan.rows), "batch_rows": len(rows),
                                        "tensor_rows": sorted(sizes)})


def check_plan_current(cache, plan: DecodePlan) -> Gate:
    """A plan is current while the tables still hold exactly the lengths it planned; planning
    again grows them, and the older plan would write over the newer one's slots."""
    planned = plan.context_lens.cpu().tolist()
    actual = [cache.table(row).num_tokens for row in plan.rows]
    stale = sum(p != a for p, a in zip(planned, actual, strict=True))
    return Gate("check_plan_current", stale == 0, {"rows": len(actual), "stale_rows": stale})


def check_rebuild_bounded(rows: int, prompt_len: int, steps: int, limit: float = 32.0) -> Gate:
    """Cells rebuilt per cell appended stays under `limit` over a run of `steps`."""
    ratio = rebuild_ratio(rows, prompt_len, steps)
    return Gate("check_rebuild_bounded", ratio <= limit, {
        "rebuild_cells": rebuild_cells(rows, prompt_len, steps), "appended_cells": appended_cells(rows, steps),
        "ratio": round(ratio, 2), "limit": limit})
