"""The control plane against the number of workers: how each cost of the router, its worker
registry and cache index, the controller, the autoscaler and the planner's simulator grows,
each fitted as cost ~ a * N^k (least squares on log-log) and classed by k: constant (k <
0.2), sublinear (< 0.8), linear (<= 1.2) or worse than linear.

Three kinds of measurement, each marked in the JSON:

- **in-process** (8, 32, 128, 512 workers; benchmarks/control_plane_inproc.py): the router's
  own components over N synthetic workers whose updates (load, cache deltas) go through the
  registry's own `apply`: the cache-aware routing decision (prompt hashing, the cache-index lookup
  of every routable worker, the pick and the prefill order) against N and the prompt's
  length; cache events absorbed per second and bytes per indexed block; the autoscaler's
  decision and the planner's simulator (simulated requests/s) for an N-worker plan;
- **registry over gRPC** (the same sizes; benchmarks/control_plane_registry.py): the real
  registry following the update streams of N synthetic workers served over loopback gRPC by
  one process (one channel per worker), and one more worker in a process of its own that is
  hung then killed: the registry's CPU per worker, the messages each worker sends, how long
  the hung and the killed worker stay routable;
- **real processes** (benchmarks/control_plane_cluster.py): simulated workers (`model: sim`)
  under the real controller and router on a Ray of this process's own, as many as this
  machine holds (~310 MiB each): scale decode 1 -> 4, 8, 16, 32 (128 extrapolated by the
  fit, marked so), replace a killed worker, a killed and a hung worker's time in routing,
  idle CPU of the router and controller, and one router process's relay rate (streamed
  tokens/s, requests/s, its CPU, the TTFT it adds);
- **router alone, synthetic token source** (benchmarks/control_plane_relay.py): the real
  router process between a gRPC token source process and an HTTP load generator process,
  each measured on its own: the router's relay capacity (tokens/s, tokens per router
  CPU-second, SSE events per token) at 64, 256 and 512 concurrent streams, which the
  real-process relay cannot show on a machine whose cores the sim workers take.

Targets (from the issue): routing decision p99 <= 1 ms at 128 workers; one router process
relays >= 20k streamed tokens/s; a dead worker leaves routing within 2 s at every size;
scaling to 32 workers in under a minute here. Writes benchmarks/results/control_plane.json
and .png.

    .venv/bin/python benchmarks/control_plane.py            # about 7 minutes on 2 cores
    .venv/bin/python benchmarks/control_plane.py --quick    # about 2 minutes
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import control_plane_inproc as inproc  # noqa: E402
from benchmarks.report import panels, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LENGTHS = (128, 1024, 8192)
ROUTING_TARGET_US, RELAY_TARGET, DETECT_TARGET_S, SCALE_TARGET_S = 1000.0, 20_000.0, 2.0, 60.0


def fit(sizes: list[float], values: list[float | None]) -> dict:
    """cost ~ a * N^k by least squares on log-log (points with no value or <= 0 left out):
    k, a and the growth class, and `k_top`, the exponent between the two largest sizes (where
    a fixed part no longer hides how the rest grows); None with fewer than two points."""
    points = [(math.log(s), math.log(v)) for s, v in zip(sizes, values, strict=True) if s > 0 and v and v > 0]
    if len(points) < 2:
        return {"k": None, "a": None, "growth": "unknown", "k_top": None}
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    k = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    (x1, y1), (x2, y2) = points[-2:]
    return {"k": round(k, 3), "a": math.exp(my - k * mx), "growth": growth_class(k),
            "k_top": round((y2 - y1) / (x2 - x1), 3) if x2 != x1 else None}


def growth_class(k: float) -> str:
    return "constant" if k < 0.2 else "sublinear" if k < 0.8 else "linear" if k <= 1.2 else "worse than linear"


def row(cost: str, unit: str, sizes: list, values: list, source: str, target: str = "", met=None,
        against: str = "workers", **extra) -> dict:
    """One line of the summary table: a cost at each size, its fit and its target."""
    return {"cost": cost, "unit": unit, "against": against, "sizes": sizes,
            "values": [None if v is None else float(f"{v:.4g}") for v in values], **fit(sizes, values),
            "source": source, "target": target, "met": met, **extra}


def routing_rows(routing: dict) -> list[dict]:
    """Decision p99 (and p50) against N per prompt length and cache state, and against the
    prompt length at the largest N."""
    out = []
    rows = routing["rows"]
    for length in LENGTHS:
        for state in inproc.STATES:
            cells = sorted((r for r in rows if r["prompt_tokens"] == length and r["state"] == state),
                           key=lambda r: r["workers"])
            sizes = [r["workers"] for r in cells]
            at_128 = next((r["p99_us"] for r in cells if r["workers"] == 128), None)
            p50 = [r["p50_us"] for r in cells]
            out.append(row(f"routing decision p99, {length}-token prompt, {state} cache", "us", sizes,
                           [r["p99_us"] for r in cells], "in-process", "p99 <= 1000 us at 128 workers",
                           None if at_128 is None else at_128 <= ROUTING_TARGET_US,
                           p50=[round(v, 1) for v in p50], p50_fit=fit(sizes, p50)))
    largest = max(r["workers"] for r in rows)
    for state in ("cold", "hot"):
        cells = sorted((r for r in rows if r["workers"] == largest and r["state"] == state),
                       key=lambda r: r["prompt_tokens"])
        out.append(row(f"routing decision p50 at {largest} workers, {state} cache", "us",
                       [r["prompt_tokens"] for r in cells], [r["p50_us"] for r in cells], "in-process",
                       against="prompt tokens"))
    out.append(row("prompt hashing (part of every decision, any N)", "us", list(LENGTHS),
                   [routing["hash_us"][str(n)] for n in LENGTHS], "in-process", against="prompt tokens"))
    return out


def registry_rows(registry: list[dict]) -> list[dict]:
    """The registry over gRPC: polling CPU and RPCs, and detection, against N."""
    sizes = [r["workers"] for r in registry]

    def col(*path):
        values = []
        for r in registry:
            for key in path:
                r = r.get(key) if r is not None else None
            values.append(r)
        return values

    src = "registry over loopback gRPC (synthetic workers)"
    dead, hung = col("dead", "routable_for_s"), col("hung", "routable_for_s")
    return [row("registry CPU of the router process taking in busy workers' updates", "fraction of a core", sizes,
                col("router_cpu_fraction"), src, per_worker_us_per_s=col("router_cpu_us_per_worker_s")),
            row("registry messages each worker sends", "per s", sizes, col("messages_per_worker_s"), src,
                note="one pushed update per 0.25 s while busy (every 0.5 s idle); was Stats + CacheEvents "
                     "polls, 8 RPCs/s"),
            row("update interval each worker's stream keeps, busy", "s", sizes, col("update_interval_s"), src),
            row("killed worker stays routable", "s", sizes, dead, src, "<= 2 s at every size",
                all(v is not None and v <= DETECT_TARGET_S for v in dead)),
            row("hung worker stays routable", "s", sizes, hung, src, "<= 2 s at every size",
                all(v is not None and v <= DETECT_TARGET_S for v in hung)),
            row("update interval the other workers keep while one hangs", "s", sizes,
                col("hung", "others_update_interval_s"), src)]


def index_rows(result: dict) -> list[dict]:
    absorb, memory = result["cache_index"]["absorb"], result["cache_index"]["memory"]
    sizes = [r["workers"] for r in absorb]
    return [row("cache events absorbed (registry update path)", "events/s", sizes,
                [r["events_per_s"] for r in absorb], "in-process",
                cpu_s_per_event=[r["cpu_s_per_event"] for r in absorb]),
            row("one update from every worker (64 events each)", "s", sizes,
                [r["poll_s"] for r in absorb], "in-process"),
            row("cache index memory per reported block", "bytes", [memory["workers"]],
                [memory["bytes_per_held_block"]], "in-process (tracemalloc)",
                per_expected_block=memory["bytes_per_expected_block"], mib_per_worker=memory["mib_per_worker"])]


def planner_rows(result: dict) -> list[dict]:
    sim, auto = result["planner_simulator"], result["autoscaler"]
    sizes = [r["workers"] for r in sim]
    return [row("planner simulator: wall seconds per simulated request", "s", sizes,
                [r["wall_s"] / r["requests"] for r in sim], "in-process",
                requests_per_s=[round(r["requests_per_s"]) for r in sim],
                note="an N-worker plan's pools, N workers' rate; cost per request"),
            row("autoscaler decision", "s", [r["workers"] for r in auto], [r["decision_s"] for r in auto],
                "in-process")]


def cluster_rows(cluster: dict) -> list[dict]:
    """Real processes: the controller's scaling and replacement, detection in the router's
    view, idle CPU, and the router's relay rate."""
    src = "real processes (sim workers, real controller and router)"
    scale = cluster["scale"]
    sizes = [r["decode_to"] for r in scale]
    measured_32 = next((r["routable_s"] for r in scale if r["decode_to"] == 32), None)
    scaled = row("scale decode 1 -> N, until the router routes to all N", "s", sizes,
                 [r["routable_s"] for r in scale], src,
                 f"< {SCALE_TARGET_S:g} s to 32 ({'measured' if measured_32 is not None else 'extrapolated'})",
                 scale_call_s=[round(r["scale_call_s"], 2) for r in scale],
                 scale_down_to_1_s=[round(r["scale_down_s"], 2) for r in scale])
    if scaled["k"] is not None:  # 128 sim workers do not fit this machine's memory: extrapolated, marked so
        scaled["extrapolated_s"] = {n: round(scaled["a"] * n ** scaled["k"], 1) for n in (32, 128)}
        scaled["met"] = (measured_32 if measured_32 is not None else scaled["extrapolated_s"][32]) < SCALE_TARGET_S
    out = [scaled]
    for sig, what in (("SIGKILL", "killed"), ("SIGSTOP", "hung")):
        rows = [r for r in cluster["failures"] if r["signal"] == sig]
        failed = sorted({r["decode_workers"] for r in rows})
        stays = [[r["routable_for_s"] for r in rows if r["decode_workers"] == n] for n in failed]
        back = [[r["back_to_size_s"] for r in rows if r["decode_workers"] == n] for n in failed]
        out.append(row(f"{what} decode worker stays routable (router's view, median)", "s", failed,
                       [_median(v) for v in stays], src, "<= 2 s at every size",
                       all(v is not None and v <= DETECT_TARGET_S for vs in stays for v in vs),
                       each=[[None if v is None else round(v, 3) for v in vs] for vs in stays]))
        out.append(row(f"{what} decode worker replaced (pool back to size, median)", "s", failed,
                       [_median(v) for v in back], src,
                       each=[[None if v is None else round(v, 2) for v in vs] for vs in back]))
    idle = cluster["idle"]
    workers = [r["workers"] for r in idle]
    out.append(row("router CPU while idle", "fraction of a core", workers, [r["router_cpu_fraction"] for r in idle],
                   src))
    out.append(row("controller CPU while idle", "fraction of a core", workers,
                   [r["controller_cpu_fraction"] for r in idle], src))
    return out + relay_rows(cluster, src)


def relay_rows(cluster: dict, src: str) -> list[dict]:
    """Per decode pool size: the router's streamed tokens/s against concurrent streams (with
    its CPU, the client's and the workers'), and the TTFT it adds (0 streams: idle)."""
    out = []
    for decode in sorted({r["decode_workers"] for r in cluster["relay"]}):
        relay = [r for r in cluster["relay"] if r["decode_workers"] == decode]
        levels = [r["concurrency"] for r in relay]
        out.append(row(f"router relay, {decode} decode workers: streamed tokens/s", "tokens/s", levels,
                       [r["tokens_per_s"] for r in relay], src, ">= 20k tokens/s from one router process",
                       max(r["tokens_per_s"] for r in relay) >= RELAY_TARGET, against="concurrent streams",
                       requests_per_s=[round(r["requests_per_s"], 1) for r in relay],
                       requests_per_s_by_tokens=[round(r["requests_per_s_by_tokens"], 1) for r in relay],
                       router_cpu_fraction=[round(r["router_cpu_fraction"], 3) for r in relay],
                       router_tokens_per_cpu_s=[round(r["router_tokens_per_cpu_s"]) for r in relay],
                       events_per_token=[round(r["events_per_token"], 3) if "events_per_token" in r else None
                                         for r in relay],  # < 1: the router coalesced tokens
                       client_cpu_fraction=[round(r["client_cpu_fraction"], 3) for r in relay],
                       workers_cpu_fraction=[round(r["workers_cpu_fraction"], 3) for r in relay]))
        idle = [r for r in cluster["ttft_idle"] if r["decode_workers"] == decode]
        levels = [0] * len(idle) + levels
        out.append(row(f"TTFT the router adds, {decode} decode workers (p50, router - direct gRPC)", "ms", levels,
                       [r["added_ttft_p50_ms"] for r in idle + relay], src, against="concurrent streams",
                       router_ttft_p50_ms=[round(r["router_ttft_p50_ms"], 1) for r in idle + relay],
                       direct_ttft_p50_ms=[round(r["direct_ttft_p50_ms"], 1) for r in idle + relay]))
    return out


def messages_from_code() -> dict:
    """The control plane's messages per worker per second, from the code's intervals."""
    import inspect

    from pdserve.cluster.config import ServeConfig
    from pdserve.router.registry import HEARTBEAT_S, WorkerRegistry

    defaults = inspect.signature(WorkerRegistry).parameters
    interval_s, refresh_s = defaults["stats_s"].default, defaults["refresh_s"].default
    health_s = ServeConfig.model_fields["health_check_interval_s"].default
    return {"worker_updates_busy": 1 / interval_s, "worker_updates_idle": 1 / HEARTBEAT_S,
            "controller_health_pings": 1 / health_s,
            "note": f"per router: each worker pushes an update (load and cache changes) at most every {interval_s} s "
                    f"while its engine steps and a heartbeat every {HEARTBEAT_S} s when idle, on one stream; one "
                    f"membership call to the controller every {refresh_s} s listing all workers; the controller "
                    f"pings each worker's actor every {health_s} s (the actor then asks its own gRPC Stats)"}


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summary(result: dict) -> list[dict]:
    out = routing_rows(result["routing"]) + index_rows(result) + planner_rows(result)
    out += registry_rows(result["registry"])
    if result.get("cluster"):
        out += cluster_rows(result["cluster"])
    if result.get("relay_alone"):
        from benchmarks.control_plane_relay import relay_alone_rows

        out += relay_alone_rows(result["relay_alone"], row)
    return out


def meta(args) -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": os.cpu_count(),
            "load_average_at_start": os.getloadavg(), "quick": args.quick, "python": platform.python_version()}


def _find(summary_rows: list[dict], prefix: str) -> list[dict]:
    return [r for r in summary_rows if r["cost"].startswith(prefix)]


def _loglog(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def plot(result: dict, path: Path) -> None:
    rows = result["summary"]
    with panels(path, 6, width=4.0, height=4.0) as (routing, polling, detect, scale, relay, planner):
        for r in _find(rows, "routing decision p99"):
            if "one cache" not in r["cost"]:
                label = r["cost"].removeprefix("routing decision p99, ").replace(" prompt", "")
                routing.plot(r["sizes"], r["values"], marker="o", label=f"{label} (k={r['k']})")
        routing.axhline(ROUTING_TARGET_US, color="red", linestyle="--", label="target at 128")
        _loglog(routing, "routing decision p99 (in-process)", "workers", "us")
        for r in _find(rows, "registry CPU") + _find(rows, "router CPU while idle"):
            polling.plot(r["sizes"], r["values"], marker="o", label=f"{r['cost'][:34]} (k={r['k']})")
        _loglog(polling, "router CPU taking in its workers' updates", "workers", "fraction of a core")
        for r in _find(rows, "killed") + _find(rows, "hung"):
            if "stays routable" in r["cost"]:
                detect.plot(r["sizes"], r["values"], marker="o", label=r["cost"].replace(" stays routable", ""))
        detect.axhline(DETECT_TARGET_S, color="red", linestyle="--", label="target")
        _loglog(detect, "time a failed worker stays routable", "workers", "s")
        _plot_scaling(scale, rows)
        _plot_relay(relay, rows)
        _plot_planner(planner, rows)
        for ax in (routing, polling, detect, scale, relay, planner):
            ax.legend(fontsize=6)


def _plot_scaling(ax, rows: list[dict]) -> None:
    for r in _find(rows, "scale decode"):
        ax.plot(r["sizes"], r["values"], marker="o", label=f"1 -> N, measured (k={r['k']})")
        if r.get("extrapolated_s"):
            xs = [r["sizes"][-1], *map(int, r["extrapolated_s"])]
            ax.plot(xs, [r["a"] * x ** r["k"] for x in xs], linestyle=":", label="fit, extrapolated")
    for r in _find(rows, "killed decode worker replaced"):
        ax.plot(r["sizes"], r["values"], marker="s", linestyle="", label="replace a killed worker")
    ax.axhline(SCALE_TARGET_S, color="red", linestyle="--", label="target at 32")
    _loglog(ax, "controller (real processes)", "decode workers", "s")


def _plot_relay(ax, rows: list[dict]) -> None:
    for r in _find(rows, "router relay"):
        ax.plot(r["sizes"], r["values"], marker="o", label=r["cost"].split(":")[0].removeprefix("router relay, "))
        ax.plot(r["sizes"], r["router_tokens_per_cpu_s"], marker="x", linestyle=":", label="per router CPU-second")
    ax.axhline(RELAY_TARGET, color="red", linestyle="--", label="target")
    ax.set_xscale("log", base=2)
    ax.set_title("one router process: streamed tokens/s", fontsize=9)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s")


def _plot_planner(ax, rows: list[dict]) -> None:
    for r in _find(rows, "planner simulator") + _find(rows, "autoscaler decision"):
        ax.plot(r["sizes"], r["values"], marker="o", label=f"{r['cost'][:30]} (k={r['k']})")
    _loglog(ax, "planner and autoscaler (in-process)", "workers", "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and shorter windows (~2 minutes)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the real-process part")
    parser.add_argument("--sim-speed", type=float, default=50.0, help="simulated workers' step speed-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "control_plane.json")
    args = parser.parse_args()
    quick = args.quick
    sizes = (8, 32, 128) if quick else (8, 32, 128, 512)
    started = time.monotonic()
    result = {"meta": meta(args), "sizes": sizes, "prefill_share": f"1 in {inproc.PREFILL_SHARE} workers"}
    result["routing"] = inproc.routing(sizes, LENGTHS, 0.3 if quick else 1.0, 1000 if quick else 3000)
    result["cache_index"] = {"in_process": True, "absorb": inproc.index_absorb(sizes, 10 if quick else 30),
                             "memory": inproc.index_memory()}
    planner = inproc.PlannerBench()
    result["planner_simulator"] = [planner.simulator(n, 30) for n in sizes]
    result["autoscaler"] = [planner.autoscaler(n, 1 if quick else 2) for n in sizes]
    result["planner_setup"] = {"in_process": True, "capacity_per_instance": planner.capacity,
                               "slo": vars(planner.slo)}
    from benchmarks.control_plane_registry import registry_at_scale

    result["registry"] = registry_at_scale(sizes, 2.0 if quick else 4.0)
    result["messages_per_worker_s"] = messages_from_code()
    from benchmarks.control_plane_relay import relay_alone

    result["relay_alone"] = relay_alone((256,) if quick else (64, 256, 512), 4.0 if quick else 8.0)
    if not args.no_cluster:
        from benchmarks.control_plane_cluster import run_cluster

        result["cluster"] = run_cluster((4, 8) if quick else (4, 8, 16, 32), (8,) if quick else (8, 16),
                                        (8,) if quick else (8, 16), (256,) if quick else (64, 256, 512),
                                        args.sim_speed, 3.0 if quick else 5.0, 8.0 if quick else 15.0,
                                        failure_reps=1 if quick else 3)
    result["summary"] = summary(result)
    result["meta"]["load_average_at_end"] = os.getloadavg()
    result["meta"]["runtime_s"] = round(time.monotonic() - started, 1)
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
