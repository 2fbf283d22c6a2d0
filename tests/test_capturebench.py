"""The capture bench's host-side pieces that run on a CPU: the agreement counts (the timed arms
and the graphs themselves need CUDA, and run on the H200 through `scripts/gpu_run.sh capture`)."""

from __future__ import annotations

from nanolab import Engine
from nanolab.bench import random_prompts
from nanolab.capturebench import graph_agreement, rows_equal
from nanolab.reference import engine_greedy, nanolab_greedy


def test_engine_greedy_decodes_what_a_fresh_engine_does(tiny_model):
    prompts = random_prompts(3, 9, tiny_model.config.vocab_size, seed=4).tolist()
    engine = Engine(tiny_model, num_blocks=32)
    ours = engine_greedy(engine, prompts, 5)
    assert [len(t) for t in ours] == [5, 5, 5]
    assert ours == nanolab_greedy(tiny_model, prompts, 5)
    assert not engine.has_unfinished_requests()
    assert engine.cache.allocator.num_free == engine.cache.num_blocks  # finished rows gave their blocks back


def test_graph_agreement_counts_rows(tiny_model):
    prompts = random_prompts(4, 7, tiny_model.config.vocab_size, seed=5).tolist()
    plain = nanolab_greedy(tiny_model, prompts, 4)
    engine = Engine(tiny_model, num_blocks=32)  # no graphs: both of its passes are the eager step
    counts = graph_agreement(engine, prompts, plain, 4)
    assert counts == {"rows equal, graphs vs same shapes eager": 4, "rows equal, graphs vs unpadded eager": 4}
    assert engine.graphs is None  # set aside and put back
    wrong = [plain[0], [t + 1 for t in plain[1]], *plain[2:]]
    assert graph_agreement(engine, prompts, wrong, 4)["rows equal, graphs vs unpadded eager"] == 3
    assert rows_equal([[1, 2], [3]], [[1, 2], [4]]) == 1
