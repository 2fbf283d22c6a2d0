"""Speculative decoding's two halves, as functions of one request's tokens and probabilities:
`propose_ngram` (prompt lookup: draft tokens copied from where the request's latest tokens
occurred before) and `rejection_sample` / `greedy_accept` (which drafts the target model keeps,
and the one token it adds after them). vLLM's names: `NgramProposer`, `RejectionSampler`.

Acceptance keeps the target distribution exactly (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"): draft token d_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from the residual
max(p_i - q_i, 0), renormalized, and nothing after it is kept; when every draft is kept, a bonus
token is drawn from p_{k+1}. A prompt-lookup draft is deterministic (q_i is one-hot on d_i), so
d_i is kept with probability p_i(d_i) and a rejection draws from p_i without d_i.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


class TokenIndex:
    """One request's tokens (`tokens`) and where each token id occurs in them, in order: a lookup
    for a suffix that ends in token t tries t's earlier positions only, so it costs the matches it
    tries, not a walk over the whole context. `update` takes in what the request gained since the
    last call; a request's tokens only grow, so nothing indexed changes."""

    __slots__ = ("positions", "tokens")

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}  # token id -> its positions, ascending
        self.tokens: list[int] = []  # the tokens indexed, positions 0 .. length - 1

    @property
    def length(self) -> int:
        return len(self.tokens)

    def update(self, prompt: Sequence[int], output: Sequence[int]) -> TokenIndex:
        """Take in the tokens of `prompt` then `output` past `length`; return self."""
        n, positions, tokens = len(prompt), self.positions, self.tokens
        for i in range(len(tokens), n + len(output)):
            t = prompt[i] if i < n else output[i - n]
            tokens.append(t)
            at = positions.get(t)
            if at is None:
                positions[t] = [i]
            else:
                at.append(i)
        return self


def propose_ngram(token_ids: Sequence[int], k: int, max_n: int = 4, min_n: int = 1,
                  index: TokenIndex | None = None, covered: int | None = None) -> list[int]:
    """Up to `k` draft tokens: the tokens that followed the latest earlier occurrence of the
    longest suffix of `token_ids` between `max_n` and `min_n` tokens long (prompt lookup, as
    vLLM's n-gram proposer). Empty when no suffix occurred before, or nothing followed it.
    `index`, the request's `TokenIndex` over the first `covered` of these tokens (default its
    `length`), gives the same drafts without walking them: only the tokens past it are scanned."""
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    length = len(tokens)
    if length < 2:
        return []
    last = tokens[-1]
    # The positions j < length - 1 that hold the last token, latest first: each ends a match,
    # extended backwards up to max_n tokens; the longest wins, the latest among equals.
    covered = index.length if index is not None and covered is None else covered
    if index is not None and covered <= length:
        tail = [j for j in range(length - 2, covered - 1, -1) if tokens[j] == last]
        earlier = index.positions.get(last, [])
        ends = itertools.chain(tail, (j for j in reversed(earlier) if j <= length - 2))
    else:
        ends = (j for j in range(length - 2, -1, -1) if tokens[j] == last)
    best_n, best_j = 0, -1
    for j in ends:
        n = 1
        while n < max_n and n <= j and tokens[j - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_j = n, j
            if n == max_n:
                break
    if best_n < min_n:
        return []
    return tokens[best_j + 1: best_j + 1 + k]


def greedy_accept(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """Temperature 0: target_argmax [k + 1] (the target's choice after each prefix of the drafts)
    and draft_tokens [k] -> the drafts that match, then the target's own token at the first
    mismatch, or its bonus token after all k. 1 to k + 1 tokens: what plain greedy decoding emits."""
    if len(target_argmax) != len(draft_tokens) + 1:
        raise ValueError(f"{len(draft_tokens)} drafts need {len(draft_tokens) + 1} target tokens, "
                         f"got {len(target_argmax)}")
    out = []
    for target, draft in zip(target_argmax, draft_tokens):
        out.append(int(target))
        if target != draft:
            return out
    out.append(int(target_argmax[-1]))
    return out


def rejection_sample(target_probs: torch.Tensor, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k + 1, vocab] (the target's distribution after each prefix of the drafts,
    with the request's temperature, top-k and top-p applied), draft_tokens [k], draft_probs
    [k, vocab] or None for a deterministic draft (prompt lookup) -> the kept drafts, then one token
    drawn from the residual at the first rejection or, when all are kept, the bonus token from
    target_probs[k]. 1 to k + 1 tokens, distributed as sampling the target token by token."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} drafts need target_probs of shape [{k + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    p = target_probs.float()
    out = []
    for i, d in enumerate(draft_tokens):
        q = None if draft_probs is None else draft_probs[i].float()
        q_d = 1.0 if q is None else float(q[d])
        keep = min(1.0, float(p[i, d]) / q_d) if q_d > 0 else 0.0
        if float(torch.rand((), generator=generator, device=p.device)) < keep:
            out.append(int(d))
            continue
        if q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p equals q (or p is all on d): the target's own draw
            residual = p[i]
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
