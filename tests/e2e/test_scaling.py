"""Scaling each pool while traffic flows, killing worker actors mid-traffic, admission control."""

import asyncio
import random
import threading
import time

import aiohttp
import pytest

from tests.e2e.http import post, stream


class Traffic:
    """Clients sending streaming requests in a loop until stopped; records every outcome."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 12) -> None:
        self.url, self.clients, self.max_tokens = url, clients, max_tokens
        self.outcomes: list[tuple[str, str]] = []  # (finish_reason or error, request tag)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(120)

    async def _run(self):
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session, index: int):
        rng = random.Random(index)
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": "tiny", "prompt": [rng.randrange(3, 40000) for _ in range(rng.randint(20, 150))],
                    "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                events, done = await stream(session, self.url + "/v1/completions", body)
                errors = [e for e in events if "error" in e]
                if errors:
                    self.outcomes.append((f"error: {errors[0]['error']['message']}", f"{index}-{n}"))
                elif not done or events[-1]["usage"]["completion_tokens"] != self.max_tokens:
                    self.outcomes.append(("incomplete", f"{index}-{n}"))
                else:
                    self.outcomes.append(("ok", f"{index}-{n}"))
            except Exception as exc:  # noqa: BLE001 - recorded as a failure
                self.outcomes.append((f"exception: {exc!r}", f"{index}-{n}"))


def pool_state(controller):
    import ray

    return ray.get(controller.status.remote())


def test_scale_both_pools_up_and_down_under_traffic_loses_nothing(service):
    import ray

    controller = service["controller"]
    with Traffic(service["url"]) as traffic:
        time.sleep(1.0)
        assert ray.get(controller.scale.remote(prefill=2, decode=2)) == {"prefill": 2, "decode": 2}
        time.sleep(2.0)
        status = pool_state(controller)
        assert [len(p["workers"]) for p in status["pools"].values()] == [2, 2]
        busy = [w["stats"]["num_finished"] for p in status["pools"].values() for w in p["workers"]]
        assert all(n > 0 for n in busy), f"every new worker takes traffic: {busy}"
        assert ray.get(controller.scale.remote(prefill=1, decode=1)) == {"prefill": 1, "decode": 1}
        time.sleep(1.0)
    outcomes = traffic.outcomes
    assert len(outcomes) > 20
    assert all(o == "ok" for o, _ in outcomes), [o for o in outcomes if o[0] != "ok"][:5]
    events = [(e["role"], e["event"]) for e in pool_state(controller)["events"]]
    for role in ("prefill", "decode"):
        assert (role, "draining") in events and (role, "drained") in events


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_worker_actor_loses_no_request_and_is_replaced(service, role):
    import ray

    controller = service["controller"]
    ray.get(controller.scale.remote(**{role: 2}))
    before = pool_state(controller)["pools"][role]["workers"]
    assert [w["state"] for w in before] == ["ready", "ready"]
    victim_id = before[0]["worker_id"]
    with Traffic(service["url"], clients=4, max_tokens=40) as traffic:
        time.sleep(1.5)
        ray.kill(ray.get(controller.handle_of.remote(victim_id)), no_restart=True)
        killed_at = len(traffic.outcomes)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = pool_state(controller)["pools"][role]["workers"]
            ids = [w["worker_id"] for w in workers]
            if [w["state"] for w in workers] == ["ready", "ready"] and victim_id not in ids:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"{role} pool not restored: {pool_state(controller)['pools'][role]}")
        restored_at = len(traffic.outcomes)
        time.sleep(2.0)
    ray.get(controller.scale.remote(**{role: 1}))
    outcomes = [o for o, _ in traffic.outcomes]
    failed = [o for o in outcomes if o != "ok"]
    # prefill: decode workers fail over to the other prefill worker or prefill locally;
    # decode: the router resumes the victim's streams on the other decode worker
    assert not failed, failed[:3]
    assert outcomes[:killed_at] and all(o == "ok" for o in outcomes[:killed_at])
    assert outcomes[restored_at:] and all(o == "ok" for o in outcomes[restored_at:]), "the restored pool serves"
    events = [(e["role"], e["event"]) for e in pool_state(controller)["events"]]
    assert (role, "died") in events


def test_a_dead_router_is_replaced(service):
    import ray

    from tests.e2e.conftest import wait_http

    controller = service["controller"]
    killed_at = time.time()
    router = ray.get_actor("pdserve-router", namespace="pdserve")
    ray.kill(router, no_restart=True)
    # ray.kill returns before the process is gone, and the old router can answer HTTP for a
    # while (on a loaded machine, more than a second): wait for the controller to see the death
    # and start a replacement, then check that the replacement serves
    deadline = time.monotonic() + 90
    while True:
        events = [(e["role"], e["event"]) for e in pool_state(controller)["events"] if e["time"] >= killed_at]
        if ("router", "replaced") in events or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert ("router", "died") in events and ("router", "replaced") in events, events
    replacement = ray.get_actor("pdserve-router", namespace="pdserve")
    assert replacement._actor_id != router._actor_id
    wait_http(service["url"] + "/health", timeout_s=60)
    status, body, _ = post(service["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
