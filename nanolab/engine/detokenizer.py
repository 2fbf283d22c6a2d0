"""`TextDeltas`: one request's output as text deltas while it streams, the stop strings respected.

Added with the server. A streamed token is turned into the text it completes. Two things delay that text.
- A token that ends inside a multi-byte character decodes to U+FFFD. Its text waits for the
  token that completes the character.
- Text that could still become the start of a stop string is held back until it cannot. A matched
  stop string is never sent.

Decoding works on a window of the last few tokens, as vLLM does (a prefix offset and a read
offset). A step therefore costs the same at any output length; decoding the whole output every
step would cost O(n^2) over a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextDeltas:
    def __init__(self, decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str] = ()) -> None:
        self.decode = decode  # token ids -> text, e.g. Tokenizer.decode (special tokens skipped)
        # A suffix of this many characters may be the start of a stop string.
        self.holdback = max((len(s) - 1 for s in stop_strings), default=0)
        self.ids: list[int] = []
        self.text = ""  # every character decoded so far, held back or not
        self.emitted = 0  # characters of `text` already returned
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` that the window re-decodes
        self._read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.decode(ids)

    def push(self, token_id: int | None, finished: bool = False, stop_text_index: int | None = None) -> str:
        """Add one token (None: none, as when a request is aborted); return the text that may be
        sent now (possibly ""). When the request has `finished`, that is the rest of its text, cut
        at `stop_text_index` (an index into the decode of the whole output, as the engine computed
        it) when a stop string matched."""
        if token_id is not None:
            self.ids.append(token_id)
            before = self._decode(self.ids[self._prefix: self._read])
            after = self._decode(self.ids[self._prefix:])
            # A trailing U+FFFD is an incomplete character: wait for the token that completes it.
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self._prefix, self._read = self._read, len(self.ids)
        if not finished:
            return self._emit(len(self.text) - self.holdback)
        full = self._decode(self.ids)
        if full.startswith(self.text):
            self.text = full
        return self._emit(len(self.text) if stop_text_index is None else stop_text_index)

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted: end]
        self.emitted = end
        return delta
