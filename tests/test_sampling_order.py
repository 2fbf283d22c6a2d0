"""Sampling choices that a token-level test can miss: the order of temperature, top-k and top-p,
which stop string wins when several match, and a seeded request that is preempted mid-run."""

from __future__ import annotations

import pytest
import torch
from conftest import run_until_done
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanolab import LLM, Engine, EngineConfig, SamplingParams
from nanolab.sampling import sample

pytestmark = pytest.mark.usefixtures("one_thread")


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 3000, seed: int = 0) -> set[int]:
    """The support of n draws from one row of logits [vocab]."""
    gen = torch.Generator().manual_seed(seed)
    return set(sample(logits.expand(n, -1).contiguous(), [params] * n, [gen] * n))


def nucleus(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[set[int], torch.Tensor]:
    """vLLM's order, in float64: scale by temperature, keep the top k, then the smallest prefix of
    the renormalised distribution whose mass reaches top_p. Returns the kept tokens and the
    cumulative masses (to keep examples away from ties with top_p)."""
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs, order = scaled.softmax(-1).sort(descending=True)
    before = probs.cumsum(-1) - probs
    kept = {int(t) for t, b, p in zip(order, before, probs) if b < top_p and p > 0}
    return kept, before


# probabilities 0.5, 0.3, 0.2 at temperature 1
THREE = torch.tensor([0.5, 0.3, 0.2]).log()


@pytest.mark.parametrize("temperature,top_p,kept", [
    # T=0.5 sharpens to 0.66, 0.24, 0.10: top_p=0.6 keeps token 0 alone. (Before scaling, 0.5 < 0.6
    # would keep token 1 too.)
    (0.5, 0.6, {0}),
    # T=2 flattens to 0.42, 0.32, 0.26: top_p=0.75 needs all three. (Before scaling, 0.5 + 0.3
    # reaches 0.75 and token 2 would be dropped.)
    (2.0, 0.75, {0, 1, 2}),
])
def test_top_p_applies_to_the_temperature_scaled_distribution(temperature, top_p, kept):
    assert nucleus(THREE, temperature, 0, top_p)[0] == kept  # the reference agrees with the comment
    assert draws(THREE, SamplingParams(temperature=temperature, top_p=top_p)) == kept


def test_top_k_then_top_p_at_a_low_temperature():
    """Five tokens, top_k=3 keeps 0.4, 0.3, 0.15; at T=0.5 they become 0.59, 0.33, 0.08 of the
    kept mass and top_p=0.55 keeps token 0 alone. Unscaled (0.47, 0.35, 0.18) it would keep two."""
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.55)
    assert nucleus(logits, 0.5, 3, 0.55)[0] == {0}
    assert draws(logits, params) == {0}
    # at T=3 (0.38, 0.35, 0.27) top_p=0.75 keeps all three of the top k, never the others; unscaled
    # (0.47 + 0.35 >= 0.75) it would keep two
    assert nucleus(logits, 3.0, 3, 0.75)[0] == {0, 1, 2}
    assert draws(logits, SamplingParams(temperature=3.0, top_k=3, top_p=0.75)) == {0, 1, 2}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), vocab=st.integers(3, 12), temperature=st.sampled_from([0.3, 0.7, 1.5, 4.0]),
       top_k=st.sampled_from([0, 2, 4]), top_p=st.floats(0.2, 0.95))
def test_sampled_tokens_stay_inside_the_nucleus(seed, vocab, temperature, top_k, top_p):
    """No draw ever lands outside the nucleus of the scaled, top-k'd distribution."""
    logits = 2.0 * torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    kept, before = nucleus(logits, temperature, top_k, top_p)
    assume(bool(((before - top_p).abs() > 1e-4).all()))  # no tie between a prefix mass and top_p
    got = draws(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n=400, seed=seed)
    assert got <= kept, f"drew {sorted(got - kept)} outside the nucleus {sorted(kept)}"


# Stop strings: the earliest match in the text wins, whichever order the list names them in.

def letters(ids) -> str:
    """A detokenizer that ignores the vocabulary: token id i reads as one letter, 'a' + i mod 26."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("spans", [[(2, 5), (3, 5)], [(3, 5), (2, 5)], [(4, 5), (1, 5), (2, 5)]])
def test_the_earliest_stop_string_in_the_text_wins(tiny_model, spans):
    """Stop strings cut from the output's own text, all completed by its 5th token: the match that
    starts earliest in the text wins, whatever order the list names them in."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = Engine(tiny_model, EngineConfig(num_blocks=32, block_size=4), detokenize=letters)
    full = free.add_request([5, 6, 7], params)
    run_until_done(free)
    text = letters(full.output_token_ids)
    stop = [text[a:b] for a, b in spans]
    # Where the engine must stop: the first prefix whose text holds a stop string.
    n = next(n for n in range(1, 21) if any(s in text[:n] for s in stop))
    engine = Engine(tiny_model, EngineConfig(num_blocks=32, block_size=4), detokenize=letters)
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop))
    run_until_done(engine)
    assert seq.finish_reason == "stop" and seq.output_token_ids == full.output_token_ids[:n]
    assert seq.stop_text_index == min(i for i in (text[:n].find(s) for s in stop) if i >= 0)


def test_request_output_text_ends_where_the_earliest_stop_string_starts(sharp_gqa24):
    llm = LLM(str(sharp_gqa24.path), device="cpu", dtype="float32", num_blocks=64)
    prompt = {"prompt_token_ids": [72, 101, 108, 108, 111]}
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    decode = llm.tokenizer.decode
    # a step s where a 3-character and a 1-character string both first appear, ending the text
    for s in range(3, 31):
        text, before = decode(full.token_ids[:s]), decode(full.token_ids[: s - 1])
        longer, shorter = text[-3:], text[-1:]
        if len(text) >= 4 and longer not in before and shorter not in before and text.find(shorter) == len(text) - 1:
            break
    else:
        pytest.skip("the greedy text has no step where two fresh strings end together")
    for stop in ([shorter, longer], [longer, shorter]):
        (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop),
                              use_tqdm=False)
        assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:s]
        assert out.text == text[: len(text) - 3]


# Seeded sampling under preemption: the request's generator continues through the recompute.

def seeded_run(model, num_blocks: int) -> tuple[list[list[int]], int]:
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, block_size=4))
    g = torch.Generator().manual_seed(11)
    seqs = [engine.add_request(torch.randint(3, 320, (n,), generator=g).tolist(),
                               SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=20,
                                              ignore_eos=True))
            for i, n in enumerate((7, 12, 9, 5, 13))]
    run_until_done(engine)
    assert engine.block_manager.allocator.num_free == num_blocks
    return [s.output_token_ids for s in seqs], engine.scheduler.num_preemptions


def test_seeded_requests_repeat_under_preemption(sharp_model):
    roomy, none = seeded_run(sharp_model.model, 128)
    tight, preempted = seeded_run(sharp_model.model, 14)
    assert none == 0 and preempted > 0
    assert tight == roomy


def test_stop_strings_are_found_without_decoding_the_whole_output(tiny_model):
    """A request with stop strings costs a few tokens' decode a step, not its whole output's."""
    longest = []

    def decode(ids):
        longest.append(len(ids))
        return letters(ids)

    engine = Engine(tiny_model, EngineConfig(num_blocks=64, block_size=4), detokenize=decode)
    seq = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=150, ignore_eos=True,
                                                       stop=["never-matches"]))
    run_until_done(engine)
    assert len(seq.output_token_ids) == 150 and seq.finish_reason == "length"
    assert max(longest) <= 4, f"decoded {max(longest)} tokens at once"
