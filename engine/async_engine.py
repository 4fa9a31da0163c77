"""Drive an LLMEngine from asyncio, for the worker servers.

Steps run one at a time in a dedicated thread, so the event loop keeps serving RPCs while
the model computes. All engine state is read and written under `lock`; the stepping task
holds it for the duration of a step, and asyncio's lock is fair, so RPC handlers get in
between steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.stats import Histogram
from pdserve.engine.step_log import StepLog

logger = logging.getLogger(__name__)
Listener = Callable[[RequestOutput], None]
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BLOCKED_RECHECK_S = 0.05  # a blocked engine (LLMEngine.blocked) looks again this often at most


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_fn: Callable | None = None, name: str = "") -> None:
        self.engine = engine
        self.stats_fn = stats_fn  # computes a load report from engine state (see `stats`)
        self.lock = asyncio.Lock()
        self.listeners: dict[str, Listener] = {}
        self.after_step: list[Callable[[], None]] = []
        self.num_finished = 0
        self._snapshot = None
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._step_started: float | None = None  # time.monotonic() when the running step began
        self.step_seconds = Histogram(STEP_SECONDS_BUCKETS)  # each step's wall time
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)  # the sequences each step computed
        self.step_log = StepLog(name)  # per-step records, when PDSERVE_STEP_LOG asks for them

    def start(self) -> None:
        if self.stats_fn is not None:
            self._snapshot = self.stats_fn()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    def wake(self) -> None:
        """Tell the loop there may be work (call after adding a request)."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop stepping (the running step ends first), then close the second KV tier's
        store, if any: what it has queued is written (off the event loop) and its writer
        thread stops, so a graceful stop loses no write-through."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)
        self.step_log.close()
        tier = getattr(self.engine, "kv_tier", None)
        if tier is not None:
            await asyncio.to_thread(tier.store.close)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            async with self.lock:
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    continue
                started = self._step_started = time.monotonic()
                started_wall, process_cpu = time.time(), time.process_time()
                thread_cpu = None
                try:
                    outputs, thread_cpu = await loop.run_in_executor(self._executor, self._timed_step)
                except Exception:
                    logger.exception("engine step failed; aborting its requests")
                    outputs = self._abort_all()
                finally:
                    self._step_started = None
                seconds = time.monotonic() - started
                self.step_seconds.observe(seconds)
                self.step_log.record(started_wall, seconds, self.engine.last_step_shape, thread_cpu,
                                     time.process_time() - process_cpu)
                self.batch_size.observe(self.engine.last_step_sequences)
                if self.stats_fn is not None:
                    self._snapshot = self.stats_fn()
            for output in outputs:
                self.num_finished += output.finished
                listener = self.listeners.get(output.request_id)
                if listener is not None:
                    listener(output)
            for callback in self.after_step:
                callback()
            if self.engine.blocked:  # nothing can run until a reservation is admitted or released
                await self._wait_for_change()

    async def _wait_for_change(self) -> None:
        """Wait until someone wakes the loop (an admission, a new or released request), or
        BLOCKED_RECHECK_S at most (a release that did not wake it), instead of spinning."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), BLOCKED_RECHECK_S)
        except TimeoutError:
            self._wake.set()

    def _timed_step(self) -> tuple[list[RequestOutput], float]:
        """engine.step() and the CPU seconds this thread spent in it (the step log's "u")."""
        cpu = time.thread_time()
        outputs = self.engine.step()
        return outputs, time.thread_time() - cpu

    def step_running_s(self) -> float:
        """How long the step now running has run (0 between steps): a health check's measure
        of an engine thread that is wedged while the event loop still answers."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def stats(self):
        """`stats_fn()` without waiting for a running step: fresh when no step runs (nothing
        else touches the engine then: this is the loop thread), otherwise as of the end of
        the last step. Load reports must not stall behind a multi-second prefill step, or
        routers would take a busy worker for a dead one."""
        if not self.lock.locked():
            self._snapshot = self.stats_fn()
        return self._snapshot

    def _abort_all(self) -> list[RequestOutput]:
        ids = list(self.engine.scheduler.requests)
        return [out for rid in ids if (out := self.engine.abort_request(rid)) is not None]
