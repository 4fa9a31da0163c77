"""Router replicas on the real controller (`router.replicas: 2`, a simulated deployment with
three decode workers): both replicas serve requests through the one port; one replica's
process SIGKILLed mid-traffic ends only the streams it carried, while those on the other all
complete; the controller replaces the dead replica alone (a new process, same name); a
restarted controller re-adopts every replica, and kills a worker actor its predecessor created
but never started rather than waiting for it; `scale(routers=1)` leaves one; a chat's turns
land on the worker holding their prefix whichever replica takes them; a replica started after
the chats began routes their later turns to their prefixes too (its index starts from the
workers' snapshots)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time

import aiohttp
import pytest

from pdserve.cluster.recovery import NAMESPACE, ROUTER_NAME
from pdserve.engine.config import SIM_MODEL
from tests.e2e.conftest import service_actors, start_service, stop_service
from tests.e2e.http import post

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def replicated(ray_cluster):
    controller, url = start_service(SIM_MODEL, served_model_name=None, **{
        "router.replicas": 2, "prefill.num_cpus": 0.1, "decode.num_cpus": 0.1, "decode.replicas": 3,
        "sim.speed": 0.25})  # slower steps: streams long enough to be cut
    yield controller, url
    stop_service(controller)


def status(controller) -> dict:
    import ray

    return ray.get(controller.status.remote(), timeout=60)


def replicas(controller) -> dict:
    import ray

    return ray.get(controller.router_handles.remote(), timeout=60)


def served(handles: dict) -> dict:
    import ray

    return {i: ray.get(h.requests_total.remote(), timeout=30) for i, h in handles.items()}


def inflight(handle) -> int:
    import ray

    return ray.get(handle.observation_samples.remote(1.0), timeout=30)["inflight"]


def scale_routers(controller, n: int) -> None:
    """`scale(routers=n)`, which must return within 120 s with n replicas; when it does not,
    the failure shows what the controller reports meanwhile (its replicas, latest events) and
    the service actors Ray holds."""
    import ray

    try:
        assert ray.get(controller.scale.remote(routers=n), timeout=120)["routers"] == n
    except ray.exceptions.GetTimeoutError:
        now = status(controller)
        actors = service_actors()
        raise AssertionError(f"scale(routers={n}) did not return in 120 s: routers {now['routers']}, "
                             f"events {now['events'][-12:]}, actors {actors}") from None


def complete_once(url: str) -> None:
    status_code, body, _ = post(url + "/v1/completions", {"model": SIM_MODEL, "prompt": [5, 6, 7, 8],
                                                          "max_tokens": 3, "ignore_eos": True})
    assert status_code == 200 and body["usage"]["completion_tokens"] == 3, body


def wait_for(what: str, check, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.3)


def test_both_replicas_serve_through_the_one_port(replicated):
    controller, url = replicated
    now = status(controller)
    assert now["router"] == url and now["router_target"] == 2
    routers = now["routers"]
    assert [r["replica"] for r in routers] == [0, 1] and {r["state"] for r in routers} == {"ready"}
    assert {r["address"] for r in routers} == {url} and len({r["pid"] for r in routers}) == 2
    handles = replicas(controller)
    before = served(handles)
    for _ in range(24):  # urllib: a new connection each, which the kernel gives either replica
        complete_once(url)
    after = served(handles)
    gained = {i: after[i] - before[i] for i in handles}
    assert sum(gained.values()) == 24 and all(n > 0 for n in gained.values()), gained


class Streams:
    """Streaming requests, each on its own connection, run on a thread; records each outcome."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.futures = []

    def open(self) -> None:
        self.futures.append(asyncio.run_coroutine_threadsafe(self._one(), self.loop))

    async def _one(self) -> str:
        body = {"model": SIM_MODEL, "prompt": [11, 12, 13, 14, 15], "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                    session.post(self.url + "/v1/completions", json=body,
                                 timeout=aiohttp.ClientTimeout(total=120)) as response:
                text = (await response.read()).decode()
        except Exception as exc:  # noqa: BLE001 - the replica carrying it died
            return f"cut: {type(exc).__name__}"
        from tests.e2e.http import parse_sse

        events, done = parse_sse(text)
        if done and events and (events[-1].get("usage") or {}).get("completion_tokens") == MAX_TOKENS:
            return "ok"
        return f"incomplete: {text[-200:]!r}"

    def results(self) -> list[str]:
        out = [f.result(timeout=180) for f in self.futures]
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        return out


def test_a_killed_replica_cuts_only_its_streams_and_is_replaced_alone(replicated):
    import ray

    controller, url = replicated
    handles = replicas(controller)
    pids = {r["replica"]: r["pid"] for r in status(controller)["routers"]}
    streams = Streams(url)
    for _ in range(6):
        streams.open()
    # until each replica carries some of the streams (the kernel hashes each connection)
    deadline = time.monotonic() + 30
    while min(inflight(h) for h in handles.values()) == 0:
        assert time.monotonic() < deadline, "the streams never spread over both replicas"
        if len(streams.futures) < 24:
            streams.open()
        time.sleep(0.2)
    time.sleep(0.5)  # their first tokens are out
    carried = {i: inflight(h) for i, h in handles.items()}
    done_before = served(handles)
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)
    outcomes = streams.results()
    ok = outcomes.count("ok")
    cut = [o for o in outcomes if o != "ok"]
    # every stream the survivor carried completed, token for token; the dead one's ended
    assert served({0: handles[0]})[0] - done_before[0] == ok, (outcomes, carried)
    assert ok >= carried[0] and len(cut) >= 1, (outcomes, carried)
    assert all(o.startswith(("cut", "incomplete")) for o in cut), outcomes

    def replaced():
        now = status(controller)
        events = [(e["role"], e["event"]) for e in now["events"] if e["time"] >= killed_at]
        routers = now["routers"]
        ready = len(routers) == 2 and all(r["state"] == "ready" for r in routers)
        return now if ready and ("router", "replaced") in events else None

    now = wait_for("the controller replaced the dead replica", replaced)
    died = [e for e in now["events"] if e["time"] >= killed_at and e["event"] == "died"]
    assert [e["role"] for e in died] == ["router"] and f"{ROUTER_NAME}-1" in died[0]["detail"], died
    new_pids = {r["replica"]: r["pid"] for r in now["routers"]}
    assert new_pids[0] == pids[0] and new_pids[1] not in (pids[0], pids[1]), (pids, new_pids)
    assert ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)._actor_id == handles[0]._actor_id  # replica 0 untouched
    handles = replicas(controller)
    before = served(handles)
    for _ in range(16):
        complete_once(url)
    after = served(handles)
    assert sum(after[i] - before[i] for i in handles) == 16 and after[1] > before[1], (before, after)


def crash_and_restart(controller) -> dict:
    """Kill the controller as a crash would; Ray restarts it, and it re-adopts what runs.
    Returns its status once it says it restarted."""
    import ray

    killed_at = time.time()
    ray.kill(controller, no_restart=False)

    def restarted():
        try:
            now = status(controller)
        except Exception:  # noqa: BLE001 - restarting
            return None
        events = [e for e in now["events"] if e["time"] >= killed_at and e["event"] == "controller_restarted"]
        return now if events else None

    return wait_for("the controller is back", restarted)


def test_a_restarted_controller_re_adopts_every_replica(replicated):
    controller, url = replicated
    before = {r["replica"]: r["pid"] for r in status(controller)["routers"]}
    now = crash_and_restart(controller)
    assert {r["replica"]: r["pid"] for r in now["routers"]} == before and now["router_target"] == 2
    assert "2 router replica(s)" in [e for e in now["events"] if e["event"] == "controller_restarted"][-1]["detail"]
    complete_once(url)


def test_a_restarted_controller_kills_a_worker_its_predecessor_never_started(replicated):
    """A controller that dies between creating a worker's actor and starting it leaves an
    actor nobody will start: the restarted controller kills it rather than waiting for it,
    and scales at once."""
    import ray

    from pdserve.cluster.actors import WorkerActor
    from pdserve.cluster.recovery import WORKER_PREFIX

    controller, url = replicated
    name = f"{WORKER_PREFIX}decode-never-started"
    orphan = ray.remote(WorkerActor).options(name=name, namespace=NAMESPACE, lifetime="detached",
                                             num_cpus=0).remote("decode")
    assert ray.get(orphan.info.remote(), timeout=60)["state"] == "unstarted"
    workers = {w["worker_id"] for w in status(controller)["pools"]["decode"]["workers"]}
    crash_and_restart(controller)
    assert ray.get(controller.scale.remote(decode=3), timeout=60)["decode"] == 3  # nothing left to wait for
    wait_for("the never-started worker is gone", lambda: name not in service_actors())
    assert {w["worker_id"] for w in status(controller)["pools"]["decode"]["workers"]} == workers
    complete_once(url)


def test_scaling_to_one_router_leaves_one(replicated):
    import ray

    controller, url = replicated
    scale_routers(controller, 1)
    now = status(controller)
    assert [r["replica"] for r in now["routers"]] == [0] and now["router_target"] == 1
    wait_for("replica 1's actor is gone", lambda: f"{ROUTER_NAME}-1" not in {
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE})
    for _ in range(5):
        complete_once(url)
    scale_routers(controller, 2)
    assert [r["replica"] for r in status(controller)["routers"]] == [0, 1]
    complete_once(url)


BLOCK = 16  # tokens per KV block (SmolLM2's layout, which `sim` runs)


class Chat:
    """A chat as a client sends it: each turn resends the whole history plus new tokens, on
    a connection of its own (the kernel gives it either replica), without `user` (no replica
    may know the session: only the workers' cache reports tell where its prefix is)."""

    def __init__(self, url: str, seed: int) -> None:
        self.url, self.seed = url, seed
        self.history: list[int] = []
        self.turns: list[dict] = []

    def turn(self) -> dict:
        """Send the next turn; returns {replica, prompt, cached, held}: the replica that took it,
        its prompt length, the prompt tokens its decode worker found cached, and the prompt
        tokens of whole blocks the history before it already had."""
        held = len(self.history) // BLOCK * BLOCK
        self.history += [1000 + (self.seed * 7919 + len(self.history) + i) % 40000 for i in range(2 * BLOCK)]
        status_code, body, headers = post(self.url + "/v1/completions", {
            "model": SIM_MODEL, "prompt": self.history, "max_tokens": 4, "ignore_eos": True})
        assert status_code == 200, body
        replica = {k.lower(): v for k, v in headers.items()}["x-pdserve-replica"]
        out = {"replica": int(replica), "prompt": len(self.history), "held": held,
               "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}
        self.turns.append(out)
        return out


def later_turns_missing_their_prefix(chats: list[Chat]) -> list[dict]:
    return [t for c in chats for t in c.turns[1:] if t["cached"] < t["held"]]


def test_a_chats_turns_land_on_the_worker_holding_their_prefix_whichever_replica_takes_them(replicated):
    controller, url = replicated
    assert len(status(controller)["pools"]["decode"]["workers"]) == 3
    chats = [Chat(url, seed) for seed in range(6)]
    for _ in range(4):
        for chat in chats:
            chat.turn()
        time.sleep(1.0)  # a user's think time: the workers' updates reach every replica meanwhile
    assert not later_turns_missing_their_prefix(chats), [c.turns for c in chats]
    # turns that another replica took than the turn before: routed by what the workers reported
    switched = [t for c in chats for before, t in itertools.pairwise(c.turns) if t["replica"] != before["replica"]]
    assert switched, [c.turns for c in chats]


def test_a_replica_started_late_routes_with_the_whole_index(replicated):
    import ray

    controller, url = replicated
    scale_routers(controller, 1)
    chats = [Chat(url, seed) for seed in range(100, 108)]
    for _ in range(2):
        for chat in chats:
            assert chat.turn()["replica"] == 0
    scale_routers(controller, 2)
    late = replicas(controller)[1]
    time.sleep(1.0)

    def index_of(handle) -> dict:
        return {w: held["held"] for w, held in ray.get(handle.routing_summary.remote(), timeout=30)["index"].items()}

    assert index_of(late) == index_of(replicas(controller)[0])  # both from the same worker reports
    on_late = []
    for attempt in range(48):  # until the kernel has given the late replica a few of the later turns
        turn = chats[attempt % len(chats)].turn()
        if turn["replica"] == 1:
            on_late.append(turn)
        if len(on_late) >= 4:
            break
    assert len(on_late) >= 4, [c.turns for c in chats]
    assert all(t["cached"] >= t["held"] for t in on_late), on_late
    assert not later_turns_missing_their_prefix(chats), [c.turns for c in chats]
