"""The router's view of the worker pools: membership (from the cluster controller, or a
static list), per-worker gRPC stubs, and each worker's load and prefix cache
(router/cache_index.py) from the updates it pushes (`Watch`, worker_base/watch.py): one
stream per worker, resubscribed when it breaks.

A worker leaves routing for a few seconds when its stream breaks (a dead process: the
connection resets), when it says its engine is stalled, or when a request to it fails; and
while it is silent (no update for SILENT_AFTER_S, a few of its heartbeats: a hung process
keeps its connections open), until it speaks again. Each worker is judged on its own
stream, so one hung worker delays nobody else's updates. One the membership source no longer
lists (dead, removed) is dropped, with its cache index, at the next refresh.

A cache delta applies only on top of the cursor the index holds (its `since`): one that does
not (events missed) makes the registry resubscribe from cursor 0, which answers with the
whole cache. The index files a worker's second-KV-tier events under its node (`node`, from
the membership source; a static worker is a node of its own).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.router.cache_index import CacheIndex
from pdserve.rpc.channel import open_channel
from pdserve.rpc.security import Security

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.5  # asked of every worker: an update at least this often
SILENT_AFTER_S = 1.5  # no update for this long (3 heartbeats): hung, out of routing until it speaks
RESUBSCRIBE_S = (0.1, 2.0)  # backoff after a broken stream: first, most
MembershipSource = Callable[[], Awaitable[list[dict]]]


@dataclass
class WorkerView:
    role: str
    worker_id: str
    address: str
    state: str  # "ready" | "draining"
    channel: grpc.aio.Channel
    stub: object
    stats: pb.WorkerStats | None = None
    inflight: int = 0  # requests this router has open on the worker
    inflight_peak: int = 0  # the most `inflight` was since the last update came
    peak_before: int = 0  # ... in the interval before that
    own_at_report: int = 0  # the most this router may have had open when the last report was taken
    routed: dict[str, float] = field(default_factory=dict)  # picked, stream not yet opened: id -> when
    inflight_tokens: int = 0  # prompt tokens this router sent it (prefill) not yet prefilled
    unhealthy_until: float = 0.0
    heard_at: float = field(default_factory=time.monotonic)  # its last update (or when it joined)
    caches: bool | None = None  # has a prefix cache (None: not asked yet)
    node: str = ""  # the address of the node it runs on, as the controller reports it
    tiebreak: int = 0  # orders workers a policy finds equal: each router its own order (WorkerRegistry)
    watch: asyncio.Task | None = None  # following its update stream

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens waiting on this (prefill) worker: its last report plus what this
        router sent it since."""
        return (self.stats.queued_prefill_tokens if self.stats else 0) + self.inflight_tokens

    ROUTED_TTL_S = 5.0  # a request routed here whose stream never opened (client gone) stops counting

    def note_routed(self, request_id: str) -> None:
        """The router picked this worker for `request_id`; it counts as open from now on,
        so a burst of requests routed before any stream opens does not pile onto one worker."""
        self.routed[request_id] = time.monotonic()

    def note_opened(self, request_id: str) -> None:
        self.routed.pop(request_id, None)
        self.inflight += 1
        self.inflight_peak = max(self.inflight_peak, self.inflight)

    def note_closed(self) -> None:
        self.inflight -= 1

    def note_report(self, stats: pb.WorkerStats) -> None:
        """A new report of the worker's load came. It was taken after the update before it
        came, so this router's share of it is at most the most it had open since then."""
        self.stats = stats
        self.own_at_report = max(self.peak_before, self.inflight_peak)
        self.peak_before, self.inflight_peak = self.inflight_peak, self.inflight

    @property
    def others_busy(self) -> int:
        """Requests on the worker that this router did not send (other router replicas',
        direct clients'), by its last report: its count less the most this router may have
        had open when it was taken. Never more than the truth then: a request this router
        closed meanwhile is not mistaken for another's (a chat client's next turn comes the
        moment the last one ends), at the price of missing others' requests while this
        router's own count was higher."""
        s = self.stats
        if s is None:
            return 0
        return max(0, s.num_running + s.num_waiting + s.num_waiting_for_kv - self.own_at_report)

    @property
    def open_requests(self) -> int:
        """This router's open requests on the worker, counting those routed a moment ago."""
        if self.routed:
            stale = time.monotonic() - self.ROUTED_TTL_S
            for request_id in [r for r, t in self.routed.items() if t < stale]:
                del self.routed[request_id]
        return self.inflight + len(self.routed)

    @property
    def silent(self) -> bool:
        """No update for SILENT_AFTER_S: hung, or too loaded to answer."""
        return time.monotonic() - self.heard_at > SILENT_AFTER_S

    @property
    def routable(self) -> bool:
        return self.state == "ready" and time.monotonic() >= self.unhealthy_until and not self.silent


def tiebreak(salt: bytes, worker_id: str) -> int:
    """A worker's place among equals in the order `salt` (one router's) gives them."""
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), key=salt, digest_size=8).digest())


@dataclass
class ModelInfo:
    max_model_len: int = 0
    vocab_size: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerRegistry:
    def __init__(self, source: MembershipSource, security: Security, refresh_s: float = 0.5,
                 stats_s: float = 0.25) -> None:
        self.source, self.security = source, security
        self.refresh_s, self.stats_s = refresh_s, stats_s  # stats_s: the update interval asked of workers
        self._views: dict[str, WorkerView] = {}
        self.cache_index = CacheIndex()
        self.model = ModelInfo()
        self._tasks: list[asyncio.Task] = []
        self.resyncs = 0  # cache deltas that did not follow the index's cursor (events missed)
        # Each router orders equally good workers its own way: router replicas that see the
        # same idle pool must not all send their next request to the same worker.
        self._tiebreak_salt = os.urandom(8)

    async def start(self) -> None:
        await self.refresh()
        self._tasks = [asyncio.get_running_loop().create_task(self._every(self.refresh_s, self.refresh))]

    async def stop(self) -> None:
        watches = [v.watch for v in self._views.values() if v.watch is not None]
        for task in (*self._tasks, *watches):
            task.cancel()
        await asyncio.gather(*self._tasks, *watches, return_exceptions=True)
        for view in self._views.values():
            await view.channel.close()

    def workers(self, role: str, routable: bool = True) -> list[WorkerView]:
        return [v for v in self._views.values() if v.role == role and (v.routable or not routable)]

    def candidates(self, role: str) -> list[WorkerView]:
        """The workers to route to: the routable ones; when there is none, those out of
        routing only for their silence (a loaded machine can delay a worker's updates:
        better to try a slow worker than to refuse the request)."""
        return self.workers(role) or [v for v in self._views.values() if v.role == role and v.state == "ready"
                                      and time.monotonic() >= v.unhealthy_until]

    def mark_unhealthy(self, view: WorkerView, seconds: float = 3.0) -> None:
        view.unhealthy_until = time.monotonic() + seconds

    async def refresh(self) -> None:
        try:
            members = await self.source()
        except Exception as exc:  # noqa: BLE001 - keep the last known membership
            logger.warning("membership refresh failed: %s", exc)
            return
        seen = set()
        for m in members:
            seen.add(m["worker_id"])
            view = self._views.get(m["worker_id"])
            if view is None:
                channel = open_channel(m["address"], self.security)
                stub_class = pb_grpc.DecodeWorkerStub if m["role"] == "decode" else pb_grpc.PrefillWorkerStub
                view = WorkerView(m["role"], m["worker_id"], m["address"], m["state"], channel, stub_class(channel),
                                  tiebreak=tiebreak(self._tiebreak_salt, m["worker_id"]))
                self._views[m["worker_id"]] = view
                view.watch = asyncio.get_running_loop().create_task(self._watch(view), name=f"watch-{view.worker_id}")
                logger.info("worker joined role=%s id=%s address=%s", view.role, view.worker_id, view.address)
            view.state, view.node = m["state"], m.get("node", "")
        for worker_id in list(self._views):
            if worker_id not in seen:
                view = self._views.pop(worker_id)
                self.cache_index.remove_worker(worker_id)
                logger.info("worker left role=%s id=%s", view.role, worker_id)
                if view.watch is not None:
                    view.watch.cancel()
                await view.channel.close()
        if not self.model.ready.is_set():
            await self._learn_model()

    async def _learn_model(self) -> None:
        for view in self.workers("decode", routable=False):
            try:
                info = await view.stub.Info(pb.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError:
                continue
            self.model.max_model_len, self.model.vocab_size = info.max_model_len, info.vocab_size
            self.model.ready.set()
            return

    async def _watch(self, view: WorkerView) -> None:
        """Follow the worker's updates for as long as it is a member: resubscribe (with
        backoff) when the stream breaks, keeping it out of routing meanwhile."""
        backoff = RESUBSCRIBE_S[0]
        while True:
            try:
                await self._follow(view)
                backoff = RESUBSCRIBE_S[0]  # ended by us (a gap) or by the worker (stopping)
            except grpc.aio.AioRpcError as exc:
                if view.worker_id not in self._views:
                    return
                self.mark_unhealthy(view)
                logger.debug("update stream of %s broke: %s", view.worker_id, exc.code())
                await asyncio.sleep(backoff)
                backoff = min(RESUBSCRIBE_S[1], 2 * backoff)

    async def _follow(self, view: WorkerView) -> None:
        """One subscription: learn the worker's hash root (first time), then apply its
        updates until the stream ends or a cache delta shows missed events."""
        index = self.cache_index
        if view.caches is None:
            info = await view.stub.Info(pb.InfoRequest(), timeout=5)
            view.caches = info.prefix_caching
            if view.caches:
                index.add_worker(view.worker_id, info.cache_root, info.layout.block_size, view.node)
        request = pb.WatchRequest(cursor=index.cursor(view.worker_id), interval_ms=round(1e3 * self.stats_s),
                                  heartbeat_ms=round(1e3 * HEARTBEAT_S))
        call = view.stub.Watch(request)
        try:
            async for update in call:
                if not self.apply(view, update):
                    return
        finally:
            call.cancel()

    def apply(self, view: WorkerView, update: pb.WorkerUpdate) -> bool:
        """Take in one update from `view`'s worker. False when its cache delta does not follow
        the index's cursor (events were missed): the index forgets the worker's cursor, and
        the caller resubscribes for the whole cache."""
        view.heard_at = time.monotonic()
        view.note_report(update.stats)
        if update.stalled:
            self.mark_unhealthy(view)
        if update.HasField("cache") and view.worker_id in self._views:
            c = update.cache
            if not self.cache_index.apply(view.worker_id, c.next_cursor, c.reset, c.stored, c.removed, since=c.since,
                                          tier_stored=c.tier_stored, tier_removed=c.tier_removed, tier=c.tier):
                self.resyncs += 1
                logger.warning("cache events of %s missed (delta after %d, index at %d): resyncing", view.worker_id,
                               c.since, self.cache_index.cursor(view.worker_id))
                return False
        return True

    async def _every(self, seconds: float, fn) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except Exception:  # noqa: BLE001 - background upkeep must not die
                logger.exception("registry upkeep failed")


def static_source(prefill: list[str], decode: list[str], security: Security) -> MembershipSource:
    """Membership from fixed addresses (bare workers, no Ray): asks each for its id once."""
    known: dict[str, dict] = {}

    async def source() -> list[dict]:
        for role, addresses in (("prefill", prefill), ("decode", decode)):
            for address in addresses:
                if address in known:
                    continue
                async with open_channel(address, security) as channel:
                    stub = (pb_grpc.DecodeWorkerStub if role == "decode" else pb_grpc.PrefillWorkerStub)(channel)
                    info = await stub.Info(pb.InfoRequest(), timeout=5)
                known[address] = {"role": role, "worker_id": info.worker_id, "address": address, "state": "ready"}
        return list(known.values())

    return source
