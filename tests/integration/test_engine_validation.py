"""Bad input gets a ValueError naming the field and the allowed range, and changes nothing."""

import json

import pytest

from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.model_source import resolve_model


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1"),
        ({"max_tokens": 1.5}, r"max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, r"temperature must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"seed": -1}, r"seed must be"),
        ({"stop": [""]}, r"stop must be non-empty strings"),
        ({"stop_token_ids": [-3]}, r"stop_token_ids must be"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", r"prompt must not be empty"),
        ([], r"prompts must be a non-empty"),
        ([[]], r"prompt must not be empty"),
        ([[1, 2, 49152]], r"token ids must be integers in \[0, 49152\); got \[49152\]"),
        ([[1, -1]], r"token ids must be integers in \[0, 49152\)"),
        ([list(range(3, 67))], r"prompt has 64 tokens but max_model_len is 64"),
        (3.5, r"prompts must be"),
    ],
)
def test_bad_prompts_are_rejected_and_leave_nothing_queued(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=2))
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_one_bad_prompt_in_a_batch_queues_none(llm):
    with pytest.raises(ValueError):
        llm.generate([[5, 6, 7], [1, 49999]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_stop_token_ids_outside_vocab(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 49152\)"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[60000]))


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64 - 57


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, r"block_size must be an integer in \[1, 1024\]"),
        ({"max_num_seqs": 0}, r"max_num_seqs must be"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"device": "tpu"}, r"device must be"),
        ({"dtype": "int8"}, r"dtype must be one of"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_unknown_engine_argument():
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['max_batch'\]"):
        EngineConfig.from_kwargs(max_batch=3)


def test_kv_cache_too_small_fails_at_startup(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"KV cache too small.*max_model_len=512"):
        LLM(str(tiny_llama_dir), max_model_len=512, kv_cache_bytes=4096)


def test_max_model_len_above_the_model_limit(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"exceeds the model's limit of 1024"):
        LLM(str(tiny_llama_dir), max_model_len=4096)


def test_unknown_model_names_what_was_tried():
    with pytest.raises(ValueError) as info:
        resolve_model("no-such-org/no-such-model")
    message = str(info.value)
    assert "no-such-org/no-such-model" in message
    assert "local path" in message and "Hugging Face cache" in message
    assert "LlamaForCausalLM" in message and "Qwen2ForCausalLM" in message


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match=r"unsupported model architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_chat_applies_the_template(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0))[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False)
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError, match=r"messages\[0\] must have string 'role' and 'content'"):
        llm.chat([{"role": "user"}])
