"""FP8 weights: e4m3 values with one fp32 scale per output channel (vLLM's `fp8` with
per-channel weight scales), quantized from a checkpoint's weights at load.

A weight W [out, in] becomes Q = W / s, rounded to float8_e4m3fn, with s [out] = max|W[o, :]| / 448
(e4m3's largest finite value), so every row uses e4m3's whole range; W is read back as Q * s.
Rounding to e4m3's 3 mantissa bits moves a normal value by at most 1/16 of itself, and a value
below e4m3's smallest normal (2^-6) by at most half its subnormal step (2^-10), times s.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] (any float dtype) -> (qweight [out, in] float8_e4m3fn, scale [out] fp32)."""
    if weight.dim() != 2:
        raise ValueError(f"an fp8 weight is [out, in], got shape {tuple(weight.shape)}")
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX  # [out]
    qweight = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return qweight, scale


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(qweight [out, in] float8_e4m3fn, scale [out]) -> the weight [out, in] in `dtype`."""
    return (qweight.float() * scale[:, None]).to(dtype)


def fp8_error_bound(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[out, in]: the most a round trip through e4m3 may move each element of `weight`."""
    return torch.maximum(weight.float().abs() / 16, scale[:, None] * 2.0**-10)
