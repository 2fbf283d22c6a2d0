"""The decode reads at head dims that are not powers of two (24, 40, 80).

The streamed kernels pad the head dim to a power of two (`D`) for their tiles; the padding lanes
must be masked, and the softmax scale must be 1/sqrt(head_dim), not 1/sqrt(D). Both kernel entry
points and all three variants are checked against the reference read, and the reference read
against a plain float64 softmax attention written here. Queries are scaled up so the scores span
several units: a wrong scale moves the output far past the tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch

from nanolab.engine.plan import derive_slot_mapping
from nanolab.kernels.paged_attention import paged_attention
from nanolab.kernels.reference import reference_read
from nanolab.lab.streambench import mapping_read

# Triton compiles for a GPU and runs its interpreter on CPU tensors elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIMS = [24, 40, 80]
SHAPES = {"gqa4:2": (4, 2), "mha2:2": (2, 2)}
PAGE = 4  # cache block size
LENS = [37, 5, 18]  # context lengths, this step's token included


def batch(head_dim: int, heads: int, kv_heads: int, seed: int = 0):
    """Pools with scattered blocks, a block table whose batch rows are not its table rows, and q."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    slots = num_blocks * PAGE + 1  # the last slot is the sink
    k_pool = torch.randn((slots, kv_heads, head_dim), generator=g)
    v_pool = torch.randn((slots, kv_heads, head_dim), generator=g)
    max_blocks = 12
    table = torch.full((6, max_blocks), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=g)
    table_rows = torch.tensor([4, 0, 2])  # batch row i owns table row table_rows[i]
    used = 0
    for row, n in zip(table_rows.tolist(), LENS):
        need = -(-n // PAGE)
        table[row, :need] = order[used:used + need].int()
        used += need
    lens = torch.tensor(LENS)
    q = 3.0 * torch.randn((len(LENS), 1, heads, head_dim), generator=g)
    return q, k_pool, v_pool, table, table_rows, lens


def float64_attention(q, k_pool, v_pool, mapping, lens) -> torch.Tensor:
    """Plain softmax attention, one row and one head at a time, in float64."""
    rows, _, heads, d = q.shape
    group = heads // k_pool.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(rows):
        slots = mapping[r, : int(lens[r])]
        for h in range(heads):
            k = k_pool[slots, h // group].double()
            v = v_pool[slots, h // group].double()
            scores = k @ q[r, 0, h].double() / math.sqrt(d)
            out[r, 0, h] = torch.softmax(scores, 0) @ v
    return out


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_reference_read_against_float64_attention(head_dim, shape):
    q, k_pool, v_pool, table, table_rows, lens = batch(head_dim, *shape)
    mapping = derive_slot_mapping(table, table_rows, lens, max(LENS), PAGE)
    positions = (lens - 1)[:, None]
    got = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    want = float64_attention(q, k_pool, v_pool, mapping, lens)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("variant", ["head", "gqa", "split"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_streamed_kernels_against_the_reference_read(head_dim, shape, variant):
    q, k_pool, v_pool, table, table_rows, lens = (t.to(DEVICE) for t in batch(head_dim, *shape, seed=head_dim))
    positions = (lens - 1)[:, None]
    width = max(LENS)
    mapping = derive_slot_mapping(table, table_rows, lens, width, PAGE)
    want = reference_read(q, k_pool, v_pool, mapping, lens, positions)
    assert want.abs().max() > 0.5  # the reads are not near zero, so the tolerance means something
    splits = 3 if variant == "split" else None  # 3 shares of 16-key tiles: the 37-key row spans them
    by_mapping = mapping_read(q, k_pool, v_pool, mapping, lens, positions, block=16, variant=variant, splits=splits)
    by_table = paged_attention(q, k_pool, v_pool, table, table_rows, PAGE, lens, positions, block=16,
                               variant=variant, splits=splits)
    assert by_table.device.type == DEVICE
    torch.testing.assert_close(by_mapping, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(by_table, want, atol=2e-5, rtol=2e-5)
