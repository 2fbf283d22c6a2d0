"""`scatter_step_inputs`: a decode plan's per-row values, from one host buffer into the device
buffers the step reads, in one kernel. Day 61.

A decode plan hands the forward four [batch] int64 vectors (table row, write slot, context length,
position), each in a buffer of its own (`KVCache.step_inputs`). Copied one `copy_` each, they are
four host-to-device copies between two replays of the graphed step, each with the copy engine's
start and hand-back around it. Here one kernel loads all four straight from pinned host memory,
which the GPU addresses directly (CUDA's unified addressing), and stores them: no copy engine, one
launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # rows a program


@triton.jit
def _scatter(src_ptr, dst0_ptr, dst1_ptr, dst2_ptr, dst3_ptr, rows, BLOCK: tl.constexpr):
    # src [4, rows] int64 in pinned host memory, row-major; dst_i [rows] int64 on the device.
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = r < rows
    # Every load before any store: a store may alias a later load as far as the compiler knows, so
    # interleaved, each load's round trip over PCIe would wait for the one before.
    v0 = tl.load(src_ptr + r, mask=mask)
    v1 = tl.load(src_ptr + rows + r, mask=mask)
    v2 = tl.load(src_ptr + 2 * rows + r, mask=mask)
    v3 = tl.load(src_ptr + 3 * rows + r, mask=mask)
    tl.store(dst0_ptr + r, v0, mask=mask)
    tl.store(dst1_ptr + r, v1, mask=mask)
    tl.store(dst2_ptr + r, v2, mask=mask)
    tl.store(dst3_ptr + r, v3, mask=mask)


def scatter_step_inputs(src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    """src [4, rows] int64, contiguous, pinned on the host (or on the device) -> each of the four
    `dsts`, contiguous [rows]-element int64 tensors on one CUDA device. The kernel reads `src` as it
    runs, later than this call returns: the caller keeps it unchanged until then (an event recorded
    after this call)."""
    if src.dtype != torch.int64 or src.dim() != 2 or src.shape[0] != 4 or not src.is_contiguous():
        raise ValueError(f"src must be a contiguous [4, rows] int64 tensor, got {tuple(src.shape)} {src.dtype}")
    if src.device.type == "cpu" and not src.is_pinned():
        raise ValueError("src on the host must be pinned: the GPU reads it in place")
    rows = src.shape[1]
    if len(dsts) != 4 or any(d.numel() != rows or d.dtype != torch.int64 or not d.is_contiguous() or not d.is_cuda
                             for d in dsts):
        raise ValueError(f"dsts must be four contiguous int64 CUDA tensors of {rows} elements")
    _scatter[(triton.cdiv(rows, BLOCK),)](src, *dsts, rows, BLOCK=BLOCK)
