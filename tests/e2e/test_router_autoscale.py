"""The autoscaler sizes the router replicas from their CPU, on the real controller (a simulated
deployment, no traffic; the pools held at one worker each by their bounds):

- routers min 1, max 2, started at 2, with a low mark an idle router stays far below: it scales
  them down to 1 and says why (the event and the decision); an operator's `scale(routers=2)`
  pins 2 for longer than the autoscaler needs to act; `clear_override` hands them back: down to 1;
- started at 1 with a high mark below any CPU a router can read over an interval: up to 2.

The marks are deterministic, not tuned: an idle router used 0.012-0.034 of a core in our
measurements (its heartbeats), and every interval reads some CPU, since answering the reading
itself takes some (RouterActor.cpu_seconds counts in nanoseconds)."""

from __future__ import annotations

import time

from pdserve.engine.config import SIM_MODEL
from pdserve.engine.sim import DEFAULT_PROFILE
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.test_scaling import pool_state, wait_until

INTERVAL_S, COOLDOWN_S = 0.5, 1.0
# Half a core: a router tops out at about one; an idle one reads 15x below (0.034 at most measured)
IDLE_BELOW = 0.5
# Less CPU than one reading takes over an interval (a Ray call: tens of microseconds at least)
ANY_CPU = 1e-6


def serve(replicas: int, **routers):
    return start_service(SIM_MODEL, served_model_name=None, **{
        "router.replicas": replicas, "prefill.num_cpus": 0.1, "decode.num_cpus": 0.1,
        "prefill.min_replicas": 1, "prefill.max_replicas": 1, "decode.max_replicas": 1,
        "autoscaler": {"enabled": True, "profile": str(DEFAULT_PROFILE), "interval_s": INTERVAL_S,
                       "cooldown_s": COOLDOWN_S, "routers": {"min_replicas": 1, "max_replicas": 2, **routers}}})


def routers_at(controller, n: int) -> bool:
    state = pool_state(controller)
    return state["router_target"] == n and [r["state"] for r in state["routers"]] == ["ready"] * n


def autoscale_events(controller, since: float) -> list[dict]:
    return [e for e in pool_state(controller)["events"]
            if e["time"] >= since and (e["role"], e["event"]) == ("router", "autoscale")]


def test_idle_routers_scale_down_unless_an_operator_pins_them(ray_cluster):
    import ray

    controller, _ = serve(2, cpu_low=IDLE_BELOW)
    try:
        started = time.time()
        wait_until(lambda: routers_at(controller, 1), "the idle routers are scaled down to 1", 30,
                   lambda: pool_state(controller)["autoscaler"])
        (event,) = autoscale_events(controller, started)
        assert event["detail"].startswith("target 1 replica(s): 1 replica(s) would use"), event
        acted = [d for d in pool_state(controller)["autoscaler"]["router_decisions"] if d["action"] == 1]
        assert acted and acted[0]["current"] == 2 and "below low" in acted[0]["reason"], acted
        assert all(cpu < IDLE_BELOW for cpu in acted[0]["cpu"]), acted

        assert ray.get(controller.scale.remote(routers=2), timeout=60)["routers"] == 2
        pinned = time.time()
        unpinned_would_act_by = pinned + COOLDOWN_S + 3 * INTERVAL_S  # low a cooldown, then the next decision

        def decisions_since_pin() -> list[dict]:
            return [d for d in pool_state(controller)["autoscaler"]["router_decisions"] if d["time"] > pinned]

        wait_until(lambda: any(d["time"] > unpinned_would_act_by for d in decisions_since_pin()),
                   "decisions for longer than an unpinned scale-down takes", 30)
        state = pool_state(controller)
        assert state["router_target"] == 2 and "router" in state["autoscaler"]["overridden"]
        assert all("override" in d["reason"] and d["action"] is None for d in decisions_since_pin())
        assert not autoscale_events(controller, pinned)

        ray.get(controller.clear_override.remote(), timeout=60)
        wait_until(lambda: routers_at(controller, 1), "the unpinned routers are scaled down to 1 again", 30,
                   lambda: pool_state(controller)["autoscaler"])
        assert pool_state(controller)["pools"]["decode"]["target"] == 1
    finally:
        stop_service(controller)


def test_routers_above_the_high_mark_scale_up(ray_cluster):
    controller, _ = serve(1, cpu_high=ANY_CPU, cpu_low=ANY_CPU / 2)
    try:
        started = time.time()
        wait_until(lambda: routers_at(controller, 2), "the routers are scaled up to 2", 30,
                   lambda: pool_state(controller)["autoscaler"])
        (event,) = autoscale_events(controller, started)  # and no further: max 2
        assert event["detail"].startswith("target 2 replica(s): mean CPU") and "above high" in event["detail"]
    finally:
        stop_service(controller)
