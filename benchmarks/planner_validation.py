"""Does the planner predict what the real system does? On this machine:

1. profile the real engine pinned to one core (each worker's share in the 1P+1D layout) and
   to both cores (a colocated engine): prefill, decode and mixed steps (`pdserve profile`);
2. predict SLO attainment with the simulator under the serving configuration's own
   policies (a decode worker prefills a prompt of at most `local_prefill_max_tokens`
   itself): online-poisson at 0.7x, 1.0x and 1.3x the planner's 1P+1D capacity, and the
   interference workload in both layouts (1P+1D on a core each; colocated on both cores);
3. replay every point through the real service `--repeats` times, the repeats interleaved
   so that drift of this shared machine falls on every point alike; report each point's
   mean and spread and pass/fail against the targets: every point within 10 pp, and
   layouts ranked as measured wherever their measured goodputs differ by more than 10%;
4. check the latency model step by step: each worker logs every step's (T, Q, B, C) and
   wall time (engine.step_log), and the measured/predicted step time is summarised per
   role and kind of step;
5. report how far the autoscaler's observed/predicted correction would move on each
   disaggregated point (five decisions on the measured percentiles).

Writes benchmarks/results/planner_validation.json (and .png).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import panels, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ROOT.parent / "shared" / "workloads"
TOLERANCE_PP = 10.0  # a point passes when |mean measured - predicted| <= this
RANKING_MARGIN = 0.10  # layouts whose measured goodputs differ by more must be ranked alike


def run_profile(out: Path, cores: str, threads: int, model: str, repeats: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(["taskset", "-c", cores, sys.executable, "-m", "cluster.cli", "profile", "--model", model,
                    "--out", str(out), "--repeats", str(repeats)], check=True, env=env, cwd=ROOT)


def measured_attainment(results: list[dict], ttft_slo: float, tpot_slo: float) -> float:
    ok = [r for r in results if r["error"] is None and r["ttft_s"] is not None and r["ttft_s"] <= ttft_slo
          and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
    return len(ok) / len(results)


def to_replay(requests) -> list[dict]:
    """SimRequests -> the load generator's request dicts (random prompt ids of the right
    length, no two sharing a prefix block)."""
    rng = random.Random(0)
    return [{"id": f"v{i}", "at": r.arrival_s - requests[0].arrival_s, "max_tokens": r.output_len,
             "prompt_token_ids": [rng.randrange(3, 40000) for _ in range(r.prompt_len)]}
            for i, r in enumerate(requests)]


def serve_and_replay(model: str, overrides: dict, requests: list[dict], port: int) -> tuple[list[dict], float, float]:
    """Start the service with `overrides`, warm it with one request of its own, replay
    `requests`; returns (results, wall start, wall end) of the replay."""
    import ray

    from benchmarks.online_load import replay
    from cluster.config import load_config
    from cluster.controller import create_controller

    config = load_config(None, {"model": model, "router.port": port, **overrides})
    controller = create_controller(config)
    try:
        url = ray.get(controller.start.remote())
        warm = {"id": "warm", "at": 0.0, "max_tokens": 2, "prompt_token_ids": list(range(40000, 40000 - 64, -1))}
        asyncio.run(replay(url, model, [warm]))
        started = time.time()
        results, _ = asyncio.run(replay(url, model, requests))
        return results, started, time.time()
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def step_errors(steps: list[dict], profile) -> dict:
    """Measured / predicted seconds of logged steps, by kind: prefill-only, decode-only and
    mixed (prompt chunks and decodes in one step)."""
    kinds: dict[str, list[float]] = {}
    for s in steps:
        if s["T"] and s["B"]:
            kind, model = "mixed", profile.colocated_step_s(s["T"], s["Q"], s["B"], s["C"])
        elif s["T"]:
            kind, model = "prefill", profile.prefill_step_s(s["T"], s["Q"])
        else:
            kind, model = "decode", profile.decode_step_s(s["B"], s["C"])
        kinds.setdefault(kind, []).append(s["s"] / model)
    return {kind: {"steps": len(r), "median_ratio": statistics.median(r),
                   "p10_ratio": sorted(r)[len(r) // 10], "p90_ratio": sorted(r)[len(r) * 9 // 10]}
            for kind, r in kinds.items()}


def correction_path(profile, slo, work, measured: list[dict], local: int, rounds: int = 5) -> dict:
    """The autoscaler's correction factors after each of `rounds` decisions, observing the
    measured TTFT/TPOT percentiles of this point at 1P+1D."""
    from cluster.autoscaler import Autoscaler
    from engine.stats import percentile

    ok = [r for r in measured if r["error"] is None and r["ttft_s"] is not None]
    span = max(1e-9, work[-1].arrival_s - work[0].arrival_s)
    observed = {"rate": (len(work) - 1) / span, "count": len(work),
                "lengths": [(r.prompt_len, r.output_len, r.cached_len) for r in work],
                "ttft_p": percentile([r["ttft_s"] for r in ok], slo.percentile),
                "tpot_p": percentile([r["tpot_s"] for r in ok if r["tpot_s"] is not None], slo.percentile)}
    scaler = Autoscaler(profile, slo, {"prefill": (1, 8), "decode": (1, 8)}, cooldown_s=0.0,
                        local_prefill_max_tokens=local)
    path = []
    for _ in range(rounds):
        scaler.decide(observed, {"prefill": 1, "decode": 1})
        path.append(dict(scaler.correction))
    return {"observed_ttft_p": observed["ttft_p"], "observed_tpot_p": observed["tpot_p"], "after_each": path}


def summarize(point: dict) -> None:
    runs = point["runs"]
    measured = [r["measured_attainment"] for r in runs]
    point["measured_mean"] = statistics.mean(measured)
    point["measured_min"], point["measured_max"] = min(measured), max(measured)
    point["measured_stdev"] = statistics.stdev(measured) if len(measured) > 1 else 0.0
    point["difference_pp"] = 100 * (point["measured_mean"] - point["predicted_attainment"])
    point["pass"] = abs(point["difference_pp"]) <= TOLERANCE_PP
    point["measured_goodput_per_s"] = point["measured_mean"] * point["requests"] / point["span_s"]
    point["predicted_goodput_per_s"] = point["predicted_attainment"] * point["requests"] / point["span_s"]


def ranking(points: dict) -> dict:
    """Interference: does the planner rank the layouts as the system did?"""
    dis, col = points["interference/disaggregated"], points["interference/colocated"]
    measured = (dis["measured_goodput_per_s"], col["measured_goodput_per_s"])
    predicted = (dis["predicted_goodput_per_s"], col["predicted_goodput_per_s"])
    differ = abs(measured[0] - measured[1]) > RANKING_MARGIN * max(measured)
    same = (measured[0] >= measured[1]) == (predicted[0] >= predicted[1])
    return {"measured_disaggregated_vs_colocated": measured, "predicted_disaggregated_vs_colocated": predicted,
            "measured_differ_by_more_than_10pct": differ, "pass": same or not differ}


def plot(result: dict, path: Path) -> None:
    points = result["points"]
    names = list(points)
    with panels(path, 1, width=8.0) as (ax,):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [100 * points[n]["predicted_attainment"] for n in names], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [100 * points[n]["measured_mean"] for n in names], 0.4, label="measured (mean)",
               yerr=[[100 * (points[n]["measured_mean"] - points[n]["measured_min"]) for n in names],
                     [100 * (points[n]["measured_max"] - points[n]["measured_mean"]) for n in names]])
        ax.set_xticks(list(xs), [n.replace("/", "\n") for n in names], fontsize=7)
        ax.set_ylabel("SLO attainment (%)")
        ax.set_title(f"planner validation ({result['repeats']} repeats; bars: min..max)")
        ax.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--ttft-slo", type=float, default=4.0)
    parser.add_argument("--tpot-slo", type=float, default=0.2)
    parser.add_argument("--requests", type=int, default=60, help="requests of the online trace per rate")
    parser.add_argument("--repeats", type=int, default=3, help="replays of every point")
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--reuse-profiles", action="store_true", help="use the profiles already in the results dir")
    parser.add_argument("--points", default="online,interference", help="which workloads to replay")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--out", type=Path, default=RESULTS / "planner_validation.json")
    args = parser.parse_args()

    import ray

    from cluster.config import ServeConfig
    from cluster.planner.search import SLO, lengths_of, phase_curve, predict
    from cluster.planner.workload import load_trace, rescale
    from cluster.ray_cluster import ray_env
    from engine.model_source import resolve_model
    from engine.profile import Profile
    from engine.step_log import ENV as STEP_LOG_ENV
    from engine.step_log import read_step_logs

    model = str(resolve_model(args.model))
    RESULTS.mkdir(parents=True, exist_ok=True)
    one_core, two_cores = RESULTS / "profile_1core.json", RESULTS / "profile_2cores.json"
    if not args.reuse_profiles:
        print("profiling ...", flush=True)
        run_profile(one_core, "0", 1, model, args.profile_repeats)
        run_profile(two_cores, "0,1", 2, model, args.profile_repeats)
    p1, p2 = Profile.load(one_core), Profile.load(two_cores)
    slo = SLO(args.ttft_slo, args.tpot_slo)
    local = ServeConfig().local_prefill_max_tokens  # what the decode workers will do

    disagg = {"prefill.replicas": 1, "decode.replicas": 1, "prefill.cpu_affinity": [0], "decode.cpu_affinity": [1]}
    colocated = {"prefill.replicas": 0, "decode.replicas": 1, "decode.cpu_affinity": [0, 1]}
    points: dict[str, dict] = {}
    result = {"slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "percentile": slo.percentile},
              "local_prefill_max_tokens": local, "repeats": args.repeats, "points": points}
    if "online" in args.points:
        online = load_trace(WORKLOADS / "online-poisson.jsonl")
        lengths = lengths_of(online)
        cap_p = phase_curve(p1, lengths, "prefill", local_prefill_max_tokens=local).capacity(slo, True, False)
        cap_d = phase_curve(p1, lengths, "decode", local_prefill_max_tokens=local).capacity(slo, False, True)
        capacity = min(cap_p, cap_d)
        result["capacity_per_instance"] = {"prefill": cap_p, "decode": cap_d}
        result["predicted_capacity_1p1d"] = capacity
        for factor in (0.7, 1.0, 1.3):
            work = rescale(online, capacity * factor)[: args.requests]
            points[f"online/{factor}x"] = {"layout": "disaggregated", "overrides": disagg, "work": work,
                                           "profile": p1, "rate": capacity * factor, "factor": factor,
                                           "prediction": predict(p1, slo, work, 1, 1, False, local)}
    if "interference" in args.points:
        work = load_trace(WORKLOADS / "interference.jsonl")
        points["interference/disaggregated"] = {"layout": "disaggregated", "overrides": disagg, "work": work,
                                                "profile": p1, "prediction": predict(p1, slo, work, 1, 1, False, local)}
        points["interference/colocated"] = {"layout": "colocated", "overrides": colocated, "work": work,
                                            "profile": p2, "prediction": predict(p2, slo, work, 0, 1, True)}
    for point in points.values():
        work = point["work"]
        point.update(requests=len(work), span_s=work[-1].arrival_s - work[0].arrival_s,
                     predicted_attainment=point["prediction"]["attainment"], runs=[])

    step_dir = Path(tempfile.mkdtemp(prefix="pdserve-steps-"))
    os.environ[STEP_LOG_ENV] = str(step_dir)  # the workers inherit it from the Ray node
    ray_env()
    ray.init(num_cpus=4, namespace="pdserve", include_dashboard=False, object_store_memory=300_000_000,
             logging_level="WARNING", log_to_driver=False)
    try:
        for repeat in range(args.repeats):
            for name, point in points.items():
                print(f"[{repeat + 1}/{args.repeats}] {name}: replaying {point['requests']} requests ...", flush=True)
                measured, start, end = serve_and_replay(model, point["overrides"], to_replay(point["work"]), args.port)
                steps = [s for s in read_step_logs(step_dir) if start <= s["t"] <= end]
                run = {"measured_attainment": measured_attainment(measured, slo.ttft_s, slo.tpot_s),
                       "errors": sum(r["error"] is not None for r in measured), "results": measured,
                       "steps": {role: step_errors([s for s in steps if s["name"] == role], point["profile"])
                                 for role in sorted({s["name"] for s in steps})}}
                point["runs"].append(run)
                print(f"  predicted {point['predicted_attainment']:.0%}, measured {run['measured_attainment']:.0%}; "
                      f"steps measured/predicted {run['steps']}", flush=True)
    finally:
        ray.shutdown()
    for point in points.values():
        summarize(point)
        if point["layout"] == "disaggregated":
            point["autoscaler_correction"] = [correction_path(p1, slo, point["work"], run["results"], local)
                                              for run in point["runs"]]
        for run in point["runs"]:
            del run["results"]
        for key in ("overrides", "work", "profile"):
            del point[key]
    if {"interference/disaggregated", "interference/colocated"} <= set(points):
        result["ranking"] = ranking(points)
    result["pass"] = all(p["pass"] for p in points.values()) and result.get("ranking", {}).get("pass", True)
    write(result, args.out, plot)
    print(f"{'point':28} {'predicted':>9} {'measured mean':>13} {'min..max':>11} {'diff':>8}  pass")
    for name, p in points.items():
        print(f"{name:28} {p['predicted_attainment']:>9.0%} {p['measured_mean']:>13.0%} "
              f"{p['measured_min']:>5.0%}..{p['measured_max']:<4.0%} {p['difference_pp']:>+7.1f}pp  {p['pass']}")
    if "ranking" in result:
        print(f"layout ranking: {result['ranking']}")
    print("PASS" if result["pass"] else "FAIL")


if __name__ == "__main__":
    main()
