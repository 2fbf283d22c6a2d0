"""The floor chapter's instruments: one decode step's time with each lever pulled in turn, where its
time goes by kernel class, and the projections alone against cuBLAS.

Day 61. CUDA only. Every arm is a graphed engine over the same weights, built with the levers
of `ARMS` up to its own, so the arms read as a waterfall: the step before, then each lever added
to the one before it. A step is timed as the engine runs it (`lab.timing.time_engine`), host
work included; a profile of graphed steps at one shape splits the GPU's part by kernel class,
and the rest of the step is the host's. Nothing here asserts a time.

    python -m nanolab levers --model llama-3.2-1b
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
import triton

from nanolab import Engine, SamplingParams, load_model
from nanolab.engine import kv_cache as kv_cache_module
from nanolab.engine import llm_engine as engine_module
from nanolab.engine import runner as runner_module
from nanolab.engine.block_manager import cdiv
from nanolab.engine.runner import DecodeForward, compile_decode, mark_step_kernels
from nanolab.kernels import gemv as gemv_module
from nanolab.kernels import paged_attention as paged_attention_module
from nanolab.kernels import pdl as pdl_module
from nanolab.kernels.gemv import MAX_ROWS, GemvConfig, gemv, step_config
from nanolab.kernels.pdl import supports_pdl
from nanolab.lab.capturebench import _profile, rows_equal
from nanolab.lab.costs import kv_read_bytes, weight_bytes
from nanolab.lab.folds import folded_decode
from nanolab.lab.projections import FusedDecode
from nanolab.lab.reference import engine_greedy
from nanolab.lab.timing import copy_bandwidth, drain, prefill, random_prompts, time_engine, time_us, wall_s
from nanolab.model import attention as attention_module
from nanolab.model.config import ModelConfig
from nanolab.progress import progress_bar

NAN = float("nan")


@dataclass(frozen=True)
class Lever:
    name: str
    pinned: bool = True  # step inputs staged in pinned memory (`kv_cache.stage`); False: copied from pageable memory
    compile: bool = False  # inductor over the graphed step (`runner.compile_decode`)
    async_scheduling: bool = False  # launch step t + 1 before reading back step t (`Engine`)
    fused: bool = False  # up to 16 rows, the fused projections (`runner.FusedDecode`), the compiled step past that
    pdl: bool = False  # the fused step's kernels launched as programmatic dependents (`kernels.pdl`)
    rope_write: bool = False  # q's and k's rotation and the K/V write in one kernel (`CacheView.write_rotated`)
    autotune: bool = False  # batch 1 through its own graph, projections autotuned at M = 1 (`autotuned_batch_1`)
    tune_batch_1: bool = False  # batch 1's graph with coordinate-descent tuning (`runner.BATCH_1_OPTIONS`)
    fold_shares: bool = False  # a split read's shares folded in its own kernel (`paged_attention.FOLD_SHARES`)
    step_pdl: bool = False  # the compiled step's kernels launched as programmatic dependents (`runner.PDL_OPTIONS`)
    opaque: tuple[str, ...] = ()  # projections inductor leaves to cuBLAS (`layers.Linear.opaque`): "lm_head", "down"
    skip_empty: bool = False  # a split read's empty shares write nothing (`paged_attention.SKIP_EMPTY_SHARES`)
    steady: bool = False  # batch 1's kernels tuned with a warmed-up benchmark (`runner.steady_tuning`)
    triton_rows: int = 0  # 2 to this many rows: the layers' projections through `gemv.step_linear` in the step
    prefetch: bool = False  # `gemv.step_linear`'s first weight tile loaded ahead of its PDL wait
    programs_per_sm: int = 8  # the split read's grid, aimed at this many programs per SM (`paged_attention`)
    early_release: bool = False  # the engine's kernels release their dependents as they start (`pdl.EARLY_RELEASE`)
    l2_ahead: int = 0  # bytes of its weight each `gemv.step_linear` asks of L2 ahead of its PDL wait
    # n > 0: a split read's shares walk at least n tiles, so a row of at most n is one share that writes
    # its output, and a longer row's shares are folded in the read (`paged_attention.SHARE_TILES`, `FOLD_SHARES`)
    read_whole: int = 0
    fix_up: bool = False  # `gemv.step_linear`'s split-K shares added in its own kernel (`gemv.STEP_FIX_UP`)
    # a batch's norms, residual adds and SwiGLU folded into its GEMVs, to 64 rows (`lab.folds.FoldedStep`)
    step_fused: bool = False
    # between two steps: the next plan's four per-row vectors uploaded in one kernel from pinned memory
    # (`KVCache._upload`), and the tokens read back on a stream of their own (`Engine`); False: four
    # copies, and the read-back on the step's stream, as every arm before it ran
    upload: bool = False


# Cumulative up to "+ one rope and K/V write kernel": each arm keeps every lever before it. The two
# batch-1 arms each branch off that one, and the fused projections (and PDL over them) off
# "+ async scheduling", as they were measured. The shares folded, PDL in the compiled step and the
# cuBLAS projections each branch off the tuned batch 1; the empty shares skipped off the cuBLAS LM
# head, and PDL over the kept step and the tuning timed after a warm-up, in turn, off that. The
# Triton GEMV in the batched step (to 16 rows, kept; to 64; to 64 with the weight ahead of the wait)
# each branch off the warmed-up tuning, and the two read grids off the GEMV to 16 rows. The GEMV
# alone against cuBLAS is `projection_table`, and back to back `chained_projection_table`. The read
# in one kernel (kept) and the levers after it branch off the GEMV to 16 rows; the upload kernel with
# the read-back's own stream (kept) off the read in one kernel.
ARMS = (
    Lever("graphs (before)", pinned=False),
    Lever("+ pinned step inputs"),
    Lever("+ inductor", compile=True),
    Lever("+ async scheduling", compile=True, async_scheduling=True),
    Lever("+ one rope and K/V write kernel", compile=True, async_scheduling=True, rope_write=True),
    Lever("+ autotuned batch-1 projections", compile=True, async_scheduling=True, rope_write=True, autotune=True),
    Lever("+ tuned batch-1 reductions", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True),
    Lever("+ fused projections", compile=True, async_scheduling=True, fused=True),
    Lever("+ PDL", compile=True, async_scheduling=True, fused=True, pdl=True),
    Lever("+ shares folded in the read", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          fold_shares=True),
    Lever("+ PDL in the compiled step", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          step_pdl=True),
    Lever("+ cuBLAS LM head", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          opaque=("lm_head",)),
    Lever("+ cuBLAS LM head and down", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          opaque=("lm_head", "down")),
    Lever("+ empty shares skipped", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          opaque=("lm_head",), skip_empty=True),
    Lever("+ PDL over the kept step", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          opaque=("lm_head",), skip_empty=True, step_pdl=True),
    Lever("+ tuning timed after a warm-up", compile=True, async_scheduling=True, rope_write=True, tune_batch_1=True,
          opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True),
    Lever("+ Triton projections to 16 rows", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16),
    Lever("+ Triton projections to 64 rows", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=64),
    Lever("+ Triton projections, weight ahead of the wait", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=64,
          prefetch=True),
    Lever("+ a read grid of 4 programs per SM", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          programs_per_sm=4),
    Lever("+ a read grid of 2 programs per SM", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          programs_per_sm=2),
    Lever("+ kernels released as they start", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          early_release=True),
    Lever("+ 16 MiB of each weight asked of L2 ahead", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          early_release=True, l2_ahead=16 << 20),
    Lever("+ whole weights asked of L2 ahead", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          early_release=True, l2_ahead=64 << 20),
    Lever("+ L2 ahead, Triton projections to 64 rows", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=64,
          early_release=True, l2_ahead=16 << 20),
    Lever("+ rows of 4 tiles read whole, shares folded in the read", compile=True, async_scheduling=True,
          rope_write=True, tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True,
          triton_rows=16, read_whole=4),
    Lever("+ split-K added in the GEMV's kernel", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          fix_up=True),
    Lever("+ both: one read kernel, one GEMV kernel", compile=True, async_scheduling=True, rope_write=True,
          tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True, triton_rows=16,
          read_whole=4, fix_up=True),
    Lever("+ norms, residual adds and SwiGLU inside the GEMVs", compile=True, async_scheduling=True,
          rope_write=True, tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True,
          triton_rows=16, read_whole=4, step_fused=True),
    Lever("+ the plan in one upload kernel, the read-back on its own stream", compile=True, async_scheduling=True,
          rope_write=True, tune_batch_1=True, opaque=("lm_head",), skip_empty=True, step_pdl=True, steady=True,
          triton_rows=16, read_whole=4, upload=True),
)
# What `levers` runs unless told: the engine as it was built, every kept lever added in turn (the
# last arm is the engine's defaults). The levers measured and not kept run by index (--arms).
DEFAULT_ARMS = tuple(ARMS[i] for i in (0, 1, 2, 3, 4, 6, 11, 13, 14, 15, 16, 25, 29))


def _pageable(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t  # the engine before pinned staging: every step input copied from pageable memory


def _copied_upload(cache, step: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    """`KVCache._upload` before the upload kernel: one copy per vector, staged by `kv_cache.stage`
    (pinned, or pageable under `staging(pinned=False)`)."""
    step = kv_cache_module.stage(step, cache.device)
    for dst, values in zip(dsts, step, strict=True):
        dst.copy_(values, non_blocking=True)


@contextlib.contextmanager
def between_steps_before(engine: Engine):
    """Run `engine`, as built, with its work between two steps as it was before the upload kernel:
    the plan in four copies (`_copied_upload`) and the tokens read back on the step's own stream.
    Nothing inside its graphs or compiled step changes, so one engine can be timed both ways. The
    copies replace `KVCache._upload` on the class, for every cache in the process while this
    holds; both come back on exit, an exception's included."""
    saved = kv_cache_module.KVCache._upload, engine._readback
    kv_cache_module.KVCache._upload = _copied_upload
    engine._readback = torch.cuda.current_stream(engine.device)  # wait_stream on itself is a no-op
    try:
        yield
    finally:
        kv_cache_module.KVCache._upload, engine._readback = saved


@contextlib.contextmanager
def staging(pinned: bool, rope_write: bool = True, prompts_by_sdpa: bool = True,
            fold_shares: bool = paged_attention_module.FOLD_SHARES,
            ops_pdl: bool = False, skip_empty: bool = True, step_rows: int = gemv_module.STEP_ROWS,
            prefetch: bool = False, programs_per_sm: int = paged_attention_module.PROGRAMS_PER_SM,
            early_release: bool = False, l2_ahead: int = 0, share_tiles: int = paged_attention_module.SHARE_TILES,
            fix_up: bool = False, upload: bool = True):
    """Run the engine with its step inputs staged in pinned memory (its own design) or, for the
    arm before that lever, copied from pageable memory, each copy a round trip the host waits on;
    with or without the one rotation-and-write kernel (`attention.FUSED_ROPE_WRITE`), with or
    without torch's fused attention for whole prompts (`kv_cache.PROMPTS_BY_SDPA`), with a split
    read's shares folded in its own kernel or by a second one (`paged_attention.FOLD_SHARES`), its
    empty shares skipped or written (`paged_attention.SKIP_EMPTY_SHARES`), with or without the
    engine's ops launched as programmatic dependents (`kernels.pdl.OPS_PDL`), and with
    `gemv.step_linear` taking up to `step_rows` rows, its weight ahead of the wait or not, or
    `l2_ahead` bytes of it asked of L2 there (`gemv.STEP_L2_AHEAD`), the split read's grid aimed at
    `programs_per_sm` programs per SM (`paged_attention.PROGRAMS_PER_SM`), and the engine's kernels
    releasing their dependents as they start or as they exit (`pdl.EARLY_RELEASE`), a split read's
    shares at least `share_tiles` tiles (`paged_attention.SHARE_TILES`), and split-K's shares added
    in the GEMV's kernel or a second one (`gemv.STEP_FIX_UP`), and a decode plan uploaded in one
    kernel or four copies (`KVCache._upload`; the read-back's stream is `lever_engine`'s to set).
    Build the engine inside: a compiled step keeps the choices it was traced with."""
    modules = (kv_cache_module, runner_module, engine_module)
    switches = ((attention_module, "FUSED_ROPE_WRITE", rope_write),
                (kv_cache_module, "PROMPTS_BY_SDPA", prompts_by_sdpa),
                (paged_attention_module, "FOLD_SHARES", fold_shares), (pdl_module, "OPS_PDL", ops_pdl),
                (paged_attention_module, "SKIP_EMPTY_SHARES", skip_empty), (gemv_module, "STEP_ROWS", step_rows),
                (gemv_module, "STEP_PREFETCH", prefetch),
                (paged_attention_module, "PROGRAMS_PER_SM", programs_per_sm),
                (pdl_module, "EARLY_RELEASE", early_release), (gemv_module, "STEP_L2_AHEAD", l2_ahead),
                (paged_attention_module, "SHARE_TILES", share_tiles), (gemv_module, "STEP_FIX_UP", fix_up),
                (kv_cache_module.KVCache, "_upload", kv_cache_module.KVCache._upload if upload else _copied_upload))
    saved = [m.stage for m in modules], [getattr(m, name) for m, name, _ in switches]
    if not pinned:
        for m in modules:
            m.stage = _pageable
    for m, name, value in switches:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, fn in zip(modules, saved[0], strict=True):
            m.stage = fn
        for (m, name, _), value in zip(switches, saved[1], strict=True):
            setattr(m, name, value)

def lever_staging(lever: Lever):
    """`staging` with every switch `lever` sets: what an engine built for that arm runs under."""
    return staging(lever.pinned, lever.rope_write, fold_shares=lever.fold_shares or lever.read_whole > 0,
                   ops_pdl=lever.step_pdl,
                   skip_empty=lever.skip_empty, step_rows=lever.triton_rows or gemv_module.STEP_ROWS,
                   prefetch=lever.prefetch, programs_per_sm=lever.programs_per_sm,
                   early_release=lever.early_release, l2_ahead=lever.l2_ahead, share_tiles=lever.read_whole or 1,
                   fix_up=lever.fix_up, upload=lever.upload)


# Kernel classes of the waterfall, matched in order against a kernel's name.
KERNEL_CLASSES = (
    # "_mm": inductor's kernels that hold a matmul (a tuned batch-1 reduction, with its norm or
    # activation fused in) are named after it.
    ("projections", ("nvjet", "gemm", "cutlass", "splitkreduce", "triton_tem", "_mm", "_gemv", "_sum_splits",
                     "_norm_qkv_rope",
                     "_norm_gate_up", "_norm_head")),
    ("attention read", ("_paged_decode", "_merge_splits")),
    ("sampling", ("argmax", "reduce_kernel", "_chunk_max", "_pick")),
    ("norms", ("layer_norm", "rms")),
    ("fused by inductor", ("triton_",)),
    ("copies and indexing", ("copy", "index", "gather", "cat", "memcpy", "memset", "fill", "scatter",
                             "_upload")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in lowered for k in keys):
            return cls
    return "other elementwise"


# Inductor's options for `autotuned_batch_1`'s graph: each projection timed at M = 1 as cuBLAS and as
# inductor's Triton matmul templates, the faster kept.
AUTOTUNE_BATCH_1 = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}


def autotuned_batch_1(model) -> DecodeForward:
    """The compiled step (`runner.DecodeForward`) with batch 1's graph compiled with
    `AUTOTUNE_BATCH_1` instead: its projections autotuned at M = 1. Measured on the H200 and not
    kept (`day61_autotune_levers`): the batch-1 step went from 1.13 to 1.42 ms, since the templates
    it picked, timed alone with their weights warm in L2, read them slower than cuBLAS inside the
    step."""
    return DecodeForward(model, AUTOTUNE_BATCH_1)


def opaque_projections(model, names: tuple[str, ...]) -> None:
    """Mark the projections `names` ("lm_head", "down") opaque to inductor (`layers.Linear.opaque`),
    and every other not."""
    unknown = set(names) - {"lm_head", "down"}
    if unknown:
        raise ValueError(f"opaque: unknown projections {sorted(unknown)}; known: lm_head, down")
    model.lm_head.opaque = "lm_head" in names
    for layer in model.layers:
        layer.mlp.down_proj.opaque = "down" in names


def lever_engine(model, lever: Lever, **engine_kwargs) -> tuple[Engine, float]:
    """A graphed engine with `lever`'s settings, and the seconds building it took (compile included).
    Marks the model's projections as the lever says (`opaque_projections`), over what
    `compile_decode` marks. With `step_fused`, the compiled forward is `lab.folds.FoldedStep`'s."""
    start = time.perf_counter()
    forward = None
    if lever.compile:
        build = folded_decode if lever.step_fused else compile_decode
        forward = (autotuned_batch_1(model) if lever.autotune else
                   build(model, tune_batch_1=lever.tune_batch_1, pdl=lever.step_pdl, steady=lever.steady))
    opaque_projections(model, lever.opaque)  # compiling happens at the first call, in the engine's capture
    mark_step_kernels(model, lever.triton_rows > 0)  # the lever's own say, over compile_decode's default
    if lever.fused:
        forward = FusedDecode(model, forward, pdl=lever.pdl)
    engine = Engine(model, forward=forward, cuda_graphs=True, read="streamed", progress=False,
                    async_scheduling=lever.async_scheduling, enable_chunked_prefill=False,  # see `timing.prefill`
                    **engine_kwargs)
    if not lever.upload:  # the read-back on the step's own stream: the engine's stream for it is that one
        engine._readback = torch.cuda.current_stream(engine.device)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - start


def replay_ms(engine: Engine, batch: int, repeats: int = 50) -> float:
    """Median ms of the batch-`batch` graph's replay alone, timed with events: the GPU's part of a
    step, its kernels and the gaps between them. Replays whatever plan the buffers hold last; run
    it only when no request is live."""
    graph = engine.runner.graphs.graphs[(batch, None)]
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_anatomy(engine: Engine, prompts: torch.Tensor, steps: int) -> dict[str, float]:
    """Mean host microseconds a graphed decode step spends in each part, found by wrapping the
    engine's own methods on this instance: scheduling, planning (host tables and the copies into
    the step buffers), issuing the replay, launching the sampler (`sample_tokens` leaves the tokens
    on the device), and the rest of `Engine.step`, which holds the wait for the GPU and the
    tokens' read-back. Each step starts from an idle GPU, so an engine with asynchronous scheduling
    overlaps nothing here: compare its parts with the other arms', and its step time with
    `time_engine`'s. Also the share of steps that replayed a graph."""
    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    runner, graphs = engine.runner, engine.runner.graphs
    patches = [(engine.scheduler, "schedule"), (runner, "plan_step"), (graphs, "replay"), (engine, "sampler")]
    originals = [getattr(obj, name) for obj, name in patches]
    for obj, name in patches:
        setattr(obj, name, timed(name, getattr(obj, name)))
    prefill(engine, prompts, steps + 1)
    spent.clear()
    graphed, total = 0, 0.0
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        total += time.perf_counter() - t0
        graphed += runner.last_decode[1]
    for (obj, name), original in zip(patches, originals, strict=True):
        setattr(obj, name, original)
    drain(engine)
    out = {f"{name}_us": 1e6 * s / steps for name, s in spent.items()}
    out["rest_us"] = 1e6 * total / steps - sum(out.values())
    out["graphed_share"] = graphed / steps
    return out


def decode_logits(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """[rows, vocab] fp32 logits of the first decode step after prefilling `prompts`, read back
    synchronously (an asynchronous step's logits are overwritten before its tokens are read)."""
    engine.async_scheduling, overlapped = False, engine.async_scheduling
    seqs = prefill(engine, prompts, 2)
    logits = {o.seq.request_id: o.logits.clone() for o in engine.step()}
    drain(engine)
    engine.async_scheduling = overlapped
    return torch.stack([logits[s.request_id] for s in seqs])


def fp32_agreement(model_path, steps: int = 32, rows: int = 8, block_size: int = 16) -> pd.DataFrame:
    """How far bf16 decode is from fp32 decode, eagerly and compiled: the first decode step's
    logits of each against the fp32 eager engine's (relative error), and how many rows' `steps`
    greedy tokens equal fp32's. Random weights give near-flat logits, so greedy tokens part early
    even between two correct bf16 paths; the logits' error is the measure that tells them apart."""
    device = torch.device("cuda")
    prompts = random_prompts(rows, 64, ModelConfig.from_dir(model_path).vocab_size, seed=1).tolist()
    kw = dict(num_blocks=rows * (cdiv(64 + steps, block_size) + 1) + 8, block_size=block_size, max_num_seqs=rows,
              progress=False, enable_chunked_prefill=False)
    results, reference = [], None
    for dtype, compiled in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        model = load_model(model_path, dtype=dtype, device=device)
        engine = Engine(model, forward=compile_decode(model) if compiled else None, cuda_graphs=True, **kw)
        tokens, logits = engine_greedy(engine, prompts, steps), decode_logits(engine, prompts)
        reference = reference or (tokens, logits)
        results.append({"arm": f"{str(dtype).removeprefix('torch.')} {'inductor' if compiled else 'eager'} graphs",
                        "rows": rows, "steps": steps, "rows equal to fp32": rows_equal(tokens, reference[0]),
                        "logits rel err to fp32": float((logits - reference[1]).norm() / reference[1].norm())})
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    return pd.DataFrame(results)


def breakdown(profile: pd.DataFrame, ms_per_step: float) -> pd.DataFrame:
    """ms per step by kernel class, and the host's share: the measured step less the GPU's time."""
    by_class = profile.assign(cls=profile.kernel.map(kernel_class)).groupby("cls").us_per_step.sum() / 1000
    rows = [{"part": cls, "ms": ms} for cls, ms in by_class.items()]
    rows.append({"part": "host (GPU idle)", "ms": ms_per_step - by_class.sum()})
    return pd.DataFrame(rows)


def show_lever_run(stem: str, values: str, command: str, slug: str = "h200"
                   ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]] | None:
    """A partial levers run committed under `stem` (`levers --stem STEM`), shown as a chapter shows
    it: its label, `values` by batch and arm, and the parts by arm of each profiled batch (a part
    an arm lacks is 0). Returns (levers table, the smallest profiled batch's parts by arm, arms in
    run order), or None with how to make it (`command`) when data/ lacks it."""
    from nanolab.lab.report import load_table, measured_table, show

    levers = measured_table(f"{stem}_levers", command, slug)
    parts = load_table(f"{stem}_parts", slug)  # the same run's
    if levers is None:
        return None
    if parts is None:
        print(f"data/{stem}_parts_{slug}.csv, the same run's parts, is missing: `{command}` makes both")
        return None
    order = list(dict.fromkeys(levers.arm))
    show(levers.pivot_table(index=["batch", "context"], columns="arm", values=values)[order].round(3))
    by_batch = {b: p.pivot_table(index="part", columns="arm", values="ms", aggfunc="sum")[order].fillna(0.0)
                for b, p in parts.groupby("batch")}
    for b, by_arm in by_batch.items():
        if len(by_batch) > 1:
            print(f"batch {b}, ms per step by part:")
        show(by_arm.round(3))
    return levers, by_batch[min(by_batch)], order


def run_levers(model_path, dtype=torch.bfloat16, shapes=((1, 128), (8, 128), (32, 128), (64, 128), (32, 2048)),
               arms=DEFAULT_ARMS, steps: int = 32, repeats: int = 3, profile_shapes=((1, 128),), block_size: int = 16,
               progress: bool = True, checkpoint: Callable[[dict[str, pd.DataFrame]], None] | None = None
               ) -> dict[str, pd.DataFrame]:
    """Tables `day61_levers` (arm, batch, context, ms_per_step, floor_ms, x_floor, build_s, the step's
    anatomy and its replay alone), `day61_parts` (arm, part, ms at each of `profile_shapes`),
    `day61_lever_profile` (its kernels) and `day61_lever_agreement` (greedy tokens and first-step
    logits of each arm against the first). `checkpoint`, when given, gets the tables so far after
    each arm, so a run cut short keeps its finished arms. Each arm compiles afresh, with inductor's
    caches off, as in a new process on a new machine: two arms whose graphs are the same (one that
    changes only how batch 1 is tuned, say) would otherwise share the first one's tuned kernels."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    config = model.config
    max_batch = max(b for b, _ in shapes)
    num_blocks = max_batch * (cdiv(max(c for _, c in shapes), block_size) + 2) + 16
    kw = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_batch)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    check = random_prompts(8, 64, config.vocab_size, seed=1).tolist()
    records, parts, profiles, agreement, first = [], [], [], [], None
    for lever in progress_bar(arms, desc="levers", enabled=progress):
        torch._dynamo.reset()
        with lever_staging(lever), torch._inductor.config.patch(force_disable_caches=True):
            engine, build_s = lever_engine(model, lever, **kw)
            for batch, context in shapes:
                prompts = random_prompts(batch, context - steps, config.vocab_size)
                timing = time_engine(engine, prompts, steps, repeats, lever.name)
                floor = (weights + kv_read_bytes(config, batch, context, dtype)) / bandwidth * 1000
                records.append({"arm": lever.name, "batch": batch, "context": context,
                                "ms_per_step": timing.ms_per_step, "floor_ms": floor,
                                "x_floor": timing.ms_per_step / floor, "build_s": build_s,
                                "bandwidth_tb_s": bandwidth / 1e12, **step_anatomy(engine, prompts, steps),
                                "replay_ms": replay_ms(engine, batch)})
                if (batch, context) in set(map(tuple, profile_shapes)):
                    profile = _profile(engine, prompts, steps, lever.name).assign(batch=batch, context=context)
                    profiles.append(profile)
                    parts.append(breakdown(profile, timing.ms_per_step).assign(arm=lever.name, batch=batch,
                                                                               context=context))
            tokens, logits = engine_greedy(engine, check, 32), decode_logits(engine, check)
        first = first or (tokens, logits)
        agreement.append({"arm": lever.name, "rows": len(check), "steps": 32,
                          "rows equal to the first arm": rows_equal(tokens, first[0]),
                          "logits rel err to the first arm": float((logits - first[1]).norm() / first[1].norm())})
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(_lever_tables(records, parts, agreement, profiles))
    return _lever_tables(records, parts, agreement, profiles)


def _lever_tables(records, parts, agreement, profiles) -> dict[str, pd.DataFrame]:
    tables = {"day61_levers": pd.DataFrame(records), "day61_lever_agreement": pd.DataFrame(agreement)}
    if parts:
        tables["day61_parts"] = pd.concat(parts, ignore_index=True)
        tables["day61_lever_profile"] = pd.concat(profiles, ignore_index=True)
    return tables


# The batch-1 arms `tuning_spread` compiles afresh: the engine's step, and it with PDL.
SPREAD_ARMS = (ARMS[6], ARMS[10])


@contextlib.contextmanager
def recording_tuning(configs: list[dict], timings: list[dict] | None = None):
    """While inside, every config inductor's coordinate descent settles on is appended to `configs`
    (kernel, config), and, into `timings` when given, every timing its benchmarker returned (kernel,
    config, us). Kernels are named as inductor names them, which two graphs compiled inside may
    share. Wraps `CachingAutotuner`'s two methods and puts them back after."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    tune, bench = CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench

    def recorded_tune(self, launcher, *args, **kwargs):
        best = tune(self, launcher, *args, **kwargs)
        configs.append({"kernel": self.inductor_meta.get("kernel_name"), "config": config_text(best.config)})
        return best

    def recorded_bench(self, launcher, *args, **kwargs):
        ms = bench(self, launcher, *args, **kwargs)
        if timings is not None:
            timings.append({"kernel": self.inductor_meta.get("kernel_name"), "config": config_text(launcher.config),
                            "us": 1000 * float(ms)})
        return ms

    CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench = recorded_tune, recorded_bench
    try:
        yield
    finally:
        CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench = tune, bench


def config_text(config) -> str:
    """A Triton config as "XBLOCK: 4, R0_BLOCK: 2048, num_warps: 16": its block sizes and warps, and
    its stages where not 1 (inductor's reductions use one)."""
    parts = [f"{k}: {v}" for k, v in config.kwargs.items()] + [f"num_warps: {config.num_warps}"]
    return ", ".join(parts + ([f"num_stages: {config.num_stages}"] if config.num_stages != 1 else []))


def tuning_spread(model_path, dtype=torch.bfloat16, arms=SPREAD_ARMS, trials: int = 3, steps: int = 32,
                  repeats: int = 3, context: int = 128, progress: bool = True,
                  checkpoint: Callable[[dict[str, pd.DataFrame]], None] | None = None) -> dict[str, pd.DataFrame]:
    """Tables `day61_tuning_spread` (arm, trial, ms_per_step, replay_ms, build_s at batch 1), `day61_spread_profile`
    (each trial's kernels), `day61_configs` (the config coordinate descent chose for each kernel, with the fastest
    time its benchmarker gave that config while tuning, `tuning_us`) and `day61_tuning_timings` (the same for every
    config it timed): every arm's batch-1 engine built `trials` times with inductor's caches off, so coordinate
    descent tunes each kernel anew, and timed as `run_levers` times a step. The spread between trials of one arm is
    the tuning's, not the code's. Arms alternate trial by trial, so drift on the card falls on both."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    prompts = random_prompts(1, context - steps, model.config.vocab_size)
    kw = dict(num_blocks=cdiv(context, 16) + 18, block_size=16, max_num_seqs=1)
    records, profiles, configs, timings = [], [], [], []
    jobs = [(trial, lever) for trial in range(trials) for lever in arms]
    for trial, lever in progress_bar(jobs, desc="tuning spread", enabled=progress):
        torch._dynamo.reset()
        chosen, timed = [], []
        with torch._inductor.config.patch(force_disable_caches=True), \
                lever_staging(lever), recording_tuning(chosen, timed):
            engine, build_s = lever_engine(model, lever, **kw)
            timing = time_engine(engine, prompts, steps, repeats, lever.name)
            records.append({"arm": lever.name, "trial": trial, "batch": 1, "context": context,
                            "ms_per_step": timing.ms_per_step, "replay_ms": replay_ms(engine, 1), "build_s": build_s})
            profiles.append(_profile(engine, prompts, steps, lever.name).assign(trial=trial, batch=1, context=context))
        fastest = pd.DataFrame(timed, columns=["kernel", "config", "us"]).groupby(["kernel", "config"]).us.min()
        configs += [{"arm": lever.name, "trial": trial, **c, "tuning_us": fastest.get((c["kernel"], c["config"]), NAN)}
                    for c in chosen]
        timings += [{"arm": lever.name, "trial": trial, "kernel": kernel, "config": config, "tuning_us": us}
                    for (kernel, config), us in fastest.items()]
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(_spread_tables(records, profiles, configs, timings))
    return _spread_tables(records, profiles, configs, timings)


def once_a_step(profile: pd.DataFrame, steps: int = 32) -> pd.DataFrame:
    """Per (arm, trial) of a `tuning_spread` profile, the longest kernel a step launches once: at
    batch 1 the LM head, whose 525 MB (Llama-3.2-1B) dwarf the sampler's and the first norm's.
    Columns arm, trial, kernel, us_per_step."""
    once = profile[profile.calls == steps]
    longest = once.loc[once.groupby(["arm", "trial"]).us_per_step.idxmax()]
    return longest[["arm", "trial", "kernel", "us_per_step"]].reset_index(drop=True)


def _spread_tables(records, profiles, configs, timings) -> dict[str, pd.DataFrame]:
    columns = ["arm", "trial", "kernel", "config", "tuning_us"]
    return {"day61_tuning_spread": pd.DataFrame(records),
            "day61_spread_profile": pd.concat(profiles, ignore_index=True),
            "day61_configs": pd.DataFrame(configs, columns=columns),
            "day61_tuning_timings": pd.DataFrame(timings, columns=columns)}


PREFILL_ARMS = (  # (name, rope_write, prompts_by_sdpa), cumulative
    ("streamed varlen read", False, False),
    ("+ one rope and K/V write kernel", True, False),
    ("+ fused attention for whole prompts", True, True),
)


def prefill_levers(model_path, dtype=torch.bfloat16, cases=((1, 2048), (8, 1024)), repeats: int = 5,
                   progress: bool = True) -> pd.DataFrame:
    """Table `day61_prefill_levers`: ms to the first token of `batch` prompts of `prompt_len` tokens
    (one eager varlen forward and its sampling, whole prompts), with each prefill lever added in
    turn, the median of `repeats` after one warm-up; and how far each arm's first logits are from
    the first arm's."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    rows = max(b for b, _ in cases)
    num_blocks = rows * (cdiv(max(n for _, n in cases) + 1, 16) + 1) + 16
    records, first = [], {}
    for name, rope_write, by_sdpa in progress_bar(PREFILL_ARMS, desc="prefill levers", enabled=progress):
        with staging(True, rope_write, by_sdpa):
            engine = Engine(model, cuda_graphs=False, read="streamed", progress=False, num_blocks=num_blocks,
                            async_scheduling=False,
                            block_size=16, max_num_seqs=rows, enable_chunked_prefill=False)
            for batch, prompt_len in cases:
                prompts = random_prompts(batch, prompt_len, vocab)
                run = functools.partial(prefill, engine, prompts, 1)
                times = [wall_s(run, device) for _ in range(repeats + 1)][1:]
                drain(engine)
                logits = decode_logits_of_prompts(engine, prompts[:1].tolist())
                ref = first.setdefault((batch, prompt_len), logits)
                records.append({"arm": name, "batch": batch, "prompt_len": prompt_len,
                                "ttft_ms": 1000 * statistics.median(times),
                                "logits rel err to the first arm": float((logits - ref).norm() / ref.norm())})
            del engine
        gc.collect()
        torch.cuda.empty_cache()
    return pd.DataFrame(records)


def decode_logits_of_prompts(engine: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """[rows, vocab] fp32 logits of `prompts`' prefill step, read back synchronously."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    logits = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.logits is not None:
                logits.setdefault(o.seq.request_id, o.logits.clone())
    return torch.stack([logits[s.request_id] for s in seqs])


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection a decode step runs."""
    h, d = config.hidden_size, config.head_dim
    return {"qkv": ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h),
            "o": (h, config.num_attention_heads * d), "gate_up": (2 * config.intermediate_size, h),
            "down": (h, config.intermediate_size), "lm_head": (config.vocab_size, h)}


def choose_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """The isolated sweep's default tiles for an [n, k] weight (its "gemv" arm): 64 columns a
    program, K in 256-wide tiles, and as many shares of K as bring the grid to about two programs
    per SM (at most 8, each at least one tile)."""
    block_n, block_k = 64, 256
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split * 2 <= 2 * num_sms and k % (split * 2 * block_k) == 0 and split < 8:
        split *= 2
    return GemvConfig(block_n, block_k, split)



def sweep_configs(n: int, k: int) -> list[GemvConfig]:
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (128, 256, 512):
            for split in (1, 2, 4, 8):
                stage_bytes = (block_n + 16) * block_k * 2  # a weight tile and the activation tile, 16-bit
                stages = min(4, 200_000 // stage_bytes)  # what an H200 SM's 227 KiB of shared memory holds
                if k % (split * block_k) == 0 and stages >= 2:
                    out.append(GemvConfig(block_n, block_k, split, num_stages=stages))
    return out


def projection_table(config, dtype=torch.bfloat16, rows=(1, 2, 4, 8, 16), sweep_rows=(1, 16), repeats: int = 30,
                     progress: bool = True) -> pd.DataFrame:
    """Each projection alone, L2 flushed before every launch: cuBLAS (`F.linear`), `gemv` with
    `choose_config`'s tiles, and at `sweep_rows` the best of `sweep_configs`. TB/s counts the
    weight, the activations and the output once."""
    device = torch.device("cuda")
    jobs = [(name, nk, m) for name, nk in projection_shapes(config).items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="projections", enabled=progress):
        records += _time_projection(name, n, k, m, dtype, device, m in sweep_rows, repeats)
    df = pd.DataFrame(records)
    df["chosen"] = [a == "gemv" for a in df.arm]
    return df


def chained_projection_table(config, dtype=torch.bfloat16, rows=(8,), layers: int = 16, repeats: int = 20,
                             progress: bool = True) -> pd.DataFrame:
    """Each layer projection as a decode step runs it: `layers` launches back to back in one CUDA
    graph, each against a weight of its own (so none is warm in L2), `us` per launch. Arms: cuBLAS
    (`F.linear`), and `gemv` with every tile of `sweep_configs` and `step_config`'s, launched as
    programmatic dependents, so each one's start overlaps the one before it as in the step."""
    device = torch.device("cuda")
    shapes = {name: nk for name, nk in projection_shapes(config).items() if name != "lm_head"}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="chained projections", enabled=progress):
        ws = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(layers)]
        x = torch.randn(m, k, dtype=dtype, device=device)
        ref = F.linear(x.double(), ws[-1].double())
        chosen = step_config(n, k, m)
        arms = [("cublas", None)] + [(f"gemv {c.block_n}x{c.block_k} split {c.split_k} stages {c.num_stages}"
                                      + (" (step_config)" if c == chosen else ""), c)
                                     for c in dict.fromkeys([chosen, *sweep_configs(n, k)])]
        for arm, c in arms:
            try:
                err, us = _time_chain(x, ws, c, ref, repeats)
            except Exception as e:  # a tile the card cannot hold: recorded, and the sweep goes on
                records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": NAN,
                                "tb_s": NAN, "rel_err": NAN, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": us,
                            "tb_s": n * k * ws[0].element_size() / us / 1e6, "rel_err": err, "error": ""})
        del ws
    return pd.DataFrame(records)


# Each layer projection's neighbours `lab.folds.step_projection` folds into it (`fold_table`).
FOLDS = {"qkv": ("norm",), "o": ("residual",), "gate_up": ("norm",), "down": ("swiglu", "swiglu + residual")}


def fold_table(config, dtype=torch.bfloat16, rows=(8, 64), layers: int = 16, repeats: int = 20,
               progress: bool = True) -> pd.DataFrame:
    """Each layer projection through `gemv` as `chained_projection_table` times it (`layers` launches
    in one CUDA graph, each with a weight of its own, as programmatic dependents), plain and with
    each neighbour of `FOLDS` folded in (`gemv`'s norm, residual, SwiGLU, as `lab.folds` runs
    them): `us` per launch, what the fold added to the plain launch, and the error against fp32
    torch."""
    device = torch.device("cuda")
    shapes = {name: nk for name, nk in projection_shapes(config).items() if name in FOLDS}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="folded projections", enabled=progress):
        ws = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(layers)]
        x, gate_up = torch.randn(m, k, dtype=dtype, device=device), torch.randn(m, 2 * k, dtype=dtype, device=device)
        g, res = torch.rand(k, dtype=dtype, device=device) + 0.5, torch.randn(m, n, dtype=dtype, device=device)
        silu_up = F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
        arms = {"none": (dict(), x, x.float()),
                "norm": (dict(norm=g), x, F.rms_norm(x.float(), (k,), g.float(), 1e-5)),
                "residual": (dict(residual=res), x, x.float()),
                "swiglu": (dict(swiglu=True), gate_up, silu_up),
                "swiglu + residual": (dict(swiglu=True, residual=res), gate_up, silu_up)}
        plain = NAN
        for fold in ("none", *FOLDS[name]):
            kw, a, a_ref = arms[fold]
            cfg = step_config(n, k, m, swiglu=kw.get("swiglu", False), norm="norm" in kw)
            ref = F.linear(a_ref.double(), ws[-1].double()) + (res.double() if "residual" in kw else 0)
            err, us = _time_chain(a, ws, cfg, ref, repeats, kw)
            plain = us if fold == "none" else plain
            records.append({"projection": name, "n": n, "k": k, "rows": m, "fold": fold,
                            "tiles": f"{cfg.block_n}x{cfg.block_k} split {cfg.split_k} stages {cfg.num_stages}",
                            "us": us, "us_added": us - plain, "tb_s": n * k * ws[0].element_size() / us / 1e6,
                            "rel_err": err})
        del ws
    return pd.DataFrame(records)


def _time_chain(x, ws, config: GemvConfig | None, ref, repeats: int, fold: dict | None = None
                ) -> tuple[float, float]:
    """(relative error of the last weight's product against `ref`, us per launch) of `x` against each
    of `ws` in turn, through cuBLAS (`config` None) or `gemv`, with `fold` (`gemv`'s norm, residual
    or swiglu) folded in."""
    def one(w):
        return F.linear(x, w) if config is None else gemv(x, w, config, pdl=supports_pdl(x.device), **(fold or {}))
    err = float((one(ws[-1]).double() - ref).norm() / ref.norm())
    return err, time_us(lambda: [one(w) for w in ws], x.device, repeats) / len(ws)


def _time_projection(name: str, n: int, k: int, m: int, dtype, device, sweep: bool, repeats: int) -> list[dict]:
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(m, k, dtype=dtype, device=device)
    nbytes = (n * k + m * k + m * n) * w.element_size()
    ref = F.linear(x.double(), w.double())
    arms: list[tuple[str, Callable]] = [("cublas", lambda: F.linear(x, w))]
    if m <= MAX_ROWS:
        arms.append(("gemv", lambda: gemv(x, w, choose_config(n, k))))
        if sweep:
            arms += [(f"gemv {c.block_n}x{c.block_k} split {c.split_k}", lambda c=c: gemv(x, w, c))
                     for c in sweep_configs(n, k)]
    records = []
    for arm, fn in arms:
        err = float((fn().double() - ref).norm() / ref.norm())
        us = time_us(fn, device, repeats)
        records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": us,
                        "tb_s": nbytes / us / 1e6, "rel_err": err})
    return records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None,
                        choices=("levers", "projections", "chain", "agreement", "prefill", "spread", "folds", "mixed",
                                 "loop", "between", "mixedhost"))
    parser.add_argument("--trials", type=int, default=None, help="--only spread: fresh compiles of each arm "
                        "(default 3); --only between: rounds of both ways (default 8)")
    parser.add_argument("--arms", default=None, help="comma-separated indices into ARMS (default: the kept levers, "
                        "DEFAULT_ARMS)")
    parser.add_argument("--shapes", default=None, help="batch@context pairs, comma-separated (default: 1@128, 8@128, "
                        "32@128, 64@128, 32@2048)")
    parser.add_argument("--profile", default="1@128", help="batch@context pairs to profile, comma-separated")
    parser.add_argument("--stem", default="day61", help="table names' prefix: a partial run under its own name "
                        "leaves the full tables as they are")


def parse_shapes(text: str, flag: str = "--shapes") -> tuple[tuple[int, int], ...]:
    """"1@128,8@128" -> ((1, 128), (8, 128)); refuses anything else, naming `flag`."""
    try:
        shapes = tuple(tuple(int(x) for x in part.split("@")) for part in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"{flag}: expected batch@context pairs such as 1@128,8@128, got {text!r}")
    return shapes


def main(args: argparse.Namespace) -> int:
    from nanolab.lab.report import run_label, save_table
    from nanolab.llm import resolve_dtype
    from nanolab.model.weights import resolve_weights, weights_kind

    if not torch.cuda.is_available():
        raise ValueError("--device: the levers bench needs a CUDA device")
    path = resolve_weights(args.model)
    dtype = resolve_dtype(args.dtype, torch.device("cuda"))
    label = run_label(torch.device("cuda"), args.model, dtype, weights=weights_kind(path))
    tables = {}

    def keep(new: dict[str, pd.DataFrame]) -> None:  # saved as they come: a later arm's failure loses nothing
        new = {name.replace("day61", args.stem, 1): table for name, table in new.items()}
        for name, table in new.items():
            print(f"{name}: {save_table(table, name, label)}", flush=True)
        tables.update(new)

    if args.only == "agreement":
        keep({"day61_fp32_agreement": fp32_agreement(path)})
        print(tables[f"{args.stem}_fp32_agreement"].to_string(index=False))
        return 0
    if args.trials is not None and args.trials < 1:
        raise ValueError(f"--trials must be at least 1, got {args.trials}")
    if args.only == "spread":
        arms = SPREAD_ARMS if args.arms is None else tuple(ARMS[int(i)] for i in args.arms.split(","))
        keep(tuning_spread(path, dtype, arms=arms, trials=args.trials or 3, steps=args.steps, repeats=args.repeats,
                           checkpoint=keep))
        spread = tables[f"{args.stem}_tuning_spread"]
        print(spread.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print(spread.groupby("arm").ms_per_step.describe().to_string(float_format="{:.3f}".format))
        return 0
    if args.only == "chain":
        keep({"day61_chained_projections": chained_projection_table(ModelConfig.from_dir(path), dtype)})
        c = tables[f"{args.stem}_chained_projections"]
        best = c[c.arm != "cublas"].sort_values("us").groupby("projection").head(3)
        print(pd.concat([c[c.arm == "cublas"], c[c.arm.str.contains("step_config")], best]).to_string(index=False))
        return 0
    if args.only == "mixed":
        from nanolab.lab.mixedsteps import mixed_step_anatomy

        keep(mixed_step_anatomy(path, dtype, repeats=args.repeats))
        print(tables[f"{args.stem}_mixed_anatomy"].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        kernels = tables.get(f"{args.stem}_mixed_kernels")
        if kernels is not None:
            print(kernels.groupby("arm", sort=False).head(12).to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "mixedhost":
        from nanolab.lab.mixedsteps import mixed_host_parts

        keep(mixed_host_parts(path, dtype, repeats=args.repeats))
        host = tables[f"{args.stem}_mixed_host"]
        print(host.drop(columns=["running_rows", "context", "budget"]).to_string(
            index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "loop":
        from nanolab import LLM
        from nanolab.lab.steploop import step_loop

        llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=64, enable_chunked_prefill=False)
        keep(step_loop(llm))
        print(tables[f"{args.stem}_loop"].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(tables[f"{args.stem}_loop_ops"].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "between":
        from nanolab import LLM
        from nanolab.lab.steploop import between_steps_ab

        llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=64, enable_chunked_prefill=False)
        keep(between_steps_ab(llm, trials=args.trials or 8, repeats=args.repeats))
        ab = tables[f"{args.stem}_between_ab"]
        print(ab.pivot_table(index="batch", columns="variant", values="ms_per_step", aggfunc="median")
              .to_string(float_format=lambda x: f"{x:.4f}"))
        print(tables[f"{args.stem}_between_loop"].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "folds":
        keep({"day61_folds": fold_table(ModelConfig.from_dir(path), dtype)})
        print(tables[f"{args.stem}_folds"].to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        return 0
    if args.only == "prefill":
        keep({"day61_prefill_levers": prefill_levers(path, dtype)})
        print(tables[f"{args.stem}_prefill_levers"].to_string(index=False))
        return 0
    if args.only != "levers":
        keep({"day61_projections": projection_table(ModelConfig.from_dir(path), dtype)})
    if args.only != "projections":
        arms = DEFAULT_ARMS if args.arms is None else tuple(ARMS[int(i)] for i in args.arms.split(","))
        shapes = {} if args.shapes is None else {"shapes": parse_shapes(args.shapes)}
        keep(run_levers(path, dtype, arms=arms, steps=args.steps, repeats=args.repeats,
                        profile_shapes=parse_shapes(args.profile, "--profile"), checkpoint=keep, **shapes))
    fmt = dict(index=False, float_format=lambda x: f"{x:.3f}")
    if f"{args.stem}_projections" in tables:
        p = tables[f"{args.stem}_projections"]
        best = p[p.arm.str.startswith("gemv")].sort_values("us").groupby(["projection", "rows"]).head(1)
        print(best.to_string(**fmt))
        print(p[p.arm.isin(("cublas", "gemv"))].pivot_table(index=["projection", "rows"], columns="arm",
                                                             values="us").to_string(float_format="{:.1f}".format))
    for name in (f"{args.stem}_parts", f"{args.stem}_lever_agreement", f"{args.stem}_levers"):
        if name in tables:
            print(tables[name].to_string(**fmt))
    print(label.caption())
    return 0
