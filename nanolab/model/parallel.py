"""Tensor parallelism: which slice of every weight a rank holds, and the collectives that join the
slices back up.

Megatron's split of a Llama layer, as vLLM and gpt-fast do it:
- q/k/v and gate/up are column-parallel: a rank holds some KV heads with the query heads that read
  them, and a slice of the intermediate size, and computes its share of the outputs alone;
- o and down are row-parallel: a rank multiplies its share of the inputs by its rows of the
  weight, and an all-reduce sums the partial outputs;
- the embedding and the head are split by vocabulary: a rank looks up only its own tokens (the
  rest read zeros, and an all-reduce fills them in) and computes only its own logits (an
  all-gather lays them side by side).

The KV cache follows the heads: a rank stores the K and V of its own KV heads only. Splits are
contiguous and as even as the counts allow, so a shape that does not divide still shards: at
TP = 2, SmolLM2's 3 KV heads go 2 and 1, with their 6 and 3 query heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanolab.model.config import ModelConfig


def split(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank's contiguous share of n items, the first n % world_size ranks one larger."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank of world_size, and the process group
    its collectives run in (None: the default group)."""

    rank: int
    world_size: int
    group: object = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        return split(config.num_key_value_heads, self.world_size, self.rank)

    def q_heads(self, config: ModelConfig) -> tuple[int, int]:
        """The query heads that read this rank's KV heads: whole groups, so attention stays local."""
        a, b = self.kv_heads(config)
        return a * config.q_per_kv, b * config.q_per_kv

    def intermediate(self, config: ModelConfig) -> tuple[int, int]:
        return split(config.intermediate_size, self.world_size, self.rank)

    def vocab(self, config: ModelConfig) -> tuple[int, int]:
        return split(config.vocab_size, self.world_size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., this rank's vocab share] -> [..., vocab_size]: every rank's share side by side,
        padded to the largest share for the all-gather and cut back after."""
        widest = split(vocab_size, self.world_size, 0)[1]
        pad = widest - logits.shape[-1]
        local = torch.nn.functional.pad(logits, (0, pad)) if pad else logits.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        widths = [b - a for a, b in (split(vocab_size, self.world_size, r) for r in range(self.world_size))]
        return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


def check_shardable(config: ModelConfig, world_size: int, name: str = "tensor_parallel_size") -> None:
    """Refuse a group that would leave a rank without a KV head (the one thing a share cannot be empty of)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{name}={world_size!r}: must be a positive int")
    if world_size > config.num_key_value_heads:
        raise ValueError(f"{name}={world_size}: the model has {config.num_key_value_heads} KV heads, and every rank "
                         f"needs at least one (the KV cache is split by KV head)")


def shard_state(state: dict[str, torch.Tensor], config: ModelConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """This rank's slice of a fused state dict (`llama._fuse`'s names): q/k/v rows of its heads,
    gate/up rows of its intermediate share, o and down columns to match, embedding and head rows
    of its vocabulary share; norms whole."""
    d = config.head_dim
    (q0, q1), (k0, k1) = tp.q_heads(config), tp.kv_heads(config)
    (i0, i1), (v0, v1) = tp.intermediate(config), tp.vocab(config)
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    out = {}
    for name, w in state.items():
        if name.endswith("qkv_proj.weight"):  # [(heads + 2 kv) * d, hidden]
            q, k, v = w.split((heads * d, kv * d, kv * d))
            w = torch.cat((q[q0 * d:q1 * d], k[k0 * d:k1 * d], v[k0 * d:k1 * d]))
        elif name.endswith("o_proj.weight"):  # [hidden, heads * d]
            w = w[:, q0 * d:q1 * d]
        elif name.endswith("gate_up_proj.weight"):  # [2 inter, hidden]
            gate, up = w.split((inter, inter))
            w = torch.cat((gate[i0:i1], up[i0:i1]))
        elif name.endswith("down_proj.weight"):  # [hidden, inter]
            w = w[:, i0:i1]
        elif name in ("embed_tokens.weight", "lm_head.weight"):  # [vocab, hidden]
            w = w[v0:v1]
        out[name] = w.contiguous()
    return out
