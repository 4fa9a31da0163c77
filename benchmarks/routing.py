"""Cache-aware routing against both pure strategies, side by side in one run, on the same
two cores (every worker runs one thread; OMP_NUM_THREADS=1):

- `colocated`: 2 decode workers prefilling everything themselves, least-loaded routing;
- `disaggregated`: 2 prefill + 2 decode workers, every prompt prefilled remotely,
  least-loaded routing (DistServe-style, always disaggregated);
- `pdserve`: 2 prefill + 2 decode workers, cache-aware routing, the decode worker prefilling
  short uncached tails itself (the per-request decision);
- (`pdserve-least-loaded`, on request: the same with least-loaded routing, to split the
  gain between the routing and the decision).

All three have prefix caching on. Workloads, replayed through the real service (Ray,
router, HTTP) with the clients of benchmarks/prefix_reuse.py: `multi-turn-chat` (each turn
resends the history with the real replies), `shared-prefix`, and `interference`. Per
configuration and workload: goodput (requests meeting both SLOs per second of the replay),
attainment, TTFT/TPOT p50/p90, cache hit rate, KV bytes shipped; and the planner's
prediction for the same request stream (arrivals, lengths and cached tokens as measured,
the profile `--profile`, halved per worker where four workers share two cores).

    .venv/bin/python benchmarks/routing.py [--sessions 16] [--questions 48] [--ttft-slo 2] [--tpot-slo 0.35]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.prefix_reuse import WORKLOADS, local_ray, replay, scrape, service, summarize, workload_rows  # noqa: E402
from benchmarks.report import panels, repo_relative, write  # noqa: E402

COMMON = {"env": {"OMP_NUM_THREADS": "1"}}
SPLIT = {"prefill.replicas": 2, "decode.replicas": 2, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5}
CONFIGS = {
    "colocated": {"prefill.replicas": 0, "decode.replicas": 2, "decode.num_cpus": 1.0,
                  "router.routing": "least-loaded"},
    "disaggregated": {**SPLIT, "local_prefill_max_tokens": 0, "router.routing": "least-loaded"},
    "pdserve": {**SPLIT, "local_prefill_max_tokens": 256, "router.routing": "cache-aware"},
    # pdserve without cache-aware routing: what the routing alone adds (not run by default)
    "pdserve-least-loaded": {**SPLIT, "local_prefill_max_tokens": 256, "router.routing": "least-loaded"},
}
DEFAULT_CONFIGS = "colocated,disaggregated,pdserve"
LOCAL_PREFILL = {"colocated": None, "disaggregated": 0, "pdserve": 256, "pdserve-least-loaded": 256}


def attainment(results: list[dict], ttft_slo: float, tpot_slo: float) -> tuple[int, int]:
    """(requests meeting both SLOs, requests); a failed request meets neither."""
    ok = sum(1 for r in results if "error" not in r and r["ttft_s"] <= ttft_slo
             and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo))
    return ok, len(results)


def predict(name: str, results: list[dict], profile_path: Path, ttft_slo: float, tpot_slo: float) -> dict:
    """The planner's simulator on the request stream this configuration actually saw."""
    from pdserve.cluster.planner.simulator import simulate
    from pdserve.cluster.planner.workload import SimRequest
    from pdserve.engine.profile import Profile

    done = sorted((r for r in results if "error" not in r), key=lambda r: r["sent_s"])
    work = [SimRequest(r["sent_s"], r["prompt_tokens"], max(1, r["output_tokens"]), r["cached_tokens"])
            for r in done]
    profile = Profile.load(profile_path)
    if name == "colocated":
        result = simulate(profile, work, 0, 2, colocated=True)
    else:  # four one-thread workers on two cores: each runs at about half a core's speed
        result = simulate(profile.scaled(prefill=2.0, decode=2.0), work, 2, 2,
                          local_prefill_max_tokens=LOCAL_PREFILL[name])
    return {"attainment": result.attainment(ttft_slo, tpot_slo), "ttft_p50": result.percentile("ttft_s", 50),
            "tpot_p50": result.percentile("tpot_s", 50)}


def run_config(name: str, workloads: dict, scales: dict, args) -> dict:
    with service({"router.port": args.port, **COMMON, **CONFIGS[name]}) as url:
        out = {}
        for workload, rows in workloads.items():
            time.sleep(1.0)  # let the router's view of worker stats settle
            before = scrape(url)
            results, wall = asyncio.run(replay(url, workload, rows, scales[workload]))
            time.sleep(1.0)
            summary = summarize(results, wall, before, scrape(url))
            ok, total = attainment(results, args.ttft_slo, args.tpot_slo)
            summary.update(attainment=ok / total, goodput=ok / wall, offered_rate=total / wall)
            summary["planner"] = predict(name, results, args.profile, args.ttft_slo, args.tpot_slo)
            summary["planner"]["goodput"] = summary["planner"]["attainment"] * summary["requests"] / wall
            out[workload] = summary
            print(f"{name} {workload}: goodput {summary['goodput']:.3f}/s attainment {summary['attainment']:.0%} "
                  f"TTFT p50 {summary['ttft_s']['p50']:.2f}s TPOT p50 {summary['tpot_s']['p50']:.3f}s "
                  f"hit rate {summary['cache_hit_rate']:.0%} (planner: {summary['planner']['attainment']:.0%})",
                  flush=True)
        return out


def plot(result: dict, path: Path) -> None:
    configs, workloads = list(result["configs"]), list(result["workloads"])
    metrics = [("goodput", "goodput (req/s meeting SLOs)"), ("ttft_p50", "TTFT p50 (s)"),
               ("cache_hit_rate", "prefix cache hit rate")]
    with panels(path, len(metrics), width=4.5) as axes:
        width = 0.8 / len(configs)
        for ax, (key, label) in zip(axes, metrics, strict=True):
            for i, name in enumerate(configs):
                values = [result["configs"][name][w]["ttft_s"]["p50"] if key == "ttft_p50"
                          else result["configs"][name][w][key] for w in workloads]
                ax.bar([x + i * width for x in range(len(workloads))], values, width, label=name)
            ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(workloads))], workloads,
                          fontsize=8)
            ax.set_title(label)
        axes[0].legend()


def verdict(configs: dict) -> dict:
    """The issue's targets: pdserve's goodput >= 1.3x the better pure strategy on
    multi-turn-chat, and not below either on interference."""
    out = {}
    for workload, factor in (("multi-turn-chat", 1.3), ("interference", 1.0)):
        if all(workload in c for c in configs.values()) and {"colocated", "disaggregated", "pdserve"} <= set(configs):
            best = max(configs["colocated"][workload]["goodput"], configs["disaggregated"][workload]["goodput"])
            ours = configs["pdserve"][workload]["goodput"]
            out[workload] = {"pdserve_goodput": ours, "best_pure_goodput": best,
                             "ratio": ours / best if best else float("inf"), "target_ratio": factor,
                             "met": ours >= factor * best}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=16, help="multi-turn-chat sessions to replay")
    parser.add_argument("--questions", type=int, default=48, help="shared-prefix requests to replay")
    parser.add_argument("--interference", type=int, default=56, help="interference requests to replay")
    parser.add_argument("--shared-prefix-time-scale", type=float, default=2.0,
                        help="shared-prefix arrival times x this (its 1600-token prompts overload two cores "
                             "at the trace's own rate)")
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="seconds (default: 2)")
    parser.add_argument("--tpot-slo", type=float, default=0.35, help="seconds (default: 0.35)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"which of {', '.join(CONFIGS)} (default: {DEFAULT_CONFIGS})")
    parser.add_argument("--workloads", default="multi-turn-chat,shared-prefix,interference",
                        help="which workloads (default: all three)")
    parser.add_argument("--profile", type=Path, default=ROOT / "benchmarks" / "results" / "profile_1core.json",
                        help="`pdserve profile` of one worker on one core, for the planner's predictions")
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "routing.json")
    args = parser.parse_args()
    limits = {"multi-turn-chat": args.sessions, "shared-prefix": args.questions, "interference": args.interference}
    workloads = {w: workload_rows(w, limits[w]) for w in args.workloads.split(",")}
    scales = {"multi-turn-chat": 1.0, "shared-prefix": args.shared_prefix_time_scale, "interference": 1.0}
    with local_ray(num_cpus=2):
        configs = {name: run_config(name, workloads, scales, args) for name in args.configs.split(",")}
    result = {"workloads": {w: repo_relative(WORKLOADS / f"{w}.jsonl") for w in workloads},
              "sessions": args.sessions, "questions": args.questions, "interference": args.interference,
              "time_scales": scales, "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo},
              "profile": repo_relative(args.profile), "configs": configs, "targets": verdict(configs)}
    for workload, v in result["targets"].items():
        print(f"target {workload}: pdserve {v['pdserve_goodput']:.3f}/s vs best pure {v['best_pure_goodput']:.3f}/s "
              f"= {v['ratio']:.2f}x (target {v['target_ratio']}x): {'MET' if v['met'] else 'NOT MET'}")
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
