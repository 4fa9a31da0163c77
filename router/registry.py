"""The router's view of the worker pools: membership (from the cluster controller, or a
static list), per-worker gRPC stubs, load from the workers' `Stats` and their prefix caches
from `CacheEvents` (router/cache_index.py), refreshed in the background. A worker that
fails a call is kept out of routing for a few seconds, and so is one whose Stats (the health
check: it also fails while the worker's engine is stalled) answers UNAVAILABLE, or nothing for
HUNG_AFTER_POLLS polls in a row (a hung process still accepts connections), until it answers
again; one the membership source no longer lists (dead, removed) is dropped, with its cache
index, at the next refresh."""

from __future__ import annotations

import asyncio
import logging
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
HUNG_AFTER_POLLS = 3
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
    closed: int = 0  # requests this router has closed on the worker, ever
    closed_before_stats: int = 0  # `closed` when the current `stats` were asked for
    routed: dict[str, float] = field(default_factory=dict)  # picked, stream not yet opened: id -> when
    inflight_tokens: int = 0  # prompt tokens this router sent it (prefill) not yet prefilled
    unhealthy_until: float = 0.0
    failed_polls: int = 0  # Stats polls in a row that got no answer
    caches: bool | None = None  # has a prefix cache (None: not asked yet)
    node: str = ""  # the address of the node it runs on, as the controller reports it

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

    def note_closed(self) -> None:
        self.inflight -= 1
        self.closed += 1

    @property
    def reported_busy(self) -> int:
        """Requests on the worker by its last Stats report, less those this router closed
        since it asked for that report (a chat client's next turn comes the moment the last
        one ends: a report from before then must not make the worker look busy)."""
        s = self.stats
        if s is None:
            return 0
        return max(0, s.num_running + s.num_waiting + s.num_waiting_for_kv - (self.closed - self.closed_before_stats))

    @property
    def open_requests(self) -> int:
        """This router's open requests on the worker, counting those routed a moment ago."""
        if self.routed:
            stale = time.monotonic() - self.ROUTED_TTL_S
            for request_id in [r for r, t in self.routed.items() if t < stale]:
                del self.routed[request_id]
        return self.inflight + len(self.routed)

    @property
    def routable(self) -> bool:
        return self.state == "ready" and time.monotonic() >= self.unhealthy_until


@dataclass
class ModelInfo:
    max_model_len: int = 0
    vocab_size: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class WorkerRegistry:
    def __init__(self, source: MembershipSource, security: Security, refresh_s: float = 0.5,
                 stats_s: float = 0.25) -> None:
        self.source, self.security = source, security
        self.refresh_s, self.stats_s = refresh_s, stats_s
        self._views: dict[str, WorkerView] = {}
        self.cache_index = CacheIndex()
        self.model = ModelInfo()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._every(self.refresh_s, self.refresh)),
                       loop.create_task(self._every(self.stats_s, self.poll_stats)),
                       loop.create_task(self._every(self.stats_s, self.poll_caches))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for view in self._views.values():
            await view.channel.close()

    def workers(self, role: str, routable: bool = True) -> list[WorkerView]:
        return [v for v in self._views.values() if v.role == role and (v.routable or not routable)]

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
                view = WorkerView(m["role"], m["worker_id"], m["address"], m["state"], channel, stub_class(channel))
                self._views[m["worker_id"]] = view
                logger.info("worker joined role=%s id=%s address=%s", view.role, view.worker_id, view.address)
            view.state, view.node = m["state"], m.get("node", "")
        for worker_id in list(self._views):
            if worker_id not in seen:
                view = self._views.pop(worker_id)
                self.cache_index.remove_worker(worker_id)
                logger.info("worker left role=%s id=%s", view.role, worker_id)
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

    async def poll_stats(self) -> None:
        async def one(view: WorkerView) -> None:
            closed = view.closed
            try:
                view.stats = await view.stub.Stats(pb.StatsRequest(), timeout=2)
                view.closed_before_stats = closed
                view.failed_polls = 0
            except grpc.aio.AioRpcError as exc:
                view.failed_polls += 1
                # unreachable or stalled at once; no answer (hung: accepts, never replies) 3 times in a row
                if exc.code() == grpc.StatusCode.UNAVAILABLE or view.failed_polls >= HUNG_AFTER_POLLS:
                    self.mark_unhealthy(view)

        await asyncio.gather(*(one(v) for v in list(self._views.values())))

    async def poll_caches(self) -> None:
        """Bring the cache index up to date (apart from the Stats poll: a worker answers
        CacheEvents between engine steps, which may be long)."""
        async def one(view: WorkerView) -> None:
            try:
                await self._poll_cache(view)
            except grpc.aio.AioRpcError:
                pass  # unreachable or slow: the Stats poll decides about its health

        await asyncio.gather(*(one(v) for v in list(self._views.values())))

    async def _poll_cache(self, view: WorkerView) -> None:
        """Bring the worker's entry in the cache index up to date (learning its hash root
        from Info the first time)."""
        index = self.cache_index
        if view.caches is False:
            return
        if not index.tracks(view.worker_id):
            info = await view.stub.Info(pb.InfoRequest(), timeout=2)
            view.caches = info.prefix_caching
            if not view.caches or view.worker_id not in self._views:
                return
            index.add_worker(view.worker_id, info.cache_root, info.layout.block_size)
        reply = await view.stub.CacheEvents(pb.CacheEventsRequest(cursor=index.cursor(view.worker_id)), timeout=2)
        if view.worker_id in self._views:  # not removed meanwhile
            index.apply(view.worker_id, reply.next_cursor, reply.reset, reply.stored, reply.removed)

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
