"""Router replicas side by side: 1, 2 and 4 replicas of the router in front of the same
workers, in one run (issue 49). Two deployments, each on a Ray of this process's own, under
the real controller, its router replicas sharing one port (SO_REUSEPORT):

- **simulated workers** (`model: sim`, 2 prefill + 4 decode): per replica count, `concurrency`
  streaming clients (benchmarks/control_plane_relay.py's load generator, one process, every
  request's tokens checked against its usage) for `seconds`: requests/s and tokens/s through
  the port, each replica's share and CPU, tokens per router CPU-second, the workers' and the
  client's CPU; meanwhile every 0.5 s each replica's count of requests on each decode worker
  (`routing_summary()["decode_load"]`, what its policy routes by) against the worker's own
  (running + waiting, from its stats): how far the replicas' views diverge from each other and
  from the truth; and how evenly the decode workers were loaded (requests each finished).
  Then, at the largest replica count, one replica SIGKILLed under load: every request's
  outcome with the replica that answered it (its `x-pdserve-replica` header), so a failure on
  a replica that was not killed shows; and the seconds until the controller replaced it.
- **the real model** (SmolLM2-135M-Instruct, 1 prefill + 2 decode workers): per replica count,
  `sessions` chats of ../shared/workloads/multi-turn-chat.jsonl (each turn resends the history
  with the replies the service really generated, after the user's think time x `time-scale`),
  each turn on a connection of its own, so the kernel may give each turn another replica; each
  run's chats open with a token block of their own, so no run finds another's KV. The cached
  share of later turns' prompt tokens (`usage.prompt_tokens_details.cached_tokens`) is the cache
  affinity the replicas keep; the replica counts run in the order given (default 1 2 4 1: the
  closing repeat of one router shows what the order alone changed).

Targets (issue 49): cached share through 4 replicas >= 95% of one router's; capacity with N
replicas >= 0.8 x N of one's (on this machine's cores: the JSON says what bounds it); a
replica killed under load fails no request that was not on it. JSON + PNG.

    .venv/bin/python benchmarks/router_replicas.py [--replicas 1 2 4] [--sessions 16] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.control_plane_cluster import SimCluster, cpu_seconds  # noqa: E402
from benchmarks.control_plane_relay import run_clients  # noqa: E402
from benchmarks.prefix_reuse import chat_session, local_ray, service, workload_rows  # noqa: E402
from benchmarks.report import panels, write  # noqa: E402
from pdserve.engine.stats import percentile  # noqa: E402
from pdserve.testkit.workers import free_port  # noqa: E402

SIM_VOCAB = 49152


def replica_handles(controller) -> dict:
    import ray

    return ray.get(controller.router_handles.remote(), timeout=60)


def set_replicas(controller, n: int) -> list[dict]:
    """Scale the router to `n` replicas (returns once they serve); their status rows."""
    import ray

    ray.get(controller.scale.remote(routers=n), timeout=300)
    time.sleep(1.5)  # the new replicas' first updates from every worker
    return ray.get(controller.status.remote(), timeout=60)["routers"]


# ------------------------------------------------------------------ views and their divergence

def busy(stats: dict | None) -> int:
    return 0 if not stats else stats["num_running"] + stats["num_waiting"] + stats["num_waiting_for_kv"]


class ViewSampler:
    """Every `every_s` on a thread, until stopped: each replica's count of requests on each
    decode worker, and the workers' own counts (their stats through the controller)."""

    def __init__(self, controller, handles: dict, every_s: float = 0.5) -> None:
        self.controller, self.handles, self.every_s = controller, handles, every_s
        self.samples: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import ray

        while not self.stop.wait(self.every_s):
            views = ray.get([h.routing_summary.remote() for h in self.handles.values()], timeout=30)
            workers = ray.get(self.controller.status.remote(), timeout=30)["pools"]["decode"]["workers"]
            self.samples.append({"views": [v["decode_load"] for v in views],
                                 "truth": {w["worker_id"]: busy(w["stats"]) for w in workers}})

    def summary(self) -> dict:
        """Spread: the largest minus the smallest replica count per worker and sample; error:
        each replica's count less the worker's (sampled ~ms apart, not at one instant)."""
        self.stop.set()
        self.thread.join(30)
        spread, error, truth = [], [], []
        for s in self.samples:
            for worker, count in s["truth"].items():
                seen = [v[worker] for v in s["views"] if worker in v]
                if not seen:
                    continue
                spread.append(max(seen) - min(seen))
                error += [v - count for v in seen]
                truth.append(count)
        absolute = [abs(e) for e in error]
        return {"samples": len(self.samples), "worker_requests_mean": statistics.fmean(truth) if truth else None,
                "spread_p50": percentile(spread, 50), "spread_p90": percentile(spread, 90),
                "abs_error_p50": percentile(absolute, 50), "abs_error_p90": percentile(absolute, 90),
                "error_mean": statistics.fmean(error) if error else None}


# ------------------------------------------------------------------ capacity with sim workers

def capacity(cluster: SimCluster, n: int, concurrency: int, seconds: float, warm_s: float, prompt_len: int,
             max_tokens: int) -> dict:
    import ray

    routers = set_replicas(cluster.controller, n)
    handles = replica_handles(cluster.controller)
    router_pids = [r["pid"] for r in routers]
    decode = {w["worker_id"]: w for w in cluster.decode_workers()}
    worker_pids = [w["pid"] for pool in cluster.status()["pools"].values() for w in pool["workers"]]
    finished = {w: d["stats"]["num_finished"] for w, d in decode.items()}
    served = ray.get([h.requests_total.remote() for h in handles.values()], timeout=60)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    client = ctx.Process(target=run_clients, args=(cluster.url, concurrency, warm_s, seconds, prompt_len, max_tokens,
                                                   SIM_VOCAB, out))
    client.start()
    try:
        measure_from, end = out.get(timeout=60)
        time.sleep(max(0.0, measure_from - time.monotonic()))
        sampler = ViewSampler(cluster.controller, handles)
        start = time.monotonic()
        before = {"routers": [cpu_seconds([p]) for p in router_pids], "workers": cpu_seconds(worker_pids),
                  "client": cpu_seconds([client.pid])}
        time.sleep(max(0.0, end - time.monotonic()))
        wall = time.monotonic() - start
        cpu = {"routers": [(cpu_seconds([p]) - b) / wall for p, b in zip(router_pids, before["routers"], strict=True)],
               "workers": (cpu_seconds(worker_pids) - before["workers"]) / wall,
               "client": (cpu_seconds([client.pid]) - before["client"]) / wall}
        divergence = sampler.summary()
        counts = out.get(timeout=300)
    finally:
        client.join(60)
        if client.is_alive():
            client.kill()
            client.join()
    served = [after - b for after, b in zip(ray.get([h.requests_total.remote() for h in handles.values()]), served,
                                            strict=True)]
    per_worker = [w["stats"]["num_finished"] - finished.get(w["worker_id"], 0) for w in cluster.decode_workers()]
    tokens_per_s = counts["tokens"] / seconds
    router_cpu = sum(cpu["routers"])
    return {"replicas": n, "concurrency": concurrency, "seconds": seconds, "tokens_per_s": tokens_per_s,
            "requests_per_s": counts["requests"] / seconds, "errors": counts["errors"],
            "miscounted_requests": counts["miscounted"], "requests_per_replica": served,
            "router_cpu_fraction": cpu["routers"], "router_tokens_per_cpu_s": tokens_per_s / router_cpu,
            "workers_cpu_fraction": cpu["workers"], "client_cpu_fraction": cpu["client"],
            "machine_cpu_fraction": router_cpu + cpu["workers"] + cpu["client"],
            "decode_requests_per_worker": per_worker,
            "decode_imbalance_max_over_mean": (max(per_worker) / statistics.fmean(per_worker) if any(per_worker)
                                               else None),
            "view_divergence": divergence}


# ------------------------------------------------------------------ a replica killed under load

async def _stream(session, url: str, rng: random.Random, max_tokens: int, log: list) -> None:
    body = {"model": "sim", "prompt": [rng.randrange(3, SIM_VOCAB) for _ in range(32)], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, replica, outcome = time.monotonic(), None, "ok"
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            replica = response.headers.get("x-pdserve-replica")
            text = await response.read()
        if response.status != 200:
            outcome = f"http {response.status}"
        elif not text.rstrip().endswith(b"data: [DONE]") or f'"completion_tokens":{max_tokens}'.encode() not in text:
            outcome = "cut"
    except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
        outcome = type(exc).__name__
    log.append({"sent": sent, "replica": None if replica is None else int(replica), "outcome": outcome})


async def _load_and_kill(url: str, victim_pid: int, concurrency: int, seconds: float, kill_at_s: float,
                         max_tokens: int) -> tuple[list, float]:
    import aiohttp

    log: list[dict] = []
    start = time.monotonic()
    killed_at = start + kill_at_s

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=120)) as session:
            while time.monotonic() < start + seconds:
                await _stream(session, url, rng, max_tokens, log)

    async def killer() -> None:
        await asyncio.sleep(kill_at_s)
        os.kill(victim_pid, signal.SIGKILL)

    await asyncio.gather(killer(), *(client(i) for i in range(concurrency)))
    return log, killed_at


def kill_under_load(cluster: SimCluster, n: int, concurrency: int, seconds: float, max_tokens: int) -> dict:
    """SIGKILL replica n-1 `seconds`/3 into `seconds` of load: each request's outcome by the
    replica that answered it, and the seconds until the controller replaced the killed one."""
    import ray

    routers = set_replicas(cluster.controller, n)
    victim = routers[-1]
    log, killed_at = asyncio.run(_load_and_kill(cluster.url, victim["pid"], concurrency, seconds, seconds / 3,
                                                max_tokens))

    def replaced() -> bool:
        now = ray.get(cluster.controller.status.remote(), timeout=60)["routers"]
        pids = {r["pid"] for r in now}
        return len(now) == n and all(r["state"] == "ready" for r in now) and victim["pid"] not in pids

    deadline = time.monotonic() + 120
    while not replaced() and time.monotonic() < deadline:
        time.sleep(0.1)
    replaced_s = time.monotonic() - killed_at if replaced() else None
    by_replica: dict[str, dict[str, int]] = {}
    for r in log:
        key = "no answer" if r["replica"] is None else str(r["replica"])
        by_replica.setdefault(key, {}).setdefault(r["outcome"], 0)
        by_replica[key][r["outcome"]] += 1
    failed_elsewhere = [r for r in log if r["outcome"] != "ok" and r["replica"] not in (None, victim["replica"])]
    return {"replicas": n, "killed_replica": victim["replica"], "concurrency": concurrency, "seconds": seconds,
            "requests": len(log), "ok": sum(r["outcome"] == "ok" for r in log), "outcomes_by_replica": by_replica,
            "failed_on_other_replicas": len(failed_elsewhere),
            "failed_without_an_answer": sum(r["outcome"] != "ok" and r["replica"] is None for r in log),
            "failed_sent_after_kill_plus_1s": sum(r["outcome"] != "ok" and r["sent"] > killed_at + 1 for r in log),
            "replaced_s": replaced_s}


def sim_part(args) -> dict:
    cluster = SimCluster(args.sim_speed)
    try:
        import ray

        ray.get(cluster.controller.scale.remote(prefill=2, decode=4), timeout=300)
        runs = [capacity(cluster, n, args.concurrency, args.seconds, 3.0, 64, args.max_tokens)
                for n in sorted(set(args.replicas))]
        killed = kill_under_load(cluster, max(args.replicas), min(args.concurrency, 48), 9.0, args.max_tokens)
    finally:
        cluster.close()
    one = next(r for r in runs if r["replicas"] == 1)
    for r in runs:
        r["capacity_ratio_tokens"] = r["tokens_per_s"] / one["tokens_per_s"]
        r["capacity_ratio_requests"] = r["requests_per_s"] / one["requests_per_s"]
        r["capacity_target_met"] = r["capacity_ratio_requests"] >= 0.8 * r["replicas"]
    return {"capacity": runs, "kill": killed}


# ------------------------------------------------------------------ cache affinity with the real model

def tagged(rows: list[dict], run: int) -> list[dict]:
    """The chats with a token block of run `run`'s own in front (no run finds another's KV)."""
    tag = [1000 + (run * 131 + i * 17) % 30000 for i in range(16)]
    return [{**row, "system_prompt_ids": tag + row["system_prompt_ids"]} for row in rows]


async def _chats(url: str, rows: list[dict], time_scale: float) -> list[list[dict]]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # each turn a connection: any replica
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        return await asyncio.gather(*(chat_session(session, url, row, start, time_scale) for row in rows))


def affinity(controller, url: str, n: int, run: int, rows: list[dict], time_scale: float) -> dict:
    import ray

    set_replicas(controller, n)
    handles = replica_handles(controller)
    served = ray.get([h.requests_total.remote() for h in handles.values()], timeout=60)
    sessions = asyncio.run(_chats(url, tagged(rows, run), time_scale))
    served = [a - b for a, b in zip(ray.get([h.requests_total.remote() for h in handles.values()]), served,
                                    strict=True)]
    first = [s[0] for s in sessions if s and "error" not in s[0]]
    later = [t for s in sessions for t in s[1:] if "error" not in t]
    failed = [t["error"] for s in sessions for t in s if "error" in t]

    def share(turns: list[dict]) -> float | None:
        prompt = sum(t["prompt_tokens"] for t in turns)
        return sum(t["cached_tokens"] for t in turns) / prompt if prompt else None

    return {"replicas": n, "sessions": len(rows), "turns": len(first) + len(later), "failed": len(failed),
            "first_errors": failed[:3], "requests_per_replica": served,
            "later_turns_cached_share": share(later), "first_turns_cached_share": share(first),
            "ttft_p50_s": percentile([t["ttft_s"] for t in first + later], 50)}


def model_part(args) -> list[dict]:
    from pdserve.cluster.controller import controller_handle

    rows = workload_rows("multi-turn-chat", args.sessions)
    settings = {"router.port": free_port(), "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5, "decode.replicas": 2,
                "router.max_inflight_requests": 1024}
    with local_ray(2), service(settings) as url:
        controller = controller_handle()
        return [affinity(controller, url, n, run, rows, args.time_scale) for run, n in enumerate(args.affinity_order)]


# ------------------------------------------------------------------ the run

def plot(result: dict, path: Path) -> None:
    with panels(path, 3, width=4.6) as (cap, hits, views):
        runs = result["sim"]["capacity"]
        ns = [r["replicas"] for r in runs]
        cap.plot(ns, [r["capacity_ratio_requests"] for r in runs], "o-", label="requests/s vs one replica")
        cap.plot(ns, [r["capacity_ratio_tokens"] for r in runs], "s-", label="tokens/s vs one replica")
        cap.plot(ns, [0.8 * n for n in ns], "k--", label="target 0.8 x N")
        cap.set_xlabel("router replicas")
        cap.set_title(f"capacity, sim workers ({os.cpu_count()} cores)")
        cap.legend(fontsize=8)
        model = result["model"]
        labels = [f"{r['replicas']}#{i}" for i, r in enumerate(model)]
        hits.bar(labels, [r["later_turns_cached_share"] or 0 for r in model])
        hits.set_ylim(0, 1)
        hits.set_title("multi-turn chat: later turns' cached share")
        hits.set_xlabel("router replicas (run order)")
        views.plot(ns, [r["view_divergence"]["spread_p90"] for r in runs], "o-", label="spread between replicas p90")
        views.plot(ns, [r["view_divergence"]["abs_error_p90"] for r in runs], "s-", label="|replica - worker| p90")
        views.set_xlabel("router replicas")
        views.set_title("requests counted on a decode worker")
        views.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replica counts (sim part)")
    parser.add_argument("--affinity-order", type=int, nargs="+", default=[1, 2, 4, 1],
                        help="replica counts of the chat runs, in order (real model)")
    parser.add_argument("--concurrency", type=int, default=128, help="streaming clients (sim part)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per replica count (sim part)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (sim part)")
    parser.add_argument("--sim-speed", type=float, default=4.0, help="sim steps this many times faster than the "
                                                                     "2-core profile")
    parser.add_argument("--sessions", type=int, default=16, help="multi-turn-chat sessions per run (real model)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="chat arrivals and think times x this")
    parser.add_argument("--skip", choices=["sim", "model"], help="leave one part out")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router_replicas.json")
    args = parser.parse_args()
    result = {"setup": {"cores": os.cpu_count(), "load_average_at_start": os.getloadavg(), "args": {
        k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()}}}
    if args.skip != "sim":
        result["sim"] = sim_part(args)
    if args.skip != "model":
        result["model"] = model_part(args)
        one = next(r for r in result["model"] if r["replicas"] == 1)["later_turns_cached_share"]
        for r in result["model"]:
            r["cached_share_vs_one_router"] = (r["later_turns_cached_share"] or 0) / one if one else None
    write(result, args.out, plot if "sim" in result and "model" in result else None)


if __name__ == "__main__":
    main()
