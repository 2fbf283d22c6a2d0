"""The book's instruments: benches, the HF reference, cost arithmetic, run labels and table and
figure I/O, plots, and the designs the engine replaced. It imports the engine; the engine never
imports it. A chapter imports what it runs from here, as d2l's chapters import `d2l`; each name
is loaded from its module on first use, so importing one instrument does not load every bench.

- `timing`: the one decode timing loop (`prefill`, `timed_steps`) and the clocks around it
- `reference`: HF transformers, and nanolab's greedy decode beside it
- `costs`: rebuild cells, padding, workspace bytes, streamed work, the seed's tables
- `report`: run labels, data/ and figures/ I/O
- `plots`: one module of figures per chapter
- `history`: the unplanned decode (Days 49 and 50's "before"), as a runner the engine accepts
- `decodebench`, `compilebench`, `capturebench`, `streambench`: the benches
- `graphbench`: the server under Poisson load, CUDA graphs on and off (Day 58), over `workload` (the
  Poisson plan), `loadclient`, `servingmetrics` (TTFT, TPOT, ITL, goodput), `compaction` (the step
  log), `serveprocess` and `offlinesteps` (the same step in-process)
- `leverarms`, `leverrun`, `stepparts`, `tuningspread`, `gemvbench`, `agreement` (the `levers` command
  runs them): Day 61's levers as engines, their waterfall, where a step's time goes, the tuning's
  spread, the projections alone, bf16 against fp32
- `floorbench`, `projections`: Day 61's peers, and the fused projections that were not kept
- `mixedsteps`: where a mixed step of chunked prefill spends its time (Day 61)
- `steploop`: what the GPU runs between two replays of the graphed decode step (Day 61)
- `folds`: the decode step with its norms, residual adds and SwiGLU inside the GEMVs (Day 61, not kept)
- `tpbench`: tensor parallelism at TP = 1 and 2, its agreement with one process, and its arithmetic (Day 62)
- `graphbench`'s `fullgraphs` arm, `startup_table` and `plots.tail`: the serving tail with every step
  graphed, and the server's start (Day 63)
- `prefixbench` and `plots.prefix`: prefix caching on and off, at a shared prefix, a chat's second
  turn, no hits, and the hit rate /metrics reports (Day 64)
- `frontcosts`: a request's host work around its prompt step, stage by stage and by prompt length,
  and after the host idles (Day 64b)
- `prefixsteps`: a prompt step after a cached prefix, timed, profiled and split between host and GPU,
  and a warm hit's TTFT as host and GPU parts (Days 64, 64c, 64d)
- `kernelres`: a kernel's registers and spilled bytes on an NVIDIA GPU, compiled on this machine (Day 64c)
- `specbench`: speculative decoding on real text, acceptance and ms a token at batch 1 (Day 65)
- `results`: the front page's figure and the results page, from the committed tables
"""

import importlib

_EXPORTS = {
    "nanolab.gates": ["Gate"],
    "nanolab.lab.capturebench": ["bench_buckets", "run_capturebench", "step_breakdown", "table_stems", "targets"],
    "nanolab.lab.compaction": ["capture_batch_sizes", "check_compaction"],
    "nanolab.lab.compilebench": ["check_graph_reused", "compilebench_table", "first_guard_failure", "guards_table",
                                 "results_table", "run_compilebench"],
    "nanolab.lab.costs": ["SEED_STREAMBENCH", "appended_cells", "bucket_table", "check_rebuild_bounded",
                          "mapping_bytes", "padding_waste", "rebuild_cells", "rebuild_ratio", "render_streambench",
                          "spread_lengths", "streambench_table", "streamed_work", "streamed_workspace_bytes",
                          "workspace_bytes"],
    "nanolab.lab.decodebench": ["decode_table"],
    "nanolab.lab.fp8bench": ["agreed_prefix", "stored_weight_bytes", "step_lines"],
    "nanolab.lab.graphbench": ["graphbench_ratios", "graphbench_stems", "round_ratios", "run_graphbench",
                                "startup_table"],
    "nanolab.lab.history": ["unplanned_runner"],
    "nanolab.lab.hostbench": ["host_summary", "run_hostbench"],
    "nanolab.lab.w8a16": ["layer_prefill"],
    "nanolab.lab.leverrun": ["show_lever_run"],
    "nanolab.lab.plots": ["between_steps_timeline", "lever_run_waterfall", "plot_between_steps",
                          "plot_block_tables", "plot_capture_buckets", "plot_chunked_itl",
                          "plot_decode_plan", "plot_decode_speed", "plot_floor_roofline", "plot_folds",
                          "plot_kernel_draws", "plot_launch_sweep", "plot_lever_waterfall", "plot_mixed_anatomy",
                          "plot_mixed_host", "plot_mixed_steps",
                          "plot_paper_speedup", "plot_projections", "plot_streamed_engine", "plot_streamed_read",
                          "plot_tp_steps", "plot_tuning_spread"],
    "nanolab.lab.plots.belowfloor": ["plot_fp8_prefill", "plot_fp8_steps", "plot_fp8_tiles", "plot_lookup_rules",
                                    "plot_prompt_step_ms",
                                    "plot_round_ratios",
                                    "plot_spec_batches", "plot_specload_rules", "plot_verify_kernels"],
    "nanolab.lab.plots.floor": ["best_of_sweep"],
    "nanolab.lab.plots.prefix": ["plot_front_costs", "plot_nohit_throughput", "plot_prefix_ttft", "plot_read_in_step",
                                 "plot_capture_sweep", "plot_ratio_runs", "plot_read_launches", "plot_warm_hit_ledger",
                                 "plot_read_shares", "plot_shared_blocks"],
    "nanolab.lab.frontcosts": ["front_costs", "front_label", "front_totals", "idle_costs"],
    "nanolab.lab.kernelres": ["resources_label", "varlen_resources"],
    "nanolab.lab.plots.results": ["plot_headline"],
    "nanolab.lab.plots.serving": ["plot_graphbench", "plot_row_compaction"],
    "nanolab.lab.plots.tail": ["plot_itl_cdf", "plot_startup"],
    "nanolab.lab.reference": ["engine_greedy", "hf_greedy", "load_hf", "nanolab_greedy"],
    "nanolab.lab.results": ["CHAPTERS", "headline_table"],
    "nanolab.lab.prefixbench": ["prefix_ratios", "ratio_runs", "ttft_summary"],
    "nanolab.lab.prefixsteps": ["ledger_summary", "run_prefix_steps", "warm_hit_ledger", "warm_hit_ledgers"],
    "nanolab.lab.report": ["caption_figure", "chapter_run", "chapter_target", "committed_tables", "figure_path",
                           "load_table", "measured_table", "run_label", "save_figure", "save_table", "show",
                           "table_label"],
    "nanolab.lab.servingmetrics": ["SLO", "SLOS", "check_requests", "median_interval", "serving_metrics"],
    "nanolab.lab.stepparts": ["kernel_class"],
    "nanolab.lab.specbench": ["chained_settings", "divergences", "load_prompt_set", "lookup_arm", "lookup_settings",
                              "replay_chained", "replay_inputs", "replay_lookup", "run_prompt", "spec_summary",
                              "switch_off_batch",
                              "tie_margins"],
    "nanolab.lab.streambench": ["kernel_agreement", "launch_rule", "mapping_read", "read_batch", "run_streambench"],
    "nanolab.lab.timing": ["drain", "prefill", "random_prompts", "time_engine", "timed_steps"],
    "nanolab.lab.tpbench": ["collectives_per_step", "group_agreement", "predicted_steps", "speedups",
                            "target_line"],
    "nanolab.lab.tuningspread": ["once_a_step"],
    "nanolab.lab.workload": ["SEED_RATES", "WORKLOADS", "Workload", "request_plan"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'nanolab.lab' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
