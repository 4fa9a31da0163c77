"""The prefill worker's gRPC service.

A request's life here (docs/design.md, "Request lifecycle"):

    QUEUED ──scheduled──► PREFILLING (chunks, under the token budget, batched with other
    requests' chunks) ──last chunk: first token sampled──► SHIPPED ──ack──► DONE
       └──────────── stream cancelled / Abort / transfer error ──────────────► ABORTED

Each layer's K/V of each chunk is handed to the KV sender as soon as that layer is
computed (layer-wise pipelining); the sender copies it into its own staging buffers, so
the request's cache blocks here are freed as soon as its prompt is computed, not held for
the transfer. The first token is sampled here at output position 0 with the seed the
decode worker chose, so it is the token the decode worker would have sampled.

Prefix caching on both sides: the decode worker says how many leading prompt tokens it
holds already (`num_cached_tokens`, whole blocks); this worker computes only what its own
prefix cache lacks, and ships only positions the decode worker lacks: computed chunks
clipped to start there, plus, per layer, the span between the two caches read straight
from this worker's cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
from dataclasses import dataclass

import grpc

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.kv_transfer.base import KVSender
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.registry import resolve_transport_name
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.protos.convert import logprob_to_proto, sampling_from_proto
from pdserve.rpc import tracing
from pdserve.worker_base.config import WorkerConfig
from pdserve.worker_base.service import WorkerServiceBase
from pdserve.worker_base.telemetry import Stopwatch

logger = logging.getLogger(__name__)


@dataclass
class _Shipment:
    """One leg's transfer. Per layer, positions below the layer's watermark are shipped (or
    held by the decode worker: `skip_below`); every position is shipped once, so a chunk
    computed again (after a preemption, or as a prefix-cache hit) is not sent twice."""

    transfer_id: int
    sender: KVSender
    skip_below: int = 0  # the decode worker holds positions [0, skip_below)
    shipped: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> positions below are shipped
    error: str | None = None
    stopwatch: Stopwatch = dataclasses.field(default_factory=Stopwatch)  # started at the first piece sent

    def plan(self, layer: int, token_start: int, num_tokens: int) -> tuple[int, int]:
        """For a chunk of `num_tokens` computed at `token_start`: (`from_cache`, `cut`): ship
        positions [from_cache, token_start) from this worker's cache (none when equal), then
        the chunk's rows from `cut` on (none when `cut == num_tokens`). Records them shipped."""
        shipped = self.shipped.get(layer, self.skip_below)
        end = token_start + num_tokens
        self.shipped[layer] = max(shipped, end)
        from_cache = min(shipped, token_start)
        return from_cache, min(max(shipped - token_start, 0), num_tokens)


class PrefillService(WorkerServiceBase, pb_grpc.PrefillWorkerServicer):
    role = "prefill"

    def __init__(self, engine: LLMEngine, config: WorkerConfig) -> None:
        super().__init__(engine, config)
        self._shipments: dict[str, _Shipment] = {}
        self._streams: dict[str, asyncio.Task] = {}
        self.kv_bytes_sent = 0
        self.kv.worker_side.set_layer_hook(self._ship)

    def add_to(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)

    # ------------------------------------------------------------ RPCs
    def _stats(self) -> pb.WorkerStats:
        load = self.engine.load()  # a prefill worker's requests never decode: all they queue is prompt
        return self._worker_stats(load, num_waiting=load.num_waiting, num_running=len(self._streams),
                                  queued_prefill_tokens=load.queued_prompt_tokens, kv_bytes_sent=self.kv_bytes_sent)

    async def Abort(self, request, context) -> pb.AbortReply:
        task = self._streams.get(request.request_id)
        if task is None:
            return pb.AbortReply(found=False)
        task.cancel()
        return pb.AbortReply(found=True)

    async def Prefill(self, request_iterator, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("start"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be `start`")
        start = first.start
        try:
            ids, params, transport = self._validate(start)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request_id = start.request_id
        tracing.annotate(request_id=request_id, num_prompt_tokens=len(ids), num_cached_tokens=start.num_cached_tokens,
                         kv_transport=transport)
        # _streams too: a torch leg is registered there while it joins its KV pair, before it ships
        if request_id in self._streams or request_id in self._shipments:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is in use")
        if len(self._streams) >= self.config.max_queued_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"prefill worker has {len(self._streams)} requests open "
                                f"(max_queued_requests); retry later or elsewhere")
        self._streams[request_id] = asyncio.current_task()
        try:
            async for message in self._prefill(start, ids, params, transport, request_iterator):
                yield message
        except _LegFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        finally:
            self._streams.pop(request_id, None)

    # ------------------------------------------------------------ the leg
    async def _prefill(self, start, ids, params, transport, request_iterator):
        """Compute the prompt, shipping its KV as each layer of each chunk is computed (the
        pieces that ride this stream are yielded), then yield `done` with the first token and
        wait for the decode worker's ack. `_LegFailed` when the prefill or its transfer fails."""
        request_id, loop = start.request_id, asyncio.get_running_loop()
        sender = await self._open_sender(transport, start.kv_endpoint)
        shipment = _Shipment(start.transfer_id, sender, skip_below=start.num_cached_tokens)
        first_token: asyncio.Future = loop.create_future()
        self._shipments[request_id] = shipment
        self.aengine.listeners[request_id] = lambda out: _resolve(first_token, out)
        kv_bytes = self.layout.kv_bytes(len(ids) - start.num_cached_tokens)
        computing = tracing.start_span("pdserve.prefill", request_id=request_id)  # queued and computed
        transfer = tracing.start_span("pdserve.kv_transfer", request_id=request_id, kv_transport=transport,
                                      direction="send", kv_bytes=kv_bytes)
        try:
            async with self.aengine.lock:
                self.engine.add_request(request_id, ids, params, detokenize=False)
            self.aengine.wake()
            first_token.add_done_callback(lambda _: sender.finish())
            async for chunk in sender.messages():  # pieces that ride this stream, until the first token
                yield pb.PrefillServerMessage(kv=chunk)
            output = await first_token
            tracing.end(computing)
            tracing.add_event("first_token")
            await self._complete_shipment(output, shipment, transport, kv_bytes)
            tracing.end(transfer)
            yield pb.PrefillServerMessage(done=_done(output, len(ids), self.config.worker_id))
            self.kv_bytes_sent += kv_bytes
            ack = await asyncio.wait_for(anext(aiter(request_iterator), None),
                                         timeout=self.config.kv_transfer_timeout_s)
            if ack is None or not ack.HasField("ack") or not ack.ack.ok:
                logger.warning("request_id=%s no ack from the decode worker", request_id)
        finally:
            tracing.end(computing, sys.exc_info()[1])
            tracing.end(transfer, sys.exc_info()[1])
            self.aengine.listeners.pop(request_id, None)
            self._shipments.pop(request_id, None)
            sender.discard(shipment.transfer_id)
            if not first_token.done():  # cancelled or failed mid-prefill: free its blocks now
                loop.create_task(self._abort(request_id))

    async def _open_sender(self, transport: str, endpoint: str) -> KVSender:
        """The leg's sender on `transport` to the decode worker at `endpoint`; `_LegFailed`
        (counted) when it cannot be reached."""
        try:
            return await self.transports[transport].open_sender(endpoint)
        except Exception as exc:  # noqa: BLE001 - cannot reach the decode worker
            self.transfers.failed(transport, "send", "connect")
            raise _LegFailed(f"KV transport: {exc}") from exc

    async def _complete_shipment(self, output: RequestOutput, shipment: _Shipment, transport: str,
                                 kv_bytes: int) -> None:
        """Once the first token is out: wait until every piece is on the wire and count the
        transfer; `_LegFailed` (counted) when the prefill was aborted or the transfer failed."""
        if output.finish_reason == "abort":
            raise _LegFailed("prefill aborted")
        if not shipment.error:  # a failed transfer's pieces may wait behind a peer not reading
            await shipment.sender.flush(shipment.transfer_id)
        if shipment.error:
            self.transfers.failed(transport, "send", "send_failed")
            raise _LegFailed(f"KV transfer failed: {shipment.error}")
        self.transfers.succeeded(transport, "send", kv_bytes, shipment.stopwatch.seconds())

    async def _abort(self, request_id: str) -> None:
        async with self.aengine.lock:
            self.engine.abort_request(request_id)

    def _ship(self, request_id: str, layer: int, token_start: int, k, v) -> None:
        """Engine-thread hook: hand one layer of one chunk to the request's sender, only the
        positions the decode worker lacks and that were not shipped yet; first, the positions
        before the chunk that this worker's cache supplied (not computed here), if unshipped."""
        shipment = self._shipments.get(request_id)
        if shipment is None or shipment.error:
            return
        try:
            from_cache, cut = shipment.plan(layer, token_start, k.shape[0])
            shipment.stopwatch.start()
            if from_cache < token_start:
                cached_k, cached_v = self._cached_kv(request_id, layer, from_cache, token_start)
                shipment.sender.send(shipment.transfer_id, layer, from_cache, cached_k, cached_v)
            if cut < k.shape[0]:
                shipment.sender.send(shipment.transfer_id, layer, token_start + cut, k[cut:], v[cut:])
        except Exception as exc:  # noqa: BLE001 - never break the engine step for one request
            shipment.error = str(exc)
            logger.warning("request_id=%s KV shipment failed: %s", request_id, exc)

    def _cached_kv(self, request_id: str, layer: int, start: int, end: int):
        """K and V `[end - start, kv_heads, head_dim]` of positions [start, end) from the cache."""
        return self.kv.worker_side.read(self.kv.scheduler_side.block_table(request_id), layer, start, end)

    def _validate(self, start: pb.PrefillRequest):
        if not start.request_id:
            raise ValueError("request_id must not be empty")
        theirs = KVLayout.from_proto(start.layout)
        mismatch = self.layout.mismatch(theirs)
        if mismatch:
            raise ValueError(mismatch)
        ids = self.engine.check_prompt_ids(start.prompt_token_ids)
        if start.num_cached_tokens >= len(ids) or start.num_cached_tokens % self.layout.block_size:
            raise ValueError(f"num_cached_tokens {start.num_cached_tokens} must be whole blocks of "
                             f"{self.layout.block_size} short of the prompt's {len(ids)} tokens")
        # the first token only; EOS and stop ids stay as sent (a min_tokens request must not
        # sample them first), min_tokens capped to what one token can need
        params = sampling_from_proto(start.sampling)
        params = dataclasses.replace(params, max_tokens=1, seed=start.seed,
                                     min_tokens=min(params.min_tokens, params.first_position + 1))
        transport = resolve_transport_name(start.kv_transport)
        self.transports[transport].check_endpoint(start.kv_endpoint)
        return ids, params, transport


class _LegFailed(Exception):
    pass


def _resolve(future: asyncio.Future, output) -> None:
    if output.finished and not future.done():
        future.set_result(output)


def _done(output: RequestOutput, num_prompt_tokens: int, worker_id: str) -> pb.PrefillDone:
    """The leg's result: the first token, with the logprobs the request asked for."""
    done = pb.PrefillDone(first_token=output.token_ids[0], num_prompt_tokens=num_prompt_tokens,
                          prefill_worker_id=worker_id, num_cached_tokens=output.num_cached_tokens)
    if output.outputs[0].logprobs:
        done.first_logprob.CopyFrom(logprob_to_proto(output.outputs[0].logprobs[0]))
    if output.prompt_logprobs is not None:
        done.prompt_logprobs.extend(logprob_to_proto(lp) for lp in output.prompt_logprobs[1:])
    return done
