"""The autoscaler on a real local cluster (tiny model) decides both ways on one TPOT SLO, set
between the TPOT a light load and a heavy load get on this machine (measured first, on the
same service without the autoscaler): under the light load, once the autoscaler's correction
of the profile has settled, the decode pool is not scaled up and none is wanted; a heavy load
step scales it up; removing the load scales it back down after the cooldown;
no request is lost meanwhile; every decision is visible in status and metrics."""

import math
import subprocess
import sys
import time

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get
from tests.e2e.test_scaling import Traffic, pool_state, wait_until

LIGHT_CLIENTS, HEAVY_CLIENTS, MAX_TOKENS = 1, 48, 40
# The heavy load's TPOT must be this many times the light load's: an SLO between them (their
# geometric mean) then sits at least 3 times away from each, beyond the drift of a shared
# machine between the measurement and the decisions (2.2x was seen within a minute)
SPREAD = 9.0
MIN_SAMPLES, LIGHT_DECISIONS = 3, 4
# The autoscaler corrects the profile by what it observes, by at most sqrt(8) a decision: a
# profile measured while the machine was busy can be off by more than 8x (its first light
# decisions then plan for a slower engine), so the light load's decisions are judged after these
SETTLING_DECISIONS = 5
AUTOSCALER = {"interval_s": 2.0, "window_s": 6.0, "cooldown_s": 6.0, "min_samples": MIN_SAMPLES}


def router_observations(window_s: float) -> dict:
    """What the router tells the autoscaler about the requests that ended in the last `window_s`."""
    import ray

    router = ray.get_actor("pdserve-router", namespace="pdserve")
    return ray.get(router.observations.remote(window_s, 90.0))


def tpot_under(url: str, clients: int, requests: int) -> float:
    """The router's TPOT p90 (the autoscaler's own figure) over `requests` requests of a load
    of `clients` streaming clients, those of this load only."""
    started = time.monotonic()
    with Traffic(url, clients=clients, max_tokens=MAX_TOKENS) as traffic:
        traffic.wait_for_outcomes(requests, f"{requests} requests of {clients} clients")
        observed = router_observations(time.monotonic() - started)
    assert all(o == "ok" for o, _ in traffic.outcomes), traffic.outcomes[:3]
    return observed["tpot_p"]


def measured_slo(tiny_llama_dir) -> tuple[float, float, float]:
    """(light TPOT, heavy TPOT, the SLO between them), measured on a service of the same shape
    as the autoscaled one but without the autoscaler (which a tight SLO would set to work)."""
    import ray

    controller, url = start_service(tiny_llama_dir)
    try:
        light = tpot_under(url, LIGHT_CLIENTS, 30)
        heavy = tpot_under(url, HEAVY_CLIENTS, 3 * HEAVY_CLIENTS)
    finally:
        stop_service(controller)

    def controller_gone() -> bool:  # the next service's controller takes the same name
        try:
            ray.get_actor("pdserve-controller", namespace="pdserve")
        except ValueError:
            return True
        return False

    wait_until(controller_gone, "the measuring service's controller is gone", 60)
    assert heavy > SPREAD * light, f"TPOT p90 {heavy * 1000:.1f} ms under {HEAVY_CLIENTS} clients, " \
                                   f"{light * 1000:.1f} ms under {LIGHT_CLIENTS}: too close for an SLO between"
    return light, heavy, math.sqrt(light * heavy)


def decisions_after(controller, since: float, count: int, what: str) -> list[dict]:
    """Until the autoscaler has made `count` decisions after `since` (wall time) on at least
    MIN_SAMPLES requests each; returns them all."""
    seen: dict[float, dict] = {}

    def enough() -> bool:
        for d in pool_state(controller)["autoscaler"]["decisions"]:
            if d["time"] > since and d["observed"]["count"] >= MIN_SAMPLES:
                seen[d["time"]] = d
        return len(seen) >= count

    wait_until(enough, f"{count} autoscaler decisions {what}", 120, lambda: list(seen.values()))
    return sorted(seen.values(), key=lambda d: d["time"])


def decode_target(controller) -> int:
    return pool_state(controller)["pools"]["decode"]["target"]


def test_autoscaler_follows_a_load_step_and_not_a_light_load(ray_cluster, tiny_llama_dir, tmp_path):
    profile = tmp_path / "profile.json"
    out = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "profile", "--model", str(tiny_llama_dir),
                          "--out", str(profile), "--repeats", "2", "--max-model-len", "1024"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    light_tpot, heavy_tpot, tpot_slo = measured_slo(tiny_llama_dir)

    controller, url = start_service(tiny_llama_dir, **{
        "autoscaler": {"enabled": True, "profile": str(profile), "ttft_slo_s": 30.0, "tpot_slo_s": tpot_slo,
                       **AUTOSCALER},
        "decode.max_replicas": 3, "prefill.max_replicas": 1, "prefill.min_replicas": 1})
    measured = f"SLO {tpot_slo * 1000:.1f} ms between {light_tpot * 1000:.1f} and {heavy_tpot * 1000:.1f} ms"
    try:
        with Traffic(url, clients=LIGHT_CLIENTS, max_tokens=MAX_TOKENS) as light:
            decisions_after(controller, time.time(), SETTLING_DECISIONS, "settling on the light load")
            # one that planned with the profile's first figures may have scaled up: it comes back
            # down once the plan stays lower for a cooldown
            wait_until(lambda: decode_target(controller) == 1, "the decode pool is back at 1 under the light load",
                       60, lambda: (measured, pool_state(controller)["autoscaler"]))
            since = time.time()
            decisions = decisions_after(controller, since, LIGHT_DECISIONS, "on the light load")
            light_target = decode_target(controller)
            scaled = [e for e in pool_state(controller)["events"]
                      if e["time"] > since and (e["role"], e["event"]) == ("decode", "autoscale")]
        assert light_target == 1 and not scaled and all(d["desired"]["decode"] == 1 for d in decisions), \
            (measured, scaled, [(d["observed"], d["correction"], d["desired"]) for d in decisions])
        with Traffic(url, clients=HEAVY_CLIENTS, max_tokens=MAX_TOKENS) as traffic:
            wait_until(lambda: decode_target(controller) >= 2,
                       f"the heavy load scales the decode pool up ({measured})", 90,
                       lambda: pool_state(controller)["autoscaler"])
            traffic.wait_for_outcomes(len(traffic.outcomes) + HEAVY_CLIENTS, "the scaled-up pool serves")
        wait_until(lambda: decode_target(controller) == 1,
                   "no load scales the decode pool back down", 90, lambda: pool_state(controller)["autoscaler"])
        status = pool_state(controller)
        outcomes = light.outcomes + traffic.outcomes
        assert outcomes and all(o == "ok" for o, _ in outcomes), [o for o in outcomes if o[0] != "ok"][:3]
        decisions = status["autoscaler"]["decisions"]
        assert decisions and {"observed", "correction", "desired", "action", "current"} <= set(decisions[-1])
        events = [(e["role"], e["event"]) for e in status["events"]]
        assert ("decode", "autoscale") in events and ("decode", "drained") in events
        deadline = time.monotonic() + 15  # the router mirrors the controller every 2 s
        while 'pdserve_autoscaler_target_replicas{pool="decode"} 1.0' not in (metrics := get(url + "/metrics")[1]):
            assert time.monotonic() < deadline, metrics[-1500:]
            time.sleep(0.5)
        assert "pdserve_autoscaler_correction" in metrics
    finally:
        stop_service(controller)
