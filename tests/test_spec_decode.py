"""Speculative decoding's halves on their own: the prompt-lookup proposer on token lists worked by
hand; greedy acceptance, which must emit exactly what plain greedy decoding emits; and rejection
sampling, whose output must be distributed as the target's, token by token (chi-square tests on a
small vocabulary, seeded, so they are deterministic)."""

from __future__ import annotations

import random

import pytest
import torch

from nanolab.spec_decode import greedy_accept, propose_ngram, rejection_sample

# Chi-square's 0.999 quantile with 4 degrees of freedom (a vocabulary of 5): a correct sampler
# exceeds it once in a thousand seeds; these seeds are fixed.
CHI2_4_999 = 18.467


def test_propose_ngram_copies_what_followed_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert propose_ngram([1, 2, 9, 1, 2, 7, 1, 2], k=3) == [7, 1, 2]  # the latest earlier [1, 2]
    # [5, 1, 2] matched (3 tokens) wins over the later [1, 2] (2 tokens).
    assert propose_ngram([5, 1, 2, 8, 1, 2, 9, 5, 1, 2], k=3) == [8, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, max_n=1) == [3, 4, 1]
    assert propose_ngram([7, 8, 9], k=2) == []  # nothing occurred before
    assert propose_ngram([4, 4], k=3) == [4]  # only what exists after the match
    assert propose_ngram([3], k=2) == []
    with pytest.raises(ValueError, match="k >= 1"):
        propose_ngram([1, 2], k=0)


def test_greedy_accept_keeps_the_matching_drafts_and_adds_one():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, then the bonus
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token at the first mismatch
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert greedy_accept([3], []) == [3]
    with pytest.raises(ValueError, match="need 3 target tokens"):
        greedy_accept([1, 2], [1, 2])


def test_speculative_greedy_emits_plain_greedy_tokens():
    """A toy target whose next token depends on the last three (so prompt lookup often guesses
    right, and sometimes wrong): decoding with n-gram drafts of up to 4 tokens, verified by
    greedy_accept, gives the same tokens as one token at a time, in fewer target passes."""
    rng = random.Random(0)
    table = {}

    def target(prefix: list[int]) -> int:
        key = tuple(prefix[-3:])
        if key not in table:
            table[key] = rng.choice([1, 2, 3]) if rng.random() < 0.8 else rng.randrange(4, 9)
        return table[key]

    prompt = [1, 2, 3, 1, 2]
    plain = list(prompt)
    while len(plain) < 80:
        plain.append(target(plain))
    spec, passes = list(prompt), 0
    while len(spec) < 80 and passes < 80:  # a pass that emits nothing would loop forever
        drafts = propose_ngram(spec, k=4)
        argmax = [target(spec + drafts[:i]) for i in range(len(drafts) + 1)]  # one pass of the target
        spec += greedy_accept(argmax, drafts)
        passes += 1
    assert spec[:80] == plain
    assert passes < 80 - len(prompt), "no draft was ever kept"


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    """k = 2 drafts over a vocabulary of 5, 20,000 seeded trials: the first token is distributed
    as p_1, the second (given the first draft kept) as p_2, the third (both kept) as p_3; with a
    deterministic draft (the same two tokens every trial) and with drafts drawn from a draft
    distribution q each trial. And lengths 1 to k + 1 all occur."""
    g = torch.Generator().manual_seed(1)
    dirichlet = lambda rows: (lambda e: e / e.sum(-1, keepdim=True))(-torch.rand(rows, 5, generator=g).log())  # noqa: E731
    p = dirichlet(3)  # [k + 1, vocab]
    q = dirichlet(2) if with_draft_probs else None
    trials = 20_000
    drafts = (torch.multinomial(q, trials, replacement=True, generator=g).T.tolist() if with_draft_probs
              else [[1, 3]] * trials)
    outs = [rejection_sample(p, d, q, g) for d in drafts]
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=5).float()
    second = torch.bincount(torch.tensor([o[1] for o, d in zip(outs, drafts) if len(o) > 1]),
                            minlength=5).float()
    third = torch.bincount(torch.tensor([o[2] for o in outs if len(o) == 3]), minlength=5).float()
    for name, counts, probs in (("first", first, p[0]), ("second", second, p[1]), ("third", third, p[2])):
        assert counts.sum() > 500, f"too few {name} tokens to test"
        assert _chi2(counts, probs) < CHI2_4_999, f"the {name} token is not distributed as the target's"
    assert {len(o) for o in outs} == {1, 2, 3}


def test_a_sure_draft_is_always_kept_and_a_bonus_follows():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert all(rejection_sample(p, [1, 2], None, g) == [1, 2, 0] for _ in range(50))
    assert all(rejection_sample(p, [2, 2], None, g) == [1] for _ in range(50))  # an impossible draft
    with pytest.raises(ValueError, match=r"target_probs of shape \[3, vocab\]"):
        rejection_sample(p[:2], [1, 2])
