"""The prefix-cache event log (engine) and the router's per-worker index built from it."""

import random

import pytest

from pdserve.engine.block_hash import prefix_hashes, root_hash
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cache_events import CacheEventLog, key64
from pdserve.router.cache_index import CacheIndex, PromptKeys

BS = 4
ROOT = root_hash("model|float32")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 50_000) for _ in range(n)]


def fill(bm: BlockManager, request_id: str, ids: list[int]) -> None:
    """Run a request's prompt through the block manager: allocate, compute, commit, free."""
    assert bm.allocate_slots(request_id, len(ids), bm.cached_prefix(ids)) is not None
    bm.commit(request_id, len(ids), lambda a, b: ids[a:b])
    bm.free(request_id)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sync(index: CacheIndex, worker: str, bm: BlockManager) -> None:
    delta = bm.cache_events(index.cursor(worker))
    index.apply(worker, delta.next_cursor, delta.reset, delta.stored, delta.removed)


def test_events_name_the_engines_blocks_and_net_out():
    log = CacheEventLog()
    a, b = b"a" * 16, b"b" * 16
    log.stored(a)
    log.stored(b)
    log.removed(a)
    delta = log.since(0, snapshot=lambda: [])
    assert not delta.reset and delta.stored == [key64(b)] and delta.removed == [key64(a)]
    assert log.since(delta.next_cursor, snapshot=lambda: []).stored == []


def test_a_reader_the_log_has_outrun_gets_the_whole_cache():
    log = CacheEventLog(capacity=2)
    for i in range(5):
        log.stored(bytes([i]) * 16)
    delta = log.since(1, snapshot=lambda: [b"x" * 16])
    assert delta.reset and delta.stored == [key64(b"x" * 16)] and delta.next_cursor == 5
    # a cursor from the future (another worker's) resets too
    assert log.since(99, snapshot=lambda: []).reset


def test_index_follows_the_block_manager_through_stores_and_evictions():
    bm = BlockManager(num_blocks=6, block_size=BS, root=ROOT)
    index = CacheIndex()
    index.add_worker("w", ROOT, BS)
    first, second = tokens(17, 1), tokens(17, 2)  # 4 full blocks each (the 17th token is the last)
    fill(bm, "r1", first)
    sync(index, "w", bm)
    assert index.matched_tokens("w", PromptKeys(first)) == 16
    assert index.matched_tokens("w", PromptKeys(second)) == 0
    fill(bm, "r2", second)  # 5 blocks needed of 6: evicts first's cached blocks (LRU)
    sync(index, "w", bm)
    assert index.matched_tokens("w", PromptKeys(first)) == len(bm.cached_prefix(first)) * BS < 16
    assert index.matched_tokens("w", PromptKeys(second)) == 16
    held, _ = index.size("w")
    assert held == sum(h is not None for h in bm._hash_of)


def test_match_stops_at_the_first_missing_block_and_never_counts_the_last_token():
    index = CacheIndex()
    index.add_worker("w", ROOT, BS)
    ids = tokens(12, 3)  # 3 full blocks; the last token's block is never a hit
    keys = [key64(h) for h in prefix_hashes(ids, BS, ROOT)]
    index.apply("w", 1, False, [keys[0], keys[2]], [])
    assert index.matched_tokens("w", PromptKeys(ids)) == BS
    index.apply("w", 2, False, [keys[1]], [])
    assert index.matched_tokens("w", PromptKeys(ids)) == 2 * BS  # block 3 holds token 12, the last


def test_expected_blocks_count_until_reported_or_expired():
    clock = Clock()
    index = CacheIndex(expect_ttl_s=10, clock=clock)
    index.add_worker("w", ROOT, BS)
    ids = tokens(13, 4)
    index.expect("w", PromptKeys(ids))
    assert index.matched_tokens("w", PromptKeys(ids)) == 12
    clock.now = 11
    assert index.matched_tokens("w", PromptKeys(ids)) == 0


def test_reported_blocks_do_not_expire_and_removal_beats_expectation():
    clock = Clock()
    index = CacheIndex(expect_ttl_s=10, clock=clock)
    index.add_worker("w", ROOT, BS)
    ids = tokens(13, 5)
    keys = PromptKeys(ids).keys(ROOT, BS)
    index.expect("w", PromptKeys(ids))
    index.apply("w", 1, False, keys, [])
    clock.now = 100
    assert index.matched_tokens("w", PromptKeys(ids)) == 12
    index.expect("w", PromptKeys(ids))
    index.apply("w", 2, False, [], keys[:1])
    assert index.matched_tokens("w", PromptKeys(ids)) == 0


def test_memory_is_bounded_and_a_leaving_worker_is_forgotten():
    index = CacheIndex(max_expected=8, max_held=20)
    index.add_worker("w", ROOT, BS)
    for seed in range(10):
        index.expect("w", PromptKeys(tokens(33, seed)))  # 8 blocks each
    assert index.size("w")[1] == 8
    index.apply("w", 7, False, list(range(21)), [])
    assert index.size("w")[0] == 0 and index.cursor("w") == 0  # past the cap: read again from scratch
    index.remove_worker("w")
    assert not index.tracks("w") and index.matched_tokens("w", PromptKeys(tokens(9, 1))) == 0


def test_a_worker_with_another_root_hashes_differently():
    index = CacheIndex()
    index.add_worker("a", ROOT, BS)
    index.add_worker("b", root_hash("other-model|float32"), BS)
    ids = tokens(9, 6)
    prompt = PromptKeys(ids)
    index.apply("a", 1, False, prompt.keys(ROOT, BS), [])
    index.apply("b", 1, False, prompt.keys(ROOT, BS), [])  # keys of another model's chain
    assert index.matched_tokens("a", prompt) == 8 and index.matched_tokens("b", prompt) == 0


@pytest.mark.parametrize("capacity", [1, 3, 1 << 16])
def test_index_equals_the_engines_cache_under_random_traffic(capacity):
    rng = random.Random(capacity)
    bm = BlockManager(num_blocks=24, block_size=BS, root=ROOT)
    bm.events = CacheEventLog(capacity)
    index = CacheIndex()
    index.add_worker("w", ROOT, BS)
    shared = tokens(8, 99)
    for i in range(60):
        ids = (shared if rng.random() < 0.5 else []) + tokens(rng.randrange(2, 30), i)
        fill(bm, f"r{i}", ids)
        if rng.random() < 0.4:
            sync(index, "w", bm)
    sync(index, "w", bm)
    truth = {key64(h) for h in bm._by_hash}
    assert index._workers["w"].held == truth
