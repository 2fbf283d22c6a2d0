"""`EngineConfig`: every choice a user makes about the engine, checked in one place.

`LLM(**fields)`, `python -m nanolab serve`, `generate` and `bench` build one (`EngineConfig.add_cli_args`
and `from_cli_args` give the command line's flags their names and defaults), and `Engine` takes
it whole. The names are vLLM's `EngineArgs` where vLLM has one. A bad value raises ValueError
naming its field when the config is made, before any weights are read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, fields

import torch

from nanolab.model.config import PRESETS

DEFAULT_MODEL = "smollm2-135m"
READS = ("streamed", "reference")
CUDAGRAPH_MODES = ("full", "full_decode_only")  # vLLM's names for the two it shares with nanolab
QUANTIZATIONS = (None, "fp8")
MAX_TIMEOUT_S = 30 * 24 * 3600  # a tensor-parallel collective's timeout: 30 days at most (torch keeps it in ms)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    """Raise ValueError naming `name` unless `value` is an int >= `minimum` (or None, if `optional`).
    bool is an int subclass; True is not a size."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}{' or None' if optional else ''}")


def check_bool(name: str, value, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be a bool{' or None' if optional else ''}")


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
    if resolved.type == "cpu" and resolved.index not in (None, 0):
        raise ValueError(f"device={shown!r}: the CPU is one device, 'cpu' (or 'cpu:0')")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={shown!r}: CUDA is not available on this machine (torch "
                             f"{torch.__version__} sees no CUDA device); use device='cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={shown!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def check_current_cuda(device: torch.device, shown=None) -> None:
    """Raise ValueError naming `device` (as the user gave it: `shown`) when it is a CUDA device
    other than the current one: Triton launches its kernels, and CUDA graphs capture, on the
    current device, whatever device the tensors are on. Where the engine runs, not where a config
    is checked (a server checks its config in a process that never touches the GPU)."""
    if device.type != "cuda" or device.index is None:
        return
    current = torch.cuda.current_device()
    if device.index != current:
        raise ValueError(f"device={str(shown if shown is not None else device)!r}: the engine runs its Triton kernels "
                         f"and CUDA graphs on the current CUDA device, cuda:{current}; make cuda:{device.index} "
                         f"current first (torch.cuda.set_device({device.index})), or choose it with "
                         "CUDA_VISIBLE_DEVICES")


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """A torch dtype, its name ("bfloat16", "bf16", "float32", ...) or "auto" (bf16 on CUDA, fp32
    on the CPU)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype}: must be float32, bfloat16 or float16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be 'auto', one of {sorted(DTYPES)} or a torch.dtype")
    return DTYPES[dtype]


def _check_model(model) -> None:
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model={model!r}: must be a preset name or a model folder's path")
    text = os.fspath(model)
    if isinstance(model, os.PathLike) or os.sep in text or "/" in text or os.path.exists(text):
        if not os.path.isdir(os.path.expanduser(text)):
            raise ValueError(f"model={text!r}: no such folder")
    elif text not in PRESETS:
        raise ValueError(f"model={text!r}: neither a model folder nor a preset; presets: {', '.join(PRESETS)}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`; given to `EngineConfig` as this or a
    dict of its fields). Method "ngram": each decoding row gets up to `num_speculative_tokens`
    drafts by prompt lookup (`spec_decode.propose_ngram`, suffixes of `prompt_lookup_max` down to
    `prompt_lookup_min` tokens), verified in one forward with the row's pending token. Until one of
    a request's drafts has been kept, its lookups take only matches of at least
    `prompt_lookup_min_until_kept` tokens (None: two, or `prompt_lookup_min` if that is more, and at
    most `prompt_lookup_max`): text that never repeats still matches its last token somewhere now
    and then, and each such draft costs a verify step that keeps nothing. Where a lookup's miss
    pauses a request (below), a lookup that finds only a shorter match counts as a miss.

    Under asynchronous scheduling (`async_scheduling`), while every running request is greedy and
    none asks for logprobs, verify steps overlap as plain decode steps do: each step is launched
    before the one in flight is read back, with drafts looked up as if that step kept all of its
    own, and acceptance runs on the device (`Engine`'s chained speculation). A step with a sampled
    row runs synchronously when it may carry drafts, since rejection sampling runs on the host.

    Two rules switch it off where verifying costs more than it saves, and the engine then overlaps
    its steps as it does without speculation: a decode step of more than `max_num_seqs` rows
    decodes one token a row; and a request that gets no draft to keep (its verify step kept none
    of its drafts, or, unless its steps chain, prompt lookup finds no match) looks up none for the
    next step, then for twice as many steps after each such step in a row, at most
    `max_draft_backoff` (0: never paused), each pause running on to a step numbered a multiple of
    its length, so that paused requests look up together. A verify step that keeps one ends the
    pause. A chained step overlaps with or without drafts, so there a lookup that finds nothing
    costs nothing and pauses nothing. Whether a step with a sampled row runs synchronously is
    decided by a lookup over the tokens a request already has, so a lookup that finds nothing never
    stops the overlap.

    A verify step's rows and drafts together stay within `max_num_batched_tokens` (drafts are cut
    to fit). A seeded request that samples (temperature above 0) gets no drafts: rejection sampling
    draws from its generator otherwise than a plain step does, so its tokens would depend on when
    it speculated, and with it on what shared its batch."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_min_until_kept: int | None = None
    max_num_seqs: int = 8
    max_draft_backoff: int = 32

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config.method={self.method!r}: must be 'ngram'")
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens)
        check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min)
        check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, minimum=self.prompt_lookup_min)
        check_int("speculative_config.prompt_lookup_min_until_kept", self.prompt_lookup_min_until_kept,
                  minimum=self.prompt_lookup_min, optional=True)
        if self.prompt_lookup_min_until_kept is not None and self.prompt_lookup_min_until_kept > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min_until_kept={self.prompt_lookup_min_until_kept}: "
                             f"must be at most prompt_lookup_max ({self.prompt_lookup_max})")
        check_int("speculative_config.max_num_seqs", self.max_num_seqs)
        check_int("speculative_config.max_draft_backoff", self.max_draft_backoff, minimum=0)

    @property
    def min_until_kept(self) -> int:
        """The shortest match a request's lookups take until one of its drafts has been kept."""
        if self.prompt_lookup_min_until_kept is not None:
            return self.prompt_lookup_min_until_kept
        return min(max(2, self.prompt_lookup_min), self.prompt_lookup_max)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs, as the user chose it. None and "auto" stay as given and are settled
    where they run: `device` and `dtype` when `LLM` loads the weights (an `Engine` runs where its
    model lives), the pool's size and the context by the engine once the weights are in memory
    (`Engine.num_blocks`, `Engine.max_model_len`)."""

    model: str = DEFAULT_MODEL  # a preset name or a Hugging Face folder (config.json + safetensors)
    device: str | torch.device | None = None  # "cpu", "cuda", "cuda:N"; None: CUDA when there is one
    dtype: str | torch.dtype = "auto"  # bf16 on CUDA, fp32 on the CPU
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # requests running at once (rows of the batch)
    max_model_len: int | None = None  # None: the model's context, or what the pool holds if less
    num_blocks: int | None = None  # the KV pool; None: as many as kv_cache_bytes holds
    kv_cache_bytes: int | None = None  # None: 1 GiB on the CPU, 40% of what the weights leave free on CUDA
    enforce_eager: bool = False  # no CUDA graphs (vLLM's name)
    cudagraph_mode: str = "full"  # varlen steps replay graphs too; "full_decode_only": decode steps alone
    max_cudagraph_capture_size: int | None = None  # the largest varlen step captured; None: the budget, at most 512
    read: str = "auto"  # the paged read: "streamed" (Triton), "reference" (torch); "auto": streamed on CUDA
    compile: bool | None = None  # decode steps through inductor; None: on with CUDA graphs
    async_scheduling: bool | None = None  # launch step t + 1 before reading back step t; None: on with graphs
    enable_chunked_prefill: bool = True  # a token budget per step, decode rows first, prompts in chunks
    enable_prefix_caching: bool = True  # a prompt starts after the cached full blocks of its prefix
    max_num_batched_tokens: int = 512  # the tokens one step feeds, with chunked prefill: every step fits a graph
    tensor_parallel_size: int = 1  # processes the model is sharded over, rank 0 coordinating
    distributed_timeout_s: float | None = None  # a tensor-parallel group's collective timeout; None: torch's
    quantization: str | None = None  # "fp8": the layers' weights as e4m3 with a scale per output channel
    speculative_config: SpeculativeConfig | dict | None = None  # None: one token a row each decode step
    # Tensor parallelism on CUDA runs over NCCL, a path that has not yet passed on two GPUs: refused
    # unless asked for.
    unverified_nccl: bool = False

    def __post_init__(self) -> None:
        _check_model(self.model)
        object.__setattr__(self, "model", os.fspath(self.model))
        device = resolve_device(self.device)
        resolve_dtype(self.dtype, device)
        check_int("block_size", self.block_size)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_model_len", self.max_model_len, minimum=2, optional=True)  # a prompt token and a new one
        check_int("num_blocks", self.num_blocks, optional=True)
        check_int("kv_cache_bytes", self.kv_cache_bytes, optional=True)
        check_bool("enforce_eager", self.enforce_eager)
        if not isinstance(self.cudagraph_mode, str) or self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode={self.cudagraph_mode!r}: must be one of "
                             f"{', '.join(map(repr, CUDAGRAPH_MODES))}")
        check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, optional=True)
        if not isinstance(self.read, str) or self.read not in ("auto", *READS):
            raise ValueError(f"read={self.read!r}: must be 'auto' or one of {', '.join(map(repr, READS))}")
        check_bool("compile", self.compile, optional=True)
        check_bool("async_scheduling", self.async_scheduling, optional=True)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        timeout = self.distributed_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0.001 <= timeout <= MAX_TIMEOUT_S):
            raise ValueError(f"distributed_timeout_s={timeout!r}: must be a number of seconds in [0.001, "
                             f"{MAX_TIMEOUT_S:g}], or None")
        check_bool("unverified_nccl", self.unverified_nccl)
        spec = self.speculative_config
        if isinstance(spec, dict):
            known = {f.name for f in fields(SpeculativeConfig)}
            if set(spec) - known:
                raise ValueError(f"speculative_config={spec!r}: unknown keys {sorted(set(spec) - known, key=str)}; "
                                 f"known: {sorted(known)}")
            try:
                object.__setattr__(self, "speculative_config", SpeculativeConfig(**spec))
            except ValueError as e:
                raise ValueError(f"speculative_config={spec!r}: {e}") from None
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config={spec!r}: must be a SpeculativeConfig, a dict of its fields, "
                             "or None")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r}: must be None or one of "
                             f"{', '.join(repr(q) for q in QUANTIZATIONS if q)}")
        tp = self.tensor_parallel_size
        if tp > 1 and device.type == "cuda":
            if tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={tp}: this machine has {torch.cuda.device_count()} "
                                 "CUDA device(s), one per rank")
            if device.index not in (None, 0):
                raise ValueError(f"device={device}: a tensor-parallel group puts rank r on cuda:r, rank 0 on cuda:0")
            if not self.unverified_nccl:
                raise ValueError(f"tensor_parallel_size={tp} on {device}: tensor parallelism runs on the CPU (gloo) "
                                 "for now; its NCCL path has not yet passed on two GPUs (unverified_nccl=True, "
                                 "--unverified-nccl, runs it anyway)")

    def cuda_graphs(self, device: torch.device) -> bool:
        """Whether decode steps on `device` replay CUDA graphs: on CUDA unless `enforce_eager`."""
        return device.type == "cuda" and not self.enforce_eager

    def varlen_capture_size(self, device: torch.device, read: str) -> int | None:
        """The largest varlen step (prompt chunks beside decode rows) that replays a graph on
        `device` with the paged read `read` (as the cache resolved it), or None when varlen steps
        run eagerly: `max_cudagraph_capture_size`, else the step's token budget up to 512 (vLLM's
        cap), with graphs, `cudagraph_mode` "full" and the streamed read. The reference read walks
        a step's segments on the host, which a graph cannot follow, so under it varlen steps run
        eagerly whatever the mode, as vLLM falls back for a backend that cannot capture them."""
        if not self.cuda_graphs(device) or self.cudagraph_mode != "full" or read != "streamed":
            return None
        budget = self.max_num_batched_tokens if self.enable_chunked_prefill else 512
        return self.max_cudagraph_capture_size or min(budget, 512)

    def compiled(self, device: torch.device) -> bool:
        """Whether decode steps on `device` go through inductor: `compile`, else with CUDA graphs."""
        return self.cuda_graphs(device) if self.compile is None else self.compile

    def overlapped(self, device: torch.device) -> bool:
        """Whether asynchronous scheduling is on for `device`: `async_scheduling`, else with CUDA
        graphs. With speculative decoding, greedy rows' verify steps overlap too (chained
        speculation); a step with a sampled row that may carry drafts runs synchronously."""
        return self.cuda_graphs(device) if self.async_scheduling is None else self.async_scheduling

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes`, checked again."""
        return dataclasses.replace(self, **changes)

    # The command line: one flag per field, vLLM's spelling.

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = (), **defaults) -> None:
        """Add a flag for every field but those named in `skip` (a command that sets them itself),
        with `defaults` in place of the config's own (a bench's model, say)."""
        d = EngineConfig.__dataclass_fields__
        flags = {
            "model": dict(default=d["model"].default, help="a preset name or a Hugging Face model folder"),
            "device": dict(default=None, help="cpu, cuda or cuda:N (default: cuda when available)"),
            "dtype": dict(default="auto", help="float32, bfloat16, float16 or auto (bf16 on CUDA, fp32 on the CPU)"),
            "block_size": dict(type=int, default=16, help="tokens per KV block"),
            "max_num_seqs": dict(type=int, default=64, help="the most requests running at once"),
            "max_model_len": dict(type=int, default=None, help="the context (default: the model's, or the pool's)"),
            "num_blocks": dict(type=int, default=None, help="KV blocks in the pool (default: from --kv-cache-bytes)"),
            "kv_cache_bytes": dict(type=int, default=None,
                                   help="the KV pool's bytes (default: 1 GiB on the CPU, 40%% of free memory on CUDA)"),
            "enforce_eager": dict(action="store_true", help="no CUDA graphs"),
            "cudagraph_mode": dict(default="full", choices=CUDAGRAPH_MODES,
                                   help="full (default): every step up to the largest capture size replays a graph; "
                                        "full_decode_only: decode steps alone"),
            "max_cudagraph_capture_size": dict(type=int, default=None,
                                               help="the largest varlen step captured, in tokens "
                                                    "(default: the step's token budget, --max-num-batched-tokens "
                                                    "with chunked prefill and 512 without, at most 512)"),
            "read": dict(default="auto", choices=("auto", *READS), help="the paged read (default: streamed on CUDA)"),
            "quantization": dict(default=None, choices=[q for q in QUANTIZATIONS if q],
                                 help="fp8: the layers' weights as e4m3, a scale per output channel, quantized at "
                                      "load (the embedding and the LM head stay in --dtype)"),
            "compile": dict(action=argparse.BooleanOptionalAction, default=None,
                            help="decode steps through inductor (default: on with CUDA graphs)"),
            "async_scheduling": dict(action=argparse.BooleanOptionalAction, default=None,
                                     help="launch each decode step before reading back the last "
                                          "(default: on with CUDA graphs)"),
            "enable_chunked_prefill": dict(action=argparse.BooleanOptionalAction, default=True,
                                           help="a token budget per step, decode rows first and prompts in chunks "
                                                "(--no-enable-chunked-prefill: whole prompts, or decode)"),
            "enable_prefix_caching": dict(action=argparse.BooleanOptionalAction, default=True,
                                          help="reuse the cached K/V of a prompt's leading full blocks "
                                               "(--no-enable-prefix-caching: recompute every prompt)"),
            "max_num_batched_tokens": dict(type=int, default=512, help="the tokens one step feeds (default: 512)"),
            "tensor_parallel_size": dict(type=int, default=1,
                                         help="shard the model over this many processes, rank 0 coordinating"),
            "distributed_timeout_s": dict(type=float, default=None,
                                          help="a tensor-parallel group's collective timeout in seconds"),
            "speculative_config": dict(type=json.loads, default=None,
                                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                                            '"num_speculative_tokens": 4}\' (fields of SpeculativeConfig)'),
            "unverified_nccl": dict(action="store_true",
                                    help="allow tensor parallelism on CUDA (NCCL), not yet passed on two GPUs"),
        }
        assert set(flags) == {f.name for f in fields(EngineConfig)}, "a field without a flag"
        unknown = set(defaults) - set(flags)
        if unknown:
            raise ValueError(f"defaults for no field: {', '.join(sorted(unknown))}")
        for name, kwargs in flags.items():
            if name not in skip:
                kwargs = {**kwargs, "default": defaults[name]} if name in defaults else kwargs
                parser.add_argument("--" + name.replace("_", "-"), dest=name, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config the flags of `add_cli_args` give, with `overrides` on top."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})
