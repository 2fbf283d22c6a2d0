"""The capture bench's host-side pieces that run on a CPU: the greedy decode it compares and the
agreement counts (the timed arms and the graphs themselves need CUDA, and run on the H200 through
`scripts/gpu_run.sh capture`)."""

from __future__ import annotations

import pandas as pd

from nanolab import Engine, EngineConfig
from nanolab.engine.buckets import DecodeBuckets
from nanolab.lab.capturebench import CaptureBench, graph_agreement, rows_equal, table_stems
from nanolab.lab.reference import engine_greedy, hf_greedy, load_hf
from nanolab.lab.timing import random_prompts


def test_engine_greedy_decodes_transformers_tokens(tiny_model, tiny_path):
    prompts = random_prompts(3, 9, tiny_model.config.vocab_size, seed=4).tolist()
    engine = Engine(tiny_model, EngineConfig(num_blocks=32))
    ours = engine_greedy(engine, prompts, 5)
    hf = load_hf(tiny_path)
    assert ours == [hf_greedy(hf, p, 5) for p in prompts]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.allocator.num_free == engine.kv_cache.num_blocks  # finished rows gave their blocks back


def test_graph_agreement_counts_rows(tiny_model):
    prompts = random_prompts(4, 7, tiny_model.config.vocab_size, seed=5).tolist()
    plain = engine_greedy(Engine(tiny_model, EngineConfig(num_blocks=32)), prompts, 4)
    buckets = DecodeBuckets((1, 2, 4, 8), (32, 64))
    padded = Engine(tiny_model, EngineConfig(num_blocks=32, read="reference"), buckets=buckets)
    # On a CPU the "graphed" engine is one more padded engine: the counts are the plumbing's.
    graphed = Engine(tiny_model, EngineConfig(num_blocks=32, read="reference"), buckets=buckets)
    counts = graph_agreement(graphed, padded, prompts, plain, 4)
    assert counts == {"rows equal, graphs vs same shapes eager": 4, "rows equal, graphs vs unpadded eager": 4}
    wrong = [plain[0], [t + 1 for t in plain[1]], *plain[2:]]
    assert graph_agreement(graphed, padded, prompts, wrong, 4)["rows equal, graphs vs unpadded eager"] == 3
    assert rows_equal([[1, 2], [3]], [[1, 2], [4]]) == 1
    assert not graphed.has_unfinished_requests() and not padded.has_unfinished_requests()


def test_tables_are_named_as_the_chapters_load_them():
    frames = [pd.DataFrame({"n": [i]}) for i in range(4)]
    tables = CaptureBench(*frames).tables("day60")
    assert list(tables) == list(table_stems("day60")) == ["day60_decode", "day60_capture", "day60_agreement",
                                                          "day60_profile"]
    assert [t.n.item() for t in tables.values()] == [0, 1, 2, 3]  # steps, capture, agreement, profile
