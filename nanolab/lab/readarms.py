"""Candidate launches of the varlen read, handed to an engine at construction: a runner that gives
its cache another varlen read before its graphs are captured (`KVCache.varlen_reader`), so that a
bench can time the engine's steps with a candidate beside the engine's own, in one process.

- "persistent": a captured (padded) step's read launches `persistent_programs` programs a KV head
  and share, each looping over the step's query tiles (`varlen_attention`'s `programs`), where the
  engine launches one program for every tile the step's rows could fill. A step that is not
  padded reads as the engine's does.

    Engine(model, config, runner=READ_ARMS["persistent"])
"""

from __future__ import annotations

import torch

from nanolab.engine.runner import ModelRunner
from nanolab.kernels.varlen_attention import choose_varlen_splits, persistent_programs, varlen_attention


@torch.library.custom_op("nanolab_lab::persistent_varlen", mutates_args=())
def persistent_varlen_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                         table_rows: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                         positions: torch.Tensor, block_size: int, num_sms: int = 132) -> torch.Tensor:
    """`varlen_attention_op` with persistent programs: the flat grid cut for q's token count, its
    shares chosen for that count, `persistent_programs` programs a KV head and share."""
    n, heads, kv_heads = q.shape[0], q.shape[1], k_pool.shape[1]
    splits = choose_varlen_splits(n, 1, kv_heads, heads // kv_heads, num_sms)
    return varlen_attention(q, k_pool, v_pool, block_table, table_rows, block_size, query_start_loc, context_lens,
                            positions, max(n, 1), grid_tokens=max(n, 1), splits=splits,
                            programs=persistent_programs(kv_heads, splits, num_sms))


@persistent_varlen_op.register_fake
def _(q, k_pool, v_pool, block_table, table_rows, query_start_loc, context_lens, positions, block_size, num_sms=132):
    return torch.empty_like(q)


def persistent_varlen_read(view, layer: int, q: torch.Tensor, positions: torch.Tensor, *, engine_read
                           ) -> torch.Tensor:
    """A varlen step's read (`KVCache.varlen_reader`'s signature; q [1, tokens, heads, head_dim]):
    a padded plan's, and every compiled step's, through persistent programs; any other plan's
    through `engine_read`, the engine's own."""
    plan, kv = view.plan, view.cache
    if torch.compiler.is_compiling():
        return persistent_varlen_op(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                                    plan.query_start_loc, plan.context_lens, positions[0], plan.block_size,
                                    num_sms=kv.num_sms)[None]
    if not plan.padded:
        return engine_read(view, layer, q, positions)
    kv_heads = kv.k_pools[layer].shape[1]
    splits = choose_varlen_splits(plan.num_tokens, 1, kv_heads, q.shape[2] // kv_heads, kv.num_sms)
    return varlen_attention(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                            plan.block_size, plan.query_start_loc, plan.context_lens, positions[0],
                            plan.max_query_len, grid_tokens=plan.num_tokens, splits=splits,
                            programs=persistent_programs(kv_heads, splits, kv.num_sms))[None]


class PersistentReadRunner(ModelRunner):
    """A `ModelRunner` whose cache reads varlen steps through `persistent_varlen_read`, handed to
    it before the runner captures its graphs. Needs the streamed read (Triton)."""

    def __init__(self, model, kv_cache, **kwargs) -> None:
        if kv_cache.read != "streamed":
            raise ValueError(f"persistent programs are a launch of the streamed read; this cache reads "
                             f"{kv_cache.read!r}")
        engine_read = kv_cache.varlen_reader

        def read(view, layer, q, positions):
            return persistent_varlen_read(view, layer, q, positions, engine_read=engine_read)

        kv_cache.varlen_reader = read
        super().__init__(model, kv_cache, **kwargs)


READ_ARMS = {"engine": ModelRunner, "persistent": PersistentReadRunner}  # arm -> the runner an Engine takes
