"""`LLM`: the user-facing engine, shaped like vLLM's offline API. Engine core (before Day 49).

    from nanolab import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].text)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from nanolab.engine.kv_cache import kv_bytes_per_block
from nanolab.engine.llm_engine import Engine
from nanolab.engine.sequence import Sequence
from nanolab.model.llama import load_model
from nanolab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from nanolab.model.weights import resolve_weights, weights_kind
from nanolab.sampling import SamplingParams

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None


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


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """A torch dtype, its name ("bfloat16", "bf16", "float32", ...) or "auto" (bf16 on CUDA,
    fp32 on the CPU)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(names)} or a torch.dtype")
    return names[dtype]


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
                 kv_cache_bytes: int | None = None, enforce_eager: bool = False, read: str = "auto") -> None:
        """`enforce_eager` (vLLM's name) turns CUDA graphs off; on a CUDA device they are on, and the
        capture list is warmed here, with a progress bar. `read` picks the decode read: "streamed",
        "reference", or "auto" (streamed on CUDA)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device = device
        self.dtype = resolve_dtype(dtype, device)
        self.model_name = model
        self.path = resolve_weights(model)
        self.tokenizer = Tokenizer.from_dir(self.path)
        self.model = load_model(self.path, dtype=self.dtype, device=device)
        if num_blocks is None:
            budget = kv_cache_bytes or default_kv_cache_bytes(device)
            c = self.model.config
            per_block = kv_bytes_per_block(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block_size,
                                           self.dtype)
            num_blocks = max(1, budget // per_block)
        self.engine = Engine(self.model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, detokenize=self.tokenizer.decode,
                             cuda_graphs=device.type == "cuda" and not enforce_eager, read=read)

    @property
    def config(self):
        return self.model.config

    @property
    def weights_kind(self) -> str:
        """"real", or "synthesized random" for a preset whose weights were made up at its shapes."""
        return weights_kind(self.path)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _add_all(self, prompts: list, params) -> list[Sequence]:
        """Validate every prompt before queueing any, so one bad prompt adds nothing."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        encoded = [self._encode(p) for p in prompts]
        for i, (ids, p) in enumerate(zip(encoded, params, strict=True)):
            try:
                self.engine.validate_request(ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return [self.engine.add_request(ids, p) for ids, p in zip(encoded, params, strict=True)]

    def _step(self):
        """One engine step; a step that schedules nothing while requests wait can never finish them."""
        outputs = self.engine.step()
        if not outputs and self.engine.has_unfinished_requests():
            raise RuntimeError("the engine scheduled nothing while requests were waiting: none of them can be "
                               "admitted (no free row, or not enough free blocks)")
        return outputs

    def _result(self, prompt, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids)
        if seq.stop_text_index is not None:
            text = text[: seq.stop_text_index]
        completion = CompletionOutput(text, list(seq.output_token_ids), seq.finish_reason)
        return RequestOutput(prompt if isinstance(prompt, str) else None, list(seq.prompt_token_ids), [completion])

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion in one continuously batched loop; results in prompt order."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        seqs = self._add_all(prompts, sampling_params)
        with tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while any(not s.finished for s in seqs):
                bar.update(sum(out.finished for out in self._step()))
        return [self._result(p, s) for p, s in zip(prompts, seqs, strict=True)]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, use_tqdm: bool = True):
        """`messages` is one conversation (a list of {"role", "content"} dicts) or a list of them."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c)} for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        return outs

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield one prompt's completion as text deltas, as each token is produced. A list of
        messages is rendered with the chat template. Closing the iterator aborts the request."""
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": self.tokenizer.encode_chat(prompt)}
        (seq,) = self._add_all([prompt], sampling_params)
        detok = IncrementalDetokenizer(self.tokenizer)
        # Text that could still become the start of a stop string is held back until it cannot.
        holdback = max((len(s) - 1 for s in seq.params.stop_strings), default=0)
        seen = emitted = 0
        try:
            while True:
                self._step()
                detok.push(seq.output_token_ids[seen:])
                seen = len(seq.output_token_ids)
                if seq.finished:
                    detok.finish()
                    end = len(detok.text) if seq.stop_text_index is None else seq.stop_text_index
                    if end > emitted:
                        yield detok.text[emitted:end]
                    return
                end = len(detok.text) - holdback
                if end > emitted:
                    yield detok.text[emitted:end]
                    emitted = end
        finally:
            if not seq.finished:
                self.engine.abort_request(seq.request_id)
