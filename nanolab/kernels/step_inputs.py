"""`upload_step_inputs`: a decode plan's four per-row vectors, from one host buffer into the device
buffers the step reads, in one kernel.

The plan's table rows, write slots, context lengths and positions each live in a device buffer of
their own (`KVCache.step_inputs`). One kernel loads all four from pinned host memory, which the GPU
addresses directly (CUDA's unified addressing), and stores them: one launch between two replays
of the graphed step, and no copy engine to start and hand back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanolab.kernels import INTERPRETED

BLOCK = 128  # rows a program


@triton.jit
def _upload(src_ptr, dst0_ptr, dst1_ptr, dst2_ptr, dst3_ptr, rows, BLOCK: tl.constexpr):
    # src [4, rows] int64, row-major, in pinned host memory; dst_i [rows] int64 on the device.
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


def upload_step_inputs(src: torch.Tensor, dsts: list[torch.Tensor], validated: bool = False) -> None:
    """src [4, rows] int64, contiguous, pinned on the host -> each of the four `dsts`, contiguous
    [rows]-element int64 tensors on one CUDA device (in Triton's interpreter, CPU tensors both). The
    kernel reads `src` when it runs, after this call returns: the caller keeps `src` unchanged until
    then (an event recorded after this call). `validated`: the caller has checked the inputs."""
    if not validated and (src.dtype != torch.int64 or src.dim() != 2 or src.shape[0] != 4
                          or not src.is_contiguous()):
        raise ValueError(f"src must be a contiguous [4, rows] int64 tensor, got {tuple(src.shape)} {src.dtype}")
    if not validated and not INTERPRETED and not src.is_pinned():
        raise ValueError("src must be pinned host memory: the GPU reads it in place")
    rows = src.shape[1]
    on_device = (lambda d: d.device.type == "cpu") if INTERPRETED else (lambda d: d.is_cuda)
    if not validated and (len(dsts) != 4 or any(d.numel() != rows or d.dtype != torch.int64
                                                or not d.is_contiguous() or not on_device(d) for d in dsts)):
        raise ValueError(f"dsts must be four contiguous int64 tensors of {rows} elements on the device")
    _upload[(triton.cdiv(rows, BLOCK),)](src, *dsts, rows, BLOCK=BLOCK)
