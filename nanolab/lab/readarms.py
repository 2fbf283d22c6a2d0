"""Launches of the varlen read other than the engine's, handed to an engine at construction: a
runner that gives its cache another varlen read before its graphs are captured
(`KVCache.varlen_reader`), so that a bench can time the engine's steps with a candidate, or with a
launch the engine replaced, beside the engine's own, in one process.

A captured (padded) step's read cuts a flat grid for the most query tiles its size could fill. The
engine cuts its walks into `captured_splits` shares and launches persistent programs where they
are split (`captured_programs`), a program for every tile the grid could need where they are not.
The arms, each for every padded step and every compiled one (a step that is not padded reads as
the engine's does), take the share count the engine took before, `choose_varlen_splits` for the
capture size:

- "flat": a program for every tile the grid could need, split or not: the engine's read before it
  took persistent programs and `captured_splits`;
- "persistent": `persistent_programs` programs a KV head and share, each looping over the step's
  query tiles, split or not.

    Engine(model, config, runner=READ_ARMS["flat"])
"""

from __future__ import annotations

import torch

from nanolab.engine.runner import ModelRunner
from nanolab.kernels.varlen_attention import choose_varlen_splits, persistent_programs, varlen_attention

LAUNCHES = ("flat", "persistent")


def _programs(launch: str, kv_heads: int, splits: int, num_sms: int) -> int | None:
    if launch not in LAUNCHES:
        raise ValueError(f"launch {launch!r}: one of {', '.join(LAUNCHES)}")
    return persistent_programs(kv_heads, splits, num_sms) if launch == "persistent" else None


@torch.library.custom_op("nanolab_lab::launched_varlen", mutates_args=())
def launched_varlen_op(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                       table_rows: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                       positions: torch.Tensor, block_size: int, launch: str, num_sms: int = 132) -> torch.Tensor:
    """`varlen_attention_op` with `launch`'s grid (one of `LAUNCHES`): the flat grid cut for q's
    token count, its shares chosen for that count."""
    n, heads, kv_heads = q.shape[0], q.shape[1], k_pool.shape[1]
    splits = choose_varlen_splits(n, 1, kv_heads, heads // kv_heads, num_sms)
    return varlen_attention(q, k_pool, v_pool, block_table, table_rows, block_size, query_start_loc, context_lens,
                            positions, max(n, 1), grid_tokens=max(n, 1), splits=splits,
                            programs=_programs(launch, kv_heads, splits, num_sms))


@launched_varlen_op.register_fake
def _(q, k_pool, v_pool, block_table, table_rows, query_start_loc, context_lens, positions, block_size, launch,
      num_sms=132):
    return torch.empty_like(q)


def launched_varlen_read(view, layer: int, q: torch.Tensor, positions: torch.Tensor, *, launch: str, engine_read
                         ) -> torch.Tensor:
    """A varlen step's read (`KVCache.varlen_reader`'s signature; q [1, tokens, heads, head_dim]):
    a padded plan's, and every compiled step's, through `launch`'s grid (one of `LAUNCHES`); any
    other plan's through `engine_read`, the engine's own."""
    plan, kv = view.plan, view.cache
    if torch.compiler.is_compiling():
        return launched_varlen_op(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                                  plan.query_start_loc, plan.context_lens, positions[0], plan.block_size, launch,
                                  num_sms=kv.num_sms)[None]
    if not plan.padded:
        return engine_read(view, layer, q, positions)
    kv_heads = kv.k_pools[layer].shape[1]
    splits = choose_varlen_splits(plan.num_tokens, 1, kv_heads, q.shape[2] // kv_heads, kv.num_sms)
    return varlen_attention(q[0], kv.k_pools[layer], kv.v_pools[layer], plan.block_table, plan.table_rows,
                            plan.block_size, plan.query_start_loc, plan.context_lens, positions[0],
                            plan.max_query_len, grid_tokens=plan.num_tokens, splits=splits,
                            programs=_programs(launch, kv_heads, splits, kv.num_sms))[None]


class LaunchReadRunner(ModelRunner):
    """A `ModelRunner` whose cache reads varlen steps through `launched_varlen_read` with the class's
    `launch` (one of `LAUNCHES`, set by each subclass), handed to it before the runner captures its
    graphs. Needs the streamed read (Triton)."""

    launch: str

    def __init__(self, model, kv_cache, **kwargs) -> None:
        if kv_cache.read != "streamed":
            raise ValueError(f"the {self.launch} launch is one of the streamed read; this cache reads "
                             f"{kv_cache.read!r}")
        engine_read, launch = kv_cache.varlen_reader, self.launch

        def read(view, layer, q, positions):
            return launched_varlen_read(view, layer, q, positions, launch=launch, engine_read=engine_read)

        kv_cache.varlen_reader = read
        super().__init__(model, kv_cache, **kwargs)


class FlatReadRunner(LaunchReadRunner):
    launch = "flat"


class PersistentReadRunner(LaunchReadRunner):
    launch = "persistent"


# arm -> the runner an Engine takes
READ_ARMS = {"engine": ModelRunner, "flat": FlatReadRunner, "persistent": PersistentReadRunner}
