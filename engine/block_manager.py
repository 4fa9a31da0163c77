"""KV block bookkeeping: block ids, reference counts, a free pool, one block table per
request, and (with prefix caching) an index of full blocks by content hash.

No tensors here: a block id indexes the `num_blocks` axis of the KV cache. A block is
either free or referenced by the tables of one or more requests. Only full blocks whose
every token is computed get a hash (engine.block_hash), and only hashed blocks are shared,
so a shared block is never written: no copy-on-write. A freed block that has a hash stays
in the cache, evictable, until its memory is needed: allocation takes never-hashed free
blocks first, then evicts the least recently freed cached block (dropping its hash).
Allocation that cannot be satisfied returns None and changes nothing; the caller decides
whether to wait or preempt.

    free (no hash) ──allocate──► in use (ref >= 1) ──free, no hash──► free (no hash)
                                   │  ▲
                   commit (full,   │  │ allocate with this prefix (ref += 1)
                   computed) adds  ▼  │
                   a hash      in use, hashed ──free, ref 0──► cached, evictable (LRU)
                                                                   │ evicted by allocate
                                                                   ▼
                                                               free (no hash)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from pdserve.engine.block_hash import block_hash
from pdserve.engine.cache_events import CacheDelta, CacheEventLog


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 root: bytes = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.root = enable_prefix_caching, root
        self._free: deque[int] = deque(range(num_blocks))  # never hashed (or evicted)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed, oldest first
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per request: hashes of its full computed blocks
        self.events = CacheEventLog()  # blocks indexed and evicted, for routers (cache_events)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones plus cached ones it may evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their content (evictable)."""
        return len(self._evictable)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached run of full blocks at the start of `token_ids`
        (none when prefix caching is off). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        blocks, parent, bs = [], self.root, self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = block_hash(parent, token_ids[start : start + bs])
            block = self._by_hash.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: list[int] = ()) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens; a request without a table
        may start it with `prefix`, cached blocks from `cached_prefix` (shared, not copied).

        Returns the newly allocated block ids (not the prefix), or None, changing nothing,
        when too few blocks are free.
        """
        table = self._tables.get(request_id)
        if table is not None and prefix:
            raise ValueError(f"request {request_id!r} already has blocks; a prefix only starts a table")
        have = len(table) if table is not None else len(prefix)
        missing = max(self.blocks_for_tokens(num_tokens) - have, 0)
        revived = sum(1 for b in prefix if self._ref[b] == 0)  # leave the free pool
        if missing + revived > self.num_free_blocks:
            return None
        if table is None:
            table = self._tables[request_id] = []
            self._hashes[request_id] = []
            for block in prefix:
                self._take(block)
                self._hashes[request_id].append(self._hash_of[block])
            table.extend(prefix)
        new_blocks = [self._pop_free() for _ in range(missing)]
        for block in new_blocks:
            self._ref[block] = 1
        table.extend(new_blocks)
        return new_blocks

    def commit(self, request_id: str, num_computed_tokens: int,
               tokens: Callable[[int, int], list[int]]) -> list[tuple[int, bytes]]:
        """Hash the request's full blocks that `num_computed_tokens` now covers, and index
        them for reuse; `tokens(start, end)` gives the request's token ids in that range.
        Returns the (block, hash) pairs newly indexed (content the cache did not hold yet)."""
        stored: list[tuple[int, bytes]] = []
        if not self.enable_prefix_caching or request_id not in self._tables:
            return stored
        hashes, table, bs = self._hashes[request_id], self._tables[request_id], self.block_size
        for index in range(len(hashes), min(num_computed_tokens // bs, len(table))):
            parent = hashes[-1] if hashes else self.root
            digest = block_hash(parent, tokens(index * bs, (index + 1) * bs))
            hashes.append(digest)
            block = table[index]
            if digest not in self._by_hash and self._hash_of[block] is None:
                self._by_hash[digest] = block  # else: the same content is cached already
                self._hash_of[block] = digest
                self.events.stored(digest)
                stored.append((block, digest))
        return stored

    def free(self, request_id: str) -> int:
        """Drop the request's references (last block first, so a prefix outlives its tail
        in the LRU); returns how many it held. Idempotent."""
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        for block in reversed(table):
            if self._ref[block] < 1:
                raise RuntimeError(f"block {block} of {request_id!r} has no reference left to free")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash_of[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        return len(table)

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of[block]]
        self.events.removed(self._hash_of[block])
        self._hash_of[block] = None
        return block

    def cache_events(self, cursor: int, max_events: int = 1 << 16) -> CacheDelta:
        """Blocks indexed and evicted since `cursor` (engine.cache_events)."""
        return self.events.since(cursor, lambda: self._by_hash.keys(), max_events)

    def check_integrity(self) -> None:
        """Raise naming the counts if any block is lost, double-counted, or mis-indexed."""
        problems = []
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                counts[block] += 1
        if counts != self._ref:
            wrong = [b for b in range(self.num_blocks) if counts[b] != self._ref[b]]
            problems.append(f"{len(wrong)} block(s) whose ref count differs from the tables, e.g. {wrong[:3]}")
        free, evictable = set(self._free), set(self._evictable)
        in_use = {b for b in range(self.num_blocks) if counts[b] > 0}
        if len(free) != len(self._free):
            problems.append(f"{len(self._free) - len(free)} duplicate(s) in the free list")
        if free & evictable or (free | evictable) & in_use:
            problems.append("a block is in two of free / cached-evictable / in use")
        if len(free) + len(evictable) + len(in_use) != self.num_blocks:
            problems.append(f"free {len(free)} + cached {len(evictable)} + in use {len(in_use)} "
                            f"!= capacity {self.num_blocks}")
        if any(self._hash_of[b] is None for b in evictable) or any(self._hash_of[b] is not None for b in free):
            problems.append("a cached block without a hash, or a free block with one")
        if len(self._by_hash) != sum(h is not None for h in self._hash_of) or any(
                self._hash_of[b] != h for h, b in self._by_hash.items()):
            problems.append("the hash index disagrees with the blocks' hashes")
        if problems:
            raise AssertionError("block manager integrity: " + "; ".join(problems))
