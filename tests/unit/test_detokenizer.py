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
