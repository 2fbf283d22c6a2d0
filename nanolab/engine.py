"""The engine loop: schedule, build the step's inputs, run the forward, sample, retire.

Introduced with the engine core (before Day 49). `Engine.step` runs one forward over the batch
the scheduler chose. Requests join (`add_request`) and leave (`abort_request`, or finishing)
between steps. Every way a request ends returns its row and blocks to the pool.

Decode runs through a host-built `DecodePlan` (Day 50). Given `buckets` (Day 52), a decode batch
is padded up to its capture bucket; with `cuda_graphs` (Days 54 and 56) every bucket is captured
at start and a step in the list replays its graph, while a step outside the list runs eagerly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab.buckets import DecodeBuckets
from nanolab.cache import BatchedPagedKVCache, cdiv
from nanolab.graphs import CaptureReport, DecodeGraphs, planned_step
from nanolab.model import LlamaModel
from nanolab.plan import DecodePlan
from nanolab.sampling import SamplingParams, sample
from nanolab.scheduler import Scheduler, Sequence


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's progress in one step: the token it gained, the logits it was sampled from,
    and whether it is done."""

    seq: Sequence
    token_id: int
    logits: torch.Tensor  # [vocab] fp32; a view the next step may overwrite (a graph's output)

    @property
    def finished(self) -> bool:
        return self.seq.finished


class Engine:
    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                 detokenize: Callable[[list[int]], str] | None = None, planned: bool = True,
                 buckets: DecodeBuckets | None = None, cuda_graphs: bool = False, progress: bool = True,
                 streamed_read: bool | None = None) -> None:
        self.model = model
        # What a decode step calls: the model, or a compiled or captured stand-in for it (Day 49 on).
        self.decode_forward: Callable = model
        # Decode through a host-built DecodePlan (Day 50); False keeps the addressing in the forward.
        self.planned = planned
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.cache = BatchedPagedKVCache(
            num_layers=self.config.num_hidden_layers, num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim, num_blocks=num_blocks, block_size=block_size,
            max_rows=max_num_seqs, max_model_len=self.max_model_len, dtype=self.dtype, device=self.device,
            streamed_read=streamed_read,
        )
        self.scheduler = Scheduler(self.cache, max(max_num_batched_tokens, self.max_model_len))
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(self.config.eos_token_id)
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}
        if cuda_graphs and buckets is None:
            # Up to 64 rows and 8,192 tokens: the reference read's rectangle grows with both. The
            # streamed read has no width, so its list is the batch axis alone (Day 60).
            buckets = DecodeBuckets.default(min(max_num_seqs, 64), min(self.cache.max_width, 8192), min_width=128)
            if self.cache.streamed_read:
                buckets = buckets.without_width()
        if buckets is not None and not planned:
            raise ValueError("capture buckets pad a DecodePlan; they need planned=True")
        self.buckets = buckets
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs:
            self.graphs = DecodeGraphs(lambda *a, **k: self.decode_forward(*a, **k), self.cache, buckets)
            self.graphs.capture(progress=progress)

    @property
    def capture_report(self) -> CaptureReport | None:
        """Day 56: what warming the capture list at start cost, or None without graphs."""
        return None if self.graphs is None else self.graphs.report

    # Requests in and out.

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request. Bad input raises ValueError and changes nothing."""
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(next(self._ids), prompt, params, generator)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError (TypeError for a wrong type) naming what is wrong with a request."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty: there is nothing to continue")
        vocab = self.config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens but the model's context is {self.max_model_len}: "
                "it must leave room for at least one new token"
            )
        longest = min(len(prompt) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(longest, self.cache.block_size) > self.cache.num_blocks:
            raise ValueError(
                f"this request can grow to {longest} tokens, more than the whole KV pool holds "
                f"({self.cache.num_blocks} blocks of {self.cache.block_size}); lower max_tokens or enlarge the pool"
            )

    def abort_request(self, request_id: int) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # One step.

    def step(self) -> list[StepOutput]:
        seqs, prefill = self.scheduler.schedule()
        if not seqs:
            return []
        logits = self._prefill(seqs) if prefill else self._decode(seqs)
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        outputs = []
        for seq, token, row in zip(seqs, tokens, logits, strict=True):
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            outputs.append(StepOutput(seq, token, row))
        return outputs

    def build_inputs(self, seqs: list[Sequence], prefill: bool):
        """input_ids, positions [rows, T], the cache view, and the logits index [rows].

        A planned decode builds its DecodePlan here, which is where the tables grow; unplanned,
        positions are read off the tables and the forward grows them."""
        rows = [s.row for s in seqs]
        if prefill:
            lengths = [s.num_tokens for s in seqs]
            width = max(lengths)
            ids = torch.zeros((len(seqs), width), dtype=torch.int64)
            for i, s in enumerate(seqs):
                ids[i, : lengths[i]] = torch.tensor(s.token_ids)
            # Padding positions are 0: a padded query attends to key 0 only and is never read.
            steps = torch.arange(width)
            positions = torch.where(steps < torch.tensor(lengths)[:, None], steps, 0)
            index = torch.tensor(lengths) - 1
            view = self.cache.view(rows, lengths)
        elif self.planned:
            plan, ids = self.plan_step(seqs)
            return ids.to(self.device), plan.positions, self.cache.view(rows, plan=plan), None
        else:
            ids = torch.tensor([[s.output_token_ids[-1]] for s in seqs])
            positions = torch.tensor([[self.cache.tables[row].num_tokens] for row in rows])
            index = None
            view = self.cache.view(rows)
        dev = self.device
        return ids.to(dev), positions.to(dev), view, None if index is None else index.to(dev)

    @torch.inference_mode()
    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        ids, positions, view, index = self.build_inputs(seqs, prefill=True)
        return self.model(ids, positions, cache=view, logits_index=index)

    def plan_step(self, seqs: list[Sequence]) -> tuple[DecodePlan, torch.Tensor]:
        """Plan a decode step, padded to its bucket when it has one, and its input ids [batch, 1]
        on the host (padded rows decode token 0)."""
        shape = None if self.buckets is None else self.buckets.lookup(len(seqs), max(s.num_tokens for s in seqs))
        plan = self.cache.plan_decode([s.row for s in seqs], batch_size=shape and shape[0], width=shape and shape[1])
        ids = torch.zeros((plan.batch_size, 1), dtype=torch.int64)
        ids[: len(seqs), 0] = torch.tensor([s.output_token_ids[-1] for s in seqs])
        return plan, ids

    @torch.inference_mode()
    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        if self.graphs is not None:
            plan, ids = self.plan_step(seqs)
            shape = (plan.batch_size, plan.width if self.buckets.widths is not None else None)
            if shape in self.graphs:
                return self.graphs.replay(shape, ids[: len(seqs)], plan)
            # outside the capture list: the same step, eagerly
            return planned_step(self.decode_forward, self.cache, ids.to(self.device), plan)[: len(seqs)]
        ids, positions, view, _ = self.build_inputs(seqs, prefill=False)
        return self.decode_forward(ids, positions, cache=view)[: len(seqs), -1]

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_strings and self.detokenize is not None:
            text = self.detokenize(seq.output_token_ids)
            hits = [i for i in (text.find(s) for s in p.stop_strings) if i >= 0]
            if hits:
                seq.stop_text_index = min(hits)
                return "stop"
        if p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None
