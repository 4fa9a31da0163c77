"""The router's index of the KV blocks each worker has cached, for cache-aware routing.

Per worker, two sets of block keys (engine.cache_events.key64 of the chained block hashes
that worker's engine computes, from the root it reports in Info):

- `held`: what the worker reported in its updates (router/registry.py), exact as of the
  last one;
- `expected`: what this router routed to it since (the prompt's full blocks when a request
  is sent, the prompt's and output's when it finishes), which the worker will report
  shortly. An expected key expires after `expect_ttl_s` unless reported, so a wrong guess
  costs a few seconds of mis-routing at most.

A prompt matches a worker on its longest run of leading full blocks found in either set,
excluding the last prompt token (which is always computed, as in the engine). Memory is
bounded: `held` by the worker's own block count (and `max_held`, past which the worker is
re-read from scratch), `expected` by `max_expected` per worker (oldest dropped). A worker
that leaves the pool is forgotten whole.

Beside the per-worker sets, the index keeps their inverse, key -> the workers holding it as a
bit mask (one map for `held`, one for `expected`), updated by every mutation, so
`matched_all` finds every worker's match in one walk over the prompt's keys instead of one
walk per worker, narrowing a mask of the workers still matching.

**The second KV tier** (engine.kv_tier): per node, the blocks in the store its workers share
(`NodeTier`, one per (node, store directory): workers with the tier off join none), from the
tier events of their deltas. Every worker's store object reports the changes IT made to the
shared store (blocks it wrote, blocks it evicted: also blocks another worker wrote), so the
node's set is not a union of per-worker contributions (one would keep a block worker B
wrote after worker A's store evicted it) but one set that every worker's report changes: a
write adds, an eviction removes, and a reset (its keys are the whole store, as that
worker's store reads it) replaces the set. Each write and eviction is reported once, by the
worker that made it; what this cannot order is two workers' reports of one block within a
report interval (one writes it just as another evicts it), which leaves that block wrong
until the next reset of any worker on the node (routing: a load that misses, or a hit not
scored). A node's set is kept while one of its workers is, and bounded like `held`. Its
inverse is a bit mask per key too (`_tier_by`, a bit per node store), so `matched_by_tier`
continues each worker's walk past its pool match through its node's tier in the same walk.
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
    bit: int = 0  # this worker's bit in the index's holder masks
    node: str = ""  # the node it runs on: whose tier it may load from
    tier: tuple[str, str] | None = None  # its NodeTier's (node, store), None: no tier


@dataclass
class NodeTier:
    """One node's second-KV-tier store as its workers report it (see the module docstring)."""

    bit: int  # its bit in the index's tier masks
    keys: set[int] = field(default_factory=set)
    workers: int = 0  # the bits of the workers on it


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
        # The inverse of every worker's `held` and `expected`, as bit masks of workers (each
        # worker has a bit of its own, `WorkerCache.bit`; invariant: w's bit is in
        # _held_by[k] iff k in _workers[w].held, likewise for expected; no zero masks are
        # kept). A mask is a small int where a set of names was a set object: a third of
        # the memory per indexed block.
        self._held_by: dict[int, int] = {}
        self._expected_by: dict[int, int] = {}
        self._named: dict[int, str] = {}  # bit -> worker id
        # The node tiers and their inverse: key -> the NodeTiers holding it as a mask of
        # their bits (invariant: t's bit is in _tier_by[k] iff k in t.keys; no zero masks).
        self._tiers: dict[tuple[str, str], NodeTier] = {}
        self._tier_named: dict[int, NodeTier] = {}  # bit -> node tier
        self._tier_by: dict[int, int] = {}

    # ------------------------------------------------------------ membership
    def add_worker(self, worker_id: str, root: bytes, block_size: int, node: str = "") -> None:
        """Start tracking a worker whose engine hashes blocks from `root` (idempotent), on
        `node` (whose KV tier it shares; "": a node of its own)."""
        if worker_id not in self._workers and root and block_size > 0:
            bit = _free_bit(self._named)
            self._named[bit] = worker_id
            self._workers[worker_id] = WorkerCache(root, block_size, bit=bit, node=node or f"worker {worker_id}")

    def remove_worker(self, worker_id: str) -> None:
        cache = self._workers.pop(worker_id, None)
        if cache is not None:
            self._leave_tier(cache)
            _unlink(self._held_by, cache.bit, cache.held)
            _unlink(self._expected_by, cache.bit, cache.expected)
            del self._named[cache.bit]

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

    def tier_size(self, worker_id: str) -> int:
        """Blocks the index holds for `worker_id`'s node's tier (0: it has none)."""
        tier = self._tier_of(self._workers.get(worker_id))
        return len(tier.keys) if tier else 0

    # ------------------------------------------------------------ updates
    def apply(self, worker_id: str, next_cursor: int, reset: bool, stored, removed, since: int | None = None,
              tier_stored=(), tier_removed=(), tier: str = "") -> bool:
        """Apply a worker's cache delta (`stored`, `removed`: lists of keys): `held` becomes
        `stored` on a reset, else gains `stored` then loses `removed`; every key in either
        leaves `expected` (confirmed or contradicted). Its node's tier likewise, from
        `tier_stored` and `tier_removed`; a reset also puts the worker on its node's store
        named `tier` ("": none; a worker's first delta with a tier is a reset,
        engine.cache_events). A delta that is not a reset and follows another cursor than
        the one held (`since`, when given) is refused: events were missed, the worker's
        cursor drops to 0 (the next read is a reset) and the answer is False."""
        cache = self._workers.get(worker_id)
        if cache is None:
            return True
        if not reset and since is not None and since != cache.cursor:
            cache.cursor = 0
            return False
        if reset:
            self._drop_held(worker_id, cache, cache.held.difference(stored))
            self._join_tier(cache, tier)
        self._add_held(worker_id, cache, stored)
        if not reset:
            self._drop_held(worker_id, cache, removed)
        for key in (*stored, *removed):  # confirmed or contradicted
            self._drop_expected(worker_id, cache, key)
        cache.cursor = next_cursor
        if len(cache.held) > self.max_held:  # more than any worker holds: re-read it whole
            self._drop_held(worker_id, cache, set(cache.held))
            cache.cursor = 0
        node_tier = self._tier_of(cache)
        if node_tier is not None:
            if reset:
                _drop(self._tier_by, node_tier.bit, node_tier.keys, node_tier.keys.difference(tier_stored))
            _add(self._tier_by, node_tier.bit, node_tier.keys, tier_stored)
            _drop(self._tier_by, node_tier.bit, node_tier.keys, tier_removed)
            if len(node_tier.keys) > self.max_held:  # likewise: re-read from this worker
                _drop(self._tier_by, node_tier.bit, node_tier.keys, set(node_tier.keys))
                cache.cursor = 0
        return True

    def _add_held(self, worker_id: str, cache: WorkerCache, keys) -> None:
        _add(self._held_by, cache.bit, cache.held, keys)

    def _drop_held(self, worker_id: str, cache: WorkerCache, keys) -> None:
        _drop(self._held_by, cache.bit, cache.held, keys)

    def _tier_of(self, cache: WorkerCache | None) -> NodeTier | None:
        return self._tiers.get(cache.tier) if cache is not None and cache.tier is not None else None

    def _join_tier(self, cache: WorkerCache, store: str) -> None:
        """Make `cache`'s worker one of the workers of its node's tier in `store` ("": of none)."""
        wanted = (cache.node, store) if store else None
        if cache.tier == wanted:
            return
        self._leave_tier(cache)
        if wanted is None:
            return
        node_tier = self._tiers.get(wanted)
        if node_tier is None:
            node_tier = self._tiers[wanted] = NodeTier(_free_bit(self._tier_named))
            self._tier_named[node_tier.bit] = node_tier
        node_tier.workers |= cache.bit
        cache.tier = wanted

    def _leave_tier(self, cache: WorkerCache) -> None:
        """Take `cache`'s worker off its node's tier, forgotten with its last worker."""
        node_tier = self._tier_of(cache)
        if node_tier is not None:
            node_tier.workers &= ~cache.bit
            if not node_tier.workers:
                _unlink(self._tier_by, node_tier.bit, node_tier.keys)
                del self._tiers[cache.tier], self._tier_named[node_tier.bit]
        cache.tier = None

    def _drop_expected(self, worker_id: str, cache: WorkerCache, key: int) -> None:
        if cache.expected.pop(key, None) is not None:
            _unlink(self._expected_by, cache.bit, (key,))

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
                self._expected_by[key] = self._expected_by.get(key, 0) | cache.bit
        while len(cache.expected) > self.max_expected:
            key, _ = cache.expected.popitem(last=False)
            _unlink(self._expected_by, cache.bit, (key,))

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
                self._drop_expected(worker_id, cache, key)
                break
            run += 1
        return run * cache.block_size

    def matched_all(self, worker_ids, prompt: PromptKeys) -> dict[str, int]:
        """`matched_tokens(w, prompt)` for every w in `worker_ids` (0 for an untracked one),
        with the same effect on the index (an expired expectation a walk meets is dropped),
        in one walk over the prompt's keys per (root, block size) rather than one per worker:
        it costs about the prompt's blocks plus the workers, not their product, when a key is
        held by every tracked worker or by few."""
        return self.matched_by_tier(worker_ids, prompt)[0]

    def matched_by_tier(self, worker_ids, prompt: PromptKeys) -> tuple[dict[str, int], dict[str, int]]:
        """(pool, tier) per w in `worker_ids`: pool[w] as `matched_all` gives it; tier[w] the
        prompt tokens after those that w's node's tier holds, a leading run of whole blocks
        (0 without a tier): what w would load rather than compute. The same walks."""
        matched, tiered = dict.fromkeys(worker_ids, 0), dict.fromkeys(worker_ids, 0)
        groups: dict[tuple[bytes, int], int] = {}  # (root, block size) -> mask of its workers asked
        for worker_id in matched:
            cache = self._workers.get(worker_id)
            if cache is not None:
                group = (cache.root, cache.block_size)
                groups[group] = groups.get(group, 0) | cache.bit
        now = self.clock()
        with_tier = 0  # the workers on a node tier
        for node_tier in self._tiers.values():
            with_tier |= node_tier.workers
        for (root, block_size), active in groups.items():
            self._walk(prompt.keys(root, block_size), block_size, active, now, matched, tiered, with_tier)
        return matched, tiered

    def _walk(self, keys: list[int], block_size: int, active: int, now: float, matched: dict[str, int],
              tiered: dict[str, int], with_tier: int) -> None:
        """Set matched[w] for each w in `active` (a mask of workers sharing `keys`' root and
        block size): the leading keys found in its `held`, or in its unexpired `expected`,
        times `block_size`; and for those in `with_tier`, tiered[w]: the keys after those
        that its node's tier holds, times `block_size`. Walks `keys` in order keeping the
        workers still matching either way; stops when none remain."""
        run, tiering = 0, 0  # tiering: workers past their pool match, still matching in their node's tier
        for key in keys:
            staying = active & self._held_by.get(key, 0)
            if staying != active:  # else every worker still matching holds it
                for bit in _bits(active & self._expected_by.get(key, 0) & ~staying):
                    cache = self._workers[self._named[bit]]
                    if cache.expected[key] < now:
                        self._drop_expected(self._named[bit], cache, key)
                    else:
                        staying |= bit
                for bit in _bits(active & ~staying):
                    matched[self._named[bit]] = run * block_size
                tiering |= active & ~staying & with_tier
                active = staying
            if tiering:
                holding = self._tier_holders(key)
                for bit in _bits(tiering & ~holding):
                    name = self._named[bit]
                    tiered[name] = run * block_size - matched[name]
                tiering &= holding
            if not (active | tiering):
                return
            run += 1
        for bit in _bits(active):
            matched[self._named[bit]] = run * block_size
        for bit in _bits(tiering):
            name = self._named[bit]
            tiered[name] = run * block_size - matched[name]

    def _tier_holders(self, key: int) -> int:
        """The workers whose node's tier holds `key`, as a mask of their bits."""
        workers = 0
        for bit in _bits(self._tier_by.get(key, 0)):
            workers |= self._tier_named[bit].workers
        return workers


def _bits(mask: int):
    """The set bits of `mask`, lowest first, each as a mask of its own."""
    while mask:
        bit = mask & -mask
        yield bit
        mask ^= bit


def _free_bit(named: dict[int, object]) -> int:
    """The lowest bit not in `named`: masks stay as short as the pool is."""
    bit = 1
    while bit in named:
        bit <<= 1
    return bit


def _add(holders: dict[int, int], bit: int, have: set[int], keys) -> None:
    """Add `keys` to the set `have` whose owner is `bit`, and `bit` to their holders."""
    new = set(keys).difference(have)
    have |= new
    for key in new:
        holders[key] = holders.get(key, 0) | bit


def _drop(holders: dict[int, int], bit: int, have: set[int], keys) -> None:
    """Remove `keys` from the set `have` whose owner is `bit`, and `bit` from their holders."""
    gone = have.intersection(keys)
    have -= gone
    _unlink(holders, bit, gone)


def _unlink(holders: dict[int, int], bit: int, keys) -> None:
    """Clear `bit` in holders[key] for each of `keys`, dropping emptied entries."""
    for key in keys:
        mask = holders.get(key)
        if mask is not None:
            mask &= ~bit
            if mask:
                holders[key] = mask
            else:
                del holders[key]
