"""The router's worker registry against N workers over real gRPC, at sizes no machine could
run as worker processes (benchmarks/control_plane.py): a "fleet" process serves the workers'
Info and update streams (`Watch`) for N-1 synthetic workers on one port (each with a channel
of its own from the registry, as N workers would have), and a "victim" process serves one
more on a port of its own, which is then hung (SIGSTOP) and killed (SIGKILL).

Per size: the registry's CPU per worker per second (taking in the updates, measured as the
CPU time of the process that runs nothing else), the messages each worker sends per second
(counted by the fleet), the update interval each worker's stream actually keeps, and how long
the hung and the killed worker stay routable in the registry's view. The registry is the
product's (router/registry.py); the fleet's workers behave as busy ones (an update every
interval the registry asks, never only heartbeats), each carrying a Stats report the size of
a busy worker's and no cache events.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.router.registry import WorkerRegistry
from pdserve.rpc.channel import add_port, new_server
from pdserve.rpc.security import Security

TOKEN = "control-plane-benchmark-token-0123456789"
COUNTED = ("Info", "Watch", "updates")


def busy_stats(worker_id: str) -> pb.WorkerStats:
    """A Stats answer the size of a busy worker's: load, counters, the step-time and batch-size
    histograms (13 and 10 buckets) and one transport's transfers."""
    stats = pb.WorkerStats(worker_id=worker_id, role="decode", num_running=12, num_waiting=2, num_free_blocks=3100,
                           num_total_blocks=5000, num_finished=123456, prefix_cache_queries=98765,
                           prefix_cache_query_tokens=45_000_000, prefix_cache_hit_tokens=12_000_000,
                           num_cached_blocks=900, prefill_tokens_computed=33_000_000,
                           decode_tokens_computed=8_000_000)
    for histogram, buckets in ((stats.step_seconds, 13), (stats.batch_size, 10)):
        histogram.bounds[:] = [0.001 * 2**i for i in range(buckets)]
        histogram.counts[:] = [1000 + 37 * i for i in range(buckets + 1)]
        histogram.sum = 1234.5
    transfer = stats.transfers.add(transport="torch", direction="receive", bytes=123_456_789_012)
    transfer.seconds.bounds[:] = [0.001 * 2**i for i in range(14)]
    transfer.seconds.counts[:] = [10 * i for i in range(15)]
    return stats


class Fleet(pb_grpc.DecodeWorkerServicer, pb_grpc.PrefillWorkerServicer):
    """Canned answers to what the registry asks every worker, counted per method."""

    def __init__(self, counters) -> None:
        self.counters = counters
        self.info = pb.WorkerInfo(worker_id="fleet", role="decode", max_model_len=8192, vocab_size=49152,
                                  cache_root=b"r" * 16, prefix_caching=True, layout=pb.KVLayout(block_size=16))
        self.stats = busy_stats("fleet")

    async def Info(self, request, context):
        self.counters[0] += 1
        return self.info

    async def Watch(self, request, context):
        """A busy worker's stream: an update every interval asked (its cache unchanged)."""
        self.counters[1] += 1
        seq = 0
        while True:
            seq += 1
            self.counters[2] += 1
            cache = pb.CacheEventsReply(since=request.cursor, next_cursor=request.cursor or 1,
                                        reset=not request.cursor) if seq == 1 else None
            yield pb.WorkerUpdate(seq=seq, stats=self.stats, cache=cache)
            await asyncio.sleep(request.interval_ms / 1e3)


def serve(port, counters) -> None:
    """A process's body: serve the fleet on a free loopback port (written to `port`)."""
    async def main() -> None:
        security = Security(TOKEN)
        server = new_server(security)
        fleet = Fleet(counters)
        pb_grpc.add_DecodeWorkerServicer_to_server(fleet, server)
        pb_grpc.add_PrefillWorkerServicer_to_server(fleet, server)
        port.value = add_port(server, "127.0.0.1:0", security)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def start_server(ctx) -> tuple[mp.Process, int, object]:
    """A fleet process: (process, port, its counters of Info and Watch calls and updates sent)."""
    port, counters = ctx.Value("i", 0), ctx.Array("q", len(COUNTED), lock=False)
    process = ctx.Process(target=serve, args=(port, counters), daemon=True)
    process.start()
    deadline = time.monotonic() + 60
    while not port.value:
        if time.monotonic() > deadline or not process.is_alive():
            process.kill()
            raise RuntimeError("the fleet process did not start")
        time.sleep(0.05)
    return process, port.value, counters


async def until(condition, timeout_s: float, step_s: float = 0.002) -> float | None:
    """Seconds until `condition()` holds (polled every `step_s`), None past `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            return None
        await asyncio.sleep(step_s)
    return time.monotonic() - start


async def update_cost(registry: WorkerRegistry, counters, fleet_pid: int, n: int, seconds: float) -> dict:
    """The registry's CPU over `seconds`, per worker per second, with the messages each worker
    sent per second, the update interval each kept, and the fleet's CPU per worker."""
    import psutil

    fleet = psutil.Process(fleet_pid)
    before, cpu, fleet_cpu = list(counters), time.process_time(), fleet.cpu_times()
    start = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - start
    cpu = time.process_time() - cpu
    after, fleet_after = list(counters), fleet.cpu_times()
    calls = {name: (after[i] - before[i]) / wall / (n - 1) for i, name in enumerate(COUNTED)}
    served = fleet_after.user + fleet_after.system - fleet_cpu.user - fleet_cpu.system
    return {"router_cpu_fraction": cpu / wall, "router_cpu_us_per_worker_s": 1e6 * cpu / wall / n,
            "messages_per_worker_s": sum(calls.values()), "messages_by_kind_per_worker_s": calls,
            "update_interval_s": 1 / calls["updates"] if calls["updates"] else None,
            "workers_cpu_us_per_worker_s": 1e6 * served / wall / (n - 1)}


async def stays_routable(registry: WorkerRegistry, worker_id: str, pid: int, sig: int, counters,
                         n: int) -> dict:
    """Send `sig` to the worker's process; seconds until the registry stops routing to it, and
    the update interval the other workers kept meanwhile."""
    view = registry._views[worker_id]
    updates_before = counters[2]
    os.kill(pid, sig)
    elapsed = await until(lambda: not view.routable, 60)
    updates = counters[2] - updates_before
    if elapsed is None or elapsed < 1.0:  # too short a span to say how often the others sent
        return {"routable_for_s": elapsed}
    return {"routable_for_s": elapsed, "others_update_interval_s": elapsed * (n - 1) / updates if updates else None}


async def one_size(ctx, n: int, fleet: tuple, measure_s: float) -> dict:
    """A registry over `n` workers (n-1 in the fleet, one victim decode worker): the cost of
    their updates, then the victim hung, resumed, and killed."""
    from benchmarks.control_plane_inproc import members

    fleet_process, fleet_port, counters = fleet
    victim, victim_port, _ = start_server(ctx)
    listed = [{**m, "address": f"127.0.0.1:{fleet_port}"} for m in members(n - 1)]
    listed.append({"role": "decode", "worker_id": "victim", "address": f"127.0.0.1:{victim_port}", "state": "ready"})

    async def source() -> list[dict]:
        return listed

    registry = WorkerRegistry(source, Security(TOKEN))
    try:
        await registry.start()
        views = registry._views
        first = await until(lambda: all(v.stats is not None for v in views.values())
                            and len(registry.cache_index.worker_ids()) == n, 120, 0.05)
        await asyncio.sleep(1.0)
        row = {"workers": n, "first_full_view_s": first,
               **await update_cost(registry, counters, fleet_process.pid, n, measure_s)}
        row["hung"] = await stays_routable(registry, "victim", victim.pid, signal.SIGSTOP, counters, n)
        os.kill(victim.pid, signal.SIGCONT)
        row["hung"]["routable_again_s"] = await until(lambda: views["victim"].routable, 30, 0.01)
        row["dead"] = await stays_routable(registry, "victim", victim.pid, signal.SIGKILL, counters, n)
    finally:
        await registry.stop()
        victim.kill()
        victim.join()
    return row


def _run(sizes: tuple[int, ...], measure_s: float, out) -> None:
    """The child process's body: the fleet, then every size in turn; puts the rows on `out`."""
    ctx = mp.get_context("spawn")
    fleet = start_server(ctx)
    try:
        async def every_size() -> list[dict]:  # one event loop: gRPC's poller outlives a loop of its own
            return [await one_size(ctx, n, fleet, measure_s) for n in sizes]

        out.put(asyncio.run(every_size()))
    finally:
        fleet[0].kill()
        fleet[0].join()


def registry_at_scale(sizes: tuple[int, ...], measure_s: float) -> list[dict]:
    """Per size, the registry's update cost and detection times (see the module's docstring),
    measured in a process of their own (its CPU is the registry's alone)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    process = ctx.Process(target=_run, args=(sizes, measure_s, out))
    process.start()
    try:
        return out.get(timeout=120 + 60 * len(sizes))
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
