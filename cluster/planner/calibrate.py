"""Serving-calibrated latency models: a profile plus the time its engine's steps took on
top of it while serving.

`pdserve profile` times the engine alone. Serving adds what that cannot see: the router,
the clients and Ray on the same cores, and the worker's own gRPC, token-streaming and
KV-transfer threads beside its engine. That work comes per step and per sequence a step
streams a token of, not in proportion to the step's length: measured on this 2-core
machine (benchmarks/planner_validation.py), decode steps took 1.1-1.7x the engine-alone
model while a 2048-token prefill step took about what it was profiled at, and scaling
every step by one factor put the colocated prediction 11 pp too low. So calibration is
additive: a step log recorded while serving (PDSERVE_STEP_LOG, engine.step_log) gives,
for each kind of step -- prefill only, decode only, mixed (prompt chunks beside running
decodes) -- the extra seconds e0 + e1 * B (B: the step's decode rows) fitted to the
median excess of the logged steps at each B; they are added to that kind's constant and
per-row coefficients. Pure: no I/O here.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np

from engine.profile import Profile, fit_nonnegative

KINDS = ("prefill", "decode", "mixed")
MIN_STEPS = 5  # fewer logged steps of a kind: not calibrated by its own steps (see calibrate)


def step_kind(step: dict) -> str:
    """"prefill", "decode" or "mixed", from a step record's T (prompt tokens) and B (decodes)."""
    if step["T"] and step["B"]:
        return "mixed"
    return "prefill" if step["T"] else "decode"


def predicted_s(profile: Profile, step: dict) -> float:
    kind = step_kind(step)
    if kind == "mixed":
        return profile.colocated_step_s(step["T"], step["Q"], step["B"], step["C"])
    if kind == "prefill":
        return profile.prefill_step_s(step["T"], step["Q"])
    return profile.decode_step_s(step["B"], step["C"])


def step_ratios(profile: Profile, steps: list[dict]) -> dict[str, list[float]]:
    """Measured / predicted seconds of each logged step (records with s, T, Q, B, C), by kind."""
    ratios: dict[str, list[float]] = {}
    for step in steps:
        model = predicted_s(profile, step)
        if model > 0:
            ratios.setdefault(step_kind(step), []).append(step["s"] / model)
    return ratios


def serving_overhead(profile: Profile, steps: list[dict]) -> tuple[float, float]:
    """(e0 [s], e1 [s/decode row]) >= 0: the extra seconds of `steps` (one kind) over the
    profile's prediction, fitted to the median excess at each decode batch size B (each
    weighted by its count: robust to the odd step a busy machine stretches)."""
    by_batch: dict[int, list[float]] = {}
    for step in steps:
        by_batch.setdefault(step["B"], []).append(step["s"] - predicted_s(profile, step))
    batches = sorted(by_batch)
    medians = np.array([statistics.median(by_batch[b]) for b in batches])
    weights = np.sqrt([len(by_batch[b]) for b in batches])
    if len(batches) == 1:
        return max(0.0, float(medians[0])), 0.0
    features = np.column_stack([np.ones(len(batches)), batches]) * weights[:, None]
    e0, e1 = fit_nonnegative(features, medians * weights)
    return e0, e1


def calibrate(profile: Profile, steps: list[dict]) -> Profile:
    """`profile` plus each kind's serving overhead fitted on `steps` (a serving step log of
    engines this profile models): prefill p0 += e0; decode d0 += e0, d1 += e1; mixed c0 +=
    e0, c3 += e1. A kind with fewer than MIN_STEPS logged steps is left as profiled (mixed
    steps then take the decode overhead: what their decode rows stream). The overheads and
    step counts are recorded in the result's samples["serving_calibration"]."""
    by_kind: dict[str, list[dict]] = {}
    for step in steps:
        by_kind.setdefault(step_kind(step), []).append(step)
    overhead = {kind: serving_overhead(profile, s) for kind, s in by_kind.items() if len(s) >= MIN_STEPS}
    p0, p1, p2 = profile.prefill_coeffs
    d0, d1, d2 = profile.decode_coeffs
    c0, c1, c2, c3, c4 = profile.colocated_coeffs or (max(p0, d0), p1, p2, d1, d2)
    pe, _ = overhead.get("prefill", (0.0, 0.0))
    de0, de1 = overhead.get("decode", (0.0, 0.0))
    me0, me1 = overhead.get("mixed", (de0, de1))
    record = {"overhead_s": {kind: {"e0": e0, "e1": e1} for kind, (e0, e1) in overhead.items()},
              "steps": {kind: len(s) for kind, s in by_kind.items()},
              "median_ratio_before": {kind: statistics.median(r) for kind, r in step_ratios(profile, steps).items()}}
    return replace(profile, prefill_coeffs=(p0 + pe, p1, p2), decode_coeffs=(d0 + de0, d1 + de1, d2),
                   colocated_coeffs=(c0 + me0, c1, c2, c3 + me1, c4),
                   samples={**profile.samples, "serving_calibration": record})
