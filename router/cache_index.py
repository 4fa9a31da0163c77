"""The router's index of the KV blocks each worker has cached, for cache-aware routing.

Per worker, two sets of block keys (engine.cache_events.key64 of the chained block hashes
that worker's engine computes, from the root it reports in Info):

- `held`: what the worker reported through CacheEvents (polled with its Stats), exact as
  of the last poll;
- `expected`: what this router routed to it since (the prompt's full blocks when a request
  is sent, the prompt's and output's when it finishes), which the worker will report
  shortly. An expected key expires after `expect_ttl_s` unless reported, so a wrong guess
  costs a few seconds of mis-routing at most.

A prompt matches a worker on its longest run of leading full blocks found in either set,
excluding the last prompt token (which is always computed, as in the engine). Memory is
bounded: `held` by the worker's own block count (and `max_held`, past which the worker is
re-read from scratch), `expected` by `max_expected` per worker (oldest dropped). A worker
that leaves the pool is forgotten whole.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.block_hash import prefix_hashes
from pdserve.engine.cache_events import key64


@dataclass
class WorkerCache:
    root: bytes
    block_size: int
    cursor: int = 0
    held: set[int] = field(default_factory=set)
    expected: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> expiry (clock)


class PromptKeys:
    """One prompt's block keys, computed once per (root, block size) however many workers
    share them."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self._memo: dict[tuple[bytes, int], list[int]] = {}

    def keys(self, root: bytes, block_size: int) -> list[int]:
        """Keys of the full blocks of all tokens but the last (the engine always computes
        the last prompt token, so its block is never a hit)."""
        if (root, block_size) not in self._memo:
            self._memo[root, block_size] = [key64(h) for h in prefix_hashes(self.token_ids[:-1], block_size, root)]
        return self._memo[root, block_size]


class CacheIndex:
    def __init__(self, expect_ttl_s: float = 30.0, max_expected: int = 1 << 16, max_held: int = 1 << 22,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.expect_ttl_s, self.max_expected, self.max_held = expect_ttl_s, max_expected, max_held
        self.clock = clock
        self._workers: dict[str, WorkerCache] = {}

    # ------------------------------------------------------------ membership
    def add_worker(self, worker_id: str, root: bytes, block_size: int) -> None:
        """Start tracking a worker whose engine hashes blocks from `root` (idempotent)."""
        if worker_id not in self._workers and root and block_size > 0:
            self._workers[worker_id] = WorkerCache(root, block_size)

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def tracks(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def cursor(self, worker_id: str) -> int:
        cache = self._workers.get(worker_id)
        return cache.cursor if cache else 0

    def size(self, worker_id: str) -> tuple[int, int]:
        """(held, expected) entries for `worker_id`."""
        cache = self._workers.get(worker_id)
        return (len(cache.held), len(cache.expected)) if cache else (0, 0)

    # ------------------------------------------------------------ updates
    def apply(self, worker_id: str, next_cursor: int, reset: bool, stored, removed) -> None:
        """Apply a worker's CacheEvents answer."""
        cache = self._workers.get(worker_id)
        if cache is None:
            return
        if reset:
            cache.held = set(stored)
        else:
            cache.held.update(stored)
            cache.held.difference_update(removed)
        for key in stored:
            cache.expected.pop(key, None)  # confirmed
        for key in removed:
            cache.expected.pop(key, None)
        cache.cursor = next_cursor
        if len(cache.held) > self.max_held:  # more than any worker holds: re-read it whole
            cache.held.clear()
            cache.cursor = 0

    def expect(self, worker_id: str, prompt: PromptKeys) -> None:
        """`worker_id` is about to hold the full blocks of `prompt` (all tokens but the last)."""
        cache = self._workers.get(worker_id)
        if cache is None:
            return
        expiry = self.clock() + self.expect_ttl_s
        for key in prompt.keys(cache.root, cache.block_size):
            if key not in cache.held:
                cache.expected[key] = expiry
                cache.expected.move_to_end(key)
        while len(cache.expected) > self.max_expected:
            cache.expected.popitem(last=False)

    # ------------------------------------------------------------ queries
    def matched_tokens(self, worker_id: str, prompt: PromptKeys) -> int:
        """Leading prompt tokens `worker_id` is expected to have cached (whole blocks)."""
        cache = self._workers.get(worker_id)
        if cache is None:
            return 0
        now, run = self.clock(), 0
        for key in prompt.keys(cache.root, cache.block_size):
            if key in cache.held:
                run += 1
                continue
            expiry = cache.expected.get(key)
            if expiry is None:
                break
            if expiry < now:
                del cache.expected[key]
                break
            run += 1
        return run * cache.block_size
