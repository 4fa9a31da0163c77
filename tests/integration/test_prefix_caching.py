"""Token identity with prefix caching on and off, through the real engine: prefixes that end
mid-block, exactly on a block boundary, and a prompt that is cached whole; greedy and
seeded sampling; a second turn that reuses the first turn's prompt and reply."""

import pytest

from pdserve.engine import LLM, SamplingParams

BLOCK = 16
SYSTEM = list(range(1000, 1000 + 3 * BLOCK))  # three full blocks shared by every prompt
PROMPTS = [
    SYSTEM + [5, 6, 7],  # shares 3 blocks, ends mid-block
    SYSTEM,  # exactly on a block boundary: cached whole, its last block recomputed
    SYSTEM + list(range(2000, 2000 + BLOCK)),  # one block past the shared prefix
    SYSTEM[:40] + [9] * 30,  # diverges mid-block
]


KWARGS = dict(max_model_len=512, kv_cache_bytes=64 * 1024 * 1024, block_size=BLOCK)


@pytest.fixture(scope="module")
def uncached_engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), enable_prefix_caching=False, **KWARGS)


@pytest.fixture
def engines(tiny_llama_dir, uncached_engine):
    """A fresh (empty-cache) caching engine for each test, and one without caching."""
    return LLM(str(tiny_llama_dir), enable_prefix_caching=True, **KWARGS), uncached_engine


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_same_tokens_with_and_without_the_cache(engines, params):
    cached, uncached = engines
    reference = [o.token_ids for o in uncached.generate(PROMPTS, params)]
    warm = cached.generate(PROMPTS[:1], params)  # fills the cache with the shared prefix
    outputs = cached.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == reference
    assert warm[0].token_ids == reference[0]
    hits = [o.num_cached_tokens for o in outputs]
    assert hits[0] == 3 * BLOCK and hits[1] == 2 * BLOCK  # the whole-prompt hit leaves its last block
    assert hits[3] == 2 * BLOCK  # diverges inside the third block
    assert all(o.num_cached_tokens == 0 for o in uncached.generate(PROMPTS, params))


def test_second_turn_reuses_the_first_turns_reply(engines):
    cached, uncached = engines
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    turn1 = cached.generate([SYSTEM + [11, 12]], params)[0]
    history = SYSTEM + [11, 12] + turn1.token_ids + [13, 14, 15]
    turn2 = cached.generate([history], params)[0]
    assert turn2.num_cached_tokens == (len(SYSTEM) + 2 + 20 - 1) // BLOCK * BLOCK  # reply included
    assert turn2.token_ids == uncached.generate([history], params)[0].token_ids


def test_every_block_is_returned_after_the_runs(engines):
    cached, _ = engines
    cached.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0))
    manager = cached.engine.block_manager
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks and manager.num_cached_blocks > 0
