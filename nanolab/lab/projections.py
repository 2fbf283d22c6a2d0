"""A decode step's projections with the work around them folded in, in Triton, and `FusedDecode`,
the decode step built from them. Day 61's lever that did not pay: on the H200 the graphed
Llama-3.2-1B step ran no faster than inductor's fusions around cuBLAS (`lab.leverrun`,
`data/day61_levers_h200.csv`), because these kernels read the large weights (gate/up, the LM head)
well below cuBLAS's bandwidth. The engine keeps the compiled step; the chapter measures this one.

A decode step multiplies a few activation rows by every weight matrix once, so each projection is
bound by reading its weight, and what sits between two projections (a norm, a residual add, the
rotary embedding, the K/V write, SwiGLU) is a kernel launch of its own that moves almost nothing.
Here each projection carries its neighbours:
- `norm_qkv_rope`: RMSNorm of the residual stream, the fused q/k/v projection, RoPE on q and k,
  k and v written to the layer's pool slots, q returned;
- `gemv_add`: `h += a @ W.T`, the o and down projections with their residual adds;
- `norm_gate_up`: RMSNorm, the fused gate/up projection and SwiGLU;
- `norm_head`: the final RMSNorm and the LM head, fp32 logits.
So a layer is four of these and the paged read, and the stream never stores a normed activation.

Every kernel streams its weight in [rows, BLOCK_K] tiles along K, one program per block of output
rows; the activation rows (at most `MAX_ROWS`) are the rows of a `tl.dot` tile padded to 16. A
norm is applied after the dot: y = (W (x * g)) * rsqrt(mean(x^2) + eps), with x's sum of squares
gathered from the same tiles the dot reads. Paired outputs (a rotary pair of dims j and
j + head_dim / 2, or gate and up column j) come from one tile whose rows interleave the two.

With `pdl`, a kernel is launched as a programmatic dependent of the one before (Hopper's PDL):
it may start while its predecessor drains, prefetches its own weight slice into L2 (weights do not
depend on the step), and waits (`griddepcontrol.wait`) before it reads anything the step wrote.
On a CPU (Triton's interpreter) every launch is plain. Prefetching into L2 before the wait
(`PREFETCH_L2`) made the H200 step slower, and is off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanolab.kernels.paged_attention import _dot_mode, paged_attention
from nanolab.kernels.pdl import dependent_launch, release_dependents, supports_pdl

MAX_ROWS = 16  # rows of one tl.dot tile: past this a projection is a GEMM, and cuBLAS's
PREFETCH_L2 = False  # under PDL, prefetch each program's weight rows into L2 before waiting


class Tiles(NamedTuple):
    """Launch settings of one projection: output rows per program (per half, for a paired one),
    the K tile, warps, pipeline depth, and shares of K (`gemv_add` only, into an fp32 h)."""

    block_n: int
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# Per projection, read off an H200 sweep of the graphed Llama-3.2-1B step at 1 and 8 rows.
TILES = {
    "qkv": Tiles(16, 256, 4, 4),  # pairs of 16 rotary dims: 32 weight rows a program
    "o": Tiles(16, 256, 4, 4),
    "gate_up": Tiles(64, 256, 8, 3),  # 64 gate and 64 up rows a program
    "down": Tiles(16, 1024, 4, 3),  # split-K into fp32 h measured no better
    "head": Tiles(128, 256, 4, 3),
}


@triton.jit
def _prefetch(w_ptr, rows, stride_wn, K: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr,
              PREFETCH: tl.constexpr):
    """Ask L2 for this program's weight rows, one instruction per 128-byte line of LINE elements
    (LINES, a power of two, covers a row)."""
    if PREFETCH:
        lines = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
        ptrs = w_ptr + rows[:, None] * stride_wn + lines[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _project(x_ptr, g_ptr, w_ptr, rows, m, mmask, stride_xm, stride_wn, eps, k_start, k_stop, K: tl.constexpr,
             BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
             DOT: tl.constexpr):
    """x[m] @ W[rows].T over k_start <= k < k_stop -> [BLOCK_M, len(rows)] fp32, with x RMS-normed
    by g first when NORM (which needs the whole of K).
    DOT as `paged_attention._dot_mode`: 0 fp32 at IEEE precision, 1 fp32, 2 the weight's 16-bit
    dtype on the tensor cores (fp32 accumulation)."""
    acc = tl.zeros([BLOCK_M, ROWS], tl.float32)
    sumsq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < k_stop
        x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        x = x.to(tl.float32)
        if NORM:
            sumsq += tl.sum(x * x, axis=1)
            x = x * tl.load(g_ptr + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=kmask[None, :], other=0.0)
        if DOT == 0:
            acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT == 1:
            acc += tl.dot(x, tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x.to(w.dtype), tl.trans(w))
    if NORM:
        acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
    return acc


@triton.jit
def _stream_rows(x_ptr, g_ptr, w_ptr, rows, M, stride_xm, stride_wn, eps, k_start, k_stop, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                 DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
                 LINES: tl.constexpr):
    """Every kernel's body: prefetch this program's weight rows (before the PDL wait: weights do
    not depend on the step), wait, `_project`, then release the next kernel. Returns the [BLOCK_M,
    ROWS] fp32 product, the activation rows m and their mask."""
    _prefetch(w_ptr, rows, stride_wn, K, LINE, LINES, PREFETCH)
    dependent_launch(PDL)
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    acc = _project(x_ptr, g_ptr, w_ptr, rows, m, mmask, stride_xm, stride_wn, eps, k_start, k_stop, K, BLOCK_M,
                   ROWS, BLOCK_K, NORM, DOT)
    release_dependents(PDL)  # the weight is read: the next kernel may start prefetching its own
    return acc, m, mmask


@triton.jit
def _pairs(acc, BLOCK_M: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK_M, 2 * HALF] with the two members of each pair interleaved -> the two halves."""
    return tl.split(tl.reshape(acc, [BLOCK_M, HALF, 2]))


@triton.jit
def _norm_qkv_rope(h_ptr, g_ptr, w_ptr, inv_freq_ptr, pos_ptr, slots_ptr, q_ptr, k_ptr, v_ptr,
                   M, eps, pool_slots, stride_hm, stride_wn, stride_qm, stride_ks, stride_vs,
                   HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr):
    """One program: dims j0 .. j0 + BLOCK_H and their rotary partners j + D/2 of one head of the
    fused qkv weight [(HEADS + 2 KV_HEADS) * D, K]. q heads go to q [M, HEADS * D]; k and v heads to
    their pools [slots, KV_HEADS, D] at slots[m] (-1, the sink, is the pool's last slot)."""
    pid = tl.program_id(0)
    HALF: tl.constexpr = D // 2
    per_head: tl.constexpr = (HALF + BLOCK_H - 1) // BLOCK_H
    head = pid // per_head
    j = (pid % per_head) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] rotary dims of this program
    jmask = j < HALF
    first = head * D + tl.minimum(j, HALF - 1).to(tl.int64)  # dims past HALF reread the last, unstored
    rows = tl.interleave(first, first + HALF)  # j0, j0 + D/2, j0 + 1, j0 + 1 + D/2, ...
    acc, m, mmask = _stream_rows(h_ptr, g_ptr, w_ptr, rows, M, stride_hm, stride_wn, eps, 0, K, K, BLOCK_M,
                                 2 * BLOCK_H, BLOCK_K, True, DOT, PDL, PREFETCH, LINE, LINES)
    a, b = _pairs(acc, BLOCK_M, BLOCK_H)  # dims j and j + D/2, [BLOCK_M, BLOCK_H] each
    if head < HEADS + KV_HEADS:  # q and k rotate; v does not
        pos = tl.load(pos_ptr + m, mask=mmask, other=0).to(tl.float32)
        angle = pos[:, None] * tl.load(inv_freq_ptr + j, mask=jmask, other=0.0)[None, :]
        cos, sin = tl.cos(angle), tl.sin(angle)
        a, b = a * cos - b * sin, b * cos + a * sin
    mask = mmask[:, None] & jmask[None, :]
    if head < HEADS:
        out = q_ptr + m[:, None] * stride_qm + head * D + j[None, :]
        tl.store(out, a.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, b.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slots_ptr + m, mask=mmask, other=0)
        slot = tl.where(slot < 0, slot + pool_slots, slot)
        if head < HEADS + KV_HEADS:
            out = k_ptr + slot[:, None] * stride_ks + (head - HEADS) * D + j[None, :]
        else:
            out = v_ptr + slot[:, None] * stride_vs + (head - HEADS - KV_HEADS) * D + j[None, :]
        tl.store(out, a.to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(out + HALF, b.to(k_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_add(a_ptr, w_ptr, h_ptr, M, N, stride_am, stride_wn, stride_hm,
              K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              SPLIT_K: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
              LINE: tl.constexpr, LINES: tl.constexpr):
    """One program: h[:, n] += a @ W[n].T for BLOCK_N columns n < N over share s of K. Programs own
    disjoint columns of h and read only a, so the add is in place; with SPLIT_K shares, each adds
    its partial sum into fp32 h atomically."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    per_split: tl.constexpr = (K + SPLIT_K * BLOCK_K - 1) // (SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = tl.program_id(1) * per_split
    k_stop = tl.minimum(k_start + per_split, K)
    nmask = n < N
    rows = tl.minimum(n, N - 1).to(tl.int64)
    acc, m, mmask = _stream_rows(a_ptr, a_ptr, w_ptr, rows, M, stride_am, stride_wn, 0.0, k_start, k_stop, K, BLOCK_M,
                                 BLOCK_N, BLOCK_K, False, DOT, PDL, PREFETCH, LINE, LINES)
    out = h_ptr + m[:, None] * stride_hm + n[None, :]
    mask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        h = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (h + acc).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")


@triton.jit
def _norm_gate_up(h_ptr, g_ptr, w_ptr, out_ptr, M, eps, stride_hm, stride_wn, stride_om,
                  I: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                  LINE: tl.constexpr, LINES: tl.constexpr):
    """One program: out[:, n] = silu(gate_n) * up_n for BLOCK_N columns n < I of the intermediate,
    with gate row n and up row I + n of the fused weight [2I, K] interleaved in one tile."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    gate_rows = tl.minimum(n, I - 1).to(tl.int64)
    rows = tl.interleave(gate_rows, gate_rows + I)  # gate n0, up n0, gate n0 + 1, ...
    acc, m, mmask = _stream_rows(h_ptr, g_ptr, w_ptr, rows, M, stride_hm, stride_wn, eps, 0, K, K, BLOCK_M,
                                 2 * BLOCK_N, BLOCK_K, True, DOT, PDL, PREFETCH, LINE, LINES)
    gate, up = _pairs(acc, BLOCK_M, BLOCK_N)
    act = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _norm_head(h_ptr, g_ptr, w_ptr, out_ptr, M, N, eps, stride_hm, stride_wn, stride_om,
               K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr,
              LINES: tl.constexpr):
    """One program: fp32 logits out[:, n] = norm(h) @ W[n].T for BLOCK_N vocabulary rows n; the
    last program's rows past N read row N - 1 and are not stored."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(n, N - 1).to(tl.int64)
    acc, m, mmask = _stream_rows(h_ptr, g_ptr, w_ptr, rows, M, stride_hm, stride_wn, eps, 0, K, K, BLOCK_M,
                                 BLOCK_N, BLOCK_K, True, DOT, PDL, PREFETCH, LINE, LINES)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, mask=mmask[:, None] & (n < N)[None, :])


def _launch_options(tiles: Tiles, pdl: bool, dtype: torch.dtype, k: int) -> dict:
    block_k = min(tiles.block_k, max(16, triton.next_power_of_2(k)))
    line = 128 // torch.empty((), dtype=dtype).element_size()  # elements in a 128-byte line
    options = dict(BLOCK_M=MAX_ROWS, BLOCK_K=block_k, DOT=_dot_mode(dtype), PDL=pdl, PREFETCH=pdl and PREFETCH_L2,
                   LINE=line, LINES=triton.next_power_of_2(triton.cdiv(k, line)),
                   num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if pdl:
        options["launch_pdl"] = True
    return options


def _check(x: torch.Tensor, weight: torch.Tensor, k: int, name: str) -> int:
    """Rows of x [M, k]; refuses shapes the kernels do not take."""
    if x.dim() != 2 or x.shape[1] != k or weight.shape[1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share K = {k}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{name}: takes 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name}: x and weight must be contiguous along K")
    return x.shape[0]


def norm_qkv_rope(h: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor, inv_freq: torch.Tensor,
                  positions: torch.Tensor, write_slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  *, heads: int, eps: float, tiles: Tiles | None = None, pdl: bool = False) -> torch.Tensor:
    """The attention block's input side, one kernel.

    h            [M, hidden]                          residual stream
    qkv_weight   [(heads + 2 kv_heads) * head_dim, hidden]
    inv_freq     [head_dim / 2] fp32                  `layers.rope_inv_freq`
    positions    [M] int64, write_slots [M] int64     the plan's; slot -1 is the sink
    k_pool/v_pool [slots, kv_heads, head_dim]         this layer's, written in place
    returns q    [M, heads * head_dim]                rotated, in the weight's dtype
    """
    tiles = tiles or TILES["qkv"]
    _, kv_heads, d = k_pool.shape
    m = _check(h, qkv_weight, h.shape[1], "norm_qkv_rope")
    if qkv_weight.shape[0] != (heads + 2 * kv_heads) * d or d % 2:
        raise ValueError(f"norm_qkv_rope: weight {tuple(qkv_weight.shape)} is not {heads} + 2 x {kv_heads} heads "
                         f"of an even head_dim {d}")
    q = torch.empty((m, heads * d), dtype=qkv_weight.dtype, device=h.device)
    grid = ((heads + 2 * kv_heads) * triton.cdiv(d // 2, tiles.block_n),)
    _norm_qkv_rope[grid](h, norm_weight, qkv_weight, inv_freq, positions, write_slots, q, k_pool, v_pool,
                         m, eps, k_pool.shape[0], h.stride(0), qkv_weight.stride(0), q.stride(0),
                         k_pool.stride(0), v_pool.stride(0), HEADS=heads, KV_HEADS=kv_heads, D=d, K=h.shape[1],
                         BLOCK_H=tiles.block_n, **_launch_options(tiles, pdl, qkv_weight.dtype, h.shape[1]))
    return q


def gemv_add(a: torch.Tensor, weight: torch.Tensor, h: torch.Tensor, *, tiles: Tiles | None = None,
             pdl: bool = False) -> torch.Tensor:
    """h [M, N] += a [M, K] @ weight [N, K].T, in place; returns h."""
    tiles = tiles or TILES["o"]
    m = _check(a, weight, a.shape[1], "gemv_add")
    n = weight.shape[0]
    if h.shape != (m, n) or h.stride(1) != 1:
        raise ValueError(f"gemv_add: h {tuple(h.shape)} must be [{m}, {n}], contiguous along N")
    if tiles.split_k > 1 and h.dtype != torch.float32:
        raise ValueError(f"gemv_add: split_k={tiles.split_k} adds shares atomically and needs an fp32 h, got {h.dtype}")
    options = _launch_options(tiles, pdl, weight.dtype, a.shape[1])
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    _gemv_add[grid](a, weight, h, m, n, a.stride(0), weight.stride(0), h.stride(0), K=a.shape[1],
                    BLOCK_N=tiles.block_n, SPLIT_K=tiles.split_k, **options)
    return h


def norm_gate_up(h: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor, *, eps: float,
                 tiles: Tiles | None = None, pdl: bool = False) -> torch.Tensor:
    """silu(norm(h) @ gate.T) * (norm(h) @ up.T) -> [M, intermediate] in the weight's dtype,
    gate_up_weight [2I, hidden]."""
    tiles = tiles or TILES["gate_up"]
    m = _check(h, gate_up_weight, h.shape[1], "norm_gate_up")
    inter = gate_up_weight.shape[0] // 2
    out = torch.empty((m, inter), dtype=gate_up_weight.dtype, device=h.device)
    options = _launch_options(tiles, pdl, gate_up_weight.dtype, h.shape[1])
    _norm_gate_up[(triton.cdiv(inter, tiles.block_n),)](h, norm_weight, gate_up_weight, out, m, eps, h.stride(0),
                                             gate_up_weight.stride(0), out.stride(0), I=inter, K=h.shape[1],
                                             BLOCK_N=tiles.block_n, **options)
    return out


def norm_head(h: torch.Tensor, norm_weight: torch.Tensor, head_weight: torch.Tensor, *, eps: float,
              tiles: Tiles | None = None, pdl: bool = False) -> torch.Tensor:
    """norm(h) @ head_weight.T -> fp32 logits [M, vocab]."""
    tiles = tiles or TILES["head"]
    m = _check(h, head_weight, h.shape[1], "norm_head")
    n = head_weight.shape[0]
    out = torch.empty((m, n), dtype=torch.float32, device=h.device)
    options = _launch_options(tiles, pdl, head_weight.dtype, h.shape[1])
    _norm_head[(triton.cdiv(n, tiles.block_n),)](h, norm_weight, head_weight, out, m, n, eps, h.stride(0),
                                                 head_weight.stride(0), out.stride(0), K=h.shape[1],
                                                 BLOCK_N=tiles.block_n, **options)
    return out


class FusedDecode:
    """A decode step of at most `max_rows` rows as the fused projections above and the streamed
    read, about five kernels a layer, launched as programmatic dependents where the GPU has PDL;
    anything else (more rows, a varlen step, the reference read) goes to
    `fallback` (default: the model). Same call as the model's; reads the model's own weights.

    Per layer: norm_qkv_rope (RMSNorm, q/k/v, RoPE, K/V into the pools) -> paged_attention ->
    gemv_add (o, residual) -> norm_gate_up (RMSNorm, gate/up, SwiGLU) -> gemv_add (down, residual).
    The residual stream h [rows, hidden] is kept in fp32 (so the o and down projections can add
    split shares of K into it atomically), updated in place; q, the read's output and the SwiGLU
    activations are in the weights' dtype."""

    def __init__(self, model, fallback: Callable | None = None, *, pdl: bool | None = None,
                 max_rows: int = MAX_ROWS) -> None:
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        self.model = model
        self.fallback = model if fallback is None else fallback
        self.pdl = supports_pdl(model.embed_tokens.weight.device) if pdl is None else pdl
        self.max_rows = max_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                 logits_index: torch.Tensor | None = None) -> torch.Tensor:
        rows, t = input_ids.shape
        if t != 1 or logits_index is not None or rows > self.max_rows or cache.cache.read != "streamed":
            return self.fallback(input_ids, positions, cache=cache, logits_index=logits_index)
        m, c, plan, kv, pdl = self.model, self.model.config, cache.plan, cache.cache, self.pdl
        eps = c.rms_norm_eps
        h = m.embed_tokens(input_ids[:, 0]).float()  # [rows, hidden] fp32, this step's own buffer
        pos = positions.view(-1)  # [rows]
        for i, layer in enumerate(m.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q = norm_qkv_rope(h, layer.input_layernorm.weight, attn.qkv_proj.weight, m.inv_freq, pos,
                              plan.write_slots, kv.k_pools[i], kv.v_pools[i], heads=attn.heads, eps=eps, pdl=pdl)
            out = paged_attention(q.view(rows, 1, attn.heads, attn.head_dim), kv.k_pools[i], kv.v_pools[i],
                                  plan.block_table, plan.table_rows, plan.block_size, plan.context_lens, positions,
                                  pdl=pdl)  # [rows, 1, heads, head_dim]
            gemv_add(out.view(rows, -1), attn.o_proj.weight, h, tiles=TILES["o"], pdl=pdl)
            act = norm_gate_up(h, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, eps=eps, pdl=pdl)
            gemv_add(act, mlp.down_proj.weight, h, tiles=TILES["down"], pdl=pdl)
        return norm_head(h, m.norm.weight, m.lm_head.weight, eps=eps, pdl=pdl)[:, None]  # [rows, 1, vocab] fp32
