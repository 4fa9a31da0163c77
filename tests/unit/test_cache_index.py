"""The prefix-cache event log (engine) and the router's per-worker index built from it."""

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ---------------------------------------------------------------- one walk for every worker
ROOTS = (ROOT, root_hash("other-model|float32"))
WORKERS = ("a", "b", "c", "d", "e")
BASE = tokens(40, 123)
PROMPTS = [BASE[:n] + tokens(m, n * 100 + m) for n in (0, 8, 17, 40) for m in (0, 1, 9)]


def _op():
    """One step on the index, as a hypothesis strategy: a CacheEvents answer storing the
    first blocks of one prompt (as the worker hashes it) and removing a run of another's, an
    expectation, time passing, a worker leaving or joining, or a lookup."""
    worker, prompt, blocks = st.sampled_from(WORKERS), st.sampled_from(range(len(PROMPTS))), st.integers(0, 12)
    return st.one_of(
        st.tuples(st.just("apply"), worker, st.booleans(), prompt, blocks, prompt, blocks, blocks),
        st.tuples(st.just("expect"), worker, prompt),
        st.tuples(st.just("tick"), st.floats(0, 20)),
        st.tuples(st.just("leave"), worker),
        st.tuples(st.just("join"), worker, st.sampled_from(ROOTS), st.sampled_from((BS, 2 * BS))),
        st.tuples(st.just("match"), prompt),
    )


def _run(index: CacheIndex, clock: Clock, op: tuple) -> None:
    kind, *args = op
    if kind == "apply" and index.tracks(args[0]):
        worker, reset, stored, upto, removed, start, stop = args
        cache = index._workers[worker]
        keys = [PromptKeys(PROMPTS[i]).keys(cache.root, cache.block_size) for i in (stored, removed)]
        index.apply(worker, index.cursor(worker) + 1, reset, keys[0][:upto], keys[1][start:stop])
    elif kind == "expect":
        index.expect(args[0], PromptKeys(PROMPTS[args[1]]))
    elif kind == "tick":
        clock.now += args[0]
    elif kind == "leave":
        index.remove_worker(args[0])
    elif kind == "join":
        index.add_worker(*args)
    elif kind == "match":
        index.matched_all(WORKERS, PromptKeys(PROMPTS[args[0]]))


def _inverse(index: CacheIndex) -> tuple[dict, dict]:
    """The key -> holders masks the per-worker sets imply (each worker's bit its own)."""
    held, expected = {}, {}
    bits = [cache.bit for cache in index._workers.values()]
    assert all(bit and bit & (bit - 1) == 0 for bit in bits) and len(set(bits)) == len(bits)
    for cache in index._workers.values():
        for key in cache.held:
            held[key] = held.get(key, 0) | cache.bit
        for key in cache.expected:
            expected[key] = expected.get(key, 0) | cache.bit
    return held, expected


@given(ops=st.lists(_op(), max_size=40),
       probe=st.sampled_from(range(len(PROMPTS))), asked=st.permutations([*WORKERS, "nobody"]),
       mixed=st.booleans())
@settings(max_examples=300, deadline=None)
def test_one_walk_matches_every_worker_as_the_per_worker_walk_does(ops, probe, asked, mixed):
    """matched_all == {w: matched_tokens(w)} (same keys, same order, same expired entries
    dropped) after any mix of stores, evictions, resets, expectations, expiry, joins and
    leaves; and the key -> holders maps stay the exact inverse of the per-worker sets."""
    clock = Clock()
    index = CacheIndex(expect_ttl_s=10.0, max_expected=20, max_held=30, clock=clock)
    for worker in WORKERS:  # all alike, or three alike, one of another model, one of another block size
        index.add_worker(worker, ROOTS[mixed and worker == "d"], 2 * BS if mixed and worker == "e" else BS)
    for op in ops:
        _run(index, clock, op)
        assert (index._held_by, index._expected_by) == _inverse(index)
    prompt = PromptKeys(PROMPTS[probe])
    reference = copy.deepcopy(index)
    expected = {w: reference.matched_tokens(w, prompt) for w in asked}
    got = index.matched_all(asked, prompt)
    assert got == expected and list(got) == list(expected)
    assert {w: (c.held, dict(c.expected)) for w, c in index._workers.items()} == \
        {w: (c.held, dict(c.expected)) for w, c in reference._workers.items()}
    assert (index._held_by, index._expected_by) == _inverse(index)


def test_one_walk_where_all_but_one_or_every_worker_holds_the_prefix():
    index = CacheIndex()
    for worker in WORKERS:
        index.add_worker(worker, ROOT, BS)
    prompt = PromptKeys(PROMPTS[-1])
    for worker in WORKERS[:-1]:
        index.apply(worker, 1, False, prompt.keys(ROOT, BS), [])
    index.apply(WORKERS[-1], 1, False, prompt.keys(ROOT, BS)[:3], [])
    full = len(prompt.keys(ROOT, BS)) * BS
    assert index.matched_all(WORKERS, prompt) == {**dict.fromkeys(WORKERS[:-1], full), WORKERS[-1]: 3 * BS}
    index.apply(WORKERS[-1], 2, False, prompt.keys(ROOT, BS), [])
    assert index.matched_all(WORKERS, prompt) == dict.fromkeys(WORKERS, full)
