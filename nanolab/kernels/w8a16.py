"""`w8a16_linear`: a prompt step's projection over an e4m3 weight (W8A16), in Triton.

A prompt step multiplies hundreds of activation rows by each weight, past what the decode GEMV
(`kernels.gemv`) takes. This kernel reads the weight's bytes once, widens each [BLOCK_N, BLOCK_K]
tile in registers and multiplies it on tensor cores, accumulating in fp32 and applying the
per-output-channel scale to the sum, as the GEMV does. The activations stay in their dtype; bf16
rows go through fp16 tensor cores as x / 256 (e4m3 widens to fp16 in one conversion).

Programs run in groups of `group_m` row blocks down each column block, so a group reads a weight
tile from memory once and the rest from L2. `prompt_tile` picks the tile by how many programs it
makes against the device's SMs. A config may also split K into shares (`split_k`), each share's
programs writing an fp32 partial that are added after: more programs for a projection with few
column tiles and a long K; `prompt_tile` uses none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanolab.kernels.paged_attention import sm_count


@dataclass(frozen=True)
class MMConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # row blocks that walk one column block's weight tiles in turn, while they sit in L2
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # shares of K, each its own programs, their fp32 partials added after

    def name(self) -> str:
        split = f" k/{self.split_k}" if self.split_k > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{split}"


# `prompt_tile`'s choices, largest first: the fastest tile of each Llama-3.2-1B projection at 128
# and 512 rows is one of these (data/day65d_fp8_prefill_*).
PROMPT_TILES = (MMConfig(128, 128, 64, num_warps=8, num_stages=3), MMConfig(64, 128, 64), MMConfig(64, 64, 128))


def prompt_tile(m: int, n: int, sms: int) -> MMConfig:
    """The largest of `PROMPT_TILES` whose grid for [m, K] @ [K, n] has at least one program per
    SM, else the smallest: a bigger tile reads each weight tile for more rows, and fewer programs
    than SMs leave the device idle (a down projection of 2,048 columns at 128 rows)."""
    for tile in PROMPT_TILES:
        if triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n) >= sms:
            return tile
    return PROMPT_TILES[-1]


@triton.jit
def _w8a16_mm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_SHARE, stride_xm, stride_wn, stride_om, stride_os,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One program: out[m0:m0 + BLOCK_M, n0:n0 + BLOCK_N] = x (w s)^T over all of K, for x [M, K]
    and an e4m3 weight w [N, K] with its scale s [N] fp32. DOT "x": the weight widened to x's
    dtype; "f16" (bf16 x): the weight widened to fp16 and x taken as x / 256, which fp16 holds to
    bf16's precision from 2**-6 up and below that to within 2**-17 absolute, the sum multiplied back.
    Program axis 1 is a share of K, K_SHARE columns from pid_k * K_SHARE (all of K when there is
    one share); with more than one, each writes its scaled fp32 sum to out_ptr + pid_k * stride_os."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Row offsets in int64: a long prompt's rows times N (or K) pass 2**31 elements.
    rows_x = m.to(tl.int64)[:, None] * stride_xm
    rows_w = n.to(tl.int64)[:, None] * stride_wn
    k_end = tl.minimum(K, (pid_k + 1) * K_SHARE)
    for k0 in range(pid_k * K_SHARE, k_end, BLOCK_K):
        kmask = (k0 + k) < k_end
        x = tl.load(x_ptr + rows_x + (k0 + k)[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rows_w + (k0 + k)[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if DOT == "f16":
            xh = (x.to(tl.float32) * 0.00390625).to(tl.float16)
            acc += tl.dot(xh, tl.trans(w.to(tl.float16)))
        else:
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
    if DOT == "f16":
        acc *= 256.0
    acc *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, config: MMConfig | None = None,
                 dot: str | None = None) -> torch.Tensor:
    """x [..., K] (fp32, bf16 or fp16) @ (qweight * scale[:, None]).T for an e4m3 weight [N, K] and
    its fp32 scale [N] -> [..., N] in x's dtype, reading the weight's bytes once. `config`: the
    tile (default `prompt_tile`'s on CUDA, the first of `PROMPT_TILES` elsewhere); with split_k
    above 1, the shares' fp32 partials [split_k, rows, N] are added by `torch.sum` and rounded
    once. `dot` as `_w8a16_mm`'s DOT (default "f16" for bf16 x, "x" otherwise)."""
    if qweight.dtype != torch.float8_e4m3fn or qweight.dim() != 2 or qweight.stride(1) != 1:
        raise ValueError(f"qweight must be a 2-D float8_e4m3fn weight contiguous along K, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be a contiguous fp32 [{n}], got {scale.dtype} {tuple(scale.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    dot = dot or ("f16" if x.dtype == torch.bfloat16 else "x")
    if dot not in ("x", "f16") or dot == "f16" and x.dtype != torch.bfloat16:
        raise ValueError(f"dot={dot!r}: 'x', or 'f16' for bf16 x")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    c = config or (prompt_tile(m, n, sm_count(x.device)) if x.is_cuda else PROMPT_TILES[0])
    if isinstance(c.split_k, bool) or not isinstance(c.split_k, int) or c.split_k < 1:
        raise ValueError(f"config.split_k={c.split_k!r}: must be a positive int")
    if m == 0:
        return x.new_empty((*x.shape[:-1], n))
    share = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k) * c.block_k  # whole tiles a share
    shares = triton.cdiv(k, share)
    out = torch.empty((shares, m, n) if shares > 1 else (1, m, n),
                      dtype=torch.float32 if shares > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n), shares)
    _w8a16_mm[grid](x2, qweight, scale, out, m, n, k, share, x2.stride(0), qweight.stride(0), out.stride(1),
                    out.stride(0), BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                    DOT=dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c.num_warps,
                    num_stages=c.num_stages)
    out = out.sum(0).to(x.dtype) if shares > 1 else out[0]
    return out.view(*x.shape[:-1], n)
