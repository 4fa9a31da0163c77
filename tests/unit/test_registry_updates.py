"""The registry's handling of pushed worker updates (router/registry.py `apply`), without a
network: deltas that follow the index's cursor apply; a dropped update (a delta following
another cursor) is detected, counted, and the worker's cursor drops to 0 so the resubscription
gets the whole cache, which then replaces what the index held; a report counts the requests
this router closed since the update before it came as gone, and the rest of
its count as other routers' requests."""

from __future__ import annotations

from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.registry import WorkerRegistry, WorkerView
from pdserve.rpc.security import Security


def registry_with_one_worker() -> tuple[WorkerRegistry, WorkerView]:
    async def source() -> list[dict]:
        return []

    registry = WorkerRegistry(source, Security("u" * 32))
    view = WorkerView("decode", "w", "127.0.0.1:1", "ready", channel=None, stub=None)
    registry._views["w"] = view
    registry.cache_index.add_worker("w", b"r" * 16, 16)
    return registry, view


def update(seq: int, since: int, next_cursor: int, stored=(), removed=(), reset=False, running=0) -> pb.WorkerUpdate:
    return pb.WorkerUpdate(seq=seq, stats=pb.WorkerStats(worker_id="w", num_running=running),
                           cache=pb.CacheEventsReply(since=since, next_cursor=next_cursor, stored=stored,
                                                     removed=removed, reset=reset))


def held(registry: WorkerRegistry) -> set[int]:
    return set(registry.cache_index._workers["w"].held)


def test_deltas_in_order_apply_and_a_dropped_one_makes_the_registry_resync():
    registry, view = registry_with_one_worker()
    assert registry.apply(view, update(1, 0, 3, stored=[1, 2, 3], reset=True))
    assert registry.apply(view, update(2, 3, 5, stored=[4], removed=[1]))
    assert held(registry) == {2, 3, 4} and registry.cache_index.cursor("w") == 5
    # the update after cursor 5 (storing 5) was lost: the next one follows cursor 7
    assert not registry.apply(view, update(4, 7, 9, stored=[6], removed=[2]))
    assert registry.resyncs == 1 and registry.cache_index.cursor("w") == 0
    assert held(registry) == {2, 3, 4}  # nothing of the refused delta applied
    # the resubscription from cursor 0 answers with the whole cache
    assert registry.apply(view, update(1, 0, 9, stored=[3, 4, 5, 6], reset=True))
    assert held(registry) == {3, 4, 5, 6} and registry.cache_index.cursor("w") == 9


def test_an_update_without_cache_changes_keeps_the_cursor_and_refreshes_load_and_liveness():
    registry, view = registry_with_one_worker()
    registry.apply(view, update(1, 0, 2, stored=[1, 2], reset=True))
    view.heard_at = 0.0
    assert not view.routable  # silent
    assert registry.apply(view, pb.WorkerUpdate(seq=2, stats=pb.WorkerStats(worker_id="w", num_running=3)))
    assert view.routable and view.stats.num_running == 3 and registry.cache_index.cursor("w") == 2


def test_a_stalled_engine_takes_the_worker_out_of_routing():
    registry, view = registry_with_one_worker()
    registry.apply(view, pb.WorkerUpdate(seq=1, stats=pb.WorkerStats(worker_id="w"), stalled=True))
    assert not view.routable and not registry.candidates("decode")


def test_a_silent_worker_is_tried_only_when_no_other_is_routable():
    registry, view = registry_with_one_worker()
    view.heard_at = 0.0
    assert registry.workers("decode") == [] and registry.candidates("decode") == [view]
    other = WorkerView("decode", "x", "127.0.0.1:2", "ready", channel=None, stub=None)
    registry._views["x"] = other
    assert registry.candidates("decode") == [other]


def test_a_report_counts_the_requests_closed_since_the_update_before_it_as_gone():
    registry, view = registry_with_one_worker()
    view.note_opened("a")
    view.note_opened("b")
    registry.apply(view, update(1, 0, 0, running=2))
    view.note_closed()  # closed after update 1 came: update 2 may predate the close
    registry.apply(view, update(2, 0, 0, running=2))
    assert view.others_busy == 0 and view.open_requests == 1
    registry.apply(view, update(3, 0, 0, running=1))  # taken after the close
    assert view.others_busy == 0 and view.open_requests == 1


def test_a_report_counts_requests_another_router_sent_as_theirs():
    registry, view = registry_with_one_worker()
    view.note_opened("a")
    registry.apply(view, update(1, 0, 0, running=3))  # two of them are another replica's
    assert view.others_busy == 2 and view.open_requests == 1
