"""Structured output: JSON constrained by a schema, enforced token by token.

The grammar library is llguidance (the Rust engine behind vLLM's and SGLang's `guidance`
backend). It was chosen over xgrammar and outlines-core because it runs the same on CPU and
CUDA with no dependency beyond its own wheel (xgrammar pulls triton and a TVM runtime; an
outlines-core index is built per schema and vocabulary up front, seconds for a large
schema), it computes a token mask in about 2 ms for SmolLM2's 49k vocabulary, and it
supports JSON Schema's bounds (`maxLength`, `minimum`/`maximum`, `enum`, `pattern`).

A `Guide` is a function of the request's own generated tokens: before each sample it is
brought in step with them (`sync`), so a request resumed elsewhere (its earlier tokens at
the end of its prompt), preempted, or sampled first by a prefill worker gets exactly the
mask an unbroken run would. JSON is compact (no free whitespace), so a model cannot pad
forever between tokens.
"""

from __future__ import annotations

import json
from functools import cached_property

import numpy as np

ANY_OBJECT = '{"type": "object"}'  # response_format {"type": "json_object"}
_OPTIONS = {"whitespace_flexible": False}


def schema_error(schema: str) -> str | None:
    """What is wrong with a JSON schema (JSON text), or None if a grammar compiles from it."""
    return _compile(schema)[1]


def _compile(schema: str) -> tuple[str | None, str | None]:
    """(llguidance grammar, None) for a JSON schema (JSON text), or (None, what is wrong)."""
    try:
        parsed = json.loads(schema)
    except (TypeError, ValueError) as e:
        return None, f"not valid JSON: {e}"
    if not isinstance(parsed, dict | bool):
        return None, f"a JSON schema is an object, got {type(parsed).__name__}"
    from llguidance import LLMatcher  # imported only where structured output is used

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_OPTIONS)
        error = LLMatcher.validate_grammar(grammar)
    except BaseException as e:  # any failure to compile is the schema's fault
        if not _is_failure(e):
            raise
        return None, str(e).split("\n")[0] or type(e).__name__
    return (None, error) if error else (grammar, None)


def _is_failure(e: BaseException) -> bool:
    """An Exception, or a panic in the grammar library's Rust code (pyo3's PanicException, a
    BaseException so that `except Exception` misses it; seen on odd schemas while fuzzing)."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


class GuideFactory:
    """Builds per-request guides for one tokenizer and vocabulary (the tokenizer conversion,
    ~0.5 s, happens once, on first use)."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size

    @cached_property
    def _tokenizer(self):
        import llguidance.hf

        if self._hf_tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer")
        return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)

    def new(self, schema: str) -> Guide:
        """A guide for output matching `schema`; ValueError naming what is wrong with it."""
        from llguidance import LLMatcher

        grammar, error = _compile(schema)
        if error:
            raise ValueError(f"json_schema: {error}")
        tokenizer = self._tokenizer

        def new_matcher():
            return LLMatcher(tokenizer, grammar, log_level=0)

        matcher = new_matcher()
        if matcher.is_error():
            raise ValueError(f"json_schema: {matcher.get_error()}")
        return Guide(new_matcher, self.vocab_size, matcher)


class Guide:
    """One request's grammar state, kept equal to the tokens it has generated."""

    def __init__(self, new_matcher, vocab_size: int, matcher=None) -> None:
        """`new_matcher()` makes a fresh matcher (to start again from); `matcher`, if given,
        is one already made."""
        self._new_matcher = new_matcher
        self._matcher = matcher if matcher is not None else new_matcher()
        self._vocab_size = vocab_size
        self._consumed: list[int] = []

    def sync(self, generated: list[int]) -> None:
        """Bring the state to having consumed exactly `generated`."""
        common = 0
        for mine, theirs in zip(self._consumed, generated, strict=False):
            if mine != theirs:
                break
            common += 1
        if common < len(self._consumed):
            # a matcher in its error state stays in it: start again from the common prefix
            if self._matcher.is_error() or not self._matcher.rollback(len(self._consumed) - common):
                self._matcher, self._consumed = self._new_matcher(), []
                common = 0
            del self._consumed[common:]
        for token in generated[common:]:
            self._matcher.consume_token(token)  # a token the grammar refuses puts it in its error state
            self._consumed.append(token)

    def allowed(self, eos_token_ids: frozenset[int]) -> np.ndarray:
        """A bool mask `[vocab]` of the tokens that keep the output valid (numpy: the router
        imports this module, and never torch). Once the output is complete (or the grammar
        is in an error state) only EOS is allowed, which ends it."""
        if not self._matcher.is_error():
            packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
            bits = np.unpackbits(packed, bitorder="little")[: self._vocab_size]
            if bits.any():
                return bits.astype(bool)
        mask = np.zeros(self._vocab_size, dtype=bool)
        mask[[t for t in eos_token_ids if t < self._vocab_size]] = True
        return mask

    @property
    def finished(self) -> bool:
        """The output is complete (or can no longer be continued validly)."""
        return self._matcher.is_stopped() or self._matcher.is_error()
