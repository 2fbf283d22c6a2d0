"""Day 64's prefixbench on the CPU: the seeded plans, the ideal hit count by hand, the /metrics
reading, the reductions and gates from known tables, the no-hit passes of two tiny engines in
one process, and one caching server (the tiny model) through every server part. The H200's run
is `scripts/gpu_run.sh prefix`."""

from __future__ import annotations

import argparse
import http.server
import threading
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from nanolab.config import EngineConfig
from nanolab.lab import report
from nanolab.lab.plots.prefix import plot_nohit_throughput, plot_prefix_ttft
from nanolab.lab.prefixbench import (
    HITS,
    PREFIX_SIZES,
    QUERIES,
    TTFT_SPLIT,
    PrefixBench,
    PrefixCounters,
    PrefixSizes,
    add_arguments,
    add_server_steps,
    check_prefix_requests,
    conversation,
    hitrate_plan,
    ideal_hits,
    median_interval,
    nohit_configs,
    nohit_pairs,
    prefix_counters,
    prefix_ratios,
    reply_ids,
    run_nohit,
    run_prefixbench,
    run_server_arm,
    shared_prompts,
    sizes_from_args,
    ttft_summary,
)
from nanolab.lab.serveprocess import parse_metrics, serve_command
from nanolab.lab.workload import TOKEN_ID_FLOOR, PlannedRequest, Workload
from nanolab.model.tokenizer import Tokenizer

SIZES = PrefixSizes(
    system_len=40, suffix_len=(3, 9), shared_requests=3, max_tokens=2, history_len=48, question_len=5,
    turn1_tokens=4, conversations=2, systems=3, hit_system_len=32, hit_rate=20.0, hit_duration_s=0.4,
    hit_output_len=(1, 3), nohit_requests=4, nohit_repeats=2, warmup=1)


# The plans.


def test_the_plans_share_what_they_say_and_are_seeded():
    warmups, prompts = shared_prompts(SIZES, 500, seed=1)
    assert (warmups, prompts) == shared_prompts(SIZES, 500, seed=1) != shared_prompts(SIZES, 500, seed=2)
    system = prompts[0][:40]
    assert all(p[:40] == system and 3 <= len(p) - 40 <= 9 for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == len(prompts)  # a suffix of its own each
    assert len(warmups) == 1 and len(warmups[0]) == len(prompts[0]) and warmups[0][:16] != system[:16]
    assert min(min(p) for p in prompts) >= TOKEN_ID_FLOOR and max(max(p) for p in prompts) < 500

    turn1, question = conversation(SIZES, 500, 0)
    assert len(turn1) == 48 + 5 and len(question) == 5 and conversation(SIZES, 500, 1)[0][:48] != turn1[:48]

    plan, picks = hitrate_plan(SIZES, 500, seed=0)
    assert len(plan) == len(picks) == round(20.0 * 0.4) and set(picks) <= {0, 1, 2}
    heads = {}
    for r, k in zip(plan, picks):
        assert heads.setdefault(k, r.prompt_token_ids[:32]) == r.prompt_token_ids[:32]  # one system prompt per pick
        assert 3 <= len(r.prompt_token_ids) - 32 <= 9 and 1 <= r.max_tokens <= 3
    assert len(set(heads.values())) == len(heads)
    assert [r.arrival_s for r in plan] == sorted(r.arrival_s for r in plan)


def test_ideal_hits_by_hand():
    plan = [PlannedRequest(i, float(i), tuple(range(n)), 1) for i, n in enumerate((40, 40, 40, 32, 33))]
    # block 16, system 32: the first of prompt 0 and of 1 miss; the later 0s find 2 blocks, but a
    # 32-token prompt leaves its last token uncached: 1 block.
    assert ideal_hits(plan, [0, 1, 0, 0, 0], 32, 16) == (185, 32 + 16 + 32)
    assert ideal_hits(plan, [0, 1, 2, 3, 4], 32, 16) == (185, 0)  # every prompt its own
    assert ideal_hits(plan, [0, 0, 0, 0, 0], 40, 16) == (185, 32 * 3 + 16)  # a partial block is never shared
    # by arrival, not list order (which would give the 32-token prompt its 1 block: 80)
    assert ideal_hits(plan[::-1], [0, 0, 0, 1, 1][::-1], 32, 16) == (185, 32 * 3)


def test_reply_ids_re_encode_or_stand_in(tiny_path):
    tok = Tokenizer.from_dir(tiny_path)
    ids = tok.encode("the engine reads", add_special_tokens=False)
    assert reply_ids("the engine reads", len(ids), tok, 512, 0) == (ids, "re-encoded")
    stand, source = reply_ids("the engine reads", len(ids) + 3, tok, 512, 0)
    assert source == "stand-in" and len(stand) == len(ids) + 3 and min(stand) >= TOKEN_ID_FLOOR
    assert reply_ids("", 5, tok, 512, 0) == reply_ids("x", 5, tok, 512, 0)  # seeded by conversation
    assert reply_ids("", 5, tok, 512, 1) != reply_ids("", 5, tok, 512, 0)


# The server's counters.

METRICS = f"""\
# HELP nanolab:prefix_cache_queries Prompt tokens looked up in the prefix cache.
# TYPE nanolab:prefix_cache_queries counter
{QUERIES}{{model_name="m",engine="0"}} 300.0
{QUERIES}{{model_name="m",engine="1"}} 20.0
# HELP nanolab:prefix_cache_hits Prompt tokens found in the prefix cache.
# TYPE nanolab:prefix_cache_hits counter
{HITS}{{model_name="m"}} 256.0
# TYPE nanolab:num_requests_running gauge
nanolab:num_requests_running 2.0
"""


def _serve(routes: dict[str, tuple[int, str]]):
    """A stand-in HTTP server on a free loopback port answering GET `path` with (status, body)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = routes.get(self.path, (404, "no"))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_counters_are_read_from_the_prometheus_text():
    values = parse_metrics(METRICS)
    assert values[QUERIES] == 320.0 and values[HITS] == 256.0  # label sets summed
    server, url = _serve({"/metrics": (200, METRICS)})
    try:
        got = prefix_counters(url)
        assert got == PrefixCounters(320.0, 256.0) and got.hit_rate == pytest.approx(0.8)
        assert (got - PrefixCounters(300.0, 200.0)) == PrefixCounters(20.0, 56.0)
        assert np.isnan(PrefixCounters(0, 0).hit_rate)
    finally:
        server.shutdown()
    for routes in ({}, {"/metrics": (200, "# TYPE other counter\nother_total 1.0\n")}):  # no /metrics; no counters
        server, url = _serve(routes)
        try:
            assert prefix_counters(url) is None
        finally:
            server.shutdown()


# The reductions, from tables whose answers are known.


def test_each_request_gets_the_server_steps_inside_its_window():
    steps = pd.DataFrame({"t": [1.0, 1.1, 1.2, 1.3, 2.05, 2.1, 2.2, 3.5],
                          "phase": ["prefill", "prefill", "decode", "decode", "prefill", "mixed", "decode", "prefill"],
                          "tokens": [512, 40, 1, 1, 24, 9, 2, 7], "graph": [False, True, True, True, True, False,
                                                                            True, False],
                          "ms": [5.0, 2.0, 1.0, 1.0, 1.5, 2.5, 1.0, 9.0]})
    rows = [{"window": (0.9, 1.35)}, {"window": (2.0, 2.3)}, {"window": (4.0, 5.0)}]
    add_server_steps(rows, steps)
    assert [(r["server_prefill_steps"], r["server_prefill_tokens"], r["server_prefill_graphed"],
             r["server_prefill_ms"]) for r in rows] == [(2, 552, 1, 7.0), (2, 33, 1, 4.0), (0, 0, 0, 0.0)]
    assert not any("window" in r for r in rows)


def test_a_requests_ttft_splits_into_parts_that_add_up():
    """Sent at 10.000 s, taken by the core at 10.002, two prompt steps called at 10.003 and 10.010
    (4 and 3 ms of forward inside 5 and 4 ms calls), first chunk at 10.016: every part as
    worked out by hand, and the parts add up to the TTFT."""
    steps = pd.DataFrame({"t0": [10.003, 10.010, 10.015], "t": [10.008, 10.014, 10.0155],
                          "phase": ["prefill", "mixed", "decode"], "tokens": [512, 40, 1],
                          "graph": [False, True, True], "ms": [4.0, 3.0, 0.4]})
    row = {"window": (9.9, 10.1), "sent_t": 10.000, "first_t": 10.016, "ttft_ms": 16.0}
    add_server_steps([row], steps, pd.Series([9.5, 10.002]))
    got = {k: round(row[k], 6) for k in TTFT_SPLIT}
    assert got == {"front_ms": 2.0, "core_wait_ms": 1.0, "step_host_ms": 2.0, "server_prefill_ms": 7.0,
                   "between_steps_ms": 2.0, "back_ms": 2.0}
    assert sum(got.values()) == pytest.approx(row["ttft_ms"])
    bare = {"window": (9.9, 10.1)}  # a log without start times or events: the split is NaN
    add_server_steps([bare], steps.drop(columns="t0"))
    assert all(np.isnan(bare[k]) for k in TTFT_SPLIT if k != "server_prefill_ms")


def _shared(off_warm, on_warm, off_cold=100.0, on_cold=100.0) -> pd.DataFrame:
    rows = [("off", "cold", off_cold, 0), ("on", "cold", on_cold, 0)]
    rows += [("off", "warm", t, 0) for t in off_warm] + [("on", "warm", t, 256) for t in on_warm]
    return pd.DataFrame([{"arm": a, "phase": p, "ttft_ms": t, "ok": True, "prompt_len": 300, "cached_tokens": c,
                          "server_prefill_tokens": 300 - c, "server_prefill_ms": t / 2} for a, p, t, c in rows])


def _turns(off2, on2) -> pd.DataFrame:
    rows = []
    for arm, t2 in (("off", off2), ("on", on2)):
        for c, t in enumerate(t2):
            cached = 608 if arm == "on" else 0
            rows += [{"arm": arm, "conversation": c, "turn": 1, "ttft_ms": 90.0, "ok": True, "prompt_len": 600,
                      "cached_tokens": 0, "server_prefill_tokens": 600, "server_prefill_ms": 80.0},
                     {"arm": arm, "conversation": c, "turn": 2, "ttft_ms": t, "ok": True, "prompt_len": 650,
                      "cached_tokens": cached, "server_prefill_tokens": 650 - cached, "server_prefill_ms": t / 2}]
    return pd.DataFrame(rows)


NOHIT = pd.DataFrame({"repeat": [0, 0, 1, 1, 2, 2], "arm": ["off", "on", "on", "off", "off", "on"],
                      "tokens_per_s": [100.0, 99.5, 98.0, 100.0, 100.0, 101.0], "prefix_hits": [0] * 6})
HITRATE = pd.DataFrame([{"hit_rate": 0.8, "ideal_hit_rate": 0.85, "hit_tokens": 800.0, "queried_tokens": 1000.0,
                         "metrics": "present", "requests": 10, "failed": 0, "token_mismatches": 0}])


def test_ratios_from_known_tables():
    summary = ttft_summary(_shared([40, 50, 60, 70], [4, 5, 6, 100]), _turns([40, 40], [10, 10]))
    s = summary.set_index(["part", "phase", "arm"])
    assert s.loc[("shared prefix", "warm", "off")].ttft_p50_ms == 55.0
    assert s.loc[("shared prefix", "warm", "on")].ttft_p50_ms == 5.5
    assert s.loc[("shared prefix", "warm", "on")].ttft_p90_ms == pytest.approx(6 + 0.7 * 94)  # linear, as numpy
    assert s.loc[("shared prefix", "cold", "on")].requests == 1
    assert s.loc[("multi-turn", "turn 2", "on")].cached_tokens == 608
    assert s.loc[("multi-turn", "turn 2", "on")].server_prefill_tokens == 42
    assert list(summary.part.unique()) == ["shared prefix", "multi-turn"]

    pairs = nohit_pairs(NOHIT)
    assert pairs.ratio.tolist() == pytest.approx([0.995, 0.98, 1.01])
    r = prefix_ratios(summary, NOHIT, HITRATE).set_index("ratio")
    assert r.loc["shared prefix, warm: TTFT p50 off / on"].value == pytest.approx(10.0)
    assert r.loc["shared prefix, warm: TTFT p50 off / on"].met
    assert r.loc["multi-turn, turn 2: TTFT p50 off / on"].value == pytest.approx(4.0)
    assert not r.loc["multi-turn, turn 2: TTFT p50 off / on"].met  # 4x is short of the 5x aim
    nohit = r.loc["no hits: output tokens/s on / off, median of repeats"]
    assert nohit.value == pytest.approx(0.995) and nohit.met
    assert "95% bootstrap interval of the median 0.980 to 1.010 over 3 repeats" in nohit.detail
    lo, hi = median_interval([0.97, 0.99, 1.0, 1.01, 1.03] * 6)
    assert lo < 1.0 < hi and hi - lo < 0.03 and (lo, hi) == median_interval([0.97, 0.99, 1.0, 1.01, 1.03] * 6)
    assert all(np.isnan(median_interval([1.0])))  # one repeat has no spread to resample
    slower = NOHIT.assign(tokens_per_s=[100.0, 98.0, 98.5, 100.0, 100.0, 101.0])
    assert not prefix_ratios(summary, slower, HITRATE).set_index("ratio").loc[nohit.name].met  # median 0.985
    hit = r.loc["hit rate from /metrics / ideal"]
    assert hit.value == pytest.approx(0.8 / 0.85) and hit.met
    assert not prefix_ratios(summary, NOHIT, HITRATE.assign(hit_rate=0.5)).met.iloc[-1]
    # a part not run leaves its ratio out
    assert len(prefix_ratios(ttft_summary(pd.DataFrame(), pd.DataFrame()), pd.DataFrame(), pd.DataFrame())) == 0


def test_the_request_gate_fails_on_each_defect():
    shared, turns, servers = _shared([50], [5]), _turns([40], [10]), pd.DataFrame({"server_exit": [0, 0]})
    ok = check_prefix_requests(shared, turns, HITRATE, NOHIT, servers)
    assert ok, ok
    assert ok.numbers["sequential requests"] == 8 and ok.numbers["no-hit passes"] == 6
    assert not check_prefix_requests(shared.assign(ok=[True, False, True, True]), turns, HITRATE, NOHIT, servers)
    assert not check_prefix_requests(shared, turns, HITRATE.assign(token_mismatches=1), NOHIT, servers)
    assert not check_prefix_requests(shared, turns, HITRATE, NOHIT, pd.DataFrame({"server_exit": [0, -9]}))
    hit = check_prefix_requests(shared, turns, HITRATE, NOHIT.assign(prefix_hits=[0, 16, 0, 0, 0, 0]), servers)
    assert not hit and hit.numbers["no-hit passes with a hit"] == 1
    empty = pd.DataFrame()
    assert not check_prefix_requests(empty, empty, empty, empty, empty)  # nothing measured is no pass


def test_tables_carry_the_run_label_and_plots_draw(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DATA_DIR", tmp_path)
    bench = PrefixBench(_shared([50, 60], [5, 6]), _turns([40], [10]), NOHIT, HITRATE,
                        pd.DataFrame({"arm": ["off", "on"], "server_exit": [0, 0]}))
    tables = bench.tables("day64")
    assert list(tables) == ["day64_shared", "day64_turns", "day64_ttft", "day64_nohit", "day64_hitrate",
                            "day64_servers", "day64_ratios"]
    label = report.run_label("cpu", "tiny", "float32", weights="synthesized random")
    path = report.save_table(tables["day64_ttft"], "day64_ttft", label)
    assert path == tmp_path / "day64_ttft_cpu.csv"  # the device slug: a CPU run never overwrites the H200's
    saved = pd.read_csv(path)
    assert {"part", "phase", "arm", "ttft_p50_ms", "ttft_p90_ms", "device", "device_slug", "model", "dtype", "date",
            "torch", "weights"} <= set(saved.columns)
    assert (saved.model == "tiny").all() and (saved.device_slug == "cpu").all()
    assert "day64_nohit" not in PrefixBench(bench.shared, bench.turns, pd.DataFrame(), pd.DataFrame(),
                                            bench.servers).tables()
    fig = plot_prefix_ttft(bench.summary)
    assert len(fig.axes) == 2 and {t.get_text() for t in fig.axes[0].texts} == {"1.0x", "10.0x"}
    assert len(plot_nohit_throughput(NOHIT).axes) == 2


# The command line.


def test_flags_override_the_device_sizes_and_a_bad_part_is_refused():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--system-len", "256", "--history-len", "512", "--suffix-len", "4,8"])
    sizes = sizes_from_args(args, "cpu")
    assert (sizes.system_len, sizes.history_len, sizes.suffix_len) == (256, 512, (4, 8))
    assert sizes.conversations == PREFIX_SIZES["cpu"].conversations
    assert sizes_from_args(parser.parse_args([]), "cuda") == PREFIX_SIZES["cuda"]
    with pytest.raises(ValueError, match="system_len"):
        sizes_from_args(parser.parse_args(["--system-len", "0"]), "cpu")
    with pytest.raises(ValueError, match="bogus"):
        run_prefixbench("tiny", "cpu", SIZES, ("shared", "bogus"))
    # tiny's context is 2,048 tokens: a part whose longest request would pass it is refused before
    # any server starts (each request would otherwise fail with a 400, and the plot had no TTFT to draw)
    assert replace(SIZES, system_len=1024).longest("shared") == 1024 + SIZES.suffix_len[1] + SIZES.max_tokens
    # each part's bound holds the longest request its own plans make, new tokens included
    sizes = replace(SIZES, suffix_len=(9, 9), hit_output_len=(3, 3))  # the extremes drawn for certain
    _, shared = shared_prompts(sizes, 500)
    assert sizes.longest("shared") == max(map(len, shared)) + sizes.max_tokens
    turn1, question = conversation(sizes, 500, 0)
    assert sizes.longest("turns") == len(turn1) + sizes.turn1_tokens + len(question) + sizes.max_tokens
    plan, _ = hitrate_plan(sizes, 500)
    assert sizes.longest("hitrate") == max(len(r.prompt_token_ids) + r.max_tokens for r in plan)
    with pytest.raises(ValueError, match="turns: a request would hold 2"):
        run_prefixbench("tiny", "cpu", replace(SIZES, history_len=2048), ("shared", "turns"))


def test_the_server_takes_the_prefix_caching_flag(tmp_path):
    from nanolab.entrypoints.openai.api_server import add_arguments as server_arguments

    parser = argparse.ArgumentParser()
    server_arguments(parser)
    argv = lambda **kw: serve_command("tiny", 1, device="cpu", eager=True, step_log=tmp_path / "s", **kw)
    assert parser.parse_args(argv(prefix_caching=True)[4:]).enable_prefix_caching is True
    assert parser.parse_args(argv(prefix_caching=False)[4:]).enable_prefix_caching is False
    assert not any("prefix" in a for a in argv())  # the server's default


# The parts, on the tiny model.


def test_nohit_passes_alternate_in_one_process(tiny_path, one_thread):
    base = EngineConfig(model=str(tiny_path), device="cpu", kv_cache_bytes=16 << 20, max_num_seqs=8)
    configs = nohit_configs(base)
    assert configs["on"].enable_prefix_caching and not configs["off"].enable_prefix_caching
    assert configs["on"].replace(enable_prefix_caching=False) == configs["off"]  # nothing else differs
    table = run_nohit(base, Workload((20, 40), (2, 4), 1.0, 1, 4), 4, 2, log=lambda _: None)
    assert table[["repeat", "arm", "position"]].values.tolist() == [[0, "off", 0], [0, "on", 1], [1, "on", 0],
                                                                     [1, "off", 1]]
    assert (table.output_tokens == table.groupby("repeat").output_tokens.transform("first")).all()  # same plan
    on, off = table[table.arm == "on"], table[table.arm == "off"]
    assert (on.prefix_queries == on.prompt_tokens).all() and (off.prefix_queries == 0).all()
    assert (table.prefix_hits == 0).all() and (table.tokens_per_s > 0).all()
    assert len(nohit_pairs(table)) == 2


def test_a_caching_server_through_every_server_part(tiny_path, tmp_path):
    tok = Tokenizer.from_dir(tiny_path)
    arm = run_server_arm("on", "tiny", "cpu", 512, tok, SIZES, ("shared", "turns", "hitrate"), eager=True,
                         start_timeout_s=60, workdir=tmp_path, log=lambda _: None)
    assert arm.server["server_exit"] == 0 and arm.server["metrics"] == "present"
    shared = pd.DataFrame(arm.shared)
    assert shared.ok.all() and list(shared.phase) == ["cold", "warm", "warm"]
    assert shared.cached_tokens.tolist() == [0, 32, 32]  # the system prompt's 2 full blocks of 16, once cached
    assert (shared.queried_tokens == shared.prompt_len).all()
    # the step log agrees without /metrics: the server's prompt steps fed what the cache did not hold
    assert (shared.server_prefill_tokens == shared.prompt_len - shared.cached_tokens).all()
    turns = pd.DataFrame(arm.turns)
    assert turns.ok.all() and list(turns.turn) == [1, 2, 1, 2]
    second = turns[turns.turn == 2]
    assert (second.prompt_len == 48 + 5 + 4 + 5).all()
    assert (second.cached_tokens == 48).all()  # turn 1's 53 + 4 tokens, 56 written: 3 full blocks
    assert (turns[turns.turn == 1].cached_tokens == 0).all()
    (hit,) = arm.hitrate
    assert hit["completed"] == hit["requests"] == 8 and hit["metrics"] == "present"
    assert hit["queried_tokens"] == hit["prompt_tokens"]
    # Nothing evicts: all of the ideal, unless a request came while the first of its prompt was in prefill.
    assert 0.5 * hit["ideal_hit_rate"] <= hit["hit_rate"] <= hit["ideal_hit_rate"] and hit["hit_tokens"] % 16 == 0


def test_ratio_runs_reads_each_committed_run_and_names_a_missing_one(capsys):
    from nanolab.lab.prefixbench import ratio_runs

    runs, tables = ratio_runs([("a", "H100", "day64e2", "h100-80gb-hbm3"), ("b", "H100", "day64nosuch", "h100")])
    assert list(runs.run) == ["a", "a"] and list(runs.ratio) == ["shared prefix", "second turn"]
    assert len(tables) == 1 and "data/day64nosuch_ratios_h100.csv is not committed" in capsys.readouterr().out
    stated = tables[0].set_index("ratio").value
    assert runs.value.iloc[0] == stated[stated.index.str.startswith("shared prefix")].iloc[0]
    assert runs.value.iloc[1] == stated[stated.index.str.startswith("multi-turn")].iloc[0]
