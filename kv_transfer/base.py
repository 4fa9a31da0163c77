"""The KV transport interface, split by role (the registry of implementations is
kv_transfer.registry).

Ownership (docs/design.md, "KV ownership and the KV hand-off"): the decode worker owns the blocks it reserved for a
prompt from the moment it reserves them; a `ReservationTable` entry says which slots an
incoming transfer may fill. The prefill worker owns its own cache blocks only while it
computes the prompt: a sender copies each shipped piece into a transport-owned staging
buffer at once, so the prefill blocks are not needed by the transfer. The transfer (and
the request on the prefill side) ends when the decode worker acknowledges it or abandons
it; the decode worker then frees or keeps its reservation.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from pdserve.kv_transfer.layout import KVLayout
    from pdserve.kv_transfer.reservations import ReservationTable


class KVSender(ABC):
    """Prefill side: ships pieces of one or more transfers to one decode worker."""

    @abstractmethod
    def send(self, transfer_id: int, layer: int, token_start: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
        """Queue K and V (`[num_tokens, kv_heads, head_dim]`) of one layer for positions
        starting at `token_start`. Returns once they are copied; may block for back-pressure.
        Called from the engine thread, as soon as the layer is computed (layer-wise
        pipelining)."""

    @abstractmethod
    async def flush(self, transfer_id: int) -> None:
        """Wait until every piece queued for the transfer is on the wire. Raises
        `TransferError` if the transfer cannot complete (peer gone)."""

    @abstractmethod
    def discard(self, transfer_id: int) -> None:
        """Drop the transfer's unsent pieces (abort). Idempotent."""

    @abstractmethod
    def finish(self) -> None:
        """Called on the event loop once the leg's last piece is sent: `messages` ends."""

    @abstractmethod
    def messages(self) -> AsyncIterator:
        """The pieces to put on the Prefill stream itself, as they come, until `finish`
        (none for a sender that ships out of band)."""


@dataclass(frozen=True)
class TransportSettings:
    """What a worker's transports are built from (kv_transfer.registry)."""

    worker_id: str
    layout: KVLayout
    device: torch.device | str
    max_piece_tokens: int  # the most tokens one piece carries (the engine's step token budget)
    host: str = "127.0.0.1"  # the worker's own address, for endpoints it hosts
    timeout_s: float = 30.0  # forming a pair, and a transfer
    send_deadline_s: float = 5.0  # a piece waiting for a peer that does not read fails after this


class KVTransport(ABC):
    """One worker's end of one way to move KV from prefill to decode workers. A worker holds
    one of every registered transport (kv_transfer.registry); a request names the one its
    prefill leg uses.

    Decode side: `listen` once; per leg, `writer_for` (who may write its reservation) and
    `endpoint_for` (what the prefill worker needs to reach this one). Prefill side: per
    leg, `check_endpoint` on what the decode worker sent, then `open_sender`."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: TransportSettings) -> KVTransport:
        """This transport for a worker with `settings`."""

    def listen(self, table: ReservationTable) -> str:
        """Decode side: deliver arriving pieces into `table` from now on; returns the
        endpoint this worker advertises for it ("" when it needs none)."""
        return ""

    def writer_for(self, peer_id: str) -> str:
        """Decode side: who may write a leg's reservation when prefill worker `peer_id` runs
        it: its id when pieces arrive tagged with their sender, "" (any) by default."""
        return ""

    def endpoint_for(self, peer_id: str) -> str:
        """Decode side: the leg's `kv_endpoint` for prefill worker `peer_id` ("" by default:
        the pieces ride the leg's own stream)."""
        return ""

    @abstractmethod
    def check_endpoint(self, endpoint: str) -> None:
        """Prefill side: ValueError when a leg's `kv_endpoint` is not what this transport needs."""

    @abstractmethod
    async def open_sender(self, endpoint: str) -> KVSender:
        """Prefill side: the sender for one leg to the decode worker `endpoint` names; raises
        when that worker cannot be reached."""

    @abstractmethod
    def close(self) -> None:
        """Stop everything in flight so the process can exit."""


class KVTransportError(RuntimeError):
    """A transport could not be set up or broke."""


def thread_safe_notifier(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A callable any thread may call to resolve `future` (once) on `loop`."""

    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    return lambda: loop.call_soon_threadsafe(resolve)
