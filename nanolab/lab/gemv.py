"""`gemv`: a decode step's projections, `x @ weight.T` for a few rows, in Triton. Day 61's lever
that did not pay: alone, with the L2 flushed, its best tiles only match cuBLAS at 1 and 16 rows on
the H200 (`levers.projection_table`, `data/day61_projections_h200.csv`), so the engine keeps
cuBLAS and this kernel stays in the lab, where the chapter measures it.

A decode step multiplies a handful of activation rows by every weight matrix once, so each
projection is bound by reading its weight: [N, K] bf16 from memory, [M, K] activations beside
it. The kernel streams the weight in [BLOCK_N, BLOCK_K] tiles along K, one program per BLOCK_N
output columns and, when the columns alone leave the grid short of the card, per share of K
(split-K); shares write fp32 partials that `_sum_splits` adds and rounds. The activation rows are
the rows of a `tl.dot` tile padded to 16, so one kernel serves 1 to `MAX_ROWS` rows.
`choose_config` holds the tile shape per matrix; every config computes the same function.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # past this many rows a projection is no longer a row or two against the weight


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """One program: output columns [n0, n0 + BLOCK_N) over share s of K. K % (SPLIT_K * BLOCK_K)
    == 0 (the wrapper checks), so only the row and column edges are masked."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    per_split = K // SPLIT_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(s * per_split, (s + 1) * per_split, BLOCK_K):
        x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + k)[None, :], mask=mmask[:, None], other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + (k0 + k)[None, :], mask=nmask[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))  # [BLOCK_M, BLOCK_N], fp32 accumulation
    mask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials [SPLIT_K, M, N] fp32
        tl.store(out_ptr + s * stride_os + m[:, None] * stride_om + n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, total, stride_s, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over shares of part[s, i], rounded once to out's dtype; i over M * N."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_s + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """Tiles for an [n, k] weight: 64 columns a program, K in 256-wide tiles, and as many shares of
    K as bring the grid to about two programs per SM (at most 8, each at least one tile)."""
    block_n, block_k = 64, 256
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split * 2 <= 2 * num_sms and k % (split * 2 * block_k) == 0 and split < 8:
        split *= 2
    return GemvConfig(block_n, block_k, split)


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, weight [N, K] -> [..., N] in x's dtype
    (`F.linear` without bias). fp32 accumulation; with split-K, shares are added in fp32 and
    rounded once."""
    *lead, k = x.shape
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but weight is {tuple(weight.shape)}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {m}")
    if x2.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    cfg = config or choose_config(n, k)
    if k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"K={k} must be a multiple of split_k * block_k = {cfg.split_k * cfg.block_k}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    meta = dict(BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k == 1:
        _gemv[grid](x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0), 0, **meta)
    else:
        part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        _gemv[grid](x2, weight, part, m, n, k, x2.stride(0), weight.stride(0), part.stride(1), part.stride(0), **meta)
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, out, m * n, part.stride(0), SPLIT_K=cfg.split_k, BLOCK=block)
    return out.reshape(*lead, n)

