"""The second KV tier, router side (issue 50): the event log carries the changes a worker's
store made to its node's tier (engine.cache_events, engine.kv_store), the router's index keeps
one tier per node from every worker's reports (router.cache_index), the cache-aware policy
weighs a tier hit between a pool hit and a miss (router.policies), and metrics and
`pdserve status` show tier hits apart; AsyncEngine.stop writes what the store queued.
Through real worker processes: tests/integration/test_kv_tier_routing.py."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.cli_service import print_status
from pdserve.engine import kv_store
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.block_hash import root_hash
from pdserve.engine.cache_events import CacheEventLog, key64
from pdserve.engine.kv_store import KVStore
from pdserve.engine.kv_tier import KVTier
from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.cache_index import CacheIndex, PromptKeys
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import CacheAware, CacheAwareWeights, RouteRequest
from pdserve.router.registry import WorkerView

BS = 4
ROOT = root_hash("model|float32")
PAYLOAD = 1000  # bytes per block


def digest(i: int) -> bytes:
    return hashlib.blake2b(bytes([i]), digest_size=16).digest()


def block_file_size() -> int:
    return kv_store.HEADER.size + 16 + PAYLOAD


def nothing() -> list[bytes]:
    return []


# ---------------------------------------------------------------- the event log


@pytest.fixture
def store(tmp_path):
    made = []

    def make(blocks: int = 100) -> KVStore:
        made.append(KVStore(tmp_path / "tier", blocks * block_file_size()))
        return made[-1]
    yield make
    for s in made:
        s.close()


def test_the_log_carries_what_its_store_wrote_and_evicted_apart_from_the_pool(store):
    tier = store(blocks=2)  # room for two blocks: a third evicts the least recently used
    log = CacheEventLog()
    log.attach_tier(tier, "the-store")
    first = log.since(0, nothing)
    assert first.reset and first.tier_stored == [] and first.tier == "the-store"
    log.stored(digest(9))  # the pool's event
    for i in (0, 1):
        tier.put(digest(i), bytes(PAYLOAD))
    assert tier.flush()
    delta = log.since(first.next_cursor, nothing)
    assert not delta.reset and delta.stored == [key64(digest(9))] and delta.removed == []
    assert sorted(delta.tier_stored) == sorted(key64(digest(i)) for i in (0, 1)) and delta.tier_removed == []
    tier.put(digest(2), bytes(PAYLOAD))
    assert tier.flush()
    later = log.since(delta.next_cursor, nothing)
    assert later.tier_stored == [key64(digest(2))] and later.tier_removed == [key64(digest(0))]
    assert later.stored == later.removed == [] and later.tier == "the-store"


def test_a_reset_gives_the_whole_store_as_this_worker_reads_it(store):
    mine, another = store(), store()  # another worker's store object on the same directory
    log = CacheEventLog()
    log.attach_tier(mine, "s")
    another.put(digest(1), bytes(PAYLOAD))
    mine.put(digest(2), bytes(PAYLOAD))
    assert another.flush() and mine.flush()
    delta = log.since(0, lambda: [digest(7)])  # cursor 0 resets: the store held blocks before any event
    assert delta.reset and delta.stored == [key64(digest(7))]
    assert delta.tier_stored == sorted(key64(digest(i)) for i in (1, 2))
    # what came before the reset is in it: the next delta starts after it
    assert log.since(delta.next_cursor, nothing).tier_stored == []


def test_changes_the_store_lost_undrained_make_readers_reset(store, monkeypatch):
    monkeypatch.setattr(kv_store, "_MAX_CHANGES", 2)
    tier = store()
    log = CacheEventLog()
    log.attach_tier(tier, "s")
    cursor = log.since(0, nothing).next_cursor
    for i in range(3):
        tier.put(digest(i), bytes(PAYLOAD))
    assert tier.flush()
    delta = log.since(cursor, nothing)
    assert delta.reset and delta.tier_stored == sorted(key64(digest(i)) for i in range(3))
    assert tier.drain_changes() == []


def test_a_tier_given_the_event_log_attaches_its_store_by_its_directory(store):
    tier = store()
    log = CacheEventLog()
    KVTier(tier, cache=None, block_size=BS, root=ROOT, events=log)
    assert log.since(0, nothing).tier == str(tier.root.resolve())
    assert CacheEventLog().since(0, nothing).tier == ""  # no tier: no tier name, no tier events


def test_async_engine_stop_writes_what_the_store_queued(tmp_path):
    class Engine:
        kv_tier = KVTier(KVStore(tmp_path, 10 * block_file_size()), cache=None, block_size=BS, root=ROOT)

    async def scenario():
        aengine = AsyncEngine(Engine())
        aengine.start()
        assert Engine.kv_tier.store.put(digest(1), bytes(PAYLOAD))
        await aengine.stop()

    asyncio.run(scenario())
    assert Engine.kv_tier.store.state == "off"
    reopened = KVStore(tmp_path, 10 * block_file_size())
    assert reopened.contains([digest(1)]) == 1
    reopened.close()


# ---------------------------------------------------------------- the router's index


PROMPT = list(range(100, 100 + 5 * BS + 1))  # five full blocks and the last token
KEYS = PromptKeys(PROMPT).keys(ROOT, BS)


def index_of(workers: dict[str, str]) -> CacheIndex:
    """An index tracking `workers` (id -> node), each told at a reset that it has a tier in
    the store "s" (but "no-tier", which has none)."""
    index = CacheIndex()
    for worker, node in workers.items():
        index.add_worker(worker, ROOT, BS, node)
        index.apply(worker, 1, True, [], [], tier="" if worker == "no-tier" else "s")
    return index


def tier_tokens(index: CacheIndex, *workers: str) -> dict[str, int]:
    return index.matched_by_tier(workers, PromptKeys(PROMPT))[1]


def test_a_block_one_worker_wrote_is_in_its_nodes_tier_for_every_worker_there():
    index = index_of({"a": "n1", "b": "n1", "c": "n2", "no-tier": "n1"})
    index.apply("a", 2, False, KEYS[:3], [], since=1, tier_stored=KEYS[:3])
    pool, tier = index.matched_by_tier(["a", "b", "c", "no-tier"], PromptKeys(PROMPT))
    assert pool == {"a": 3 * BS, "b": 0, "c": 0, "no-tier": 0}
    assert tier == {"a": 0, "b": 3 * BS, "c": 0, "no-tier": 0}  # a's own blocks are pool hits
    assert index.tier_size("a") == index.tier_size("b") == 3 and index.tier_size("c") == 0


def test_a_tier_match_continues_past_the_pool_match_and_stops_at_the_first_gap():
    index = index_of({"a": "n1"})
    index.apply("a", 2, False, KEYS[:1], [], since=1, tier_stored=[*KEYS[:3], KEYS[4]])
    assert index.matched_by_tier(["a"], PromptKeys(PROMPT)) == ({"a": BS}, {"a": 2 * BS})


def test_an_eviction_any_worker_on_the_node_reports_removes_the_block_for_all():
    index = index_of({"a": "n1", "b": "n1"})
    index.apply("a", 2, False, [], [], since=1, tier_stored=KEYS)
    index.apply("b", 2, False, [], [], since=1, tier_removed=[KEYS[2]])  # b's store evicted a block a wrote
    assert tier_tokens(index, "a", "b") == {"a": 2 * BS, "b": 2 * BS}
    index.apply("b", 3, False, [], [], since=2, tier_stored=[KEYS[2]])  # and b wrote it again
    assert tier_tokens(index, "a", "b") == {"a": 5 * BS, "b": 5 * BS}


def test_a_reset_replaces_the_nodes_tier_and_the_last_worker_takes_it_along():
    index = index_of({"a": "n1", "b": "n1"})
    index.apply("a", 2, False, [], [], since=1, tier_stored=KEYS)
    index.apply("b", 7, True, [], [], tier_stored=KEYS[:2], tier="s")  # the whole store, as b reads it now
    assert tier_tokens(index, "a", "b") == {"a": 2 * BS, "b": 2 * BS}
    index.remove_worker("a")
    assert tier_tokens(index, "b") == {"b": 2 * BS}  # the store outlives a worker
    index.apply("b", 8, True, [], [], tier="")  # b's tier is off now
    assert tier_tokens(index, "b") == {"b": 0} and index._tier_by == {} and index._tiers == {}


def test_workers_of_one_node_on_different_stores_do_not_share_a_tier():
    index = index_of({"a": "n1"})
    index.add_worker("b", ROOT, BS, "n1")
    index.apply("b", 1, True, [], [], tier="another directory")
    index.apply("a", 2, False, [], [], since=1, tier_stored=KEYS)
    assert tier_tokens(index, "a", "b") == {"a": 5 * BS, "b": 0}


def test_static_workers_are_nodes_of_their_own():
    index = index_of({"a": "", "b": ""})
    index.apply("a", 2, False, [], [], since=1, tier_stored=KEYS)
    assert tier_tokens(index, "a", "b") == {"a": 5 * BS, "b": 0}


WORKERS = {"a": "n1", "b": "n1", "c": "n2", "d": "n2"}
PROMPTS = [list(range(s, s + 4 * BS + 1)) for s in (1, 1000)] + [list(range(1, 1 + 2 * BS)) + [7] * 2 * BS]


@st.composite
def _op(draw):
    worker = draw(st.sampled_from(sorted(WORKERS)))
    keys = [PromptKeys(p).keys(ROOT, BS) for p in PROMPTS]
    pick = st.lists(st.sampled_from(sorted({k for ks in keys for k in ks})), max_size=6)
    return worker, draw(st.booleans()), draw(pick), draw(pick), draw(pick), draw(st.sampled_from(["s", "s", ""]))


@given(ops=st.lists(_op(), max_size=30), probe=st.sampled_from(range(len(PROMPTS))))
@settings(max_examples=200, deadline=None)
def test_the_walk_matches_a_per_worker_reference_and_the_masks_stay_inverse(ops, probe):
    """After any mix of deltas (resets, tier events, tiers on and off at resets), each worker's tier
    tokens are the keys after its pool match held by the one set its node's workers feed,
    and the key -> node tiers masks are the exact inverse of those sets."""
    index = CacheIndex()
    for worker, node in WORKERS.items():
        index.add_worker(worker, ROOT, BS, node)
    nodes: dict[str, set[int]] = {}  # the reference: (node) -> keys, while a worker there has the tier
    tiered: dict[str, bool] = dict.fromkeys(WORKERS, False)
    for worker, reset, pool, stored, removed, tier in ops:
        cursor = index.cursor(worker)
        index.apply(worker, cursor + 1, reset, pool, [], since=cursor, tier_stored=stored, tier_removed=removed,
                    tier=tier)
        node = WORKERS[worker]
        if reset:  # the tier a worker is on is the one its last reset named
            tiered[worker] = bool(tier)
        if not any(tiered[w] for w in WORKERS if WORKERS[w] == node):
            nodes.pop(node, None)
        elif tiered[worker]:
            keys = nodes.setdefault(node, set())
            if reset:
                keys.clear()
            keys |= set(stored)
            keys -= set(removed)
    prompt = PromptKeys(PROMPTS[probe])
    pool, tier = index.matched_by_tier(list(WORKERS), prompt)
    for worker in WORKERS:
        keys, held = prompt.keys(ROOT, BS), nodes.get(WORKERS[worker], set()) if tiered[worker] else set()
        start = pool[worker] // BS
        run = next((i for i, k in enumerate(keys[start:]) if k not in held), len(keys) - start)
        assert pool[worker] == index.matched_tokens(worker, prompt)
        assert tier[worker] == run * BS, worker
    inverse: dict[int, int] = {}
    for node_tier in index._tiers.values():
        for key in node_tier.keys:
            inverse[key] = inverse.get(key, 0) | node_tier.bit
    assert inverse == index._tier_by


# ---------------------------------------------------------------- the policy


def view(worker_id: str, role: str = "decode", running: int = 0) -> WorkerView:
    stats = pb.WorkerStats(worker_id=worker_id, role=role, num_running=running, num_free_blocks=100,
                           num_total_blocks=100)
    return WorkerView(role, worker_id, f"{worker_id}:1", "ready", None, None, stats)


def test_a_pool_hit_beats_a_tier_hit_of_the_same_length_which_beats_a_miss():
    pool, tier, miss = view("pool"), view("tier"), view("miss")
    route = RouteRequest(1000, matched={"pool": 960}, tier_matched={"tier": 960})
    policy = CacheAware()
    assert policy.pick_decode([tier, miss, pool], route) is pool
    assert policy.pick_decode([miss, tier], route) is tier
    assert [v.worker_id for v in policy.order_prefill([miss, tier, pool], route, pool)] == ["pool", "tier", "miss"]


def test_a_tier_token_is_worth_three_quarters_of_a_pool_token_by_default():
    weights = CacheAwareWeights()
    assert weights.tier_hit == 0.75
    policy = CacheAware(weights)
    route = RouteRequest(1000, matched={"both": 400}, tier_matched={"both": 400, "tier": 960})
    miss = policy.decode_cost(view("miss"), route)
    assert miss - policy.decode_cost(view("tier"), route) == weights.tier_hit * 960
    assert miss - policy.decode_cost(view("both"), route) == 400 + weights.tier_hit * 400
    assert route.cached_on(view("both")) == 800  # unweighted: what the router expects reused
    with pytest.raises(ValueError, match="tier_hit"):
        CacheAwareWeights(tier_hit=1.5)


def test_a_tier_hit_is_worth_what_the_weight_says_against_load():
    """A tier hit of 960 tokens at weight 0.5 is worth 480 tokens: under two open requests at
    256 each, more than one."""
    policy = CacheAware(CacheAwareWeights(request_tokens=256, kv_tokens=0, tier_hit=0.5))
    route = RouteRequest(1000, tier_matched={"tier": 960})
    assert policy.pick_decode([view("tier", running=1), view("idle")], route).worker_id == "tier"
    assert policy.pick_decode([view("tier", running=2), view("idle")], route).worker_id == "idle"


# ---------------------------------------------------------------- metrics and status


class Registry:
    def __init__(self, *stats: pb.WorkerStats) -> None:
        self.views = [WorkerView(s.role, s.worker_id, "h:1", "ready", None, None, stats=s) for s in stats]

    def workers(self, role: str, routable: bool = True) -> list[WorkerView]:
        return [v for v in self.views if v.role == role]


def tiered_stats(worker_id: str, hits: int, writable: int = 1) -> pb.WorkerStats:
    return pb.WorkerStats(worker_id=worker_id, role="decode", prefix_cache_hit_tokens=64,
                          prefix_cache_query_tokens=400, kv_tier_hit_tokens=hits,
                          kv_tier_decisions={"load": 3, "recompute: slower": 1}, kv_tier_blocks_written=9,
                          kv_tier_bytes=5 << 20, kv_tier_read_bandwidth=2e9,
                          kv_tier_store={"files": 14, "budget_bytes": 8 << 30, "writable": writable, "enabled": 1,
                                         "write_errors": 1 - writable, "corrupt": 2, "dropped": 3})


def test_metrics_export_tier_hits_apart_from_pool_hits_for_workers_with_a_tier():
    registry = Registry(tiered_stats("d1", 96), tiered_stats("d2", 32, writable=0),
                        pb.WorkerStats(worker_id="plain", role="decode", prefix_cache_hit_tokens=5))
    text = generate_latest(RouterMetrics(registry).registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    d1 = (("pool", "decode"), ("worker", "d1"))
    d1_recomputed = (("pool", "decode"), ("reason", "recompute: slower"), ("worker", "d1"))
    assert samples["pdserve_worker_kv_tier_hit_tokens_total", d1] == 96
    assert samples["pdserve_worker_prefix_cache_hit_tokens_total", d1] == 64
    assert samples["pdserve_worker_kv_tier_decisions_total", d1_recomputed] == 1
    assert samples["pdserve_worker_kv_tier_blocks_written_total", d1] == 9
    assert samples["pdserve_worker_kv_tier_bytes", d1] == 5 << 20
    assert samples["pdserve_worker_kv_tier_blocks", d1] == 14
    assert samples["pdserve_worker_kv_tier_read_bandwidth_bytes_per_second", d1] == 2e9
    states = {w: [state for state in ("on", "read-only", "off") if samples[
        "pdserve_worker_kv_tier_state", (("pool", "decode"), ("state", state), ("worker", w))] == 1]
        for w in ("d1", "d2")}
    assert states == {"d1": ["on"], "d2": ["read-only"]}  # a store degraded after a write error
    problems = {kind: samples["pdserve_worker_kv_tier_problems_total", (("kind", kind), ("pool", "decode"),
                                                                        ("worker", "d2"))]
                for kind in ("write_errors", "corrupt", "dropped")}
    assert problems == {"write_errors": 1, "corrupt": 2, "dropped": 3}
    assert samples["pdserve_kv_tier_hit_tokens_total", (("pool", "decode"),)] == 96 + 32
    assert samples["pdserve_prefix_cache_hit_tokens_total", (("pool", "decode"),)] == 64 + 64 + 5
    assert not [key for key in samples if "kv_tier" in key[0] and ("worker", "plain") in key[1]]


def test_status_shows_tier_hits_beside_cache_hits_when_the_tier_reports(capsys):
    def worker(worker_id: str, stats: pb.WorkerStats) -> dict:
        from pdserve.protos.convert import message_dict

        return {"worker_id": worker_id, "address": "h:1", "state": "ready", "stats": message_dict(stats)}

    status = {"router": "http://h:8000", "model": "tiny", "routing": None, "events": [], "autoscaler": {},
              "pools": {"decode": {"target": 2, "workers": [
                  worker("d1", tiered_stats("d1", 100)),
                  worker("plain", pb.WorkerStats(worker_id="plain", prefix_cache_hit_tokens=40,
                                                 prefix_cache_query_tokens=400))]}}}
    print_status(status)
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "cache hits 16.0% + tier 25.0% (node store 5 MiB, 14 blocks)  router index" in lines["d1"]
    assert "cache hits 10.0%  router index" in lines["plain"] and "tier" not in lines["plain"]
