"""A bounded log of prefix-cache changes (blocks stored and evicted), read by cursor.

Routers keep a per-worker index of the blocks each worker has cached (router/cache_index.py)
and bring it up to date by asking for the changes since the cursor they hold: the answer
is the net change (a block stored then evicted in between reads as evicted) and the next
cursor. A reader whose cursor has fallen out of the log, or comes from another log (a
restarted worker), is told to reset, and gets every cached hash instead.

Blocks are named by `key64`: the first 8 bytes of their chained content hash
(engine.block_hash), enough to tell a worker's cached blocks apart for routing; the KV
itself is only ever shared on the full 16-byte hash.

With the second KV tier (engine.kv_tier), the log also carries the changes the worker's
store object made to the node's store (`attach_tier`): blocks it wrote ("tier stored") and
blocks it evicted or dropped ("tier removed"), drained from the store into the log at each
read (between engine steps). The store is shared by every worker on the node and each
reports only its own writes and evictions, so a router learns the node's store from the
union of its workers' reports (router/cache_index.py); a reset gives the whole store's
keys as this worker's store sees them (one index query: ~23k keys for 8 GiB of 368 KB
blocks).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol


def key64(digest: bytes) -> int:
    """A block's routing key: its hash's first 8 bytes, little-endian."""
    return int.from_bytes(digest[:8], "little")


@dataclass
class CacheDelta:
    next_cursor: int
    reset: bool = False  # `stored` and `tier_stored` are the whole pool and store: forget what you knew
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    since: int = 0  # the cursor this delta follows (0 with a reset)
    tier_stored: list[int] = field(default_factory=list)  # blocks this worker's store wrote to the node's tier
    tier_removed: list[int] = field(default_factory=list)  # ... evicted or dropped from it
    tier: str = ""  # the store these are about (its directory); "": no tier


class TierStore(Protocol):
    """What the log reads of the tier's store (engine.kv_store.KVStore)."""

    def watch_changes(self) -> None: ...
    def drain_changes(self) -> list[tuple[bytes, bool]] | None: ...
    def keys(self) -> list[bytes]: ...


class CacheEventLog:
    """Events numbered from 1; the log keeps the last `capacity` of them."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[tuple[int, bool, bool]] = deque(maxlen=capacity)  # (key, stored?, tier?)
        self._last = 0  # number of the newest event
        self._tier: TierStore | None = None
        self._tier_name = ""

    def stored(self, digest: bytes) -> None:
        self._append(key64(digest), True, False)

    def removed(self, digest: bytes) -> None:
        self._append(key64(digest), False, False)

    def attach_tier(self, store: TierStore, name: str) -> None:
        """Carry `store`'s changes (its writes and evictions, from now on) and, in resets,
        its keys; `name` identifies the store on its node (the workers naming it share it).
        Every reader's next read is a reset, from cursor 0 too: the store held blocks
        before any event."""
        store.watch_changes()
        self._tier, self._tier_name = store, name
        self._forget_events()

    def drain_tier(self) -> None:
        """Log the attached store's changes since the last drain. Changes it lost (too many
        undrained) make every reader's next read a reset."""
        if self._tier is None:
            return
        changes = self._tier.drain_changes()
        if changes is None:
            self._forget_events()
            return
        for digest, stored in changes:
            self._append(key64(digest), stored, True)

    def _forget_events(self) -> None:
        """Drop the held events: every cursor, the newest included, is now older than the
        log holds (and stays so for cursor 0)."""
        self._events.clear()
        self._last += 1

    def _append(self, key: int, stored: bool, tier: bool) -> None:
        self._events.append((key, stored, tier))
        self._last += 1

    def since(self, cursor: int, snapshot: Callable[[], Iterable[bytes]], max_events: int = 1 << 16) -> CacheDelta:
        """The net change after event `cursor` (0: from the start), the tier's drained in
        first. Resets, with `snapshot()`'s hashes as the whole cache and the store's keys as
        the whole tier, when `cursor` is older than the log holds, newer than it (another
        worker's cursor), or more than `max_events` behind."""
        self.drain_tier()
        oldest = self._last - len(self._events)  # events after this one are held
        if cursor < oldest or cursor > self._last or self._last - cursor > max_events:
            tier = self._tier.keys() if self._tier is not None else ()
            return CacheDelta(self._last, True, _keys(snapshot()), tier_stored=_keys(tier), tier=self._tier_name)
        net: dict[tuple[int, bool], bool] = {}  # (key, tier?) -> stored? by the last event
        for key, stored, tier in itertools.islice(self._events, len(self._events) - (self._last - cursor), None):
            net[key, tier] = stored
        lists: dict[tuple[bool, bool], list[int]] = {(s, t): [] for s in (True, False) for t in (True, False)}
        for (key, tier), stored in net.items():
            lists[stored, tier].append(key)
        return CacheDelta(self._last, False, lists[True, False], lists[False, False], since=cursor,
                          tier_stored=lists[True, True], tier_removed=lists[False, True], tier=self._tier_name)


def _keys(digests: Iterable[bytes]) -> list[int]:
    """The routing keys of `digests`, sorted, each once."""
    return sorted({key64(d) for d in digests})
