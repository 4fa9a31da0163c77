"""The second KV tier's first level on GPU workers: blocks kept in this process's pinned host
memory, in front of the node's file store (engine.kv_store), bounded in bytes, the least
recently used dropped first (engine.kv_tier uses it; docs/design.md, "Second KV tier").

    host = HostBlocks(budget_bytes=4 << 30, pin=True)
    host.put(block_hash, row)       # row: one block's payload, a 1-D uint8 CPU tensor
    n = host.leading(block_hashes)  # how many leading blocks it holds
    row = host.get(block_hash)      # the row (now the most recently used), or None

Why a level of its own: a GPU worker's pool is device memory, and the file store's blocks
reach it through pageable memory (read, checksum, copy to pinned staging inside CUDA's copy);
a block kept here goes to the device in one DMA from memory the copy engine reads directly,
and is never read back from the page cache or verified again (it never left this process).
A CPU worker has no use for it: its pool already is host memory, and the page cache keeps
the store's hot files there.

Rows are never written after `put` (the tier copies into a row before handing it over), so a
row may be shared with the file store's write queue and with a copy to the device still in
flight (torch's pinned allocator holds a freed row's memory until the copies that read it
are done). Only the engine thread uses a HostBlocks: no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

_EWMA_ALPHA = 0.2  # the weight of each new load in the measured bandwidth


class HostBlocks:
    """An LRU of block rows within `budget_bytes` (rows' bytes; dropping a row frees it).
    `pin`: allocate rows in page-locked memory (needs CUDA). Never raises for a full budget:
    a row that cannot fit is not kept."""

    def __init__(self, budget_bytes: int, *, pin: bool) -> None:
        self.budget_bytes, self.pin = budget_bytes, pin
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.counts = dict.fromkeys(("host_puts", "host_hits", "host_misses", "host_evicted"), 0)
        self._ewma_bytes = self._ewma_s = 0.0

    def empty_row(self, num_bytes: int) -> torch.Tensor:
        """A row to copy one block's payload into (pinned when `pin`)."""
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def put(self, key: bytes, row: torch.Tensor) -> bool:
        """Keep `row` (a 1-D uint8 CPU tensor, from `empty_row`, never written again) under
        `key` as the most recently used, dropping the least recently used rows to fit; a key
        held already only becomes the most recently used. False if it cannot fit at all."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return True
        size = row.numel()
        if size > self.budget_bytes:
            return False
        while self.bytes + size > self.budget_bytes:
            _, old = self._rows.popitem(last=False)
            self.bytes -= old.numel()
            self.counts["host_evicted"] += 1
        self._rows[key] = row
        self.bytes += size
        self.counts["host_puts"] += 1
        return True

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are held (a leading run)."""
        for i, key in enumerate(keys):
            if key not in self._rows:
                return i
        return len(keys)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The row under `key`, now the most recently used, or None."""
        row = self._rows.get(key)
        if row is None:
            self.counts["host_misses"] += 1
            return None
        self._rows.move_to_end(key)
        self.counts["host_hits"] += 1
        return row

    def observe_load(self, num_bytes: int, seconds: float) -> None:
        """Account a load of `num_bytes` of rows into the pool that took `seconds`."""
        if num_bytes > 0 and seconds > 0:
            weight = 1.0 if self._ewma_s == 0.0 else _EWMA_ALPHA
            self._ewma_bytes += weight * (num_bytes - self._ewma_bytes)
            self._ewma_s += weight * (seconds - self._ewma_s)

    def read_bandwidth(self) -> float:
        """Bytes/s of loads from here into the pool (0.0 until one was measured)."""
        return self._ewma_bytes / self._ewma_s if self._ewma_s > 0 else 0.0

    def stats(self) -> dict[str, int]:
        """Its counters, and `host_blocks` / `host_bytes` / `host_budget_bytes`."""
        return {**self.counts, "host_blocks": len(self._rows), "host_bytes": self.bytes,
                "host_budget_bytes": self.budget_bytes}


def row_view(row: torch.Tensor) -> memoryview:
    """A row's bytes without a copy (what the file store's put takes)."""
    return memoryview(row.numpy())
