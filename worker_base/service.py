"""What the prefill and decode workers' gRPC services share: the engine driver, the KV
layout and transports, draining, and the Info/Stats answers.

Services reach the engine through its public API only (`LLMEngine`: requests, `load()`,
and `kv_connector`, whose scheduler side reserves and admits KV from elsewhere and whose
worker side is the KV cache the transports read and write); tests/unit/test_engine_api.py
holds them to it."""

from __future__ import annotations

import grpc

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.stats import EngineLoad
from pdserve.kv_transfer.base import TransportSettings
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.registry import KVTransports
from pdserve.protos import pdserve_pb2 as pb
from pdserve.worker_base.config import WorkerConfig
from pdserve.worker_base.telemetry import TransferCounters, histogram_to_proto
from pdserve.worker_base.watch import UpdateStream

# A step running longer than this means the engine thread is wedged: Stats, which routers
# and the controller use as the health check, answers UNAVAILABLE (a CPU prefill step of
# max_num_batched_tokens takes seconds, a GPU one milliseconds).
ENGINE_STALL_S = 60.0


class WorkerServiceBase:
    role = ""

    def __init__(self, engine: LLMEngine, config: WorkerConfig) -> None:
        self.engine, self.config = engine, config
        self.aengine = AsyncEngine(engine, stats_fn=self._stats, name=self.role)
        self.draining = False  # set by drain(): refuse new requests, finish open ones
        self.transfers = TransferCounters()  # KV transfers, for Stats (worker_base.telemetry)
        self.watches: set[UpdateStream] = set()  # routers' open update streams
        self.kv = engine.kv_connector
        cache = self.kv.worker_side.cache_tensor
        self.layout = KVLayout.of_cache(cache)
        self.transports = KVTransports(TransportSettings(
            config.worker_id, self.layout, cache.device, max_piece_tokens=engine.config.max_num_batched_tokens,
            host=config.host, timeout_s=config.kv_transfer_timeout_s, send_deadline_s=config.kv_send_deadline_s,
        ))

    async def start(self) -> None:
        self.aengine.start()

    async def stop(self) -> None:
        await self.aengine.stop()
        self.transports.close()

    async def Info(self, request, context) -> pb.WorkerInfo:
        info = pb.WorkerInfo(
            worker_id=self.config.worker_id, role=self.role, model=self.engine.config.model,
            kv_transports=self.transports.names, kv_endpoint=self._kv_endpoint(),
            max_model_len=self.engine.max_model_len, vocab_size=self.engine.vocab_size,
            cache_root=self.kv.scheduler_side.cache_root, prefix_caching=self.kv.scheduler_side.prefix_caching,
        )
        self.layout.to_proto(info.layout)
        return info

    async def Stats(self, request, context) -> pb.WorkerStats:
        """The load report, and the health check: refused (UNAVAILABLE) while an engine step
        has run for longer than ENGINE_STALL_S."""
        running = self.aengine.step_running_s()
        if running > ENGINE_STALL_S:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{self.role} worker's engine step has run for {running:.0f} s (stalled)")
        return self.aengine.stats()

    async def Watch(self, request, context):
        """This worker's load and prefix-cache changes, pushed to a router (worker_base.watch)."""
        side = self.kv.scheduler_side
        stream = UpdateStream(self.aengine, request, side.cache_events if side.prefix_caching else None,
                              stalled=lambda: self.aengine.step_running_s() > ENGINE_STALL_S)
        self.watches.add(stream)
        try:
            async for update in stream.updates():
                yield update
        finally:
            self.watches.discard(stream)

    async def stop_serving(self, server, grace_s: float) -> None:
        """Stop `server` (this service's gRPC server) and then the service: routers' update
        streams end first, so the grace period waits only for real requests."""
        for stream in list(self.watches):
            stream.close()
        await server.stop(grace=grace_s)
        await self.stop()

    def _kv_endpoint(self) -> str:
        return ""

    def _stats(self) -> pb.WorkerStats:
        """The role's load report: `_worker_stats(load, ...)` with its own counts."""
        raise NotImplementedError

    def _worker_stats(self, load: EngineLoad, **fields) -> pb.WorkerStats:
        """The report every role shares, from the engine's `load` (`fields` add the role's)."""
        stats = pb.WorkerStats(
            worker_id=self.config.worker_id, role=self.role, num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            num_preemptions=load.num_preemptions, num_finished=self.aengine.num_finished,
            draining=self.draining, prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_query_tokens=load.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=load.prefix_cache_hit_tokens, num_cached_blocks=load.num_cached_blocks,
            prefill_tokens_computed=load.prefill_tokens_computed,
            decode_tokens_computed=load.decode_tokens_computed,
            kv_tier_hit_tokens=load.kv_tier_hit_tokens, kv_tier_decisions=load.kv_tier_decisions,
            kv_tier_blocks_written=load.kv_tier_blocks_written, kv_tier_bytes=load.kv_tier_bytes,
            kv_tier_read_bandwidth=load.kv_tier_read_bandwidth, kv_tier_store=load.kv_tier_store,
            transfers=self.transfers.to_proto(), **fields,
        )
        histogram_to_proto(self.aengine.step_seconds, stats.step_seconds)
        histogram_to_proto(self.aengine.batch_size, stats.batch_size)
        return stats
