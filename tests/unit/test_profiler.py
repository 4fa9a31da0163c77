"""The profiler times real work: every prompt it times is new to the engine, so a prefix-cache
hit cannot pass for a prefill (it did, once prefix caching landed: a 2048-token prefill was
profiled at 105 ms instead of 4.2 s)."""

import pytest

from pdserve.cluster.planner import profiler
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=256))


def test_timed_prefills_compute_every_prompt_token(engine):
    before = engine.num_prefill_tokens_computed
    profiler.time_prefill_step(engine, [64] * 4, repeats=2)
    assert engine.num_prefill_tokens_computed - before == 3 * 4 * 64  # warm-up round + 2 timed rounds
    assert engine.scheduler.num_cache_hit_tokens == 0


def test_a_mixed_step_carries_the_prompt_beside_every_running_decode(engine):
    before = engine.num_prefill_tokens_computed
    shape, seconds = profiler._mixed_step(engine, batch=16, context=32, tokens=128, repeats=2)
    assert (shape.prefill_tokens, shape.prefill_squared, shape.decode_batch, shape.prefill_cached) == (
        128, 128 * 128, 16, 0)
    assert seconds > 0
    assert not engine.has_unfinished_requests()
    assert engine.num_prefill_tokens_computed - before >= 3 * 128  # the timed prompts, never cached


def test_a_cached_step_computes_only_the_new_tokens_over_a_cached_prefix(engine):
    """The K samples: the prefix is a cache hit on purpose, the new tokens are not."""
    hits = engine.scheduler.num_cache_hit_tokens
    before = engine.num_prefill_tokens_computed
    shape, seconds = profiler.time_cached_step(engine, tokens=64, batch=4, cached=128, repeats=2)
    assert (shape.prefill_tokens, shape.prefill_squared, shape.prefill_cached, shape.decode_batch) == (
        64, 64 * (128 + 64), 64 * 128, 4)
    assert seconds > 0 and not engine.has_unfinished_requests()
    assert engine.scheduler.num_cache_hit_tokens - hits >= 3 * 128  # each timed prompt found the prefix
    assert engine.num_prefill_tokens_computed - before >= 3 * 64
