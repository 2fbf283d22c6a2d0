"""`LLM`: the user-facing engine, shaped like vLLM's offline API.

    from nanolab import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from nanolab.config import DEFAULT_MODEL, EngineConfig, check_current_cuda, resolve_device, resolve_dtype
from nanolab.engine.detokenizer import TextDeltas
from nanolab.engine.llm_engine import Engine, pool_size
from nanolab.engine.parallel import LeaderRunner, Workers, WorkerSpec
from nanolab.engine.runner import ModelRunner
from nanolab.engine.sequence import Sequence
from nanolab.model.config import ModelConfig
from nanolab.model.llama import load_model
from nanolab.model.parallel import check_shardable
from nanolab.model.tokenizer import Tokenizer
from nanolab.model.weights import resolve_weights, weights_kind
from nanolab.progress import progress_bar
from nanolab.sampling import PositionLogprobs, SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"
    error: str | None = None  # why the request failed, when finish_reason is "error"
    logprobs: list[PositionLogprobs] | None = None  # one per token, with SamplingParams.logprobs


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. `.outputs` holds its `n` completions (vLLM users index `out.outputs[0]`);
    `.text` and `.token_ids` are the first's. `prompt_logprobs`, with SamplingParams.prompt_logprobs:
    one per prompt token after the first."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        return self.outputs[0].error


class LLM:
    """The engine behind vLLM's offline API. `LLM(model, **fields)` takes `EngineConfig`'s fields
    as keywords (`LLM.from_config` takes a config), checks them all before any weights are read (a
    bad one raises ValueError naming it), loads the weights where the config says, and builds the
    `Engine`. On CUDA the decode buckets' graphs, and with `cudagraph_mode` "full" the varlen steps'
    are captured here, with a progress bar.
    `tensor_parallel_size` > 1 shards the model over that many processes on this host
    (`engine.parallel`): this process is rank 0 and runs the engine, the others follow its steps.
    `close()`, or `with LLM(...) as llm:`, ends them."""

    def __init__(self, model: str = DEFAULT_MODEL, **fields) -> None:
        self._build(EngineConfig(model=model, **fields))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        llm = cls.__new__(cls)
        llm._build(config)
        return llm

    def _build(self, config: EngineConfig) -> None:
        self.engine_config = config
        self.device = device = resolve_device(config.device)
        check_current_cuda(device, config.device)
        self.dtype = resolve_dtype(config.dtype, device)
        self.model_name = config.model
        self.path = resolve_weights(config.model)
        c = ModelConfig.from_dir(self.path)
        tp = config.tensor_parallel_size
        check_shardable(c, tp)
        self.tokenizer = Tokenizer.from_dir(self.path)
        self.tensor_parallel_size = tp
        self.compiled = config.compiled(device)
        self.workers, runner = None, ModelRunner
        if tp > 1:  # the workers load their shards while this process loads its own
            self.workers = Workers(tp, WorkerSpec(str(self.path), self.dtype, device.type, config.block_size,
                                                  config.max_num_seqs, config.read, None, config.cuda_graphs(device),
                                                  self.compiled, config.distributed_timeout_s, config.quantization))
            runner = functools.partial(LeaderRunner, workers=self.workers)
        try:
            self.model = load_model(self.path, dtype=self.dtype, device=device,
                                    tp=self.workers.tp if self.workers else None, quantization=config.quantization)
            if self.workers:
                # The pool is sized from what this rank's shard left free, and every rank takes it.
                num_blocks, max_model_len = pool_size(config, c, device, self.dtype)
                config = config.replace(num_blocks=num_blocks, max_model_len=max_model_len)
                self.workers.size_caches(num_blocks, max_model_len)
            self.engine = Engine(self.model, config, runner=runner, detokenize=self.tokenizer.decode)
        except BaseException:
            if self.workers is not None:  # they wait on this process: send them home before raising
                self.workers.close()
            raise

    @property
    def config(self):
        return self.model.config

    def close(self) -> None:
        """End a tensor-parallel group's worker processes (nothing to do at tensor_parallel_size 1).
        The LLM cannot generate after it. Safe to call twice; `with LLM(...) as llm:` calls it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def weights_kind(self) -> str:
        """"real", or "synthesized random" for a preset whose weights were made up at its shapes."""
        return weights_kind(self.path)

    def _encode(self, prompt) -> list[int]:
        """A prompt's token ids: a str is tokenized, `{"prompt_token_ids": [...]}` is taken as it is
        (ints, not bools; the engine checks their range)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, dict):
            raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        for key in prompt:
            if key != "prompt_token_ids":
                raise ValueError(f"{key!r}: not supported (a dict prompt has only 'prompt_token_ids')")
        ids = prompt.get("prompt_token_ids")
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise TypeError(f"prompt_token_ids[{j}]={t!r}: a token id is an int")
        return list(ids)

    def _add_all(self, prompts: list, params) -> list[list[Sequence]]:
        """Queue every prompt, or none: each is encoded and validated first, and an error names the
        prompt ("prompt 2: ..."). Returns each prompt's requests: its n samples, in order."""
        if params is not None and not isinstance(params, (SamplingParams, list, tuple)):
            raise TypeError(f"sampling_params must be SamplingParams, a list of them, or None; got "
                            f"{type(params).__name__}")
        params = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        encoded = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self._encode(prompt))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        seqs = iter(self.engine.add_requests(encoded, params, name="prompt"))  # each prompt's n samples
        return [[next(seqs) for _ in range(p.n)] for p in params]

    def _abort_unfinished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if not seq.finished:
                self.engine.abort_request(seq.request_id)

    def _step(self):
        """One engine step; a step that schedules nothing while requests wait can never finish them."""
        outputs = self.engine.step()
        if self.engine.stalled(outputs):
            raise RuntimeError("the engine scheduled nothing while requests were waiting: none of them can be "
                               "admitted (no free row, or not enough free blocks)")
        return outputs

    def _result(self, prompt, seqs: list[Sequence]) -> RequestOutput:
        completions = []
        for seq in seqs:
            text = self.tokenizer.decode(seq.output_token_ids)
            if seq.stop_text_index is not None:
                text = text[: seq.stop_text_index]
            completions.append(CompletionOutput(text, list(seq.output_token_ids), seq.finish_reason, seq.error,
                                                seq.output_logprobs))
        first = seqs[0]
        return RequestOutput(prompt if isinstance(prompt, str) else None, list(first.prompt_token_ids), completions,
                             first.prompt_logprobs)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion in one continuously batched loop; results in prompt order.

        `prompts` is a str, a `{"prompt_token_ids": [...]}` dict, or a list of them. A bad prompt
        raises before any is queued. A request that fails while running comes back with
        finish_reason "error" and its `error`. If the loop itself is interrupted (KeyboardInterrupt
        or any exception), every request this call added is aborted, returning its blocks, and the
        exception propagates."""
        if not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm={use_tqdm!r}: must be a bool")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)):
            prompts = list(prompts)
        else:
            raise TypeError(f"prompts must be a str, a {{'prompt_token_ids': [...]}} dict, or a list of them, "
                            f"got {type(prompts).__name__}")
        groups = self._add_all(prompts, sampling_params)
        seqs = [seq for group in groups for seq in group]
        try:
            with progress_bar(total=len(seqs), desc="generate", unit="req", enabled=use_tqdm) as bar:
                while any(not s.finished for s in seqs):
                    bar.update(sum(out.finished for out in self._step()))
        finally:
            self._abort_unfinished(seqs)
        return [self._result(p, g) for p, g in zip(prompts, groups, strict=True)]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them.
        Every conversation is validated (`validate_messages`) before any is queued; with a list of
        them, an error names the conversation ("conversation 1: messages[0].role: ...")."""
        several = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], list)
        conversations = list(messages) if several else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            try:  # encode_chat validates the messages first
                prompts.append({"prompt_token_ids": self.tokenizer.encode_chat(conversation)})
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if several else str(e)) from None
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield one prompt's completion as text deltas, as each token is produced. A list of
        messages is rendered with the chat template (and validated). Closing the iterator, or an
        exception in the loop, aborts the request; a request that fails while running raises
        RuntimeError with its error."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": self.tokenizer.encode_chat(prompt)}
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError(f"SamplingParams.n={sampling_params.n}: stream() yields one completion's text")
        ((seq,),) = self._add_all([prompt], sampling_params)
        text = TextDeltas(self.tokenizer.decode, seq.params.stop_strings)
        seen = 0
        try:
            while True:
                self._step()
                new, seen = seq.output_token_ids[seen:], len(seq.output_token_ids)
                if seq.finish_reason == "error":
                    raise RuntimeError(seq.error)
                for i, token in enumerate(new):
                    last = seq.finished and i == len(new) - 1
                    delta = text.push(token, last, seq.stop_text_index)
                    if delta:
                        yield delta
                if seq.finished:
                    return
        finally:
            if not seq.finished:
                self.engine.abort_request(seq.request_id)
