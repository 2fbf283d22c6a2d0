"""`SamplingParams` validation and the sampler: greedy, top-k, top-p and seeded determinism."""

import math

import pytest
import torch
from conftest import load_tiny, run_until_done

from nanolab import Engine, EngineConfig, SamplingParams
from nanolab.sampling import sample

pytestmark = pytest.mark.usefixtures("one_thread")


# Validation: every nonsense value is a ValueError that names its field.

NONSENSE = [
    ("temperature", -1.0), ("temperature", -1e-9), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", -math.inf), ("temperature", "0.5"), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.0001), ("top_p", 2), ("top_p", -0.5), ("top_p", math.nan),
    ("top_p", "1"),
    ("top_k", -2), ("top_k", -100), ("top_k", 1.5), ("top_k", 2.0), ("top_k", True), ("top_k", "3"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.0), ("max_tokens", True), ("max_tokens", "8"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", ""]), ("stop", [1]),
    ("seed", True), ("seed", False), ("seed", 1.5), ("seed", "7"),
]


@pytest.mark.parametrize("field,value", NONSENSE, ids=[f"{f}={v!r}" for f, v in NONSENSE])
def test_nonsense_sampling_params_raise_naming_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("kwargs", [
    {}, {"temperature": 0}, {"temperature": 0.0}, {"temperature": 2}, {"top_p": 1}, {"top_p": 1e-6},
    {"top_k": 0}, {"top_k": -1}, {"top_k": 1}, {"max_tokens": None}, {"max_tokens": 1}, {"seed": 0},
    {"seed": -5}, {"stop": "\n"}, {"stop": ["a", "bc"]}, {"stop": None}, {"stop": []},
])
def test_sensible_sampling_params_are_accepted(kwargs) -> None:
    SamplingParams(**kwargs)


def test_stop_strings_normalise_to_a_tuple() -> None:
    assert SamplingParams(stop="x").stop_strings == ("x",)
    assert SamplingParams(stop=["x", "yz"]).stop_strings == ("x", "yz")
    assert SamplingParams().stop_strings == ()
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-2).greedy


# The sampler.

def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n draws from one row of logits [vocab], all from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1), [params] * n, [gen] * n)


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(16, 100, 0)
    params = [SamplingParams(temperature=0)] * 16
    assert sample(logits, params, [None] * 16) == logits.argmax(-1).tolist()
    # Greedy rows stay argmax when they share the batch with sampled rows.
    mixed = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=5.0) for i in range(16)]
    gens = [torch.Generator().manual_seed(i) for i in range(16)]
    got = sample(logits, mixed, gens)
    assert got[1::2] == logits.argmax(-1).tolist()[1::2]


@pytest.mark.parametrize("temperature", [0.01, 0.7, 1.0, 5.0, 100.0])
def test_top_k_one_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = random_logits(32, 64, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(32)]
    got = sample(logits, [SamplingParams(temperature=temperature, top_k=1)] * 32, gens)
    assert got == logits.argmax(-1).tolist()


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_keeps_only_the_k_largest(k: int) -> None:
    logits = random_logits(1, 12, 2)[0]
    top = set(torch.topk(logits, k).indices.tolist())
    # A high temperature flattens the kept tokens so every one of them shows up in 2000 draws.
    got = draw(logits, SamplingParams(temperature=20.0, top_k=k), 2000)
    assert set(got) == top


def test_top_k_at_least_the_vocab_keeps_everything() -> None:
    logits = torch.zeros(6)
    assert set(draw(logits, SamplingParams(top_k=6), 1000)) == set(range(6))
    assert set(draw(logits, SamplingParams(top_k=50), 1000)) == set(range(6))


# probabilities 0.45, 0.25, 0.15, 0.10, 0.05 placed at shuffled token ids
TOP_P_PROBS = torch.tensor([0.10, 0.45, 0.05, 0.25, 0.15])


@pytest.mark.parametrize("top_p,kept", [
    (0.3, {1}),  # 0.45 alone reaches 0.3
    (0.45 - 1e-3, {1}),
    (0.6, {1, 3}),  # 0.45 + 0.25 = 0.70
    (0.75, {1, 3, 4}),  # + 0.15 = 0.85
    (0.9, {1, 3, 4, 0}),  # + 0.10 = 0.95
    (0.99, {0, 1, 2, 3, 4}),
    (1.0, {0, 1, 2, 3, 4}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, kept: set) -> None:
    got = draw(TOP_P_PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p), 4000)
    assert set(got) == kept


def test_top_p_renormalises_what_it_keeps() -> None:
    """top_p=0.6 keeps 0.45 and 0.25; they are drawn in the ratio 0.45 : 0.25."""
    got = torch.tensor(draw(TOP_P_PROBS.log(), SamplingParams(top_p=0.6), 20000))
    share = (got == 1).float().mean().item()
    assert abs(share - 0.45 / 0.70) < 0.02


def test_top_k_then_top_p() -> None:
    """top-k applies first: of the 3 kept (0.45, 0.25, 0.15, renormalised to 0.53, 0.29, 0.18),
    top_p=0.75 keeps the first two (0.82)."""
    got = draw(TOP_P_PROBS.log(), SamplingParams(top_k=3, top_p=0.75), 4000)
    assert set(got) == {1, 3}


def test_same_seed_same_tokens() -> None:
    logits = random_logits(1, 50, 3)[0]
    params = SamplingParams(temperature=1.0)
    assert draw(logits, params, 200, seed=42) == draw(logits, params, 200, seed=42)
    assert draw(logits, params, 200, seed=42) != draw(logits, params, 200, seed=43)


# Seeded requests through the engine.

def run(requests: list[tuple[list[int], SamplingParams]], late: int = 0) -> list[list[int]]:
    """Every request's output tokens; the last `late` requests join after three steps."""
    engine = Engine(load_tiny(), EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8))
    first, rest = requests[: len(requests) - late], requests[len(requests) - late:]
    seqs = [engine.add_request(prompt, params) for prompt, params in first]
    for _ in range(3):
        engine.step()
    seqs += [engine.add_request(prompt, params) for prompt, params in rest]
    run_until_done(engine)
    return [s.output_token_ids for s in seqs]


SEEDED = ([5, 17, 301, 44, 9], SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24,
                                               ignore_eos=True))


def test_seeded_request_repeats_and_other_seeds_differ() -> None:
    (first,) = run([SEEDED])
    assert len(first) == 24
    assert run([SEEDED]) == [first]
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    assert run([(SEEDED[0], other)]) != [first]


def test_seeded_request_does_not_depend_on_its_batch() -> None:
    (alone,) = run([SEEDED])
    neighbours = [
        ([7] * 30, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)),  # unseeded
        ([100, 200, 300], SamplingParams(temperature=0.8, seed=1234, max_tokens=40, ignore_eos=True)),
        ([400, 3], SamplingParams(temperature=0, max_tokens=5)),
    ]
    together = run(neighbours[:2] + [SEEDED] + neighbours[2:])
    assert together[2] == alone
    # Joining later, after the others have drawn from their own generators, changes nothing either.
    late = run(neighbours + [SEEDED], late=1)
    assert late[3] == alone


def test_a_top_p_below_fp32s_smallest_number_keeps_the_top_token() -> None:
    """1e-46 rounds to 0 in fp32: the first sorted token must stay, or every logit is -inf."""
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    params = SamplingParams(temperature=1.0, top_p=1e-46, seed=0)
    assert sample(logits, [params], [torch.Generator().manual_seed(0)]) == [1]
