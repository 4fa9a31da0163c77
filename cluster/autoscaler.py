"""Keeps each pool sized for its SLO as load changes (Dynamo-style correction on top of the
DistServe-style planner).

Every interval: take the router's recent observations (arrival rate, prompt and output
lengths with each prompt's cached tokens: the observed prefix-cache hits, TTFT and TPOT
percentiles, and each request's arrival time); simulate the current pool sizes on those
arrivals with the profile; correct the profile by observed/predicted latency (smoothed);
plan instances per pool with the corrected profile; move each pool toward its plan within [min, max] --
up as soon as the cooldown since its last change has passed, down only once the plan
has stayed lower for a whole cooldown (hysteresis). A pool an operator scaled by hand is
left alone until the override is cleared. Pure decision logic: the controller applies it.

The router replicas are sized apart, from their own CPU (`RouterSizer`): a router process
tops out at about one core whatever the pools do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.planner.search import SLO, phase_curve
from pdserve.cluster.planner.simulator import simulate
from pdserve.cluster.planner.workload import SimRequest, poisson
from pdserve.engine.profile import Profile

ROLES = ("prefill", "decode")


@dataclass
class Decision:
    time: float
    observed: dict
    correction: dict
    desired: dict
    action: dict = field(default_factory=dict)  # role -> new size, for pools that change
    reason: str = ""

    def as_dict(self) -> dict:
        return {"time": time.time(), "observed": self.observed, "correction": self.correction,
                "desired": self.desired, "action": self.action, "reason": self.reason}


class Autoscaler:
    def __init__(self, profile: Profile, slo: SLO, bounds: dict[str, tuple[int, int]], cooldown_s: float,
                 min_samples: int = 5, clock: Callable[[], float] = time.monotonic,
                 local_prefill_max_tokens: int = 0) -> None:
        self.profile, self.slo, self.bounds = profile, slo, bounds
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.cooldown_s, self.min_samples, self.clock = cooldown_s, min_samples, clock
        self.correction = {"prefill": 1.0, "decode": 1.0}
        self.last_change = {role: -math.inf for role in ROLES}
        self.below_since: dict[str, float | None] = {role: None for role in ROLES}

    def decide(self, observed: dict, current: dict[str, int], overridden: set[str] = frozenset()) -> Decision:
        """`observed`: rate (req/s), count, lengths [(prompt, output[, cached])], ttft_p and tpot_p (s);
        optionally arrivals (s, one per entry of lengths), see observed_work."""
        now = self.clock()
        if observed["count"] and observed["count"] < self.min_samples:
            return Decision(now, observed, dict(self.correction), dict(current), {}, "too few samples; holding")
        desired = self._desired(observed, current)
        decision = Decision(now, observed, dict(self.correction), desired)
        for role in ROLES:
            if role in overridden:
                decision.reason += f"{role}: operator override; "
                continue
            want, have = desired[role], current[role]
            cooled = now - self.last_change[role] >= self.cooldown_s
            if want > have:
                self.below_since[role] = None
                if cooled:
                    decision.action[role] = want
            elif want < have:
                self.below_since[role] = self.below_since[role] or now
                if cooled and now - self.below_since[role] >= self.cooldown_s:
                    decision.action[role] = want
            else:
                self.below_since[role] = None
        for role in decision.action:
            self.last_change[role] = now
            self.below_since[role] = None
        decision.reason += "scaling" if decision.action else "no change"
        return decision

    def _desired(self, observed: dict, current: dict[str, int]) -> dict[str, int]:
        rate = observed["rate"]
        if not observed["count"] or rate <= 0:
            return {role: self._clamp(role, 0) for role in ROLES}
        lengths = observed["lengths"]
        self._update_correction(observed, current, lengths)
        corrected = self.profile.scaled(prefill=self.correction["prefill"], decode=self.correction["decode"])
        local = self.local_prefill_max_tokens
        capacity = {
            "prefill": phase_curve(corrected, lengths, "prefill", self.slo.percentile, 150,
                                   local_prefill_max_tokens=local).capacity(self.slo, True, False),
            "decode": phase_curve(corrected, lengths, "decode", self.slo.percentile, 150,
                                  local_prefill_max_tokens=local).capacity(self.slo, False, True),
        }
        return {role: self._clamp(role, math.ceil(rate / capacity[role]) if capacity[role] > 0 else 1 << 20)
                for role in ROLES}

    def _update_correction(self, observed: dict, current: dict[str, int], lengths) -> None:
        work = observed_work(observed)
        corrected = self.profile.scaled(prefill=self.correction["prefill"], decode=self.correction["decode"])
        predicted = simulate(corrected, work, max(1, current["prefill"]), max(1, current["decode"]),
                             local_prefill_max_tokens=self.local_prefill_max_tokens)
        for role, key, which in (("prefill", "ttft_p", "ttft_s"), ("decode", "tpot_p", "tpot_s")):
            seen, model = observed.get(key), predicted.percentile(which, self.slo.percentile)
            if seen and model > 0:
                ratio = min(8.0, max(0.125, seen / model))
                self.correction[role] = min(64.0, max(1 / 64, self.correction[role] * ratio ** 0.5))

    def _clamp(self, role: str, n: int) -> int:
        low, high = self.bounds[role]
        return max(low, min(high, n))


def observed_work(observed: dict) -> list[SimRequest]:
    """The load the correction simulates to compare with the observed percentiles: the
    window's requests as they arrived when `observed` has their arrival times ("arrivals",
    aligned with "lengths"), else a Poisson stream at the observed rate with those lengths.

    Why the arrivals: a correction is meant to say how much slower the engines run than the
    profile, and a Poisson stream smooths away the bursts a real window had. On the
    multi-turn-chat workload (sessions starting together, each first turn a long uncached
    prompt) Poisson put the TTFT p90 at 1.1 s where the same profile over the arrivals as they
    came gave 5.7 s (measured 7.0 s): five decisions took the prefill correction to 4x,
    reading the burst as slow prefill.
    """
    lengths, arrivals = observed["lengths"], observed.get("arrivals")
    if arrivals and len(arrivals) == len(lengths):
        start = min(arrivals)
        return sorted((SimRequest(t - start, *shape) for t, shape in zip(arrivals, lengths, strict=True)),
                      key=lambda r: r.arrival_s)
    return poisson(observed["rate"], 150, lengths, seed=7)


def cpu_used(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Cores a process used between two of its (CPU seconds, monotonic seconds) readings
    (RouterActor.cpu_seconds)."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1e-9)


@dataclass
class RouterDecision:
    time: float
    cpu: list[float]  # cores each measured replica used over the last interval
    current: int
    desired: int
    action: int | None = None  # the new replica count, when it changes
    reason: str = ""

    def as_dict(self) -> dict:
        return {"time": time.time(), "cpu": [round(c, 4) for c in self.cpu], "current": self.current,
                "desired": self.desired, "action": self.action, "reason": self.reason}


class RouterSizer:
    """Sizes the router replicas from their CPU. One router process tops out at about one core
    (~20k streamed tokens/s per router CPU-second), so the replicas' mean CPU use says whether
    they keep up. Given the cores each replica used over the last interval and the count now:

    - mean above `high`: one replica more, as soon as `cooldown_s` has passed since the last change;
    - the replicas' total spread over one replica fewer below `low`: one fewer, once that has held
      for a whole cooldown (hysteresis: with low < high, the replicas left do not read as busy);
    - within `bounds` [min, max]; a count outside them is brought inside the same way.

    Up by one, not by as many as would bring the mean to a target: a saturated replica reads
    about one core however much load waits, so its reading cannot say how many more are needed
    (and the kernel gives a new replica only new connections). Pure decision logic: the
    controller reads the CPU and applies it."""

    def __init__(self, bounds: tuple[int, int], high: float, low: float, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds, self.high, self.low, self.cooldown_s, self.clock = bounds, high, low, cooldown_s, clock
        self.last_change = -math.inf
        self.below_since: float | None = None  # since when the replicas wanted fewer

    def decide(self, cpu: list[float], current: int, overridden: bool = False) -> RouterDecision:
        """`cpu`: the cores each replica measured used over the last interval (unmeasured ones,
        e.g. just started, are assumed to use the mean); `overridden`: an operator pinned the count."""
        now = self.clock()
        if overridden or not cpu:
            return RouterDecision(now, cpu, current, current, None,
                                  "operator override; holding" if overridden else "no CPU readings yet; holding")
        mean = sum(cpu) / len(cpu)
        fewer = mean * current / (current - 1) if current > 1 else math.inf
        if mean > self.high:
            want, why = current + 1, f"mean CPU {mean:.3f} cores above high {self.high:g}"
        elif fewer < self.low:
            want, why = current - 1, f"{current - 1} replica(s) would use {fewer:.3f} cores each, " \
                                     f"below low {self.low:g}"
        else:
            want, why = current, f"mean CPU {mean:.3f} cores"
        lowest, highest = self.bounds
        desired = max(lowest, min(highest, want))
        if desired != want:
            why += f", bounds [{lowest}, {highest}]"
        decision = RouterDecision(now, cpu, current, desired, None, why)
        cooled = now - self.last_change >= self.cooldown_s
        if desired > current:
            self.below_since = None
            decision.action = desired if cooled else None
        elif desired < current:
            self.below_since = now if self.below_since is None else self.below_since
            decision.action = desired if cooled and now - self.below_since >= self.cooldown_s else None
        else:
            self.below_since = None
        if decision.action is not None:
            self.last_change, self.below_since = now, None
            decision.reason += f": scaling to {decision.action}"
        elif desired != current:
            decision.reason += f": holding for the {self.cooldown_s:g} s cooldown"
        return decision
