"""load_tokenizer (the class tokenizer_config.json names, no auto classes, so no torch in the
router) encodes text and chat templates exactly as AutoTokenizer does on our model families.
transformers may pick a model-specific class (Qwen2Tokenizer) where the config names the
generic one; what must agree is the token ids, and this checks them."""

import pytest
from transformers import AutoTokenizer

from engine.tokenizer import apply_chat_template, load_tokenizer

TEXTS = ["Hello world, ok?", "  leading spaces\nand a newline", "naïve café — 東京 🚀", "<|im_start|>user"]


@pytest.mark.parametrize("model", ["smollm2_dir", "tiny_llama_dir", "tiny_qwen2_dir"])
def test_same_tokens_as_autotokenizer(model, request):
    model_dir = request.getfixturevalue(model)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        assert ours(text).input_ids == auto(text).input_ids, text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert apply_chat_template(ours, messages) == list(expected)


def test_a_directory_without_tokenizer_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None
