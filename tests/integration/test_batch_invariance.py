"""A request's tokens do not depend on what else is in its batch, on chunking, or on
preemption: run alone vs among 32 mixed requests with a tiny token budget and a KV cache
small enough to force preemption. Within each dtype: fp32 and bf16 (whose coarse rounding
turns any difference in summation order into flipped tokens)."""

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.loader import kv_block_bytes

NUM_REQUESTS = 32
BLOCK_SIZE = 8


def mixed_requests(seed: int, sampled: bool):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(NUM_REQUESTS):
        prompts.append([rng.randrange(3, 49152) for _ in range(rng.randint(2, 120))])
        if sampled:
            params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.9,
                                         top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 50]),
                                         seed=1000 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=rng.randint(4, 40), temperature=0,
                                         ignore_eos=True))
    return prompts, params


def run_alone(llm, prompts, params):
    return [llm.generate([p], [sp])[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def squeezed_llm(model_dir, num_blocks: int, max_model_len: int = 256, **args):
    """An engine whose KV cache holds exactly `num_blocks` blocks."""
    probe = LLM(str(model_dir), max_model_len=max_model_len, block_size=BLOCK_SIZE, dtype=args.get("dtype", "auto"))
    loaded = probe.engine.loaded
    per_block = kv_block_bytes(loaded.shape, BLOCK_SIZE, loaded.model.dtype)
    return LLM(str(model_dir), max_model_len=max_model_len, block_size=BLOCK_SIZE,
               kv_cache_bytes=num_blocks * per_block, **args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_alone_equals_batched_with_chunking_and_preemption(request, fixture, sampled, dtype):
    model_dir = request.getfixturevalue(fixture)
    prompts, params = mixed_requests(7, sampled)
    alone = run_alone(LLM(str(model_dir), max_model_len=256, dtype=dtype), prompts, params)

    # 48 blocks of 8 tokens hold ~3 of these requests at once; budget 16 tokens per step
    llm = squeezed_llm(model_dir, num_blocks=48, max_num_batched_tokens=16, dtype=dtype)
    assert llm.engine.loaded.model.dtype == getattr(torch, dtype)
    batched = [o.token_ids for o in llm.generate(prompts, params)]

    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the test must force preemption"
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert a == b, f"request {i}: alone {a} != batched {b}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.block_manager.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_batch_invariance(smollm2_dir, dtype):
    texts = ["The capital of France is", "Write a poem about autumn leaves.",
             "1, 2, 3, 4,", "Tell me a joke about computers and programmers.",
             "What is the boiling point of water?", "Name a famous painter:",
             "The quick brown fox", "In the year 2050, cities will"]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(texts))]
    params = [greedy] * len(texts) + seeded
    prompts = texts + texts
    alone = run_alone(LLM(str(smollm2_dir), max_model_len=128, dtype=dtype), prompts, params)
    llm = squeezed_llm(smollm2_dir, num_blocks=16, max_model_len=128, max_num_batched_tokens=16, dtype=dtype)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert alone == batched
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
