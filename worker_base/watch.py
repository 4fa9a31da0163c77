"""A worker's pushed updates to one router: the `Watch` RPC's stream (protos/pdserve.proto).

Each update carries the worker's load (its Stats answer) and, when one was read, the change
of its prefix cache since the cursor the router holds (with the second KV tier, its store's
changes to the node's tier too: engine.cache_events). The worker sends one at once, then one
after engine steps at most every `interval_s`, and one every `heartbeat_s` however idle it
is, so the router hears of load and cache changes within an interval and takes a worker it
has not heard from for a few heartbeats for hung: no per-worker polling, and a hung worker's
silence is noticed per worker rather than stalling a round over all of them.

The prefix cache changes only inside engine steps, which run in the engine thread while the
step loop holds `AsyncEngine.lock`; its changes are read on the event loop when no step runs:
right after a step (an `after_step` callback, once per interval), or at a heartbeat when the
engine is idle. A multi-second prefill step therefore delays the cache part of an update,
never the update: load reports use the engine's last snapshot while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.kv_connector import CacheDelta
from pdserve.protos import pdserve_pb2 as pb

logger = logging.getLogger(__name__)
DEFAULT_INTERVAL_S = 0.25
DEFAULT_HEARTBEAT_S = 0.5
MIN_INTERVAL_S = 0.01  # however often a router asks, at most 100 updates a second
MAX_HEARTBEAT_S = 10.0


class UpdateStream:
    """One subscriber's updates. `cache_events(cursor)` reads the cache's change since
    `cursor` (None: the worker keeps no prefix cache); `stalled()` says the engine is wedged."""

    def __init__(self, aengine: AsyncEngine, request: pb.WatchRequest,
                 cache_events: Callable[[int], CacheDelta] | None, stalled: Callable[[], bool]) -> None:
        self.aengine, self.cache_events, self.stalled = aengine, cache_events, stalled
        self.interval_s = max(MIN_INTERVAL_S, request.interval_ms / 1e3 if request.interval_ms else DEFAULT_INTERVAL_S)
        heartbeat_s = request.heartbeat_ms / 1e3 if request.heartbeat_ms else DEFAULT_HEARTBEAT_S
        self.heartbeat_s = min(MAX_HEARTBEAT_S, max(self.interval_s, heartbeat_s))
        self.cursor = request.cursor  # the subscriber holds every cache event up to this one
        self.pending: CacheDelta | None = None  # read between steps, not sent yet
        self.seq = 0
        self.sent_at = 0.0
        self._ready = asyncio.Event()  # a cache change was read: send it
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def close(self) -> None:
        """End the stream (the worker is stopping): its RPC completes, so the server's
        graceful stop does not wait for it."""
        self._closed = True
        self._ready.set()

    async def updates(self) -> AsyncIterator[pb.WorkerUpdate]:
        self.aengine.after_step.append(self._stepped)
        try:
            self._read_if_idle()
            while not self._closed:
                self._ready.clear()
                yield self._next_update()
                self.sent_at = time.monotonic()
                try:
                    await asyncio.wait_for(self._ready.wait(), self.heartbeat_s)
                except TimeoutError:
                    self._read_if_idle()  # a heartbeat: with whatever changed meanwhile
        finally:
            self.aengine.after_step.remove(self._stepped)
            if self._timer is not None:
                self._timer.cancel()

    def _next_update(self) -> pb.WorkerUpdate:
        self.seq += 1
        update = pb.WorkerUpdate(seq=self.seq, stats=self.aengine.stats(), stalled=self.stalled())
        delta, self.pending = self.pending, None
        if delta is not None:
            update.cache.CopyFrom(pb.CacheEventsReply(
                next_cursor=delta.next_cursor, reset=delta.reset, stored=delta.stored, removed=delta.removed,
                since=delta.since, tier_stored=delta.tier_stored, tier_removed=delta.tier_removed, tier=delta.tier))
            self.cursor = delta.next_cursor
        return update

    def _stepped(self) -> None:
        """After every engine step (on the event loop, no step running): read the cache's
        change if an update is due, else once it is (`_due`)."""
        wait = self.sent_at + self.interval_s - time.monotonic()
        if wait <= 0:
            self._read()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._due)

    def _due(self) -> None:
        self._timer = None
        self._read_if_idle()  # else the running step's end reads it: the update is due by then

    def _read_if_idle(self) -> None:
        if not self.aengine.lock.locked():
            self._read()

    def _read(self) -> None:
        try:
            if self.cache_events is not None:
                self.pending = self.cache_events(self.cursor)
            self._ready.set()
        except Exception:  # noqa: BLE001 - the engine loop calls this: it must not raise
            logger.exception("reading the prefix cache's events failed")
