"""The OpenAI wire format: request bodies checked field by field, and the response objects.

Added with the server. A request body becomes a `CompletionRequest` or an `APIError` that names
the offending field in `param`. Nothing a client sends reaches the engine unchecked, so bad input
is a 400 and never a 500. Field names, defaults and shapes follow OpenAI's API and vLLM's server.
`top_k` and `ignore_eos` are vLLM's extensions.
"""

from __future__ import annotations

import codecs
import json
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nanolab.sampling import MAX_LOGPROBS, MAX_N, PositionLogprobs, SamplingParams


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    """One checked request. `prompts` holds the completion prompts (each a str or token ids, whose
    ids `AsyncLLM.add_requests` checks); a chat request holds `messages` instead. `params.n`
    samples a prompt; `params.logprobs` is the top log-probabilities a token (completions'
    `logprobs`, chat's `top_logprobs` under `logprobs: true`); `echo` puts the prompt before a
    completion's text, and its logprobs (`params.prompt_logprobs`) before the completion's.
    `echo_only` (completions' `max_tokens: 0` with `echo`) answers with the prompt alone, text and
    scores: the engine still samples the one token `params.max_tokens` asks (a prompt's scores come
    from a step that samples), and the response leaves it out, as vLLM's does.
    `max_tokens_field` names the field that set `params.max_tokens`, for errors about it."""

    chat: bool
    params: SamplingParams
    stream: bool
    include_usage: bool
    prompts: list[str | list[int]] | None = None
    messages: list[dict] | None = None
    echo: bool = False
    echo_only: bool = False
    max_tokens_field: str = "max_tokens"


# The fields this server implements, by route.
_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "stream",
           "stream_options", "n", "best_of", "logprobs"}
COMPLETION_FIELDS = _FIELDS | {"prompt", "echo"}
CHAT_FIELDS = _FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


def _zero_biases(value) -> bool:
    """A `logit_bias` that moves no token: each key a token id as a string, each bias 0."""
    return isinstance(value, dict) and all(isinstance(k, str) and k.isdecimal() and _is_number(b) and b == 0
                                           for k, b in value.items())


# Fields the server does not implement (OpenAI's, and vLLM's extra sampling fields), with the values
# at which they change nothing (a value, or a test a value passes): accepted at those, a 400 naming
# the field at any other, never ignored. `top_logprobs` and `echo` are implemented on one route each
# (chat's, completions').
NOOP_VALUES = {
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, _zero_biases),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "length_penalty": (None, 1),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
}
# Fields that never change what a request generates: accepted with any value.
INERT_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


def _is_noop(value, allowed: tuple) -> bool:
    """Whether `value` is one of `allowed`, or passes one that is a test: numbers by value (1 and
    1.0 alike, never a bool), the rest by value and type."""
    for a in allowed:
        if value is None or a is None:
            if value is a:
                return True
        elif callable(a):
            if a(value):
                return True
        elif _is_number(a):
            if _is_number(value) and value == a:
                return True
        elif type(value) is type(a) and value == a:
            return True
    return False


MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


def _text(v) -> bool:
    """A str that encodes to UTF-8: JSON's grammar carries lone surrogates such as "\\ud800", which no
    tokenizer takes. The server's parser already refuses them; a dict built in Python may hold one."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, name: str, ok, what: str, default=None, within: str | None = None):
    """body[name] when present and not null, checked by `ok`; a 400 naming the field otherwise
    (`within.name` for a field of the object `within`)."""
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        param = f"{within}.{name}" if within else name
        raise APIError(400, f"'{param}' must be {what}, got {value!r}", param=param)
    return value


def _prompts(value) -> list[str | list[int]]:
    """OpenAI's prompt shapes: a string, a list of strings, a list of token ids, or a list of those.
    A token-id list is told by its first item. Its ids are checked once, by type and range, where
    the vocabulary is known (`AsyncLLM.add_requests`, a 400 naming the prompt): a prompt is
    thousands of ids, and every request is checked on the server's event loop."""
    if _text(value):
        return [value]
    if isinstance(value, list) and value:
        if _is_int(value[0]):
            return [list(value)]
        if all(_text(p) for p in value):
            return list(value)
        if all(isinstance(p, list) and p and _is_int(p[0]) for p in value):
            return [list(p) for p in value]
    raise APIError(400, "'prompt' must be a string (valid Unicode), a list of strings, a list of token ids, or a "
                        "list of token-id lists, and not empty", param="prompt")


def parse_request(body, *, chat: bool, model: str) -> CompletionRequest:
    """Check a decoded JSON body for `/v1/completions` (chat=False) or `/v1/chat/completions`."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    name = body.get("model")
    if name is not None and name != model:
        if not isinstance(name, str):
            raise APIError(400, f"'model' must be a string, got {name!r}", param="model")
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{model}'", param="model",
                       code="model_not_found")
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for field, value in body.items():
        if field in known or field in INERT_FIELDS:
            continue
        if field not in NOOP_VALUES:
            raise APIError(400, f"'{field}' is not a field this server implements; it is refused rather than "
                                "ignored", param=field)
        if not _is_noop(value, NOOP_VALUES[field]):
            raise APIError(400, f"'{field}'={value!r:.80} is not supported by this server", param=field)

    stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
        unknown = set(options) - {"include_usage"}
        if unknown:
            raise APIError(400, f"'stream_options' has unknown keys {sorted(unknown)}", param="stream_options")
        include_usage = _field(options, "include_usage", lambda v: isinstance(v, bool), "a boolean", False,
                               within="stream_options")

    echo = False if chat else _field(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    if echo:  # 0: the prompt scored, nothing generated (lm-eval's loglikelihood requests may send it)
        max_tokens = _field(body, "max_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    else:
        max_tokens = _field(body, "max_tokens", lambda v: _is_int(v) and v >= 1,
                            "an integer >= 1" + ("" if chat else " (0 only with 'echo': true)"))
    echo_only = max_tokens == 0
    if echo_only:
        max_tokens = 1
    if chat:
        completion = _field(body, "max_completion_tokens", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        if completion is not None and max_tokens is not None and completion != max_tokens:
            # Neither is dropped silently: which one a client meant is not ours to guess.
            raise APIError(400, f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({completion}) disagree; "
                           "send one", param="max_completion_tokens")
        max_tokens = completion if completion is not None else max_tokens
    elif max_tokens is None and "max_tokens" not in body:
        max_tokens = 16  # OpenAI's completions default; chat runs to EOS or the context
    stop = _field(body, "stop", lambda v: isinstance(v, str) and v or isinstance(v, list) and all(
        isinstance(s, str) and s for s in v), "a non-empty string or a list of them")
    # The engine searches the output for every stop string at every step: a bounded list keeps that
    # cheap (OpenAI allows 4).
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS or any(
            len(s) > MAX_STOP_LENGTH for s in ([stop] if isinstance(stop, str) else stop or [])):
        raise APIError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} "
                            "characters", param="stop")
    n = _field(body, "n", lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an integer in [1, {MAX_N}]", 1)
    best_of = _field(body, "best_of", _is_int, "an integer")
    if best_of is not None and best_of != n:
        raise APIError(400, f"'best_of'={best_of} must equal 'n' ({n}): every sample is returned, none ranked",
                       param="best_of")
    if chat:
        wanted = _field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = _field(body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                     f"an integer in [0, {MAX_LOGPROBS}]", 0)
        if top and not wanted:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = top if wanted else None
    else:
        logprobs = _field(body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS,
                          f"an integer in [0, {MAX_LOGPROBS}]")
    try:
        params = SamplingParams(
            temperature=_field(body, "temperature", _is_number, "a number", 1.0),
            top_p=_field(body, "top_p", _is_number, "a number", 1.0),
            top_k=_field(body, "top_k", _is_int, "an integer", 0),
            seed=_field(body, "seed", _is_int, "an integer"),
            max_tokens=max_tokens, stop=stop or None,
            ignore_eos=_field(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
            n=n, logprobs=logprobs, prompt_logprobs=logprobs if echo else None)
    except ValueError as e:
        # "SamplingParams.top_p=2: must be in (0, 1]" -> param "top_p"
        match = re.match(r"SamplingParams\.(\w+)=", str(e))
        raise APIError(400, str(e).replace("SamplingParams.", ""), param=match and match.group(1)) from None

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {'role', 'content'} objects",
                           param="messages")
        # Each message's fields, its text's Unicode included, are checked as it is rendered
        # (`tokenizer.normalize_messages`).
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        return CompletionRequest(True, params, stream, include_usage, messages=messages, max_tokens_field=field)
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    return CompletionRequest(False, params, stream, include_usage, prompts=_prompts(body["prompt"]), echo=echo,
                             echo_only=echo_only)


# Response objects.


def request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_string(data: bytes) -> str:
    """A token's name in a logprobs object: its bytes as text, or, where they are not whole UTF-8
    characters (a token that ends inside one), "bytes:" and their escapes, as OpenAI's logprobs
    name such tokens ("bytes:\\xe6\\x97"). Distinct tokens get distinct names."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters (`text_offset`), from
    `start`: the characters its tokens' bytes have completed so far, decoded as the text is (bytes
    that are no character become U+FFFD). A character split across tokens is counted once, whole,
    so a token that ends inside a character starts where that character does, and so does the
    token that completes it."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, data: bytes) -> int:
        """The offset of the token whose bytes are `data` (b"" for one the text leaves out)."""
        at = self.chars
        pending = self._decoder.getstate()[0]
        if pending and data:
            try:  # does the token go on with the character the bytes before it began?
                codecs.utf_8_decode(pending + data[:1], "strict", False)
            except UnicodeDecodeError:  # no: those bytes come out as U+FFFD before the token's text
                at += len(pending.decode("utf-8", errors="replace"))
        self.chars += len(self._decoder.decode(data))
        return at


def completion_logprobs(token_ids: list[int], entries: list[PositionLogprobs | None],
                        token_bytes: Callable[[int], bytes], hidden: Sequence[bool],
                        offsets: TextOffsets) -> dict:
    """Completions' (legacy) logprobs object: per token its name (`token_string`), its
    log-probability, its top alternatives as {name: logprob}, most likely first, with the token
    itself among them (vLLM's), and where its text starts (`offsets`, advanced past it; a token
    `hidden` marks, as a special token decoding skips, is not in the text). An entry None (a
    prompt's first token) is scored null."""
    tokens = [token_string(token_bytes(t)) for t in token_ids]
    top = []
    for token, entry in zip(tokens, entries):
        if entry is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for i, lp in entry[1]:
            alternatives.setdefault(token_string(token_bytes(i)), lp)
        alternatives.setdefault(token, entry[0])
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e[0] for e in entries], "top_logprobs": top,
            "text_offset": [offsets.advance(b"" if h else token_bytes(t)) for t, h in zip(token_ids, hidden,
                                                                                          strict=True)]}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], token_bytes: Callable[[int], bytes]
                  ) -> dict:
    """Chat's logprobs object: per token its name (`token_string`), log-probability, bytes and top
    alternatives."""
    def item(token_id: int, logprob: float) -> dict:
        data = token_bytes(token_id)
        return {"token": token_string(data), "logprob": logprob, "bytes": list(data)}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                        for t, (lp, top) in zip(token_ids, entries)]}


def completion(rid: str, model: str, chat: bool, choices: list[tuple[str, str | None, dict | None]], use: dict
               ) -> dict:
    """A whole (non-streamed) response; `choices` are (text, finish_reason, logprobs) in order."""
    if chat:
        body = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": reason} for i, (text, reason, logprobs) in enumerate(choices)]
    else:
        body = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
                for i, (text, reason, logprobs) in enumerate(choices)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": body, "usage": use}


class ChunkEncoder:
    """A stream's chunks as SSE events, one choice's new text each; the first chat chunk also
    carries the role. With `include_usage` each carries `"usage": null`, as OpenAI's do before the
    last chunk's usage. The fields fixed for the request are serialized once: a chunk goes out per
    token per request, on the same interpreter as the engine loop."""

    def __init__(self, rid: str, model: str, chat: bool, created: int, include_usage: bool = False) -> None:
        self.chat = chat
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": model, **({"usage": None} if include_usage else {})}
        self._head = "data: " + json.dumps(head, separators=(",", ":"))[:-1] + ',"choices":[{"index":'

    def encode(self, index: int, text: str, finish_reason: str | None, role: bool = False,
               logprobs: dict | None = None) -> bytes:
        if self.chat:
            body = (',"delta":{"role":"assistant","content":' if role else ',"delta":{"content":') \
                + json.dumps(text) + "}"
        else:
            body = ',"text":' + json.dumps(text)
        lp = "null" if logprobs is None else json.dumps(logprobs, separators=(",", ":"))
        return (self._head + str(index) + body + ',"logprobs":' + lp + ',"finish_reason":' + json.dumps(finish_reason)
                + "}]}\n\n").encode()


def usage_chunk(rid: str, model: str, chat: bool, created: int, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
