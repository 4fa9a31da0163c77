"""How steeply does each validation point's attainment move with the machine's speed? Reads
a planner_validation.json and re-simulates every run's offered workload with the pooled
serving-calibrated model made uniformly slower and faster (--step, default 5%), at each SLO
pair the validation judged.

Why: where an SLO cuts through the middle of a point's latency distribution, a few percent
of step speed moves attainment by tens of points, and "within 10 pp" then asks the
prediction to know the speed the machine will run at to within a few percent. The
validation's step logs give how far the speed actually moved between calibration and the
runs (each run's `steps_vs_calibrated`); this gives how much attainment that is worth.
Simulation only: no service is started. Writes benchmarks/results/planner_sensitivity.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.planner_validation import RESULTS, parse_slos, simulated, slo_name  # noqa: E402
from benchmarks.report import write  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "planner_validation.json")
    parser.add_argument("--profiles", type=Path, default=RESULTS,
                        help="directory of the engine-only profiles that validation measured")
    parser.add_argument("--step", type=float, default=0.05, help="speed change either way (0.05: 5%% slower/faster)")
    parser.add_argument("--slos", default="4:0.2,4:0.04,1:0.2",
                        help="TTFT:TPOT pairs (seconds) to judge at (default: the validation's own three)")
    parser.add_argument("--out", type=Path, default=RESULTS / "planner_sensitivity.json")
    args = parser.parse_args()

    from pdserve.cluster.planner.simulator import attainment
    from pdserve.cluster.planner.workload import SimRequest
    from pdserve.engine.profile import Profile

    validation = json.loads(args.results.read_text())
    if not all("work" in run for point in validation["points"].values() for run in point["runs"]):
        raise SystemExit(f"{args.results}: its runs do not record the workload they offered; re-run "
                         f"benchmarks/planner_validation.py (it keeps them since this script exists)")
    engine_only = {"disaggregated": Profile.load(args.profiles / "profile_1core.json"),
                   "colocated": Profile.load(args.profiles / "profile_2cores.json")}
    slos = parse_slos(args.slos, validation["slo"]["percentile"], "--slos")
    speeds = {"slower": 1 + args.step, "as calibrated": 1.0, "faster": 1 - args.step}
    result = {"results": str(args.results), "step": args.step, "points": {}}
    for name, point in validation["points"].items():
        layout = point["layout"]
        factors = validation["calibration"][layout]["pooled"]["factors"]
        mixed = factors.get("mixed")
        latencies = {label: [simulated(engine_only[layout].scaled(
                         prefill=k * factors.get("prefill", 1.0), decode=k * factors.get("decode", 1.0),
                         mixed=None if mixed is None else k * mixed),
                         layout, [SimRequest(*w) for w in run["work"]], validation["local_prefill_max_tokens"])
                         for run in point["runs"]]
                     for label, k in speeds.items()}
        drift = [run["steps_vs_calibrated"].get("decode", {}).get("median_ratio") for run in point["runs"]]
        result["points"][name] = {
            "decode_steps_vs_calibrated": drift,
            "attainment": {slo_name(s): {label: statistics.mean(attainment(lat, s.ttft_s, s.tpot_s) for lat in runs)
                                         for label, runs in latencies.items()} for s in slos}}
    write(result, args.out)
    print(f"attainment at the pooled calibration {1 + args.step:g}x slower / as calibrated / {1 - args.step:g}x:")
    for s in slos:
        print(f"  at {slo_name(s)}:")
        for name, point in result["points"].items():
            a = point["attainment"][slo_name(s)]
            print(f"    {name:28} " + " / ".join(f"{100 * v:5.1f}%" for v in a.values()))


if __name__ == "__main__":
    main()
