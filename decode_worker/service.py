"""The decode worker's gRPC service.

A request's life here (docs/design.md, "Request lifecycle"):

    WAITING_FOR_BLOCKS ──blocks reserved──► WAITING_FOR_KV ──KV + first token──► RUNNING
         │                                     │   (prefill leg: try P1, then P2,      │
         │                                     │    then prefill locally)             ▼
         └──────────── abort / client gone ────┴───────────────────────────► FINISHED | ABORTED

The decode worker owns the prefill leg: it reserves blocks for the prompt, opens a
Prefill stream to a prefill worker, receives the KV into the reservation, acknowledges,
and admits the request to its continuous batch. A leg that fails or misses
`kv_transfer_timeout_s` is abandoned (the stream is cancelled, which aborts it on the
prefill worker) and retried once on the next prefill worker named in the request, then
locally. Preemption under KV pressure recomputes locally (engine scheduler).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
from collections import deque

import grpc

from pdserve.decode_worker.prefill_client import DecodeSide, PrefillClient
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.profile import Profile, prefill_seconds
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.registry import resolve_transport_name
from pdserve.kv_transfer.reservations import ReservationTable
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.protos.convert import logprob_to_proto, sampling_from_proto
from pdserve.rpc import tracing
from pdserve.worker_base.config import WorkerConfig
from pdserve.worker_base.service import WorkerServiceBase
from pdserve.worker_base.telemetry import failure_reason

logger = logging.getLogger(__name__)


class DecodeService(WorkerServiceBase, pb_grpc.DecodeWorkerServicer):
    role = "decode"

    def __init__(self, engine: LLMEngine, config: WorkerConfig) -> None:
        super().__init__(engine, config)
        self.admission = self.kv.scheduler_side  # reservations for KV prefilled elsewhere
        self.table = ReservationTable(self.layout, self.kv.worker_side.cache_tensor)
        self.kv_endpoint = self.transports.listen(self.table)
        self.prefill = PrefillClient(DecodeSide(
            config.security, self.layout, self.table, self.transports, self.transfers, engine.vocab_size,
            self._reserved_blocks))
        self._block_waiters: deque[tuple[str, list[int], asyncio.Future]] = deque()
        self._admissions: dict[str, asyncio.Task] = {}
        self._awaiting_kv: set[str] = set()  # blocks reserved, remote prefill leg not yet done
        self._seeds = random.Random()
        self.num_failed_legs = 0
        self.prefill_decisions: dict[str, int] = {}  # "where/reason" -> count
        self._abort_requested: set[str] = set()
        self.profile = Profile.load(config.prefill_profile) if config.prefill_profile else None
        tier = getattr(engine, "kv_tier", None)
        if self.profile is not None and tier is not None:
            tier.profile = self.profile  # the tier's load-or-recompute predicts prefill as the local decision does

    # ------------------------------------------------------------ lifecycle
    def add_to(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)

    async def start(self) -> None:
        self.aengine.after_step.append(self._serve_block_waiters)
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        await self.prefill.close()

    # ------------------------------------------------------------ RPCs
    def _kv_endpoint(self) -> str:
        return self.kv_endpoint

    def _stats(self) -> pb.WorkerStats:
        load = self.engine.load()
        return self._worker_stats(
            load, num_waiting=load.num_waiting + len(self._block_waiters), num_running=load.num_running,
            num_waiting_for_kv=len(self._awaiting_kv), queued_prefill_tokens=load.queued_prompt_tokens,
            num_failed_transfers=self.num_failed_legs, prefill_decisions=self.prefill_decisions,
            kv_bytes_received=self.prefill.kv_bytes_received,
        )

    async def Abort(self, request, context) -> pb.AbortReply:
        admission = self._admissions.get(request.request_id)
        if admission is not None and not admission.done():
            # remembered too: on Python 3.11 asyncio.wait_for can swallow a cancel that lands
            # as the prefill leg completes, and the admission would then go on
            self._abort_requested.add(request.request_id)
            admission.cancel()
            return pb.AbortReply(found=True)
        async with self.aengine.lock:
            output = self.engine.abort_request(request.request_id)
        if output is not None:
            self._deliver(output)
        return pb.AbortReply(found=output is not None)

    async def _accept(self, request: pb.GenerateRequest, context) -> tuple[list[int], SamplingParams, str]:
        """The request's prompt, sampling params and KV transport; or the call aborted: this
        worker draining (UNAVAILABLE), the request invalid (INVALID_ARGUMENT), its id in use
        (ALREADY_EXISTS), `max_queued_requests` waiting already (RESOURCE_EXHAUSTED)."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        try:
            ids, params, transport = self._validate(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.request_id in self._admissions or request.request_id in self.aengine.listeners:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {request.request_id!r} is in use")
        waiting = len(self._block_waiters) + self.engine.num_waiting
        if waiting >= self.config.max_queued_requests:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker has {waiting} requests waiting for KV blocks or a batch slot "
                                f"(max_queued_requests); retry later")
        return ids, params, transport

    async def Generate(self, request: pb.GenerateRequest, context):
        request_id = request.request_id
        tracing.annotate(request_id=request_id, num_prompt_tokens=len(request.prompt_token_ids))
        ids, params, transport = await self._accept(request, context)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.aengine.listeners[request_id] = outputs.put_nowait
        admission = asyncio.get_running_loop().create_task(
            self._admit(request_id, ids, params, list(request.prefill_addresses), transport,
                        request.prefill_queued_tokens))
        self._admissions[request_id] = admission
        finished = False
        phase = tracing.NO_SPAN  # the stage under way, traced: prefill here until the first token, then decode
        try:
            try:
                first, prefilled_by = await admission
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # the client went away
                # aborted by an Abort RPC while being admitted; `finally` frees the blocks
                yield pb.GenerateChunk(finish_reason="abort", num_prompt_tokens=len(ids))
                return
            finally:
                self._admissions.pop(request_id, None)
            if request_id in self._abort_requested:  # aborted while admitted: see Abort
                yield pb.GenerateChunk(finish_reason="abort", num_prompt_tokens=len(ids))
                return  # `finally` below aborts it in the engine and frees its blocks
            if first is not None:
                finished = first.finished
                tracing.add_event("first_token", prefilled_by=prefilled_by)
                yield self._chunk([first], prefilled_by)
            first_chunk = first is None
            phase = tracing.start_span("pdserve.prefill" if first_chunk else "pdserve.decode", request_id=request_id)
            while not finished:
                waiting = _waiting(await outputs.get(), outputs)
                finished = waiting[-1].finished
                if first_chunk:
                    tracing.end(phase)
                    tracing.add_event("first_token", prefilled_by="local")
                    phase = tracing.start_span("pdserve.decode", request_id=request_id)
                yield self._chunk(waiting, prefilled_by if first_chunk else "")
                first_chunk = False
        finally:
            tracing.end(phase, sys.exc_info()[1])
            self.aengine.listeners.pop(request_id, None)
            self._abort_requested.discard(request_id)
            if not finished:  # client gone or error: abort wherever the request is
                admission.cancel()
                asyncio.get_running_loop().create_task(self._forget(request_id))

    # ------------------------------------------------------------ admission
    def _validate(self, request: pb.GenerateRequest) -> tuple[list[int], SamplingParams, str]:
        if not request.request_id:
            raise ValueError("request_id must not be empty")
        ids = self.engine.check_prompt_ids(request.prompt_token_ids)
        params = sampling_from_proto(request.sampling)
        if params.seed is None:  # resolve here so every prefill worker samples alike
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        transport = resolve_transport_name(request.kv_transport)
        return ids, params, transport

    async def _admit(self, request_id: str, ids: list[int], params: SamplingParams, addresses: list[str],
                     transport: str, prefill_queued_tokens: int = 0) -> tuple[RequestOutput | None, str]:
        """Prefill the request where `_where_to_prefill` says (remotely, only what neither
        this worker's prefix cache nor its KV tier holds, or here) and admit it to the batch.
        Returns the first-token output when prefilled remotely (None when prefilled locally)."""
        async with self.aengine.lock:  # engine state is stable between steps
            cached = self.admission.cached_tokens(ids) if addresses else 0
            where, reason = self._where_to_prefill(len(ids), cached, bool(addresses), prefill_queued_tokens)
        self._decided(where, reason)
        tracing.annotate(prefill_where=where, prefill_reason=reason)
        if where == "remote":
            with tracing.span("pdserve.queue", request_id=request_id):  # waiting for KV blocks
                cached = await self._reserve(request_id, ids)
            self._awaiting_kv.add(request_id)
            try:
                output = await self._prefill_remotely(request_id, ids, params, addresses, transport, cached)
            finally:
                self._awaiting_kv.discard(request_id)
            if output is not None:
                return output
            logger.warning("request_id=%s prefilling locally after remote failures", request_id)
            self._decided("local", "remote_failed")
        async with self.aengine.lock:
            self.admission.release(request_id)
            self.engine.add_request(request_id, ids, params, detokenize=False)
        self.aengine.wake()
        return None, "local"

    async def _prefill_remotely(self, request_id: str, ids: list[int], params: SamplingParams,
                                addresses: list[str], transport: str,
                                cached: int) -> tuple[RequestOutput | None, str] | None:
        """Try the first two prefill workers in turn; admit the request with the first token
        one of them sends. None when both failed (the blocks stay reserved)."""
        for address in addresses[:2]:
            try:
                with tracing.span("pdserve.prefill_leg", client=True, request_id=request_id, prefill_address=address,
                                  kv_transport=transport, num_cached_tokens=cached):  # its call's parent
                    prefilled = await asyncio.wait_for(
                        self.prefill.run(address, request_id, ids, params, transport, cached),
                        timeout=self.config.kv_transfer_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: next prefill worker
                self.num_failed_legs += 1
                self.transfers.failed(transport, "receive", failure_reason(exc))
                logger.warning("request_id=%s prefill leg on %s failed: %s", request_id,
                               address, str(exc) or type(exc).__name__)  # a timeout's str() is ""
                continue
            async with self.aengine.lock:
                output = self.admission.admit(request_id, ids, params, prefilled.first_token,
                                              prefilled.num_cached_tokens, prefilled.first_logprob,
                                              prefilled.prompt_logprobs)
            self.aengine.wake()
            self._serve_block_waiters()  # it may have finished at once, freeing blocks
            return output, prefilled.prefill_worker_id
        return None

    def _where_to_prefill(self, num_tokens: int, cached: int, have_prefill: bool,
                          prefill_queued_tokens: int = 0) -> tuple[str, str]:
        """("remote" | "local", why). Local when no prefill worker was offered, or when what
        this worker's cache lacks, added to the prompt tokens its engine has yet to compute, is
        at most `local_prefill_max_tokens` (a short tail, e.g. a chat's next user turn: a round
        trip to the prefill pool would cost more than it saves, unless short tails pile up
        here, as they do when the second KV tier leaves most turns only their new tokens: then
        they go to the prefill pool instead of slowing this worker's batch). With a profile
        loaded, also local when the latency model predicts prefilling the tail here beats the
        prefill worker's queue plus the same prefill plus shipping the KV."""
        uncached = num_tokens - cached
        if not have_prefill:
            return "local", "no_prefill_worker"
        if uncached + self.engine.queued_prompt_tokens() <= self.config.local_prefill_max_tokens:
            return "local", "few_uncached_tokens"
        if self.profile is not None:
            load = self.engine.load()
            here = prefill_seconds(self.profile, load.queued_prompt_tokens + uncached, load.num_running,
                                   load.running_tokens)  # mixed with this batch's decodes
            there = prefill_seconds(self.profile, prefill_queued_tokens + uncached) + self.profile.transfer_s(uncached)
            return ("local", "latency_model") if here <= there else ("remote", "latency_model")
        return "remote", "many_uncached_tokens"

    def _decided(self, where: str, reason: str) -> None:
        key = f"{where}/{reason}"
        self.prefill_decisions[key] = self.prefill_decisions.get(key, 0) + 1

    async def _reserve(self, request_id: str, ids: list[int]) -> int:
        """Reserve blocks for the prompt (sharing its cached prefix, loading what the KV tier
        holds after it: KVSchedulerSide.reserve), waiting (FIFO) until enough are free;
        returns how many leading tokens the shared and loaded blocks hold."""
        future = asyncio.get_running_loop().create_future()
        self._block_waiters.append((request_id, ids, future))
        await self._try_reserve()
        try:
            return await future
        except asyncio.CancelledError:
            self._block_waiters = deque(w for w in self._block_waiters if w[2] is not future)
            raise

    def _serve_block_waiters(self) -> None:
        if self._block_waiters:
            asyncio.get_running_loop().create_task(self._try_reserve())

    async def _try_reserve(self) -> None:
        """Reserve for the waiters in turn (FIFO) while the engine takes them."""
        async with self.aengine.lock:
            while self._block_waiters:
                request_id, ids, future = self._block_waiters[0]
                cached = self.admission.reserve(request_id, ids)
                if cached is None:
                    return
                self._block_waiters.popleft()
                if not future.done():
                    future.set_result(cached)
                else:  # cancelled while we reserved
                    self.admission.release(request_id)

    async def _reserved_blocks(self, request_id: str) -> list[int]:
        """The blocks reserved for a request (read between engine steps)."""
        async with self.aengine.lock:
            return self.admission.block_table(request_id)

    async def _forget(self, request_id: str) -> None:
        """Abort a request wherever it is and free its blocks (client gone)."""
        async with self.aengine.lock:
            self.engine.abort_request(request_id)
            self.admission.release(request_id)
        await self._try_reserve()

    def _deliver(self, output: RequestOutput) -> None:
        listener = self.aengine.listeners.get(output.request_id)
        if listener is not None:
            listener(output)

    @staticmethod
    def _chunk(outputs: list[RequestOutput], prefilled_by: str) -> pb.GenerateChunk:
        """One chunk of the request's `outputs` (consecutive steps' deltas, in order): their
        tokens (and logprobs) in one message, the last one's finish reason; the first chunk
        (`prefilled_by` set) also carries the first output's cache figure and prompt logprobs."""
        first, last = outputs[0], outputs[-1]
        if len(outputs) == 1:
            token_ids, logprobs = first.new_token_ids, first.new_logprobs
        else:
            token_ids = [t for output in outputs for t in output.new_token_ids]
            logprobs = [lp for output in outputs for lp in output.new_logprobs]
        chunk = pb.GenerateChunk(token_ids=token_ids, finish_reason=last.finish_reason or "",
                                 num_prompt_tokens=len(first.prompt_token_ids))
        if logprobs:
            chunk.logprobs.extend(logprob_to_proto(lp) for lp in logprobs)
        if prefilled_by:
            chunk.prefilled_by, chunk.num_cached_tokens = prefilled_by, first.num_cached_tokens
            if first.prompt_logprobs is not None:
                chunk.prompt_logprobs.extend(logprob_to_proto(lp) for lp in first.prompt_logprobs[1:])
        return chunk


def _waiting(output: RequestOutput, queue: asyncio.Queue) -> list[RequestOutput]:
    """`output` and the request's outputs queued behind it: more than one when its stream to
    the router fell behind the engine's steps (the router is slow to read, or this worker's
    event loop is), and then sent together in one chunk."""
    waiting = [output]
    while not queue.empty():
        waiting.append(queue.get_nowait())
    return waiting
