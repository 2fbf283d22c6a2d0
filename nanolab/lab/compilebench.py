"""torch.compile over the decode step: how often dynamo rebuilds the graph, why, and what that costs.

Day 49. `run_compilebench` prefills eagerly and then runs a number of decode steps through an
engine built with the model compiled by inductor ("dynamic" or "static") as its decode forward,
or with the eager model ("off"); planned (the engine's decode) or unplanned (`lab.history`, the
decode Day 50 replaced). Everything the table reports comes from dynamo or is timed directly:

- builds: calls into the inductor backend. Every call is one graph that dynamo traced and
  inductor compiled, so a step that misses every cached graph's guards costs at least one. A
  graph dynamo throws away is counted too: when it restarts a frame's analysis (under
  dynamic=True, a float attribute it first traced as a symbol and then specialised), the
  backend has already compiled the first attempt.
- compile_s: dynamo's own timer around each frame compile ("_compile.compile_inner", its
  "entire_frame_compile" phase): bytecode analysis, tracing, guard building and the backend call,
  which is AOT autograd, inductor's lowering and the C++ compile. backend_s is the backend call
  alone, timed here. Attempts that end without a graph (a frame skipped after a graph break
  inside a loop, a recompile refused at the limit) are counted too: the time was spent.
- fell_back: dynamo recorded its own "Dynamo recompile limit exceeded" refusal. From then on the
  code object runs eagerly whenever none of its cached graphs' guards hold.
- guard_failures: dynamo's reason strings, verbatim (`torch._dynamo.utils.guard_failures`).

The model is run with oneDNN prepacking switched off in every mode, "off" included: inductor
cannot lower `mkldnn._linear_pointwise` on a weight it has not frozen itself, and the eager row
must run the same matmuls as the compiled ones for the speedup to mean anything.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pandas as pd
import torch
import torch._dynamo
from torch._dynamo.utils import compilation_time_metrics, counters, guard_failures
from torch._inductor.compile_fx import compile_fx

from nanolab import Engine, EngineConfig
from nanolab.engine.block_manager import cdiv
from nanolab.engine.kv_cache import CacheView
from nanolab.gates import Gate
from nanolab.lab.history import UnplannedView, unplanned_runner
from nanolab.lab.timing import prefill, random_prompts, timed_steps
from nanolab.model.layers import Linear

MODES = ("off", "dynamic", "static")
_FRAME_COMPILE = "_compile.compile_inner"
_LIMIT_HIT = "Dynamo recompile limit exceeded"


@dataclass(frozen=True, eq=False)  # eq=False: a tensor field has no truth value to compare by
class CompileResult:
    mode: str  # "off", "dynamic" or "static"
    planned: bool  # decode through a DecodePlan (Day 50) or the addressing inside the forward
    rows: int
    steps: int
    shapes: int  # distinct decode_shape over the steps
    builds: int  # inductor backend calls during the decode steps
    steps_with_build: int  # steps during which at least one build happened
    graph_breaks: int  # dynamo's graph-break count during the decode steps
    fell_back: bool  # dynamo refused a recompile at the recompile limit
    compile_s: float  # dynamo's whole-frame compile time, backend included
    backend_s: float  # the inductor backend calls alone
    step_ms: float  # median wall time of one Engine.step
    # dynamo's reasons, verbatim, grouped by code object in the order each first failed. On a
    # miss dynamo records a reason for every cached graph it tried, so one guard recurs.
    guard_failures: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]  # each row's greedy output, for the equality check
    logits: torch.Tensor  # [rows, vocab] fp32: the last decode step's, a finer equality check

    @property
    def reuse(self) -> float:
        """Share of steps that ran without a build. It is not 1 - builds / steps: with graph
        breaks, one step can build several graphs."""
        return 1.0 - self.steps_with_build / self.steps


def breakeven_steps(result: CompileResult, off: CompileResult) -> float:
    """Decode steps it takes for the per-step saving over `off` to repay compile_s: 0 when there
    was nothing to repay, inf when compiling saved nothing per step."""
    if result.compile_s == 0:
        return 0.0
    saved_s = (off.step_ms - result.step_ms) / 1000
    return result.compile_s / saved_s if saved_s > 0 else math.inf


def check_graph_reused(result: CompileResult) -> Gate:
    """The compiled decode builds in its first step at most and then replays: no later step
    builds, nothing breaks the graph, and dynamo never gives up and runs eagerly."""
    ok = result.steps_with_build <= 1 and result.graph_breaks == 0 and not result.fell_back
    return Gate("check_graph_reused", ok, {"builds": result.builds, "steps": result.steps,
                                           "steps_with_build": result.steps_with_build,
                                           "graph_breaks": result.graph_breaks, "fell_back": result.fell_back})


def first_guard_failure(result: CompileResult) -> str:
    """Dynamo's first guard-failure reason for this run, verbatim, or "" when no guard failed."""
    return result.guard_failures[0] if result.guard_failures else ""


def decode_shape(view: CacheView | UnplannedView) -> tuple[int, int]:
    """(rows, width) of the read rectangle one decode call builds, `slot_mapping` [rows, width].

    Call it just before the forward. Unplanned, the forward grows the tables and builds the
    rectangle afterwards, so the width is the longest history plus this step's token. A
    `DecodePlan` has grown the tables already and carries its width, which is read, not predicted.
    """
    if view.plan is not None:
        return view.plan.batch_size, view.plan.width
    return len(view.rows), max(view.cache.table(row).num_tokens for row in view.rows) + 1


def mark_plan_width_dynamic(view: CacheView | UnplannedView) -> None:
    """Mark the plan's read width as dynamic before a call (the view's slot_mapping [rows, width]
    and mask [rows, 1, width]), so the first build already has a symbol for it instead of waiting
    for automatic dynamic to see a second width. The planned path only: unplanned, the rectangle
    is built inside the forward and there is no input to mark."""
    if view.plan is None:
        raise ValueError("dynamic marks need a DecodePlan: an unplanned forward builds its rectangle inside")
    torch._dynamo.mark_dynamic(view.slot_mapping, 1)
    torch._dynamo.mark_dynamic(view.mask_bias, 2)


class CountingInductor:
    """The inductor backend, counted and timed: each call is one graph build."""

    def __init__(self) -> None:
        self.builds = 0
        self.seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        try:
            return compile_fx(gm, example_inputs)
        finally:
            self.builds += 1
            self.seconds += time.perf_counter() - start


class _DecodeProbe:
    """The engine's decode forward in a bench: records each call's decode_shape, applies `prepare`
    to the view, then calls the forward under test and keeps its last logits."""

    def __init__(self, forward: Callable, prepare: Callable[[CacheView], None] | None) -> None:
        self.forward = forward
        self.prepare = prepare
        self.shapes: list[tuple[int, int]] = []
        self.logits: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: CacheView | UnplannedView):
        self.shapes.append(decode_shape(cache))
        if self.prepare is not None:
            self.prepare(cache)
        out = self.forward(input_ids, positions, cache=cache)  # [rows, 1, vocab]
        self.logits = out[:, -1].clone()
        return out


@contextlib.contextmanager
def unpacked(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model with every prepacked `Linear` routed through F.linear, restored on exit."""
    packed = {m: m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None}
    for m in packed:
        m.packed = None
    try:
        yield model
    finally:
        for m, p in packed.items():
            m.packed = p


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _limit_hits() -> int:
    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith(_LIMIT_HIT))


def _frame_compile_times() -> list[float]:
    return compilation_time_metrics.get(_FRAME_COMPILE, [])


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Raise logger `name` to ERROR for the block, then restore its level."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_compilebench(model, *, mode: str, rows: int, prompt_len: int, steps: int, planned: bool,
                     block_size: int = 16, seed: int = 0, dynamic_marks: bool = False,
                     constant_floats: bool = True, cold: bool = True, bounds: str = "cache") -> CompileResult:
    """Prefill `rows` random prompts of `prompt_len` tokens eagerly, then time `steps` greedy
    decode steps with `mode`'s forward. Unplanned, the read takes its bounds from the host tables
    (`bounds="cache"`, Day 49's fix) or from the device (`"device"`, before it).

    The recompile limit is left as configured: falling back to eager at it is part of what is
    measured. `dynamic_marks` applies `mark_plan_width_dynamic` before every call.

    `constant_floats` compiles with `specialize_float=True`. Without it, `dynamic=True` traces the
    model's float hyper-parameters (RMSNorm's eps, the embedding's norm_type) as symbols, then
    specialises them and restarts its analysis ("Restarting analysis due to
    _tensorify_python_scalars") after inductor has already compiled the first attempt: every
    dynamic run builds twice, which is the second build Day 50 saw on the tiny model. `cold` turns
    off inductor's FX-graph and AOT-autograd caches, so a second run in the same process or on
    the same machine rebuilds instead of loading; inductor's cache of compiled C++ kernels is
    still consulted, so a kernel whose source an earlier run compiled is loaded, not rebuilt.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if dynamic_marks and not planned:
        raise ValueError("dynamic marks need planned=True: an unplanned forward has no width tensor to mark")
    if bounds != "cache" and planned:
        raise ValueError("bounds apply to the unplanned read: a planned read is validated on the host")
    torch._dynamo.reset()
    backend = CountingInductor()
    with contextlib.ExitStack() as stack:
        stack.enter_context(unpacked(model))
        # dynamo logs a warning when it hits the recompile limit; the result's `fell_back` reports it.
        stack.enter_context(_quiet_logger("torch._dynamo"))
        if cold:
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        if constant_floats:
            stack.enter_context(torch._dynamo.config.patch(specialize_float=True))
        forward = model if mode == "off" else torch.compile(model, dynamic=mode == "dynamic", backend=backend)
        probe = _DecodeProbe(forward, mark_plan_width_dynamic if dynamic_marks else None)
        # Days 49 and 50 study the reference read's guards, eagerly outside the probe; every step
        # after the prefill is a decode step.
        config = EngineConfig(num_blocks=rows * cdiv(prompt_len + steps + 1, block_size) + 1, block_size=block_size,
                              max_num_seqs=max(rows, 1), read="reference", enforce_eager=True,
                              enable_chunked_prefill=False)
        engine = Engine(model, config, forward=probe, **({} if planned else {"runner": unplanned_runner(bounds)}))
        seqs = prefill(engine, random_prompts(rows, prompt_len, model.config.vocab_size, seed), steps + 1)
        # dynamo's tallies are process-wide: count what the decode steps add to them.
        breaks, limit_hits, frames = _graph_breaks(), _limit_hits(), len(_frame_compile_times())
        built, seen = [], [backend.builds]

        def count_builds() -> None:
            built.append(backend.builds - seen[-1])
            seen.append(backend.builds)

        times = timed_steps(engine, steps, after=count_builds)
        assert all(s.finished for s in seqs), "a benchmark request outlived its steps"
        result = CompileResult(
            mode=mode, planned=planned, rows=rows, steps=steps,
            shapes=len(set(probe.shapes)),
            builds=backend.builds,
            steps_with_build=sum(n > 0 for n in built),
            graph_breaks=_graph_breaks() - breaks,
            fell_back=_limit_hits() > limit_hits,
            compile_s=sum(_frame_compile_times()[frames:], 0.0),
            backend_s=backend.seconds,
            step_ms=1000 * statistics.median(times),
            guard_failures=tuple(reason for reasons in guard_failures.values() for reason in reasons),
            tokens=tuple(tuple(s.output_token_ids) for s in seqs),
            logits=probe.logits,
        )
    torch._dynamo.reset()
    return result


def results_table(results: list[CompileResult]) -> pd.DataFrame:
    """The seed's table, one row per result; speedup and breakeven are against the "off" row."""
    off = next((r for r in results if r.mode == "off"), None)
    if off is None:
        raise ValueError("the table needs an 'off' row to measure speedup against")
    return pd.DataFrame([{
        "mode": r.mode,
        "rows": r.rows,
        "steps": r.steps,
        "shapes": r.shapes,
        "builds": r.builds,
        "reuse": r.reuse,
        "fell back": r.fell_back,
        "graph breaks": r.graph_breaks,
        "compile s": r.compile_s,
        "step ms": r.step_ms,
        "speedup": off.step_ms / r.step_ms,
        "breakeven steps": breakeven_steps(r, off),
    } for r in results])


def guards_table(results: dict[str, CompileResult]) -> pd.DataFrame:
    """Every guard failure of every mode, in order, dynamo's reason verbatim: one row each."""
    return pd.DataFrame([{"mode": mode, "order": i, "reason": reason}
                         for mode, r in results.items() for i, reason in enumerate(r.guard_failures)],
                        columns=["mode", "order", "reason"])


def compilebench_table(model, *, rows: int, prompt_len: int, steps: int, planned: bool,
                       modes: tuple[str, ...] = MODES, **kwargs) -> tuple[pd.DataFrame, dict[str, CompileResult]]:
    """Run every mode ("off" first, since the others are measured against it) and return the
    table with the results behind it, whose guard_failures the table leaves out. `kwargs` go to
    `run_compilebench`."""
    order = ("off", *(m for m in modes if m != "off"))
    results = {m: run_compilebench(model, mode=m, rows=rows, prompt_len=prompt_len, steps=steps, planned=planned,
                                   **kwargs) for m in order}
    return results_table(list(results.values())), results
