"""load_tokenizer (the class tokenizer_config.json names, no auto classes, so no torch in the
router) encodes text and chat templates exactly as AutoTokenizer does on our model families.
transformers may pick a model-specific class (Qwen2Tokenizer) where the config names the
generic one; what must agree is the token ids, and this checks them."""

import pytest
from transformers import AutoTokenizer

from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

TEXTS = ["Hello world, ok?", "  leading spaces\nand a newline", "naïve café — 東京 🚀", "<|im_start|>user"]


@pytest.mark.parametrize("model", ["smollm2_dir", "tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_own_tokenizer_dir"])
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


def test_a_tiny_model_with_its_own_tokenizer_generates_text_and_chats(tiny_llama_own_tokenizer_dir):
    """The tiny model with testkit's byte-level tokenizer (nothing of SmolLM2's: what the GPU
    tests run) loads through the real loader: its tokenizer covers the model's vocabulary
    and names its bos/eos, and the engine generates text from a text prompt and from a chat
    whose prompt is the ChatML template's tokens."""
    import json

    from pdserve.engine import LLM, SamplingParams
    from pdserve.testkit.models import SPECIAL_TOKENS

    model_dir = tiny_llama_own_tokenizer_dir
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    assert [t["content"] for t in added] == list(SPECIAL_TOKENS)  # ours, not SmolLM2's
    config = json.loads((model_dir / "config.json").read_text())
    llm = LLM(str(model_dir), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    assert len(tokenizer) == config["vocab_size"] == llm.engine.loaded.shape.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    assert None not in tokenizer.convert_ids_to_tokens(list(range(config["vocab_size"])))  # every id decodes
    for text in TEXTS:
        assert tokenizer.decode(tokenizer(text).input_ids) == text

    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    [out] = llm.generate(["Hello world"], free)
    assert out.prompt_token_ids == tokenizer("Hello world").input_ids and len(out.token_ids) == 8
    # constrained to JSON text, a random model's output is known text: the vocabulary's
    # strings reach the grammar and the detokenizer intact
    answer = SamplingParams(max_tokens=16, temperature=0, json_schema=json.dumps({"enum": ["yes", "no"]}))
    [out] = llm.generate(["Hello world"], answer)
    assert json.loads(out.text) in ("yes", "no") and out.outputs[0].finish_reason == "stop", out.text
    [chat] = llm.chat([{"role": "user", "content": "Hi!"}], answer)
    want = tokenizer("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n").input_ids
    assert chat.prompt_token_ids == want and want[0] == tokenizer.bos_token_id
    assert json.loads(chat.text) in ("yes", "no"), chat.text
