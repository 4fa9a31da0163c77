"""Routing policies' choices on constructed pool states."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.policies import (
    CacheAware,
    CacheAwareWeights,
    LeastLoaded,
    RouteRequest,
    decode_busy,
    kv_free_fraction,
    make_policy,
)
from pdserve.router.registry import WorkerView


def view(worker_id: str, role: str = "decode", running: int = 0, queued: int = 0, free: int = 100,
         total: int = 100) -> WorkerView:
    stats = pb.WorkerStats(worker_id=worker_id, role=role, num_running=running, queued_prefill_tokens=queued,
                           num_free_blocks=free, num_total_blocks=total)
    return WorkerView(role, worker_id, f"{worker_id}:1", "ready", None, None, stats)


def test_the_worker_holding_the_prefix_wins_over_an_idle_one():
    d1, d2 = view("d1", running=1), view("d2")
    route = RouteRequest(1000, matched={"d1": 960})
    assert CacheAware().pick_decode([d1, d2], route) is d1
    assert LeastLoaded().pick_decode([d1, d2], route) is d2  # blind to caches


def test_a_hot_prefix_spreads_once_its_worker_is_loaded():
    policy = CacheAware(CacheAwareWeights(request_tokens=256, kv_tokens=0))
    d2 = view("d2")
    route = RouteRequest(1000, matched={"d1": 960})
    # 960 cached tokens are worth 960 / 256 = 3.75 open requests
    assert policy.pick_decode([view("d1", running=3), d2], route).worker_id == "d1"
    assert policy.pick_decode([view("d1", running=4), d2], route) is d2


def test_without_cache_hits_it_routes_like_least_loaded():
    workers = [view("a", running=3), view("b", running=1), view("c", running=1, free=50)]
    route = RouteRequest(500)
    assert CacheAware().pick_decode(workers, route) is LeastLoaded().pick_decode(workers, route)
    assert CacheAware().pick_decode(workers, route).worker_id == "b"


def test_a_full_kv_cache_costs_what_the_weights_say():
    policy = CacheAware(CacheAwareWeights(request_tokens=0, kv_tokens=512))
    full, empty = view("full", free=0), view("empty")
    assert policy.pick_decode([full, empty], RouteRequest(1000, matched={"full": 480})) is empty
    assert policy.pick_decode([full, empty], RouteRequest(1000, matched={"full": 528})) is full


def test_a_session_sticks_to_its_worker_while_its_load_allows():
    policy = CacheAware(CacheAwareWeights(request_tokens=256, kv_tokens=0))
    a, b = view("a"), view("b", running=1)
    first = policy.pick_decode([a, b], RouteRequest(600, session="alice"))
    assert first is a
    # no cache hit seen yet (say, the index has not heard back): the hint alone keeps it there
    assert policy.pick_decode([view("a", running=2), view("b", running=1)],
                              RouteRequest(600, session="alice")).worker_id == "a"
    # a session that has not been seen goes to the least loaded
    assert policy.pick_decode([view("a", running=2), view("b", running=1)],
                              RouteRequest(600, session="bob")).worker_id == "b"
    # past what its prompt is worth (600 tokens = 2.3 requests), it moves
    assert policy.pick_decode([view("a", running=4), view("b", running=1)],
                              RouteRequest(600, session="alice")).worker_id == "b"


def test_prefill_order_is_by_what_each_prefill_worker_must_compute_plus_its_queue():
    decode = view("d")
    p1, p2, p3 = view("p1", "prefill", queued=0), view("p2", "prefill", queued=300), view("p3", "prefill", queued=0)
    route = RouteRequest(1000, matched={"p2": 800, "d": 900})
    # p2 computes 200 + 300 queued = 500 < p1's and p3's 1000 (the decode worker's copy does
    # not spare a prefill worker any computing)
    assert [v.worker_id for v in CacheAware().order_prefill([p1, p2, p3], route, decode)] == ["p2", "p1", "p3"]
    assert [v.worker_id for v in LeastLoaded().order_prefill([p1, p2, p3], route, decode)] == ["p1", "p3", "p2"]


def test_policies_by_name():
    assert make_policy("cache-aware").name == "cache-aware"
    assert make_policy("least-loaded").name == "least-loaded"
    with pytest.raises(ValueError, match="unknown routing policy 'nearest'"):
        make_policy("nearest")
    with pytest.raises(ValueError, match="must be >= 0"):
        CacheAwareWeights(request_tokens=-1)


def test_a_chat_turn_right_after_the_last_one_ended_stays_despite_a_stale_report():
    """The worker's last report (taken before the previous turn ended) still counts that turn;
    the router closed it since, so the worker is idle and the conversation's cache wins."""
    policy = CacheAware(CacheAwareWeights(request_tokens=256, kv_tokens=0))
    a, b = view("a"), view("b")
    a.note_opened("turn-1")
    a.note_report(pb.WorkerStats(worker_id="a", num_running=1))  # taken while turn 1 ran
    route = RouteRequest(200, matched={"a": 128})  # 128 cached tokens: half an open request
    assert decode_busy(a) == 1 and policy.pick_decode([a, b], route) is b  # turn 1 runs: b is the better bet
    a.note_closed()  # turn 1 ends
    assert policy.pick_decode([a, b], route) is a
    a.note_report(pb.WorkerStats(worker_id="a", num_running=1))  # taken before the close, came after it
    assert decode_busy(a) == 0 and policy.pick_decode([a, b], route) is a
    a.note_report(pb.WorkerStats(worker_id="a", num_running=0))
    assert decode_busy(a) == 0 and policy.pick_decode([a, b], route) is a


def test_router_replicas_count_their_own_requests_and_learn_the_others_from_reports():
    """Two routers' views of one worker: each counts its own open requests at once, and the
    other's once a report shows them; a request the other closed leaves with the next report."""
    mine, theirs = view("w"), view("w")
    mine.note_opened("m1")
    theirs.note_opened("t1")
    theirs.note_opened("t2")
    assert decode_busy(mine) == 1 and decode_busy(theirs) == 2  # no report yet: each knows only its own
    report = pb.WorkerStats(worker_id="w", num_running=3)
    mine.note_report(report)
    theirs.note_report(report)
    assert decode_busy(mine) == 3 and decode_busy(theirs) == 3  # the same worker, the same count
    mine.note_opened("m2")  # a request the other router will learn of from the next report
    assert decode_busy(mine) == 4 and decode_busy(theirs) == 3
    theirs.note_closed()
    after = pb.WorkerStats(worker_id="w", num_running=3)  # m1, m2, t1
    mine.note_report(after)
    theirs.note_report(after)
    assert decode_busy(mine) == 3
    # `theirs` had 2 open while this report may have been taken: it cannot tell its closed
    # request from one of mine yet, and counts low (never high) for the next report too
    assert decode_busy(theirs) == 2
    theirs.note_report(after)
    assert decode_busy(theirs) == 2
    theirs.note_report(after)
    assert decode_busy(theirs) == 3


def _old_pick(policy: CacheAware, workers, request):
    """CacheAware.pick_decode's key as it was (each load term computed twice per worker),
    with the node's KV tier's tokens at the weights' `tier_hit`."""
    def cost(v):
        tier = request.tier_matched.get(v.worker_id, 0)
        cached = request.matched.get(v.worker_id, 0) + policy.weights.tier_hit * tier
        if request.session is not None and policy._sessions.get(request.session) == v.worker_id:
            cached = max(cached, request.num_tokens - 1)
        queued = v.stats.queued_prefill_tokens if v.stats else 0
        return (request.num_tokens - cached + queued + policy.weights.request_tokens * decode_busy(v)
                + policy.weights.kv_tokens * (1 - kv_free_fraction(v)))
    return min(workers, key=lambda v: (cost(v), decode_busy(v), -kv_free_fraction(v), v.worker_id))


@given(loads=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3000), st.integers(0, 100), st.integers(0, 1100),
                                st.integers(0, 1100)), min_size=1, max_size=8),
       num_tokens=st.integers(1, 1200), session=st.sampled_from([None, "s1", "s2"]),
       weights=st.tuples(st.integers(0, 512), st.integers(0, 1024), st.sampled_from([0, 0.5, 0.75, 1])))
@settings(max_examples=300, deadline=None)
def test_cache_aware_picks_as_it_did_before_its_load_terms_were_computed_once(loads, num_tokens, session, weights):
    workers = [view(f"d{i}", running=r, queued=q, free=f) for i, (r, q, f, _, _) in enumerate(loads)]
    route = RouteRequest(num_tokens, session, {f"d{i}": m for i, (*_, m, _) in enumerate(loads) if m},
                         {f"d{i}": t for i, (*_, t) in enumerate(loads) if t})
    policy = CacheAware(CacheAwareWeights(*weights))
    for _ in range(3):  # sessions stick after the first pick
        expected = _old_pick(policy, workers, route)
        assert policy.pick_decode(workers, route) is expected


def test_equally_good_workers_are_ordered_by_each_routers_own_tiebreak():
    """Router replicas looking at the same idle pool must not all pick the same worker: each
    registry salts its views' tie-breaks differently, and the policies order ties by them."""
    from pdserve.router.registry import WorkerRegistry, tiebreak
    from pdserve.rpc.security import Security

    def order(salt: bytes) -> list[str]:
        views = [view(f"d{i}") for i in range(8)]
        for v in views:
            v.tiebreak = tiebreak(salt, v.worker_id)
        route = RouteRequest(100)
        return [CacheAware().pick_decode(views, route).worker_id, LeastLoaded().pick_decode(views, route).worker_id]

    async def nobody() -> list[dict]:
        return []

    assert len({WorkerRegistry(nobody, Security("u" * 32))._tiebreak_salt for _ in range(4)}) == 4
    picks = [order(salt) for salt in (b"replica-0", b"replica-1", b"replica-2", b"replica-3")]
    assert all(a == b for a, b in picks)  # both policies follow the tie-break
    assert len({a for a, _ in picks}) > 1
