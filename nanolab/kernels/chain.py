"""Chained speculation's device work around a verify step, one kernel each: `accept_drafts` reads a
step's greedy choices against the drafts it fed, and `shift_step` moves the next step, planned as
if every draft were kept, back to where the kept ones end.

A verify step feeds row r its tokens loc[r] .. loc[r + 1] - 1: its pending token, then its drafts.
The target's greedy choice after fed token j is best[j]. Draft j + 1 is kept while it equals
best[j]; the row then adds best at its first mismatch (or after its last draft). That is
`spec_decode.greedy_accept`, per row, with nothing read back: the next step takes each row's last
token and how far to move back from these kernels' outputs, on the device. Their torch
counterparts, the engine's on the reference read, are `engine.llm_engine.accept_on_device` and
`KVCache.shift_decode_plan`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # tokens a program of `shift_step`

# Neither kernel is specialized on its row or token count, nor on where its vectors start: both
# change from step to step (the row starts and the previous step's rows are slices of one upload
# at offsets that follow the batch), and a specialization Triton has not built yet compiles in the
# middle of a request.
# (An int's multiple of 16 counts as its alignment.)
_ACCEPT_UNALIGNED = ("best_ptr", "ids_ptr", "loc_ptr", "result_ptr", "shift_ptr", "rows")
_SHIFT_UNALIGNED = ("src_ptr", "head_ptr", "shift_ptr", "last_ptr", "pos_ptr", "lens_ptr", "rows_ptr", "slots_ptr",
                   "ids_ptr", "table_ptr", "tokens")


@triton.jit(do_not_specialize=["rows"], do_not_specialize_on_alignment=_ACCEPT_UNALIGNED)
def _accept(best_ptr, ids_ptr, loc_ptr, result_ptr, shift_ptr, rows, MAX_FED: tl.constexpr):
    r = tl.program_id(0)
    start = tl.load(loc_ptr + r)
    drafts = tl.load(loc_ptr + r + 1) - start - 1
    j = tl.arange(0, MAX_FED)
    live = j < drafts
    choice = tl.load(best_ptr + start + j, mask=live, other=-1)
    draft = tl.load(ids_ptr + start + j + 1, mask=live, other=-2)
    # The first j where draft j + 1 is not greedy's choice, or past the last draft: drafts kept.
    kept = tl.min(tl.where((choice != draft) | (j >= drafts), j, MAX_FED), axis=0)
    tl.store(result_ptr + r, kept)
    tl.store(result_ptr + rows + r, tl.load(best_ptr + start + kept))
    tl.store(shift_ptr + r, kept - drafts)


def accept_drafts(best: torch.Tensor, ids: torch.Tensor, loc: torch.Tensor, max_fed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """best and ids [tokens] int64 (greedy's choice after each fed token, and the fed tokens), loc
    [rows + 1] int64 (row r fed tokens loc[r] .. loc[r + 1] - 1, at most `max_fed` of them), all
    on one device -> (result [2, rows] int64: the drafts each row kept, then the token it adds;
    shift [rows] int64: kept drafts minus fed ones). Triton builds the kernel once per power of
    two of `max_fed`."""
    rows = loc.numel() - 1
    result = torch.empty((2, rows), dtype=torch.int64, device=best.device)
    shift = torch.empty(rows, dtype=torch.int64, device=best.device)
    _accept[(rows,)](best, ids, loc, result, shift, rows, MAX_FED=triton.next_power_of_2(max(max_fed, 2)))
    return result, shift


@triton.jit(do_not_specialize=["tokens"], do_not_specialize_on_alignment=_SHIFT_UNALIGNED)
def _shift(src_ptr, head_ptr, shift_ptr, last_ptr, pos_ptr, lens_ptr, rows_ptr, slots_ptr, ids_ptr, table_ptr,
           tokens, stride_table, block_size, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < tokens
    src = tl.load(src_ptr + i, mask=mask, other=0)
    head = tl.load(head_ptr + i, mask=mask, other=0)
    step = tl.load(shift_ptr + src, mask=mask, other=0)
    pos = tl.load(pos_ptr + i, mask=mask, other=0) + step
    tl.store(pos_ptr + i, pos, mask=mask)
    tl.store(lens_ptr + i, tl.load(lens_ptr + i, mask=mask, other=0) + step, mask=mask)
    row = tl.load(rows_ptr + i, mask=mask, other=0)
    block = tl.load(table_ptr + row * stride_table + pos // block_size, mask=mask, other=0).to(tl.int64)
    tl.store(slots_ptr + i, block * block_size + pos % block_size, mask=mask)
    tl.store(ids_ptr + i, tl.load(last_ptr + src, mask=mask & (head != 0), other=0), mask=mask & (head != 0))


def shift_step(src: torch.Tensor, head: torch.Tensor, shift: torch.Tensor, last: torch.Tensor,
               positions: torch.Tensor, context_lens: torch.Tensor, table_rows: torch.Tensor,
               write_slots: torch.Tensor, ids: torch.Tensor, block_table: torch.Tensor, block_size: int) -> None:
    """For each of a planned step's first src.numel() tokens (src and head [tokens] int64: the
    row of the step before that the token's row continues, and 1 for a row's first token): move
    its position and context length by shift[src], read its write slot again from `block_table`
    at the new position, and give a first token the row's last token, last[src]. positions,
    context_lens, table_rows, write_slots and ids are [tokens or more] int64, contiguous, changed
    in place; block_table [rows, blocks] int32. All on one device."""
    tokens = src.numel()
    _shift[(triton.cdiv(tokens, BLOCK),)](src, head, shift, last, positions, context_lens, table_rows, write_slots,
                                          ids, block_table, tokens, block_table.stride(0), block_size, BLOCK=BLOCK)
