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
same run's own steps. The median stays in the record, beside the factor.

Decode steps take one factor and a co-tenancy term: measured = f * the profile's decode
model + k * rate * the same model, rate being the prompt tokens a second the prefill engines
in the same log computed during the step (prefill_rate); k by least squares, f then set so
that the steps' total is kept. Decode steps ran 10-25% slower while the prefill worker on
the other core computed (45% of a calibration's steps, 20-30% of some runs'); by the share
of the step the prefill engines computed, the interference run's decode time was
over-predicted by 5.5-8%, by their token rate by 2.6-4% (decode steps ran 18-20% longer
beside short prompts' prefill, 8-10% beside 2,000-token prompts').

Why one factor and not one each for the profile's fixed part (d0) and its per-request part
(d1 B + d2 C), as an earlier version fitted: a calibration replay's batches span a narrow
range (8-16 requests), so the split absorbs the profile's own shape error there and carries
it to the batches other workloads run. Replayed on two validations' step logs, the split
fitted the fixed part 1.19-1.24x and the per-request part 0.97-0.99x, and a workload of
7-request batches ran 0.94-0.98x that model (its tight-TPOT attainment predicted over 20 pp
below measured); one factor put those steps at 1.00x. The measurements, run by run:
benchmarks/README.md, "How the planner's model got where it is".
Pure: no I/O here.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import replace

import numpy as np

from pdserve.engine.profile import Profile, fit_nonnegative
from pdserve.engine.profile import step_kind as kind_of

MIN_STEPS = 5  # fewer logged steps of a kind: not calibrated by its own steps (see calibrate)
# the mixed steps' predicted sizes must span this factor (largest over smallest) for a size
# exponent to be fitted on them (fit_mixed_size)
MIN_SIZE_SPREAD = 4.0
PREFILL_ENGINE = "prefill"  # the step log name of prefill workers' engines (engine.step_log)


def step_kind(step: dict) -> str:
    """"prefill", "decode" or "mixed", from a step record's T (prompt tokens) and B (decodes)."""
    return kind_of(step["T"], step["B"])


def predicted_s(profile: Profile, step: dict) -> float:
    """The model's seconds for a step record (one without "K", logged before K was, has 0)."""
    return profile.step_s(step["T"], step["Q"], step["B"], step["C"], step.get("K", 0))


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


def prefill_rate(steps: list[dict]) -> list[float]:
    """For each step record, the prompt tokens a second that the prefill engines (records
    named PREFILL_ENGINE, one engine per pid) computed during its span, averaged over the
    engines alive then (from an engine's first logged step to the end of its last): each
    prefill step overlapping it counts its own rate (T / s) for the share of the span it
    overlaps; 0 where no prefill engine was alive.

    Alive, not all logged: a log pooled from several services (a validation's calibration
    replays, one service after another, or `pdserve calibrate` over a directory of earlier
    runs) holds engines that never ran beside each other. Averaged over all of them, three
    replays' pooled rates came out a third of each replay's own and the co-tenancy term
    fitted on them 3x (6.5e-4 against 2.1-2.3e-4 per token a second)."""
    engines: dict[int, list[tuple[float, float, float]]] = {}
    for step in sorted((s for s in steps if s.get("name") == PREFILL_ENGINE), key=lambda s: s["t"]):
        engines.setdefault(step["pid"], []).append((step["t"], step["t"] + step["s"], step["T"] / max(step["s"], 1e-6)))
    if not engines:
        return [0.0] * len(steps)
    starts = {pid: [start for start, _, _ in spans] for pid, spans in engines.items()}
    lives = {pid: (spans[0][0], max(end for _, end, _ in spans)) for pid, spans in engines.items()}
    rates = []
    for step in steps:
        begin, end = step["t"], step["t"] + step["s"]
        alive = [pid for pid, (born, gone) in lives.items() if born < end and gone > begin]
        tokens = 0.0
        for pid in alive:
            spans = engines[pid]
            i = bisect.bisect_left(starts[pid], end) - 1  # an engine's steps do not overlap:
            while i >= 0 and spans[i][1] > begin:  # walk back over those ending inside the step
                tokens += (min(spans[i][1], end) - max(spans[i][0], begin)) * spans[i][2]
                i -= 1
        rates.append(tokens / (end - begin) / len(alive) if alive and end > begin else 0.0)
    return rates


def cpu_split(steps: list[dict]) -> dict[str, dict[str, float]]:
    """For each engine name among `steps` whose records carry the CPU split (engine.step_log's
    "u" and "p"), the share of its steps' wall time in all that went to the step's own thread
    ("own"), to the rest of its process ("threads": RPCs, token streaming, KV receives) and
    elsewhere ("other": other processes on its cores, or waiting for a core). Exact for an
    engine of one torch thread; with more, torch's worker threads count under "threads".
    Logs from before the split was recorded give {}.

    Why: it tells what a calibration's factors are made of. In one validation a 1-core
    decode worker's steps spent 4% of the model's time in its other threads
    and none elsewhere while the prefill worker on the other core was idle, and 8% and 6-8%
    while it computed (the router and the clients moved onto the decode worker's core); in
    a calibration replay that overloaded the prefill worker, 9% and 11%."""
    sums: dict[str, list[float]] = {}
    for step in steps:
        if "u" in step and "p" in step:
            total = sums.setdefault(step.get("name", "engine"), [0.0, 0.0, 0.0])
            total[0] += step["s"]
            total[1] += step["u"]
            total[2] += step["p"]
    return {name: {"own": u / s, "threads": (p - u) / s, "other": (s - p) / s}
            for name, (s, u, p) in sums.items() if s > 0}


def speed_change(profile: Profile, then: list[dict], now: list[dict]) -> dict[str, float]:
    """How many times as long each kind of step took in the step log `now` as in `then`, both
    measured against `profile` (measured over predicted seconds in all, total_ratios), for
    the kinds with at least MIN_STEPS steps in each. Two short logs of the same work -- the
    warm-up burst a service serves before each load, once before a calibration replay and
    once before a later run -- say how far the host's speed moved between them, which
    `profile.scaled(**factors)` then carries (planner_validation: runs' steps ran 0.37-1.62x
    what their calibration, minutes before, said)."""
    before, after = total_ratios(profile, then), total_ratios(profile, now)
    return {kind: after[kind][1] / before[kind][1] for kind in before.keys() & after.keys()
            if min(before[kind][0], after[kind][0]) >= MIN_STEPS}


def fit_decode_terms(profile: Profile, steps: list[dict]) -> tuple[float, float] | None:
    """(f, k): the decode steps among `steps` fitted as f * M + k * rate * M, M being
    `profile`'s decode model of the step and rate the prefill engines' (prefill_rate): k by
    least squares with non-negative terms, then f so that the steps' measured total is kept.
    None where co-tenancy cannot be told from the step's own speed: fewer than MIN_STEPS
    decode steps beside a computing prefill engine or fewer than MIN_STEPS beside none, or k
    or f fitted to zero."""
    rows = [(step, rate, profile.decode_step_s(step["B"], step["C"]))
            for step, rate in zip(steps, prefill_rate(steps), strict=True) if step_kind(step) == "decode"]
    busy = sum(1 for _, rate, _ in rows if rate > 0)
    if min(busy, len(rows) - busy) < MIN_STEPS:
        return None
    features = np.array([(model, rate * model) for _, rate, model in rows])
    measured = np.array([step["s"] for step, _, _ in rows])
    k = fit_nonnegative(features, measured)[1]
    f = (measured.sum() - k * features[:, 1].sum()) / features[:, 0].sum()
    return (float(f), k) if k > 0 and f > 0 else None


def fit_mixed_size(profile: Profile, steps: list[dict]) -> tuple[float, float] | None:
    """(a, reference seconds): serving's slowdown of the mixed steps among `steps` as a power
    of their size, s / M = c * M ** -a with M `profile`'s mixed model of the step, by least
    squares on the logarithms, each step weighted by M (the long steps are most of the time);
    the reference is the steps' M-weighted geometric mean. None where it cannot be told or
    comes out below 0.01 (under 1% a doubling): fewer than MIN_STEPS mixed steps, or sizes
    spanning less than MIN_SIZE_SPREAD. Capped at 0.5: steeper would have a longer step take less time.

    Why: a colocated engine (two torch threads on 2 cores) took 1.8-1.9x the model at
    0.3-0.6 s steps and 1.3-1.4x at 2.2-3.5 s (benchmarks/README.md). One factor
    fitted on a calibration replay's 0.2-1.9 s steps over-predicted the interference runs'
    2.9 s prompts by 15-25% and under-predicted their small steps; with a = 0.12-0.14 from
    the same replays, both came within 10%. Profile.colocated_step_s applies it."""
    rows = [(predicted_s(profile, step), step["s"]) for step in steps if step_kind(step) == "mixed"]
    rows = [(model, seconds) for model, seconds in rows if model > 0 and seconds > 0]
    if len(rows) < MIN_STEPS or max(m for m, _ in rows) < MIN_SIZE_SPREAD * min(m for m, _ in rows):
        return None
    model, seconds = np.array(rows).T
    x, y, root = np.log(model), np.log(seconds / model), np.sqrt(model)
    slope = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]) * root[:, None], y * root, rcond=None)[0][1]
    if -slope < 0.01:
        return None
    return min(0.5, float(-slope)), float(np.exp(np.average(x, weights=model)))


def calibrate(profile: Profile, steps: list[dict]) -> Profile:
    """`profile` calibrated to `steps` (a serving step log of engines this profile models,
    engine.step_log.read_step_logs): prefill and mixed steps' coefficients scaled by the
    kind's measured seconds in all over its predicted seconds in all; decode steps fitted
    with a co-tenancy term (fit_decode_terms: d0..d2 by f, decode_cotenancy_coeffs set to k
    times d0..d2), or scaled like the others where co-tenancy cannot be told apart. The
    factors, step counts, median per-step ratios, decode terms and, where the log has it, the
    steps' CPU split (cpu_split) are recorded in the result's samples["serving_calibration"].
    A kind with fewer than MIN_STEPS steps: prefill
    or decode keeps its profiled coefficients; mixed steps take the prefill factor on their
    prefill terms and the decode factor on the rest. Where the decode terms carry a
    co-tenancy term k, mixed steps take it too (fit_mixed_terms)."""
    if sized := fit_mixed_size(replace(profile, mixed_size_exponent=0.0), steps):  # mixed steps' size exponent
        profile = replace(profile, mixed_size_exponent=sized[0], mixed_reference_s=sized[1])
    totals = total_ratios(profile, steps)
    factors = {kind: ratio for kind, (count, ratio) in totals.items() if count >= MIN_STEPS}
    record = {"factors": factors, "steps": {kind: count for kind, (count, _) in totals.items()},
              "median_ratios": {kind: statistics.median(r) for kind, r in step_ratios(profile, steps).items()}}
    if split := cpu_split(steps):
        record["cpu_split"] = split
    if sized:
        record["mixed_size"] = {"exponent": sized[0], "reference_s": sized[1]}
    terms = fit_decode_terms(profile, steps)
    mixed, mixed_cotenancy = factors.get("mixed"), 0.0
    if terms is not None and mixed is not None:  # mixed steps take the decode's co-tenancy
        fitted = fit_mixed_terms(profile, steps, terms[1])
        if fitted is not None:
            mixed, mixed_cotenancy = fitted, terms[1] / fitted
            record["mixed_terms"] = {"step": fitted, "prefill_rate": terms[1]}
    calibrated = replace(profile.scaled(prefill=factors.get("prefill", 1.0), decode=factors.get("decode", 1.0),
                                        mixed=mixed), mixed_cotenancy=mixed_cotenancy)
    if terms is not None:
        f, k = terms
        calibrated = replace(calibrated, decode_coeffs=tuple(f * c for c in profile.decode_coeffs),
                             decode_cotenancy_coeffs=tuple(k * c for c in profile.decode_coeffs))
        record["decode_terms"] = {"factor": f, "prefill_rate": k}
    return replace(calibrated, samples={**profile.samples, "serving_calibration": record})


def fit_mixed_terms(profile: Profile, steps: list[dict], k: float) -> float | None:
    """m: the mixed steps among `steps` fitted as m * M + k * rate * M, M being `profile`'s
    mixed model of the step and rate the prefill engines' (prefill_rate), with `k` the decode
    steps' co-tenancy term (fit_decode_terms): m keeps the mixed steps' measured total. None
    where it comes out at 0 or below.

    Why co-tenancy from the decode steps and not a factor of the mixed steps' own: a decode
    worker's mixed steps slow beside a computing prefill worker as its decode steps do, and
    a calibration replay's mixed steps all ran beside one (short prompts, 1,000-1,100 prompt
    tokens a second), which one factor carried to every run. Replayed on one validation's
    step logs (with the K term): one factor of 1.38-1.44 put the interference run's mixed steps, which
    ran beside 150-160 prompt tokens a second, at 1.20-1.27x their measured time and chat's
    (30 tokens a second) at 1.27-1.33x; m = 1.17-1.22 with the decode's k put them at
    1.04-1.07x and 1.08-1.11x, online's at 0.89-0.98x (1.0-1.1x before). The calibration's
    rates are too alike to fit k from the mixed steps alone."""
    rows = [(step, rate) for step, rate in zip(steps, prefill_rate(steps), strict=True) if step_kind(step) == "mixed"]
    model = [predicted_s(profile, step) for step, _ in rows]
    total = sum(model)
    if total <= 0:
        return None
    beside = sum(rate * x for (_, rate), x in zip(rows, model, strict=True))
    m = (sum(step["s"] for step, _ in rows) - k * beside) / total
    return m if m > 0 else None



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
