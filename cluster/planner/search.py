"""From a profile and SLOs to instance counts (DistServe-style).

For each phase, the latency percentile one instance delivers is computed on a geometric
grid of Poisson rates (with the workload's length distribution); an instance's capacity
under an SLO is the highest grid rate below which every grid rate meets it. Because the
grid curves do not depend on the SLO, capacity never grows when an SLO tightens, and
instances = ceil(rate / capacity) never shrink when the rate grows: monotone by
construction. The plan is then checked by simulating the whole system at the target rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.cluster.planner.simulator import simulate
from pdserve.cluster.planner.workload import SimRequest, poisson
from pdserve.engine.profile import Profile

GRID_POINTS = 36
MAX_INSTANCES = 256


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0 and 0 < self.percentile < 100):
            raise ValueError(f"SLOs must be > 0 and the percentile in (0, 100): {self}")


@dataclass
class Curve:
    """Latency percentiles of one instance of a phase at increasing Poisson rates."""

    rates: list[float]
    ttft: list[float]
    tpot: list[float]

    def capacity(self, slo: SLO, check_ttft: bool, check_tpot: bool) -> float:
        best = 0.0
        for rate, ttft, tpot in zip(self.rates, self.ttft, self.tpot, strict=True):
            if (check_ttft and ttft > slo.ttft_s) or (check_tpot and tpot > slo.tpot_s):
                break
            best = rate
        return best


@dataclass
class Plan:
    feasible: bool
    rate: float
    slo: SLO
    prefill: int
    decode: int
    colocated: int
    capacity: dict = field(default_factory=dict)  # requests/s one instance sustains, per phase
    predicted: dict = field(default_factory=dict)  # attainment and percentiles, per layout
    note: str = ""

    def table(self) -> str:
        rows = [f"{'layout':12} {'instances':>16} {'attainment':>11} {'TTFT p':>8} {'TPOT p':>8} "
                f"{'goodput/unit':>13}"]
        for layout, count in (("disaggregated", f"{self.prefill}P + {self.decode}D"),
                              ("colocated", f"{self.colocated}")):
            p = self.predicted.get(layout, {})
            rows.append(f"{layout:12} {count:>16} {p.get('attainment', 0):>11.1%} "
                        f"{p.get('ttft_p', 0):>7.2f}s {p.get('tpot_p', 0) * 1000:>6.0f}ms "
                        f"{p.get('goodput_per_unit', 0):>10.3f}/s")
        return "\n".join(rows)


def lengths_of(requests: list[SimRequest]) -> list[tuple[int, int, int]]:
    return [(r.prompt_len, r.output_len, r.cached_len) for r in requests]


def phase_curve(profile: Profile, lengths: list[tuple[int, ...]], phase: str, percentile: float = 90.0,
                requests: int = 300, seed: int = 0, local_prefill_max_tokens: int = 0) -> Curve:
    """`phase`: "prefill" (1 prefill instance, decode unconstrained), "decode" (the reverse),
    or "colocated" (1 colocated instance). `lengths`: (prompt, output[, cached]) tuples."""
    top = _saturation_rate(profile, lengths, phase) * 1.6
    rates = [top * (0.02 ** (1 - i / (GRID_POINTS - 1))) for i in range(GRID_POINTS)]
    curve = Curve(rates, [], [])
    for rate in rates:
        work = poisson(rate, requests, lengths, seed)
        if phase == "prefill":
            result = simulate(profile, work, prefill=1, decode=64, local_prefill_max_tokens=local_prefill_max_tokens)
        elif phase == "decode":
            result = simulate(profile, work, prefill=64, decode=1, local_prefill_max_tokens=local_prefill_max_tokens)
        else:
            result = simulate(profile, work, prefill=0, decode=1, colocated=True)
        curve.ttft.append(result.percentile("ttft_s", percentile))
        curve.tpot.append(result.percentile("tpot_s", percentile))
    return curve


def _saturation_rate(profile: Profile, lengths: list[tuple[int, ...]], phase: str) -> float:
    """A rough upper bound of the rate one instance can serve (where the grid ends)."""
    mean_prompt = sum(t[0] for t in lengths) / len(lengths)
    mean_output = sum(t[1] for t in lengths) / len(lengths)
    mean_computed = max(1.0, mean_prompt - sum(t[2] if len(t) > 2 else 0 for t in lengths) / len(lengths))
    budget = profile.max_num_batched_tokens
    prefill_s = profile.prefill_step_s(budget, budget * mean_prompt) / budget * mean_computed
    batch = min(profile.max_num_seqs, 64)
    decode_s = profile.decode_step_s(batch, batch * (mean_prompt + mean_output / 2)) / batch * mean_output
    per_request = {"prefill": prefill_s, "decode": decode_s, "colocated": prefill_s + decode_s}[phase]
    return 1.0 / max(per_request, 1e-6)


def make_plan(profile: Profile, slo: SLO, rate: float, workload: list[SimRequest],
              curves: dict[str, Curve] | None = None, verify_requests: int = 300,
              local_prefill_max_tokens: int = 0) -> Plan:
    """Instances per pool for `rate` requests/s with `workload`'s lengths (and cached
    prefixes), and predictions; decode workers prefill locally what lacks at most
    `local_prefill_max_tokens` after their cache."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    lengths = lengths_of(workload)
    curves = curves or {phase: phase_curve(profile, lengths, phase, slo.percentile,
                                           local_prefill_max_tokens=local_prefill_max_tokens)
                        for phase in ("prefill", "decode", "colocated")}
    capacity = {"prefill": curves["prefill"].capacity(slo, True, False),
                "decode": curves["decode"].capacity(slo, False, True),
                "colocated": curves["colocated"].capacity(slo, True, True)}
    feasible = capacity["prefill"] > 0 and capacity["decode"] > 0
    counts = {k: min(MAX_INSTANCES, math.ceil(rate / v)) if v > 0 else MAX_INSTANCES for k, v in capacity.items()}
    plan = Plan(feasible, rate, slo, counts["prefill"], counts["decode"], counts["colocated"], capacity)
    if not feasible:
        plan.prefill, plan.decode = max(1, counts["prefill"] if capacity["prefill"] else 1), \
            max(1, counts["decode"] if capacity["decode"] else 1)
        best = curves["prefill"].ttft[0], curves["decode"].tpot[0]
        plan.note = (f"no configuration meets these SLOs: at the lightest load one instance gives "
                     f"TTFT p{slo.percentile:g} {best[0]:.2f}s (SLO {slo.ttft_s}s) and TPOT p{slo.percentile:g} "
                     f"{best[1] * 1000:.0f}ms (SLO {slo.tpot_s * 1000:.0f}ms); best attainable figures shown")
    work = poisson(rate, max(verify_requests, min(len(workload), 2000)), lengths, seed=1)
    plan.predicted["disaggregated"] = predict(profile, slo, work, plan.prefill, plan.decode, False,
                                              local_prefill_max_tokens)
    colocated = plan.colocated if capacity["colocated"] else max(1, plan.prefill + plan.decode)
    plan.predicted["colocated"] = predict(profile, slo, work, 0, colocated, True)
    return plan


def predict(profile: Profile, slo: SLO, work: list[SimRequest], prefill: int, decode: int,
            colocated: bool, local_prefill_max_tokens: int = 0) -> dict:
    result = simulate(profile, work, prefill, decode, colocated, local_prefill_max_tokens)
    attainment = result.attainment(slo.ttft_s, slo.tpot_s)
    units = decode + (0 if colocated else prefill)
    span = max(1e-9, work[-1].arrival_s - work[0].arrival_s)
    rate = (len(work) - 1) / span
    return {"attainment": attainment, "ttft_p": result.percentile("ttft_s", slo.percentile),
            "tpot_p": result.percentile("tpot_s", slo.percentile), "units": units,
            "goodput_per_unit": rate * attainment / units}
