"""The capture chapter's measurement: decode step time with CUDA graphs on and off, against HF
transformers' static-cache `generate` on its eager path, at every batch and context, with the
bandwidth floor.

Day 54 (and Day 56's warm-up report). CUDA only. In one process, on one set of
weights: nanolab eager (the planned step, unpadded), nanolab with graphs (the same engine code,
every decode step padded to its bucket and replayed), and HF's `generate` with a static cache and
`disable_compile=True` (arm "hf-static"): its eager path, not its default, which on CUDA compiles
the decode forward (`lab.floorbench` times both). Each context length is the history at the last
timed step: prompts are `context - steps` tokens long. The floor of a step is the bytes it must
read (every weight once, and each row's K and V) over the copy bandwidth measured in the same run.
Targets print as ratios; nothing asserts a time.

    python -m nanolab capturebench --model llama-3.2-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import pandas as pd
import torch

from nanolab import Engine, EngineConfig, load_model
from nanolab.engine.block_manager import cdiv
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import DecodeGraphs
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.costs import kv_read_bytes, weight_bytes
from nanolab.lab.reference import engine_greedy, load_hf
from nanolab.lab.timing import copy_bandwidth, drain, prefill, random_prompts, time_engine, time_hf
from nanolab.progress import progress_bar

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 2048)


def table_stems(day: str) -> tuple[str, ...]:
    """The names a capture bench's tables are saved under: day54_* for Day 54's run, day60_* for
    the run with the streamed arm (`CaptureBench.tables`)."""
    return tuple(f"{day}_{name}" for name in ("decode", "capture", "agreement", "profile"))


@dataclass(frozen=True)
class CaptureBench:
    steps: pd.DataFrame  # arm, batch, context, ms_per_step, tokens_per_s, floor_ms, ...
    capture: pd.DataFrame  # pool, shapes, seconds, pool_mib
    agreement: pd.DataFrame  # graphs against eager: tokens that agree
    profile: pd.DataFrame  # the graphed batch-1 step's kernels by GPU time

    def tables(self, day: str) -> dict[str, pd.DataFrame]:
        """The four tables by the names they are saved under (`table_stems`)."""
        return dict(zip(table_stems(day), (self.steps, self.capture, self.agreement, self.profile), strict=True))


def rows_equal(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def graph_agreement(graphed: Engine, padded: Engine, prompts: list[list[int]], plain: list[list[int]],
                    steps: int) -> dict:
    """Rows whose greedy tokens through `graphed`'s graphs equal those of `padded` (the same buckets,
    eagerly) and those of the unpadded eager engine (`plain`, decoded once by the caller)."""
    tokens = engine_greedy(graphed, prompts, steps)
    return {"rows equal, graphs vs same shapes eager": rows_equal(tokens, engine_greedy(padded, prompts, steps)),
            "rows equal, graphs vs unpadded eager": rows_equal(tokens, plain)}


def _profile(engine: Engine, prompts: torch.Tensor, steps: int, arm: str) -> pd.DataFrame:
    """Kernels of `steps` graphed decode steps, by total GPU time: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    prefill(engine, prompts, steps + 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        drain(engine)
        torch.cuda.synchronize()
    return kernel_table(prof, steps, arm)


def kernel_table(prof, steps: int, arm: str) -> pd.DataFrame:
    """A finished `torch.profiler.profile`'s CUDA kernels over `steps` steps of `arm`, by total GPU
    time: calls, gpu_us, us_per_step and share."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    df = pd.DataFrame([{"arm": arm, "kernel": e.key[:90], "calls": e.count, "gpu_us": e.self_device_time_total}
                       for e in events])
    df = df.sort_values("gpu_us", ascending=False, ignore_index=True)
    df["us_per_step"] = df.gpu_us / steps
    df["share"] = df.gpu_us / df.gpu_us.sum()
    return df


def bench_buckets(batches, contexts) -> DecodeBuckets:
    """The bench's capture list: powers of two up to the largest batch, and widths from the
    shortest context to twice the longest."""
    return DecodeBuckets.default(max(batches), 2 * max(contexts), min_width=min(contexts))


def compiled_graphs(model, buckets: DecodeBuckets, progress: bool = True, **fields) -> Engine:
    """An engine whose graphs capture the model compiled by inductor (Day 50's planned dynamic
    compile, floats constant) instead of the eager model: inductor fuses the small elementwise
    kernels that the eager graph replays one by one. Compiling happens in the warm-ups."""
    with torch._dynamo.config.patch(specialize_float=True):
        return Engine(model, EngineConfig(read="reference", compile=False, async_scheduling=False, **fields),
                      buckets=buckets, forward=torch.compile(model, dynamic=True), progress=progress)


def run_capturebench(model_path, dtype=torch.bfloat16, batches=BATCHES, contexts=CONTEXTS, steps: int = 32,
                     repeats: int = 3, block_size: int = 16, compile: bool = True, streamed: bool = False,
                     progress: bool = True) -> CaptureBench:
    """`streamed` adds Day 60's arm: graphs over the streamed read, captured for the batch axis alone."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    config = model.config
    max_batch = max(batches)
    # Every row's history, and at least one row as wide as the widest bucket (a batch of 1 would
    # otherwise leave the cache narrower than its capture list).
    num_blocks = max(max_batch * (cdiv(max(contexts), block_size) + 1), cdiv(2 * max(contexts), block_size)) + 16
    buckets = bench_buckets(batches, contexts)
    # Whole prompts: every row of a timed batch starts decoding in the same step (`timing.prefill`).
    fields = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_batch, enable_chunked_prefill=False)

    # Day 54: the capture list with a pool per graph (over the padded engine's cache, then let go),
    # then with one shared pool: the graphed engine's own, captured when it is built.
    padded = Engine(model, EngineConfig(read="reference", enforce_eager=True, **fields), buckets=buckets,
                    progress=progress)  # the graphs' shapes, eagerly
    per_graph = DecodeGraphs(model, padded.kv_cache, buckets)
    reports = [("eager", per_graph.capture(shared_pool=False, progress=progress))]
    per_graph.release()
    del per_graph
    graphed = Engine(model, EngineConfig(read="reference", compile=False, async_scheduling=False, **fields),
                     buckets=buckets, progress=progress)  # Day 54's read
    reports.append(("eager", graphed.capture_report))
    arms = {"nanolab graphs": graphed}
    if compile:
        arms["nanolab graphs + compile"] = compiled_graphs(model, buckets, progress, **fields)
        reports.append(("compiled (compile time included)", arms["nanolab graphs + compile"].capture_report))
    if streamed:
        streamed_config = EngineConfig(read="streamed", compile=False, async_scheduling=False, **fields)
        arms["nanolab graphs, streamed read"] = Engine(model, streamed_config, buckets=buckets.without_width(),
                                                       progress=progress)
        reports.append(("eager, streamed read", arms["nanolab graphs, streamed read"].capture_report))
    capture = pd.DataFrame([{"forward": forward, "pool": "shared" if r.shared_pool else "one per graph",
                             "shapes": r.shapes, "seconds": r.seconds, "pool_mib": r.pool_bytes / 2**20}
                            for forward, r in reports])
    eager = Engine(model, EngineConfig(read="reference", enforce_eager=True, **fields), progress=progress)
    arms["nanolab eager"] = eager

    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    hf = load_hf(model_path, dtype, device, attn_implementation="sdpa")
    records = []
    jobs = [(c, b) for c in contexts for b in batches]
    for context, batch in progress_bar(jobs, desc="capture bench", enabled=progress):
        prompts = random_prompts(batch, context - steps, config.vocab_size)
        floor = (weights + kv_read_bytes(config, batch, context, dtype)) / bandwidth * 1000
        timings = [time_engine(engine, prompts, steps, repeats, arm) for arm, engine in arms.items()]
        timings.append(time_hf(hf, prompts, steps, "static", repeats))
        for timing in timings:
            arm = timing.engine
            records.append({"arm": arm, "batch": batch, "context": context, "steps": steps,
                            "ms_per_step": timing.ms_per_step, "tokens_per_s": timing.tokens_per_s,
                            "floor_ms": floor, "bandwidth_tb_s": bandwidth / 1e12})
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    df = pd.DataFrame(records)
    hf_ms = df[df.arm == "hf-static"].set_index(["batch", "context"]).ms_per_step
    df["speedup_vs_hf_static"] = [hf_ms[b, c] / ms for b, c, ms in zip(df.batch, df.context, df.ms_per_step,
                                                                         strict=True)]
    df["x_floor"] = df.ms_per_step / df.floor_ms
    corners = ((1, contexts[0]), (8, contexts[0]), (4, contexts[-1]))
    agreement = []
    for b, c in corners:
        prompts = random_prompts(b, c - steps, config.vocab_size, seed=1).tolist()
        plain = engine_greedy(eager, prompts, steps)  # the unpadded eager reference, decoded once a corner
        row = {"batch": b, "context": c, "steps": steps, **graph_agreement(graphed, padded, prompts, plain, steps),
               "rows": b}
        if streamed:  # Day 60's acceptance: the streamed graphs decode the reference's greedy tokens
            row["rows equal, streamed graphs vs reference eager"] = rows_equal(
                engine_greedy(arms["nanolab graphs, streamed read"], prompts, steps), plain)
        agreement.append(row)
    agreement = pd.DataFrame(agreement)
    # Profiled at both corners of the measured grid: the smallest step and the largest.
    profile = pd.concat([
        _profile(arms[a], random_prompts(b, c - steps, config.vocab_size), steps, a).assign(batch=b, context=c)
        for b, c in ((min(batches), min(contexts)), (max(batches), max(contexts)))
        for a in arms if a != "nanolab eager"], ignore_index=True)
    return CaptureBench(df, capture, agreement, profile)


def step_breakdown(steps: pd.DataFrame, profile: pd.DataFrame, batch: int, context: int) -> pd.DataFrame:
    """Where a profiled step's time goes, per graphed arm: GPU time in matmuls (cuBLAS's kernels,
    and a split-K reduction), GPU time in every other kernel, and the rest of the measured step,
    which is the host (scheduling, planning, copies, the launch, the sampled tokens' readback)
    with the GPU idle. The floor is beside it."""
    records = []
    profile = profile[(profile.batch == batch) & (profile.context == context)]
    for arm, kernels in profile.groupby("arm"):
        step = steps[(steps.arm == arm) & (steps.batch == batch) & (steps.context == context)].iloc[0]
        matmul = kernels.kernel.str.contains("nvjet|gemm|splitKreduce|cutlass", case=False)
        gpu_matmul = kernels[matmul].us_per_step.sum() / 1000
        gpu_other = kernels[~matmul].us_per_step.sum() / 1000
        records.append({"arm": arm, "batch": batch, "context": context, "step_ms": step.ms_per_step,
                        "gpu_matmul_ms": gpu_matmul, "gpu_other_ms": gpu_other,
                        "host_ms": step.ms_per_step - gpu_matmul - gpu_other, "floor_ms": step.floor_ms,
                        "kernels_per_step": kernels.calls.sum() / step.steps})
    return pd.DataFrame(records)


def targets(steps: pd.DataFrame, gpt_fast_batch1_ms: float | None = None) -> list[str]:
    """The capture chapter's targets as ratios, with the margin by which each is met or missed;
    `gpt_fast_batch1_ms` is the peer's batch-1 step, as the caller quotes or measures it. The HF
    ratio is against the eager arm this bench measures (`disable_compile=True`)."""
    lines = []
    for (arm, context), rows in steps[steps.arm.str.startswith("nanolab graphs")].groupby(["arm", "context"]):
        b1 = rows[rows.batch == 1].iloc[0]
        line = (f"{arm}, context {context}, batch 1: {b1.ms_per_step:.3f} ms a step; target 0.9 ms "
                f"({0.9 / b1.ms_per_step:.2f}x of target), {b1.x_floor:.2f}x the floor")
        if gpt_fast_batch1_ms is not None:
            line += (f", {gpt_fast_batch1_ms / b1.ms_per_step:.2f}x gpt-fast's {gpt_fast_batch1_ms:.3f} ms "
                     "(target 1.4x)")
        lines.append(line)
        worst = rows.loc[rows.speedup_vs_hf_static.idxmin()]
        lines.append(f"{arm}, context {context}: against HF static, eager (disable_compile=True), "
                     f"{rows.speedup_vs_hf_static.min():.2f}x at worst (batch {worst.batch}) to "
                     f"{rows.speedup_vs_hf_static.max():.2f}x; target 3x at every batch")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled-graphs arm")
    parser.add_argument("--streamed", action="store_true",
                        help="add graphs over the streamed read (Day 60); tables are saved as day60_*")


def main(args: argparse.Namespace) -> int:
    from nanolab.config import resolve_dtype
    from nanolab.lab.report import run_label, save_table
    from nanolab.model.weights import resolve_weights, weights_kind

    if not torch.cuda.is_available():
        raise ValueError("the capture bench needs a CUDA device")
    batches, contexts = int_list(args.batches, "--batches"), int_list(args.contexts, "--contexts")
    steps, repeats = positive_int(args.steps, "--steps"), positive_int(args.repeats, "--repeats")
    path = resolve_weights(args.model)
    dtype = resolve_dtype(args.dtype, torch.device("cuda"))
    bench = run_capturebench(path, dtype, batches, contexts, steps, repeats,
                             compile=not args.no_compile, streamed=args.streamed)
    label = run_label(torch.device("cuda"), args.model, dtype, weights=weights_kind(path))
    day = "day60" if args.streamed else "day54"  # the streamed run is Day 60's; it leaves Day 54's tables be
    for name, table in bench.tables(day).items():
        print(f"{name}: {save_table(table, name, label)}")
        print(table.head(25).to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print("\n".join(targets(bench.steps)))
    print(label.caption())
    return 0
