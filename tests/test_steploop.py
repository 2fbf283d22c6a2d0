"""`lab.steploop` on a made-up trace: the timeline is cut at each graph replay, and what runs
between two replays is counted and timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanolab.lab.steploop import loop_records, middle_step_ops, step_loop


def trace(steps: int = 4, upload_ops: int = 4, graph_us: float = 100.0) -> list[dict]:
    """`steps` replays of a two-kernel graph, each followed by an argmax kernel, a read-back and
    `upload_ops` copies; each launched 50 us before the GPU gets to it."""
    events, t, corr = [], 0.0, 0

    def gpu(cat, name, dur, c):
        nonlocal t
        t += 1.0  # a gap of 1 us before every operation
        events.append({"cat": cat, "name": name, "ts": t, "dur": dur, "args": {"correlation": c}})
        t += dur

    for _ in range(steps):
        corr += 1
        events.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 50.0, "dur": 5.0,
                       "args": {"correlation": corr}})
        gpu("kernel", "layers", graph_us / 2, corr)
        gpu("kernel", "head", graph_us / 2, corr)
        for name, cat in [("_chunk_max", "kernel"), ("Memcpy DtoH", "gpu_memcpy")] + \
                [("Memcpy HtoD", "gpu_memcpy")] * upload_ops:
            corr += 1
            events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 3.0,
                           "args": {"correlation": corr}})
            gpu(cat, name, 2.0, corr)
    return events


def test_the_timeline_is_cut_at_each_replay():
    records = loop_records(trace(steps=4, upload_ops=4))
    assert len(records) == 3  # the last replay has no next one
    for r in records:
        assert r["graph_busy_us"] == 100.0
        assert r["graph_span_us"] == 101.0  # two kernels and the gap between them
        assert r["outside_ops"] == 6
        assert r["outside_busy_us"] == 12.0
        assert r["between_us"] == 6 * 3.0 + 1.0  # each op and its gap, and the gap before the next replay
        assert r["period_us"] == r["graph_span_us"] + r["between_us"]
        assert r["launch_to_start_us"] == 51.0


def test_fewer_uploads_show_as_fewer_ops_between_replays():
    many, one = loop_records(trace(upload_ops=4))[0], loop_records(trace(upload_ops=1))[0]
    assert many["outside_ops"] - one["outside_ops"] == 3
    assert many["between_us"] - one["between_us"] == 9.0


def test_the_typical_middle_step_is_listed_in_order():
    ops = middle_step_ops(trace(steps=5, upload_ops=2))
    assert list(ops.op) == ["_chunk_max", "Memcpy DtoH", "Memcpy HtoD", "Memcpy HtoD"]
    assert list(ops.gap_us) == [1.0] * 4
    assert middle_step_ops(trace(steps=1)).empty


def test_work_before_the_first_replay_and_out_of_order_events_are_placed_by_time():
    events = trace(steps=3, upload_ops=2)
    prefill = {"cat": "kernel", "name": "prefill", "ts": -500.0, "dur": 400.0, "args": {"correlation": 999}}
    events = [prefill] + events[::-1]  # a trace lists its events in no promised order
    records = loop_records(events)
    assert len(records) == 2 and all(r["outside_ops"] == 4 for r in records)  # the prefill is in none
    assert all(r["between_us"] == 4 * 3.0 + 1.0 for r in records)


def test_a_copy_on_another_stream_counts_in_the_step_it_starts_in():
    events = trace(steps=3, upload_ops=1)
    graph = [e for e in events if e["name"] == "layers"]
    # a read-back that starts 10 us into the second replay, on a stream of its own
    events.append({"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": graph[1]["ts"] + 10.0, "dur": 2.0,
                   "args": {"correlation": 500, "stream": 45}})
    first, second = loop_records(events)
    assert first["outside_ops"] == 3 and second["outside_ops"] == 4
    assert second["between_us"] == first["between_us"]  # it overlaps the replay: the gap after is the same


def test_the_typical_step_is_not_one_with_an_extra_write():
    events = trace(steps=5, upload_ops=2)
    chunk = [e for e in events if e["name"] == "_chunk_max"]
    # the middle step also writes a new block-table entry, as a step that crosses a block does
    middle = chunk[2]
    events.append({"cat": "kernel", "name": "index_put", "ts": middle["ts"] + 0.5, "dur": 0.1,
                   "args": {"correlation": 700}})
    ops = middle_step_ops(events)
    assert "index_put" not in set(ops.op) and len(ops) == 4


def test_step_loop_needs_graphs_and_refuses_bad_arguments_by_name():
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(graphs=None)))
    with pytest.raises(ValueError, match="llm: needs CUDA graphs"):
        step_loop(llm)
    llm.engine = SimpleNamespace(runner=SimpleNamespace(graphs=object()),
                                 block_manager=SimpleNamespace(max_rows=8))
    with pytest.raises(ValueError, match="new_tokens=1"):
        step_loop(llm, new_tokens=1)
    for batches in ((), (0,), (16,), (True,), (2.0,)):
        with pytest.raises(ValueError, match="batches="):
            step_loop(llm, batches=batches)
