"""A prefill's kernels besides the matmuls and the read: the in-place rotary embedding and SwiGLU
(`kernels.elementwise`, which the model calls eagerly on a GPU) against the torch ops they
replace. On a CPU the Triton kernels run in the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanolab.kernels import INTERPRETED
from nanolab.kernels.elementwise import rope_, silu_mul
from nanolab.model.layers import rope_cos_sin

DEVICE = "cpu" if INTERPRETED else "cuda"


def rotate(x, cos, sin):
    """Hugging Face's rotate_half form, spelled out."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("head_dim", [24, 64])
def test_rope_rotates_a_slice_of_the_fused_heads_in_place(head_dim):
    torch.manual_seed(0)
    qkv = torch.randn(2, 21, 8, head_dim, device=DEVICE)  # 2 rows x 21 tokens, 8 fused heads
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    positions = torch.arange(42, device=DEVICE).view(2, 21) * 7
    cos, sin = rope_cos_sin(positions, inv_freq, qkv.dtype)
    expected = rotate(qkv[:, :, :6], cos, sin)
    untouched = qkv[:, :, 6:].clone()
    out = rope_(qkv[:, :, :6], cos, sin)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :, :6], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :, 6:], untouched), "the rope wrote past the heads it was given"


def test_silu_mul_is_swiglu():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2 * 1100, device=DEVICE)  # 1,100 columns: two tiles, the second ragged
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
