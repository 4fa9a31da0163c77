"""Greedy token ids from our engine in fp32 equal Hugging Face `generate(do_sample=False)` in
fp32 (bf16 has its own gate: test_bf16_quality.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.engine import LLM, SamplingParams

TOKEN_PROMPT_LENGTHS = [1, 3, 7, 16, 17, 33, 64, 150]
TEXT_PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "Explain in one sentence why the sky is blue, and then explain why sunsets are red "
    "and orange instead of blue, using the idea of scattering.",
    "Translate to French: I would like a cup of coffee and a croissant, please. "
    "Then translate to German: where is the train station? " * 3,
]


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.pad_token_id)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def token_prompts(vocab_size: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in TOKEN_PROMPT_LENGTHS]


def assert_matches_hf(model_dir, prompts, max_new_tokens, **engine_args):
    expected = hf_greedy(model_dir, prompts, max_new_tokens)
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): engine {g} != HF {e}"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen2_dir"])
def test_tiny_models_match_hf(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    # small blocks and a small token budget: block boundaries and chunked prefill are crossed
    assert_matches_hf(model_dir, token_prompts(), 24, block_size=4, max_num_batched_tokens=48)


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer(p).input_ids for p in TEXT_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # varied lengths
    assert_matches_hf(smollm2_dir, prompts, 20, max_num_batched_tokens=64)
