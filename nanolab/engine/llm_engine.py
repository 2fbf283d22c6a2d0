"""`Engine`: schedule, run, sample, retire. Engine core (before Day 49).

`Engine.step` runs one forward over the batch the scheduler chose: a prefill of newly admitted
requests or one decode token for every running one. Requests join (`add_request`) and leave
(`abort_request`, or finishing) between steps; every way a request ends returns its row and blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.graphs import CaptureReport
from nanolab.engine.kv_cache import KVCache
from nanolab.engine.runner import ModelRunner
from nanolab.engine.scheduler import Scheduler
from nanolab.engine.sequence import Sequence
from nanolab.model.llama import LlamaModel
from nanolab.sampling import SamplingParams, sample


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
    """The engine over `model`: a KV pool of `num_blocks` blocks, at most `max_num_seqs` running
    requests. `read` picks the decode read ("auto": streamed on CUDA); `forward` replaces the model
    in decode steps (a compiled model); `cuda_graphs` captures the decode buckets at start; `runner`
    builds the `ModelRunner` (the lab passes the designs the engine replaced)."""

    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 8192,
                 detokenize: Callable[[list[int]], str] | None = None, read: str = "auto",
                 forward: Callable | None = None, buckets: DecodeBuckets | None = None, cuda_graphs: bool = False,
                 progress: bool = True, runner: Callable[..., ModelRunner] = ModelRunner) -> None:
        self.model = model
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.block_manager = BlockManager(num_blocks, block_size, max_num_seqs)
        self.kv_cache = KVCache(self.block_manager, num_layers=self.config.num_hidden_layers,
                                num_kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim,
                                max_model_len=self.max_model_len, dtype=self.dtype, device=self.device, read=read)
        self.scheduler = Scheduler(self.block_manager, max(max_num_batched_tokens, self.max_model_len))
        self.runner = runner(model, self.kv_cache, forward=forward, buckets=buckets, cuda_graphs=cuda_graphs,
                             progress=progress)
        self.detokenize = detokenize
        self.eos_token_ids = frozenset(self.config.eos_token_id)
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}

    @property
    def capture_report(self) -> CaptureReport | None:
        """What warming the capture list at start cost (Day 56), or None without graphs."""
        graphs = self.runner.graphs
        return None if graphs is None else graphs.report

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
        blocks = self.block_manager
        if cdiv(longest, blocks.block_size) > blocks.num_blocks:
            raise ValueError(
                f"this request can grow to {longest} tokens, more than the whole KV pool holds "
                f"({blocks.num_blocks} blocks of {blocks.block_size}); lower max_tokens or enlarge the pool"
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
        logits = self.runner.prefill(seqs) if prefill else self.runner.decode(seqs)
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
