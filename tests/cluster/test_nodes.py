"""pdserve across nodes (tests/cluster/conftest.py): pools land on the nodes labelled for
them and spread over them; a seeded sampled stream whose decode node, or whose prefill node
during its prefill, is removed mid-stream completes exactly as an unbroken run; a pool with
no node left to host it shows as short (status, events, metric) and returns to its target by
itself when a node with room joins; the controller killed mid-traffic loses no request, and
the restarted one re-adopts the running workers and the router, and scales again. The tests
run in this order on one cluster."""

import asyncio
import json
import threading
import time

import pytest

from pdserve.testkit.workers import stats_of
from tests.e2e.http import get, metric
from tests.e2e.test_scaling import Traffic
from tests.integration.streaming import stream_ids

pytestmark = pytest.mark.slow
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "ignore_eos": True}


def status(service) -> dict:
    import ray

    return ray.get(service["controller"].status.remote(), timeout=60)


def workers(service, role: str) -> list[dict]:
    return status(service)["pools"][role]["workers"]


def wait_for(what: str, condition, timeout_s: float = 120, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting until {what}"
        time.sleep(every_s)


def events(service, since: float) -> list[tuple[str, str]]:
    """The controller's events since `since` ([] while it is restarting)."""
    from ray.exceptions import RayActorError

    try:
        return [(e["role"], e["event"]) for e in status(service)["events"] if e["time"] >= since]
    except RayActorError:  # ActorUnavailableError included: asked while Ray restarts it
        return []


async def busy_worker(service, role: str, busy) -> dict:
    """The worker of `role` whose Stats satisfy `busy` (polled over gRPC, bounded)."""
    candidates = await asyncio.to_thread(workers, service, role)
    for _ in range(2000):
        for w in candidates:
            if w["state"] == "ready" and busy(await stats_of(w["address"], role)):
                return w
        await asyncio.sleep(0.005)
    raise AssertionError(f"no {role} worker ever held the request")


def test_pools_land_on_their_labelled_nodes_and_spread(nodes, service):
    prefill, decode = workers(service, "prefill"), workers(service, "decode")
    assert [nodes.name_of(w["node"]) for w in prefill] == ["prefill-1"]
    assert sorted(nodes.name_of(w["node"]) for w in decode) == ["decode-a", "decode-b"], "spread: one per node"
    for w in prefill + decode:  # each worker listens on its own node's address
        assert w["address"].rsplit(":", 1)[0] == w["node"]
    dashboard = json.loads(get(service["url"] + "/dashboard/data")[1])
    shown = {w["worker_id"]: w["node"] for pool in dashboard["pools"].values() for w in pool["workers"]}
    assert shown == {w["worker_id"]: w["node"] for w in prefill + decode}


def test_a_decode_node_removed_mid_stream_loses_no_token(nodes, service):
    body = {"model": "tiny", "prompt": list(range(7, 47)), "max_tokens": 500, **SAMPLED}
    reference, *_ = asyncio.run(stream_ids(service["url"], body))
    removed = []

    async def remove_the_serving_node():
        victim = await busy_worker(service, "decode", lambda s: s.num_running)
        removed.append(nodes.name_of(victim["node"]))
        await asyncio.to_thread(nodes.remove, removed[0])

    since = time.time()
    ids, finishes, usage, errors, done = asyncio.run(stream_ids(service["url"], body, 30, remove_the_serving_node))
    assert removed and not errors and done and finishes == ["length"], (errors, finishes)
    assert len(reference) == 500 and ids == reference, "the stream differs from an unbroken run"
    assert usage["completion_tokens"] == 500
    assert metric(service["url"], 'pdserve_migrations_total{reason="unavailable"}') >= 1
    wait_for("the decode pool is back at 2 ready workers on the surviving node", lambda: [
        w["node"] for w in workers(service, "decode") if w["state"] == "ready"] == [nodes.by_name[
            "decode-b" if removed[0] == "decode-a" else "decode-a"].node_ip_address] * 2)
    assert ("decode", "died") in events(service, since)


def test_a_prefill_node_removed_mid_prefill_then_the_pool_waits_for_a_node(nodes, service):
    body = {"model": "tiny", "prompt": [(i * 7919) % 40000 + 5 for i in range(900)], "max_tokens": 40, **SAMPLED}
    reference, *_ = asyncio.run(stream_ids(service["url"], body))
    since = time.time()
    outcome = {}

    def stream():
        outcome["result"] = asyncio.run(stream_ids(service["url"], body))

    client = threading.Thread(target=stream)
    client.start()
    victim = asyncio.run(busy_worker(service, "prefill", lambda s: s.queued_prefill_tokens > 0))
    nodes.remove(nodes.name_of(victim["node"]))
    client.join(300)
    ids, finishes, _, errors, done = outcome["result"]
    assert not errors and done and finishes == ["length"] and ids == reference, (errors, finishes)

    # no node offers `prefill` now: the pool is short, and says so, instead of failing or spinning
    wait_for("the prefill pool shows a worker pending for a node", lambda: status(service)["pools"]["prefill"]
             ["pending"] == 1)
    assert ("prefill", "died") in events(service, since) and ("prefill", "pending") in events(service, since)
    wait_for("/metrics shows the pending worker", lambda: metric(
        service["url"], 'pdserve_pool_pending_workers{pool="prefill"}') == 1, timeout_s=30)
    out = asyncio.run(stream_ids(service["url"], {**body, "max_tokens": 5}))  # decode workers prefill meanwhile
    assert out[1] == ["length"] and not out[3]

    nodes.add("prefill-2", "127.0.0.6", resources={"prefill": 2})  # an operator's (or Ray's autoscaler's) node
    ready = wait_for("the prefill pool is back at its target on the new node", lambda: [
        w for w in workers(service, "prefill") if w["state"] == "ready"], timeout_s=180)
    assert [w["node"] for w in ready] == ["127.0.0.6"] and status(service)["pools"]["prefill"]["pending"] == 0
    assert ("prefill", "placed") in events(service, since)


def test_the_controller_killed_mid_traffic_is_restarted_and_re_adopts(nodes, service):
    import ray

    before = {w["worker_id"] for pool in status(service)["pools"].values() for w in pool["workers"]}
    since = time.time()
    with Traffic(service["url"], clients=3, max_tokens=30) as traffic:
        wait_for("traffic flows", lambda: len(traffic.outcomes) >= 3, timeout_s=60)
        ray.kill(service["controller"], no_restart=False)  # a crash: Ray restarts it
        wait_for("the controller is back and says so", lambda: ("cluster", "controller_restarted") in
                 events(service, since), timeout_s=120, every_s=1.0)
        done_at = len(traffic.outcomes)
        wait_for("more requests finish after the restart", lambda: len(traffic.outcomes) >= done_at + 3)
    failed = [o for o in traffic.outcomes if o[0] != "ok"]
    assert traffic.outcomes and not failed, failed[:3]
    after = status(service)
    assert {w["worker_id"] for pool in after["pools"].values() for w in pool["workers"]} == before
    assert {role: pool["target"] for role, pool in after["pools"].items()} == {"prefill": 1, "decode": 2}
    assert ray.get(service["controller"].scale.remote(prefill=2), timeout=300) == {"prefill": 2, "decode": 2}
    assert len([w for w in workers(service, "prefill") if w["state"] == "ready"]) == 2
