"""Day 61's levers as engines: each arm of the waterfall is an `EngineConfig` and the decode forward
handed to `Engine` at construction (`lever_engine`), over the engine as it is now.

An arm that pulled a lever the engine has since made its only design (pinned step inputs, the one
rotation-and-write kernel, the read's shares folded in its own kernel, the plan's upload kernel) or
deleted (a weight tile ahead of the PDL wait, weights asked of L2 ahead, kernels released as they
start, split-K added in the GEMV's kernel, other read grids, the GEMV past 16 rows) cannot run
again: its measured rows stay in `data/` (`lab.leverrun.show_lever_run` shows them).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab import Engine, EngineConfig
from nanolab.engine.runner import DecodeForward, compile_decode, mark_step_kernels
from nanolab.lab.folds import folded_decode
from nanolab.lab.projections import FusedDecode
from nanolab.sampling import sample_tokens


@dataclass(frozen=True)
class Lever:
    name: str
    compile: bool = False  # inductor over the graphed step (`runner.compile_decode`)
    async_scheduling: bool = False  # launch step t + 1 before reading back step t (`EngineConfig`)
    # up to 16 rows, the fused projections (`lab.projections.FusedDecode`), the compiled step past that
    fused: bool = False
    pdl: bool = False  # the fused step's kernels launched as programmatic dependents (`kernels.pdl`)
    autotune: bool = False  # batch 1 through its own graph, projections autotuned at M = 1 (`autotuned_batch_1`)
    tune_batch_1: bool = False  # batch 1's graph with coordinate-descent tuning (`runner.BATCH_1_OPTIONS`)
    step_pdl: bool = False  # the compiled step's kernels launched as programmatic dependents (`runner.PDL_OPTIONS`)
    opaque: tuple[str, ...] = ()  # projections inductor leaves to cuBLAS (`layers.Linear.opaque`): "lm_head", "down"
    steady: bool = False  # batch 1's kernels tuned with a warmed-up benchmark (`runner.steady_tuning`)
    # 2 to `gemv.STEP_ROWS` rows: the layers' projections through `gemv.step_linear` in the step
    triton_projections: bool = False
    # a batch's norms, residual adds and SwiGLU folded into its GEMVs, to 64 rows (`lab.folds.FoldedStep`)
    step_fused: bool = False


# Cumulative up to "+ async scheduling": each arm keeps every lever before it. The batch-1 arms
# branch off that one, and the fused projections (and PDL over them) too. PDL in the compiled step
# and the cuBLAS projections each branch off the tuned batch 1; PDL over the kept step and the
# tuning timed after a warm-up, in turn, off the cuBLAS LM head; the Triton GEMV in the batched step
# off that; the norms folded into the GEMVs off the GEMV.
ARMS = (
    Lever("graphs, eager forward"),
    Lever("+ inductor", compile=True),
    Lever("+ async scheduling", compile=True, async_scheduling=True),
    Lever("+ autotuned batch-1 projections", compile=True, async_scheduling=True, autotune=True),
    Lever("+ tuned batch-1 reductions", compile=True, async_scheduling=True, tune_batch_1=True),
    Lever("+ fused projections", compile=True, async_scheduling=True, fused=True),
    Lever("+ PDL", compile=True, async_scheduling=True, fused=True, pdl=True),
    Lever("+ PDL in the compiled step", compile=True, async_scheduling=True, tune_batch_1=True, step_pdl=True),
    Lever("+ cuBLAS LM head", compile=True, async_scheduling=True, tune_batch_1=True, opaque=("lm_head",)),
    Lever("+ cuBLAS LM head and down", compile=True, async_scheduling=True, tune_batch_1=True,
          opaque=("lm_head", "down")),
    Lever("+ PDL over the kept step", compile=True, async_scheduling=True, tune_batch_1=True, opaque=("lm_head",),
          step_pdl=True),
    Lever("+ tuning timed after a warm-up", compile=True, async_scheduling=True, tune_batch_1=True,
          opaque=("lm_head",), step_pdl=True, steady=True),
    Lever("+ Triton projections to 16 rows", compile=True, async_scheduling=True, tune_batch_1=True,
          opaque=("lm_head",), step_pdl=True, steady=True, triton_projections=True),
    Lever("+ norms, residual adds and SwiGLU inside the GEMVs", compile=True, async_scheduling=True,
          tune_batch_1=True, opaque=("lm_head",), step_pdl=True, steady=True, triton_projections=True,
          step_fused=True),
)
# What `levers` runs unless told: the graphed engine with an eager forward, every kept lever added in
# turn (the last arm is the engine's defaults). The levers measured and not kept run by index (--arms).
DEFAULT_ARMS = tuple(ARMS[i] for i in (0, 1, 2, 4, 8, 10, 11, 12))
# The batch-1 arms `tuningspread.tuning_spread` compiles afresh unless told: the tuned step, and it with PDL.
SPREAD_ARMS = (ARMS[4], ARMS[7])

# Inductor's options for `autotuned_batch_1`'s graph: each projection timed at M = 1 as cuBLAS and as
# inductor's Triton matmul templates, the faster kept.
AUTOTUNE_BATCH_1 = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}


def autotuned_batch_1(model) -> DecodeForward:
    """The compiled step (`runner.DecodeForward`) with batch 1's graph compiled with
    `AUTOTUNE_BATCH_1` instead: its projections autotuned at M = 1. Measured on the H200 and not
    kept (`day61_autotune_levers`): the templates it picked, timed alone with their weights warm in
    L2, read them slower than cuBLAS inside the step."""
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


def lever_forward(model, lever: Lever) -> Callable | None:
    """The decode forward `lever` hands the engine (None: the model, eagerly, under the graphs), with
    the model's projections marked as the lever says (`opaque_projections`, `runner.mark_step_kernels`),
    over what `compile_decode` marks. With `step_fused`, the compiled forward is `lab.folds.FoldedStep`'s."""
    forward = None
    if lever.compile:
        build = folded_decode if lever.step_fused else compile_decode
        forward = (autotuned_batch_1(model) if lever.autotune else
                   build(model, tune_batch_1=lever.tune_batch_1, pdl=lever.step_pdl, steady=lever.steady))
    opaque_projections(model, lever.opaque)  # compiling happens at the first call, in the engine's capture
    mark_step_kernels(model, lever.triton_projections)  # the lever's own say, over compile_decode's default
    if lever.fused:
        forward = FusedDecode(model, forward, pdl=lever.pdl)
    return forward


def release_arm_memory() -> None:
    """Collect an arm's engine once its caller dropped it and hand its CUDA blocks back, so the
    next arm's pool and graphs start from the same free memory."""
    gc.collect()
    torch.cuda.empty_cache()


def lever_engine(model, lever: Lever, sampler: Callable = sample_tokens, **fields) -> tuple[Engine, float]:
    """A graphed engine over `model` (on CUDA) with `lever`'s settings, the streamed read and whole
    prompts (`timing.prefill` counts on them), and the seconds building it took (compile included).
    `sampler` goes to the engine; `fields` are more of `EngineConfig`'s (the pool, the rows)."""
    start = time.perf_counter()
    config = EngineConfig(read="streamed", compile=lever.compile, async_scheduling=lever.async_scheduling,
                          enable_chunked_prefill=False, **fields)
    engine = Engine(model, config, forward=lever_forward(model, lever), sampler=sampler, progress=False)
    torch.cuda.synchronize()
    return engine, time.perf_counter() - start
