"""What a serving bench sends: the workload (prompt and output lengths, requests a rate), and the
seeded Poisson plan of requests at each rate. Day 58.

Prompts are random token ids, so their lengths are exact; every request asks for `max_tokens`
with `ignore_eos`, so it produces exactly that many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEED_RATES = (1.0, 2.0, 4.0, 8.0)
TOKEN_ID_FLOOR = 16  # prompt ids are drawn above the special tokens at the bottom of the vocabulary


@dataclass(frozen=True)
class Workload:
    """What each rate sends: prompt and output lengths uniform over [lo, hi] (inclusive), and
    max(min_requests, rate x duration_s) requests, at most max_requests."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    duration_s: float
    min_requests: int
    max_requests: int

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")
        if not 1 <= self.min_requests <= self.max_requests:
            raise ValueError(f"need 1 <= min_requests <= max_requests, got {self.min_requests}, {self.max_requests}")

    def requests_at(self, rate: float) -> int:
        return int(min(self.max_requests, max(self.min_requests, round(rate * self.duration_s))))

    @property
    def mean_output(self) -> float:
        return sum(self.output_len) / 2


# The H200 run, Llama-3.2-1B shapes: prompts of 64 to 512 tokens and 32 to 256 new tokens, so 64
# full rows hold at most 49k tokens, and requests that start together finish up to 8x apart, which
# is what row compaction is about. 8 s of arrivals a rate, at least 16 requests (the 1 request/s
# rate still pools about 2,300 ITL gaps) and at most 512: both arms, the offline steps and the
# weights' synthesis took 222 s on an H200 (2026-11-30).
WORKLOADS = {
    "cuda": Workload(prompt_len=(64, 512), output_len=(32, 256), duration_s=8.0, min_requests=16, max_requests=512),
    # SmolLM2 on two CPU cores decodes a step in 40 to 100 ms: short requests, 2.5 s a rate, so the
    # seed's four rates take about 20 s (8 requests/s saturates it).
    "cpu": Workload(prompt_len=(16, 64), output_len=(8, 24), duration_s=2.5, min_requests=4, max_requests=16),
}


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    arrival_s: float  # from the start of the rate
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def request_plan(rate: float, n: int, vocab_size: int, workload: Workload, seed: int = 0) -> list[PlannedRequest]:
    """`n` requests arriving as a Poisson process of `rate` per second (exponential gaps; the first
    at 0), with random token-id prompts so their lengths are exact. Seeded by (seed, rate): every
    arm gets the same plan at a rate."""
    rng = np.random.default_rng([seed, int(round(rate * 1000))])
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    prompt_lens = rng.integers(workload.prompt_len[0], workload.prompt_len[1] + 1, size=n)
    output_lens = rng.integers(workload.output_len[0], workload.output_len[1] + 1, size=n)
    plan = []
    for i in range(n):
        prompt = tuple(int(t) for t in rng.integers(TOKEN_ID_FLOOR, vocab_size, size=prompt_lens[i]))
        plan.append(PlannedRequest(i, float(arrivals[i]), prompt, int(output_lens[i])))
    return plan


def rate_schedule(rates: Sequence[float], max_rate: float) -> list[float]:
    """The listed rates, then doubling from the last up to `max_rate`: the order they run in, until
    one past the listed ones saturates."""
    rates = [float(r) for r in rates]
    while rates[-1] * 2 <= max_rate:
        rates.append(rates[-1] * 2)
    return rates
