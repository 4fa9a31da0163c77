"""The cluster controller: a named, detached Ray actor that owns the router and the two
worker pools.

Each pool has a target size; the controller reconciles toward it. A worker's life:

    pending ──a node had room──► starting ──start() returned its address──► ready ──scale down──► draining
    (no node with room)              │                                        │                  │ idle
                                     └──── failed to start ────► dead ◄── failed a health check  ▼
                                                                      (its actor died/hung, its node lost)  stopped

Dead workers leave the pool at once (the router stops routing to them at its next
membership refresh) and are replaced to keep the pool at its target. A replacement that no
node has room for stays `pending` (shown in status, events and `pdserve_pool_pending_workers`)
and starts by itself when a node with room joins. Draining workers refuse new requests
themselves (so nothing races the router's view), finish what they hold, and are stopped
once their stats show nothing open.

The router replicas' lifecycle, health and sizing live in `cluster/routers.py`
(`RouterReplicas`, mixed in).

Workers and router replicas are detached, named actors: they do not share the controller's
fate. When the controller dies, Ray restarts it; the new one re-adopts the running workers
(each reports what it is) and router replicas (which keep the controller's targets and
pins), and scaling and autoscaling resume (`_recover`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque

import ray

from pdserve.cluster.actors import WorkerActor, merge_observations
from pdserve.cluster.config import ServeConfig
from pdserve.cluster.recovery import (
    CONTROLLER_NAME,
    NAMESPACE,
    ON_HEAD,
    ROLES,
    WORKER_PREFIX,
    Recovery,
    RouterRecord,
    WorkerRecord,
    answers_ping,
    router_replica,
)
from pdserve.cluster.routers import RouterReplicas
from pdserve.engine.logs import setup_logging

logger = logging.getLogger(__name__)

_MAX_START_FAILURES = 3
_PLACED_WITHIN_S = 5.0  # an actor not created by then waits for a node with room: `pending`


class Controller(Recovery, RouterReplicas):
    def __init__(self, config: dict) -> None:
        setup_logging("controller")
        self.config = ServeConfig.model_validate(config)
        self.targets = {role: self.config.pool(role).replicas for role in ROLES}
        self.workers: dict[int, WorkerRecord] = {}
        self.events: deque[dict] = deque(maxlen=200)
        self.start_failures = {role: 0 for role in ROLES}
        self.routers: dict[int, RouterRecord] = {}  # by replica
        self.router_target = self.config.router.replicas
        self.router_url = ""
        self._routers_lock = asyncio.Lock()  # one change of the router replicas at a time
        self._keys = iter(range(1 << 62))
        self._health_task: asyncio.Task | None = None
        self.manual: set[str] = set()  # pools an operator sized by hand: the autoscaler leaves them alone
        self.decisions: deque[dict] = deque(maxlen=50)
        self.autoscaler = self._make_autoscaler()
        self.router_sizer = self._make_router_sizer()  # None: the router replica count is fixed
        self.router_decisions: deque[dict] = deque(maxlen=50)
        self._router_cpu: dict[tuple[int, int], tuple[float, float]] = {}  # (replica, pid) -> last reading
        self._autoscale_task: asyncio.Task | None = None
        # Ray restarted this actor after it died: re-adopt what runs, at the first call
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._adoption: asyncio.Task | None = None
        self.closing = False  # shutdown began: nothing is started any more

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Start the pools and the router replicas; returns the router's URL once workers
        and every replica are ready."""
        if not self.config.router.resources:  # the replicas bind the head's port, shared: nothing else may hold it
            from pdserve.router.server import ensure_port_free

            ensure_port_free(self.config.router.host or ray.util.get_node_ip_address(), self.config.router.port)
        self._reconcile()
        await self._wait_ready(include_pending=True)
        failures = await self._reconcile_routers()
        if failures:
            raise failures[0]
        self._start_loops()
        self._event("router", "ready", self.router_url + (f" ({len(self.routers)} replicas)"
                                                          if len(self.routers) > 1 else ""))
        return self.router_url

    def _start_loops(self) -> None:
        loop = asyncio.get_running_loop()
        self._health_task = loop.create_task(self._health_loop())
        if self.autoscaler is not None:
            self._autoscale_task = loop.create_task(self._autoscale_loop())

    async def shutdown(self) -> None:
        """Stop every router replica and worker. Nothing starts from here on: a worker whose
        start fails because it is being stopped is not replaced (it would outlive the service,
        detached, and a later controller would adopt it)."""
        self.closing = True
        await self._recover()
        for task in (self._health_task, self._autoscale_task):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(self._stop_router(r) for r in list(self.routers.values())), return_exceptions=True)
        await asyncio.gather(*(self._stop(w) for w in list(self.workers.values())), return_exceptions=True)
        self.workers.clear()

    # ------------------------------------------------------------ queries
    async def members(self) -> list[dict]:
        await self._recover()
        return [w.member() for w in self.workers.values() if w.state in ("ready", "draining")]

    async def pools_summary(self) -> dict:
        """Per pool: target, ready workers and workers pending for a node with room (metrics)."""
        await self._recover()
        return {role: {"target": self.targets[role],
                       "ready": sum(1 for w in self.workers.values() if w.role == role and w.state == "ready"),
                       "pending": sum(1 for w in self.workers.values() if w.role == role and w.state == "pending")}
                for role in ROLES}

    async def status(self) -> dict:
        await self._recover()

        async def stats(w: WorkerRecord):
            if w.state not in ("ready", "draining"):
                return None
            try:
                return await asyncio.wait_for(w.handle.stats.remote(), 3)
            except Exception:  # noqa: BLE001 - shown as unknown
                return None

        records = list(self.workers.values())
        all_stats = await asyncio.gather(*(stats(w) for w in records))
        short = await self.pools_summary()
        pools = {role: {"target": self.targets[role], "workers": [], "pending": short[role]["pending"]}
                 for role in ROLES}
        for w, s in zip(records, all_stats, strict=True):
            pools[w.role]["workers"].append({**w.member(), "pid": w.pid, "dtype": w.dtype,
                                             "num_threads": w.num_threads, "stats": s})
        spec = self.config.autoscaler
        autoscaler = {"enabled": self.autoscaler is not None, "overridden": sorted(self.manual),
                      "decisions": list(self.decisions)[-5:], "router_decisions": list(self.router_decisions)[-5:],
                      "slo": {"ttft_s": spec.ttft_slo_s, "tpot_s": spec.tpot_slo_s, "percentile": spec.percentile}}
        # replica 0's view (each replica's cache index and load counts are its own, built from
        # the same worker updates; its counts of requests are of the requests it routed)
        first = next((r for _, r in sorted(self.routers.items()) if r.state == "ready"), None)
        try:
            routing = await asyncio.wait_for(first.handle.routing_summary.remote(), 3) if first else None
        except Exception:  # noqa: BLE001 - shown as unknown
            routing = None
        return {"router": self.router_url, "routers": [r.view() for _, r in sorted(self.routers.items())],
                "router_target": self.router_target, "model": self.config.name,
                "simulated": self.config.simulated(), "pools": pools, "events": list(self.events),
                "autoscaler": autoscaler, "routing": routing}

    async def autoscaler_summary(self) -> dict | None:
        """The latest decision (for the router's metrics), or None when autoscaling is off."""
        await self._recover()
        if self.autoscaler is None:
            return None
        last = self.decisions[-1] if self.decisions else None
        return {"decisions": len(self.decisions), "targets": dict(self.targets), "overridden": sorted(self.manual),
                "desired": last["desired"] if last else dict(self.targets),
                "correction": last["correction"] if last else {"prefill": 1.0, "decode": 1.0}}

    async def handle_of(self, worker_id: str):
        """The actor handle of a worker (operators and tests: e.g. to kill one)."""
        await self._recover()
        for w in self.workers.values():
            if w.worker_id == worker_id:
                return w.handle
        raise ValueError(f"no worker {worker_id!r}")

    # ------------------------------------------------------------ scaling
    async def scale(self, prefill: int | None = None, decode: int | None = None, wait: bool = True,
                    manual: bool = True, routers: int | None = None) -> dict:
        """Set pool sizes and/or the number of router replicas; with `wait`, return once new
        workers and replicas serve and drained ones stopped. A manual scale (operators) pins
        the pool, or the router count, against the autoscaler until `clear_override`. Returns the pools' targets,
        and `routers` when it was given."""
        await self._recover()
        if routers is not None and routers < 1:
            raise ValueError(f"router replicas must be >= 1, got {routers}")
        if routers is not None and routers > 1 and self.config.router.port == 0:
            raise ValueError("router replicas share one port: this service's router.port is 0 (each replica would "
                             "get its own); restart it with a fixed router.port")
        for role, n in (("prefill", prefill), ("decode", decode)):
            if n is None:
                continue
            if n < (1 if role == "decode" else 0):
                raise ValueError(f"{role} pool size must be >= {1 if role == 'decode' else 0}, got {n}")
            self.targets[role] = n
            self.start_failures[role] = 0
            if manual:
                self.manual.add(role)
            self._event(role, "scale" if manual else "autoscale", f"target {n}")
        routers_changed = None if routers is None else self._retarget_routers(routers, manual)
        self._remember()
        self._reconcile()
        if wait:
            await asyncio.sleep(0)  # let the drain tasks just created mark their workers draining
            await self._wait_ready()
            while any(w.state == "draining" for w in self.workers.values()):
                await asyncio.sleep(0.1)
            if routers_changed is not None:
                failures = await routers_changed
                if failures:
                    raise RuntimeError(f"router replicas failed to start: {failures[0]}")
        out = {role: self.targets[role] for role in ROLES}
        return out if routers is None else {**out, "routers": self.router_target}

    async def drain(self, worker_id: str) -> dict | None:
        """Drain one ready worker (an operator's: a slow or suspect one) and start its
        replacement, so the pool keeps its target (scale down to shrink a pool). Returns
        the worker as `members()` shows it, or None when no ready worker has this id."""
        await self._recover()
        w = next((w for w in self.workers.values() if w.worker_id == worker_id and w.state == "ready"), None)
        if w is None:
            return None
        asyncio.get_running_loop().create_task(self._drain(w))
        await asyncio.sleep(0)  # the drain task marks it draining before its first await
        self._reconcile()
        return w.member()

    async def clear_override(self) -> None:
        """Hand every pool, and the router replica count, back to the autoscaler."""
        await self._recover()
        self.manual.clear()
        self._remember()
        self._event("cluster", "override_cleared")

    # ------------------------------------------------------------ autoscaling
    def _make_autoscaler(self):
        spec = self.config.autoscaler
        if not spec.enabled:
            return None
        from pdserve.cluster.autoscaler import Autoscaler
        from pdserve.cluster.planner.search import SLO
        from pdserve.engine.profile import Profile

        bounds = {role: (max(self.config.pool(role).min_replicas, 1 if role == "decode" else 0),
                         self.config.pool(role).max_replicas) for role in ROLES}
        return Autoscaler(Profile.load(spec.profile), SLO(spec.ttft_slo_s, spec.tpot_slo_s, spec.percentile),
                          bounds, spec.cooldown_s, spec.min_samples,
                          local_prefill_max_tokens=self.config.local_prefill_max_tokens)

    async def _autoscale_loop(self) -> None:
        spec = self.config.autoscaler
        while True:
            await asyncio.sleep(spec.interval_s)
            if self.router_sizer is not None:
                await self._autoscale_routers()  # never raises: the pools are decided regardless
            try:
                observed = await self._observations(spec.window_s, spec.percentile)
                current = dict(self.targets)
                decision = await asyncio.to_thread(self.autoscaler.decide, observed, current, set(self.manual))
            except Exception as exc:  # noqa: BLE001 - keep deciding next interval
                self._event("cluster", "autoscale_error", str(exc)[:200])
                continue
            entry = decision.as_dict()
            entry["observed"] = {k: v for k, v in observed.items() if k not in ("lengths", "arrivals")}
            entry["current"] = current
            self.decisions.append(entry)
            logger.info("autoscale decision current=%s desired=%s action=%s correction=%s observed=%s",
                        current, decision.desired, decision.action, decision.correction, entry["observed"])
            if decision.action:
                await self.scale(**decision.action, wait=False, manual=False)

    async def _observations(self, window_s: float, percentile: float) -> dict:
        """What every ready router replica observed, merged (each replica sees only the
        requests the kernel gave it); replicas that do not answer are left out."""
        ready = [r for r in self.routers.values() if r.state == "ready"]
        parts = await asyncio.gather(*(asyncio.wait_for(r.handle.observation_samples.remote(window_s), 10)
                                       for r in ready), return_exceptions=True)
        answered = [p for p in parts if not isinstance(p, BaseException)]
        if not answered:
            raise RuntimeError("no router replica answered for its observations"
                               + (f": {parts[0]}" if parts else ""))
        return merge_observations(answered, window_s, percentile)

    def _reconcile(self) -> None:
        """Launch the workers missing below each pool's target and drain those above it."""
        if self.closing:
            return
        for role in ROLES:
            live = [w for w in self.workers.values() if w.role == role and w.state in ("pending", "starting", "ready")]
            missing = self.targets[role] - len(live)
            if missing > 0 and self.start_failures[role] >= _MAX_START_FAILURES:
                continue  # do not hot-loop on a config that cannot start; status shows the events
            for _ in range(missing):
                self._launch(role)
            for w in sorted(live, key=lambda w: (w.state == "ready", w.started_at), reverse=True)[:max(0, -missing)]:
                asyncio.get_running_loop().create_task(self._drain(w))

    def _launch(self, role: str) -> None:
        cfg, spec = self.config, self.config.pool(role)
        name = f"{WORKER_PREFIX}{role}-{uuid.uuid4().hex[:12]}"
        handle = ray.remote(WorkerActor).options(
            name=name, namespace=NAMESPACE, lifetime="detached",  # outlives the controller: re-adopted
            num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, resources=dict(spec.resources),
            scheduling_strategy="SPREAD" if spec.placement == "spread" else "DEFAULT",
            runtime_env={"env_vars": dict(cfg.env)}, max_restarts=0,
        ).remote(role)
        record = WorkerRecord(role, handle, next(self._keys), name=name)
        self.workers[record.key] = record
        asyncio.get_running_loop().create_task(
            self._start(record, cfg.engine_kwargs(role), cfg.worker_kwargs(), spec.cpu_affinity))

    async def _start(self, w: WorkerRecord, engine_kwargs: dict, worker_kwargs: dict, cpu_affinity) -> None:
        if not await self._placed(w):
            return
        try:
            info = await w.handle.start.remote(engine_kwargs, worker_kwargs, cpu_affinity)
        except Exception as exc:  # noqa: BLE001 - reported and retried by reconcile
            self.start_failures[w.role] += 1
            self._event(w.role, "start_failed", str(exc).splitlines()[-1][:300], w)
            await self._forget(w, "dead")
            self._reconcile()
            return
        if w.state != "starting":  # drained or stopped while starting
            return
        w.learn(info)
        w.state = "ready"
        self.start_failures[w.role] = 0
        self._event(w.role, "ready", f"{w.address} on node {w.node_ip}", w)

    async def _placed(self, w: WorkerRecord) -> bool:
        """Wait until Ray has created the worker's actor on some node. While no node has
        room, the record is `pending` (a node that joins later with room ends the wait).
        Returns False when the record was given up meanwhile (scaled down, stopped)."""
        created = asyncio.ensure_future(w.handle.__ray_ready__.remote())
        try:
            await asyncio.wait_for(asyncio.shield(created), _PLACED_WITHIN_S)
        except TimeoutError:
            spec = self.config.pool(w.role)
            w.state = "pending"
            self._event(w.role, "pending", f"no node with room (needs {spec.num_cpus:g} CPU, "
                                           f"{spec.num_gpus:g} GPU, {dict(spec.resources)})", w)
            while not created.done():
                if w.state != "pending":  # given up while waiting
                    created.cancel()
                    return False
                await asyncio.wait([created], timeout=1.0)
            if w.state != "pending":
                return False
            w.state = "starting"
            self._event(w.role, "placed", "a node with room joined", w)
        except Exception:  # noqa: BLE001 - the actor died before it was created: start() reports it
            pass
        return w.state == "starting"

    async def _drain(self, w: WorkerRecord) -> None:
        was_starting = w.state in ("pending", "starting")
        w.state = "draining"
        self._event(w.role, "draining", w.address, w)
        if not was_starting:
            try:
                await w.handle.drain.remote()
                deadline = time.monotonic() + self.config.drain_timeout_s
                while time.monotonic() < deadline:
                    s = await asyncio.wait_for(w.handle.stats.remote(), 5)
                    if not (s["num_running"] or s["num_waiting"] or s["num_waiting_for_kv"]):
                        break
                    await asyncio.sleep(0.1)
            except Exception as exc:  # noqa: BLE001 - a dying worker is drained anyway
                self._event(w.role, "drain_error", str(exc)[:200], w)
        self._event(w.role, "drained", w.address, w)
        await self._stop(w)

    async def _stop(self, w: WorkerRecord) -> None:
        try:
            await asyncio.wait_for(w.handle.stop.remote(), 5)
        except Exception:  # noqa: BLE001 - killed below regardless
            pass
        await self._forget(w, "stopped")

    async def _forget(self, w: WorkerRecord, state: str) -> None:
        w.state = state
        self.workers.pop(w.key, None)
        ray.kill(w.handle, no_restart=True)

    # ------------------------------------------------------------ health
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            ready = [w for w in self.workers.values() if w.state in ("ready", "draining")]
            results = await asyncio.gather(*(answers_ping(w.handle) for w in ready))
            dead = [w for w, ok in zip(ready, results, strict=True) if not ok]
            for w in dead:
                self._event(w.role, "died", w.address, w)
                await self._forget(w, "dead")
            if dead:
                self._reconcile()
            await self._check_routers()

    async def _wait_ready(self, timeout_s: float = 600, include_pending: bool = False) -> None:
        waiting = ("starting", "pending") if include_pending else ("starting",)
        deadline = time.monotonic() + timeout_s
        while any(w.state in waiting for w in self.workers.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not start in time")
            await asyncio.sleep(0.1)
        for role in ROLES:
            if self.start_failures[role] >= _MAX_START_FAILURES:
                failures = [e["detail"] for e in self.events if e["event"] == "start_failed" and e["role"] == role]
                raise RuntimeError(f"{role} workers fail to start: {failures[-1] if failures else 'unknown'}")

    def _event(self, role: str, event: str, detail: str = "", w: WorkerRecord | None = None) -> None:
        entry = {"time": time.time(), "role": role, "event": event, "detail": detail,
                 "worker_id": w.worker_id if w else ""}
        self.events.append(entry)
        logger.info("event role=%s event=%s worker_id=%s %s", role, event, entry["worker_id"], detail)


def is_service_actor(name: str) -> bool:
    """Whether an actor name (in NAMESPACE) is a pdserve worker's or router replica's."""
    return name.startswith(WORKER_PREFIX) or router_replica(name) is not None


def kill_service_actors() -> int:
    """Kill every pdserve worker and router replica left on this Ray cluster (they are
    detached: after a `shutdown` that could not finish, nothing else would); returns how many."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and is_service_actor(a["name"])]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except Exception:  # noqa: BLE001 - gone meanwhile
            pass
    return len(names)


def controller_handle():
    return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)


def create_controller(config: ServeConfig):
    """The controller actor; Ray restarts it whenever it dies (it re-adopts what runs)."""
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_concurrency=1000,
        max_restarts=-1, resources=ON_HEAD,
    ).remote(config.with_token().model_dump())
