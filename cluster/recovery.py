"""What lets the controller die without taking the service with it: the record it keeps of
each worker, and, after Ray restarted it, re-adopting the running workers and the router
from what they report (`Recovery`, mixed into `cluster.controller.Controller`).

Workers and the router are detached, named actors, so they outlive the controller. The
router also keeps the controller's decisions (pool targets, operator pins) through
`remember`/`recall`, so a restarted controller resumes them instead of the config's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray

NAMESPACE = "pdserve"
WORKER_PREFIX = "pdserve-worker-"
ROUTER_NAME = "pdserve-router"
ROLES = ("prefill", "decode")


@dataclass
class WorkerRecord:
    role: str
    handle: object
    key: int
    name: str = ""  # the actor's name (WORKER_PREFIX...), by which a restarted controller finds it
    worker_id: str = ""
    address: str = ""
    state: str = "starting"
    pid: int = 0  # the worker's process (on its node), once started
    dtype: str = ""  # weights and KV, as the worker resolved `auto`
    num_threads: int = 0  # torch threads the worker runs its engine on
    node_ip: str = ""  # the Ray node it runs on
    node_id: str = ""
    started_at: float = field(default_factory=time.time)

    def member(self) -> dict:
        return {"role": self.role, "worker_id": self.worker_id, "address": self.address, "state": self.state,
                "node": self.node_ip}

    def learn(self, info: dict) -> None:
        """Take what the worker reported (its start() answer, or info())."""
        self.worker_id, self.address, self.pid = info["worker_id"], info["address"], info["pid"]
        self.dtype, self.num_threads = info["dtype"], info["num_threads"]
        self.node_ip, self.node_id = info.get("node_ip", ""), info.get("node_id", "")


class Recovery:
    """Re-adoption after a restart. Uses the controller's `workers`, `targets`, `manual`,
    `router`, `router_url`, `_keys`, `_restarted` and `_adoption`, and its `_event`,
    `_reconcile`, `_start_router`, `_start_loops`, `_drain` and `_forget`."""

    async def _recover(self) -> None:
        """After a restart, adopt the running workers and router once (every call awaits it)."""
        if not self._restarted:
            return
        if self._adoption is None:
            self._adoption = asyncio.get_running_loop().create_task(self._adopt())
        await asyncio.shield(self._adoption)

    async def _adopt(self) -> None:
        try:
            self.router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
            self.router_url = await asyncio.wait_for(self.router.get_url.remote(), 10)
            memo = await asyncio.wait_for(self.router.recall.remote(), 10)
        except Exception:  # noqa: BLE001 - no live router: the health loop starts one
            self.router, memo = None, {}
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == NAMESPACE and a["name"].startswith(WORKER_PREFIX)]
        adopted = await asyncio.gather(*(self._adopt_worker(name) for name in names))
        counts = {role: sum(1 for w in adopted if w is not None and w.role == role) for role in ROLES}
        self.targets.update(memo.get("targets") or counts)
        self.manual = set(memo.get("manual", ()))
        self._event("cluster", "controller_restarted",
                    f"re-adopted {counts['prefill']} prefill + {counts['decode']} decode worker(s)"
                    f"{' and the router' if self.router is not None else ''}; targets {self.targets}")
        if self.router is None:
            await self._start_router()
        self._reconcile()
        self._start_loops()

    async def _adopt_worker(self, name: str) -> WorkerRecord | None:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await asyncio.wait_for(handle.info.remote(), 10)
        except Exception:  # noqa: BLE001 - dead or hung: not adopted (killed if it still exists)
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            return None
        record = WorkerRecord(info["role"], handle, next(self._keys), name=name)
        if info["state"] == "starting":  # its start() is still running: wait for it there
            self.workers[record.key] = record
            asyncio.get_running_loop().create_task(self._await_adopted_start(record))
            return record
        record.learn(info)
        record.state = info["state"]
        self.workers[record.key] = record
        if record.state == "draining":
            asyncio.get_running_loop().create_task(self._drain(record))
        return record

    async def _await_adopted_start(self, w: WorkerRecord, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and w.state == "starting":
            try:
                info = await asyncio.wait_for(w.handle.info.remote(), 10)
            except Exception:  # noqa: BLE001 - died while starting
                break
            if info["state"] != "starting":
                w.learn(info)
                w.state = "ready"
                self._event(w.role, "ready", w.address, w)
                return
            await asyncio.sleep(0.5)
        if w.state == "starting":
            await self._forget(w, "dead")
            self._reconcile()

    def _remember(self) -> None:
        """Keep targets and pins with the router, which outlives this actor."""
        if self.router is not None:
            self.router.remember.remote({"targets": dict(self.targets), "manual": sorted(self.manual)})
