"""The live dashboard: `GET /dashboard`, one static page (router/static/dashboard.html, charts
drawn as SVG by hand, no build step) that polls `GET /dashboard/data` every few seconds.

The data come from what `/metrics` exports, read the same way (the registry's workers and
their latest Stats, the metrics' counters), so the two agree; the finished-request log gives
the TTFT/TPOT percentiles, rate and goodput over the last minutes; the controller (when the
router has one) adds pool targets, starting workers, the autoscaler's decisions, the SLOs
and the events. The page works without a controller, without those parts. Its scale and
drain buttons call /admin/scale and /admin/drain with the admin token the operator types in.

Among router replicas (the app's `replicas` hook, router.app.build_app) whichever replica
serves the page shows them all: the request totals and open requests are summed over the
replicas that answered, the latency and rate charts pool their finished requests, and
`routers` (the "Router replicas" table) lists each replica with its own counts. A bare router
lists itself alone.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from pdserve.engine import stats
from pdserve.router.metrics import POOLS, Replica

if TYPE_CHECKING:
    from pdserve.router.state import FinishedRequest, Router

PAGE = Path(__file__).parent / "static" / "dashboard.html"
WINDOW_S = 300.0  # the charts' span
BUCKET_S = 10.0  # one chart point
PERCENTILES = (50, 90, 99)
CONTROLLER_TIMEOUT_S = 3.0
CLUSTER_CACHE_S = 1.0


class TransferRates:
    """KV transfer bandwidth (bytes/s), from each worker's kv_bytes_sent/received counters
    sampled over time: the sum of per-worker increases over the time between samples (a
    worker that leaves or restarts contributes nothing for that interval)."""

    def __init__(self, keep: int = int(WINDOW_S), min_interval_s: float = 1.0) -> None:
        self.points: deque[tuple[float, float, float]] = deque(maxlen=keep)  # (when, sent/s, received/s)
        self.min_interval_s = min_interval_s
        self._last: dict[str, tuple[int, int]] = {}
        self._last_at: float | None = None

    def sample(self, views, now: float) -> None:
        if self._last_at is not None and now - self._last_at < self.min_interval_s:
            return
        counters = {v.worker_id: (v.stats.kv_bytes_sent, v.stats.kv_bytes_received)
                    for v in views if v.stats is not None}
        if self._last_at is not None:
            sent = received = 0
            for worker_id, (now_sent, now_received) in counters.items():
                before_sent, before_received = self._last.get(worker_id, (now_sent, now_received))
                sent += max(0, now_sent - before_sent)
                received += max(0, now_received - before_received)
            elapsed = now - self._last_at
            self.points.append((now, sent / elapsed, received / elapsed))
        self._last, self._last_at = counters, now


def _sample_sum(families, name: str) -> float:
    """The samples called `name` (e.g. `pdserve_requests_total`) summed over their labels."""
    return sum(s.value for family in families for s in family.samples if s.name == name)


def local_replica(router: Router) -> Replica:
    """A bare router as the one replica there is (no address: it has no controller's view)."""
    return Replica(0, "", os.getpid(), "ready", router.metrics.replica_families(), list(router.finished))


def routers_view(replicas: list[Replica]) -> list[dict]:
    """Each replica's row: its view, whether it answered, and (when it did) its open and
    finished requests as its `pdserve_inflight_requests` and `pdserve_requests_total`."""
    rows = []
    for r in replicas:
        answered = r.families is not None
        rows.append({"replica": r.replica, "address": r.address, "pid": r.pid, "state": r.state, "answered": answered,
                     "open_requests": int(_sample_sum(r.families, "pdserve_inflight_requests")) if answered else None,
                     "requests_total": int(_sample_sum(r.families, "pdserve_requests_total")) if answered else None})
    return rows


def _worker(view) -> dict:
    s = view.stats
    row = {"worker_id": view.worker_id, "role": view.role, "address": view.address, "node": view.node,
           "state": view.state, "routable": view.routable, "open_requests": view.open_requests}
    if s is None:
        return row
    return {**row, "running": s.num_running, "waiting": s.num_waiting + s.num_waiting_for_kv,
            "finished": s.num_finished, "kv_usage": 1 - s.num_free_blocks / s.num_total_blocks
            if s.num_total_blocks else 0.0,
            # as pdserve_worker_prefix_cache_hit_rate
            "hit_rate": s.prefix_cache_hit_tokens / max(1, s.prefix_cache_query_tokens),
            "kv_bytes_sent": s.kv_bytes_sent, "kv_bytes_received": s.kv_bytes_received}


def pools_view(registry, cluster: dict | None) -> dict:
    """Per pool, what /metrics exports (routable workers, queue depth, KV usage: the same
    sums) and each worker; with a controller, the target and workers still starting."""
    out = {}
    for pool in POOLS:
        views = registry.workers(pool, routable=False)
        s = [v.stats for v in views if v.stats is not None]
        total = sum(x.num_total_blocks for x in s)
        workers = [_worker(v) for v in views]
        target = None
        if cluster is not None:
            known = {w["worker_id"] for w in workers}
            target = cluster["pools"][pool]["target"]
            workers += [{"worker_id": w["worker_id"], "role": pool, "address": w["address"], "node": w.get("node", ""),
                         "state": w["state"], "routable": False} for w in cluster["pools"][pool]["workers"]
                        if w["worker_id"] not in known]
        out[pool] = {"workers_routable": sum(v.routable for v in views), "target": target,
                     "queue_depth": sum(x.num_waiting for x in s),
                     "kv_usage": 1 - sum(x.num_free_blocks for x in s) / total if total else 0.0,
                     "workers": workers}
    return out


def latency_view(finished: Iterable[FinishedRequest], slo: dict | None, now: float, window_s: float = WINDOW_S,
                 bucket_s: float = BUCKET_S) -> dict:
    """TTFT/TPOT percentiles, request rate and goodput (requests/s that met both SLOs) of
    the requests that finished in the last `window_s`, overall and per `bucket_s` (x: seconds
    before now, at the bucket's end)."""
    recent = [r for r in finished if now - r.end <= window_s]

    def met(r: FinishedRequest) -> bool:
        return r.ttft_s <= slo["ttft_s"] and (r.tpot_s is None or r.tpot_s <= slo["tpot_s"])

    def summary(rows: list[FinishedRequest], span_s: float) -> dict:
        ttft = [r.ttft_s for r in rows]
        tpot = [r.tpot_s for r in rows if r.tpot_s is not None]
        return {"count": len(rows), "rate": len(rows) / span_s,
                "goodput": sum(map(met, rows)) / span_s if slo else None,
                **{f"ttft_p{q}": stats.percentile(ttft, q) for q in PERCENTILES},
                **{f"tpot_p{q}": stats.percentile(tpot, q) for q in PERCENTILES}}

    series = []
    for i in range(int(window_s // bucket_s)):
        start, end = window_s - (i + 1) * bucket_s, window_s - i * bucket_s  # seconds ago
        rows = [r for r in recent if start <= now - r.end < end]
        series.append({"ago_s": start, **summary(rows, bucket_s)})
    return {"window_s": window_s, "bucket_s": bucket_s, "overall": summary(recent, window_s), "series": series}


async def cluster_view(controller: Any) -> dict | None:
    """The controller's status, or None without one (a bare router) or when it does not answer."""
    if controller is None:
        return None
    try:
        return await asyncio.wait_for(controller.status.remote(), CONTROLLER_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - shown as "controller unavailable"
        return None


class CachedClusterStatus:
    """The controller's status, asked of it at most once per `CLUSTER_CACHE_S` however many
    pages poll; None without a controller or when it did not answer."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self.fetched_at = float("-inf")  # time.monotonic()
        self.status: dict | None = None

    async def get(self) -> dict | None:
        if time.monotonic() - self.fetched_at >= CLUSTER_CACHE_S:
            self.fetched_at, self.status = time.monotonic(), await cluster_view(self.controller)
        return self.status


def dashboard_data(router: Router, cluster: dict | None, rates: TransferRates, replicas: list[Replica]) -> dict:
    """The page's data; `replicas`: every router replica (`local_replica` for a bare router)."""
    now = time.monotonic()
    views = [v for pool in POOLS for v in router.registry.workers(pool, routable=False)]
    rates.sample(views, now)
    auto = (cluster or {}).get("autoscaler") or {}
    slo = auto.get("slo")
    answered = [r for r in replicas if r.families is not None]
    families = [f for r in answered for f in r.families]
    return {
        "time": time.time(), "model": router.config.served_model_name, "routing": router.policy.name,
        "has_controller": router.controller is not None, "controller_ok": cluster is not None,
        "requests_total": _sample_sum(families, "pdserve_requests_total"),
        "rejected_total": _sample_sum(families, "pdserve_rejected_requests_total"),
        "generation_tokens_total": _sample_sum(families, "pdserve_generation_tokens_total"),
        "inflight": int(_sample_sum(families, "pdserve_inflight_requests")), "routers": routers_view(replicas),
        "pools": pools_view(router.registry, cluster), "slo": slo,
        "latency": latency_view((f for r in answered for f in r.finished), slo, now),
        "transfer": [{"ago_s": now - t, "sent_bps": sent, "received_bps": received}
                     for t, sent, received in rates.points if now - t <= WINDOW_S],
        "autoscaler": {"enabled": auto.get("enabled", False), "overridden": auto.get("overridden", []),
                       "decisions": auto.get("decisions", [])},
        "events": (cluster or {}).get("events", [])[-20:],
    }


def install_dashboard(app: FastAPI, router: Router) -> None:
    rates = TransferRates()
    cluster = CachedClusterStatus(router.controller)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return HTMLResponse(PAGE.read_text())

    @app.get("/dashboard/data")
    async def dashboard_json():
        hook = app.state.replicas
        replicas = await hook(WINDOW_S) if hook else [local_replica(router)]
        return dashboard_data(router, await cluster.get(), rates, replicas)
