"""Incremental detokenization with stop strings.

Text is emitted in deltas. A delta never ends inside a multi-byte character (the tokenizer
renders an incomplete byte sequence as U+FFFD; such text is held back until the next token
completes it), and never contains the start of a stop string that might still complete:
the last `len(longest stop) - 1` characters are held back until the request finishes.
"""

from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 5  # decode with a little prompt context so leading spaces render


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # all output text decoded so far (cut at a stop string, if one hit)
        self._emitted = 0  # how much of `text` has been handed out as deltas
        self.stopped = False

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the text that can be emitted now."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        new_text = self._decode_new()
        if new_text:
            start = max(0, len(self.text) - self._hold)
            self.text += new_text
            self._cut_at_stop(start)
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The held-back text, once the request has finished."""
        return self._take(final=True)

    def _decode_new(self) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset],
                        skip_special_tokens=self._skip_special)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing printable yet, or an incomplete UTF-8 sequence
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _cut_at_stop(self, search_from: int) -> None:
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
