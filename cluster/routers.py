"""The controller's router replicas (`RouterReplicas`, mixed into
`cluster.controller.Controller`).

The router is `router.replicas` RouterActors on the head node, all serving one host:port
(SO_REUSEPORT), or, with `router.resources`, each on a node offering them (deploy/nodes.yaml
labels them `router`; `router.host: null`: on its node's address, behind a load balancer). A
replica no node has room for fails its start after _ROUTER_PLACED_WITHIN_S, naming the
resources; the health loop retries a missing one, so it starts once a node with room joins.
Replica 0 is named ROUTER_NAME, replica i `ROUTER_NAME-i`. The health loop pings each and
replaces a dead one alone (`_check_routers`); `scale(routers=N)` starts replicas or stops the
highest-numbered ones (each finishing its open requests first); with the autoscaler on and
`autoscaler.routers` giving a range, their CPU sizes them (`_autoscale_routers`). Routing
state needs no sharing: every replica follows every worker's updates itself.

What the mixin uses of the controller: `config`, `routers` (replica -> RouterRecord),
`router_target`, `manual`, `router_sizer`, `router_decisions`, `_router_cpu`,
`_routers_lock`, `closing`, and its `_event`, `_recover`, `_remember`, `_take_router_url`.
"""

from __future__ import annotations

import asyncio
import logging

import ray

from pdserve.cluster.actors import RouterActor
from pdserve.cluster.recovery import CONTROLLER_NAME, NAMESPACE, ON_HEAD, RouterRecord, answers_ping, router_name

logger = logging.getLogger(__name__)
# A router replica whose actor Ray has not created by then has no node with room: its start
# fails (an operator's `pdserve up` or scale gets the reason). Creating one takes a process
# start, a few seconds on a loaded host; the health loop retries a missing replica.
_ROUTER_PLACED_WITHIN_S = 30.0


class RouterReplicas:
    async def _start_router(self, replica: int) -> RouterRecord:
        """Start router replica `replica` on the head node, or on a node offering
        `router.resources`; raises (and kills it) when it does not start, or when no node has
        room for it within _ROUTER_PLACED_WITHIN_S (a RuntimeError naming the resources)."""
        if self.closing:
            raise RuntimeError(f"router replica {replica} not started: the service is shutting down")
        needs = dict(self.config.router.resources) or ON_HEAD
        handle = ray.remote(RouterActor).options(
            name=router_name(replica), namespace=NAMESPACE, num_cpus=0, lifetime="detached", resources=needs,
            runtime_env={"env_vars": dict(self.config.env)}).remote()
        record = RouterRecord(replica, handle)
        self.routers[replica] = record
        try:
            await self._router_placed(record, needs)
            config = self.config.router_config().model_copy(update={"replica": replica})
            await handle.start.remote(config, CONTROLLER_NAME, NAMESPACE)
            info = await asyncio.wait_for(handle.info.remote(), 10)
        except BaseException:
            if self.routers.get(replica) is record:
                del self.routers[replica]
            ray.kill(handle, no_restart=True)
            raise
        record.learn(info)
        self._take_router_url(record)
        self._remember()
        return record

    @staticmethod
    async def _router_placed(r: RouterRecord, needs: dict) -> None:
        """Wait until Ray has created replica `r`'s actor; RuntimeError naming the resources it
        `needs` when no node had room for it within _ROUTER_PLACED_WITHIN_S."""
        try:
            await asyncio.wait_for(r.handle.__ray_ready__.remote(), _ROUTER_PLACED_WITHIN_S)
        except TimeoutError:
            raise RuntimeError(f"router replica {r.replica}: no node offers {needs} with room (waited "
                               f"{_ROUTER_PLACED_WITHIN_S:g}s): label a node `router` in deploy/nodes.yaml, "
                               f"one replica per unit") from None

    async def _stop_router(self, r: RouterRecord, drain_s: float = 0.0) -> None:
        """Stop a replica gracefully (with `drain_s`: it stops accepting, then finishes what it
        holds), then kill its actor."""
        r.state = "stopping"
        try:
            await asyncio.wait_for(r.handle.stop.remote(drain_s), drain_s + 15)
        except Exception:  # noqa: BLE001 - it is going away regardless
            pass
        ray.kill(r.handle, no_restart=True)
        if self.routers.get(r.replica) is r:
            del self.routers[r.replica]

    async def _reconcile_routers(self) -> list[BaseException]:
        """Start the missing replicas below `router_target` and stop those above it, at once;
        returns why each replica that failed to start did."""
        async with self._routers_lock:
            if self.closing:  # shutdown stops them all
                return []
            missing = [i for i in range(self.router_target) if i not in self.routers]
            extra = [r for i, r in self.routers.items() if i >= self.router_target and r.state != "stopping"]
            for r in extra:
                self._event("router", "stopping", f"{r.name} {r.url} pid {r.pid}")
            results = await asyncio.gather(*(self._start_router(i) for i in missing),
                                           *(self._stop_router(r, self.config.drain_timeout_s) for r in extra),
                                           return_exceptions=True)
            for r in extra:
                self._event("router", "stopped", f"{r.name} pid {r.pid}")
            return [exc for exc in results[:len(missing)] if isinstance(exc, BaseException)]

    async def router_handles(self) -> dict[int, object]:
        """The actor handle of each router replica, by replica (operators and tests)."""
        await self._recover()
        return {i: r.handle for i, r in sorted(self.routers.items())}

    async def router_views(self) -> list[dict]:
        """Each router replica's `RouterRecord.view()` with its actor handle under "handle",
        in replica order: how the replicas find each other for /metrics and /dashboard
        (cheap, unlike `status`, which asks every worker)."""
        await self._recover()
        return [{**r.view(), "handle": r.handle} for _, r in sorted(self.routers.items())]

    async def _scale_routers(self) -> list[BaseException]:
        failures = await self._reconcile_routers()
        for exc in failures:
            self._event("router", "start_failed", str(exc)[:200])
        return failures

    def _make_router_sizer(self):
        """The router replicas' sizer, or None when autoscaling is off or their count is fixed
        (`autoscaler.routers.max_replicas` not above `min_replicas`)."""
        spec, bounds = self.config.autoscaler, self.config.router_bounds()
        if bounds is None:
            return None
        from pdserve.cluster.autoscaler import RouterSizer

        return RouterSizer(bounds, spec.routers.cpu_high, spec.routers.cpu_low, spec.cooldown_s)

    async def _autoscale_routers(self) -> None:
        """One router sizing: read each ready replica's CPU, decide (kept in `router_decisions`,
        shown by status), and apply it like an operator's `scale(routers=...)` but unpinned, the
        reason in the event. An operator's pin ("router" in `manual`) holds the count. Errors
        become `autoscale_error` events."""
        try:
            cpu = await self._router_cpu_used()
            current = self.router_target
            decision = self.router_sizer.decide(cpu, current, "router" in self.manual)
        except Exception as exc:  # noqa: BLE001 - keep deciding next interval
            self._event("router", "autoscale_error", str(exc)[:200])
            return
        self.router_decisions.append(decision.as_dict())
        logger.info("router autoscale decision current=%d cpu=%s action=%s: %s", current, decision.cpu,
                    decision.action, decision.reason)
        if decision.action is not None:
            self._retarget_routers(decision.action, manual=False, why=decision.reason)
            self._remember()

    async def _router_cpu_used(self) -> list[float]:
        """The cores each ready replica used since this method last read it; a replica read for
        the first time (new, or a new process) or that does not answer is left out."""
        from pdserve.cluster.autoscaler import cpu_used

        ready = [r for r in self.routers.values() if r.state == "ready"]
        readings = await asyncio.gather(*(asyncio.wait_for(r.handle.cpu_seconds.remote(), 10) for r in ready),
                                        return_exceptions=True)
        previous, self._router_cpu = self._router_cpu, {}
        used = []
        for r, reading in zip(ready, readings, strict=True):
            if isinstance(reading, BaseException):
                continue
            key = (r.replica, r.pid)
            self._router_cpu[key] = reading
            if key in previous:
                used.append(cpu_used(previous[key], reading))
        return used

    def _retarget_routers(self, n: int, manual: bool, why: str = "") -> asyncio.Task:
        """Set the router replica target and start reconciling toward it (the task returns the
        start failures); `manual` (an operator's) pins it against the autoscaler."""
        self.router_target = n
        if manual:
            self.manual.add("router")
        self._event("router", "scale" if manual else "autoscale",
                    f"target {n} replica(s)" + (f": {why}" if why else ""))
        return asyncio.get_running_loop().create_task(self._scale_routers())

    async def _check_routers(self) -> None:
        """Ping every ready replica; replace each dead one alone (the others serve on), and
        start any replica missing below the target (one that failed to start before)."""
        if self._routers_lock.locked():
            return  # replicas are being started or stopped: checked next time
        ready = [r for r in self.routers.values() if r.state == "ready"]
        alive = await asyncio.gather(*(answers_ping(r.handle) for r in ready))
        dead = [r for r, ok in zip(ready, alive, strict=True) if not ok]
        for r in dead:
            self._event("router", "died", f"{r.name} {r.url} pid {r.pid}")
            ray.kill(r.handle, no_restart=True)
            if self.routers.get(r.replica) is r:
                del self.routers[r.replica]
        if not dead and len(self.routers) >= self.router_target:
            return
        failures = await self._reconcile_routers()  # retried at the next check when it fails
        for exc in failures:
            self._event("router", "start_failed", str(exc)[:200])
        for r in dead:
            new = self.routers.get(r.replica)
            if new is not None and new.state == "ready":
                self._event("router", "replaced", f"{new.name} {new.url} pid {new.pid} (was pid {r.pid})")
