"""Serving-calibrated latency models: a profile's step times scaled, kind by kind, by what
the same engine's steps took while it served.

`pdserve profile` times the engine alone. Serving adds what that cannot see: the router,
the clients and Ray on the same cores, and the worker's own gRPC, token-streaming and
KV-transfer threads beside its engine (measured on this 2-core machine: serving steps took
1.2-1.7x the engine-alone model; benchmarks/planner_validation.py). A step log recorded
while serving (PDSERVE_STEP_LOG, engine.step_log) measures it: for each kind of step --
prefill only, decode only, mixed (prompt chunks beside running decodes) -- the kind's
measured seconds in all over its predicted seconds in all scales its coefficients. What
no step log shows -- the first token's way from the client through the router to an engine
and back -- is a fixed first-token overhead, set from measured against simulated TTFTs
(with_first_token_overhead).

Why totals and not the median step: a TPOT is a sum of the steps a request lived through,
and a TTFT a sum of prompt chunks, so what the model must get right is the time the steps
take together. Serving's slowdown is skewed (the slow steps are the large ones and the ones
another process preempted): in one calibration replay on a 1-core decode worker the median
step ran 4.10x a profile's model and the steps' total 4.48x, and on an earlier host
measured TPOTs ran 2-4 ms (6-10%) above those simulated with a median-scaled model of the
same run's own steps. The median stays in the record, beside the factor. Pure: no I/O here.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from engine.profile import Profile
from engine.profile import step_kind as kind_of

MIN_STEPS = 5  # fewer logged steps of a kind: not calibrated by its own steps (see calibrate)


def step_kind(step: dict) -> str:
    """"prefill", "decode" or "mixed", from a step record's T (prompt tokens) and B (decodes)."""
    return kind_of(step["T"], step["B"])


def predicted_s(profile: Profile, step: dict) -> float:
    return profile.step_s(step["T"], step["Q"], step["B"], step["C"])


def step_ratios(profile: Profile, steps: list[dict]) -> dict[str, list[float]]:
    """Measured / predicted seconds of each logged step (records with s, T, Q, B, C), by kind."""
    ratios: dict[str, list[float]] = {}
    for step in steps:
        model = predicted_s(profile, step)
        if model > 0:
            ratios.setdefault(step_kind(step), []).append(step["s"] / model)
    return ratios


def total_ratios(profile: Profile, steps: list[dict]) -> dict[str, tuple[int, float]]:
    """(steps, measured seconds in all / predicted seconds in all) of logged steps, by kind."""
    sums: dict[str, list] = {}
    for step in steps:
        model = predicted_s(profile, step)
        if model > 0:
            total = sums.setdefault(step_kind(step), [0, 0.0, 0.0])
            total[0] += 1
            total[1] += step["s"]
            total[2] += model
    return {kind: (count, measured / predicted) for kind, (count, measured, predicted) in sums.items()}


def calibrate(profile: Profile, steps: list[dict]) -> Profile:
    """`profile` with each kind's coefficients scaled by the kind's measured seconds in all
    over its predicted seconds in all, over `steps` (a serving step log of engines this
    profile models); the factors, step counts and median per-step ratios are recorded in the
    result's samples["serving_calibration"]. A kind with fewer than MIN_STEPS steps: prefill
    or decode keeps its profiled coefficients; mixed steps take the prefill factor on their
    prefill terms and the decode factor on the rest."""
    totals = total_ratios(profile, steps)
    factors = {kind: ratio for kind, (count, ratio) in totals.items() if count >= MIN_STEPS}
    calibrated = profile.scaled(prefill=factors.get("prefill", 1.0), decode=factors.get("decode", 1.0),
                                mixed=factors.get("mixed"))
    record = {"factors": factors, "steps": {kind: count for kind, (count, _) in totals.items()},
              "median_ratios": {kind: statistics.median(r) for kind, r in step_ratios(profile, steps).items()}}
    return replace(calibrated, samples={**profile.samples, "serving_calibration": record})



def with_first_token_overhead(profile: Profile, measured_ttft_s: list[float | None],
                              simulated_ttft_s: list[float | None]) -> Profile:
    """`profile` with `first_token_overhead_s` set to the median of measured minus simulated
    TTFT over the requests both have (None: failed or not simulated), at least 0; recorded
    in samples["serving_calibration"]["first_token_overhead_s"].

    `simulated_ttft_s` is the same requests simulated with `profile` (its own overhead, if
    any, is replaced, not added to). What it measures: the time from a request reaching the
    router to its first token reaching the client, beyond the engine steps that made the
    token -- HTTP, routing, the RPCs to the workers, streaming the token back. On a 2-core
    host serving SmolLM2 it was 150-250 ms per request (planner_validation's own-speed
    diagnostic), and a TTFT SLO near a prompt's prefill time is missed by that much. The
    median, not the mean: a few requests queued differently in the real run than in the
    simulation must not set it."""
    gaps = [m - s for m, s in zip(measured_ttft_s, simulated_ttft_s, strict=True) if m is not None and s is not None]
    if not gaps:
        raise ValueError("no request has both a measured and a simulated TTFT to calibrate a first-token overhead")
    own = profile.first_token_overhead_s
    overhead = max(0.0, statistics.median(gaps) + own)
    record = {**profile.samples.get("serving_calibration", {}), "first_token_overhead_s": overhead,
              "first_token_requests": len(gaps)}
    return replace(profile, first_token_overhead_s=overhead,
                   samples={**profile.samples, "serving_calibration": record})
