"""The elementwise work between a prefill's matmuls, one Triton kernel each: the rotary embedding
of q and k, and SwiGLU. Day 61.

Eagerly, `layers.apply_rope` is five kernels (two multiplies, a negation, a concatenation and an
add), each striding over a slice of the fused q/k/v output, and SwiGLU is two over halves of the
gate/up output. Over a 2,048-token prompt on the H200 those strided passes took about a quarter of
the prefill. The model calls these instead when it runs eagerly on a GPU; under `torch.compile`
it keeps the torch ops, which inductor fuses itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # tokens a program


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, n_tokens, stride_xt, stride_xh, stride_ct,
          HALF: tl.constexpr, H2: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: BLOCK_T tokens of one head, rotated in place in halves: (x1, x2) ->
    (x1 cos - x2 sin, x2 cos + x1 sin), with cos and sin [tokens, 2 HALF] (their halves equal)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    j = tl.arange(0, H2)
    mask = (t < n_tokens)[:, None] & (j < HALF)[None, :]
    x = x_ptr + t[:, None].to(tl.int64) * stride_xt + h * stride_xh + j[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    c = t[:, None].to(tl.int64) * stride_ct + j[None, :]
    cos = tl.load(cos_ptr + c, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(x, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    """One program: BLOCK columns of one token, silu(gate) * up with gate and up the halves of x."""
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < inter
    gate = tl.load(x_ptr + r * stride_x + n, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + r * stride_x + inter + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + n, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`layers.apply_rope` in place, one kernel: x [rows, T, heads, head_dim] (any head stride, as a
    slice of the fused q/k/v output is), cos and sin [rows, T, 1, head_dim] contiguous. Returns x."""
    rows, t, heads, d = x.shape
    if cos.shape != (rows, t, 1, d) or sin.shape != cos.shape or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [{rows}, {t}, 1, {d}], got {tuple(cos.shape)}")
    if d % 2 or x.stride(3) != 1 or x.stride(0) != t * x.stride(1):
        raise ValueError("x must have an even head_dim, contiguous, and its tokens evenly strided")
    n = rows * t
    _rope[(triton.cdiv(n, BLOCK_T), heads)](x, cos, sin, n, x.stride(1), x.stride(2), d,
                                            HALF=d // 2, H2=triton.next_power_of_2(d // 2), BLOCK_T=BLOCK_T)
    return x


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up output: x [..., 2 * inter] -> silu(x[..., :inter]) * x[..., inter:]."""
    *lead, two = x.shape
    inter = two // 2
    x2 = x.reshape(-1, two)
    if two % 2 or x2.stride(1) != 1:
        raise ValueError(f"x must be [..., 2 * inter] and contiguous along it, got {tuple(x.shape)}")
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul[(x2.shape[0], triton.cdiv(inter, block))](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block)
    return out.reshape(*lead, inter)
