"""Does Ray's worker niceness slow pdserve's engines? An A/B on this machine.

Ray starts its workers -- pdserve's engines and router among them -- at nice 15 (its
`worker_niceness` default), while the load generator and Ray's own daemons run at nice 0.
The hypothesis (planner_validation, stop 33): whatever those nice-0 processes do preempts
an engine step at once, which would be part of why serving steps run slower than the
engine-alone profile. This starts a local Ray with RAY_worker_niceness set to each value
given, alternating, serves the planner validation's calibration work (online-poisson
requests 100-159 at the engine-only 1P+1D capacity) in the given layouts, and records each
kind of step's serving time over the engine-only profile's (benchmarks/results/profile_*),
median TTFT/TPOT, and the niceness the Ray processes actually ran at.

    python benchmarks/worker_niceness.py --niceness 15,0,15,0 --layouts colocated

Measured on 2026-12-03 (2-core AMD EPYC without AVX-512, fp32; results/worker_niceness.json):
colocated decode steps took 1.48x and 1.39x the model at nice 15, 1.74x and 1.69x at nice 0
-- nice 0 was slower, not faster; pdserve keeps Ray's default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.planner_validation import (  # noqa: E402
    LAYOUTS,
    RESULTS,
    WORKLOADS,
    measured_latencies,
    serve_and_drive,
    simulated,
    to_replay,
    trace_driver,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--niceness", default="15,0,15,0", help="RAY_worker_niceness values, one Ray each, in order")
    parser.add_argument("--layouts", default="colocated", help="comma-separated: colocated, disaggregated")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--out", type=Path, default=RESULTS / "worker_niceness.json")
    args = parser.parse_args()

    import ray

    from pdserve.cluster.config import ServeConfig
    from pdserve.cluster.planner.calibrate import calibrate, total_ratios
    from pdserve.cluster.planner.search import SLO, lengths_of, phase_curve
    from pdserve.cluster.planner.workload import load_trace, rescale
    from pdserve.cluster.ray_cluster import init_private_cluster
    from pdserve.engine.profile import Profile
    from pdserve.engine.step_log import ENV, read_step_logs

    engine_only = {"disaggregated": Profile.load(RESULTS / "profile_1core.json"),
                   "colocated": Profile.load(RESULTS / "profile_2cores.json")}
    local = ServeConfig().local_prefill_max_tokens
    online = load_trace(WORKLOADS / "online-poisson.jsonl")
    lengths, slo = lengths_of(online), SLO(4.0 * 3.49, 0.2 * 3.49)  # planner_validation's default pair here
    capacity = min(phase_curve(engine_only["disaggregated"], lengths, phase, local_prefill_max_tokens=local)
                   .capacity(slo, phase == "prefill", phase == "decode") for phase in ("prefill", "decode"))
    trace = rescale(online, capacity)
    work = trace[100:160]
    warmup = to_replay([replace(r, output_len=min(r.output_len, 32)) for r in trace[160:172]], seed=1)
    step_dir = Path(tempfile.mkdtemp(prefix="pdserve-niceness-"))
    os.environ[ENV] = str(step_dir)
    runs = []
    for nice in args.niceness.split(","):
        os.environ["RAY_worker_niceness"] = nice  # read by the raylet this ray.init starts
        init_private_cluster(4)
        try:
            for layout in args.layouts.split(","):
                measured, _, start, end = serve_and_drive(args.model, LAYOUTS[layout],
                                                       trace_driver(args.model, to_replay(work)), args.port, warmup)
                ps = subprocess.run(["ps", "-eo", "ni,comm"], capture_output=True, text=True).stdout
                steps = [s for s in read_step_logs(step_dir) if start <= s["t"] <= end]
                latencies = measured_latencies(measured)
                own = simulated(calibrate(engine_only[layout], steps), layout, work, local)
                run = {"nice": nice, "layout": layout,
                       "ratios": {k: round(r, 3) for k, (_, r) in total_ratios(engine_only[layout], steps).items()},
                       "ttft_med": statistics.median(t for t, _ in latencies if t is not None),
                       "tpot_med": statistics.median(p for _, p in latencies if p is not None),
                       "ttft_gap_own": statistics.median(m[0] - s[0] for m, s in zip(latencies, own, strict=True)
                                                         if m[0] is not None),
                       "tpot_gap_own": statistics.median(m[1] - s[1] for m, s in zip(latencies, own, strict=True)
                                                         if m[1] is not None and s[1] is not None),
                       "worker_nice": sorted({line.split()[0] for line in ps.splitlines() if "ray::" in line})}
                print(json.dumps(run), flush=True)
                runs.append(run)
        finally:
            ray.shutdown()
            time.sleep(3)
    args.out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
