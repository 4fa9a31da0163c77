"""Incremental detokenization: deltas add up to the full text, never split a character,
and stop strings cut the text without leaking their prefix."""

import pytest
from transformers import AutoTokenizer

from pdserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer, text, stop=()):
    prompt = tokenizer("Say:").input_ids
    ids = tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, tuple(stop))
    deltas = []
    for t in ids:
        deltas.append(detok.add_token(t))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, detok


def test_deltas_concatenate_to_the_decoded_text(tokenizer):
    text = " Hello, wörld! 你好 🎉🚀 naïve café."
    deltas, detok = stream(tokenizer, text)
    assert "".join(deltas) == detok.text == tokenizer.decode(tokenizer(text).input_ids)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_are_never_split(tokenizer):
    text = "🎉🚀🌍"
    ids = tokenizer(text).input_ids
    assert len(ids) > 3  # byte-level BPE splits these emoji across tokens
    deltas, _ = stream(tokenizer, text)
    for d in deltas:
        d.encode("utf-8")  # complete characters only
        assert "\ufffd" not in d


def test_stop_string_across_tokens_is_cut_and_never_emitted(tokenizer):
    deltas, detok = stream(tokenizer, " one two three four five", stop=["three f"])
    assert detok.stopped
    assert "".join(deltas) == " one two "
    assert all("three" not in d for d in deltas)


def test_earliest_of_several_stops_wins(tokenizer):
    _, detok = stream(tokenizer, " alpha beta gamma", stop=["gamma", "beta"])
    assert detok.text == " alpha "


# ---- the Rust stream (tokenizers' DecodeStream) against straightforward references

class _ReferenceDetokenizer:
    """The Python computation as it stood before the Rust stream (two `tokenizer.decode`
    calls per token), stop strings and hold-back included: the reference for any token ids."""

    def __init__(self, tokenizer, prompt, stop=(), skip_special_tokens=True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt[-5:])
        self.p, self.r = 0, len(self.ids)
        self.stop, self.hold = stop, max((len(s) for s in stop), default=1) - 1
        self.text, self.emitted, self.stopped = "", 0, False

    def add_token(self, token_id):
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.p:self.r], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self.p:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.p, self.r = self.r, len(self.ids)
            start = max(0, len(self.text) - self.hold)
            self.text += full[len(prefix):]
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
        return self.take(self.stopped)

    def take(self, final):
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta


class _PythonOnly:
    """`tokenizer` seen without its backend: the detokenizer's Python computation."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


def _run(detok, ids):
    deltas = []
    for t in ids:
        deltas.append(detok.add_token(t))
        if detok.stopped:
            break
    deltas.append(detok.flush() if hasattr(detok, "flush") else detok.take(True))
    return deltas


def _texts(rng, n):
    """Random texts mixing ASCII words, spaces, punctuation and multi-byte characters."""
    pieces = ["hello", " world", "  ", "\n", ",", ".", " the", "ö", "é", "ñ", "你好", "世界", "日本語", "🎉", "🚀",
              "👩‍👩‍👧", "Ω", "ß", " naïve", " café", "—", "\t", "123", " déjà", "русский", "Ελλάδα", "\u00a0", "a"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40))) for _ in range(n)]


def test_stream_is_in_use_for_the_fast_tokenizer(tokenizer):
    assert IncrementalDetokenizer(tokenizer, [1, 2, 3])._stream is not None
    assert IncrementalDetokenizer(_PythonOnly(tokenizer), [1, 2, 3])._stream is None


def test_stream_matches_the_full_decode_of_valid_text(tokenizer):
    import random

    rng = random.Random(1)
    for text in _texts(rng, 300):
        ids = tokenizer(text).input_ids
        prompt = tokenizer(rng.choice(["Say:", "", "你好", " ", "🎉x"])).input_ids
        deltas = _run(IncrementalDetokenizer(tokenizer, prompt), ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True), text
        assert not any("\ufffd" in d for d in deltas)


def test_stream_matches_the_reference_on_random_token_ids(tokenizer):
    """Any token ids (split characters, stray continuation bytes, special tokens), stop
    strings or none, special tokens skipped or kept: the same deltas, delta by delta."""
    import random

    rng = random.Random(2)
    vocab = len(tokenizer)
    multibyte = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]  # partial characters
    special = list(tokenizer.all_special_ids)
    valid = [tokenizer(t).input_ids for t in _texts(rng, 50)]
    for case in range(400):
        kind = case % 4
        if kind == 0:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        elif kind == 1:
            ids = [rng.choice(multibyte) if rng.random() < 0.6 else rng.randrange(vocab)
                   for _ in range(rng.randrange(1, 60))]
        elif kind == 2:
            ids = [t for seq in rng.sample(valid, 3) for t in seq]
            for _ in range(rng.randrange(0, 4)):
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(special + multibyte))
        else:
            ids = rng.choice(valid)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        stop = tuple(rng.sample(["e", " th", "ö", "你", "🎉", "\n\n", "zz"], rng.randrange(0, 3)))
        skip = rng.random() < 0.7
        want = _run(_ReferenceDetokenizer(tokenizer, prompt, stop, skip), ids)
        got_fast = IncrementalDetokenizer(tokenizer, prompt, stop, skip)
        assert _run(got_fast, ids) == want, (ids, prompt, stop, skip)
        got_python = IncrementalDetokenizer(_PythonOnly(tokenizer), prompt, stop, skip)
        assert _run(got_python, ids) == want, (ids, prompt, stop, skip)
        assert got_fast.text == got_python.text
