"""`Engine`: schedule, run, sample, retire. Engine core (before Day 49).

`Engine.step` runs one forward over the batch the scheduler chose: one decode token for every
running request (a planned, possibly graphed, decode), or a flattened varlen forward of prompt
chunks and decode rows under the token budget (chunked prefill), or of whole prompts without it.
Only a request whose last token was fed is sampled. Requests join (`add_requests`, all or
nothing) and leave (`abort_request`, finishing, or failing) between steps; every way a request
ends returns its row and blocks. A failure is contained to the requests it touches: a row whose
sampling raises ends alone with an error, a forward that raises ends the requests of that step,
and the engine goes on with the rest.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.detokenizer import TextDeltas
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
    and whether it is done. A request that failed this step has no token (`error` says why)."""

    seq: Sequence
    token_id: int | None
    logits: torch.Tensor | None  # [vocab] fp32; a view the next step may overwrite (a graph's output)

    @property
    def finished(self) -> bool:
        return self.seq.finished

    @property
    def error(self) -> str | None:
        return self.seq.error


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step ran: its phase, the live rows, the rows the forward ran at (a decode bucket
    pads up to its batch size; a varlen step's segments), whether a CUDA graph replayed, the tokens
    it fed, and its wall time from scheduling to sampled tokens on the host."""

    phase: str  # "decode" (every row a decode row), "prefill" (none) or "mixed" (chunks beside decode rows)
    rows: int
    batch: int
    graph: bool
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request must fit: the vocabulary, the context, and the KV pool. Plain numbers, so a
    server can check requests in another thread or process than the engine's."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError (TypeError for a wrong type) naming what is wrong with a request."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty: there is nothing to continue")
        vocab = self.vocab_size
        # bool is an int subclass; True is not a token id.
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens but the model's context is {self.max_model_len}: "
                "it must leave room for at least one new token"
            )
        longest = min(len(prompt) + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(longest, self.block_size) > self.num_blocks:
            raise ValueError(
                f"this request can grow to {longest} tokens, more than the whole KV pool holds "
                f"({self.num_blocks} blocks of {self.block_size}); lower max_tokens or enlarge the pool"
            )

    def check_all(self, prompts: Seq[list[int]], params: Seq[SamplingParams], name: str = "request") -> None:
        """`check` every request; an error names the one at fault ("request 2: ...")."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                self.check(prompt, p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{name} {i}: {e}") from None


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    """Raise ValueError naming `name` unless `value` is an int >= `minimum` (or None, if `optional`).
    bool is an int subclass; True is not a size."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}{' or None' if optional else ''}")


class Engine:
    """The engine over `model`: a KV pool of `num_blocks` blocks, at most `max_num_seqs` running
    requests. `enable_chunked_prefill` (vLLM's name; on, as in vLLM v1) makes `max_num_batched_tokens`
    each step's token budget, decode rows first and prompts in chunks; off, a step prefills whole
    prompts or decodes, and the budget is raised to `max_model_len` so any prompt fits. The default
    budget, 2,048, is vLLM v1's for serving on a smaller GPU: every step stays a short one, which is
    what bounds inter-token latency, and a forward of 2,048 tokens is already compute-bound. `read`
    picks the reads ("auto": streamed on CUDA); `forward` replaces the model in decode steps (a
    compiled model); `cuda_graphs` captures the decode buckets at start; `runner` builds the
    `ModelRunner` (the lab passes the designs the engine replaced); `sampler` turns a
    step's logits into tokens (`nanolab.sampling.sample`'s signature; tests inject failures here)."""

    def __init__(self, model: LlamaModel, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True,
                 detokenize: Callable[[list[int]], str] | None = None, read: str = "auto",
                 forward: Callable | None = None, buckets: DecodeBuckets | None = None, cuda_graphs: bool = False,
                 progress: bool = True, runner: Callable[..., ModelRunner] = ModelRunner,
                 sampler: Callable = sample) -> None:
        check_int("num_blocks", num_blocks)
        check_int("block_size", block_size)
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        check_int("max_model_len", max_model_len, minimum=2, optional=True)  # a prompt token and a new one
        if not isinstance(enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={enable_chunked_prefill!r}: must be a bool")
        self.model = model
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.block_manager = BlockManager(num_blocks, block_size, max_num_seqs)
        self.limits = RequestLimits(self.config.vocab_size, self.max_model_len, num_blocks, block_size)
        self.kv_cache = KVCache(self.block_manager, num_layers=self.config.num_hidden_layers,
                                num_kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim,
                                max_model_len=self.max_model_len, dtype=self.dtype, device=self.device, read=read)
        budget = max_num_batched_tokens if enable_chunked_prefill else max(max_num_batched_tokens, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, budget, enable_chunked_prefill)
        self.runner = runner(model, self.kv_cache, forward=forward, buckets=buckets, cuda_graphs=cuda_graphs,
                             progress=progress)
        self.detokenize = detokenize
        self.sampler = sampler
        self.eos_token_ids = frozenset(self.config.eos_token_id)
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}
        self.last_step: StepRecord | None = None

    @property
    def capture_report(self) -> CaptureReport | None:
        """What warming the capture list at start cost (Day 56), or None without graphs."""
        graphs = self.runner.graphs
        return None if graphs is None else graphs.report

    # Requests in and out.

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request. Bad input raises ValueError (TypeError for a wrong type) and changes nothing."""
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params)
        return self._queue([prompt], [params])[0]

    def add_requests(self, prompts: Seq[list[int]], params: Seq[SamplingParams],
                     name: str = "request") -> list[Sequence]:
        """Queue several requests, all or nothing: each is validated before any is queued, and an
        error names the request ("request 2: ...", or `name` in its place)."""
        prompts = [list(p) for p in prompts]
        self.limits.check_all(prompts, params, name)
        return self._queue(prompts, list(params))

    def _queue(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Sequence]:
        # Validated input: nothing here raises (SamplingParams checked the seed's range), so a batch
        # is queued whole.
        seqs = []
        for prompt, p in zip(prompts, params):
            generator = None if p.seed is None else torch.Generator(device=self.device).manual_seed(p.seed)
            seqs.append(Sequence(next(self._ids), prompt, p, generator))
        for seq in seqs:
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return seqs

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError (TypeError for a wrong type) naming what is wrong with a request."""
        self.limits.check(prompt, params)

    def abort_request(self, request_id: int) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # One step.

    def step(self) -> list[StepOutput]:
        """One forward and its sampling. Outputs only for the requests sampled: a request whose
        prompt is partly in the cache gains nothing this step."""
        start = time.perf_counter()
        self.last_step = None
        out = self.scheduler.schedule()
        seqs = out.seqs
        if not seqs:
            return []
        try:
            if out.decode_only:
                logits = self.runner.decode(seqs)
            else:
                logits = self.runner.run_varlen(seqs, out.num_scheduled_tokens, out.num_computed_tokens, out.sampled)
        except Exception as e:  # contained: the step's requests end, the engine goes on
            # A forward's failure cannot be pinned on one row: every request of the step ends with it.
            return [self._fail(seq, f"the forward failed: {type(e).__name__}: {e}") for seq in seqs]
        sampled = [seq for seq, due in zip(seqs, out.sampled, strict=True) if due]
        tokens = self._sample(logits, sampled) if sampled else []
        batch, graph = self.runner.last_decode if out.decode_only else (len(seqs), False)
        self.last_step = StepRecord(out.phase, len(seqs), batch, graph, out.num_tokens, time.perf_counter() - start)
        outputs = []
        for seq, token, row in zip(sampled, tokens, logits, strict=True):
            if isinstance(token, Exception):
                outputs.append(self._fail(seq, f"sampling failed: {type(token).__name__}: {token}"))
                continue
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            outputs.append(StepOutput(seq, token, row))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """One token per row, or the exception that row's sampling raised. The whole batch is
        sampled at once; only when that raises is each row sampled alone, to find the culprits. A
        seeded row's generator is put back first, so its draw is the one it would have made."""
        states = [None if s.generator is None else s.generator.get_state() for s in seqs]
        try:
            return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:  # retried row by row below
            for seq, state in zip(seqs, states):
                if state is not None:
                    seq.generator.set_state(state)
        tokens: list[int | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                tokens.append(self.sampler(logits[i: i + 1], [seq.params], [seq.generator])[0])
            except Exception as e:  # this row alone ends with it
                tokens.append(e)
        return tokens

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        """End `seq` with an error; its row and blocks go back to the pool."""
        self.scheduler.finish(seq, "error")
        seq.error = message
        self.requests.pop(seq.request_id, None)
        return StepOutput(seq, None, None)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop_strings and self.detokenize is not None:
            # The text grows by a window decode (a few tokens) a step, and only the part a new match
            # could touch is searched: the new characters and the longest stop string's reach before them.
            if seq.text is None:
                seq.text = TextDeltas(self.detokenize)
            seq.text.push(token)
            text = seq.text.text
            start = max(0, seq.stop_scanned - max(len(s) for s in p.stop_strings) + 1)
            seq.stop_scanned = len(text)
            hits = [i for i in (text.find(s, start) for s in p.stop_strings) if i >= 0]
            if hits:
                seq.stop_text_index = min(hits)
                return "stop"
        if p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None
