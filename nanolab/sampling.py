"""`SamplingParams` (vLLM's field names and defaults) and the sampler."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from nanolab.kernels.argmax import argmax

# vLLM's floor for a positive temperature. Far below it, dividing fp32 logits of a few tens by the
# temperature overflows them to inf (from about 1e-37) and the sampler draws from NaN; near it, the
# draw is already the argmax in all but name.
MIN_TEMPERATURE = 1e-2
# torch.Generator.manual_seed takes any int in [-2**63, 2**64) and raises outside it.
SEED_RANGE = (-(2**63), 2**64)
# The most top log-probabilities a position may ask for (OpenAI's limit for chat's top_logprobs).
MAX_LOGPROBS = 20
# The most samples one request may ask for (n).
MAX_N = 128

# One position's log-probabilities: the chosen token's, then the top k as (token id, logprob),
# most likely first. A plain tuple: it crosses from the engine core's process once per token.
PositionLogprobs = tuple[float, tuple[tuple[int, float], ...]]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops. `temperature=0` is greedy.

    `n` samples are drawn for the request (each a request of its own to the engine: `samples`).
    `logprobs=k` returns, for every generated token, its log-probability and the k most likely
    tokens' (0: the token's alone); `prompt_logprobs=k` the same for every prompt token after the
    first. Both are the log-softmax of the raw logits in fp32 (the model's distribution, before
    temperature, top-k and top-p), as vLLM's default.

    Every field is checked here, so a request that constructs cannot fail in the sampler: a bad
    value raises ValueError("SamplingParams.<field>=<value>: <why>"). A bool is not a number."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    max_tokens: int | None = 16  # None: until EOS or the model's context
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if 0 < t < MIN_TEMPERATURE:
            raise bad("temperature", f"a positive temperature must be >= {MIN_TEMPERATURE} (below it sampling "
                                     "degenerates and tiny values overflow the logits); use 0 for greedy")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an int >= 1, or 0 / -1 to disable")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise bad("seed", "must be an int in [-2**63, 2**64) (torch.Generator's range), or None")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an int >= 1, or None")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an int in [1, {MAX_N}]")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise bad(name, f"must be an int in [0, {MAX_LOGPROBS}], or None")
        object.__setattr__(self, "stop_strings", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def samples(self) -> list[SamplingParams]:
        """The `n` requests this one stands for, each with n=1: sample i is seeded with seed + i
        (wrapped into the seed's range), so the samples differ and each is reproducible."""
        if self.n == 1:
            return [self]
        lo, hi = SEED_RANGE
        seeds = [None if self.seed is None else (self.seed + i - lo) % (hi - lo) + lo for i in range(self.n)]
        return [dataclasses.replace(self, n=1, seed=seed) for seed in seeds]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | list[int], k: int
                     ) -> list[PositionLogprobs]:
    """logits [rows, vocab] (any float dtype), token_ids [rows] -> per row the token's
    log-probability and the top `k`, from the log-softmax in fp32. One read-back for all rows."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # [rows]
    if k:
        top = logprobs.topk(k, dim=-1)  # values, indices [rows, k]
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_lps = [[] for _ in range(len(ids))]
    return [(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen.tolist(), top_ids, top_lps)]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits [rows, vocab] fp32 -> one token per row, on the host (`sample_tokens`, read back)."""
    return sample_tokens(logits, params, generators).tolist()


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [rows, vocab] fp32 -> [rows] int64 tokens on logits' device, with nothing read back
    to the host: the engine can launch the next step before it looks at these.

    Greedy rows take the argmax of the raw logits (exact, no noise). Sampled rows apply
    temperature, then top-k, then top-p, and draw with the row's own generator, so a seeded
    request gives the same tokens whatever else shares its batch.
    """
    tokens = argmax(logits) if logits.is_cuda else logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        tokens = tokens.clone()
        for i in sampled:
            tokens[i] = _sample_row(logits[i], params[i], generators[i])
    return tokens


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> the distribution a sampled (not greedy) row draws from: temperature, then
    top-k, then top-p, then softmax, in fp32."""
    logits = logits.float() / p.temperature  # [vocab]
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
        drop[0] = False  # the most likely token always stays (a top_p below fp32's smallest number is 0)
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(sampling_probs(logits, p), 1, generator=generator)[0]
