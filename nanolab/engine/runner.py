"""`ModelRunner`: plans a scheduled batch, runs the forward it was built with, returns the logits.

Engine core (before Day 49); planned decode Day 50, buckets Day 52, graphs Days 54 and 56, varlen
steps with chunked prefill. Which forward a decode step runs is fixed at construction: the model
eagerly, a stand-in given as `forward` (a compiled model), and on top of either, CUDA graphs over
the capture buckets. A decode batch outside the capture list runs the same planned step eagerly. A
step that is not decode-only (whole prompts, chunks, and decode rows beside them) runs the model
eagerly over one flattened varlen plan, or compiled where the decode forward compiled one.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import DecodeGraphs, planned_step
from nanolab.engine.kv_cache import KVCache, host_int64, stage
from nanolab.engine.plan import DecodePlan
from nanolab.engine.sequence import Sequence
from nanolab.kernels import pdl as pdl_module
from nanolab.kernels.pdl import supports_pdl
from nanolab.model.llama import LlamaModel

# Inductor's options for the batch-1 graph. With coordinate-descent tuning on, inductor lowers a
# matmul of one row into a multiply and a sum, a Triton reduction that it tunes for its shape and
# fuses with the norm or activation beside it. On the H200 the reductions read Llama-3.2-1B's
# weights a little slower than cuBLAS, but the step lost its separate norm kernels and the gaps
# around them, and got shorter (Day 61). The tuning starts afresh with each process, and what it
# settles on varies: compiled six times, the same step took 1.02 to 1.21 ms.
BATCH_1_OPTIONS = {"coordinate_descent_tuning": True}
# Inductor's option that launches each of its Triton kernels as a programmatic dependent of the one
# before (Hopper's PDL): it waits in-kernel before its first read of what an earlier kernel wrote.
# On by default where the GPU has it (`compile_decode`): four fresh compiles of Llama-3.2-1B's
# batch-1 step each way on the H200 took 0.99 to 1.09 ms with it, 1.06 to 1.20 without (Day 61);
# the batched graph, whose projections are cuBLAS's, did not move.
PDL_OPTIONS = {"triton.enable_pdl": True}


@contextlib.contextmanager
def steady_tuning() -> Iterator[None]:
    """While inside, inductor's autotuner times each candidate config with Triton's `do_bench` (25 ms
    of warm-up, then the median of 40 ms of calls) instead of its default benchmarker (the fastest
    of at most 100 calls, after one untimed call and five that estimate its length). The tuning
    happens at a kernel's first run, after seconds of compiling with the GPU idle, and the default's
    timings of one config of Llama-3.2-1B's down projection then ranged from 31 to 50 us from one
    compile to the next. Over eight compiles coordinate descent settled on six different configs;
    the one it chose three times ran 185 us a step in the graph every time, the others 225 to 294
    (Day 61, the H200). Timed after a warm-up, it chose that config in three compiles of four. Swaps
    the benchmarker inductor's heuristics module holds
    (`torch._inductor.runtime.triton_heuristics.benchmarker`), a process-wide setting: two threads
    compiling at once would see each other's."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.benchmarking import TritonBenchmarker

    saved = triton_heuristics.benchmarker
    triton_heuristics.benchmarker = TritonBenchmarker()
    try:
        yield
    finally:
        triton_heuristics.benchmarker = saved


# On the CPU, inductor's wrapper (the code that calls each kernel and op in turn) in C++ rather
# than Python: SmolLM2's compiled one-row step spent about 2.5 ms of 29 in the Python wrapper's
# calls, and ran 27.4 ms with it in C++ (Day 61), for about 40 s more at start compiling it. Not
# for a tensor-parallel shard: the C++ wrapper cannot pass the process-group argument of the
# vocabulary all-gather in torch 2.13.
CPU_OPTIONS = {"cpp_wrapper": True}
# Whether `compile_decode` compiles the varlen steps that mix decode rows with prompt chunks as well
# (`DecodeForward.run_varlen`). Eagerly such a step took 9.0 to 12.7 ms at the median on the H200
# under Day 58's load, four to six decode steps, and ITL's p99 lands on those steps (Day 61). Off:
# compiled, the mixed step's median under the same load was 8.49 ms against 8.47 eagerly at 32
# requests/s, and 11.96 against 13.51 at 16; about 7 ms of it follows neither its tokens nor its
# compilation (`data/day61_varlen_*`).
COMPILE_VARLEN = False


class DecodeForward:
    """The decode step compiled by inductor: inductor fuses the norms and residual adds and the
    activations between the projections into a few kernels a layer, and the rotation with the
    K/V write (`kernels.elementwise.rope_write_op`) and the streamed read (`paged_attention_op`)
    stay one opaque op each. Two compiled graphs of one model: every batch but 1 goes through
    `batched`, whose batch is symbolic, so the capture buckets share it and its projections are
    cuBLAS's; batch 1 goes through `single`, compiled with inductor's `batch_1_options` when given
    (the engine's are `BATCH_1_OPTIONS`: its projections become tuned Triton reductions with the
    norms folded in, and tuning every kernel adds tens of seconds at start for Llama-3.2-1B), else
    batch 1 shares `batched`. With `opaque_head`, the LM head stays cuBLAS's in both graphs
    (`layers.Linear.opaque`): set on the model, so it holds for every compile of it after. With
    `pdl`, both graphs' Triton kernels are launched as programmatic dependents (`PDL_OPTIONS`), and
    so are the engine's own ops in every call of it (`kernels.pdl.OPS_PDL` otherwise). With
    `steady`, batch 1's kernels are tuned inside `steady_tuning`. `options`: inductor's, for both
    graphs. With `varlen`, a third graph (`run_varlen`) serves the varlen steps that mix decode rows
    and prompt chunks, its token count symbolic. Compiling happens on the first call of each."""

    def __init__(self, model: LlamaModel, batch_1_options: dict | None = None, pdl: bool = False,
                 opaque_head: bool = False, options: dict | None = None, steady: bool = False,
                 varlen: bool = False) -> None:
        model.lm_head.opaque = opaque_head
        extra = {**(options or {}), **(PDL_OPTIONS if pdl else {})}
        self.options = extra  # inductor's options for both graphs, besides `batch_1_options`
        self.batched = torch.compile(model, dynamic=True, fullgraph=True, options=extra or None)
        self.single = (self.batched if batch_1_options is None else
                       torch.compile(model, dynamic=True, fullgraph=True, options={**batch_1_options, **extra}))
        self.batch_1_options = batch_1_options
        self.pdl, self.steady = pdl, steady
        self.varlen = torch.compile(model, dynamic=True, fullgraph=True, options=extra or None) if varlen else None

    @property
    def tune_batch_1(self) -> bool:
        return self.batch_1_options == BATCH_1_OPTIONS

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # ids [batch, tokens]: the batch is a Python int here, so a graph captures one branch.
        single = ids.shape[0] == 1
        with (steady_tuning() if self.steady and single else contextlib.nullcontext()), \
                pdl_module.launching_dependents(self.pdl or pdl_module.OPS_PDL):
            return (self.single if single else self.batched)(ids, positions, cache=cache)

    def run_varlen(self, ids: torch.Tensor, positions: torch.Tensor, cache, logits_index: torch.Tensor
                   ) -> torch.Tensor:
        """A varlen step through the compiled varlen graph: ids and positions [1, num_tokens], the
        logits of `logits_index`'s tokens [n, vocab] fp32, as the model's forward returns them. The
        streamed read only: its varlen attention is one opaque op with nothing of the plan's host
        values in it (`varlen_attention_op`), where the reference read loops over segments."""
        with pdl_module.launching_dependents(self.pdl or pdl_module.OPS_PDL):
            return self.varlen(ids, positions, cache=cache, logits_index=logits_index)


def mark_step_kernels(model: LlamaModel, on: bool) -> None:
    """Mark every layer's projections (not the LM head) to run through `kernels.gemv.step_linear` in a
    compiled step of 2 rows or more (`layers.Linear.step_kernel`), or not. Set on the model, so it
    holds for every compile of it after. Batch 1's graph keeps inductor's tuned reductions."""
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            linear.step_kernel = on


def compile_decode(model: LlamaModel, tune_batch_1: bool | None = None, pdl: bool | None = None,
                   steady: bool | None = None, varlen: bool | None = None) -> DecodeForward:
    """`model` compiled for decode steps (`DecodeForward`), batch 1 with `BATCH_1_OPTIONS` when
    `tune_batch_1`: by default for a model on CUDA, since inductor lowers a one-row matmul that way
    on accelerators only. With tuning, the LM head stays cuBLAS's (`opaque_head`): tuned afresh at
    each start, its reduction read the 525 MB head of Llama-3.2-1B in 115 to 328 us, cuBLAS in 120
    every time (Day 61), and the tuning is `steady` unless told. `pdl` as `DecodeForward`'s, by
    default wherever the GPU has it (`PDL_OPTIONS`), except for a tensor-parallel shard. With PDL,
    the layers' projections of a few rows run through the Triton GEMV (`mark_step_kernels`). A
    model on the CPU compiles with `CPU_OPTIONS`, unless it is a tensor-parallel shard. `varlen`
    (`COMPILE_VARLEN` unless told) compiles the mixed varlen steps too (`DecodeForward.run_varlen`)."""
    param = next(model.parameters())
    device = param.device.type
    if tune_batch_1 is None:
        tune_batch_1 = device == "cuda"
    if pdl is None:  # not yet for a tensor-parallel shard, whose graphs hold NCCL's kernels: unmeasured
        pdl = supports_pdl(param.device) and model.tp is None
    if steady is None:
        steady = tune_batch_1
    # The GEMV paid through PDL alone (launch by launch it ties cuBLAS): only where the step has PDL.
    mark_step_kernels(model, pdl and supports_pdl(param.device))
    if varlen is None:
        varlen = COMPILE_VARLEN
    return DecodeForward(model, BATCH_1_OPTIONS if tune_batch_1 else None, pdl=pdl, opaque_head=tune_batch_1,
                         options=CPU_OPTIONS if device == "cpu" and model.tp is None else None, steady=steady,
                         varlen=varlen)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, *, forward: Callable | None = None,
                 buckets: DecodeBuckets | None = None, cuda_graphs: bool = False, progress: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.forward = model if forward is None else forward  # what a decode step calls
        # Mixed varlen steps through the decode forward's compiled varlen graph, where it has one and
        # the cache reads streamed (`DecodeForward.run_varlen`); else the model, eagerly.
        self.compiled_varlen = getattr(self.forward, "varlen", None) is not None and kv_cache.read == "streamed"
        if self.compiled_varlen:
            kv_cache.mark_static()  # the varlen graph's token count is the one size that moves
        if cuda_graphs and buckets is None:
            # Up to 64 rows and 8,192 tokens; the streamed read has no width, so its list is the
            # batch axis alone (Day 60).
            buckets = DecodeBuckets.default(min(kv_cache.max_rows, 64), min(kv_cache.max_width, 8192), min_width=128)
            if kv_cache.read == "streamed":
                buckets = buckets.without_width()
        self.buckets = buckets
        self.graphs: DecodeGraphs | None = None
        # The last decode step's shape as it ran: (rows the forward ran at, whether a graph replayed).
        self.last_decode: tuple[int, bool] = (0, False)
        if cuda_graphs:
            self.graphs = DecodeGraphs(self.forward, kv_cache, buckets)
            self.graphs.capture(progress=progress)

    def close(self) -> None:
        """Release what the runner started besides this process's memory: nothing here; a
        tensor-parallel leader's workers (`engine.parallel.LeaderRunner`)."""

    def planned(self, kind: str, seqs: list[Sequence], ids, counts: list[int] | None, sampled: list[bool] | None
                ) -> None:
        """Called between a step's plan and its forward: "varlen" with the host ids, the counts and
        which rows are sampled, or "decode" with its ids [batch, 1] (host, or still being sampled on
        the device). Nothing here; a tensor-parallel leader tells its workers (`engine.parallel`)."""

    @torch.inference_mode()
    def run_varlen(self, seqs: list[Sequence], num_scheduled_tokens: list[int], num_computed_tokens: list[int],
                   sampled: list[bool]) -> torch.Tensor:
        """One flattened forward of every scheduled token: sequence i feeds its tokens
        num_computed_tokens[i] .. + num_scheduled_tokens[i] - 1 (a prompt, a chunk of one, or a
        decode row's pending token) -> logits [sum(sampled), vocab] fp32, at the last token of each
        sampled sequence, in order. A varlen step has no capture: it runs the model eagerly, or, when
        the decode forward compiled one (`DecodeForward.run_varlen`) and the cache reads streamed,
        through that graph, unless every segment is a whole prompt (those attend through torch's
        fused attention, one call a prompt)."""
        plan = self.kv_cache.plan_varlen([s.row for s in seqs], num_scheduled_tokens, sampled)
        ids = list(itertools.chain.from_iterable(
            s.token_ids[a:a + n] for s, a, n in zip(seqs, num_computed_tokens, num_scheduled_tokens, strict=True)))
        self.planned("varlen", seqs, ids, num_scheduled_tokens, sampled)
        ids = host_int64(ids).to(self.device)[None]  # [1, num_tokens]
        view = self.kv_cache.view(plan)
        if self.compiled_varlen and not plan.whole_prompts:
            return self.forward.run_varlen(ids, plan.positions, view, plan.logits_index)
        return self.model(ids, plan.positions, cache=view, logits_index=plan.logits_index)

    def plan_step(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> tuple[DecodePlan, torch.Tensor]:
        """Plan a decode step, padded to its bucket when it has one, and its input ids [batch, 1]:
        `ids` [rows] on the device when given (tokens still being sampled by the step before, for
        asynchronous scheduling), else each sequence's last token from the host, in pinned memory.
        Padded rows decode token 0."""
        tables = [self.kv_cache.blocks.table(s.row) for s in seqs]
        longest = max(t.num_tokens for t in tables) + 1  # this step's token included
        shape = None if self.buckets is None else self.buckets.lookup(len(seqs), longest)
        plan = self.kv_cache.plan_decode([s.row for s in seqs], batch_size=shape and shape[0],
                                         width=shape and shape[1])
        if ids is not None:
            return plan, ids.view(-1, 1)
        host = torch.zeros((plan.batch_size, 1), dtype=torch.int64)
        host[: len(seqs), 0] = torch.tensor([s.output_token_ids[-1] for s in seqs])
        return plan, stage(host, self.device)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None) -> torch.Tensor:
        """One new token's logits for every sequence -> [rows, vocab] fp32. `ids` as `plan_step`."""
        plan, ids = self.plan_step(seqs, ids)
        self.planned("decode", seqs, ids, None, None)
        if self.graphs is not None:
            shape = (plan.batch_size, plan.width if self.buckets.widths is not None else None)
            if shape in self.graphs:
                self.last_decode = (plan.batch_size, True)
                return self.graphs.replay(shape, ids[: len(seqs)], plan)
        self.last_decode = (plan.batch_size, False)
        if ids.shape[0] < plan.batch_size:  # device ids cover the live rows only: pad with token 0
            ids = torch.cat([ids, ids.new_zeros((plan.batch_size - ids.shape[0], 1))])
        return planned_step(self.forward, self.kv_cache, ids.to(self.device, non_blocking=True), plan)[: len(seqs)]
