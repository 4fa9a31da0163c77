"""Scaling each pool while traffic flows, killing worker actors mid-traffic, admission control."""

import asyncio
import os
import random
import signal
import threading
import time

import aiohttp
import pytest

from tests.e2e.http import get, post, stream


class Traffic:
    """Clients sending streaming requests in a loop until stopped; records every outcome."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 12,
                 prompt_lengths: tuple[int, int] = (20, 150)) -> None:
        self.url, self.clients, self.max_tokens, self.prompt_lengths = url, clients, max_tokens, prompt_lengths
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
            prompt = [rng.randrange(3, 40000) for _ in range(rng.randint(*self.prompt_lengths))]
            body = {"model": "tiny", "prompt": prompt,
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

    def wait_for_outcomes(self, count: int, what: str, timeout_s: float = 120) -> None:
        """Until `count` requests have ended (however), or fail saying `what` was awaited."""
        wait_until(lambda: len(self.outcomes) >= count, f"{what} ({count} requests ended)", timeout_s,
                   lambda: f"{len(self.outcomes)} ended")


def wait_until(condition, what: str, timeout_s: float = 60, state=None) -> None:
    """Until `condition()`, or fail saying `what` was awaited (and `state()`, the state then)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting until {what}" + (f": {state()}" if state else ""))
        time.sleep(0.1)


def pool_state(controller):
    import ray

    return ray.get(controller.status.remote())


def served(controller) -> dict[str, int]:
    """Each ready or draining worker's finished requests, by worker id."""
    return {w["worker_id"]: w["stats"]["num_finished"] for p in pool_state(controller)["pools"].values()
            for w in p["workers"] if w["stats"]}


def in_flight(stats: dict) -> int:
    """Requests a worker holds by its Stats: prefill, queued or with its leg open; decode,
    waiting for blocks, for its KV, or in the batch."""
    return stats["num_waiting"] + stats["num_running"] + stats["num_waiting_for_kv"]


def decoding(before: dict, now: dict) -> bool:
    """Whether a decode worker is streaming tokens: requests in its batch at two polls, and
    decode steps computed between them, so a request it holds has sent tokens to the router
    (one still queued or waiting for its KV has sent none: it is retried, not migrated)."""
    return before["num_running"] > 0 and now["num_running"] > 0 \
        and now["decode_tokens_computed"] > before["decode_tokens_computed"]


def prefilling(stats: dict) -> bool:
    """Whether a prefill worker has prompt tokens still to compute: a leg that has sent its
    decode worker nothing final yet. (Its open streams also count legs already computed and
    waiting for the decode worker's ack, which a tiny model reaches in milliseconds: killed
    then, the leg may not fail.)"""
    return stats["queued_prefill_tokens"] > 0


def kill_while_holding_a_request(controller, worker_id: str, timeout_s: float = 60) -> dict:
    """Poll the worker actor's own Stats until it holds a request mid-way (a decode worker
    `decoding`, a prefill worker `prefilling`), then kill its process at once (SIGKILL, as a
    crash would: no RPC round trip between the look and the kill); returns the Stats it was
    killed on."""
    import ray

    handle = ray.get(controller.handle_of.remote(worker_id))
    [pid] = [w["pid"] for p in pool_state(controller)["pools"].values() for w in p["workers"]
             if w["worker_id"] == worker_id]
    deadline = time.monotonic() + timeout_s
    before = stats = ray.get(handle.stats.remote())
    while not (prefilling(stats) if stats["role"] == "prefill" else decoding(before, stats)):
        assert time.monotonic() < deadline, f"worker {worker_id} held no request mid-way in {timeout_s} s of traffic"
        time.sleep(0.002)
        before, stats = stats, ray.get(handle.stats.remote())
    os.kill(pid, signal.SIGKILL)
    return stats


def failed_legs(controller) -> dict[str, int]:
    """Each decode worker's prefill legs that failed (and were tried elsewhere), by worker id."""
    workers = pool_state(controller)["pools"]["decode"]["workers"]
    return {w["worker_id"]: w["stats"]["num_failed_transfers"] for w in workers if w["stats"]}


def migrations(url: str) -> float:
    """Decode legs the router resumed on another decode worker, over every reason."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(url + "/metrics")
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "pdserve_migrations_total")


def test_scale_both_pools_up_and_down_under_traffic_loses_nothing(service):
    import ray

    controller = service["controller"]
    with Traffic(service["url"]) as traffic:
        traffic.wait_for_outcomes(4, "traffic flows before the pools are scaled")
        assert ray.get(controller.scale.remote(prefill=2, decode=2)) == {"prefill": 2, "decode": 2}
        status = pool_state(controller)
        assert [len(p["workers"]) for p in status["pools"].values()] == [2, 2]
        wait_until(lambda: all(n > 0 for n in served(controller).values()) and len(served(controller)) == 4,
                   "every new worker takes traffic", state=lambda: f"requests finished {served(controller)}")
        assert ray.get(controller.scale.remote(prefill=1, decode=1)) == {"prefill": 1, "decode": 1}
        traffic.wait_for_outcomes(max(len(traffic.outcomes) + 4, 21), "the shrunken pools serve")
    outcomes = traffic.outcomes
    assert len(outcomes) > 20
    assert all(o == "ok" for o, _ in outcomes), [o for o in outcomes if o[0] != "ok"][:5]
    events = [(e["role"], e["event"]) for e in pool_state(controller)["events"]]
    for role in ("prefill", "decode"):
        assert (role, "draining") in events and (role, "drained") in events


# Long prompts make each prefill leg last (and many of them open at once), so a prefill
# worker is seen holding one within moments; the decode worker always holds some
KILL_PROMPT_LENGTHS = {"decode": (20, 150), "prefill": (600, 900)}


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_worker_actor_loses_no_request_and_is_replaced(service, role):
    import ray

    controller = service["controller"]
    ray.get(controller.scale.remote(**{role: 2}))
    before = pool_state(controller)["pools"][role]["workers"]
    assert [w["state"] for w in before] == ["ready", "ready"]
    victim_id = before[0]["worker_id"]
    migrated_before, failed_legs_before = migrations(service["url"]), failed_legs(controller)
    with Traffic(service["url"], clients=8 if role == "prefill" else 4, max_tokens=40,
                 prompt_lengths=KILL_PROMPT_LENGTHS[role]) as traffic:
        traffic.wait_for_outcomes(4, "traffic flows before the kill")
        held = kill_while_holding_a_request(controller, victim_id)
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
        [replacement] = set(ids) - {w["worker_id"] for w in before}
        wait_until(lambda: served(controller).get(replacement, 0) > 0, f"the replacement {role} worker serves",
                   state=lambda: f"requests finished {served(controller)}")
        traffic.wait_for_outcomes(restored_at + 4, "the restored pool serves")
    ray.get(controller.scale.remote(**{role: 1}))
    outcomes = [o for o, _ in traffic.outcomes]
    failed = [o for o in outcomes if o != "ok"]
    # prefill: decode workers fail over to the other prefill worker or prefill locally;
    # decode: the router resumes the victim's streams on the other decode worker
    assert not failed, (failed[:3], f"killed holding {in_flight(held)} requests")
    assert outcomes[:killed_at] and all(o == "ok" for o in outcomes[:killed_at])
    assert outcomes[restored_at:] and all(o == "ok" for o in outcomes[restored_at:]), "the restored pool serves"
    if role == "decode":  # its streams were cut mid-way and resumed elsewhere, not just never sent to it
        assert migrations(service["url"]) > migrated_before, \
            f"no stream of the killed decode worker was resumed (killed on {held})"
    else:  # the decode worker's legs on it failed, and were served elsewhere
        after = failed_legs(controller)
        assert sum(n - failed_legs_before[w] for w, n in after.items() if w in failed_legs_before) > 0, \
            f"no prefill leg failed: {failed_legs_before} -> {after} (killed on {held})"
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

