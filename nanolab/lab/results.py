"""The book's results page and front-page figure, generated from the committed tables in data/.

`headline_table` reads each chapter's headline numbers from its CSV, one row per result, each with
the label of the run that measured it (device, model, dtype, date). Nothing here is typed: a result
whose table is not in data/ is left out, and the page says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from nanolab.lab.report import load_table, table_label

# The chapters, by notebook, with their titles, in the book's order (book/_toc.yml).
CHAPTERS = {
    "00_engine": "The engine before the compiler",
    "49_compile_guards": "Day 49: the compiler fighting the engine",
    "50_decode_plan": "Day 50: the addressing moves out of the forward",
    "54_capture_buckets": "Days 51 to 56: capture buckets",
    "58_graphbench": "Day 58: graphbench, the server under load",
    "59_streamed_kernel": "Days 59 and 60: the streamed kernel",
    "61_the_floor": "Day 61: the floor and batch 1",
    "61b_batch_eight": "Day 61: batch 8 and the step-to-step upload",
    "61c_against_the_peers": "Day 61: against the peers, TTFT and chunked prefill",
    "61d_the_cpu": "Day 61: bf16 against fp32, and the CPU",
    "62_two_gpus": "Day 62: two GPUs",
    "63_serving_tail": "Day 63: the serving tail",
    "64_prefix_caching": "Day 64: prefix caching",
    "64b_the_host_path": "Day 64: what a warm hit pays the host",
    "64c_the_read_after_a_hit": "Day 64: the attention read after a cached prefix",
    "64d_what_a_warm_hit_is_made_of": "Day 64: what a warm hit is made of",
    "64e_the_engine_or_the_machine": "Day 64: the engine or the machine",
    "65_below_the_floor": "Day 65: fp8 weights",
    "65b_speculative_decoding": "Day 65: speculative decoding",
    "65c_chained_again": "Day 65: chained speculation, measured again",
    "65d_prompt_bytes": "Day 65: an fp8 prompt step that reads its bytes",
    "65e_earned_matches": "Day 65: one-token matches, after a draft has been kept",
}


@dataclass(frozen=True)
class Headline:
    chapter: str  # the notebook that shows it, a key of CHAPTERS
    stem: str  # the table, data/<stem>_<slug>.csv
    result: str  # what the number is
    value: Callable[[pd.DataFrame], str]  # the number, formatted, computed from the table
    where: tuple[tuple[str, object], ...] = ()  # the rows it reads, where a table holds several models' runs
    slug: str | None = None  # the device whose table it reads, where not the page's (the CPU's target)


def _at(df: pd.DataFrame, **where) -> pd.Series:
    """The one row of `df` whose columns equal `where`."""
    mask = pd.Series(True, index=df.index)
    for col, value in where.items():
        mask &= df[col] == value
    rows = df[mask]
    if len(rows) != 1:
        raise LookupError(f"{len(rows)} rows match {where}")
    return rows.iloc[0]


def _ms(x: float) -> str:
    return f"{x:.3f} ms"


def _peer_over_nanolab(t: pd.DataFrame, arm: str) -> str:
    """A floor-bench peer's step over nanolab's at batches 1 and 8, context 128."""
    return ", ".join(f"{_at(t, arm=arm, batch=b, context=128).nanolab_speedup:.2f}x" for b in (1, 8))


def _builds(row: pd.Series) -> str:
    fell = "fell back to eager" if bool(row["fell back"]) else "no fallback"
    builds = int(row.builds)
    return f"{builds} build{'s' if builds != 1 else ''} for {int(row.shapes)} shapes, {fell}"


def _graphs_over_eager(t: pd.DataFrame) -> str:
    rate = t[t.arm == "eager"].rate.max()
    top = t[t.rate == rate].set_index("arm")
    return f"{top.loc['graphs'].output_throughput / top.loc['eager'].output_throughput:.2f}x at {rate:g} req/s"


def _upload_saved(t: pd.DataFrame) -> str:
    """The median over paired rounds of (the plan in one upload kernel - four copies), at batch 8."""
    first, second = dict.fromkeys(t.variant)
    rounds = t[t.batch == 8].pivot_table(index="trial", columns="variant", values="ms_per_step")
    return f"{(rounds[second] - rounds[first]).median() * 1000:+.1f} us"


def _host_cells(t: pd.DataFrame) -> str:
    row = _at(t, steps=512)
    return f"{row['day 51 ratio']:.4f} (Day 50 rebuilt {row['day 50 ratio']:.1f})"


HEADLINES = (
    Headline("49_compile_guards", "day49_compilebench",
             "torch.compile (dynamic) over the unplanned decode step: graphs built, and whether it fell back",
             lambda t: _builds(_at(t, mode="dynamic"))),
    Headline("50_decode_plan", "day50_compilebench",
             "torch.compile (dynamic) over the planned step: graphs built, and the step against eager",
             lambda t: f"{_builds(_at(t, mode='dynamic'))}, {_at(t, mode='dynamic').speedup:.2f}x eager's speed"),
    Headline("54_capture_buckets", "day51_rebuild",
             "block-table cells the host writes per cell a sequence appends, over 512 steps",
             _host_cells),
    Headline("54_capture_buckets", "day54_decode",
             "graphed decode step at batch 1, context 128; and over HF's eager static cache",
             lambda t: (f"{_ms(_at(t, arm='nanolab graphs', batch=1, context=128).ms_per_step)}, "
                        f"{_at(t, arm='nanolab graphs', batch=1, context=128).speedup_vs_hf_static:.1f}x")),
    Headline("58_graphbench", "day58_graphbench",
             "output tokens/s through the real server at the highest rate both arms ran, CUDA graphs over eager",
             _graphs_over_eager),
    Headline("59_streamed_kernel", "day59_streambench",
             "paged read of 64 rows x 8,192 tokens: the streamed kernel over the torch reference",
             lambda t: f"{t[(t['shape'] == '64 x 8192') & (t.arm != 'reference')].x_reference.max():.1f}x"),
    Headline("59_streamed_kernel", "day60_decode",
             "graphed decode step with the streamed read at batch 1, context 128",
             lambda t: _ms(_at(t, arm="nanolab graphs, streamed read", batch=1, context=128).ms_per_step)),
    Headline("61_the_floor", "day61_roofline",
             "the floor of a decode step at batch 1, context 128: every weight once at the measured copy bandwidth",
             lambda t: _ms(_at(t, batch=1, context=128).floor_ms)),
    Headline("61_the_floor", "day61_dobench_tuning_spread",
             "batch-1 decode step with PDL and the tuning timed after a warm-up, median over fresh compiles",
             lambda t: f"{t.ms_per_step.median():.4f} ms over {len(t)} compiles"),
    Headline("61b_batch_eight", "day61_between_ab",
             "batch-8 decode step, the plan uploaded in one kernel against four copies: median of paired rounds",
             _upload_saved),
    Headline("61c_against_the_peers", "day61_floor",
             "decode step at batch 1, context 128, and over the bandwidth floor",
             lambda t: (lambda r: f"{_ms(r.ms_per_step)}, {r.x_floor:.2f}x the floor")(
                 _at(t, arm="nanolab", batch=1, context=128))),
    Headline("61c_against_the_peers", "day61_floor",
             "HF transformers' default (compiled) static cache over nanolab, batch 1 and 8",
             lambda t: _peer_over_nanolab(t, "hf-default")),
    Headline("61c_against_the_peers", "day61_floor",
             "gpt-fast (compiled) over nanolab, batch 1 and 8",
             lambda t: _peer_over_nanolab(t, "gpt-fast")),
    Headline("61c_against_the_peers", "day61_ttft",
             "time to first token, one 2,048-token prompt; HF's default path over nanolab",
             lambda t: (f"{_ms(_at(t, arm='nanolab', batch=1).ttft_ms)}, "
                        f"{_at(t, arm='hf-default', batch=1).nanolab_speedup:.2f}x")),
    Headline("61d_the_cpu", "day61_floor",
             "2-core CPU, SmolLM2 in fp32: HF's default path over nanolab's compiled step at batch 1",
             lambda t: f"{_at(t, arm='hf-default', batch=1).nanolab_speedup:.2f}x", slug="cpu"),
    Headline("61d_the_cpu", "day61_fp32_agreement",
             "first decode step's logits against fp32 (relative error): bf16 eager graphs, bf16 compiled graphs",
             lambda t: ", ".join(f"{_at(t, arm=f'bfloat16 {kind} graphs')['logits rel err to fp32']:.4f}"
                                 for kind in ("eager", "inductor"))),
    Headline("62_two_gpus", "day62_tp",
             "Llama-3.1-8B's decode step on one GPU at batch 1 (graphs, eager step), and over its floor",
             lambda t: (lambda r: f"{_ms(r.ms_per_step)}, {r.x_floor:.2f}x the floor")(_at(t, arm="tp1", batch=1)),
             where=(("model", "llama-3.1-8b"),)),
    Headline("63_serving_tail", "day63_graphbench",
             "ITL p99 over p50 at 16, 32 and 48 req/s, every step graphed (mixed steps eager)",
             lambda t: ", ".join(
                 f"{(lambda r: r.itl_p99_ms / r.itl_p50_ms)(_at(t, arm='fullgraphs', rate=rate)):.1f}x "
                 f"({(lambda r: r.itl_p99_ms / r.itl_p50_ms)(_at(t, arm='graphs', rate=rate)):.1f}x)"
                 for rate in (16.0, 32.0, 48.0))),
    Headline("64_prefix_caching", "day64_ttft",
             "TTFT at a warm hit on a shared 2,048-token prompt, caching on (off); and over 4,096 tokens of chat",
             lambda t: "; ".join(
                 f"{_ms(_at(t, part=part, phase=phase, arm='on').ttft_p50_ms)} "
                 f"({_ms(_at(t, part=part, phase=phase, arm='off').ttft_p50_ms)})"
                 for part, phase in (("shared prefix", "warm"), ("multi-turn", "turn 2")))),
    Headline("65_below_the_floor", "day65_fp8_steps",
             "the batch-1 decode step with fp8 weights (bf16), and fp8 over its floor",
             lambda t: (lambda f, b: f"{_ms(f.ms_per_step)} ({_ms(b.ms_per_step)}), {f.x_floor:.2f}x the floor")(
                 _at(t, arm="fp8", batch=1), _at(t, arm="bf16", batch=1))),
    Headline("65b_speculative_decoding", "day65_spec_summary",
             "SmolLM2 on code edits at batch 1: ms a token with prompt lookup (without), bf16",
             lambda t: _code_edit_speedup(t, "ngram k=4")),
    Headline("65b_speculative_decoding", "day65_spec_summary",
             "the same with chained speculation, k = 32 over two-token matches",
             lambda t: _code_edit_speedup(t, "ngram k=32 min_n=2"), slug="h100-80gb-hbm3"),
    Headline("65c_chained_again", "day65c_rounds",
             "under load at 32 req/s, random weights: chained speculation's ITL p50 over plain's, paired rounds",
             lambda t: (lambda r: f"{r.value:.3f}x, 95% interval {r.lo:.3f} to {r.hi:.3f} ({r['rounds']} rounds)")(
                 _round_itl(t)), slug="h100-80gb-hbm3"),
    Headline("65d_prompt_bytes", "day65d_engine_fp8_prefill",
             "fp8 prompt step, a layer's projections at 128 and 512 tokens: the engine (bf16, widened first)",
             lambda t: _fp8_prefill(t), slug="h100-80gb-hbm3"),
)


def _fp8_prefill(sweep: pd.DataFrame) -> str:
    """A prefill sweep's layer sums at each token count: the engine's op (bf16's, the widening path's)."""
    from nanolab.lab.w8a16 import ENGINE, WIDENED, layer_prefill

    return "; ".join(f"{r[ENGINE]:.0f} us ({r['bf16 F.linear']:.0f}, {r[WIDENED]:.0f})"
                     for _, r in layer_prefill(sweep).iterrows())


def _code_edit_speedup(summary: pd.DataFrame, arm: str) -> str:
    """A specbench summary's code edits: `arm`'s ms a token (off's), and its speedup."""
    on, off = _at(summary, set="code_edit", arm=arm), _at(summary, set="code_edit", arm="off")
    return f"{_ms(on.ms_per_token)} ({_ms(off.ms_per_token)}), {on.speedup_over_off:.2f}x"


def _round_itl(rounds: pd.DataFrame) -> pd.Series:
    """`graphbench.round_ratios`' ITL row of a rounds table."""
    from nanolab.lab.graphbench import round_ratios

    return _at(round_ratios(rounds), ratio="speculating / plain ITL p50")


def headline_table(slug: str = "h200", headlines=HEADLINES) -> tuple[pd.DataFrame, list[str]]:
    """One row per headline whose table exists on device `slug` (or the headline's own): chapter,
    result, value, the source file, and its run label. Also the source files that were missing, or
    did not hold the row."""
    rows, missing = [], []
    for h in headlines:
        table = load_table(h.stem, h.slug or slug)
        source = f"data/{h.stem}_{h.slug or slug}.csv"
        if table is None:
            missing.append(source)
            continue
        for column, wanted in h.where:
            table = table[table[column] == wanted] if column in table else table.iloc[:0]
        if table.empty:
            missing.append(f"{source} (no rows where {dict(h.where)})")
            continue
        try:
            value = h.value(table)
        except (LookupError, KeyError, ValueError) as e:
            missing.append(f"{source} ({e})")
            continue
        label = table_label(table)
        rows.append({"chapter": CHAPTERS[h.chapter], "result": h.result, "value": value, "device": label.device,
                     "model": f"{label.model} ({label.weights} weights)", "dtype": label.dtype, "date": label.date,
                     "source": source})
    return pd.DataFrame(rows), missing
