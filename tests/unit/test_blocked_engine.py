"""A decode engine whose waiting request cannot get blocks because reservations (KV on its
way from a prefill worker) hold them waits for them instead of failing: its step schedules
nothing and says so (`blocked`), the async loop sleeps until it is woken (no spinning), and
the request runs once the reservation goes. Before, the step raised "scheduler made no
progress" and the loop aborted every request the engine held (a real multi-turn chat on
small KV pools lost requests that way: finish_reason "abort", no tokens)."""

import asyncio
import time

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=32)
    probe = LLMEngine(config)
    block_bytes = probe.runner.kv_cache[:, :, 0].numel() * probe.runner.kv_cache.element_size()
    del probe
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=32,
                                  kv_cache_bytes=10 * block_bytes))  # 10 blocks: one 32-token request and 2 more


def test_a_request_blocked_by_reservations_waits_for_them_without_failing(engine):
    side = engine.kv_connector.scheduler_side
    reserved = list(range(3, 31))  # 28 tokens: 7 blocks
    assert side.reserve("remote", reserved) == 0
    engine.add_request("local", list(range(40, 60)), SamplingParams(max_tokens=4, ignore_eos=True))  # 5 blocks
    assert engine.step() == [] and engine.blocked  # nothing to run, and no error

    async def scenario() -> tuple[float, int]:
        aengine = AsyncEngine(engine)
        done = asyncio.Event()
        aengine.listeners["local"] = lambda out: out.finished and done.set()
        aengine.start()
        aengine.wake()
        await asyncio.sleep(0.5)
        spun = aengine.batch_size.count  # steps taken while blocked: a recheck each BLOCKED_RECHECK_S
        async with aengine.lock:
            side.release("remote")
        aengine.wake()
        started = time.monotonic()
        await asyncio.wait_for(done.wait(), 30)
        await aengine.stop()
        return time.monotonic() - started, spun

    waited, spun = asyncio.run(scenario())
    assert spun <= 0.5 / 0.05 + 2, spun  # it slept between rechecks instead of spinning
    assert not engine.blocked and not engine.has_unfinished_requests()
    engine.scheduler.block_manager.check_integrity()
    assert waited < 30


def test_an_engine_with_nothing_to_wait_for_still_says_it_made_no_progress(engine):
    engine.add_request("starved", list(range(3, 31)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.scheduler.block_manager.allocate_slots("hog", 36)  # every block, held outside any request
    with pytest.raises(RuntimeError, match="no progress"):
        engine.step()
    engine.scheduler.block_manager.free("hog")
    engine.abort_request("starved")
