"""`ModelRunner`: plans a scheduled batch, runs the forward it was built with, returns the logits.

Which forward a decode step runs is fixed at construction: the model eagerly, or a stand-in given
as `forward` (the model compiled by inductor, `compile_decode`), and on top of either, CUDA graphs
over the capture buckets. A decode batch outside the capture list runs the same planned step
eagerly. A step that is not decode-only (whole prompts, chunks, and decode rows beside them) runs
one flattened varlen plan: padded to a capture size, it replays a varlen graph of the same forward
(`DecodeForward.varlen` when compiled); larger, or with no varlen graphs, the model eagerly.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import torch

from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import DecodeGraphs, VarlenGraphs, capture_sizes, planned_step
from nanolab.engine.kv_cache import KVCache, host_int64, stage
from nanolab.engine.plan import DecodePlan
from nanolab.engine.sequence import Sequence
from nanolab.kernels import pdl as pdl_module
from nanolab.kernels.pdl import supports_pdl
from nanolab.model.llama import LlamaModel

# Inductor's options for the batch-1 graph: coordinate-descent tuning lowers a one-row matmul into
# a tuned Triton reduction fused with the norm or activation beside it (no separate norm kernels).
BATCH_1_OPTIONS = {"coordinate_descent_tuning": True}
# Each of inductor's Triton kernels launched as a programmatic dependent of the one before
# (Hopper's PDL): it waits in-kernel before its first read of what an earlier kernel wrote.
PDL_OPTIONS = {"triton.enable_pdl": True}
# On the CPU, inductor's wrapper (the code that calls each kernel in turn) in C++ rather than
# Python. Not for a tensor-parallel shard: the C++ wrapper cannot pass the process-group argument
# of the vocabulary all-gather.
CPU_OPTIONS = {"cpp_wrapper": True}
# Dynamo's limit on the graphs it compiles for one function, while a compiled step runs. Dynamo
# counts them per code object across the process, and every engine's model shares
# `LlamaModel.forward`: one engine compiles 4 (decode at one row and at more, varlen at one token
# and at more), and an engine of another dtype, quantization or options compiles 4 of its own. At
# Dynamo's default of 8 a process's third such engine (a bench or test file holding several)
# failed its capture with a recompile-limit error.
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def steady_tuning() -> Iterator[None]:
    """While inside, inductor's autotuner times each candidate config with Triton's `do_bench` (a
    warm-up, then the median of many calls) instead of its default benchmarker (the fastest of a
    few calls right after compiling, with the GPU idle until then), whose timings of one config
    move by a third from one compile to the next. Swaps the benchmarker inductor's heuristics
    module holds (`torch._inductor.runtime.triton_heuristics.benchmarker`), a process-wide
    setting: two threads compiling at once would see each other's."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.benchmarking import TritonBenchmarker

    saved = triton_heuristics.benchmarker
    triton_heuristics.benchmarker = TritonBenchmarker()
    try:
        yield
    finally:
        triton_heuristics.benchmarker = saved


@contextlib.contextmanager
def recompile_budget() -> Iterator[None]:
    """While inside, Dynamo may compile up to `RECOMPILE_LIMIT` graphs of one function (when the
    default is lower); restored on the way out. Dynamo's config is process-wide: two threads
    compiling at once would see each other's."""
    config = torch._dynamo.config
    saved = config.recompile_limit
    config.recompile_limit = max(saved, RECOMPILE_LIMIT)
    try:
        yield
    finally:
        config.recompile_limit = saved


class DecodeForward:
    """The decode step compiled by inductor: inductor fuses the norms and residual adds and the
    activations between the projections into a few kernels a layer, and the rotation with the
    K/V write (`kernels.elementwise.rope_write_op`) and the streamed read (`paged_attention_op`)
    stay one opaque op each. Two compiled graphs of one model: every batch but 1 goes through
    `batched`, whose batch is symbolic, so the capture buckets share it; batch 1 goes through
    `single`, compiled with inductor's `batch_1_options` when given (the engine's are
    `BATCH_1_OPTIONS`), else batch 1 shares `batched`. With `opaque_head`, the LM head stays
    cuBLAS's in both graphs (`layers.Linear.opaque`): set on the model, so it holds for every
    compile of it after. With `pdl`, both graphs' Triton kernels are launched as programmatic
    dependents (`PDL_OPTIONS`), and so are the engine's own ops inside every call
    (`kernels.pdl.launching_dependents`). With `steady`, batch 1's kernels are tuned inside
    `steady_tuning`. `options`: inductor's, for both graphs. Compiling happens on the first call
    of each."""

    def __init__(self, model: LlamaModel, batch_1_options: dict | None = None, pdl: bool = False,
                 opaque_head: bool = False, options: dict | None = None, steady: bool = False) -> None:
        model.lm_head.opaque = opaque_head
        extra = {**(options or {}), **(PDL_OPTIONS if pdl else {})}
        self.options = extra  # inductor's options for both graphs, besides `batch_1_options`
        self.batched = torch.compile(model, dynamic=True, fullgraph=True, options=extra or None)
        self.single = (self.batched if batch_1_options is None else
                       torch.compile(model, dynamic=True, fullgraph=True, options={**batch_1_options, **extra}))
        self.batch_1_options = batch_1_options
        self.pdl, self.steady = pdl, steady

    def varlen(self, ids: torch.Tensor, positions: torch.Tensor, cache=None,
               logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """A varlen step (ids [1, num_tokens]) through `batched`, whose token count is symbolic
        for it as the batch is for decode: the norms, residual adds and activations fused, the
        varlen read one opaque op (`varlen_attention_op`). What a varlen graph captures."""
        # The token count as a symbol of its own: left to duck sizing, a count equal to another of
        # the step's sizes (the cache's rows, the block table's width) would share its symbol, and
        # the graph traced at that count would guard on the tie and compile again for the others.
        for tensor, dim in ((ids, 1), (positions, 1), (cache.plan.write_slots, 0)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        with pdl_module.launching_dependents(self.pdl), recompile_budget():
            return self.batched(ids, positions, cache=cache, logits_index=logits_index)

    @property
    def tune_batch_1(self) -> bool:
        return self.batch_1_options == BATCH_1_OPTIONS

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        # ids [batch, tokens]: the batch is a Python int here, so a graph captures one branch.
        single = ids.shape[0] == 1
        with (steady_tuning() if self.steady and single else contextlib.nullcontext()), \
                pdl_module.launching_dependents(self.pdl), recompile_budget():
            return (self.single if single else self.batched)(ids, positions, cache=cache)


def mark_step_kernels(model: LlamaModel, on: bool) -> None:
    """Mark every layer's projections (not the LM head) to run through `kernels.gemv.step_linear` in a
    compiled step of 2 rows or more (`layers.Linear.step_kernel`), or not. Set on the model, so it
    holds for every compile of it after. Batch 1's graph keeps inductor's tuned reductions."""
    for layer in model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            linear.step_kernel = on


def compile_decode(model: LlamaModel, tune_batch_1: bool | None = None, pdl: bool | None = None,
                   steady: bool | None = None) -> DecodeForward:
    """`model` compiled for decode steps (`DecodeForward`), batch 1 with `BATCH_1_OPTIONS` when
    `tune_batch_1`: by default for a model on CUDA, since inductor lowers a one-row matmul that way
    on accelerators only. With tuning, the LM head stays cuBLAS's (`opaque_head`: a tuned reduction
    over the head read it slower than cuBLAS in most compiles), and the tuning is `steady` unless
    told. `pdl` as `DecodeForward`'s, by default wherever the GPU has it, except for a
    tensor-parallel shard. With PDL, the layers' projections of a few rows run through the Triton
    GEMV (`mark_step_kernels`). A model on the CPU compiles with `CPU_OPTIONS`, unless it is a
    tensor-parallel shard."""
    param = next(model.parameters())
    device = param.device.type
    if tune_batch_1 is None:
        tune_batch_1 = device == "cuda"
    if pdl is None:  # not for a tensor-parallel shard, whose graphs hold NCCL's kernels: unmeasured
        pdl = supports_pdl(param.device) and model.tp is None
    if steady is None:
        steady = tune_batch_1
    # The GEMV pays only through PDL (launch by launch it ties cuBLAS): only where the step has it.
    mark_step_kernels(model, pdl and supports_pdl(param.device))
    return DecodeForward(model, BATCH_1_OPTIONS if tune_batch_1 else None, pdl=pdl, opaque_head=tune_batch_1,
                         options=CPU_OPTIONS if device == "cpu" and model.tp is None else None, steady=steady)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, *, forward: Callable | None = None,
                 buckets: DecodeBuckets | None = None, cuda_graphs: bool = False,
                 varlen_capture_size: int | None = None, progress: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.forward = model if forward is None else forward  # what a decode step calls
        if cuda_graphs and buckets is None:
            # Up to 64 rows and 8,192 tokens; the streamed read has no width, so its list is the
            # batch axis alone.
            buckets = DecodeBuckets.default(min(kv_cache.max_rows, 64), min(kv_cache.max_width, 8192), min_width=128)
            if kv_cache.read == "streamed":
                buckets = buckets.without_width()
        self.buckets = buckets
        self.graphs: DecodeGraphs | None = None
        # The last decode or verify step's shape as it ran: (rows, or a varlen verify step's tokens,
        # the forward ran at, whether a graph replayed).
        self.last_decode: tuple[int, bool] = (0, False)
        # Varlen steps (prompt chunks beside decode rows) of up to varlen_capture_size tokens replay
        # a graph of the smallest capture size holding them (`capture_sizes`); larger ones run eagerly.
        self.varlen_graphs: VarlenGraphs | None = None
        self.last_varlen: tuple[int, bool] = (0, False)  # (tokens the forward ran, whether a graph replayed)
        self.last_fed: torch.Tensor | None = None  # [tokens] int64 on the device: the last verify step's fed tokens
        self.last_loc: torch.Tensor | None = None  # [rows + 1] int64 on the device: where its row r's tokens start
        if cuda_graphs:
            self.graphs = DecodeGraphs(self.forward, kv_cache, buckets)
            self.graphs.capture(progress=progress)
            if varlen_capture_size is not None:
                # With a compiled decode step, the varlen graphs capture its compiled model too: a
                # step of few tokens (a verify step, a short prompt after a cached prefix) is as
                # many small launches as the eager model has kernels.
                varlen_forward = self.forward.varlen if isinstance(self.forward, DecodeForward) else model
                self.varlen_graphs = VarlenGraphs(varlen_forward, kv_cache, capture_sizes(varlen_capture_size),
                                                  model.config.vocab_size)
                self.varlen_graphs.capture(self.graphs.pool, progress=progress)

    def close(self) -> None:
        """Release what the runner started besides this process's memory: nothing here; a
        tensor-parallel leader's workers (`engine.parallel.LeaderRunner`)."""

    def planned(self, kind: str, seqs: list[Sequence], ids, counts: list[int] | None, sampled: list[bool] | None,
                all_logits: list[bool] | None = None) -> None:
        """Called between a step's plan and its forward: "varlen" with the host ids, the counts,
        which rows are sampled and which give logits at every token; "verify" with the host ids
        and the counts; or "decode" with its ids [batch, 1] (host, or still being sampled on the
        device). Nothing here; a tensor-parallel leader tells its workers (`engine.parallel`)."""

    @torch.inference_mode()
    def run_varlen(self, seqs: list[Sequence], num_scheduled_tokens: list[int], num_computed_tokens: list[int],
                   sampled: list[bool], all_logits: list[bool] | None = None) -> torch.Tensor:
        """One flattened forward of every scheduled token: sequence i feeds its tokens
        num_computed_tokens[i] .. + num_scheduled_tokens[i] - 1 (a prompt, a chunk of one, or a
        decode row's pending token) -> logits [rows of logits, vocab] fp32, in order: at the last
        token of each sampled sequence, and at every token of a sequence with `all_logits[i]` (its
        prompt's logprobs, or a verify step's drafts). With varlen graphs, a step that fits a capture
        size and gives at most `max_rows` rows of logits (a graph's head runs on that many) is padded
        to it and replays that graph; otherwise the model runs eagerly."""
        ids = list(itertools.chain.from_iterable(
            s.span(a, a + n) for s, a, n in zip(seqs, num_computed_tokens, num_scheduled_tokens, strict=True)))
        rows = [s.row for s in seqs]
        every = [False] * len(seqs) if all_logits is None else list(all_logits)
        wanted = sum(n if e else due for n, due, e in zip(num_scheduled_tokens, sampled, every, strict=True))
        size = None
        if self.varlen_graphs is not None and wanted <= self.kv_cache.max_rows:
            size = self.varlen_graphs.lookup(len(ids))
        if size is not None:
            plan = self.kv_cache.plan_varlen(rows, num_scheduled_tokens, sampled, input_ids=ids, num_tokens=size,
                                             all_logits=every)
            self.planned("varlen", seqs, ids, num_scheduled_tokens, sampled, all_logits)
            self.last_varlen = (size, True)
            return self.varlen_graphs.replay(plan, wanted)
        plan = self.kv_cache.plan_varlen(rows, num_scheduled_tokens, sampled, all_logits=all_logits)
        self.planned("varlen", seqs, ids, num_scheduled_tokens, sampled, all_logits)
        self.last_varlen = (len(ids), False)
        ids = host_int64(ids).to(self.device)[None]  # [1, num_tokens]
        return self.model(ids, plan.positions, cache=self.kv_cache.view(plan), logits_index=plan.logits_index)

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
        return self._run_decode(plan, ids, len(seqs))

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], query_lens: list[int], fed: list[int] | None = None,
               after: tuple[list[int], torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """A verify step: sequence i feeds query_lens[i] tokens (its pending token and the drafts
        after it, none in the cache yet) -> logits at every one, in order, [sum(query_lens), vocab]
        fp32. The tokens are each sequence's last query_lens[i] unless `fed` (host ints, one a fed
        token) names them. It runs as a decode step of a batch row a fed token (`plan_decode`'s
        `query_lens`), through a decode graph when a bucket holds that many rows: each token reads its
        row's keys through the decode read, which walks a short context once a token faster than the
        varlen read splits it. More tokens than the cache's rows run as a varlen step. The fed
        tokens on the device stay in `last_fed`, and where each row's begin in `last_loc`
        ([rows + 1] int64), until the next verify step.

        Planned ahead of the step before it (chained speculation), `after` is (rows, last, shift):
        sequence i continues row rows[i] of that step, whose last tokens and shifts (kept drafts
        minus fed, [its rows] int64) are still on the device. Each sequence's first fed token
        becomes its row's last token there, and its tokens move back by its row's shift
        (`KVCache.shift_decode_plan`). It needs the decode path."""
        if sum(query_lens) > self.kv_cache.max_rows:
            if after is not None or fed is not None:
                raise ValueError(f"a verify step of {sum(query_lens)} tokens, more than the cache's "
                                 f"{self.kv_cache.max_rows} rows, runs as a varlen step, which takes neither "
                                 "fed tokens nor a step before it")
            return self._verify_varlen(seqs, query_lens)
        return self._verify_decode(seqs, query_lens, fed, after)

    def _verify_decode(self, seqs: list[Sequence], query_lens: list[int], fed: list[int] | None = None,
                       after: tuple[list[int], torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`verify` as a decode step of a batch row a fed token."""
        tokens = sum(query_lens)
        tables = [self.kv_cache.blocks.table(s.row) for s in seqs]
        longest = max(t.num_tokens + n for t, n in zip(tables, query_lens, strict=True))
        shape = None if self.buckets is None else self.buckets.lookup(tokens, longest)
        plan = self.kv_cache.plan_decode([s.row for s in seqs], batch_size=shape and shape[0],
                                         width=shape and shape[1], query_lens=query_lens)
        if fed is None:
            fed = [t for s, n in zip(seqs, query_lens, strict=True) for t in s.span(s.num_tokens - n, s.num_tokens)]
        elif len(fed) != tokens:
            raise ValueError(f"fed holds {len(fed)} tokens for a step of {tokens}")
        self.planned("verify", seqs, fed, query_lens, None)
        # One upload: the fed ids padded to the batch, each row's first fed token's index
        # (`last_loc`), and with `after` each token's row of the step before and whether it heads
        # its row.
        batch = plan.batch_size
        host = fed + [0] * (batch - tokens) + list(itertools.accumulate(query_lens, initial=0))
        if after is not None:
            rows, last, shift = after
            host += [rows[i] for i, n in enumerate(query_lens) for _ in range(n)]  # src
            host += [int(j == 0) for n in query_lens for j in range(n)]  # head
        inputs = stage(host_int64(host), self.device).to(self.device, non_blocking=True)
        ids, self.last_loc, index = inputs.split([batch, len(seqs) + 1, len(host) - batch - len(seqs) - 1])
        ids = ids.view(-1, 1)
        if after is not None:
            src, head = index.view(2, tokens)
            self.kv_cache.shift_decode_plan(plan, src, head, shift, last, ids.view(-1))
        self.last_fed = ids[:tokens, 0]
        return self._run_decode(plan, ids, tokens)

    def _verify_varlen(self, seqs: list[Sequence], query_lens: list[int]) -> torch.Tensor:
        """`verify` as a varlen step with logits at every token."""
        held = [s.num_tokens - n for s, n in zip(seqs, query_lens, strict=True)]
        logits = self.run_varlen(seqs, query_lens, held, [True] * len(seqs), all_logits=[True] * len(seqs))
        self.last_decode = self.last_varlen
        return logits

    def _run_decode(self, plan: DecodePlan, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """The planned decode step's logits for its first `rows` batch rows: its bucket's graph
        replayed, else the forward eagerly. ids [rows or batch, 1]."""
        if self.graphs is not None:
            shape = (plan.batch_size, plan.width if self.buckets.widths is not None else None)
            if shape in self.graphs:
                self.last_decode = (plan.batch_size, True)
                return self.graphs.replay(shape, ids[:rows], plan)
        self.last_decode = (plan.batch_size, False)
        if ids.shape[0] < plan.batch_size:  # device ids cover the live rows only: pad with token 0
            ids = torch.cat([ids, ids.new_zeros((plan.batch_size - ids.shape[0], 1))])
        return planned_step(self.forward, self.kv_cache, ids.to(self.device, non_blocking=True), plan)[:rows]
