"""Decode side of a KV transfer: which cache slots incoming KV may be written to.

A reservation is made for a request's prompt (blocks the decode worker allocated) before
the prefill worker is asked to prefill. Every incoming piece (layer, token range, bytes)
is validated against it — transfer id, layer, range, size, no piece twice — and only then
copied into the reserved slots; anything else raises `TransferError` and touches nothing.
`release` is the only way a reservation ends; after it returns no write can reach those
blocks, so the caller may free or reuse them. Thread-safe: transports write from their
own threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.kv_connector import slot_mapping
from pdserve.kv_transfer.layout import KVLayout, as_numpy, host_scatter


class TransferError(Exception):
    """A KV piece or transfer that was rejected; the message says why."""


@dataclass
class Reservation:
    transfer_id: int
    request_id: str
    num_tokens: int
    slots: torch.Tensor  # [num_tokens] cache slot of each prompt position
    slots_np: np.ndarray  # the same, in numpy (finds runs of consecutive slots)
    peer: str  # who may write here (a prefill worker id), "" for any
    received: np.ndarray  # [num_layers, num_tokens] bool
    on_done: Callable[[], None] | None = None
    error: str | None = None
    complete: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    num_cached_tokens: int = 0  # positions [0, this) the receiver holds already
    first_write_at: float | None = None  # time.monotonic() of the first piece written
    completed_at: float | None = None  # and of the last

    @property
    def transfer_seconds(self) -> float | None:
        """From the first piece to the last (None if nothing was shipped: all cached)."""
        if self.first_write_at is None or self.completed_at is None:
            return None
        return self.completed_at - self.first_write_at


class ReservationTable:
    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor) -> None:
        if KVLayout.of_cache(kv_cache) != layout:
            raise ValueError(layout.mismatch(KVLayout.of_cache(kv_cache)))
        self.layout = layout
        self._device = kv_cache.device
        if self._device.type == "cpu":  # [layer][K or V]: numpy views by block and by token
            self._np_blocks = [[as_numpy(kv_cache[i, h]) for h in range(2)] for i in range(layout.num_layers)]
            self._np_rows = [[b.reshape(-1, *b.shape[2:]) for b in pair] for pair in self._np_blocks]
        else:  # [layer][K or V]: token rows
            self._rows = [[kv_cache[i, h].view(-1, layout.num_kv_heads, layout.head_dim) for h in range(2)]
                          for i in range(layout.num_layers)]
        self._lock = threading.Lock()
        self._by_id: dict[int, Reservation] = {}
        self._ids = itertools.count(1)

    def register(self, request_id: str, block_table: list[int], num_tokens: int, peer: str = "",
                 on_done: Callable[[], None] | None = None, num_cached_tokens: int = 0) -> Reservation:
        """Open a reservation for prompt positions [num_cached_tokens, num_tokens) of
        `block_table`; the positions before are held already (cached blocks shared with
        other requests) and a piece that touches them is rejected, so they stay intact."""
        bs = self.layout.block_size
        if len(block_table) * bs < num_tokens:
            raise ValueError(f"{len(block_table)} blocks cannot hold {num_tokens} tokens")
        if not 0 <= num_cached_tokens < num_tokens:
            raise ValueError(f"{num_cached_tokens} cached tokens of a {num_tokens}-token prompt")
        slots = slot_mapping(block_table, 0, num_tokens, bs)
        reservation = Reservation(
            transfer_id=next(self._ids), request_id=request_id, num_tokens=num_tokens,
            slots=torch.from_numpy(slots).to(self._device), slots_np=slots, peer=peer,
            received=np.zeros((self.layout.num_layers, num_tokens), dtype=bool), on_done=on_done,
            num_cached_tokens=num_cached_tokens,
        )
        reservation.received[:, :num_cached_tokens] = True
        with self._lock:
            self._by_id[reservation.transfer_id] = reservation
        return reservation

    def write(self, transfer_id: int, layer: int, token_start: int, num_tokens: int,
              payload: torch.Tensor, peer: str = "") -> None:
        """Validate one piece (K then V, flat) and copy it into the reserved slots."""
        layout = self.layout
        with self._lock:
            res = self._by_id.get(transfer_id)
            if res is None:
                raise TransferError(f"unknown transfer id {transfer_id}")
            if res.error is not None or res.complete:
                raise TransferError(f"transfer {transfer_id} is already {res.error or 'complete'}")
            if res.peer and peer and peer != res.peer:
                raise TransferError(f"transfer {transfer_id} belongs to {res.peer}, not {peer}")
            if not 0 <= layer < layout.num_layers:
                raise TransferError(f"layer {layer} outside [0, {layout.num_layers})")
            end = token_start + num_tokens
            if num_tokens < 1 or token_start < 0 or end > res.num_tokens:
                raise TransferError(
                    f"tokens [{token_start}, {end}) outside the reservation of {res.num_tokens}")
            expected = num_tokens * layout.token_elements
            if payload.dtype != layout.torch_dtype or payload.numel() != expected:
                raise TransferError(
                    f"payload of {payload.numel()} {payload.dtype} elements; expected {expected} "
                    f"{layout.torch_dtype} for {num_tokens} tokens")
            if res.received[layer, token_start:end].any():
                raise TransferError(f"layer {layer} tokens [{token_start}, {end}) sent twice or held "
                                    f"already (the first {res.num_cached_tokens} are cached here)")
            kv = payload.view(2, num_tokens, layout.num_kv_heads, layout.head_dim)
            if self._device.type == "cpu":
                self._scatter_host(layer, res.slots_np[token_start:end], as_numpy(kv))
            else:
                slots = res.slots[token_start:end]
                for half in range(2):
                    self._rows[layer][half].index_copy_(0, slots, kv[half].to(self._device))
            res.received[layer, token_start:end] = True
            if res.first_write_at is None:
                res.first_write_at = time.monotonic()
            if res.received.all():
                res.complete = True
                res.completed_at = time.monotonic()
                self._signal(res)

    def _scatter_host(self, layer: int, slots: np.ndarray, kv: np.ndarray) -> None:
        """Copy `kv` (`[2, tokens, heads, dim]`) into cache `slots` of `layer`: whole blocks
        as block rows (a shuffled block table costs one fancy-index copy of 12 KB rows, not
        one of sub-KB token rows), a partial block at either end token by token."""
        bs = self.layout.block_size
        head = min(len(slots), -int(slots[0]) % bs)  # tokens before the first block boundary
        whole = (len(slots) - head) // bs * bs
        for half in range(2):
            rows, src = self._np_rows[layer][half], kv[half]
            host_scatter(rows, slots[:head], src[:head])
            if whole:
                blocks = slots[head : head + whole : bs] // bs
                host_scatter(self._np_blocks[layer][half], blocks,
                             src[head : head + whole].reshape(-1, bs, *src.shape[1:]))
            host_scatter(rows, slots[head + whole :], src[head + whole :])

    def write_bytes(self, transfer_id: int, layer: int, token_start: int, num_tokens: int,
                    data: bytes, peer: str = "") -> None:
        """`write` for a payload that arrived as raw bytes (the grpc transport)."""
        expected = num_tokens * self.layout.token_bytes
        if len(data) != expected:
            raise TransferError(f"payload of {len(data)} bytes; expected {expected} for "
                                f"{num_tokens} tokens")
        payload = torch.frombuffer(bytearray(data), dtype=self.layout.torch_dtype)
        self.write(transfer_id, layer, token_start, num_tokens, payload, peer)

    def fail(self, transfer_id: int, error: str) -> None:
        """Mark a transfer failed (its waiter is woken); its blocks stay reserved until release."""
        with self._lock:
            res = self._by_id.get(transfer_id)
            if res is None or res.complete or res.error is not None:
                return
            res.error = error
            self._signal(res)

    def fail_peer(self, peer: str, error: str) -> None:
        """Fail every open transfer from `peer` (its connection broke)."""
        with self._lock:
            ids = [r.transfer_id for r in self._by_id.values() if r.peer == peer]
        for transfer_id in ids:
            self.fail(transfer_id, error)

    def release(self, transfer_id: int) -> None:
        """End a reservation; once this returns no write can touch its slots."""
        with self._lock:
            self._by_id.pop(transfer_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    @staticmethod
    def _signal(res: Reservation) -> None:
        res.done.set()
        if res.on_done is not None:
            res.on_done()
