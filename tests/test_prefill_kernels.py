"""A forward's kernels besides the matmuls and the read: the in-place rotary embedding, the
rotation with the K/V write, and SwiGLU (`kernels.elementwise`, which the model calls on a GPU)
against the torch ops they replace. On a CPU the Triton kernels run in the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanolab.kernels import INTERPRETED
from nanolab.kernels.elementwise import rope_, rope_write, silu_mul, silu_mul_op
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
    # the operator a compiled batch-1 step calls: the same values, and a fake that gives its shape
    torch.testing.assert_close(silu_mul_op(x[:1, :1]), F.silu(gate[:1, :1]) * up[:1, :1], atol=1e-5, rtol=1e-5)
    torch.library.opcheck(silu_mul_op, (x[:1, :1],), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 24), (6, 1, 64), (3, 3, 16)])
def test_rope_write_rotates_q_and_k_and_writes_k_and_v_at_their_slots(heads, kv_heads, head_dim):
    torch.manual_seed(0)
    tokens, slots_total = 7, 40
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    positions = torch.tensor([[3, 9, 0, 17, 30, 5, 11]], device=DEVICE)
    cos, sin = rope_cos_sin(positions, inv_freq, qkv.dtype)  # [1, tokens, 1, head_dim]
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    # Two tokens write the sink (slot -1, the last), as a padded decode row does; the rest are scattered.
    slots = torch.tensor([12, 3, -1, 25, 0, -1, 31], device=DEVICE)
    k_pool = torch.randn(slots_total, kv_heads, head_dim, device=DEVICE)
    v_pool = torch.randn(slots_total, kv_heads, head_dim, device=DEVICE)
    k_expected, v_expected = k_pool.clone(), v_pool.clone()
    rotated = rotate(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None])
    real = slots >= 0
    k_expected[slots[real]] = rotated[real, heads:]
    v_expected[slots[real]] = qkv[real, heads + kv_heads:]

    q = rope_write(qkv, cos, sin, k_pool, v_pool, slots, heads)

    torch.testing.assert_close(q, rotated[:, :heads], atol=1e-5, rtol=1e-5)
    keep = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    keep[-1] = False  # the sink holds whichever padding token wrote last
    torch.testing.assert_close(k_pool[keep], k_expected[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_pool[keep], v_expected[keep], atol=1e-5, rtol=1e-5)
    sink_writers = rotated[~real, heads:]  # [2, kv_heads, head_dim]: the padding tokens' k
    assert any(torch.allclose(k_pool[-1], k, atol=1e-5) for k in sink_writers), "slot -1 must be the pool's last"


def test_rope_write_names_a_qkv_that_does_not_split_into_heads():
    qkv = torch.zeros(2, 7, 8, device=DEVICE)
    pool = torch.zeros(4, 2, 8, device=DEVICE)
    cos = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="query heads"):
        rope_write(qkv, cos, cos, pool, pool, torch.zeros(2, dtype=torch.int64, device=DEVICE), 4)
