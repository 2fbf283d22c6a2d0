"""`LLM`: the user-facing engine, shaped like vLLM's offline API. Engine core (before Day 49).

    from nanolab import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from nanolab.engine.detokenizer import TextDeltas
from nanolab.engine.kv_cache import READS, kv_bytes_per_block
from nanolab.engine.llm_engine import Engine, check_int
from nanolab.engine.parallel import NCCL_OPT_IN, LeaderRunner, Workers, WorkerSpec, nccl_opted_in
from nanolab.engine.runner import ModelRunner, compile_decode
from nanolab.engine.sequence import Sequence
from nanolab.model.config import ModelConfig
from nanolab.model.llama import load_model
from nanolab.model.parallel import check_shardable
from nanolab.model.tokenizer import Tokenizer
from nanolab.model.weights import resolve_weights, weights_kind
from nanolab.progress import progress_bar
from nanolab.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"
    error: str | None = None  # why the request failed, when finish_reason is "error"


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. `.text` and `.token_ids` are its one completion's; `.outputs` is the
    list vLLM users index as `out.outputs[0]`."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

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


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """A torch dtype, its name ("bfloat16", "bf16", "float32", ...) or "auto" (bf16 on CUDA,
    fp32 on the CPU)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if not isinstance(dtype, str) or dtype not in names:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(names)} or a torch.dtype")
    return names[dtype]


def resolve_device(device) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:1", a torch.device, or None for CUDA when available) as a
    torch.device nanolab can run on. Raises ValueError naming `device` for anything else, and for
    a CUDA device this machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device={device!r}: must be a str such as 'cpu' or 'cuda', or a torch.device")
    shown = str(device)
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={shown!r}: torch does not accept it ({e})") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={shown!r}: nanolab runs on 'cpu' or 'cuda'")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={shown!r}: CUDA is not available on this machine (torch "
                             f"{torch.__version__} sees no CUDA device); use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={shown!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def default_kv_cache_bytes(device: torch.device) -> int:
    """The KV pool's budget: 1 GiB on the CPU; on CUDA, 40% of what is free once the weights
    are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.4 * free)
    return 1 << 30


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype = "auto", block_size: int = 16, max_num_seqs: int = 64,
                 max_model_len: int | None = None, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, enforce_eager: bool = False, read: str = "auto",
                 compile: bool | None = None, async_scheduling: bool | None = None,
                 enable_chunked_prefill: bool = True, max_num_batched_tokens: int = 2048,
                 tensor_parallel_size: int = 1, compile_varlen: bool = False) -> None:
        """`enforce_eager` (vLLM's name) turns CUDA graphs off; on a CUDA device they are on, and the
        capture list is warmed here, with a progress bar. `compile` captures the decode step compiled
        by inductor (`runner.compile_decode`; about a minute at start for Llama-3.2-1B on the H200)
        and `async_scheduling` launches each decode step before reading back the last one
        (`Engine`); both default to on with CUDA graphs and off without. `read` picks the reads:
        "streamed", "reference", or "auto" (streamed on CUDA). `enable_chunked_prefill` and
        `max_num_batched_tokens` are the engine's step budget (`Engine`). The pool is `num_blocks`
        blocks, else as many as `kv_cache_bytes` holds, else `default_kv_cache_bytes`.
        `tensor_parallel_size` > 1 shards the model over that many processes on this host
        (`engine.parallel`): this process is rank 0 and runs the engine, the others follow its
        steps, every rank compiled when `compile` is on, and with asynchronous scheduling as one
        process has it. For now only on the CPU (gloo): on CUDA it is refused until its NCCL path
        has run on two GPUs. `close()` ends the workers. `compile_varlen`, with `compile` and the
        streamed read, runs the steps that mix decode rows with prompt chunks through a compiled
        graph of their own too (`runner.DecodeForward.run_varlen`); off until it is measured, and
        one process only.

        Every argument is checked before any weights are read: a bad one raises ValueError naming it
        (a device this machine lacks is one)."""
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model={model!r}: must be a preset name or a model folder's path")
        check_int("block_size", block_size)
        check_int("max_num_seqs", max_num_seqs)
        check_int("max_model_len", max_model_len, minimum=2, optional=True)  # a prompt token and a new one
        check_int("num_blocks", num_blocks, optional=True)
        check_int("kv_cache_bytes", kv_cache_bytes, optional=True)
        check_int("max_num_batched_tokens", max_num_batched_tokens)
        check_int("tensor_parallel_size", tensor_parallel_size)
        if not isinstance(enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill={enable_chunked_prefill!r}: must be a bool")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager={enforce_eager!r}: must be a bool")
        if not isinstance(compile_varlen, bool):
            raise ValueError(f"compile_varlen={compile_varlen!r}: must be a bool")
        if compile_varlen and tensor_parallel_size > 1:
            raise ValueError(f"compile_varlen=True: one process only, not tensor_parallel_size={tensor_parallel_size}")
        for name, value in (("compile", compile), ("async_scheduling", async_scheduling)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: must be a bool or None (on with CUDA graphs)")
        if not isinstance(read, str) or read not in ("auto", *READS):
            raise ValueError(f"read={read!r}: must be 'auto' or one of {', '.join(map(repr, READS))}")
        device = resolve_device(device)
        if compile_varlen and not (compile or (compile is None and device.type == "cuda" and not enforce_eager)):
            raise ValueError("compile_varlen=True: needs the compiled decode step (compile, on by default with graphs)")
        self.device = device
        self.dtype = resolve_dtype(dtype, device)
        self.model_name = model
        self.path = resolve_weights(model)
        c = ModelConfig.from_dir(self.path)
        check_shardable(c, tensor_parallel_size)
        if device.type == "cuda" and tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s), one per rank")
        if tensor_parallel_size > 1 and device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"device={device}: a tensor-parallel group puts rank r on cuda:r, rank 0 on cuda:0")
        if tensor_parallel_size > 1 and device.type == "cuda" and not nccl_opted_in():
            # The NCCL path (graphs captured on every rank) hung in its first test on two H200s and
            # is not yet found; a group of gloo ranks on the CPU is what is tested and served.
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} on {device}: tensor parallelism runs on "
                             f"the CPU (gloo) for now; its NCCL path is not yet working (set {NCCL_OPT_IN}=1 "
                             "to run it anyway)")
        per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size, self.dtype)
        if num_blocks is None and kv_cache_bytes is not None:
            if kv_cache_bytes < per_block:
                raise ValueError(f"kv_cache_bytes={kv_cache_bytes}: holds no block; one block of {block_size} tokens "
                                 f"is {per_block} bytes for this model")
            num_blocks = kv_cache_bytes // per_block
        self.tokenizer = Tokenizer.from_dir(self.path)
        self.tensor_parallel_size = tensor_parallel_size
        graphs = device.type == "cuda" and not enforce_eager
        self.compiled = graphs if compile is None else compile
        prepack = None  # oneDNN's prepacked matmuls: the default for fp32 on the CPU, compiled or not
        self.workers, runner = None, ModelRunner
        if tensor_parallel_size > 1:  # the workers load their shards while this process loads its own
            self.workers = Workers(tensor_parallel_size, WorkerSpec(str(self.path), self.dtype, device.type,
                                                                    block_size, max_num_seqs, read, prepack, graphs,
                                                                    self.compiled))
            runner = functools.partial(LeaderRunner, workers=self.workers)
        try:
            self.model = load_model(self.path, dtype=self.dtype, device=device, prepack=prepack,
                                    tp=self.workers.tp if self.workers else None)
            if num_blocks is None:
                # On CUDA the default budget is a share of what the weights left free.
                num_blocks = max(1, default_kv_cache_bytes(device) // per_block)
            if max_model_len is None:
                # As vLLM does, the context is what the pool can hold: a request that could grow past
                # the pool is refused, so a larger context would refuse every request without max_tokens.
                max_model_len = min(self.model.config.max_position_embeddings, num_blocks * block_size)
            if self.workers:
                self.workers.size_caches(num_blocks, max_model_len)
            forward = compile_decode(self.model, varlen=compile_varlen) if self.compiled else None
            self.engine = Engine(self.model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len, detokenize=self.tokenizer.decode, cuda_graphs=graphs,
                                 read=read, forward=forward,
                                 async_scheduling=graphs if async_scheduling is None else async_scheduling,
                                 enable_chunked_prefill=enable_chunked_prefill,
                                 max_num_batched_tokens=max_num_batched_tokens, runner=runner)
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

    def _add_all(self, prompts: list, params) -> list[Sequence]:
        """Queue every prompt, or none: each is encoded and validated first, and an error names the
        prompt ("prompt 2: ...")."""
        params = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        encoded = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self._encode(prompt))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        return self.engine.add_requests(encoded, params, name="prompt")

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

    def _result(self, prompt, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids)
        if seq.stop_text_index is not None:
            text = text[: seq.stop_text_index]
        completion = CompletionOutput(text, list(seq.output_token_ids), seq.finish_reason, seq.error)
        return RequestOutput(prompt if isinstance(prompt, str) else None, list(seq.prompt_token_ids), [completion])

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion in one continuously batched loop; results in prompt order.

        `prompts` is a str, a `{"prompt_token_ids": [...]}` dict, or a list of them. A bad prompt
        raises before any is queued. A request that fails while running comes back with
        finish_reason "error" and its `error`. If the loop itself is interrupted (KeyboardInterrupt
        or any exception), every request this call added is aborted, returning its blocks, and the
        exception propagates."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)):
            prompts = list(prompts)
        else:
            raise TypeError(f"prompts must be a str, a {{'prompt_token_ids': [...]}} dict, or a list of them, "
                            f"got {type(prompts).__name__}")
        seqs = self._add_all(prompts, sampling_params)
        try:
            with progress_bar(total=len(seqs), desc="generate", unit="req", enabled=use_tqdm) as bar:
                while any(not s.finished for s in seqs):
                    bar.update(sum(out.finished for out in self._step()))
        finally:
            self._abort_unfinished(seqs)
        return [self._result(p, s) for p, s in zip(prompts, seqs, strict=True)]

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
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": self.tokenizer.encode_chat(prompt)}
        (seq,) = self._add_all([prompt], sampling_params)
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
