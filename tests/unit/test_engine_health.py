"""The health measure behind the workers' Stats check: how long the engine step now running
has run. A stand-in engine (its step blocks until released) drives the real AsyncEngine."""

import asyncio
import threading
import time

from pdserve.engine.async_engine import AsyncEngine


class _BlockingEngine:
    def __init__(self) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        self.pending = True
        self.blocked = False  # LLMEngine's: the last step could schedule nothing

    def has_unfinished_requests(self) -> bool:
        return self.pending

    def step(self):
        self.entered.set()
        self.release.wait(30)
        self.pending = False
        return []


def test_step_running_s_grows_while_a_step_is_wedged_and_is_zero_between_steps():
    async def scenario():
        engine = _BlockingEngine()
        aengine = AsyncEngine(engine)
        aengine.start()
        idle = aengine.step_running_s()
        aengine.wake()
        await asyncio.to_thread(engine.entered.wait, 30)
        first = aengine.step_running_s()
        await asyncio.sleep(0.3)
        later = aengine.step_running_s()
        engine.release.set()
        deadline = time.monotonic() + 30
        while aengine.step_running_s() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        after = aengine.step_running_s()
        await aengine.stop()
        return idle, first, later, after

    idle, first, later, after = asyncio.run(scenario())
    assert idle == 0.0 and after == 0.0
    assert later - first >= 0.25  # it measures the running step: it grew with the sleep
