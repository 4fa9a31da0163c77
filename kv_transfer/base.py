"""The KV transport interface, split by role, and the registry of implementations.

Ownership (DESIGN.md, as built): the decode worker owns the blocks it reserved for a
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

import torch


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


class KVTransportError(RuntimeError):
    """A transport could not be set up or broke."""


TRANSPORT_NAMES = ("torch", "grpc")


def check_transport_name(name: str) -> str:
    """Fail loudly on an unknown transport name."""
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown KV transport {name!r}; choose one of {list(TRANSPORT_NAMES)}")
    return name


def thread_safe_notifier(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A callable any thread may call to resolve `future` (once) on `loop`."""

    def resolve() -> None:
        if not future.done():
            future.set_result(None)

    return lambda: loop.call_soon_threadsafe(resolve)
