"""The autoscaler sizes the router replicas from their CPU (cluster.autoscaler.RouterSizer,
under a fake clock): one more when their mean is above the high mark, once the cooldown since
the last change has passed; one fewer only once their CPU spread over one replica fewer has
stayed below the low mark a whole cooldown; within the bounds; never against an operator's pin.
Also the settings (`autoscaler.routers`: bounds and marks, validated; fixed by default) and the
CPU reading a replica reports."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.cluster.actors import RouterActor
from pdserve.cluster.autoscaler import RouterSizer, cpu_used
from pdserve.cluster.config import RouterScalingSpec, load_config

HIGH, LOW, COOLDOWN = 0.7, 0.35, 30.0
HOT = [HIGH + 0.2, HIGH + 0.1]  # mean above the high mark
IDLE = [LOW / 10, LOW / 10]  # even one replica would carry both below the low mark


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sizer(bounds=(1, 4)) -> tuple[RouterSizer, Clock]:
    clock = Clock()
    return RouterSizer(bounds, HIGH, LOW, COOLDOWN, clock=clock), clock


def test_a_hot_router_gets_one_more_replica_at_once():
    s, _ = sizer()
    decision = s.decide(HOT, 2)
    assert decision.action == 3 and decision.desired == 3
    assert "above high" in decision.reason and "scaling to 3" in decision.reason


def test_up_again_only_once_the_cooldown_since_the_last_change_has_passed():
    s, clock = sizer()
    assert s.decide(HOT, 2).action == 3
    clock.now = COOLDOWN - 1
    held = s.decide(HOT, 3)
    assert held.action is None and held.desired == 4 and "holding" in held.reason
    clock.now = COOLDOWN
    assert s.decide(HOT, 3).action == 4


def test_down_only_after_staying_low_a_whole_cooldown():
    s, clock = sizer()
    first = s.decide(IDLE, 3)
    assert first.action is None and first.desired == 2 and "below low" in first.reason
    clock.now = COOLDOWN - 1
    assert s.decide(IDLE, 3).action is None
    clock.now = COOLDOWN
    assert s.decide(IDLE, 3).action == 2


def test_a_busy_interval_restarts_the_wait_before_scaling_down():
    s, clock = sizer()
    s.decide(IDLE, 3)
    clock.now = COOLDOWN / 2
    assert s.decide([(LOW + HIGH) / 2] * 3, 3).action is None  # between the marks: wants no change
    clock.now = COOLDOWN
    assert s.decide(IDLE, 3).action is None  # low again, but only since now
    clock.now = 2 * COOLDOWN
    assert s.decide(IDLE, 3).action == 2


def test_no_scale_down_when_the_replicas_left_would_be_above_the_low_mark():
    """Hysteresis: each replica below the low mark is not enough; spread over one fewer,
    their CPU must stay below it too, so that the replicas left do not read as busy."""
    s, clock = sizer()
    each = LOW * 0.6  # two replicas' total over one replica: 1.2 x LOW
    for clock.now in (0.0, COOLDOWN, 2 * COOLDOWN):
        decision = s.decide([each, each], 2)
        assert decision.action is None and decision.desired == 2, decision


def test_a_replica_not_yet_measured_counts_as_the_mean():
    s, clock = sizer()
    each = LOW * 0.6  # measured alone, one replica of two: the pair would still need two
    for clock.now in (0.0, COOLDOWN):
        assert s.decide([each], 2).action is None


def test_bounds_hold_the_count_and_bring_an_outside_count_in():
    s, clock = sizer(bounds=(2, 3))
    at_max = s.decide(HOT, 3)
    assert at_max.action is None and at_max.desired == 3 and "bounds [2, 3]" in at_max.reason
    for clock.now in (0.0, COOLDOWN):
        assert s.decide(IDLE, 2).action is None  # at min
    clock.now = 2 * COOLDOWN
    assert s.decide(IDLE, 1).action == 2  # below min (an operator's count, handed back): up at once
    clock.now = 3 * COOLDOWN
    s.decide([(LOW + HIGH) / 2] * 4, 4)  # above max, the CPU asking for nothing: down after a cooldown
    clock.now = 4 * COOLDOWN
    assert s.decide([(LOW + HIGH) / 2] * 4, 4).action == 3


def test_an_operator_pin_and_missing_readings_hold_the_count():
    s, clock = sizer()
    pinned = s.decide(HOT, 2, overridden=True)
    assert pinned.action is None and pinned.desired == 2 and "override" in pinned.reason
    assert s.decide([], 2).action is None
    assert s.decide(HOT, 2).action == 3  # the pin held no clock: up at once when released


def test_the_decision_as_recorded_says_why():
    s, _ = sizer()
    recorded = s.decide(HOT, 2).as_dict()
    assert recorded["current"] == 2 and recorded["action"] == 3 and recorded["cpu"] == pytest.approx(HOT, abs=1e-4)
    assert "above high" in recorded["reason"] and recorded["time"] == pytest.approx(time.time(), abs=60)


def test_router_count_is_fixed_by_default_and_ranged_when_max_is_above_min(tmp_path):
    assert load_config(None).router_bounds() is None
    assert RouterScalingSpec(max_replicas=4).bounds() == (1, 4)
    assert RouterScalingSpec(min_replicas=2, max_replicas=2).bounds() is None
    assert load_config(None, {"router.replicas": 3}).autoscaler.routers.bounds() is None  # fixed at 3
    ranged = {"autoscaler.routers.max_replicas": 3, "cluster_token": "t" * 32}
    assert load_config(None, ranged).router_bounds() is None  # the autoscaler is off
    profile = tmp_path / "profile.json"  # only its name is read here
    on = load_config(None, {**ranged, "autoscaler.enabled": True, "autoscaler.profile": str(profile)})
    assert on.router_bounds() == (1, 3)


def test_bad_router_scaling_settings_are_named():
    with pytest.raises(ValueError, match=r"router.replicas \(3\) must be within"):
        load_config(None, {"router.replicas": 3, "autoscaler.routers.max_replicas": 2})
    with pytest.raises(ValueError, match=r"router.replicas \(1\) must be within"):
        load_config(None, {"autoscaler.routers.min_replicas": 2, "autoscaler.routers.max_replicas": 4})
    with pytest.raises(ValueError, match="cpu_low .* must be below cpu_high"):
        load_config(None, {"autoscaler.routers.cpu_low": 0.8})
    with pytest.raises(ValueError, match="autoscaler.routers.cpu_high: Input should be greater than 0"):
        load_config(None, {"autoscaler.routers.cpu_high": 0})
    with pytest.raises(ValueError, match="share one port"):
        load_config(None, {"router.port": 0, "autoscaler.enabled": True, "autoscaler.profile": "p.json",
                           "autoscaler.routers.max_replicas": 2})


def test_a_replica_reports_the_cpu_it_uses_not_the_time_passing():
    actor = RouterActor()

    def used_over(work) -> float:
        before = asyncio.run(actor.cpu_seconds())
        work()
        after = asyncio.run(actor.cpu_seconds())
        assert after[1] - before[1] >= 0.2  # the wall clock it reports
        return cpu_used(before, after)

    def spin() -> None:
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            pass

    idle, busy = used_over(lambda: time.sleep(0.2)), used_over(spin)
    assert 0.0 < idle < busy <= 1.5, (idle, busy)  # never 0: the reading itself uses some
