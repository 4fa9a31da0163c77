"""A bounded log of prefix-cache changes (blocks stored and evicted), read by cursor.

Routers keep a per-worker index of the blocks each worker has cached (router/cache_index.py)
and bring it up to date by asking for the changes since the cursor they hold: the answer
is the net change (a block stored then evicted in between reads as evicted) and the next
cursor. A reader whose cursor has fallen out of the log, or comes from another log (a
restarted worker), is told to reset, and gets every cached hash instead.

Blocks are named by `key64`: the first 8 bytes of their chained content hash
(engine.block_hash), enough to tell a worker's cached blocks apart for routing; the KV
itself is only ever shared on the full 16-byte hash.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


def key64(digest: bytes) -> int:
    """A block's routing key: its hash's first 8 bytes, little-endian."""
    return int.from_bytes(digest[:8], "little")


@dataclass
class CacheDelta:
    next_cursor: int
    reset: bool = False  # `stored` is the whole cache: forget what you knew
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    since: int = 0  # the cursor this delta follows (0 with a reset)


class CacheEventLog:
    """Events numbered from 1; the log keeps the last `capacity` of them."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[tuple[int, bool]] = deque(maxlen=capacity)  # (key, stored?)
        self._last = 0  # number of the newest event

    def stored(self, digest: bytes) -> None:
        self._append(key64(digest), True)

    def removed(self, digest: bytes) -> None:
        self._append(key64(digest), False)

    def _append(self, key: int, stored: bool) -> None:
        self._events.append((key, stored))
        self._last += 1

    def since(self, cursor: int, snapshot: Callable[[], Iterable[bytes]], max_events: int = 1 << 16) -> CacheDelta:
        """The net change after event `cursor` (0: from the start). Resets, with
        `snapshot()`'s hashes as the whole cache, when `cursor` is older than the log holds,
        newer than it (another worker's cursor), or more than `max_events` behind."""
        oldest = self._last - len(self._events)  # events after this one are held
        if cursor < oldest or cursor > self._last or self._last - cursor > max_events:
            return CacheDelta(self._last, True, sorted({key64(d) for d in snapshot()}))
        net: dict[int, bool] = {}
        for key, stored in itertools.islice(self._events, len(self._events) - (self._last - cursor), None):
            net[key] = stored
        return CacheDelta(self._last, False, [k for k, s in net.items() if s], [k for k, s in net.items() if not s],
                          since=cursor)
