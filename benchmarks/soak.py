"""Soak: 30 minutes of steady load with client disconnects; do pdserve's processes stay flat?

Poisson arrivals through `pdserve up` (2 prefill + 2 decode workers, chaos.py's settings). Of
the requests (online-poisson rows, cycled), ~70% are streamed and read to the end, ~15% are
streamed and dropped by the client after 1-5 events, ~15% are not streamed and given up on
after 0.5-2 s (the router sees the client go mid-request). Every 10 s it samples the resident
memory, open file descriptors and threads of every pdserve process: the router (the process
listening on the router port) and each ready worker (the controller is not sampled).

Growth is measured per process and metric from the start of the measured span (the median of
the first WINDOW samples after the warm-up) to its end (the median of the last WINDOW): one
sample is one moment, and a thread pool that briefly holds one more thread is not a leak.
Reports requests completed / disconnected / failed and whether every worker's KV blocks are all
free at the end. Target: every metric flat (growth < 5% after warm-up), 0 leaked blocks.

    .venv/bin/python benchmarks/soak.py [--duration 1800] [--warmup 300] [--out benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import MODEL, SETTINGS, leaked_blocks, request, sampling  # noqa: E402
from benchmarks.prefix_reuse import WORKLOADS, local_ray, workload_rows  # noqa: E402
from benchmarks.report import panels, repo_relative, sse_events, write  # noqa: E402

KINDS = {"complete": 0.70, "cut_stream": 0.15, "timeout": 0.15}  # request kind -> share of requests
OUTCOMES = ("completed", "disconnected", "failed")
METRICS = {"rss_bytes": ("RSS MiB", 2**20), "num_fds": ("open fds", 1), "num_threads": ("threads", 1)}
FLAT = 0.05  # the most growth after warm-up that counts as flat
WINDOW = 6  # samples (a minute at the default rate) whose median marks each end of the measured span


def schedule(duration_s: float, rate: float, seed: int) -> list[dict]:
    """The requests to send, a function of `seed`: Poisson arrivals at `rate`/s up to `duration_s`,
    each with a kind drawn by KINDS' shares, the events after which a cut_stream client closes and
    the seconds after which a timeout client gives up."""
    rng, at, plan = random.Random(seed), 0.0, []
    while (at := at + rng.expovariate(rate)) <= duration_s:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        plan.append({"at_s": at, "kind": kind, "events": rng.randint(1, 5), "timeout_s": rng.uniform(0.5, 2.0)})
    return plan


async def abandon(session, url: str, index: int, row: dict, step: dict) -> dict:
    """A request the client gives up on (cut_stream or timeout, see `schedule`). Outcome
    "disconnected" when the client left first, "completed" when the response ended before."""
    import aiohttp

    stream = step["kind"] == "cut_stream"
    body = {"model": MODEL, "prompt": row["prompt_token_ids"], "max_tokens": row["max_tokens"], "ignore_eos": True,
            "stream": stream, **sampling(index)}
    timeout = session.timeout if stream else aiohttp.ClientTimeout(total=step["timeout_s"])
    try:
        async with session.post(url + "/v1/completions", json=body, timeout=timeout) as response:
            if response.status != 200:
                return {"outcome": "failed", "error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            if not stream:
                await response.read()
                return {"outcome": "completed"}
            seen = 0
            async for event in sse_events(response):
                if "error" in event:
                    return {"outcome": "failed", "error": event["error"]["message"]}
                seen += 1
                if seen == step["events"]:
                    response.close()  # drop the connection mid-stream
                    return {"outcome": "disconnected"}
            return {"outcome": "completed"}
    except TimeoutError:
        return {"outcome": "disconnected"}
    except Exception as exc:  # noqa: BLE001 - reported as a failure
        return {"outcome": "failed", "error": f"{type(exc).__name__}: {exc}"}


async def send(session, url: str, index: int, row: dict, step: dict) -> dict:
    """One scheduled request: {"kind", "outcome" (one of OUTCOMES), "error" when failed}. A normal
    request fails unless it ends with a finish reason and no error event (chaos.request)."""
    if step["kind"] != "complete":
        return {"kind": step["kind"], **await abandon(session, url, index, row, step)}
    error = (await request(session, url, index, row)).get("error")
    return {"kind": "complete", **({"outcome": "failed", "error": error} if error else {"outcome": "completed"})}


async def drive(url: str, rows: list[dict], plan: list[dict]) -> list[dict]:
    """Send `plan`'s requests at their times, row i % len(rows) for the i-th; wait for them all."""
    import aiohttp

    start, tasks = time.perf_counter(), []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
        for index, step in enumerate(plan):
            await asyncio.sleep(max(0.0, start + step["at_s"] - time.perf_counter()))
            tasks.append(asyncio.ensure_future(send(session, url, index, rows[index % len(rows)], step)))
        return list(await asyncio.gather(*tasks))


def processes(controller, port: int) -> dict[str, int]:
    """Name -> pid of every pdserve process now: "router" (the process listening on `port`) and
    "<role>:<worker_id>" for each ready worker."""
    import psutil  # a dependency of accelerate
    import ray

    pools = ray.get(controller.status.remote())["pools"]
    found = {f"{role}:{w['worker_id']}": w["pid"] for role, pool in pools.items() for w in pool["workers"]
             if w["state"] == "ready" and w["pid"]}
    router = [c.pid for c in psutil.net_connections("tcp")
              if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid]
    return {"router": router[0], **found} if router else found


def usage(pid: int) -> dict[str, int] | None:
    """The process's METRICS now, or None when it is gone (or not readable)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return {"rss_bytes": proc.memory_info().rss, "num_fds": proc.num_fds(), "num_threads": proc.num_threads()}
    except psutil.Error:
        return None


class Sampler(threading.Thread):
    """From start until `stop_event`, every `every_s`: each pdserve process's METRICS appended to
    `series` ({name: {"pid", "t_s": [...], metric: [...]}}, t_s in seconds since start)."""

    def __init__(self, controller, port: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.controller, self.port, self.every_s = controller, port, every_s
        self.stop_event, self.series = threading.Event(), {}

    def run(self) -> None:
        started, count = time.perf_counter(), 0
        while True:
            at = round(time.perf_counter() - started, 1)
            try:
                found = processes(self.controller, self.port)
            except Exception as exc:  # noqa: BLE001 - a missed sample, not the end of sampling
                print(f"soak: sample at {at} s failed: {exc}", file=sys.stderr, flush=True)
                found = {}
            for name, pid in found.items():
                if (values := usage(pid)) is not None:
                    series = self.series.setdefault(name, {"pid": pid, "t_s": [], **{m: [] for m in METRICS}})
                    series["t_s"].append(at)
                    for metric, value in values.items():
                        series[metric].append(value)
            count += 1
            if self.stop_event.wait(max(0.0, started + count * self.every_s - time.perf_counter())):
                return


def growth(series: dict, warmup_s: float) -> dict:
    """Per metric of one process's series: "start" and "end" (medians of the first and the last
    WINDOW samples at or after `warmup_s`), "growth" ((end - start) / start) and "flat" (growth <
    FLAT); {} when fewer than 2 * WINDOW samples are past the warm-up (not judged)."""
    after = [i for i, t in enumerate(series["t_s"]) if t >= warmup_s]
    if len(after) < 2 * WINDOW:
        return {}
    judged = {}
    for metric in METRICS:
        values = [series[metric][i] for i in after]
        start, end = statistics.median(values[:WINDOW]), statistics.median(values[-WINDOW:])
        change = (end - start) / start if start else 0.0
        judged[metric] = {"start": start, "end": end, "growth": round(change, 4), "flat": change < FLAT}
    return judged


def tally(results: list[dict]) -> dict:
    """Requests per kind and outcome, totals per outcome, the first few errors."""
    by_kind = {kind: dict.fromkeys(OUTCOMES, 0) for kind in KINDS}
    for r in results:
        by_kind[r["kind"]][r["outcome"]] += 1
    return {"requests": len(results), **{o: sum(k[o] for k in by_kind.values()) for o in OUTCOMES},
            "by_kind": by_kind, "first_errors": [r["error"] for r in results if "error" in r][:5]}


def print_table(judged: dict[str, dict]) -> None:
    """One line per process: each metric's start -> end (growth), and whether all are flat."""
    for name, metrics in judged.items():
        cells = []
        for metric, m in metrics.items():
            label, scale = METRICS[metric]
            cells.append(f"{label} {m['start'] / scale:.0f} -> {m['end'] / scale:.0f} ({m['growth']:+.1%})")
        flat = "not judged" if not metrics else "flat" if all(m["flat"] for m in metrics.values()) else "GROWING"
        print(f"{name:<28} {'   '.join(cells)}   {flat}", flush=True)


def plot(result: dict, path: Path) -> None:
    with panels(path, len(METRICS), width=6) as axes:
        for ax, (metric, (label, scale)) in zip(axes, METRICS.items(), strict=True):
            for name, series in result["series"].items():
                ax.plot(series["t_s"], [v / scale for v in series[metric]], label=name)
            ax.axvspan(0, result["settings"]["warmup_s"], color="grey", alpha=0.15)
            ax.set_xlabel("seconds into the run (shaded: warm-up)")
            ax.set_ylabel(label)
        axes[0].legend(fontsize="small")
        axes[1].set_title(f"soak: targets met {result['targets_met']}, "
                          f"leaked blocks {sum(result['leaked_blocks'].values())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of load (default 1800)")
    parser.add_argument("--rate", type=float, default=0.5, help="mean requests per second, Poisson (default 0.5)")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before growth is measured (default 300)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the arrivals' and request mix's seed")
    parser.add_argument("--port", type=int, default=8132)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/soak.json")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.duration:
        parser.error("--warmup must be at least 0 and less than --duration")
    rows, plan = workload_rows("online-poisson", 10_000), schedule(args.duration, args.rate, args.seed)

    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller

    with local_ray(num_cpus=2):
        controller = create_controller(load_config(None, {"router.port": args.port, **SETTINGS}))
        try:
            url = ray.get(controller.start.remote())
            sampler = Sampler(controller, args.port, args.sample_every)
            sampler.start()
            started = time.perf_counter()
            results = asyncio.run(drive(url, rows, plan))
            wall = time.perf_counter() - started
            sampler.stop_event.set()
            sampler.join()
            leaked = leaked_blocks(controller)
        finally:
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
    judged = {name: growth(series, args.warmup) for name, series in sampler.series.items()}
    result = {"workload": repo_relative(WORKLOADS / "online-poisson.jsonl"),
              "settings": {"duration_s": args.duration, "rate_per_s": args.rate, "warmup_s": args.warmup,
                           "sample_every_s": args.sample_every, "seed": args.seed, "service": SETTINGS},
              "wall_s": wall, "counts": tally(results), "leaked_blocks": leaked, "processes": judged,
              "targets_met": bool(judged.get("router")) and not any(leaked.values())
              and all(m["flat"] for metrics in judged.values() for m in metrics.values()),
              "series": sampler.series}
    write(result, args.out, plot)
    print_table(judged)


if __name__ == "__main__":
    main()
