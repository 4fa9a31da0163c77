"""The decode worker's side of a prefill leg: one Prefill stream per request.

`run` opens a reservation for the prompt's blocks, asks the prefill worker to prefill
into it, receives the KV (inline on the stream for `grpc`, through the torch pair for
`torch`), waits until every layer of every token has arrived and been validated, acks,
and returns the first token. Whatever happens, the reservation entry is released before
`run` returns or raises, so no late piece can write into blocks that are about to be
reused; a stream that did not complete is cancelled, which aborts the prefill worker's
side. A prefill worker that fails a call as UNAVAILABLE (gone, or hung past keepalive) is
forgotten, its channel closed: the next leg for that address starts afresh, and workers that
left the pool leave no channel behind.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from pdserve.engine.outputs import TokenLogprob
from pdserve.kv_transfer.base import thread_safe_notifier
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.registry import KVTransports
from pdserve.kv_transfer.reservations import ReservationTable, TransferError
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.protos.convert import logprob_from_proto, sampling_to_proto
from pdserve.rpc import tracing
from pdserve.rpc.channel import open_channel
from pdserve.rpc.security import Security
from pdserve.worker_base.telemetry import TransferCounters


@dataclass(frozen=True)
class Prefilled:
    """What a remote prefill leg returns: the first token, the prefill worker's id, how many
    prompt tokens its own cache supplied, and the logprobs the request asked for (the first
    token's; prompt tokens 1..n-1's)."""

    first_token: int
    prefill_worker_id: str
    num_cached_tokens: int
    first_logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob] | None


@dataclass(frozen=True)
class DecodeSide:
    """What a prefill leg needs from the decode worker that runs it."""

    security: Security  # for channels to prefill workers
    layout: KVLayout  # this worker's: a peer's must match
    table: ReservationTable  # where arriving KV may land
    transports: KVTransports  # this worker's, by name
    transfers: TransferCounters  # successful receives are counted here
    vocab_size: int  # a token or logprob id outside it is refused
    reserved_blocks: Callable[[str], Awaitable[list[int]]]  # a request's reserved blocks (read between steps)


@dataclass
class PrefillPeer:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.PrefillWorkerStub
    worker_id: str
    layout: KVLayout


class PrefillClient:
    def __init__(self, decode: DecodeSide) -> None:
        self.decode = decode
        self.kv_bytes_received = 0  # by legs that completed
        self._peers: dict[str, PrefillPeer] = {}
        self._closing: set[asyncio.Task] = set()

    async def peer(self, address: str) -> PrefillPeer:
        peer = self._peers.get(address)
        if peer is None:
            channel = open_channel(address, self.decode.security)
            stub = pb_grpc.PrefillWorkerStub(channel)
            try:
                info = await stub.Info(pb.InfoRequest(), timeout=10)
            except grpc.aio.AioRpcError:
                await channel.close()
                raise
            if info.role != "prefill":
                await channel.close()
                raise TransferError(f"{address} is a {info.role or 'unknown'} worker, not prefill")
            peer = PrefillPeer(address, channel, stub, info.worker_id, KVLayout.from_proto(info.layout))
            self._peers[address] = peer
        return peer

    async def run(self, address: str, request_id: str, ids: list[int], params, transport: str,
                  num_cached_tokens: int = 0) -> Prefilled:
        """Prefill remotely into the request's reserved blocks, of which the first
        `num_cached_tokens` positions hold KV already (shared cached blocks: only the rest is
        shipped)."""
        peer = await self._checked_peer(address)
        decode = self.decode
        kv = decode.transports[transport]
        loop = asyncio.get_running_loop()
        kv_complete = loop.create_future()
        block_table = await decode.reserved_blocks(request_id)
        reservation = decode.table.register(
            request_id, block_table, len(ids), peer=kv.writer_for(peer.worker_id),
            on_done=thread_safe_notifier(loop, kv_complete), num_cached_tokens=num_cached_tokens)
        call = peer.stub.Prefill(metadata=tracing.metadata())  # the current span: the decode worker's prefill leg
        kv_bytes = decode.layout.kv_bytes(len(ids) - num_cached_tokens)
        transfer = tracing.start_span("pdserve.kv_transfer", request_id=request_id, kv_transport=transport,
                                      direction="receive", peer=peer.worker_id, kv_bytes=kv_bytes)
        completed = False
        try:
            start = pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=ids, sampling=sampling_to_proto(params),
                seed=params.seed, kv_transport=transport,
                transfer_id=reservation.transfer_id, num_cached_tokens=num_cached_tokens,
                kv_endpoint=kv.endpoint_for(peer.worker_id),
            )
            decode.layout.to_proto(start.layout)
            await call.write(pb.PrefillClientMessage(start=start))
            done = await self._receive_until_done(call, reservation.transfer_id)
            prefilled = Prefilled(done.first_token, done.prefill_worker_id, done.num_cached_tokens,
                                  self._first_logprob(done, params), self._prompt_logprobs(done, params, ids))
            await kv_complete
            if reservation.error is not None:
                raise TransferError(reservation.error)
            tracing.end(transfer)
            await call.write(pb.PrefillClientMessage(ack=pb.KVAck(transfer_id=reservation.transfer_id, ok=True)))
            await call.done_writing()
            completed = True
            self.kv_bytes_received += kv_bytes
            decode.transfers.succeeded(transport, "receive", kv_bytes, reservation.transfer_seconds)
            return prefilled
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._forget(peer)
            raise
        finally:
            tracing.end(transfer, sys.exc_info()[1])
            decode.table.release(reservation.transfer_id)
            if not completed:
                call.cancel()

    async def _checked_peer(self, address: str) -> PrefillPeer:
        """`peer(address)`, forgotten when it cannot be reached; TransferError when its KV
        layout differs from this worker's."""
        try:
            peer = await self.peer(address)
        except grpc.aio.AioRpcError:
            self._peers.pop(address, None)
            raise
        mismatch = self.decode.layout.mismatch(peer.layout)
        if mismatch:
            raise TransferError(f"prefill worker {address}: {mismatch}")
        return peer

    def _first_logprob(self, done: pb.PrefillDone, params) -> TokenLogprob | None:
        """The first token's logprob from `done`, checked, when the request asked for logprobs."""
        if params.logprobs is None:
            return None
        if not done.HasField("first_logprob"):
            raise TransferError("prefill worker sent no logprob for the first token of a request that asked")
        try:
            return logprob_from_proto(done.first_token, done.first_logprob,
                                      self.decode.vocab_size, params.logprobs)
        except ValueError as exc:
            raise TransferError(f"prefill worker sent bad logprobs: {exc}") from None

    def _prompt_logprobs(self, done: pb.PrefillDone, params, ids: list[int]) -> list[TokenLogprob] | None:
        """Prompt tokens 1..n-1's logprobs from `done`, checked, when the request asked."""
        if params.prompt_logprobs is None:
            return None
        if len(done.prompt_logprobs) != len(ids) - 1:
            raise TransferError(f"prefill worker sent {len(done.prompt_logprobs)} prompt logprobs for a prompt "
                                f"of {len(ids)} tokens (expected {len(ids) - 1})")
        vocab = self.decode.vocab_size
        try:
            return [logprob_from_proto(token, message, vocab, params.prompt_logprobs)
                    for token, message in zip(ids[1:], done.prompt_logprobs, strict=True)]
        except ValueError as exc:
            raise TransferError(f"prefill worker sent bad prompt logprobs: {exc}") from None

    async def _receive_until_done(self, call, transfer_id: int) -> pb.PrefillDone:
        table = self.decode.table
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                raise TransferError("prefill worker closed the stream before finishing")
            if message.HasField("done"):
                if message.done.num_cached_tokens >= max(message.done.num_prompt_tokens, 1):
                    raise TransferError(f"prefill worker claims {message.done.num_cached_tokens} cached "
                                        f"tokens of a {message.done.num_prompt_tokens}-token prompt")
                vocab_size = self.decode.vocab_size
                if message.done.first_token >= vocab_size:  # would break this worker's whole batch
                    raise TransferError(f"prefill worker sent first token {message.done.first_token}, "
                                        f"outside the vocabulary of {vocab_size}")
                return message.done
            chunk = message.kv
            if chunk.transfer_id != transfer_id:
                raise TransferError(f"stream carried transfer {chunk.transfer_id}, expected {transfer_id}")
            try:
                table.write_bytes(chunk.transfer_id, chunk.layer, chunk.token_start, chunk.num_tokens,
                                  chunk.data)
            except TransferError as exc:
                table.fail(transfer_id, str(exc))
                raise

    def _forget(self, peer: PrefillPeer) -> None:
        """Drop a peer that is gone; its channel closes once the calls still on it end."""
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
            task = asyncio.get_running_loop().create_task(peer.channel.close(grace=30))
            self._closing.add(task)  # held until done: a task only the loop references can be collected
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close()
        self._peers.clear()
