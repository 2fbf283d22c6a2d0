"""`gemv`: a decode step's projections, `x @ weight.T` for a few rows, in Triton.

A decode step multiplies a handful of activation rows by every weight matrix once, so each
projection is bound by reading its weight: [N, K] bf16 from memory, [M, K] activations beside
it. The kernel streams the weight in [BLOCK_N, BLOCK_K] tiles along K, one program per BLOCK_N
output columns and, where a config asks, per share of K (split-K); shares write fp32 partials
that `_sum_splits` adds and rounds. The activation rows are the rows of a `tl.dot` tile padded to
a power of two of at least 16 (`block_rows`), so one kernel serves 1 to `MAX_ROWS` rows; every
config computes the same function.

Inside a compiled step with PDL (Hopper or newer), a layer's projections of 2 to `STEP_ROWS` rows
run here (`step_linear`, marked by `runner.compile_decode` through `layers.Linear.step_kernel`),
launched as programmatic dependents (`kernels.pdl`) with the rest of the step: cuBLAS's kernels
cannot wait in-kernel for the one before them, so each would start only once its predecessor has
drained.

`gemv` can also fold a projection's neighbours into the same kernel: the RMS norm before it, the
residual add after it, SwiGLU before down. The engine's step does not; the lab's `lab.folds` runs
a step that way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanolab.kernels.pdl import dependent_launch, ops_pdl
from nanolab.kernels.w8a16 import w8a16_linear

MAX_ROWS = 64  # the largest decode bucket; rows are padded to a power of two of at least 16 (tl.dot)


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _x_tile(x_ptr, g_ptr, m, kk, mmask, stride_xm, K, dtype: tl.constexpr, NORM: tl.constexpr,
            SWIGLU: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] activation tile at columns kk, in the weight's dtype for the dot, and
    its rows' sums of squares: x[:, kk] as it is; silu(x[:, kk]) * x[:, K + kk] with SWIGLU (x the
    fused gate/up output); times g[kk] with NORM, the sums of squares taken before g (the norm's
    1 / rms is applied to the dot's sum, `_gemv`). fp32 in between, rounded once."""
    x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mmask[:, None], other=0.0)
    if SWIGLU:
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + m[:, None] * stride_xm + (K + kk)[None, :], mask=mmask[:, None], other=0.0)
        x = gate * tl.sigmoid(gate) * up.to(tl.float32)
    sq = tl.zeros([x.shape[0]], tl.float32)
    if NORM:
        xf = x.to(tl.float32)
        sq = tl.sum(xf * xf, axis=1)
        x = xf * tl.load(g_ptr + kk).to(tl.float32)[None, :]
    return x.to(dtype), sq


@triton.jit
def _gemv(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_os,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
          PDL: tl.constexpr = False, PRECISION: tl.constexpr = "ieee", g_ptr=None, res_ptr=None, stride_rm=0,
          eps=0.0, NORM: tl.constexpr = False, SWIGLU: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
          s_ptr=None, SCALED: tl.constexpr = False, DOT: tl.constexpr = "mma"):
    """One program: output columns [n0, n0 + BLOCK_N) over share s of K. K % (SPLIT_K * BLOCK_K)
    == 0 (the wrapper checks), so only the row and column edges are masked. With PDL it waits for
    the kernel before it ahead of its first read of x. With SPLIT_K > 1 a share writes an fp32
    partial [SPLIT_K, M, N] to out_ptr (stride_os apart, rows stride_om as out's), for
    `_sum_splits` to add.
    What it reads of x and writes out (`_x_tile`): with NORM (SPLIT_K == 1), x's rows RMS-normed
    by g [K]; with SWIGLU, x [M, 2K] taken as silu(x[:, :K]) * x[:, K:]; with RESIDUAL (SPLIT_K
    == 1), res [M, N] (rows stride_rm apart) added to the sum before it is rounded. With SCALED, the
    weight is fp8 (e4m3), widened in registers, and column n of the sum is multiplied by s[n], the
    weight's scale for output channel n.
    How a tile is multiplied (DOT): "mma", `tl.dot` with the weight in x's dtype; "mma_f16" (an fp8
    weight, bf16 x), `tl.dot` in fp16, the weight widened by the one-instruction e4m3 -> f16 convert
    and x taken as x / 256, which fp16 holds up to 1.6e7 (both exact in fp16 from 2**-6 up, x's
    8 bits of mantissa inside fp16's 11), the sum multiplied back by 256; "fma" (BLOCK_M == 1), no
    tensor cores: the [BLOCK_N, BLOCK_K] products added in fp32 and summed over K once at the end."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mmask = m < M
    nmask = n < N
    per_split = K // SPLIT_K
    first = s * per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    prod = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # with DOT "fma", the one row's products, summed at the end
    ss = tl.zeros([BLOCK_M], tl.float32)  # with NORM, each row's sum of squares over K
    dependent_launch(PDL)
    for k0 in range(first, first + per_split, BLOCK_K):
        x, sq = _x_tile(x_ptr, g_ptr, m, k0 + k, mmask, stride_xm, K, x_ptr.dtype.element_ty, NORM, SWIGLU)
        ss += sq
        w = tl.load(w_ptr + n[:, None] * stride_wn + (k0 + k)[None, :], mask=nmask[:, None], other=0.0)
        if DOT == "fma":  # x [1, BLOCK_K] against w [BLOCK_N, BLOCK_K]
            prod += w.to(tl.float32) * x.to(tl.float32)
        elif DOT == "mma_f16":  # e4m3 -> f16 is one convert per two weights; x / 256 keeps fp16 in range
            xh = (x.to(tl.float32) * 0.00390625).to(tl.float16)
            acc += tl.dot(xh, tl.trans(w.to(tl.float16)))
        else:
            if SCALED:  # e4m3 bytes read, widened in registers
                w = w.to(x_ptr.dtype.element_ty)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N], fp32 accumulation
    if DOT == "fma":
        acc += tl.sum(prod, axis=1)[None, :]
    if DOT == "mma_f16":
        acc *= 256.0
    if NORM:  # (x g) W^T, scaled by each row's 1 / rms: the norm's scale is one number a row
        acc *= tl.rsqrt(ss / K + eps)[:, None]
    if SCALED:  # x (Q s)^T = (x Q^T) s: one scale a column, applied to the sum
        acc *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    mask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        if RESIDUAL:
            acc += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partials [SPLIT_K, M, N] fp32
        tl.store(out_ptr + s * stride_os + m[:, None] * stride_om + n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, total, stride_s, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr = False, res_ptr=None, RESIDUAL: tl.constexpr = False):
    """out[i] = sum over shares of part[s, i] (plus res[i] with RESIDUAL), rounded once to out's
    dtype; i over M * N, out and res contiguous."""
    dependent_launch(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_s + i, mask=mask, other=0.0)
    if RESIDUAL:
        acc += tl.load(res_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


def step_config(n: int, k: int, m: int, swiglu: bool = False, element_size: int = 2, norm: bool = False
                ) -> GemvConfig:
    """Tiles for `m` rows against an [n, k] weight inside a decode step, from the best of each
    projection's sweep at 16 rows (`data/day61_projections_h200.csv`): 32 columns a
    program over 256-wide K tiles, a weight four times deeper than wide (down) in two shares of
    512-wide tiles, a wide one (gate/up) in 64-column programs of 128-wide tiles. Past 16 rows K
    tiles are at most 256 wide, and the pipeline as deep as about 200 KB of shared memory holds.
    A K these tiles do not divide takes fewer shares, then narrower tiles. With `swiglu` a stage
    holds two activation tiles (gate's and up's), and the pipeline is shallower to match; so it is
    for elements wider than bf16's (`element_size` bytes). A deep one-byte (e4m3) weight takes four
    shares of 128-wide tiles, the best of its sweep at 8 rows (`data/day65_fp8_tiles_h200.csv`). With
    `norm`, one share of K: a share cannot see a row's whole sum of squares."""
    if k >= 4 * n and element_size == 1:
        block_n, block_k, split = 32, 128, 4
    elif k >= 4 * n:
        block_n, block_k, split = 32, 512, 2
    elif n >= 8192:
        block_n, block_k, split = 64, 128, 1
    else:
        block_n, block_k, split = 32, 256, 1
    if norm:
        split = 1
    block_m = block_rows(m)
    if block_m > 16:
        block_k = min(block_k, 256)
    while k % (split * block_k) and split > 1:  # a smaller model's K: fewer shares, then narrower tiles
        split //= 2
    while k % block_k and block_k > 16:
        block_k //= 2
    stage_bytes = ((2 if swiglu else 1) * block_m + block_n) * block_k * element_size
    return GemvConfig(block_n, block_k, split, num_stages=max(2, min(4, 200_000 // stage_bytes)))


def block_rows(m: int) -> int:
    """The rows of the `tl.dot` tile that holds m activation rows: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(m))


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, pdl: bool = False,
         norm: torch.Tensor | None = None, eps: float = 1e-5, residual: torch.Tensor | None = None,
         swiglu: bool = False, scale: torch.Tensor | None = None, dot: str = "mma") -> torch.Tensor:
    """x [..., K] with at most MAX_ROWS rows in all, weight [N, K] -> [..., N] in x's dtype
    (`F.linear` without bias). fp32 accumulation; with split-K, shares are added in fp32 by
    `_sum_splits` and rounded once. With `pdl`, both kernels launch as programmatic dependents
    (`kernels.pdl`).

    Folded in: `norm` [K], x RMS-normed with that weight and `eps` first (one share of K only; the
    default tiles take one); `swiglu`, x [..., 2K] the fused gate/up output, taken as
    silu(gate) * up; `residual` [..., N], added to the product before it is rounded.

    An fp8 weight (float8_e4m3fn) takes `scale` [N] fp32, its scale per output channel
    (`model.quant`): the kernel reads one byte a weight and returns x @ (weight * scale[:, None]).T.

    `dot` is how a tile is multiplied (`_gemv`'s DOT): "mma" (tensor cores, the weight in x's
    dtype), "mma_f16" (an fp8 weight and bf16 x: tensor cores in fp16), "fma" (one row: no tensor
    cores)."""
    *lead, k_in = x.shape
    n, k = weight.shape
    x2 = x.reshape(-1, k_in)
    m = x2.shape[0]
    if k_in != (2 * k if swiglu else k):
        raise ValueError(f"x has {k_in} features but weight is {tuple(weight.shape)}"
                         + (" (swiglu takes twice the weight's K: gate and up)" if swiglu else ""))
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {m}")
    if x2.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None) or fp8 and (scale.shape != (n,) or scale.dtype != torch.float32
                                              or not scale.is_contiguous()):
        raise ValueError("an fp8 weight takes a contiguous fp32 scale [N], and only an fp8 weight takes one; "
                         f"got weight {weight.dtype}, scale {None if scale is None else (scale.dtype, scale.shape)}")
    if dot not in ("mma", "mma_f16", "fma") or dot == "mma_f16" and not (fp8 and x.dtype == torch.bfloat16) \
            or dot == "fma" and m != 1:
        raise ValueError(f"dot={dot!r}: 'mma'; 'mma_f16' for an fp8 weight and bf16 x; 'fma' for one row "
                         f"(got {m} rows of {x.dtype}, weight {weight.dtype})")
    cfg = config or step_config(n, k, m, swiglu, x.element_size(), norm=norm is not None)
    if k % (cfg.split_k * cfg.block_k):
        raise ValueError(f"K={k} must be a multiple of split_k * block_k = {cfg.split_k * cfg.block_k}")
    if norm is not None and (norm.shape != (k,) or not norm.is_contiguous() or cfg.split_k != 1):
        raise ValueError(f"norm must be a contiguous [{k}] weight, and the config one share of K (split_k "
                         f"{cfg.split_k}), got {tuple(norm.shape)}")
    res = None
    if residual is not None:
        if residual.shape != (*lead, n):
            raise ValueError(f"residual must be {(*lead, n)}, got {tuple(residual.shape)}")
        res = residual.reshape(m, n)
        if not res.is_contiguous():
            raise ValueError("residual must be contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    launch = {"launch_pdl": True} if pdl else {}
    meta = dict(BLOCK_M=1 if dot == "fma" else block_rows(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                SPLIT_K=cfg.split_k, DOT=dot, num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=pdl,
                # fp32 rows multiplied in full fp32, as cuBLAS does by default, not in TF32
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **launch)
    folded = dict(g_ptr=norm, eps=eps, NORM=norm is not None, SWIGLU=swiglu, res_ptr=res,
                  stride_rm=0 if res is None else res.stride(0), RESIDUAL=res is not None, s_ptr=scale, SCALED=fp8)
    if cfg.split_k == 1:
        _gemv[grid](x2, weight, out, m, n, k, x2.stride(0), weight.stride(0), out.stride(0), 0, **folded, **meta)
    else:
        part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        _gemv[grid](x2, weight, part, m, n, k, x2.stride(0), weight.stride(0), part.stride(1), part.stride(0),
                    **{**folded, "RESIDUAL": False}, **meta)
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](part, out, m * n, part.stride(0), SPLIT_K=cfg.split_k, BLOCK=block,
                                                  PDL=pdl, res_ptr=res, RESIDUAL=res is not None, **launch)
    return out.reshape(*lead, n)


# The most rows `step_linear` takes to `gemv`; more stay cuBLAS's, which the GEMV did not beat there
# (`data/day61_gemv_levers_h200.csv`).
STEP_ROWS = 16


@torch.library.custom_op("nanolab::step_linear", mutates_args=())
def step_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` inside a compiled decode step, through `gemv` with `step_config`'s
    tiles for at most STEP_ROWS rows (launched as a programmatic dependent where
    `kernels.pdl.ops_pdl` says so), through `F.linear` past that or where the tiles do not divide K.
    One operator inductor does not look into, so a symbolic batch adds no guard."""
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    cfg = step_config(weight.shape[0], k, m, element_size=x.element_size())
    if m > STEP_ROWS or k % (cfg.split_k * cfg.block_k) or not x.is_contiguous() or not weight.is_contiguous():
        return F.linear(x, weight)
    return gemv(x, weight, cfg, pdl=ops_pdl(x.device))


@step_linear.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("nanolab::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (qweight * scale[:, None]).T for an e4m3 weight [N, K] and its fp32 scale [N]. On CUDA
    both paths read one byte a weight and scale the fp32 sum: up to MAX_ROWS rows where
    `step_config`'s tiles divide K, `gemv`, multiplying bf16 rows on fp16 tensor cores ("mma_f16":
    e4m3 widens to fp16 in one conversion, to bf16 in three); more rows (a prompt's chunk),
    `kernels.w8a16.w8a16_linear`, a tiled matmul. On the CPU, the reference: the weight widened
    to x's dtype, which holds every e4m3 value exactly, multiplied by `F.linear`, and each output
    column scaled after. One operator inductor does not look into."""
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    if not x.is_cuda:
        return F.linear(x, qweight.to(x.dtype)).mul_(scale.to(x.dtype))
    cfg = step_config(qweight.shape[0], k, m, element_size=1)
    if m <= MAX_ROWS and not k % (cfg.split_k * cfg.block_k) and x.is_contiguous():
        dot = "mma_f16" if x.dtype == torch.bfloat16 else "mma"
        return gemv(x, qweight, cfg, pdl=ops_pdl(x.device), scale=scale, dot=dot)
    return w8a16_linear(x, qweight, scale)


@fp8_linear.register_fake
def _(x, qweight, scale):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))
