"""CUDA graphs of the planned decode step, one per capture bucket, and of the padded varlen step
(prompt chunks beside decode rows), one per token count, over one shared memory pool, captured
(and warmed up) when the engine starts.

A graph records `cache.view(plan)` and the forward together, so the derivation of the step's read
inputs from the persistent block table is replayed too. A capture plan is all padding: its rows
point at the all-sink table row and write only to the sink, so capturing never touches a live row.
Capture runs largest shape first and every graph draws on one pool: the first graph sizes it and
every later one fits inside, since only one graph runs at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.plan import DecodePlan, VarlenPlan
from nanolab.progress import progress_bar


@dataclass(frozen=True)
class CaptureReport:
    """What warming the capture list cost: time, and the device memory the graphs keep."""

    shapes: int
    seconds: float
    pool_bytes: int  # device memory reserved by the captures and kept while the graphs live
    shared_pool: bool
    kind: str = "decode"

    def __str__(self) -> str:
        pool = "one shared pool" if self.shared_pool else "a pool per graph"
        return (f"captured {self.shapes} {self.kind} graphs in {self.seconds:.2f} s; "
                f"{pool} holds {self.pool_bytes / 2**20:.1f} MiB")


def capture_sizes(max_size: int) -> tuple[int, ...]:
    """The token counts a varlen step is captured at, up to `max_size`: vLLM's list, 1, 2, 4, then
    every 8 below 256 and every 16 from 256, and `max_size` itself when the steps miss it."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    sizes = [n for n in (1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)) if n <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return tuple(sizes)


def planned_step(forward: Callable, cache: KVCache, ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """One planned decode step: ids [batch, 1] -> logits [batch, vocab] fp32. The view derives the
    step's read inputs on the device; this is the function a graph captures."""
    return forward(ids, plan.positions, cache=cache.view(plan))[:, -1]


def capture_graph(fn: Callable[[], torch.Tensor], pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm `fn` once on a side stream (lazy library initialisation and allocator growth must not
    happen inside a capture), then capture it into a graph drawing on `pool`. Returns the graph and
    what `fn` returned under capture, the tensor each replay overwrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class DecodeGraphs:
    """A CUDA graph per bucket of `buckets`, each replaying `planned_step` at that shape.

    `ids` is the one static input the engine writes per step ([max batch, 1], sized for the
    largest bucket); everything else a graph reads is the cache's: pools, block table and
    `step_inputs`, which `plan_decode` fills before each replay."""

    def __init__(self, forward: Callable, cache: KVCache, buckets: DecodeBuckets) -> None:
        if buckets.widths is None and cache.read != "streamed":
            raise ValueError("a capture list without widths needs the streamed read: the reference read's "
                             "rectangle is as wide as its bucket")
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {cache.device}")
        if buckets.max_batch_size > cache.max_rows or (buckets.max_width or 0) > cache.max_width:
            raise ValueError(f"the largest bucket ({buckets.max_batch_size} rows x {buckets.max_width}) does not fit "
                             f"the cache ({cache.max_rows} rows x {cache.max_width} tokens)")
        self.forward = forward
        self.cache = cache
        self.buckets = buckets
        self.ids = torch.zeros((buckets.max_batch_size, 1), dtype=torch.int64, device=cache.device)
        self.graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int | None], torch.Tensor] = {}  # each graph's output, [batch, vocab]
        self.report: CaptureReport | None = None
        self.pool = None  # the memory pool the graphs were captured on, when they share one

    def __contains__(self, shape) -> bool:
        return shape in self.graphs

    def capture(self, *, shared_pool: bool = True, progress: bool = True) -> CaptureReport:
        """Warm and capture every bucket, largest first (`capture_graph`)."""
        self.release()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle() if shared_pool else None
        self.pool = pool
        start = time.perf_counter()
        shapes = self.buckets.shapes
        for batch, width in progress_bar(shapes, desc="capturing decode graphs", unit="graph", enabled=progress):
            plan = self.cache.plan_decode((), batch_size=batch, width=width)  # all padding: writes the sink only
            ids = self.ids[:batch]
            with torch.inference_mode():
                graph, self.logits[batch, width] = capture_graph(
                    lambda ids=ids, plan=plan: planned_step(self.forward, self.cache, ids, plan), pool)
            self.graphs[batch, width] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # what the warm-ups left cached is not the graphs'
        self.report = CaptureReport(len(shapes), seconds, torch.cuda.memory_reserved() - before, shared_pool)
        return self.report

    def release(self) -> None:
        """Drop every graph and its outputs, returning their pools."""
        self.graphs.clear()
        self.logits.clear()
        self.report = None

    def replay(self, shape: tuple[int, int | None], ids: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """Run the step `plan` describes (already planned at `shape`) through its graph: ids [rows, 1]
        -> logits [rows, vocab], a view of the graph's output that the next replay overwrites. A
        graph without a width (the streamed read) serves a plan of any width."""
        batch, width = shape
        self.cache.require_current(plan)
        if plan.batch_size != batch or width not in (None, plan.width):
            raise ValueError(f"the plan is {plan.batch_size} x {plan.width}, the graph {batch} x {width}")
        rows = ids.shape[0]
        self.ids[:rows].copy_(ids, non_blocking=True)
        self.graphs[shape].replay()
        return self.logits[shape][:rows]


def varlen_step(model: Callable, cache: KVCache, plan: VarlenPlan) -> torch.Tensor:
    """One padded varlen step -> logits [max_rows, vocab] fp32, at `plan.logits_index`: the sampled
    tokens' first, then padding. Everything it reads is the cache's fixed buffers (`plan` is a
    view of them), so this is the function a varlen graph captures."""
    return model(plan.input_ids, plan.positions, cache=cache.view(plan), logits_index=plan.logits_index)


class VarlenGraphs:
    """A CUDA graph of `varlen_step` per token count of `sizes` (vLLM's mixed-batch graphs, keyed on
    the padded token count). A step of n tokens replays the smallest size holding n; a step larger
    than every size runs eagerly. The cache's varlen buffers are reserved for the largest size.
    `model` is what the graphs capture: the model, or a compiled stand-in taking the same arguments
    (`runner.DecodeForward.varlen`); `vocab_size` its logits' width."""

    def __init__(self, model: Callable, cache: KVCache, sizes: tuple[int, ...], vocab_size: int) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the cache is on {cache.device}")
        if cache.read != "streamed":
            raise ValueError("a varlen graph needs the streamed read: the reference read walks its segments "
                             "on the host")
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be distinct positive token counts in ascending order, got {sizes}")
        self.model = model
        self.cache = cache
        self.sizes = tuple(sizes)
        cache.reserve_varlen(self.sizes[-1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph copies its logits here, [max_rows, vocab] fp32, outside the pool: kept per
        # graph, 51 outputs of Llama-3's vocabulary at 64 rows would hold 1.6 GiB.
        self.logits = torch.empty((cache.max_rows, vocab_size), dtype=torch.float32,
                                  device=cache.device)
        self.report: CaptureReport | None = None

    def lookup(self, num_tokens: int) -> int | None:
        """The smallest captured size holding `num_tokens` tokens, or None (the step runs eagerly)."""
        return next((n for n in self.sizes if n >= num_tokens), None)

    def capture(self, pool=None, *, progress: bool = True) -> CaptureReport:
        """Warm and capture every size, largest first, on `pool` (the decode graphs', to share it)."""
        self.graphs.clear()
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        start = time.perf_counter()
        for n in progress_bar(self.sizes[::-1], desc="capturing varlen graphs", unit="graph", enabled=progress):
            plan = self.cache.plan_varlen_padding(n)  # all padding: writes the sink only
            with torch.inference_mode():
                graph, _ = capture_graph(
                    lambda plan=plan: self.logits.copy_(varlen_step(self.model, self.cache, plan)), pool)
            self.graphs[n] = graph
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        torch.cuda.empty_cache()
        self.report = CaptureReport(len(self.sizes), seconds, torch.cuda.memory_reserved() - before, True, "varlen")
        return self.report

    def replay(self, plan: VarlenPlan, num_sampled: int) -> torch.Tensor:
        """Run the padded step `plan` through the graph of its size -> logits [num_sampled, vocab], a
        view of the graphs' output buffer that the next replay overwrites."""
        self.cache.require_current_varlen(plan)
        graph = self.graphs.get(plan.num_tokens)
        if graph is None:
            raise ValueError(f"no varlen graph for {plan.num_tokens} tokens; captured: {sorted(self.graphs)}")
        graph.replay()
        return self.logits[:num_sampled]
