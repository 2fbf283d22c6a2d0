"""`argmax`: greedy decoding's pick over the vocabulary, in two passes.

torch's argmax reduces one row in one block of threads, so a single row of a large vocabulary
takes longer than a layer's projections. Here a first pass splits each row into
`BLOCK`-wide chunks, one program each, and a second picks the best chunk per row. Ties go to the
lowest index, as torch's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _chunk_max(x_ptr, val_ptr, idx_ptr, N, stride_x, CHUNKS, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    i = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + i, mask=i < N, other=float("-inf"))
    best = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(val_ptr + r * CHUNKS + c, tl.max(x, axis=0))
    tl.store(idx_ptr + r * CHUNKS + c, c * BLOCK + best)


@triton.jit
def _pick(val_ptr, idx_ptr, out_ptr, CHUNKS, C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, C)
    v = tl.load(val_ptr + r * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    best = tl.argmax(v, axis=0, tie_break_left=True)
    tl.store(out_ptr + r, tl.load(idx_ptr + r * CHUNKS + best).to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] fp32 -> [rows] int64, the first index of each row's maximum. A row
    holding a NaN has no defined answer here (torch.argmax returns the NaN's index)."""
    rows, n = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(n, BLOCK)
    val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_max[(rows, chunks)](logits, val, idx, n, logits.stride(0), chunks, BLOCK=BLOCK, num_warps=8)
    _pick[(rows,)](val, idx, out, chunks, C=triton.next_power_of_2(chunks))
    return out
