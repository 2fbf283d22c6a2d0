"""`TextDeltas`: the streamed text is the whole output's text, cut where the engine found a stop
string, whatever the tokens (bytes split across tokens included) and stop strings."""

from __future__ import annotations

import functools

from conftest import HAS_SMOLLM2
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab import resolve_weights
from nanolab.engine.detokenizer import TextDeltas
from nanolab.model.tokenizer import Tokenizer


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_dir(resolve_weights(name, progress=False))


NAMES = ["tiny", "smollm2-135m"] if HAS_SMOLLM2 else ["tiny"]  # tiny's byte tokens split UTF-8 characters


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(NAMES), data=st.data())
def test_deltas_add_up_to_the_text(name, data):
    tok = tokenizer(name)
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40))
    # Stop strings the output meets (pieces of its text) or may not (any text).
    full = tok.decode(ids)
    piece = st.integers(0, max(len(full) - 1, 0)).flatmap(
        lambda i: st.integers(1, 3).map(lambda n: full[i: i + n])).filter(bool)
    stops = data.draw(st.lists(st.one_of(piece, st.text(min_size=1, max_size=3)) if full else
                               st.text(min_size=1, max_size=3), max_size=2))
    # As the engine does: after each token, the whole output so far is searched for the stop strings.
    deltas = TextDeltas(tok.decode, stops)
    streamed = ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits or n == len(ids):
            streamed += deltas.push(ids[n - 1], True, min(hits) if hits else None)
            break
        streamed += deltas.push(ids[n - 1])
    assert streamed == (text[: min(hits)] if hits else text)
    assert not any(s in streamed for s in stops)  # a stop string is never sent
