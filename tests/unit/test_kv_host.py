"""The second KV tier's host level (engine.kv_host.HostBlocks: an LRU of block rows within a
byte budget, pinned on GPU workers; unpinned here, no CUDA) and the tier using it in front of
its store (engine.kv_tier.KVTier with `host`): blocks written go to both, a plan reads the
host level first, a load from it never touches the store, a block read from the store is
kept in host memory, and the decision weighs each level at its own measured bandwidth."""

import torch

from pdserve.engine.block_hash import prefix_hashes
from pdserve.engine.kv_host import HostBlocks
from pdserve.engine.kv_tier import KVTier
from tests.unit.test_kv_tier_scheduler import BLOCK, PROMPT, ROOT, DictCache, DictStore, payload_of


def row(n: int, value: int = 0) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.uint8)


def test_rows_are_kept_least_recently_used_within_the_budget():
    host = HostBlocks(300, pin=False)
    assert host.put(b"a", row(100)) and host.put(b"b", row(100)) and host.put(b"c", row(100))
    assert host.get(b"a") is not None  # a is now the most recently used: b goes first
    assert host.put(b"d", row(100)) and b"b" not in host and host.bytes == 300
    assert host.put(b"c", row(100, 9)) and int(host.get(b"c")[0]) == 0  # held already: kept, only touched
    assert not host.put(b"huge", row(301)) and b"huge" not in host  # can never fit
    assert host.leading([b"a", b"c", b"b", b"d"]) == 2
    stats = host.stats()
    assert stats["host_blocks"] == 3 and stats["host_evicted"] == 1 and stats["host_bytes"] == 300
    assert host.get(b"b") is None and host.stats()["host_misses"] == 1


def test_the_measured_bandwidth_is_an_average_of_the_loads():
    host = HostBlocks(1 << 20, pin=False)
    assert host.read_bandwidth() == 0.0  # unmeasured
    host.observe_load(1000, 0.001)
    assert host.read_bandwidth() == 1e6
    host.observe_load(1000, 0.002)
    assert 1e6 / 2 < host.read_bandwidth() < 1e6


class CountingStore(DictStore):
    def __init__(self, bandwidth: float = 0.0) -> None:
        super().__init__(bandwidth)
        self.gets = 0

    def get(self, key):
        self.gets += 1
        return super().get(key)


def tier_with_host(host_budget: int = 1 << 20, bandwidth: float = 0.0):
    store, cache, host = CountingStore(bandwidth), DictCache(), HostBlocks(host_budget, pin=False)
    return KVTier(store, cache, BLOCK, ROOT, host=host), store, cache, host


def written(tier: KVTier, cache: DictCache, num_blocks: int) -> list[bytes]:
    """Write PROMPT's first `num_blocks` blocks through the tier (as the scheduler's commit
    does); their keys."""
    keys = prefix_hashes(PROMPT, BLOCK, ROOT)[:num_blocks]
    for block, start in enumerate(range(0, num_blocks * BLOCK, BLOCK)):
        cache.blocks[block] = payload_of(PROMPT[start:start + BLOCK])
    tier.write(list(enumerate(keys)))
    return keys


def test_written_blocks_go_to_host_memory_and_the_store_and_load_from_host_memory_first():
    tier, store, cache, host = tier_with_host()
    keys = written(tier, cache, 3)
    assert all(k in host for k in keys) and store.contains(keys) == 3 and tier.num_blocks_written == 3
    tier.write([(0, keys[0])])  # held already: not copied out again
    assert cache.num_read == 3
    plan = tier.plan(PROMPT[:-1], 0)
    assert plan.keys == keys and plan.num_host == 3 and plan.load
    assert tier.apply(plan, [10, 11, 12]) == 3 and store.gets == 0  # all from host memory
    assert [cache.blocks[b] for b in (10, 11, 12)] == [cache.blocks[b] for b in (0, 1, 2)]
    assert host.read_bandwidth() > 0  # the load measured it


def test_a_block_only_the_store_holds_is_read_from_it_and_kept_in_host_memory():
    tier, store, cache, host = tier_with_host(host_budget=3 * DictCache.block_bytes)  # room for three
    keys = written(tier, cache, 3)
    host.put(b"other", row(DictCache.block_bytes))  # another request's block
    assert keys[0] not in host and keys[1] in host  # the first was dropped from host memory
    plan = tier.plan(PROMPT[:-1], 0)
    assert plan.num_host == 0 and len(plan.keys) == 3  # the run starts in the store
    assert tier.apply(plan, [20, 21, 22]) == 3 and store.gets == 1  # the rest from host memory
    assert all(k in host for k in keys) and b"other" not in host  # kept, dropping the other's block
    assert [cache.blocks[b] for b in (20, 21, 22)] == [cache.blocks[b] for b in (0, 1, 2)]


def test_each_level_is_weighed_at_its_own_bandwidth():
    tier, store, cache, host = tier_with_host(bandwidth=1.0)  # the store: 1 byte/s
    written(tier, cache, 2)
    tier.observe_prefill(BLOCK * 1000, 1.0)  # 1000 blocks/s
    host.observe_load(cache.block_bytes, 1.0)  # host memory: one block a second, slower than computing
    assert not tier.plan(PROMPT[:-1], 0).load
    host.observe_load(cache.block_bytes * 10**6, 1.0)
    host.observe_load(cache.block_bytes * 10**6, 1e-3)
    assert tier.plan(PROMPT[:-1], 0).load  # from host memory only: now faster
    small, _, small_cache, small_host = tier_with_host(host_budget=DictCache.block_bytes, bandwidth=1.0)
    written(small, small_cache, 2)  # host memory keeps the second block only
    small.observe_prefill(BLOCK * 1000, 1.0)
    small_host.observe_load(small_cache.block_bytes * 10**6, 1e-3)
    plan = small.plan(PROMPT[:-1], 0)
    assert plan.num_host == 0 and len(plan.keys) == 2 and not plan.load  # the run starts in the slow store
