"""Incremental detokenization with stop strings.

Text is emitted in deltas. A delta never ends inside a multi-byte character (the tokenizer
renders an incomplete byte sequence as U+FFFD; such text is held back until the next token
completes it), and never contains the start of a stop string that might still complete:
the last `len(longest stop) - 1` characters are held back until the request finishes.

Each token's new text is the decoded text of the tokens since the last emission point, with
a little context before it, minus that context's own decoding (two `decode` calls per token).
With a fast (`tokenizers`) tokenizer whose `decode` is the library's own, the same
computation runs in Rust, one call per token (`tokenizers.decoders.DecodeStream`): where it
emits, its text is exactly this module's; where it holds a token back, the Python
computation is checked (it could emit there only when the new decoding does not extend the
old one), and any disagreement or error hands the request to the Python computation for good.
"""

from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 5  # decode with a little prompt context so leading spaces render


_LIBRARY_DECODE: dict[type, bool] = {}  # tokenizer class -> its decode is the backend's as it is


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` whose `decode` is exactly `tokenizer.decode` (a transformers
    fast tokenizer that neither overrides decoding nor cleans up spaces), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    cls = type(tokenizer)
    library = _LIBRARY_DECODE.get(cls)
    if library is None:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            PreTrainedTokenizerFast = None  # noqa: N806
        library = _LIBRARY_DECODE[cls] = PreTrainedTokenizerFast is not None and issubclass(
            cls, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerFast.decode and \
            cls._decode is PreTrainedTokenizerFast._decode
    if not library or type(backend).__module__.split(".")[0] != "tokenizers":
        return None
    return backend


def _decode_stream(backend, skip_special_tokens: bool, context: list[int]):
    """A `tokenizers` DecodeStream primed with `context`, None if the library has none or if
    the context's text ends in an incomplete character (the stream then takes no context)."""
    if context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        backend = _backend(tokenizer)
        self._decode = tokenizer.decode if backend is None else backend.decode  # the same function
        self._backend = backend
        self._stream = None if backend is None else _decode_stream(backend, skip_special_tokens, self._ids)
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
        new_text = self._decode_new() if self._stream is None else self._stream_new(token_id)
        if not self._stop:  # nothing held back: all the text is out, and so is this
            if new_text:
                self.text += new_text
                self._emitted = len(self.text)
            return new_text
        if new_text:
            start = max(0, len(self.text) - self._hold)
            self.text += new_text
            self._cut_at_stop(start)
        return self._take(final=self.stopped)

    def flush(self) -> str:
        """The held-back text, once the request has finished."""
        return self._take(final=True)

    def _stream_new(self, token_id: int) -> str:
        """`_decode_new`'s text, from the Rust stream (which keeps the same two offsets)."""
        try:
            new_text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - its decoding no longer extends the last: Python's
            self._stream = None
            return self._decode_new()
        if new_text is None:  # held back: so is it by Python's rule, unless the text changed
            new_text = self._decode_new()
            if new_text:
                self._stream = None  # the stream's offsets differ from ours now
            return new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text

    def _decode_new(self) -> str:
        decode = self._decode
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
