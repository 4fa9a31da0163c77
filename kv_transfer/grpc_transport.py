"""KV transport `grpc`: KV bytes ride the Prefill response stream as `KVChunk` messages.

For networks without NCCL or a usable gloo interface. Pieces are split so one message
stays under `max_message_bytes`; the receiving decode worker checks every chunk against
its reservation (`ReservationTable.write_bytes`). A decode worker that stops reading the
stream (hung) fills the window of chunks in flight; a chunk that waits longer than
`send_deadline_s` for room fails the transfer, so the engine thread moves on.
"""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from pdserve.kv_transfer.base import KVSender, KVTransport, TransportSettings
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.reservations import TransferError
from pdserve.protos import pdserve_pb2 as pb

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_END = object()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


class GrpcStreamSender(KVSender):
    """Feeds one Prefill stream. `send` may be called from any thread; the stream handler
    drains `messages()` on the event loop. At most `max_inflight` chunks wait in memory; a
    chunk that finds no room for `send_deadline_s` raises `TransferError` (peer not reading)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, layout: KVLayout, make_chunk,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_inflight: int = 16,
                 send_deadline_s: float = 5.0):
        self._loop, self._make_chunk, self._deadline_s = loop, make_chunk, send_deadline_s
        self._piece_tokens = max(1, max_message_bytes // layout.token_bytes)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._slots = threading.Semaphore(max_inflight)
        self._closed = False

    def send(self, transfer_id, layer, token_start, k, v) -> None:
        for offset in range(0, k.shape[0], self._piece_tokens):
            k_part, v_part = k[offset : offset + self._piece_tokens], v[offset : offset + self._piece_tokens]
            data = tensor_bytes(k_part) + tensor_bytes(v_part)
            chunk = self._make_chunk(transfer_id, layer, token_start + offset, k_part.shape[0], data)
            deadline = time.monotonic() + self._deadline_s
            while not self._slots.acquire(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
                if self._closed:
                    return
                if time.monotonic() >= deadline:
                    raise TransferError(f"KV peer is not reading: no chunk left for it in {self._deadline_s:g} s "
                                        "(kv_send_deadline_s)")
            if self._closed:
                self._slots.release()
                return
            self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    async def flush(self, transfer_id: int) -> None:
        """Chunks are flushed by the stream handler itself (`messages` ends after `finish`)."""

    def discard(self, transfer_id: int) -> None:
        self._closed = True

    def finish(self) -> None:
        """Called on the event loop after the last `send`: `messages()` ends after the chunks."""
        self._queue.put_nowait(_END)

    async def messages(self):
        while True:
            item = await self._queue.get()
            if item is _END:
                return
            self._slots.release()
            yield item


def kv_chunk(transfer_id: int, layer: int, token_start: int, num_tokens: int, data: bytes) -> pb.KVChunk:
    """The stream message carrying one piece (`make_chunk` for `GrpcStreamSender`)."""
    return pb.KVChunk(transfer_id=transfer_id, layer=layer, token_start=token_start, num_tokens=num_tokens,
                      data=data)


class GrpcTransport(KVTransport):
    """Nothing to set up on either side: each leg's pieces ride its own Prefill stream, where
    the decode worker validates every byte, so any piece on the stream may write the leg's
    reservation and the leg needs no endpoint."""

    name = "grpc"

    def __init__(self, layout: KVLayout, send_deadline_s: float = 5.0) -> None:
        self.layout, self.send_deadline_s = layout, send_deadline_s

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> GrpcTransport:
        return cls(settings.layout, send_deadline_s=settings.send_deadline_s)

    def check_endpoint(self, endpoint: str) -> None:
        """Any will do: the leg needs none."""

    def close(self) -> None:
        """Nothing of its own to stop: each leg's stream ends with its call."""

    async def open_sender(self, endpoint: str) -> GrpcStreamSender:
        """A sender feeding the calling stream handler's `messages()` (call on its event loop)."""
        return GrpcStreamSender(asyncio.get_running_loop(), self.layout, kv_chunk, send_deadline_s=self.send_deadline_s)
