"""What lets the controller die without taking the service with it: the record it keeps of
each worker and router replica, and, after Ray restarted it, re-adopting the running workers
and router replicas from what they report (`Recovery`, mixed into
`cluster.controller.Controller`).

Workers and router replicas are detached, named actors, so they outlive the controller.
Every router replica also keeps the controller's decisions (pool targets, operator pins, the
number of router replicas) through `remember`/`recall`, so a restarted controller resumes
them instead of the config's."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import ray

NAMESPACE = "pdserve"
CONTROLLER_NAME = "pdserve-controller"
# The controller and the router live on the head node (with the GCS): a worker node's loss
# must never take them, and Ray can pin an actor there by the head's own resource. Router
# replicas that `router.resources` places elsewhere are replaced by the health loop instead.
ON_HEAD = {"node:__internal_head__": 0.001}
WORKER_PREFIX = "pdserve-worker-"
ROUTER_NAME = "pdserve-router"
ROLES = ("prefill", "decode")


async def answers_ping(handle, timeout_s: float = 5.0) -> bool:
    """Whether a worker's or router replica's actor answers its `ping` (True) in time: False
    when it is dead, hung or unhealthy."""
    try:
        return bool(await asyncio.wait_for(handle.ping.remote(), timeout_s))
    except Exception:  # noqa: BLE001 - dead or hung
        return False


def router_name(replica: int) -> str:
    """The actor name of router replica `replica`: replica 0 keeps ROUTER_NAME."""
    return ROUTER_NAME if replica == 0 else f"{ROUTER_NAME}-{replica}"


def router_replica(name: str) -> int | None:
    """The replica an actor name is of (`router_name`'s inverse), None for other actors."""
    if name == ROUTER_NAME:
        return 0
    number = name.removeprefix(f"{ROUTER_NAME}-")
    return int(number) if number != name and number.isdigit() else None


@dataclass
class RouterRecord:
    """One router replica: a detached actor named `router_name(replica)`, on the head node or
    on a node offering `router.resources`."""

    replica: int
    handle: object
    url: str = ""
    pid: int = 0
    state: str = "starting"  # starting, ready, stopping
    node_ip: str = ""  # the Ray node it runs on

    @property
    def name(self) -> str:
        return router_name(self.replica)

    def view(self) -> dict:
        return {"replica": self.replica, "name": self.name, "address": self.url, "pid": self.pid,
                "node": self.node_ip, "state": self.state}

    def learn(self, info: dict) -> None:
        """Take what the serving replica reported (RouterActor.info): it is ready."""
        self.url, self.pid, self.node_ip, self.state = info["url"], info["pid"], info["node_ip"], "ready"


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
    `routers`, `router_target`, `router_url`, `_keys`, `_restarted` and `_adoption`, and its
    `_event`, `_reconcile`, `_reconcile_routers`, `_start_loops`, `_drain` and `_forget`."""

    async def _recover(self) -> None:
        """After a restart, adopt the running workers and router once (every call awaits it)."""
        if not self._restarted:
            return
        if self._adoption is None:
            self._adoption = asyncio.get_running_loop().create_task(self._adopt())
        await asyncio.shield(self._adoption)

    async def _adopt(self) -> None:
        named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
        routers = await asyncio.gather(*(self._adopt_router(router_replica(name)) for name in named
                                         if router_replica(name) is not None))
        memos = [memo for _, memo in sorted((r.replica, memo) for r, memo in routers if r is not None) if memo]
        memo = memos[0] if memos else {}  # every replica keeps the same memo: any will do
        names = [name for name in named if name.startswith(WORKER_PREFIX)]
        adopted = await asyncio.gather(*(self._adopt_worker(name) for name in names))
        counts = {role: sum(1 for w in adopted if w is not None and w.role == role) for role in ROLES}
        self.targets.update(memo.get("targets") or counts)
        self.manual = set(memo.get("manual", ()))
        self.router_target = memo.get("routers") or len(self.routers) or self.router_target
        self._event("cluster", "controller_restarted",
                    f"re-adopted {counts['prefill']} prefill + {counts['decode']} decode worker(s) and "
                    f"{len(self.routers)} router replica(s); targets {self.targets}, {self.router_target} router(s)")
        for exc in await self._reconcile_routers():
            self._event("router", "start_failed", str(exc)[:200])
        self._reconcile()
        self._start_loops()

    async def _adopt_router(self, replica: int) -> tuple[RouterRecord | None, dict]:
        """Adopt a live, serving router replica and recall the memo it keeps; one that does
        not answer, or was stopping, is killed (reconcile starts a new one if it is wanted)."""
        name = router_name(replica)
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await asyncio.wait_for(handle.info.remote(), 10)
            memo = await asyncio.wait_for(handle.recall.remote(), 10)
            if info["state"] != "ready" or not await asyncio.wait_for(handle.ping.remote(), 10):
                raise RuntimeError(f"router replica {replica} is {info['state']}")
        except Exception:  # noqa: BLE001 - dead, hung or half-started: not adopted
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            return None, {}
        record = RouterRecord(replica, handle)
        record.learn(info)
        self.routers[replica] = record
        self._take_router_url(record)
        return record, memo

    def _take_router_url(self, r: RouterRecord) -> None:
        """`router_url` (what `pdserve up` prints) is replica 0's URL; another replica's only
        until replica 0 reports (replicas on several nodes each have their own: status lists all)."""
        if r.replica == 0 or not self.router_url:
            self.router_url = r.url

    async def _adopt_worker(self, name: str) -> WorkerRecord | None:
        """Adopt a running worker (one still starting: once its start() returns); a dead,
        hung or `unstarted` one (its creator died before starting it: nothing ever will) is
        killed and not adopted, and reconcile starts one in its place if the pool wants it."""
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            info = await asyncio.wait_for(handle.info.remote(), 10)
            if info["state"] == "unstarted":
                raise RuntimeError(f"worker {name} was never started")
        except Exception:  # noqa: BLE001 - dead, hung or unstarted: not adopted (killed if it still exists)
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
            if info["state"] == "unstarted":  # its start() failed
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
        """Keep targets, pins and the router replica count with every router replica, which
        outlive this actor (a restarted controller recalls them from any)."""
        memo = {"targets": dict(self.targets), "manual": sorted(self.manual), "routers": self.router_target}
        for r in list(self.routers.values()):
            r.handle.remember.remote(memo)
