"""`Engine`: schedule, run, sample, retire.

`Engine.step` runs one forward over the batch the scheduler chose: one decode token for every
running request (a planned, possibly graphed, decode), or a flattened varlen forward of prompt
chunks and decode rows under the token budget (chunked prefill), or of whole prompts without it.
Only a request whose last token was fed is sampled. Requests join (`add_requests`, all or
nothing) and leave (`abort_request`, finishing, or failing) between steps; every way a request
ends returns its row and blocks. A failure is contained to the requests it touches: a row whose
sampling raises ends alone with an error, a forward that raises ends the requests of that step,
and the engine goes on with the rest. With asynchronous scheduling consecutive decode
steps overlap: step t + 1 is planned and launched, fed by step t's tokens on the device, before
step t's tokens are read back, by a copy on a stream of its own that step t + 1 does not queue behind.
With speculative decoding over greedy rows, verify steps overlap the same way (chained
speculation): step t + 1's drafts and tables assume step t kept every draft, and the device moves
its positions back by what step t did not keep.
"""

from __future__ import annotations

import array
import itertools
import operator
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from nanolab.config import EngineConfig, check_current_cuda, resolve_device
from nanolab.engine.block_manager import BlockManager, cdiv
from nanolab.engine.buckets import DecodeBuckets
from nanolab.engine.detokenizer import TextDeltas
from nanolab.engine.graphs import CaptureReport
from nanolab.engine.kv_cache import KVCache, host_int64, kv_bytes_per_block, stage
from nanolab.engine.runner import ModelRunner, compile_decode
from nanolab.engine.scheduler import Scheduler, SchedulerOutput
from nanolab.engine.sequence import Sequence
from nanolab.kernels.argmax import argmax
from nanolab.kernels.chain import accept_drafts
from nanolab.model.llama import LlamaModel
from nanolab.sampling import PositionLogprobs, SamplingParams, compute_logprobs, sample_tokens, sampling_probs
from nanolab.spec_decode import TokenIndex, greedy_accept, propose_ngram, rejection_sample


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's progress in one step: the token it gained, the logits it was sampled from,
    the token's log-probabilities when the request asked for them (`SamplingParams.logprobs`),
    and whether it is done. A request that failed this step has no token (`error` says why).
    `finished` and `error` are the request's state when this output was made: one `step()` can
    return two outputs of one request (an overlapped step's token, then the next step's failure),
    and only the last says the request ended."""

    seq: Sequence
    token_id: int | None
    logits: torch.Tensor | None  # [vocab] fp32; a view the next step may overwrite (a graph's output)
    finished: bool = False
    error: str | None = None
    logprobs: PositionLogprobs | None = None


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

    def check(self, prompt: list[int], params: SamplingParams) -> array.array:
        """Raise ValueError (TypeError for a wrong type) naming what is wrong with a request; return
        the prompt's ids packed as int64 (`array.array("q")`, a copy), which pickle to another
        process as one run of bytes."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, (list, tuple, array.array)):
            raise TypeError(f"the prompt must be a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty: there is nothing to continue")
        vocab = self.vocab_size
        bad = f"prompt token ids must be ints in [0, {vocab})"
        # By exact type, so a bool (an int subclass) is not a token id; at C speed, since a prompt
        # is thousands of ids and every request is checked on the server's event loop.
        if operator.countOf(map(type, prompt), int) != len(prompt):
            raise ValueError(bad)
        try:
            packed = array.array("q", prompt)
        except OverflowError:
            raise ValueError(bad) from None
        low, high = torch.frombuffer(packed, dtype=torch.int64).aminmax()
        if low < 0 or high >= vocab:
            raise ValueError(bad)
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
        return packed

    def check_all(self, prompts: Seq[list[int]], params: Seq[SamplingParams], name: str = "request"
                  ) -> list[array.array]:
        """`check` every request, returning each one's packed ids; an error names the one at fault
        ("request 2: ...")."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        packed = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                packed.append(self.check(prompt, p))
            except (ValueError, TypeError) as e:
                raise type(e)(f"{name} {i}: {e}") from None
        return packed


def _failed(what: str, e: Exception) -> str:
    """A request's error: what failed, and the exception it raised."""
    return f"{what} failed: {type(e).__name__}: {e}"


@dataclass(slots=True)
class _InFlight:
    """A decode step launched under asynchronous scheduling whose tokens are still on their way:
    a plain one, or a step of chained speculation (`chained`), which may feed drafts."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [rows] int64 on the device: each row's last new token, what the next step feeds
    # [rows] int64, pinned on CUDA, filled by a copy on the read-back stream; a chained step's is
    # [2, rows]: the drafts each row kept, then its last new token.
    host: torch.Tensor
    done: torch.cuda.Event | None  # recorded after that copy; None on the CPU, where it is synchronous
    batch: int  # rows the forward ran at
    graph: bool
    start: float  # perf_counter at launch
    chained: bool = False
    index: int = 0  # the engine's step number at launch
    # A chained step's rows: the drafts each fed after its first token, and on the device how far
    # each row's next tokens move back once this step is read back (kept drafts minus fed, <= 0).
    drafts: list[list[int]] | None = None
    shift: torch.Tensor | None = None
    # What each row's drafts were proposed on: how many of the step before's drafts they took as
    # kept, and the token they took that step to add after them (None: no drafts). Set when that
    # step is read back: `stale`, either failed, and the next proposal starts from the tokens the
    # host has rather than from these drafts; `excused`, the count failed, and drafts lost on it
    # do not pause the request (`Engine._drafted`): they were not the proposer's to keep.
    assumed: list[int] | None = None
    guesses: list[int | None] | None = None
    stale: list[bool] | None = None
    excused: list[bool] | None = None


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def _host_list(tokens) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)


def accept_on_device(logits: torch.Tensor, drafts: list[list[int]], counts: list[int],
                     fed: torch.Tensor | None = None, max_fed: int | None = None,
                     loc: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance without reading back: logits [sum(counts), vocab] of a verify step whose
    row r fed counts[r] tokens, its first and then drafts[r] -> (result [2, rows] int64: the
    drafts each row kept, then the token it adds after them, as `greedy_accept`; shift [rows]
    int64: kept minus fed drafts), both on the logits' device. Given `fed` (the step's fed tokens
    [sum(counts)] int64 on the device), in one Triton kernel (`kernels.chain.accept_drafts`, built
    for rows of up to `max_fed` tokens, default the longest here: an engine passes its most, so
    that Triton builds it once, at warm-up, and `loc`, where each row's tokens begin [rows + 1]
    int64 on the device, when it is there already); otherwise in torch ops over `drafts`."""
    best = argmax(logits) if logits.is_cuda else logits.argmax(-1)  # [sum(counts)]
    device = logits.device
    if fed is not None:
        if loc is None:
            loc = stage(host_int64(list(itertools.accumulate(counts, initial=0))), device).to(device, non_blocking=True)
        return accept_drafts(best, fed, loc, max(counts) if max_fed is None else max_fed)
    rows, width = len(drafts), max(len(d) for d in drafts)
    starts = itertools.accumulate(counts, initial=0)
    # Each row's choices, padded with its last one, then its drafts, padded with -1 (never a token).
    index = [s + min(j, n - 1) for s, n in zip(starts, counts) for j in range(width + 1)]
    pads = [t for d in drafts for t in (*d, *[-1] * (width - len(d)))]
    host = host_int64(index + pads + [len(d) for d in drafts])
    index, pads, fed_counts = stage(host, device).to(device, non_blocking=True).split([len(index), len(pads), rows])
    choice = best[index].view(rows, width + 1)  # [rows, width + 1]
    kept = (choice[:, :width] == pads.view(rows, width)).long().cumprod(1).sum(1)  # [rows]
    last = choice.gather(1, kept[:, None])[:, 0]
    return torch.stack([kept, last]), kept - fed_counts


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV pool's budget when the config names none: 1 GiB on the CPU; on CUDA, 40% of what is
    free once the weights are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.4 * free)
    return 1 << 30


def pool_size(config: EngineConfig, model_config, device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(num_blocks, max_model_len) for `config` over the model `model_config` describes: `num_blocks`,
    else what `kv_cache_bytes` (else `default_kv_cache_bytes`) holds of the whole model's K/V (a
    tensor-parallel rank holds its share of each block); `max_model_len`,
    else the model's context or what the pool holds if less, as vLLM does: a request that could
    grow past the pool is refused, so a longer context would refuse every request without max_tokens.
    A `max_model_len` past the model's context, a pool larger than the device's memory, or more rows
    (`max_num_seqs`) than it holds the per-row state of, is refused here, naming the field."""
    per_block = kv_bytes_per_block(model_config.num_hidden_layers, model_config.num_key_value_heads,
                                   model_config.head_dim,
                                   config.block_size, dtype)
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = config.kv_cache_bytes
        if budget is not None and budget < per_block:
            raise ValueError(f"kv_cache_bytes={budget}: holds no block; one block of {config.block_size} tokens "
                             f"is {per_block} bytes for this model")
        if budget is None:
            budget = default_kv_cache_bytes(device)
            if budget < per_block:
                raise ValueError(f"block_size={config.block_size}: one block is {per_block} bytes for this model, "
                                 f"more than the default KV budget of {budget} bytes; lower block_size or set "
                                 "kv_cache_bytes")
        num_blocks = max(1, budget // per_block)
    memory, held = device_memory_bytes(device), num_blocks * per_block // config.tensor_parallel_size  # a rank's share
    if memory is not None and held > memory:
        field = "num_blocks" if config.num_blocks is not None else "kv_cache_bytes"
        raise ValueError(f"{field}={getattr(config, field)}: a pool of {num_blocks} blocks is {held / 2**30:.1f} GiB "
                         f"a device, more than the device's {memory / 2**30:.1f} GiB")
    context = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        raise ValueError(f"max_model_len={config.max_model_len}: the model's context is {context} tokens "
                         "(max_position_embeddings)")
    max_model_len = config.max_model_len or min(context, num_blocks * config.block_size)
    # Each row of the batch keeps a block-table row and, for a step's logits, a row of fp32 over
    # the vocabulary: a row count the device cannot hold is refused before any of it is allocated.
    per_row = 4 * (model_config.vocab_size + cdiv(max_model_len, config.block_size))
    if memory is not None and config.max_num_seqs * per_row > memory:
        raise ValueError(f"max_num_seqs={config.max_num_seqs}: that many rows need "
                         f"{config.max_num_seqs * per_row / 2**30:.1f} GiB for their logits and block tables, "
                         f"more than the device's {memory / 2**30:.1f} GiB")
    return num_blocks, max_model_len


def device_memory_bytes(device: torch.device) -> int | None:
    """All the memory of `device`: the GPU's, or the host's physical memory for the CPU; None where
    it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class WarmUp:
    """What `Engine.warm_up` ran: requests, steps, and its wall time."""

    requests: int
    steps: int
    seconds: float

    def __str__(self) -> str:
        return f"warmed up on {self.requests} requests in {self.steps} steps, {self.seconds:.2f} s"


class Engine:
    """The engine over `model`, as `config` chose it (`EngineConfig`). It runs where `model` lives:
    CUDA graphs over the decode buckets when that is CUDA and not `enforce_eager` (and over varlen
    steps' token counts with `cudagraph_mode="full"`), the decode step
    compiled by inductor (`runner.compile_decode`) and asynchronous scheduling when `compile` and
    `async_scheduling` say so (by default, with graphs). `enable_chunked_prefill` (vLLM's name)
    makes `max_num_batched_tokens` each step's token budget, decode rows first and prompts in
    chunks; off, a step prefills whole prompts or decodes, and the budget is raised to the context
    so any prompt fits. The pool and the context are `pool_size`'s.

    What is handed in, rather than chosen: `forward` replaces the decode step's forward (a compiled
    model of the caller's; the lab's designs), `runner` builds the `ModelRunner`, `sampler` turns a
    step's logits into tokens (`nanolab.sampling.sample_tokens`: a device tensor, or a list),
    `buckets` the capture list, `detokenize` the text stop strings are matched in."""

    def __init__(self, model: LlamaModel, config: EngineConfig | None = None, *, forward: Callable | None = None,
                 runner: Callable[..., ModelRunner] = ModelRunner, sampler: Callable = sample_tokens,
                 buckets: DecodeBuckets | None = None, detokenize: Callable[[list[int]], str] | None = None,
                 progress: bool = True) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model = model
        self.config = config
        self.model_config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if config.device is not None and not _same_device(resolve_device(config.device), self.device):
            raise ValueError(f"device={config.device!r}: the model is on {self.device}")
        check_current_cuda(self.device, config.device)
        self.num_blocks, self.max_model_len = pool_size(config, self.model_config, self.device, self.dtype)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.max_num_seqs,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, self.num_blocks,
                                    config.block_size)
        self.kv_cache = KVCache(self.block_manager, num_layers=self.model_config.num_hidden_layers,
                                num_kv_heads=model.num_kv_heads, head_dim=self.model_config.head_dim,
                                max_model_len=self.max_model_len, dtype=self.dtype, device=self.device,
                                read=config.read)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, budget, config.enable_chunked_prefill)
        if forward is None and config.compiled(self.device):
            forward = compile_decode(model)
        # A tensor-parallel group's workers capture no varlen graphs, so rank 0 keeps those steps eager too.
        varlen = (config.varlen_capture_size(self.device, self.kv_cache.read) if config.tensor_parallel_size == 1
                  else None)
        self.runner = runner(model, self.kv_cache, forward=forward, buckets=buckets,
                             cuda_graphs=config.cuda_graphs(self.device), varlen_capture_size=varlen,
                             progress=progress)
        self.detokenize = detokenize
        self.sampler = sampler
        self.async_scheduling = config.overlapped(self.device)
        self._inflight: _InFlight | None = None  # the decode step launched and not yet read back
        # Requests whose host work for this step failed where they could not be ended at once (their
        # drafts, their prompt's logprobs), with why: each ends when the step does (`step`).
        self._doomed: dict[Sequence, str] = {}
        self._readback: torch.cuda.Stream | None = None  # where an in-flight step's tokens are read back
        self._zero_shift: torch.Tensor | None = None  # a plain link's shift, sliced (`_no_shift`)
        self.eos_token_ids = frozenset(self.model_config.eos_token_id)
        self._ids = itertools.count()
        self.requests: dict[int, Sequence] = {}
        self.last_step: StepRecord | None = None
        # Speculative decoding's counts (vLLM's): verify steps, drafts proposed, and drafts kept.
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.num_steps = 0  # steps run: the clock a request's paused drafts wait on, and the next step's index

    @property
    def capture_report(self) -> CaptureReport | None:
        """What warming the capture list at start cost, or None without graphs."""
        graphs = self.runner.graphs
        return None if graphs is None else graphs.report

    def warm_up(self) -> WarmUp:
        """Run requests that reach every path a request can, before any request comes: on CUDA a
        prompt of two budgets and a few tokens (eager chunks, alone and beside another prompt) and
        one longer than the largest varlen graph; everywhere, one short prompt per sampling path
        (greedy, temperature, top-k, top-p, seeded), 17 and then 16 at once for the read's
        many-segment kernels. Triton builds its kernels and every first CUDA call happens here
        instead of in a request's time to first token. Leaves no request behind and every block
        free; returns what it ran."""
        start = time.perf_counter()
        # Without chunked prefill the budget is the context: any prompt past the graphs builds the same kernels.
        vocab, budget = self.model_config.vocab_size, min(self.scheduler.max_num_batched_tokens, 4096)
        longest = self.max_model_len - 4  # room for the tokens each request generates
        varlen = self.runner.varlen_graphs
        # Two chunks and a tail: a whole first chunk (torch's fused attention), a later chunk alone
        # (the Triton read over one segment), its tail beside the second prompt (over two).
        lengths = {min(longest, 2 * budget + 5), min(longest, (varlen.sizes[-1] if varlen else 0) + 9)}
        pool_tokens = self.num_blocks * self.block_manager.block_size
        # On the CPU nothing is built lazily but the first call of each op: the long prompts only cost time.
        lengths = sorted(n for n in lengths if 0 < n and 2 * (n + 4) <= pool_tokens and self.device.type == "cuda")
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
        greedy = SamplingParams(temperature=0, max_tokens=3)
        samplings = [greedy, SamplingParams(temperature=0.8, max_tokens=3),
                     SamplingParams(temperature=0.8, top_k=5, max_tokens=3),
                     SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3),
                     SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=1, max_tokens=3)]
        # The long prompts alone, then waves of short prompts at once: 16 segments and 17, since Triton
        # builds a kernel apart for an int argument that is a multiple of 16 (and one that is 1).
        waves = [(prompts, [greedy] * len(prompts))]
        short = []
        for rows in sorted({min(self.config.max_num_seqs, 16), min(self.config.max_num_seqs, 17)}, reverse=True):
            wave = [torch.randint(0, vocab, (3,), generator=g).tolist() for _ in range(rows)]
            waves.append((wave, [samplings[i % len(samplings)] for i in range(rows)]))
            short += wave
        steps = 0
        for batch, params in waves:
            self.add_requests(batch, params, name="warm-up request")
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.error is not None:
                        raise RuntimeError(f"warming up failed: {out.error}")
                steps += 1
        if self.block_manager.allocator.num_free != self.num_blocks:
            raise RuntimeError("warming up left KV blocks allocated")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return WarmUp(len(prompts) + len(short), steps, time.perf_counter() - start)

    # Requests in and out.

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue a request of one sample (`params.n` 1; `add_requests` takes more). Bad input raises
        ValueError (TypeError for a wrong type) and changes nothing."""
        packed = self.limits.check(prompt_token_ids, params)
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: add_request queues one sample; add_requests "
                             "queues a request's n samples")
        return self.add_checked_requests([packed], [params])[0]

    def add_requests(self, prompts: Seq[list[int]], params: Seq[SamplingParams],
                     name: str = "request") -> list[Sequence]:
        """Queue several requests, all or nothing: each is validated before any is queued, and an
        error names the request ("request 2: ...", or `name` in its place). A request of `n`
        samples is n sequences, in order (`SamplingParams.samples`). Sequences of one call with the
        same prompt compute it once: with prefix caching, each after the first waits until the
        first has run its prompt, then shares its cached blocks."""
        if not isinstance(prompts, (list, tuple)) or not isinstance(params, (list, tuple)):
            raise TypeError(f"add_requests takes a list of prompts and a list of SamplingParams, got "
                            f"{type(prompts).__name__} and {type(params).__name__}")
        packed = self.limits.check_all(prompts, params, name)
        samples = [(prompt, s) for prompt, p in zip(packed, params) for s in p.samples()]
        return self.add_checked_requests([prompt for prompt, _ in samples], [s for _, s in samples])

    def add_checked_requests(self, prompts: list[array.array], params: list[SamplingParams]) -> list[Sequence]:
        """Queue requests that `RequestLimits.check` has passed (one sample each: `n` already
        spread by `SamplingParams.samples`), each prompt's ids as the check packed them (int64
        `array.array`s: `add_requests`', or the engine core's, checked by `AsyncLLM` in the server's
        process). Nothing is checked again here: a request that did not pass may break the step."""
        # Validated input: nothing here raises (SamplingParams checked the seed's range), so a batch
        # is queued whole.
        seqs = []
        first: dict[bytes, Sequence] = {}  # prompt -> the first request of this call with it
        for packed, p in zip(prompts, params):
            generator = None if p.seed is None else torch.Generator(device=self.device).manual_seed(p.seed)
            prompt_bytes = packed.tobytes()
            key = prompt_bytes if len(prompts) > 1 else b""  # a prompt alone has no other sample to wait for
            seq = Sequence(next(self._ids), packed.tolist(), p, generator, parent=first.get(key),
                           prompt_bytes=prompt_bytes)
            first.setdefault(key, seq)
            if p.logprobs is not None:
                seq.output_logprobs = []
            if p.prompt_logprobs is not None:
                seq.prompt_logprobs = []
            seqs.append(seq)
        for seq in seqs:
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return seqs

    def validate_request(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError (TypeError for a wrong type) naming what is wrong with a request."""
        self.limits.check(prompt, params)

    def close(self) -> None:
        """Release what the engine started outside this process (a tensor-parallel group's
        workers, `ModelRunner.close`). The engine cannot step after it."""
        self.runner.close()

    def abort_request(self, request_id: int) -> None:
        """End a request wherever it is, its blocks back to the pool; an id no live request has
        (finished, or never added) changes nothing."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"request_id={request_id!r}: must be an int, a request's id")
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def in_flight(self) -> bool:
        """Whether a decode step launched by asynchronous scheduling awaits its read-back."""
        return self._inflight is not None

    def stalled(self, outputs: list[StepOutput]) -> bool:
        """Whether the step that returned `outputs` did nothing while requests remain: it ran no
        forward, read nothing back and left nothing in flight. Every queued request was checked to
        fit the pool alone, so a stall is a scheduler fault, never a request's."""
        return not outputs and self.last_step is None and not self.in_flight and self.has_unfinished_requests()

    # One step.

    def step(self) -> list[StepOutput]:
        """Run one step and return what it produced: outputs only for the requests sampled, so a
        request whose prompt is partly in the cache gains nothing. With asynchronous scheduling a
        decode step is launched before the one in flight is read back, so what a call returns is
        the previous decode step's tokens (`_step_async`), verify steps over greedy rows included
        (`_step_chained`). A step with a sampled row that may carry drafts runs synchronously: the
        in-flight step is read back first, in a call of its own.

        A request whose own host work fails (keying its blocks, its logprobs, its stop strings, its
        drafts) ends with that error in this step's outputs; the others go on."""
        try:
            outputs = self._step()
            for seq, message in self._doomed.items():
                if not seq.finished:  # running, or preempted back into the queue by this step
                    outputs.append(self._fail(seq, message))
        finally:
            self._doomed.clear()
        return outputs

    def _doom(self, seq: Sequence, what: str, e: Exception) -> None:
        """End `seq` when this step ends: its `what` raised `e` where the step still holds its row."""
        self._doomed.setdefault(seq, _failed(what, e))

    def _step(self) -> list[StepOutput]:
        self.last_step = None
        chained = self._chains()
        if self._inflight is not None and self._inflight.chained != chained:
            # The step in flight was launched under the other rule: read back, nothing launched, the clock waits.
            prev, self._inflight = self._inflight, None
            return self._retire(prev)
        if chained:
            outputs = self._step_chained()
        elif self.async_scheduling and not self._may_speculate():
            outputs = self._step_async()
        elif self._inflight is not None:  # the in-flight step read back, nothing launched: the clock waits
            prev, self._inflight = self._inflight, None
            return self._retire(prev)
        else:
            out = self.scheduler.schedule()
            if not out.seqs:
                return []
            drafts = self._drafts(out)
            outputs = self._run_speculative(out, drafts) if drafts else self._run(out)
        self.num_steps += 1
        return outputs

    def _run(self, out: SchedulerOutput) -> list[StepOutput]:
        """One forward over the scheduled step (a planned decode, or a varlen step of prompts,
        chunks and decode rows), sampled and read back before returning."""
        start = time.perf_counter()
        seqs = out.seqs
        # Rows whose prompt's logprobs are wanted and whose segment is (partly) prompt: every token's logits.
        every = [s.prompt_logprobs is not None and a < len(s.prompt_token_ids)
                 for s, a in zip(seqs, out.num_computed_tokens, strict=True)]
        try:
            if out.decode_only:
                logits = self.runner.decode(seqs)
            else:
                extra = {"all_logits": every} if any(every) else {}
                logits = self.runner.run_varlen(seqs, out.num_scheduled_tokens, out.num_computed_tokens, out.sampled,
                                                **extra)
        except Exception as e:  # contained: the step's requests end, the engine goes on
            return self._fail_forward(seqs, e)
        if any(every):
            try:  # a row's own failure dooms that row alone (`_record_prompt_logprobs`)
                logits = self._record_prompt_logprobs(out, every, logits)
            except Exception as e:  # the step's logits cannot be told apart: as a failed forward
                return self._fail_forward(seqs, e)
        self._commit(seqs)
        sampled = [seq for seq, due in zip(seqs, out.sampled, strict=True) if due]
        tokens = self._sample(logits, sampled) if sampled else []
        batch, graph = self.runner.last_decode if out.decode_only else (len(seqs), self.runner.last_varlen[1])
        self.last_step = StepRecord(out.phase, len(seqs), batch, graph, out.num_tokens, time.perf_counter() - start)
        return self._emit(sampled, tokens, logits)

    # Speculative decoding (`EngineConfig.speculative_config`): a decode step of few rows feeds each
    # row its pending token and the drafts prompt lookup proposes, verifies them in one forward
    # with logits at every fed token (`ModelRunner.verify`: a decode step of a batch row a token),
    # keeps what `greedy_accept` / `rejection_sample` keep and one token more, and shortens each
    # row's table past the tokens it rejected.

    def _speculating(self, seq: Sequence) -> bool:
        """Whether `seq` gets drafts at the next step: not while paused after steps that gave it
        no draft to keep (`SpeculativeConfig.max_draft_backoff`)."""
        return self.num_steps >= seq.drafts_from_step

    def _drafted(self, seq: Sequence, kept: bool, step: int | None = None) -> None:
        """After a step that looked up drafts for `seq`: one kept ends its pause; none (no match, or
        a verify step that kept none) pauses its lookups for at least the next 1, 2, 4 ... steps,
        at most `max_draft_backoff`, so that the steps between overlap. A pause of b steps ends on
        a step numbered a multiple of b (so it lasts b to 2b - 1 steps): requests paused as long
        look up at the same steps, and a step runs synchronously for the shortest pause among the
        running requests, not for each of them in turn. `step`: the step that looked them up
        (default: this one), read back later under chained speculation."""
        cap = self.config.speculative_config.max_draft_backoff
        step = self.num_steps if step is None else step
        seq.draft_backoff = b = 0 if kept else min(cap, max(1, 2 * seq.draft_backoff))
        seq.drafts_from_step = step + 1 if b == 0 else -(-(step + 1 + b) // b) * b

    def _draft_room(self, seq: Sequence, ahead: int = 0) -> int:
        """The drafts `seq` may be fed at its next step: up to `num_speculative_tokens`, short of
        max_tokens and the context, with `ahead` more tokens than it has (a step still in flight
        may add them); none while paused (`_speculating`), when it wants logprobs, or when it
        samples with a seed (`SpeculativeConfig`)."""
        spec, p = self.config.speculative_config, seq.params
        if seq.output_logprobs is not None or not self._speculating(seq) or seq.generator is not None and not p.greedy:
            return 0
        return min(spec.num_speculative_tokens, self.max_model_len - seq.num_tokens - ahead - 1,
                   spec.num_speculative_tokens if p.max_tokens is None
                   else p.max_tokens - len(seq.output_token_ids) - ahead - 1)

    def _may_speculate(self) -> bool:
        """Whether the next step could carry drafts: speculation is configured, the running rows
        are at most its `max_num_seqs`, and prompt lookup over the tokens a row has finds a match
        for one of them. Such a step runs synchronously; any other overlaps with the one before
        under asynchronous scheduling. With a step in flight a row's tokens lack that step's, so
        this lookup runs a token behind: a match only makes the step synchronous, and the step
        looks up again (`_drafts`). A row whose lookup finds nothing is paused as after any miss
        (`_drafted`), so that a request whose text never repeats costs no synchronous steps."""
        spec = self.config.speculative_config
        running = self.scheduler.running
        if spec is None or not 0 < len(running) <= spec.max_num_seqs:
            return False
        due = False
        for seq in running:  # every row: each miss is recorded
            if self._draft_room(seq) >= 1:
                if self._lookup(seq, 1):
                    due = True
                else:
                    self._drafted(seq, kept=False)
        return due

    def _lookup(self, seq: Sequence, k: int, tail: list[int] | None = None) -> list[int]:
        """Prompt lookup's drafts (up to `k`) for `seq`'s tokens, then `tail` (tokens a step in
        flight is assumed to add), through its `TokenIndex`, brought up to date first; matches as
        short as `prompt_lookup_min` once one of its drafts has been kept, and as short as
        `SpeculativeConfig.min_until_kept` before."""
        spec = self.config.speculative_config
        min_n = spec.prompt_lookup_min if seq.num_accepted_tokens else spec.min_until_kept
        if seq.token_index is None:
            seq.token_index = TokenIndex()
        index = seq.token_index.update(seq.prompt_token_ids, seq.output_token_ids)
        tokens, covered = index.tokens, index.length  # the request's tokens, not a copy
        tokens.extend(tail or ())  # for this lookup only
        try:
            return propose_ngram(tokens, k, spec.prompt_lookup_max, min_n, index, covered)
        except Exception as e:  # no drafts; the request ends when the step does
            self._doom(seq, "its draft lookup", e)
            return []
        finally:
            del tokens[covered:]

    def _drafts(self, out: SchedulerOutput, pause_misses: bool = True) -> dict[int, list[int]] | None:
        """Draft tokens by row index for a decode-only step of at most the config's rows, or None:
        none proposed, or the pool lacks the blocks to feed them. A row with no room for drafts
        (`_draft_room`) gets none; a row whose lookup finds no match is paused (`_drafted`) if
        `pause_misses` (not for a chained step: see `_chained_drafts`). Drafts are cut, in row
        order, so that the step feeds at most `max_num_batched_tokens` tokens."""
        spec = self.config.speculative_config
        if spec is None or not out.decode_only or len(out.seqs) > spec.max_num_seqs:
            return None
        drafts = {}
        for i, seq in enumerate(out.seqs):
            room = self._draft_room(seq)
            if room >= 1:
                proposed = self._lookup(seq, room)
                if proposed:
                    drafts[i] = proposed
                elif pause_misses:  # no match: a miss, as a verify step that keeps nothing is
                    self._drafted(seq, kept=False)
        room = self.scheduler.max_num_batched_tokens - len(out.seqs)  # the step's budget, past each pending token
        for i in list(drafts):
            drafts[i] = drafts[i][:max(room, 0)]
            room -= len(drafts[i])
            if not drafts[i]:
                del drafts[i]
        if not drafts:
            return None
        blocks = self.block_manager
        need = sum(blocks.table(s.row).blocks_needed(1 + len(drafts.get(i, ()))) for i, s in enumerate(out.seqs))
        return drafts if need <= blocks.allocator.num_free else None

    def _run_speculative(self, out: SchedulerOutput, drafts: dict[int, list[int]]) -> list[StepOutput]:
        start = time.perf_counter()
        seqs = out.seqs
        before = [s.num_tokens for s in seqs]  # the pending token is the last of these
        counts = [1 + len(drafts.get(i, ())) for i in range(len(seqs))]
        for i, d in drafts.items():  # fed as tokens of the row for this forward, taken back after it
            seqs[i].output_token_ids.extend(d)
        try:
            logits = self.runner.verify(seqs, counts)  # [sum(counts), vocab]: every fed token's
        except Exception as e:  # contained: the step's requests end, the engine goes on
            return self._fail_forward(seqs, e)
        finally:
            for i, d in drafts.items():
                del seqs[i].output_token_ids[-len(d):]
        kept, rows, at = [], [], 0
        # Every row's argmax in one read-back: a greedy row needs nothing more of its logits.
        best = logits.argmax(-1).tolist() if any(s.params.greedy for s in seqs) else None
        for i, seq in enumerate(seqs):
            row_logits = logits[at: at + counts[i]]  # [1 + drafts, vocab]: position j scores token j
            d = drafts.get(i, [])
            try:
                if seq.params.greedy:
                    tokens = greedy_accept(best[at: at + counts[i]], d)
                else:
                    probs = torch.stack([sampling_probs(r, seq.params) for r in row_logits])
                    tokens = rejection_sample(probs, d, None, seq.generator)
            except Exception as e:  # this row alone ends with it
                tokens = e
            at += counts[i]
            if not isinstance(tokens, Exception):
                # The row holds its pending token and the drafts it kept; the rejected ones' slots go.
                self.block_manager.truncate(seq.row, before[i] + len(tokens) - 1)
                seq.num_computed_tokens = before[i] + len(tokens) - 1
                self.spec_draft_tokens += len(d)
                self.spec_accepted_tokens += len(tokens) - 1
                seq.num_draft_tokens += len(d)
                seq.num_accepted_tokens += len(tokens) - 1
                if d:
                    self._drafted(seq, kept=len(tokens) > 1)
            kept.append(tokens)
            rows.append(row_logits)
        self._commit([s for s, t in zip(seqs, kept) if not isinstance(t, Exception)])
        self.spec_steps += 1
        batch, graph = self.runner.last_decode
        self.last_step = StepRecord("decode", len(seqs), batch, graph, sum(counts), time.perf_counter() - start)
        outputs = []
        for seq, tokens, row_logits in zip(seqs, kept, rows):
            # A row's tokens in order, token j from row_logits[j]; what follows a stop is dropped.
            tokens = [tokens] if isinstance(tokens, Exception) else tokens
            outputs += self._emit([seq] * len(tokens), tokens, row_logits)
        return outputs

    def _record_prompt_logprobs(self, out: SchedulerOutput, every: list[bool], logits: torch.Tensor) -> torch.Tensor:
        """Append to each `every` row's `prompt_logprobs` what its segment's logits give (the logits
        at position p score prompt token p + 1), skipping tokens already scored (a preempted
        request's recompute); return the sampled rows' logits, one a sampled row, in order."""
        sampled_rows, at = [], 0
        for seq, a, n, due, all_ in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens, out.sampled,
                                        every, strict=True):
            if not all_:
                if due:
                    sampled_rows.append(at)
                    at += 1
                continue
            prompt = seq.prompt_token_ids
            first, last = len(seq.prompt_logprobs) + 1, min(a + n, len(prompt) - 1)  # prompt tokens to score
            if a + 1 <= first <= last and seq not in self._doomed:
                try:
                    seq.prompt_logprobs += compute_logprobs(logits[at + first - 1 - a: at + last - a],
                                                            prompt[first: last + 1], seq.params.prompt_logprobs)
                except Exception as e:  # this request alone ends with it
                    self._doom(seq, "its prompt's logprobs", e)
            if due:
                sampled_rows.append(at + n - 1)
            at += n
        return logits[sampled_rows]

    def _emit(self, seqs: list[Sequence], tokens: list, logits: torch.Tensor | None) -> list[StepOutput]:
        """Append each row's token (or end the row with its sampling error) and its logprobs when
        asked for, retire finished requests, and return the outputs. A request that ended while
        its token was in flight (aborted, or finished by the step before) has it dropped."""
        logprobs = self._logprobs(seqs, tokens, logits)
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.finished:
                continue
            if isinstance(token, Exception):
                outputs.append(self._fail(seq, _failed("sampling", token)))
                continue
            if seq in self._doomed:  # its host work failed earlier in the step: no token of it goes out
                outputs.append(self._fail(seq, self._doomed.pop(seq)))
                continue
            if isinstance(logprobs.get(i), Exception):
                outputs.append(self._fail(seq, _failed("its logprobs", logprobs[i])))
                continue
            kept = len(seq.output_token_ids)
            try:
                seq.output_token_ids.append(token)
                if seq.output_logprobs is not None:
                    seq.output_logprobs.append(logprobs[i])
                reason = self._finish_reason(seq, token)
            except Exception as e:  # this request alone ends with it (a stop string's decoding, say)
                del seq.output_token_ids[kept:]  # the token no output carried
                if seq.output_logprobs is not None:
                    del seq.output_logprobs[kept:]
                outputs.append(self._fail(seq, _failed("its output's handling", e)))
                continue
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.requests.pop(seq.request_id, None)
            outputs.append(StepOutput(seq, token, None if logits is None else logits[i], seq.finished,
                                      logprobs=logprobs.get(i)))
        return outputs

    @staticmethod
    def _logprobs(seqs: list[Sequence], tokens: list, logits: torch.Tensor | None
                  ) -> dict[int, PositionLogprobs | Exception]:
        """Row -> its token's logprobs, for the rows that ask for them, all computed at once from
        the logits the tokens were sampled from (a step with such rows is never left in flight, so
        those logits are here). Where that raises, row by row: a row that raises alone gets its
        exception."""
        rows = [i for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))
                if s.output_logprobs is not None and not s.finished and not isinstance(t, Exception)]
        if not rows:
            return {}
        try:
            top = compute_logprobs(logits[rows], [tokens[i] for i in rows], max(seqs[i].params.logprobs for i in rows))
        except Exception:  # find the culprits
            found: dict[int, PositionLogprobs | Exception] = {}
            for i in rows:
                try:
                    (lp, alts), = compute_logprobs(logits[i: i + 1], [tokens[i]], seqs[i].params.logprobs)
                    found[i] = (lp, alts)
                except Exception as e:
                    found[i] = e
            return found
        return {i: (lp, alts[: seqs[i].params.logprobs]) for i, (lp, alts) in zip(rows, top)}

    def _commit(self, seqs: list[Sequence]) -> None:
        """Key the blocks a forward just filled, for prefix caching: only after the forward was
        launched without error, so a failed step leaves no block findable whose K/V was never
        written. A row whose keying raises ends when the step does; the others are keyed."""
        try:
            self.block_manager.commit_rows(seqs)
        except Exception:
            for seq in seqs:
                try:
                    self.block_manager.commit_rows([seq])
                except Exception as e:
                    self._doom(seq, "keying its blocks", e)

    def _fail_forward(self, seqs: list[Sequence], e: Exception) -> list[StepOutput]:
        # A forward's failure cannot be pinned on one row: every request of the step ends with it.
        return [self._fail(seq, _failed("the forward", e)) for seq in seqs if not seq.finished]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        """One token per row on the host, or the exception that row's sampling raised. The whole
        batch is sampled at once; only when that raises is each row sampled alone, to find the
        culprits. A seeded row's generator is put back first, so its draw is the one it would have
        made."""
        tokens = self._sample_batch(logits, seqs)
        return _host_list(tokens) if tokens is not None else self._sample_rows(logits, seqs)

    def _sample_batch(self, logits: torch.Tensor, seqs: list[Sequence]):
        """The sampler's tokens for the whole batch (a device tensor, or a list from a host
        sampler), or None when it raised, with every seeded generator put back."""
        states = [None if s.generator is None else s.generator.get_state() for s in seqs]
        try:
            return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:  # the caller retries row by row
            for seq, state in zip(seqs, states):
                if state is not None:
                    seq.generator.set_state(state)
            return None

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
        tokens: list[int | Exception] = []
        for i, seq in enumerate(seqs):
            try:
                tokens.append(_host_list(self.sampler(logits[i: i + 1], [seq.params], [seq.generator]))[0])
            except Exception as e:  # this row alone ends with it
                tokens.append(e)
        return tokens

    # Asynchronous scheduling (vLLM's async_scheduling): the host plans and launches decode step
    # t + 1 while the GPU runs step t, whose sampled tokens feed t + 1 on the device. The tokens
    # reach the host one call later, so a request that stops on EOS or a stop string runs one step
    # past it, and that token is dropped; length limits are known ahead and never overrun.

    def _step_async(self) -> list[StepOutput]:
        prev = self._inflight
        if prev is None:
            out = self.scheduler.schedule()
            if not out.seqs:
                return []
            if not out.decode_only:  # prompts and chunks run as before: their first tokens come back now
                return self._run(out)
            return self._launch(out.seqs, None, None)
        nxt = self._continuing(prev)
        if not nxt:  # the next step needs the scheduler (admission, preemption) or nothing is left
            self._inflight = None
            return self._retire(prev)
        return self._launch(nxt, self._continued_ids(prev, nxt), prev)

    def _continued_ids(self, prev: _InFlight, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens `seqs` feed at a decode step after `prev`, still on the device: each row's last
        token of prev ([len(seqs)] int64). Counts each fed token as computed, as the scheduler does
        for a step it schedules."""
        for seq in seqs:
            seq.num_computed_tokens += 1
        index = {id(s): i for i, s in enumerate(prev.seqs)}
        rows = [index[id(s)] for s in seqs]
        if rows != list(range(len(rows))):  # the batch lost rows: gather the survivors' tokens
            return prev.tokens[stage(torch.tensor(rows), self.device).to(self.device, non_blocking=True)]
        return prev.tokens[: len(rows)]

    def _continuing(self, prev: _InFlight, check_blocks: bool = True) -> list[Sequence] | None:
        """The rows of the in-flight step that can decode again without the scheduler: every
        running request is among them, nothing waiting could be admitted (a request waits on a
        free row as long as every row is taken), the pool has a block a row (`check_blocks`), and
        a request whose in-flight token reaches its length limit is left out."""
        running = self.scheduler.running
        admissible = self.scheduler.waiting and self.block_manager.free_row_count() > 0
        if admissible or len(running) > len(prev.seqs):
            return None
        members = {id(s) for s in prev.seqs}
        if any(id(s) not in members for s in running):
            return None
        nxt = [s for s in prev.seqs if not s.finished and not self._ends_by_length(s)]
        if not check_blocks:
            return nxt
        need = sum(self.block_manager.table(s.row).blocks_needed(1) for s in nxt)
        return nxt if need <= self.block_manager.allocator.num_free else None

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether the token in flight for `seq` ends it by max_tokens or the context."""
        n = len(seq.output_token_ids) + 1
        return (seq.params.max_tokens is not None and n >= seq.params.max_tokens) or \
            seq.num_tokens + 1 >= self.max_model_len

    def _launch(self, seqs: list[Sequence], ids: torch.Tensor | None, prev: _InFlight | None,
                chained: bool = False) -> list[StepOutput]:
        """Launch a decode step over `seqs` and leave it in flight; return the outputs of `prev`,
        read back after the launch. A step that cannot stay in flight (its forward or its batch
        sampling raised, the sampler is a host one, or a row wants its logprobs) finishes here,
        after `prev`. `chained`: a link of chained speculation that carries no drafts
        (`_launch_chained`), read back as one (`_retire_chained`)."""
        start = time.perf_counter()
        try:
            logits = self.runner.decode(seqs, ids)
        except Exception as e:
            self._inflight = None
            return (self._retire(prev) if prev else []) + self._fail_forward(seqs, e)
        self._commit(seqs)
        tokens = self._sample_batch(logits, seqs)
        batch, graph = self.runner.last_decode
        # Raised (None), a host sampler's list, or logprobs wanted from logits the next replay overwrites.
        if not isinstance(tokens, torch.Tensor) or any(s.output_logprobs is not None for s in seqs):
            self._inflight = None
            outputs = self._retire(prev) if prev else []
            tokens = self._sample_rows(logits, seqs) if tokens is None else _host_list(tokens)
            self.last_step = StepRecord("decode", len(seqs), batch, graph, len(seqs), time.perf_counter() - start)
            return outputs + self._emit(seqs, tokens, logits)
        host, done = self._read_back(tokens)
        n = len(seqs)
        link = {} if not chained else dict(  # no drafts: nothing kept, nothing to move back
            chained=True, drafts=[[] for _ in seqs], shift=self._no_shift(n), assumed=[0] * n, guesses=[None] * n,
            stale=[False] * n, excused=[False] * n, index=self.num_steps)
        self._inflight = _InFlight(seqs, tokens, host, done, batch, graph, start, **link)
        return self._retire(prev) if prev else []

    def _no_shift(self, rows: int) -> torch.Tensor:
        """[rows] int64 zeros on the device: a plain link's shift (`_launch`), sliced from one buffer."""
        if self._zero_shift is None or self._zero_shift.numel() < rows:
            self._zero_shift = torch.zeros(max(rows, self.kv_cache.max_rows), dtype=torch.int64, device=self.device)
        return self._zero_shift[:rows]

    def _read_back(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying `values` (int64, on the device) to the host: (the host tensor, pinned on
        CUDA, and the event recorded after the copy, None on the CPU where the copy is done)."""
        host = stage(torch.empty(values.shape, dtype=values.dtype), self.device)
        if self.device.type != "cuda":
            host.copy_(values)
            return host, None
        if self._readback is None:  # on a stream of its own: the next step need not wait for it
            self._readback = torch.cuda.Stream(self.device)
        self._readback.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._readback):
            host.copy_(values, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        values.record_stream(self._readback)
        return host, done

    def _retire(self, step: _InFlight) -> list[StepOutput]:
        """Wait for an in-flight step's tokens and emit them (its logits are gone by now: the next
        replay overwrites a graph's output)."""
        if step.chained:
            return self._retire_chained(step)
        if step.done is not None:
            step.done.synchronize()
        tokens = step.host.tolist()
        self.last_step = StepRecord("decode", len(step.seqs), step.batch, step.graph, len(step.seqs),
                                    time.perf_counter() - step.start)
        return self._emit(step.seqs, tokens, None)

    # Chained speculation: asynchronous scheduling with speculative decoding, over greedy rows. Every
    # decode step is launched before the one in flight is read back, verify steps included. The
    # next step's drafts are proposed as if the step in flight kept all of its own, and its tables
    # grown so; its first token per row is the in-flight step's last, taken on the device, and the
    # positions it writes and reads are moved back on the device by what that step left unkept
    # (`ModelRunner.verify`'s `first_ids` and `shift`). Acceptance runs on the device too: each
    # row's kept drafts and last token are all a step reads back. Drafts proposed on a premise
    # that fails are only drafts: the verify step keeps what greedy decoding would have emitted.
    # A step with no drafts after one with none is a plain link: a plain decode step (`_launch`),
    # nothing to verify and nothing to move back, read back as a chained step that kept nothing.

    def _chains(self) -> bool:
        """Whether decode steps chain: speculation under asynchronous scheduling, one process (no
        tensor-parallel workers), and running rows that are at most the config's `max_num_seqs`,
        every one greedy and none asking for logprobs."""
        spec = self.config.speculative_config
        if spec is None or not self.async_scheduling or self.config.tensor_parallel_size != 1:
            return False
        running = self.scheduler.running
        return 0 < len(running) <= spec.max_num_seqs and all(
            s.params.greedy and s.output_logprobs is None for s in running)

    def _step_chained(self) -> list[StepOutput]:
        prev = self._inflight
        if prev is None:
            out = self.scheduler.schedule()
            if not out.seqs:
                return []
            if not out.decode_only:  # prompts and chunks run synchronously: their first tokens come back now
                return self._run(out)
            drafts = self._drafts(out, pause_misses=False) or {}
            drafts = self._fit_drafts([list(drafts.get(i, ())) for i in range(len(out.seqs))])
            return self._launch_chained(out.seqs, drafts, None, None, None)
        nxt = self._continuing(prev, check_blocks=False)
        planned = self._chained_drafts(prev, nxt) if nxt else None
        if planned is None:  # the next step needs the scheduler, or the pool lacks a block a row
            self._inflight = None
            return self._retire(prev)
        return self._launch_chained(nxt, *planned, prev)

    def _chained_drafts(self, prev: _InFlight, seqs: list[Sequence]):
        """(drafts, assumed, guesses) for the step after `prev` over `seqs`, or None when the pool
        cannot hold even one token a row. Each row's lookup runs over its tokens and what it takes
        `prev` to add: all of prev's drafts, unless prev's drafts already rest on a premise that
        failed (`stale`), then none. The lookup's first token is its guess of prev's last token and
        the rest are the drafts. A lookup that finds none does not pause the request: a chained
        step overlaps whether or not it carries drafts, so the miss costs no synchronous step, and a
        pause would forgo the matches that follow (a verify step that keeps nothing still pauses
        it, `_retire_chained`). Room is counted as if prev kept every draft. Drafts are cut to the
        step's budget and the cache's rows (a verify step that chains runs as a decode step), and
        dropped when the pool cannot grow every row by them."""
        index = {id(s): i for i, s in enumerate(prev.seqs)}
        drafts, assumed, guesses = [], [], []
        for seq in seqs:
            i = index[id(seq)]
            fed = prev.drafts[i]
            kept = 0 if prev.stale[i] else len(fed)
            room = self._draft_room(seq, ahead=len(fed) + 1)
            proposed = []
            if room >= 1:
                proposed = self._lookup(seq, room + 1, fed[:kept])
                if len(proposed) < 2:  # no draft past the guess: a plain row, and no pause (see the docstring)
                    proposed = []
            drafts.append(proposed[1:])
            assumed.append(kept)
            guesses.append(proposed[0] if proposed else None)
        drafts = self._fit_drafts(drafts)
        blocks = self.block_manager
        for attempt in (drafts, [[] for _ in seqs]):
            need = sum(blocks.table(s.row).blocks_needed(1 + len(d)) for s, d in zip(seqs, attempt))
            if need <= blocks.allocator.num_free:
                if attempt is not drafts:
                    guesses = [None] * len(seqs)
                return attempt, assumed, guesses
        return None

    def _fit_drafts(self, drafts: list[list[int]]) -> list[list[int]]:
        """`drafts` (a list a row) cut, in row order, so that the step feeds at most its token budget
        and the cache's rows (a chained verify step runs as a decode step of a batch row a token)."""
        room = min(self.scheduler.max_num_batched_tokens, self.kv_cache.max_rows) - len(drafts)
        for d in drafts:
            del d[max(room, 0):]
            room -= len(d)
        return drafts

    def _launch_chained(self, seqs: list[Sequence], drafts: list[list[int]], assumed: list[int] | None,
                        guesses: list[int | None] | None, prev: _InFlight | None) -> list[StepOutput]:
        """Launch a step of chained speculation over `seqs`, each row fed its first token and its
        drafts, with acceptance on the device, and leave it in flight; return the outputs of
        `prev`, read back after the launch. With `prev`, each row's first token is prev's last, on
        the device, and its positions move back by what prev leaves unkept. A step with no drafts
        after one with none (or after none) has nothing to verify and nothing to move back: it runs
        as a plain decode step (`_launch`), which plans in fewer host operations and runs no
        acceptance, and stays a link of the chain."""
        if not any(drafts) and (prev is None or not any(prev.drafts)):
            return self._launch(seqs, None if prev is None else self._continued_ids(prev, seqs), prev, chained=True)
        start = time.perf_counter()
        counts = [1 + len(d) for d in drafts]
        after = None
        if prev is None:
            fed = [t for s, d in zip(seqs, drafts, strict=True) for t in (s.output_token_ids[-1], *d)]
        else:
            fed = [t for d in drafts for t in (0, *d)]  # each row's 0 is replaced on the device
            index = {id(s): i for i, s in enumerate(prev.seqs)}
            after = ([index[id(s)] for s in seqs], prev.tokens, prev.shift)
        try:
            logits = self.runner.verify(seqs, counts, fed=fed, after=after)
        except Exception as e:
            self._inflight = None
            return (self._retire(prev) if prev else []) + self._fail_forward(seqs, e)
        for seq in seqs:  # the fed tokens, as if the step before kept every draft: its read-back corrects them
            seq.num_computed_tokens = self.block_manager.tables[seq.row].num_tokens
        self._commit(seqs)
        # [2, rows] and [rows]; in Triton where the step reads through Triton's kernels
        streamed = self.kv_cache.read == "streamed"
        result, shift = accept_on_device(logits, drafts, counts, self.runner.last_fed if streamed else None,
                                         self.config.speculative_config.num_speculative_tokens + 1,
                                         loc=self.runner.last_loc if streamed else None)
        host, done = self._read_back(result)
        batch, graph = self.runner.last_decode
        n = len(seqs)
        self._inflight = _InFlight(seqs, result[1], host, done, batch, graph, start, chained=True, drafts=drafts,
                                   shift=shift, assumed=assumed or [0] * n, guesses=guesses or [None] * n,
                                   stale=[False] * n, excused=[False] * n, index=self.num_steps)
        return self._retire(prev) if prev else []

    def _retire_chained(self, step: _InFlight) -> list[StepOutput]:
        """Read back a step of chained speculation and emit each row's kept drafts and last token.
        A row the step in flight after it (if any) continues keeps the blocks that step writes;
        every other row's table ends at its kept tokens, as after a synchronous verify step. The
        step after learns whether its drafts' premise held (`stale`, `excused`)."""
        if step.done is not None:
            step.done.synchronize()
        values = step.host.tolist()  # [2, rows]: kept drafts, last tokens; a plain link's [rows]: its tokens
        kept_counts, lasts = values if step.host.dim() == 2 else ([0] * len(values), values)
        after = self._inflight if self._inflight is not step else None
        following = {} if after is None else {id(s): i for i, s in enumerate(after.seqs)}
        emitted, live = [], []
        for i, seq in enumerate(step.seqs):
            if seq.finished:  # ended while this step was in flight (aborted, or finished by the step before)
                continue
            d, a = step.drafts[i], kept_counts[i]
            before = seq.num_tokens  # its pending token, the one this step fed first, is the last of these
            j = following.get(id(seq))
            fed_after = 0 if j is None else 1 + len(after.drafts[j])
            # The table keeps the kept drafts, and what the step after feeds from where they end.
            seq.num_computed_tokens = before + a + fed_after
            self.block_manager.truncate(seq.row, seq.num_computed_tokens)
            if d:
                self.spec_draft_tokens += len(d)
                self.spec_accepted_tokens += a
                seq.num_draft_tokens += len(d)
                seq.num_accepted_tokens += a
                if a or not step.excused[i]:
                    self._drafted(seq, kept=a > 0, step=step.index)
            if j is not None:
                guess = after.guesses[j]
                after.excused[j] = a != after.assumed[j]
                after.stale[j] = after.excused[j] or (guess is not None and guess != lasts[i])
            emitted.append((seq, d[:a] + [lasts[i]]))
            live.append(seq)
        self._commit(live)
        self.spec_steps += any(step.drafts)
        self.last_step = StepRecord("decode", len(step.seqs), step.batch, step.graph,
                                    sum(1 + len(d) for d in step.drafts), time.perf_counter() - step.start)
        outputs = []
        for seq, tokens in emitted:
            outputs += self._emit([seq] * len(tokens), tokens, None)
        return outputs

    def _fail(self, seq: Sequence, message: str) -> StepOutput:
        """End `seq` with an error; its row and blocks go back to the pool."""
        self.scheduler.finish(seq, "error")
        seq.error = message
        self.requests.pop(seq.request_id, None)
        return StepOutput(seq, None, None, True, message)

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
