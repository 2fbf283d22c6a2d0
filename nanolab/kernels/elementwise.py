"""The elementwise work between a forward's matmuls, one Triton kernel each: the rotary embedding
of q and k, the same with the K/V cache write, and SwiGLU.

Eagerly, `layers.apply_rope` is five kernels (two multiplies, a negation, a concatenation and an
add), each striding over a slice of the fused q/k/v output, and SwiGLU is two over halves of the
gate/up output, and over a long prompt those strided passes are a large share of the prefill. The
model calls these instead when it runs eagerly on a GPU; under `torch.compile` it keeps the torch
ops, which inductor fuses itself.

`rope_write` is for every GPU forward, eager or compiled: it rotates q and k and writes k and v
into the cache pools in one kernel. Inductor, left to itself, makes three of the same work in a
decode step (q's rotation, k's rotation with its write, v's write), as its scatters into two
pools do not fuse with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanolab.kernels.pdl import dependent_launch, ops_pdl

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


@triton.jit
def _rope_write(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, heads, kv_heads, n_slots,
                stride_t, stride_h, stride_ct, stride_st, stride_qt, stride_qh, stride_ps, stride_ph,
                HALF: tl.constexpr, H2: tl.constexpr, HP: tl.constexpr, K_IN_PLACE: tl.constexpr,
                PDL: tl.constexpr = False):
    """One program: one token's fused q/k/v heads [heads + 2 kv_heads, 2 HALF]. The first
    heads + kv_heads are rotated in halves, q goes to q_ptr [tokens, heads, 2 HALF], k and v to
    their pools [n_slots, kv_heads, 2 HALF] at the token's slot, a negative one counted from the
    end as torch's indexing does (a padded decode row writes the sink, -1). K_IN_PLACE: k rotated
    back into qkv too. PDL: launched as a programmatic dependent, it waits for the kernel before."""
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)[:, None]  # [HP, 1]: the head of each row of the tile
    j = tl.arange(0, H2)[None, :]  # [1, H2]: the column within a half
    live = (h < heads + 2 * kv_heads) & (j < HALF)
    src = qkv_ptr + t * stride_t + h * stride_h + j
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)
    rotated = h < heads + kv_heads
    y1 = tl.where(rotated, x1 * cos - x2 * sin, x1)
    y2 = tl.where(rotated, x2 * cos + x1 * sin, x2)
    is_q = live & (h < heads)
    q = q_ptr + t * stride_qt + h * stride_qh + j
    tl.store(q, y1.to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(q + HALF, y2.to(q_ptr.dtype.element_ty), mask=is_q)
    slot = tl.load(slots_ptr + t * stride_st).to(tl.int64)
    slot = tl.where(slot < 0, slot + n_slots, slot)
    is_k = live & (h >= heads) & rotated
    k = k_ptr + slot * stride_ps + (h - heads) * stride_ph + j
    tl.store(k, y1.to(k_ptr.dtype.element_ty), mask=is_k)
    tl.store(k + HALF, y2.to(k_ptr.dtype.element_ty), mask=is_k)
    if K_IN_PLACE:
        tl.store(src, y1.to(qkv_ptr.dtype.element_ty), mask=is_k)
        tl.store(src + HALF, y2.to(qkv_ptr.dtype.element_ty), mask=is_k)
    is_v = live & (h >= heads + kv_heads)
    v = v_ptr + slot * stride_ps + (h - heads - kv_heads) * stride_ph + j
    tl.store(v, y1.to(v_ptr.dtype.element_ty), mask=is_v)
    tl.store(v + HALF, y2.to(v_ptr.dtype.element_ty), mask=is_v)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor, heads: int, k_in_place: bool = False, pdl: bool = False) -> torch.Tensor:
    """qkv [tokens, heads + 2 kv_heads, head_dim] (q, k, v heads in that order), cos and sin
    [tokens, head_dim] (their halves equal), slots [tokens] int64 -> q rotated [tokens, heads,
    head_dim], with k rotated into k_pool and v into v_pool [pool slots, kv_heads, head_dim] at
    each token's slot (negative slots count from the end, as in `pool[slots] = k`). One kernel:
    `Attention`'s rotation and `CacheView.write` together. `k_in_place` also leaves k rotated in
    qkv, where a read of whole prompts takes it (`CacheView.read`) instead of gathering it back.
    `pdl` launches the kernel as a programmatic dependent of the one before (`kernels.pdl`)."""
    tokens, total, d = qkv.shape
    kv_heads = (total - heads) // 2
    if heads < 1 or kv_heads < 1 or total != heads + 2 * kv_heads or d % 2:
        raise ValueError(f"qkv [{tokens}, {total}, {d}] does not hold {heads} query heads and two equal sets of "
                         f"KV heads of an even head_dim")
    if k_pool.shape[1:] != (kv_heads, d) or v_pool.shape != k_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError(f"pools must both be [slots, {kv_heads}, {d}] alike, got {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}")
    if cos.shape != (tokens, d) or sin.shape != cos.shape or sin.stride() != cos.stride() or slots.shape != (tokens,):
        raise ValueError(f"cos and sin must be [{tokens}, {d}] alike and slots [{tokens}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)} and {tuple(slots.shape)}")
    if qkv.stride(2) != 1 or cos.stride(1) != 1 or k_pool.stride(2) != 1:
        raise ValueError("qkv, cos, sin and the pools must be contiguous along head_dim")
    q = torch.empty((tokens, heads, d), dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _rope_write[(tokens,)](qkv, cos, sin, slots, q, k_pool, v_pool, heads, kv_heads, k_pool.shape[0], qkv.stride(0),
                               qkv.stride(1), cos.stride(0), slots.stride(0), q.stride(0), q.stride(1),
                               k_pool.stride(0), k_pool.stride(1), HALF=d // 2, H2=triton.next_power_of_2(d // 2),
                               HP=triton.next_power_of_2(total), K_IN_PLACE=k_in_place, PDL=pdl,
                               **({"launch_pdl": True} if pdl else {}))
    return q


@torch.library.custom_op("nanolab::rope_write", mutates_args=("k_pool", "v_pool"))
def rope_write_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  slots: torch.Tensor, heads: int) -> torch.Tensor:
    """`rope_write` as one operator with its pool writes declared: what a compiled forward calls, so
    inductor launches the one kernel instead of tracing three of its own; a programmatic dependent
    where `kernels.pdl.ops_pdl` says so."""
    return rope_write(qkv, cos, sin, k_pool, v_pool, slots, heads, pdl=ops_pdl(qkv.device))


@rope_write_op.register_fake
def _(qkv, cos, sin, k_pool, v_pool, slots, heads):
    return qkv.new_empty((qkv.shape[0], heads, qkv.shape[2]))


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


@torch.library.custom_op("nanolab::silu_mul", mutates_args=())
def silu_mul_op(x: torch.Tensor) -> torch.Tensor:
    """`silu_mul` as one operator inductor does not look into: a compiled forward calls it where
    the activation must be written out once rather than fused into the reduction that reads it."""
    return silu_mul(x)


@silu_mul_op.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
