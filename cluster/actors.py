"""Ray actors hosting a worker's gRPC server, or the router's HTTP server, in-process.

Both are async actors: their event loop runs the gRPC/uvicorn server; engine steps run on
a thread of their own (engine.async_engine)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.protos.convert import message_dict
from pdserve.rpc import tracing

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig

logger = logging.getLogger(__name__)


def _pin_threads(cpu_affinity: list[int] | None) -> int:
    """Give torch as many threads as this worker has cores: its pinned cores when the pool
    sets `cpu_affinity`, else the CPUs Ray assigned the actor (`num_cpus`, at least 1). More
    threads than cores only make OpenMP's spinning threads fight over them. Returns the count."""
    import ray
    import torch

    if cpu_affinity:
        os.sched_setaffinity(0, set(cpu_affinity))
        threads = len(cpu_affinity)
    else:
        assigned = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
        threads = max(1, int(assigned))
    torch.set_num_threads(threads)
    return threads


@contextlib.asynccontextmanager
async def _start_slot(folder: Path | None, slots: int | None = None):
    """One of `slots` start slots (default: this process's cores), file locks in `folder`
    (None: no limit), held while the block runs and given back when it ends or the process
    dies. A simulated worker's start is ~1 s of CPU (imports, torch's the most), and on 2
    cores 16 started at once took 1.45x the CPU seconds that 2 at a time did (cache and
    memory contention): a pool scaling up got its workers later."""
    if folder is None:
        yield
        return
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    slots = slots or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    while True:
        for slot in range(max(1, slots)):
            fd = os.open(folder / f"{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                yield
            finally:
                os.close(fd)  # gives the lock back
            return
        await asyncio.sleep(0.05)


def _sim_start_folder() -> Path:
    """The start slots of the simulated workers of this Ray session on this machine (real
    models start without a limit)."""
    import ray

    context = ray.get_runtime_context()
    return Path(context.get_temp_dir()) / context.get_session_name() / "pdserve-sim-start"


def _node() -> tuple[str, str]:
    """(IP, node id) of the Ray node this actor runs on."""
    import ray

    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class WorkerActor:
    """One prefill or decode worker."""

    def __init__(self, role: str) -> None:
        from pdserve.engine.logs import setup_logging

        setup_logging(role)
        self.role = role
        self.service = self.server = None
        self.address = ""
        self._probe = None  # (channel, stub) to this worker's own gRPC server, for `ping`
        self._info: dict = {}  # what start() returned: a restarted controller adopts us from it
        self._starting = False  # start() is running

    async def start(self, engine_kwargs: dict, worker_kwargs: dict, cpu_affinity: list[int] | None = None) -> dict:
        from pdserve.engine.config import EngineConfig

        self._starting = True
        try:
            engine_config = EngineConfig.from_kwargs(**engine_kwargs)
            called = time.monotonic()
            async with _start_slot(_sim_start_folder() if engine_config.is_sim else None):
                slot = time.monotonic()
                info = await self._start(engine_config, worker_kwargs, cpu_affinity)
        finally:
            self._starting = False
        logger.info("started in %.2f s (%.2f s waiting for a start slot) process_cpu_s=%.2f", time.monotonic() - called,
                    slot - called, time.process_time())
        return info

    async def _start(self, engine_config, worker_kwargs: dict, cpu_affinity: list[int] | None) -> dict:
        from pdserve.engine.dtypes import dtype_name
        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.worker_base.config import WorkerConfig
        from pdserve.worker_base.server import start_service

        num_threads = _pin_threads(cpu_affinity)
        node_ip, node_id = _node()
        config = WorkerConfig(**{"host": node_ip, **worker_kwargs})
        engine = await asyncio.to_thread(functools.partial(LLMEngine, engine_config, serving=True))
        if self.role == "prefill":
            from pdserve.prefill_worker.service import PrefillService as make_service
        else:
            from pdserve.decode_worker.service import DecodeService as make_service
        self.service, self.server, self.address = await start_service(engine, config, make_service)
        self._info = {"role": self.role, "address": self.address, "worker_id": config.worker_id, "pid": os.getpid(),
                      "dtype": dtype_name(engine.loaded.model.dtype), "num_threads": num_threads,
                      "node_ip": node_ip, "node_id": node_id}
        return dict(self._info)

    async def info(self) -> dict:
        """What start() returned, and the state now: `unstarted` (start() never ran, or
        failed: whoever created the actor is gone or gave up on it), `starting`, `ready` or
        `draining`: how a restarted controller re-adopts this worker."""
        if self.service is None:
            state = "starting" if self._starting else "unstarted"
        else:
            state = "draining" if self.service.draining else "ready"
        return {**self._info, "role": self.role, "state": state}

    async def ping(self) -> bool:
        """Healthy iff the worker's gRPC server answers its own Stats (token checked, engine
        not stalled) within 3 s, as a router would ask it."""
        if self.service is None:
            return False
        if self._probe is None:
            from pdserve.protos.pdserve_pb2_grpc import DecodeWorkerStub, PrefillWorkerStub
            from pdserve.rpc.channel import open_channel

            channel = open_channel(self.address, self.service.config.security)
            self._probe = channel, (PrefillWorkerStub if self.role == "prefill" else DecodeWorkerStub)(channel)
        from pdserve.protos import pdserve_pb2 as pb

        try:
            await self._probe[1].Stats(pb.StatsRequest(), timeout=3)
        except Exception:  # noqa: BLE001 - unreachable, stalled or too slow: unhealthy
            return False
        return True

    async def drain(self) -> None:
        self.service.draining = True

    async def stats(self) -> dict:
        return message_dict(self.service.aengine.stats())

    async def stop(self) -> None:
        if self._probe is not None:
            await self._probe[0].close()
        if self.server is not None:
            await self.service.stop_serving(self.server, grace_s=1)
        await asyncio.to_thread(tracing.flush)  # Ray ends the process without running atexit


class RouterActor:
    """One router replica, reading pool membership from the controller. With
    `router.replicas` > 1 every replica binds the same host:port (SO_REUSEPORT,
    router.server.shared_socket) and serves the connections the kernel gives it; each follows
    every worker's updates itself, so each routes with the whole picture."""

    def __init__(self) -> None:
        from pdserve.engine.logs import setup_logging

        setup_logging("router")
        self.server = None
        self.task = self.watch = None
        self.url = ""
        self.stopping = False
        self._memo: dict = {}  # the controller's decisions (targets, pins), kept here to outlive it

    async def start(self, config: RouterConfig, controller_name: str, namespace: str) -> str:
        """Serve `config` (a null `host`: this node's address); returns the replica's URL."""
        import ray

        from pdserve.router.server import make_server

        if config.host is None:
            config = config.model_copy(update={"host": ray.util.get_node_ip_address()})
        controller = ray.get_actor(controller_name, namespace=namespace)

        async def members() -> list[dict]:
            # bounded: while the controller restarts, the registry keeps its last membership
            return await asyncio.wait_for(controller.members.remote(), 10)

        self.server = make_server(config, members, controller)
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self.server.serve())
        self.watch = loop.create_task(self._watch_autoscaler(controller))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why uvicorn could not start (port in use, ...)
                raise RuntimeError("router exited during start-up")
            await asyncio.sleep(0.05)
        self.url = f"http://{config.host}:{config.port}"
        return self.url

    async def ping(self) -> bool:
        return self.task is not None and not self.task.done()

    async def get_url(self) -> str:
        return self.url

    async def info(self) -> dict:
        """Its URL, process, node and state (starting, ready, stopping): `status()`, and how a
        restarted controller re-adopts it."""
        import ray

        state = "stopping" if self.stopping else ("ready" if self.server is not None and self.server.started
                                                  else "starting")
        return {"url": self.url, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "state": state}

    async def requests_total(self) -> int:
        """Requests this replica finished (every finish reason): its own `pdserve_requests_total`."""
        metrics = self.server.config.app.state.router.metrics
        return int(sum(sample.value for family in metrics.requests.collect() for sample in family.samples
                       if sample.name.endswith("_total")))

    async def cpu_seconds(self) -> tuple[float, float]:
        """(CPU seconds this process has used, every thread, `time.monotonic()`): two readings
        give the cores it used between them (cluster.autoscaler.cpu_used), what the autoscaler
        sizes the replicas by. process_time() counts in nanoseconds, unlike os.times()'
        10 ms ticks, and answering this call itself uses some: an interval never reads 0."""
        return time.process_time(), time.monotonic()

    async def remember(self, memo: dict) -> None:
        """Keep the controller's decisions, so that a restarted controller resumes them."""
        self._memo = dict(memo)

    async def recall(self) -> dict:
        return dict(self._memo)

    async def routing_summary(self) -> dict:
        return self.server.router.routing_summary()

    async def _watch_autoscaler(self, controller) -> None:
        """Mirror the controller's pools (target, pending) and autoscaler into /metrics, and
        keep its list of router replicas (`router_views`), which `replicas` asks: installed
        as the app's `replicas` hook, so that this replica's /metrics and /dashboard show all."""
        app = self.server.config.app
        metrics = app.state.router.metrics
        self.replica = app.state.router.config.replica or 0
        self.routers: list[dict] = []  # the controller's router_views at its last answer
        app.state.replicas = self.replicas
        while True:
            await asyncio.sleep(2.0)
            try:
                pools = await asyncio.wait_for(controller.pools_summary.remote(), 10)
                summary = await asyncio.wait_for(controller.autoscaler_summary.remote(), 10)
                self.routers = await asyncio.wait_for(controller.router_views.remote(), 10)
            except Exception:  # noqa: BLE001 - the controller may be restarting
                continue
            metrics.set_pools(pools)
            if summary is not None:
                metrics.set_autoscaler(summary)

    async def replica_report(self, window_s: float = 0.0) -> dict:
        """This replica's `info()`, per-replica metric families (router.metrics), the
        requests it finished in the last `window_s` seconds (FinishedRequest tuples) and its
        `time.monotonic()` now, which their times are of: what another replica's /metrics
        and /dashboard show of it."""
        metrics = self.server.config.app.state.router.metrics
        finished = (await self.observation_samples(window_s))["finished"]
        return {"info": await self.info(), "families": metrics.replica_families(), "finished": finished,
                "now": time.monotonic()}

    async def replicas(self, window_s: float = 0.0, timeout_s: float = 1.0) -> list:
        """Every router replica as a router.metrics.Replica: this one, read here, and each
        other one the controller listed at its last answer, asked for its `replica_report`
        (its address, pid and state as it reports them: the controller's list may be 2 s
        old); one that does not answer within `timeout_s` comes as the controller listed it,
        without families (a scrape does not wait on a hung replica). In replica order; the
        finished requests' times moved onto this process's monotonic clock (a replica on
        another node has its own)."""
        from pdserve.router.metrics import Replica
        from pdserve.router.state import FinishedRequest

        info = await self.info()
        me = {"replica": self.replica, "address": info["url"], "pid": info["pid"], "state": info["state"]}
        views = sorted([me, *(v for v in self.routers if v["replica"] != self.replica)], key=lambda v: v["replica"])

        async def report(view: dict) -> Replica:
            try:
                answer = await (self.replica_report(window_s) if view is me else
                                asyncio.wait_for(view["handle"].replica_report.remote(window_s), timeout_s))
            except Exception:  # noqa: BLE001 - dead, hung or still starting: shown as not answering
                return Replica(view["replica"], view["address"], view["pid"], view["state"])
            info = answer["info"]
            shift = time.monotonic() - answer["now"]  # off by the call's latency at most
            finished = [dataclasses.replace(f, end=f.end + shift, arrival=f.arrival + shift)
                        for f in (FinishedRequest(*r) for r in answer["finished"])]
            return Replica(view["replica"], info["url"], info["pid"], info["state"], answer["families"], finished)

        return list(await asyncio.gather(*map(report, views)))

    async def observations(self, window_s: float, percentile: float = 90.0) -> dict:
        return self.server.config.app.state.router.observations(window_s, percentile)

    async def observation_samples(self, window_s: float) -> dict:
        """The raw material of `observations` (router.state.Router.observations): this
        replica's finished requests of the last `window_s` seconds, oldest first, as
        FinishedRequest tuples, and its open requests. `merge_observations` combines the
        replicas' into what one router would have observed; `now` is this process's
        `time.monotonic()`, which the times are of."""
        router = self.server.config.app.state.router
        now = time.monotonic()
        return {"finished": [dataclasses.astuple(r) for r in router.finished if now - r.end <= window_s],
                "inflight": router.inflight, "now": now}

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop serving. With `drain_s` (a replica scaled away), first stop accepting
        connections and give the open requests up to that long to finish."""
        self.stopping = True
        if self.server is not None and drain_s > 0 and self.server.started:
            for listener in getattr(self.server, "servers", []):
                listener.close()  # the kernel gives new connections to the other replicas
            router = self.server.config.app.state.router
            deadline = time.monotonic() + drain_s
            while router.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        if self.server is not None:
            self.server.should_exit = True
            await asyncio.wait_for(asyncio.shield(self.task), timeout=10)
        await asyncio.to_thread(tracing.flush)


def merge_observations(parts: list[dict], window_s: float, percentile: float = 90.0) -> dict:
    """What the autoscaler reads (router.state.Router.observations' format) from every
    replica's `observation_samples`: their finished requests pooled, so that the rate counts
    all of them and the percentiles are of every sample, not an average of percentiles; the
    latest 500 lengths and arrivals across replicas; open requests summed. Each part's times
    move onto the first part's clock by the parts' `now` (replicas on other nodes have
    monotonic clocks of their own; the call's latency is the error)."""
    from pdserve.router.state import FinishedRequest, summarize

    reference = parts[0].get("now", 0.0) if parts else 0.0
    recent = []
    for part in parts:
        shift = reference - part.get("now", reference)
        for fields in part["finished"]:
            r = FinishedRequest(*fields)
            recent.append(dataclasses.replace(r, end=r.end + shift, arrival=r.arrival + shift))
    recent.sort(key=lambda r: r.end)
    return summarize(recent, window_s, percentile, sum(part["inflight"] for part in parts))
