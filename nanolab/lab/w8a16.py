"""A prompt step's matmul that reads an e4m3 weight's bytes itself (W8A16), a candidate for fp8
prompt steps (Day 65).

The engine's fp8 prompt step (`kernels.gemv.fp8_linear` past its GEMV's rows) widens each weight
to the activations' dtype in memory, multiplies with `F.linear`, and scales each output column
after: a weight is read once as bytes, written and read again at two bytes each. This kernel reads
the bytes once, widens a tile in registers, and multiplies it on tensor cores, with fp32
accumulation and the scale applied to the sum, as the GEMV does. The activations stay in their
dtype: quantizing them as well (W8A8, `torch._scaled_mm`) cost SmolLM2 1.85% of perplexity.

`fp8bench --parts prefill` times it against the engine's path; it enters the engine only if it
wins there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanolab.model.quant import quantize_fp8

NAN = float("nan")


@dataclass(frozen=True)
class MMConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8  # row blocks that walk one column block's weight tiles in turn, while they sit in L2
    num_warps: int = 4
    num_stages: int = 4

    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


# Tiles the prefill sweep tries; a 64-row tile suits a chunk of a few hundred tokens.
CONFIGS = (MMConfig(), MMConfig(128, 128, 64, num_warps=8, num_stages=3), MMConfig(64, 64, 128),
           MMConfig(128, 64, 64, num_warps=4, num_stages=4))


@triton.jit
def _w8a16_mm(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One program: out[m0:m0 + BLOCK_M, n0:n0 + BLOCK_N] = x (w s)^T over all of K, for x [M, K]
    and an e4m3 weight w [N, K] with its scale s [N] fp32. Programs run in groups of GROUP_M row
    blocks down each column block, so a weight tile is read from memory once a group. DOT "x":
    the weight widened to x's dtype; "f16" (bf16 x): the weight widened to fp16 in one convert and
    x taken as x / 256, which fp16 holds exactly from 2**-6 up, the sum multiplied back."""
    pid = tl.program_id(0)
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
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + k) < K
        x = tl.load(x_ptr + m[:, None] * stride_xm + (k0 + k)[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + (k0 + k)[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        if DOT == "f16":
            xh = (x.to(tl.float32) * 0.00390625).to(tl.float16)
            acc += tl.dot(xh, tl.trans(w.to(tl.float16)))
        else:
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), input_precision=PRECISION)
    if DOT == "f16":
        acc *= 256.0
    acc *= tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, config: MMConfig = MMConfig(),
                 dot: str = "x") -> torch.Tensor:
    """x [..., K] (fp32, bf16 or fp16) @ (qweight * scale[:, None]).T for an e4m3 weight [N, K] and
    its fp32 scale [N] -> [..., N] in x's dtype, reading the weight's bytes once. `dot` as
    `_w8a16_mm`'s DOT: "x", or "f16" for bf16 x."""
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
    if dot not in ("x", "f16") or dot == "f16" and x.dtype != torch.bfloat16:
        raise ValueError(f"dot={dot!r}: 'x', or 'f16' for bf16 x")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    c = config
    grid = (triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n),)
    _w8a16_mm[grid](x2, qweight, scale, out, m, n, k, x2.stride(0), qweight.stride(0), out.stride(0),
                    BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, DOT=dot,
                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c.num_warps,
                    num_stages=c.num_stages)
    return out.view(*x.shape[:-1], n)


def prefill_table(config, tokens: Sequence[int] = (128, 512), repeats: int = 20, progress: bool = True
                  ) -> pd.DataFrame:
    """Each layer projection of a prompt step (`gemvbench.projection_shapes`, the head left out) at
    each count of `tokens`, on CUDA, `us` a launch (`timing.time_us`: a CUDA graph replay after an
    L2 flush). Arms: the bf16 weight through `F.linear` (a bf16 model's prompt step); the e4m3
    weight widened to bf16 in memory, `F.linear`, then each column scaled (the engine's fp8 prompt
    step, `kernels.gemv.fp8_linear`); and `w8a16_linear` at every tile of `CONFIGS`, each dot.
    TB/s counts the stored weight once (e4m3 bytes and fp32 scales, or bf16); `rel_err` is the
    largest error over the largest output, against the dequantized weight's matmul in float64."""
    from nanolab.lab.gemvbench import projection_shapes
    from nanolab.progress import progress_bar

    shapes = {name: nk for name, nk in projection_shapes(config).items() if name != "lm_head"}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in tokens]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="fp8 prompt-step projections", enabled=progress):
        records += _time_prefill(name, n, k, m, repeats)
    return pd.DataFrame(records)


def _time_prefill(name: str, n: int, k: int, m: int, repeats: int) -> list[dict]:
    from nanolab.lab.timing import time_us

    device = torch.device("cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5
    q, scale = quantize_fp8(w)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    scale_bf16 = scale.to(torch.bfloat16)
    arms = {"bf16 F.linear": (lambda: F.linear(x, w), 2 * n * k),
            "fp8 widened, F.linear, scaled (engine)": (lambda: F.linear(x, q.to(torch.bfloat16)).mul_(scale_bf16),
                                                       n * k + 4 * n)}
    for c in CONFIGS:
        for dot in ("x", "f16"):
            arms[f"fp8 w8a16 {c.name()} dot {dot}"] = (lambda c=c, dot=dot: w8a16_linear(x, q, scale, c, dot),
                                                      n * k + 4 * n)
    records = []
    for arm, (fn, weight_bytes) in arms.items():
        row = {"projection": name, "n": n, "k": k, "tokens": m, "arm": arm}
        try:
            err = NAN if arm == "bf16 F.linear" else float((fn().double() - ref).abs().max() / ref.abs().max())
            us = time_us(fn, device, repeats)
            row.update(us=us, tb_s=weight_bytes / us / 1e6, rel_err=err)
        except Exception as e:  # a tile this card cannot build is a row that says so
            row.update(us=NAN, tb_s=NAN, rel_err=NAN, error=f"{type(e).__name__}: {e}"[:200])
        records.append(row)
    return records


def layer_prefill(table: pd.DataFrame) -> pd.DataFrame:
    """Per token count: a layer's four projections summed for bf16, the engine's fp8 path, and
    the W8A16 kernel at each projection's fastest tile and dot."""
    ok = table.dropna(subset=["us"])
    best = ok[ok.arm.str.startswith("fp8 w8a16")].sort_values("us").groupby(["projection", "tokens"]).head(1)
    parts = [ok[~ok.arm.str.startswith("fp8 w8a16")], best.assign(arm="fp8 w8a16 (each projection's best tile)")]
    return (pd.concat(parts).groupby(["tokens", "arm"]).us.sum().unstack("arm").reset_index())
