"""Text in and out: a `Tokenizer` over a Hugging Face `tokenizer.json`, chat templates, streaming
detokenization, and the small byte-level tokenizer that synthesized models ship with.

Only the `tokenizers` library and jinja2 are used, not transformers, so the engine does not need
transformers at run time.

"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache, lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

# ChatML, with ids 0..2 reserved for these strings by `build_byte_tokenizer` (SmolLM2 uses the same three).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the byte-level tokenizer. Any fixed text works: it only decides which merges
# exist, and a synthesized model's output is random anyway.
_TRAINING_TEXT = """\
The engine reads a prompt, turns it into tokens, and runs the model over all of them at once. \
That first pass is called prefill. After it, the engine produces one token at a time: each step \
reads every weight of the model once and appends one key and one value per layer to the cache. \
This is decode, and on a modern accelerator it is limited by how fast memory can be read, not by \
how fast numbers can be multiplied.

A batch of requests shares that weight traffic. Ten sequences decoded together cost little more \
than one, so a server gathers whatever requests are ready into each step. The cache grows with \
every token, and it is stored in fixed blocks so that memory can be handed out and taken back \
without copying. The scheduler decides which requests run, which wait, and which are preempted \
when the blocks run out. Questions, answers, numbers like 42 and 3.14, and names such as Paris, \
London or Tokyo appear in the text a user types; the tokenizer must cope with all of them.
"""


def build_byte_tokenizer(vocab_size: int) -> HFTokenizer:
    """A deterministic byte-level BPE trained on a fixed paragraph: 256 byte tokens, the three
    `SPECIAL_TOKENS` at ids 0..2, and merges until `vocab_size` or until the text runs out of pairs.
    Any string round-trips, because every byte has a token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 bytes and {len(SPECIAL_TOKENS)} specials")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    return tok


def write_byte_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """Write `build_byte_tokenizer(vocab_size)` as `tokenizer.json`, `tokenizer_config.json` and a
    ChatML `chat_template.jinja`: the files a Hugging Face model folder holds, so transformers'
    `AutoTokenizer` reads the folder too."""
    out_dir = Path(out_dir)
    build_byte_tokenizer(vocab_size).save(str(out_dir / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[2], "model_max_length": model_max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHATML_TEMPLATE)


CHAT_ROLES = ("system", "user", "assistant")


MESSAGE_KEYS = ("role", "content", "name")


def message_text(content, where: str) -> str:
    """A message's `content` as the text the template renders: a str as it is, or a list of text
    parts (`{"type": "text", "text": str}`, as OpenAI's newer clients send) joined with newlines,
    as vLLM joins them. `where` ("messages[i].content") starts every error. Text that is not valid
    Unicode (JSON carries lone surrogates such as "\\ud800"; no tokenizer takes them) is refused."""
    if isinstance(content, str):
        return _unicode(content, where)
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a str or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise ValueError(f"{where}[{j}]: must be a {{'type': 'text', 'text': ...}} part, got {part!r:.80}")
        if part["type"] != "text":
            raise ValueError(f"{where}[{j}].type: {part['type']!r:.40} is not supported (text parts only)")
        unknown = set(part) - {"type", "text"}
        if unknown:
            raise ValueError(f"{where}[{j}].{sorted(unknown)[0]}: not supported (a text part has 'type' and 'text')")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text: must be a str, got {type(part.get('text')).__name__}")
        texts.append(_unicode(part["text"], f"{where}[{j}].text"))
    return "\n".join(texts)


def _unicode(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: not valid Unicode (a lone surrogate)") from None
    return text


def normalize_messages(messages) -> list[dict]:
    """Raise ValueError naming the message and field unless `messages` is a conversation: a non-empty
    list of dicts, each with a `role` (one of `CHAT_ROLES`), a `content` (a str, or a list of text
    parts: `message_text`) and optionally a str `name`; else the conversation with every content
    as one str, as the chat template reads it.

    Errors read `messages[i].role: ...`, `messages[i].content: ...`, `messages[i].<key>: not supported`,
    or `messages[i]: must be a dict ...`, so an API can hand them to the caller as they are."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages: must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in message:
            if key not in MESSAGE_KEYS:
                raise ValueError(f"messages[{i}].{key}: not supported (a message has 'role', 'content' and "
                                 "optionally 'name')")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"messages[{i}].{key}: missing")
        role = message["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {', '.join(map(repr, CHAT_ROLES))}, got {role!r:.80}")
        if message.get("name") is not None and not isinstance(message["name"], str):
            raise ValueError(f"messages[{i}].name: must be a str, got {type(message['name']).__name__}")
        kept = {k: v for k, v in message.items() if k != "name" or v is not None}  # a null name is no name
        out.append({**kept, "content": message_text(message["content"], f"messages[{i}].content")})
    return out


def validate_messages(messages) -> None:
    """`normalize_messages`' checks alone."""
    normalize_messages(messages)


def _token_string(value: str | dict | None) -> str | None:
    # tokenizer_config.json stores a special token as a string, or as a serialized AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


# Pre-tokenizers that split each piece of text by its own content alone (no "first piece" rule,
# as Metaspace's prepend_scheme has): with them, a piece encodes to the same ids wherever it sits.
_LOCAL_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split"})

# Distinct text pieces whose ids `Tokenizer.encode_chat` keeps: a few system prompts and their turns.
PIECE_CACHE_SIZE = 256


def _piece_pattern(tok: HFTokenizer) -> re.Pattern | None:
    """The pattern that cuts text at `tok`'s added tokens where `tok.encode` itself cuts it first,
    leftmost-longest; or None where the ids of the pieces between them would depend on what is
    around them: a normalizer, a position-aware or unknown pre-tokenizer, BPE dropout, an added
    token that strips spaces or matches whole words only, or special tokens encoded as text."""
    model = tok.model
    if (tok.normalizer is not None or tok.pre_tokenizer is None or not isinstance(model, models.BPE)
            or model.dropout is not None or tok.encode_special_tokens):
        return None
    kinds = _kinds(tok.pre_tokenizer, "pretokenizers")
    added = list(tok.get_added_tokens_decoder().values())
    if (not added or not set(kinds) <= _LOCAL_PRE_TOKENIZERS
            or any(a.lstrip or a.rstrip or a.single_word for a in added)
            or len({a.normalized for a in added}) > 1):  # `tokenizers` matches the two kinds in two passes
        return None
    contents = sorted({a.content for a in added}, key=len, reverse=True)  # the first alternative that matches wins
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


@cache
def _byte_level_bytes() -> dict[str, int]:
    """Byte-level BPE's alphabet, back to bytes: each of the 256 bytes is spelled by one printable
    character (GPT-2's table), the printable Latin-1 bytes by themselves and the other 68, in byte
    order, by the characters from U+0100 up."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
           *range(ord("\u00ae"), ord("\u00ff") + 1)]
    spelled = {chr(b): b for b in own}
    rest = sorted(set(range(256)) - set(own))
    spelled.update({chr(256 + i): b for i, b in enumerate(rest)})
    return spelled


def _kinds(component, members: str) -> list[str]:
    """The types of a tokenizer component (a pre-tokenizer or a decoder), a Sequence's members
    (under `members`) each; [] for none."""
    if component is None:
        return []
    state = json.loads(component.__getstate__())
    return [m["type"] for m in state[members]] if state["type"] == "Sequence" else [state["type"]]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@cache
def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in, so the prompts match token for token.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """A model folder's tokenizer: `tokenizer.json` plus the chat template and special tokens."""

    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Chat text is encoded piece by piece between added tokens, a repeated piece (a shared system
        # prompt) from this cache; None where that would change the ids (`_piece_pattern`).
        self._pieces = _piece_pattern(tok)
        self._encode_piece = lru_cache(maxsize=PIECE_CACHE_SIZE)(self._encode_plain)
        added = tok.get_added_tokens_decoder()
        self._added = frozenset(added)
        self._special = frozenset(i for i, a in added.items() if a.special)
        self._byte_level = "ByteLevel" in _kinds(tok.decoder, "decoders")

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok_config_file = path / "tokenizer_config.json"
        tok_config = json.loads(tok_config_file.read_text()) if tok_config_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else tok_config.get("chat_template")
        return cls(
            HFTokenizer.from_file(str(path / "tokenizer.json")), template,
            _token_string(tok_config.get("bos_token")), _token_string(tok_config.get("eos_token")),
        )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str):
        """`encode`'s tokens with where each came from in `text` (`tokenizers.Encoding`: `ids`, and
        `offsets` as (start, end) characters; an added token, as BOS, spans nothing)."""
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (a synthesized model's vocab can be larger) decode to nothing.
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation rendered by the model's chat template, each content as one str
        (`normalize_messages`). Raises ValueError for messages `normalize_messages` refuses, and
        for a template that refuses them (`raise_exception`)."""
        messages = normalize_messages(messages)
        if self.chat_template is None:
            raise ValueError("no chat template: no chat_template.jinja, none in tokenizer_config.json")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from e

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special added token, which `decode` leaves out by default."""
        return token_id in self._special

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which a token that ends inside a character does not
        spell as text: with a byte-level BPE (GPT-2's, SmolLM2's and Llama 3's) its vocabulary
        string read back through the byte alphabet; an added token's content as UTF-8; otherwise
        the token decoded alone. An id past the vocabulary is b""."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        table = _byte_level_bytes()
        if self._byte_level and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def _encode_plain(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """`apply_chat_template`'s text as token ids (that validates the messages): the ids
        `encode(text, add_special_tokens=False)` gives. Where the tokenizer allows (`_piece_pattern`),
        the text is cut at its added tokens and each piece between them encoded once and kept
        (`PIECE_CACHE_SIZE` pieces, least recently used dropped), so a conversation that repeats a
        long system prompt pays only for its new turns."""
        # The template already spells out BOS where the model wants it, so add no specials again.
        text = self.apply_chat_template(messages, add_generation_prompt)
        if self._pieces is None:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        # re.split with a group: [text, token, text, token, ..., text]; odd items are added tokens.
        for i, piece in enumerate(self._pieces.split(text)):
            if i % 2:
                ids.append(self._tok.token_to_id(piece))
            elif piece:
                ids.extend(self._encode_piece(piece))
        return ids
