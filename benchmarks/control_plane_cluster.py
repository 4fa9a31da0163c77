"""The control plane with real processes (benchmarks/control_plane.py): simulated workers
(`model: sim`) under the real controller on a Ray of this process's own, served by the real
router (a Ray actor, as `pdserve up` runs it).

Measured: the controller's time to scale the decode pool from 1 to N workers (its scale API,
as `pdserve scale` calls it, and until the router routes to all N), to replace a killed
worker; how long a killed (SIGKILL) and a hung (SIGSTOP) decode worker stays routable in the
router's view (`pdserve_pool_workers{pool="decode"}` on /metrics, scraped every 20 ms); the
router's and the controller's CPU while idle; and one router process's relay rate: streamed
tokens/s and requests/s with many concurrent streaming clients, its CPU, and the TTFT it adds
at that load against calling a decode worker's gRPC directly (benchmarks/online_load.py's
comparison).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import time
import urllib.request

import psutil

from pdserve.testkit.workers import free_port

TOKEN = "control-plane-benchmark-token-0123456789"
ENGINE = {"kv_cache_bytes": 1 << 30}  # its pages are never touched with sim.kv_bytes false
ROUTABLE = re.compile(rb'^pdserve_pool_workers\{pool="decode"\} ([0-9.e+]+)$', re.M)


def settings(speed: float) -> dict:
    """The deployment: one prefill and one decode worker to start with, each 0.1 of a Ray CPU,
    stand-in KV (sim.kv_bytes false: a few bytes a token), steps `speed` times faster than the
    2-core profile, the controller's health check at its default (1 s)."""
    return {"model": "sim", "sim.speed": speed, "sim.kv_bytes": False, "worker_host": "127.0.0.1",
            "router.port": free_port(), "router.max_inflight_requests": 4096, "router.admin_token": TOKEN,
            "cluster_token": TOKEN, "prefill.replicas": 1, "decode.replicas": 1, "prefill.num_cpus": 0.1,
            "decode.num_cpus": 0.1, "prefill.engine": ENGINE, "decode.engine": ENGINE}


class SimCluster:
    """A simulated deployment on a Ray of this process's own; `close()` stops all of it."""

    def __init__(self, speed: float) -> None:
        import ray

        from pdserve.cluster.config import load_config
        from pdserve.cluster.controller import create_controller
        from pdserve.cluster.ray_cluster import init_private_cluster
        from pdserve.cluster.recovery import NAMESPACE, ROUTER_NAME

        self.ray = ray
        init_private_cluster(num_cpus=32)  # Ray's CPU accounting only: the workers share the machine's cores
        self.controller = create_controller(load_config(None, settings(speed)))
        try:
            start = time.monotonic()
            self.url = ray.get(self.controller.start.remote(), timeout=300)
            self.start_s = time.monotonic() - start
            router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
            self.router_pid = ray.get(router.__ray_call__.remote(lambda actor: os.getpid()))
            self.controller_pid = ray.get(self.controller.__ray_call__.remote(lambda actor: os.getpid()))
        except BaseException:
            self.close()
            raise

    def status(self) -> dict:
        return self.ray.get(self.controller.status.remote(), timeout=60)

    def decode_workers(self) -> list[dict]:
        return self.status()["pools"]["decode"]["workers"]

    def routable(self) -> int:
        """Decode workers the router routes to now (its /metrics)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
            found = ROUTABLE.search(response.read())
        return int(float(found.group(1))) if found else 0

    def scale(self, decode: int) -> float:
        """Seconds the controller's scale call took (it returns once new workers are ready)."""
        start = time.monotonic()
        self.ray.get(self.controller.scale.remote(decode=decode), timeout=600)
        return time.monotonic() - start

    def close(self) -> None:
        ray = self.ray
        try:
            ray.get(self.controller.shutdown.remote(), timeout=120)
        except Exception as exc:  # noqa: BLE001 - torn down below regardless
            print(f"controller shutdown failed: {exc}")
        finally:
            ray.kill(self.controller)
            ray.shutdown()


def wait_for(condition, timeout_s: float, step_s: float = 0.02) -> float | None:
    """Seconds until `condition()` holds (polled every `step_s`), None past `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(step_s)
    return time.monotonic() - start


def scale_up(cluster: SimCluster, n: int) -> dict:
    """Scale decode from 1 to `n` workers: seconds the scale call took (it returns once the
    new workers are ready) and until the router routes to all `n`."""
    start = time.monotonic()
    api_s = cluster.scale(n)
    routable = wait_for(lambda: cluster.routable() == n, 60)
    return {"decode_from": 1, "decode_to": n, "scale_call_s": api_s,
            "routable_s": time.monotonic() - start if routable is not None else None}


def scale_down(cluster: SimCluster) -> float:
    """Seconds to scale decode back to 1 (idle workers drained and stopped, the router's view
    down to one)."""
    start = time.monotonic()
    cluster.scale(1)
    wait_for(lambda: cluster.routable() == 1, 60)
    return time.monotonic() - start


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def idle_cost(cluster: SimCluster, seconds: float) -> dict:
    """CPU (fraction of a core) of the router, the controller and the workers (mean per
    worker) over `seconds` with no requests: the polling and health checks alone."""
    workers = [w["pid"] for pool in cluster.status()["pools"].values() for w in pool["workers"]]
    groups = {"router": [cluster.router_pid], "controller": [cluster.controller_pid], "workers": workers}
    before = {name: cpu_seconds(pids) for name, pids in groups.items()}
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    used = {name: (cpu_seconds(pids) - before[name]) / wall for name, pids in groups.items()}
    rss = [psutil.Process(pid).memory_info().rss / 2**20 for pid in workers]
    return {"workers": len(workers), "router_cpu_fraction": used["router"],
            "controller_cpu_fraction": used["controller"], "worker_cpu_fraction_mean": used["workers"] / len(workers),
            "worker_rss_mib_median": statistics.median(rss)}


def failure(cluster: SimCluster, sig: int) -> dict:
    """Send `sig` to a decode worker: seconds until the router stops routing to it, and until
    the pool is back at its size (the controller's replacement ready and routed to)."""
    workers = [w for w in cluster.decode_workers() if w["state"] == "ready"]
    n, victim = len(workers), random.choice(workers)
    start = time.monotonic()
    os.kill(victim["pid"], sig)
    try:
        out = wait_for(lambda: cluster.routable() < n, 60)
        back = wait_for(lambda: cluster.routable() == n and victim["pid"] not in
                        {w["pid"] for w in cluster.decode_workers() if w["state"] == "ready"}, 120, 0.2)
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim["pid"], signal.SIGCONT)  # if the controller has not killed it yet
            except ProcessLookupError:
                pass
    return {"decode_workers": n, "signal": signal.Signals(sig).name, "routable_for_s": out,
            "back_to_size_s": time.monotonic() - start if back is not None else None}


class Load:
    """`concurrency` clients, each streaming completions back to back (random `prompt_len`-token
    prompts, `max_tokens` tokens each, ignore_eos) until `end`; counts what arrives between
    `measure_from` and `end`: tokens (each event's `token_ids`: an event carries several when
    the router coalesced them), SSE events, and requests that finished. Every request's tokens
    are checked against its usage chunk's `completion_tokens`: a request whose counts differ
    is counted in `miscounted` (and its tokens still as they arrived)."""

    def __init__(self, url: str, prompt_len: int, max_tokens: int) -> None:
        self.url, self.prompt_len, self.max_tokens = url, prompt_len, max_tokens
        self.measure_from = self.end = 0.0
        self.tokens = self.events = self.requests = self.errors = self.miscounted = 0

    def _body(self, rng: random.Random) -> dict:
        return {"model": "sim", "prompt": [rng.randrange(3, 49152) for _ in range(self.prompt_len)],
                "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
                "return_token_ids": True, "stream_options": {"include_usage": True}}

    def _read_events(self, events: list[bytes]) -> tuple[int, int | None]:
        """The tokens in `events` (complete SSE events) and the usage's completion tokens if
        one of them is the usage chunk; counts the tokens and events now in the window."""
        tokens, token_events, completion_tokens = 0, 0, None
        for event in events:
            if not event.startswith(b"data: {"):  # [DONE]
                continue
            chunk = json.loads(event[6:])
            if chunk["choices"]:
                tokens += len(chunk["choices"][0].get("token_ids") or ())
                token_events += 1
            elif chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
        if self.measure_from <= time.monotonic() < self.end:
            self.tokens += tokens
            self.events += token_events
        return tokens, completion_tokens

    async def client(self, session, seed: int) -> None:
        """One client's loop, its start staggered over the first 2 s (the clients' requests
        must not finish in waves)."""
        rng = random.Random(seed)
        await asyncio.sleep(rng.uniform(0, 2))
        while time.monotonic() < self.end:
            try:
                async with session.post(self.url + "/v1/completions", json=self._body(rng)) as response:
                    if response.status != 200:
                        self.errors += 1
                        await response.read()
                        await asyncio.sleep(0.05)
                        continue
                    pending, tokens, usage = b"", 0, None
                    async for data in response.content.iter_any():
                        *events, pending = (pending + data).split(b"\n\n")
                        got, completion_tokens = self._read_events(events)
                        tokens, usage = tokens + got, completion_tokens if completion_tokens is not None else usage
            except Exception:  # noqa: BLE001 - counted; the load goes on
                self.errors += 1
                continue
            self.miscounted += tokens != usage
            if self.measure_from <= time.monotonic() < self.end:
                self.requests += 1


async def router_ttft(session, url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed event of a 1-token completion through the router."""
    body = {"model": "sim", "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        async for _ in response.content.iter_any():
            first = time.perf_counter() - start
            break
        await response.read()
    return first


async def direct_ttft(stub, prompt: list[int], request_id: str) -> float:
    """Seconds to the first chunk of a 1-token Generate straight to a decode worker (it
    prefills the prompt itself, as the router's probe gets it: a short prompt stays local)."""
    from pdserve.testkit.workers import generate_request

    start = time.perf_counter()
    first = None
    async for _ in stub.Generate(generate_request(request_id, prompt, 1, [])):
        first = first or time.perf_counter() - start
    return first


async def probes(url: str, addresses: list[str], until: float, gap_s: float) -> dict:
    """Alternate a router probe and a direct probe (to a random decode worker) every `gap_s`
    until `until`; median TTFT of each and their difference (what the router adds)."""
    import aiohttp

    from pdserve.rpc.security import Security
    from pdserve.testkit.workers import decode_stub

    rng = random.Random(5)
    stubs = [decode_stub(a, Security(TOKEN)) for a in addresses]
    routed, direct = [], []
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            prompt = [rng.randrange(3, 49152) for _ in range(32)]
            routed.append(await router_ttft(session, url, prompt))
            direct.append(await direct_ttft(rng.choice(stubs)[1], prompt, f"probe-{len(direct)}"))
            await asyncio.sleep(gap_s)
    for channel, _ in stubs:
        await channel.close()
    return {"probes": len(routed), "router_ttft_p50_ms": 1e3 * statistics.median(routed),
            "direct_ttft_p50_ms": 1e3 * statistics.median(direct),
            "added_ttft_p50_ms": 1e3 * (statistics.median(routed) - statistics.median(direct))}


async def first_requests(addresses: list[str]) -> list[float]:
    """Seconds to the first chunk of each decode worker's first request (straight to it): a
    worker new to the pool answers its first request slowly (lazy initialisation), which is
    the worker's cost, not the router's, so the probes come after these."""
    from pdserve.rpc.security import Security
    from pdserve.testkit.workers import decode_stub

    rng, out = random.Random(3), []
    for i, address in enumerate(addresses):
        channel, stub = decode_stub(address, Security(TOKEN))
        async with channel:
            out.append(await direct_ttft(stub, [rng.randrange(3, 49152) for _ in range(32)], f"first-{i}"))
    return out


async def idle_probes(cluster: SimCluster, seconds: float) -> dict:
    """The probes of `relay` with no other load (each worker's first request done): the TTFT
    the router adds by itself."""
    addresses = [w["address"] for w in cluster.decode_workers()]
    first = await first_requests(addresses)
    return {"decode_workers": len(addresses), "first_request_ttft_ms": [round(1e3 * t, 1) for t in first],
            **await probes(cluster.url, addresses, time.monotonic() + seconds, 0.05)}


async def relay(cluster: SimCluster, concurrency: int, seconds: float, warm_s: float = 4.0) -> dict:
    """One router process under `concurrency` streaming clients for `seconds` (after `warm_s`):
    streamed tokens/s, requests/s, its CPU (fraction of a core) and tokens per CPU-second,
    this client process's and the workers' CPU, and the TTFT the router adds meanwhile."""
    import aiohttp

    workers = [w for pool in cluster.status()["pools"].values() for w in pool["workers"]]
    addresses = [w["address"] for w in workers if w["role"] == "decode"]
    load = Load(cluster.url, prompt_len=64, max_tokens=128)
    load.measure_from = time.monotonic() + warm_s
    load.end = load.measure_from + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        clients = [asyncio.ensure_future(load.client(session, i)) for i in range(concurrency)]
        await asyncio.sleep(warm_s)
        groups = {"router": [cluster.router_pid], "client": [os.getpid()], "workers": [w["pid"] for w in workers]}
        before = {name: cpu_seconds(pids) for name, pids in groups.items()}
        probed = await probes(cluster.url, addresses, load.end, 0.2)
        used = {name: (cpu_seconds(pids) - before[name]) / seconds for name, pids in groups.items()}
        await asyncio.gather(*clients)
    return {"concurrency": concurrency, "decode_workers": len(addresses), "seconds": seconds,
            "tokens_per_s": load.tokens / seconds, "requests_per_s": load.requests / seconds,
            "requests_per_s_by_tokens": load.tokens / seconds / load.max_tokens, "errors": load.errors,
            "miscounted_requests": load.miscounted, "events_per_token": load.events / max(1, load.tokens),
            "router_cpu_fraction": used["router"], "router_tokens_per_cpu_s": load.tokens / seconds / used["router"],
            "client_cpu_fraction": used["client"], "workers_cpu_fraction": used["workers"], **probed}


def run_cluster(decode_sizes: tuple[int, ...], failure_sizes: tuple[int, ...], relay_sizes: tuple[int, ...],
                concurrencies: tuple[int, ...], speed: float, idle_s: float, relay_s: float,
                failure_reps: int = 1) -> dict:
    """The real-process measurements in one simulated deployment (1 prefill worker
    throughout): idle cost at 1 decode worker; then per size in `decode_sizes`, scale 1 -> n,
    idle cost, the failures (at `failure_sizes`, `failure_reps` kills and as many hangs, each
    waiting for the replacement), the relay (at `relay_sizes`, each of `concurrencies`), and
    back to 1."""
    cluster = SimCluster(speed)
    out = {"in_process": False, "sim_speed": speed, "start_s": cluster.start_s,
           "router_nice": psutil.Process(cluster.router_pid).nice(), "prefill_workers": 1,
           "idle": [], "scale": [], "failures": [], "relay": [], "ttft_idle": []}
    try:
        out["idle"].append(idle_cost(cluster, idle_s))
        for n in decode_sizes:
            row = scale_up(cluster, n)
            out["idle"].append(idle_cost(cluster, idle_s))
            if n in failure_sizes:
                for _ in range(failure_reps):
                    out["failures"] += [failure(cluster, signal.SIGKILL), failure(cluster, signal.SIGSTOP)]
            if n in relay_sizes:
                out["ttft_idle"].append(asyncio.run(idle_probes(cluster, relay_s / 2)))
                out["relay"] += [asyncio.run(relay(cluster, c, relay_s)) for c in concurrencies]
            row["scale_down_s"] = scale_down(cluster)
            out["scale"].append(row)
    finally:
        cluster.close()
    return out
