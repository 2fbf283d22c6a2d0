"""`Attention`: grouped-query attention over the paged cache.

It never touches the pools itself: it hands this forward's K/V and queries to the `cache` view it
is given (`engine.kv_cache.CacheView`), which writes them and reads through the read the engine
was built with. On a GPU, q's and k's rotation and the K/V write are one kernel
(`CacheView.write_rotated`); elsewhere (the CPU, Triton's interpreter) they are torch ops and a
write.
"""

from __future__ import annotations

import torch
from torch import nn

from nanolab.kernels import INTERPRETED
from nanolab.model.config import ModelConfig
from nanolab.model.layers import Linear, apply_rope
from nanolab.model.parallel import TensorParallel


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.tp = tp
        # Under tensor parallelism, this rank's KV heads and the query heads that read them.
        q0, q1 = tp.q_heads(config) if tp else (0, config.num_attention_heads)
        k0, k1 = tp.kv_heads(config) if tp else (0, config.num_key_value_heads)
        self.heads, self.kv_heads = q1 - q0, k1 - k0
        self.head_dim = config.head_dim
        # q, k and v fused into one matmul: [(heads + 2 * kv_heads) * head_dim, hidden]
        self.qkv_proj = Linear(config.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache):
        out = self.o_proj(self.attend(self.qkv_proj(x), cos, sin, positions, cache))
        return self.tp.all_reduce(out) if self.tp else out  # row-parallel: the ranks' partial sums

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, cache
               ) -> torch.Tensor:
        """What lies between the two projections: qkv [rows, T, (heads + 2 kv_heads) head_dim], the
        q/k/v projection's output, rotated, its K/V written to the cache and its q read against it
        -> [rows, T, heads head_dim], the o projection's input."""
        rows, t, _ = qkv.shape
        qkv = qkv.view(rows, t, self.heads + 2 * self.kv_heads, self.head_dim)
        if qkv.is_cuda and not INTERPRETED:
            q = cache.write_rotated(self.layer, qkv, cos, sin, self.heads)
            # Eagerly, qkv's K/V heads now hold what was written; compiled (decode), nothing reads them.
            k, v = (None, None) if torch.compiler.is_compiling() else qkv[:, :, self.heads:].split(self.kv_heads, dim=2)
        else:
            # Rotate q and k in one call: they are the first heads + kv_heads of the fused output.
            qk = apply_rope(qkv[:, :, : self.heads + self.kv_heads], cos, sin)
            q, k = qk.split((self.heads, self.kv_heads), dim=2)
            v = qkv[:, :, self.heads + self.kv_heads :]
            cache.write(self.layer, k, v)  # k, v: [rows, T, kv_heads, head_dim]
        out = cache.read(self.layer, q, positions, k, v)  # [rows, T, heads, head_dim]
        return out.reshape(rows, t, self.heads * self.head_dim)
