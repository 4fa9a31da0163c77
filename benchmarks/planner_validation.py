"""Does the planner predict what the real system does? One run, on this machine:

1. profile the real SmolLM2 engine pinned to one core (the workers' share) and on both
   cores (a colocated engine);
2. plan 1 prefill + 1 decode worker for the SLOs; find the predicted capacity;
3. replay the online trace at three rates around that capacity through the real service
   (prefill worker pinned to core 0, decode worker to core 1) and compare predicted with
   measured SLO attainment;
4. on the interference workload, predicted and measured goodput of disaggregated (1P+1D)
   vs colocated (one engine on both cores).

Writes benchmarks/results/planner_validation.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = ROOT.parent / "shared" / "workloads"


def run_profile(out: Path, cores: str, threads: int, model: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(["taskset", "-c", cores, sys.executable, "-m", "cluster.cli", "profile", "--model", model,
                    "--out", str(out), "--repeats", "2"], check=True, env=env, cwd=ROOT)


def measured_attainment(results: list[dict], ttft_slo: float, tpot_slo: float) -> float:
    ok = [r for r in results if r["error"] is None and r["ttft_s"] is not None and r["ttft_s"] <= ttft_slo
          and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
    return len(ok) / len(results)


def to_replay(requests) -> list[dict]:
    """SimRequests -> the load generator's request dicts (random prompt ids of the right length)."""
    import random

    rng = random.Random(0)
    return [{"id": f"v{i}", "at": r.arrival_s - requests[0].arrival_s, "max_tokens": r.output_len,
             "prompt_token_ids": [rng.randrange(3, 40000) for _ in range(r.prompt_len)]}
            for i, r in enumerate(requests)]


def serve_and_replay(model: str, overrides: dict, requests: list[dict], port: int) -> tuple[list[dict], float]:
    import ray

    from benchmarks.online_load import replay
    from cluster.config import load_config
    from cluster.controller import create_controller

    config = load_config(None, {"model": model, "router.port": port, **overrides})
    controller = create_controller(config)
    try:
        url = ray.get(controller.start.remote())
        asyncio.run(replay(url, model, [{**r, "id": "warm", "at": 0.0, "max_tokens": 2} for r in requests[:1]]))
        return asyncio.run(replay(url, model, requests))
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--ttft-slo", type=float, default=4.0)
    parser.add_argument("--tpot-slo", type=float, default=0.2)
    parser.add_argument("--requests", type=int, default=50, help="requests of the online trace per rate")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--out", type=Path, default=RESULTS / "planner_validation.json")
    args = parser.parse_args()

    import ray

    from cluster.planner.search import SLO, lengths_of, phase_curve, predict
    from cluster.planner.simulator import simulate
    from cluster.planner.workload import load_trace, rescale
    from cluster.ray_cluster import ray_env
    from engine.model_source import resolve_model
    from engine.profile import Profile

    model = str(resolve_model(args.model))
    RESULTS.mkdir(parents=True, exist_ok=True)
    one_core, two_cores = RESULTS / "profile_1core.json", RESULTS / "profile_2cores.json"
    print("profiling ...", flush=True)
    run_profile(one_core, "0", 1, model)
    run_profile(two_cores, "0,1", 2, model)
    p1, p2 = Profile.load(one_core), Profile.load(two_cores)
    slo = SLO(args.ttft_slo, args.tpot_slo)

    online = load_trace(WORKLOADS / "online-poisson.jsonl")
    lengths = lengths_of(online)
    cap_p = phase_curve(p1, lengths, "prefill").capacity(slo, True, False)
    cap_d = phase_curve(p1, lengths, "decode").capacity(slo, False, True)
    capacity = min(cap_p, cap_d)
    result = {"slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "percentile": slo.percentile},
              "capacity_per_instance": {"prefill": cap_p, "decode": cap_d}, "predicted_capacity_1p1d": capacity,
              "rates": []}
    ray_env()
    ray.init(num_cpus=4, namespace="pdserve", include_dashboard=False, object_store_memory=300_000_000,
             logging_level="WARNING", log_to_driver=False)
    disagg = {"prefill.replicas": 1, "decode.replicas": 1, "prefill.cpu_affinity": [0], "decode.cpu_affinity": [1]}
    for factor in (0.7, 1.0, 1.3):
        rate = capacity * factor
        work = rescale(online, rate)[: args.requests]
        predicted = simulate(p1, work, 1, 1).attainment(slo.ttft_s, slo.tpot_s)
        print(f"rate {rate:.3f} req/s ({factor}x capacity): replaying {len(work)} requests ...", flush=True)
        measured, _ = serve_and_replay(model, disagg, to_replay(work), args.port)
        row = {"factor": factor, "rate": rate, "predicted_attainment": predicted,
               "measured_attainment": measured_attainment(measured, slo.ttft_s, slo.tpot_s)}
        row["difference_pp"] = 100 * (row["measured_attainment"] - row["predicted_attainment"])
        result["rates"].append(row)
        print(json.dumps(row), flush=True)

    interference = load_trace(WORKLOADS / "interference.jsonl")
    span = interference[-1].arrival_s - interference[0].arrival_s
    colocated = {"prefill.replicas": 0, "decode.replicas": 1, "decode.cpu_affinity": [0, 1]}
    result["interference"] = {}
    for layout, overrides, prediction in (
            ("disaggregated", disagg, predict(p1, slo, interference, 1, 1, False)),
            ("colocated", colocated, predict(p2, slo, interference, 0, 1, True))):
        print(f"interference workload, {layout} ...", flush=True)
        measured, _ = serve_and_replay(model, overrides, to_replay(interference), args.port)
        attainment = measured_attainment(measured, slo.ttft_s, slo.tpot_s)
        result["interference"][layout] = {
            "predicted_goodput_per_s": prediction["attainment"] * len(interference) / span,
            "measured_goodput_per_s": attainment * len(interference) / span,
            "predicted_attainment": prediction["attainment"], "measured_attainment": attainment}
        print(json.dumps(result["interference"][layout]), flush=True)
    ray.shutdown()
    write(result, args.out)


if __name__ == "__main__":
    main()
