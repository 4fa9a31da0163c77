"""Prometheus metrics of the router, prefixed `pdserve_`.

Two kinds of families. Per replica: what one router process saw of the requests it served
(requests, rejections, tokens, TTFT/TPOT/e2e, goodput, open requests, cache-index accuracy,
migrations). Cluster-wide: what every replica reads alike from the workers' Stats and the
controller (the workers' own series, pool and autoscaler gauges, the SLOs). A bare router,
and a deployment's only replica, render both as they are, unlabelled. Once the controller
lists two router replicas or more (cluster.actors.RouterActor), whichever replica answers a
scrape renders every replica's per-replica families, each sample labelled `replica="<i>"`
(never merged: a counter stays monotonic per replica, and the service's total is
`sum without (replica) (...)`), its own cluster-wide families once, and
`pdserve_router_replica_info` / `pdserve_router_replica_up` for each replica (`by_replica`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.router.worker_metrics import WorkerMetrics

if TYPE_CHECKING:
    from pdserve.router.generation import Generation
    from pdserve.router.state import FinishedRequest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
POOLS = ("prefill", "decode")


class WorkerTotals:
    """Counters the workers keep (prefix cache, the second KV tier's hits, prefill
    decisions, KV bytes), summed per pool from their latest Stats when Prometheus scrapes.
    A worker that leaves takes its counts along, which Prometheus reads as a counter reset."""

    def __init__(self, workers) -> None:
        self.workers = workers

    def collect(self):
        queries = CounterMetricFamily("pdserve_prefix_cache_queries", "requests that looked up a prefix cache",
                                      labels=["pool"])
        hits = CounterMetricFamily("pdserve_prefix_cache_hit_tokens", "prompt tokens found in a prefix cache",
                                   labels=["pool"])
        tier_hits = CounterMetricFamily("pdserve_kv_tier_hit_tokens", "prompt tokens loaded from a node's KV tier "
                                        "(apart from prefix_cache_hit_tokens: a worker's own cache)", labels=["pool"])
        decisions = CounterMetricFamily("pdserve_prefill_decisions", "where decode workers had prompts prefilled",
                                        labels=["where", "reason"])
        shipped = CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes prefill workers shipped to decode "
                                      "workers", labels=["pool"])
        worker_hit_rate = GaugeMetricFamily("pdserve_worker_prefix_cache_hit_rate",
                                            "prompt tokens found in the worker's prefix cache / prompt tokens "
                                            "looked up, since the worker started (0 before any)",
                                            labels=["pool", "worker"])
        by_decision: dict[tuple[str, str], int] = {}
        for pool in POOLS:
            stats = [v.stats for v in self.workers.workers(pool, routable=False) if v.stats is not None]
            queries.add_metric([pool], sum(s.prefix_cache_queries for s in stats))
            hits.add_metric([pool], sum(s.prefix_cache_hit_tokens for s in stats))
            tier_hits.add_metric([pool], sum(s.kv_tier_hit_tokens for s in stats))
            shipped.add_metric([pool], sum(s.kv_bytes_sent + s.kv_bytes_received for s in stats))
            for s in stats:
                worker_hit_rate.add_metric([pool, s.worker_id],
                                           s.prefix_cache_hit_tokens / max(1, s.prefix_cache_query_tokens))
                for key, count in s.prefill_decisions.items():
                    where, _, reason = key.partition("/")
                    by_decision[where, reason] = by_decision.get((where, reason), 0) + count
        for (where, reason), count in sorted(by_decision.items()):
            decisions.add_metric([where, reason], count)
        yield from (queries, hits, tier_hits, decisions, shipped, worker_hit_rate)


@dataclass(frozen=True)
class Replica:
    """One router replica as another sees it: its view (replica number, address, pid, state)
    and, when it answered in time, its per-replica families (`RouterMetrics.replica_families`)
    and the requests it finished in the window asked for (the dashboard's charts)."""

    replica: int
    address: str
    pid: int
    state: str
    families: list[Metric] | None = None  # None: it did not answer
    finished: list[FinishedRequest] = field(default_factory=list)


class _Families:
    """Families already collected, as `generate_latest` reads a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def by_replica(replicas: list[Replica]) -> list[Metric]:
    """Every answering replica's families merged into one family per name, each sample
    labelled `replica="<i>"`; then `pdserve_router_replica_info{replica,address,pid,state}` 1
    and `pdserve_router_replica_up{replica}` (1: its series are here, 0: it did not answer)
    for each replica given."""
    merged: dict[str, Metric] = {}
    for r in replicas:
        for family in r.families or ():
            out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            out.samples += [s._replace(labels={"replica": str(r.replica), **s.labels}) for s in family.samples]
    info = GaugeMetricFamily("pdserve_router_replica_info", "each router replica the controller lists",
                             labels=["replica", "address", "pid", "state"])
    up = GaugeMetricFamily("pdserve_router_replica_up", "1: the router replica's series are in this scrape, 0: it "
                           "did not answer the replica that served the scrape in time", labels=["replica"])
    for r in replicas:
        info.add_metric([str(r.replica), r.address, str(r.pid), r.state], 1)
        up.add_metric([str(r.replica)], int(r.families is not None))
    return [*merged.values(), info, up]


class RouterMetrics:
    def __init__(self, registry, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None) -> None:
        """With both SLOs, also export them and the goodput (requests that met both).
        `self.registry` holds every family; `self.own` the per-replica ones, `self.cluster`
        the cluster-wide ones (the module's docstring)."""
        self.workers = registry
        self.own, self.cluster = CollectorRegistry(), CollectorRegistry()
        self.registry = CollectorRegistry()
        self.registry.register(self.own)
        self.registry.register(self.cluster)
        r, c = self.own, self.cluster
        self.slo = (ttft_slo_s, tpot_slo_s) if ttft_slo_s and tpot_slo_s else None
        if self.slo:
            Gauge("pdserve_slo_ttft_seconds", "the TTFT SLO", registry=c).set(ttft_slo_s)
            Gauge("pdserve_slo_tpot_seconds", "the TPOT SLO", registry=c).set(tpot_slo_s)
            self.goodput = Counter("pdserve_goodput_requests", "finished requests (stop or length) that met both "
                                   "SLOs (TPOT: when they had two tokens or more)", registry=r)
        c.register(WorkerTotals(registry))
        c.register(WorkerMetrics(registry))
        self.requests = Counter("pdserve_requests", "finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("pdserve_rejected_requests", "requests refused by admission control", registry=r)
        self.inflight = Gauge("pdserve_inflight_requests", "requests open in the router", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.expected_cached = Counter("pdserve_router_expected_cached_tokens", "prompt tokens the router's cache "
                                       "index expected the prefilling worker to have cached", registry=r)
        self.actual_cached = Counter("pdserve_router_actual_cached_tokens", "prompt tokens the prefilling worker "
                                     "found cached (compare with the expected: the index's accuracy)", registry=r)
        self.cached_tokens = {"expected": 0, "actual": 0}  # the two counters above, readable
        self.migrations = Counter("pdserve_migrations", "decode legs resumed on another decode worker after "
                                  "failing mid-stream, by why the leg failed", ["reason"], registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pdserve_pool_queue_depth", "waiting requests per pool", ["pool"], registry=c)
        self.queued_tokens = Gauge("pdserve_pool_queued_prefill_tokens", "prompt tokens not yet computed",
                                   ["pool"], registry=c)
        self.kv_usage = Gauge("pdserve_pool_kv_usage", "fraction of KV blocks in use", ["pool"], registry=c)
        self.pool_workers = Gauge("pdserve_pool_workers", "routable workers per pool", ["pool"], registry=c)
        self.autoscaler_target = Gauge("pdserve_autoscaler_target_replicas", "pool size the controller keeps",
                                       ["pool"], registry=c)
        self.autoscaler_desired = Gauge("pdserve_autoscaler_desired_replicas", "pool size the last plan wanted",
                                        ["pool"], registry=c)
        self.autoscaler_correction = Gauge("pdserve_autoscaler_correction", "observed/predicted latency factor",
                                           ["pool"], registry=c)
        self.autoscaler_decisions = Gauge("pdserve_autoscaler_decisions", "autoscaler decisions so far", registry=c)
        self.pool_target = Gauge("pdserve_pool_target_workers", "workers the controller keeps in each pool",
                                 ["pool"], registry=c)
        self.pool_pending = Gauge("pdserve_pool_pending_workers",
                                  "workers of each pool waiting for a node with room (the pool is short)",
                                  ["pool"], registry=c)

    def set_pools(self, summary: dict) -> None:
        for pool in POOLS:
            self.pool_target.labels(pool).set(summary[pool]["target"])
            self.pool_pending.labels(pool).set(summary[pool]["pending"])

    def set_autoscaler(self, summary: dict) -> None:
        self.autoscaler_decisions.set(summary["decisions"])
        for pool in POOLS:
            self.autoscaler_target.labels(pool).set(summary["targets"][pool])
            self.autoscaler_desired.labels(pool).set(summary["desired"][pool])
            self.autoscaler_correction.labels(pool).set(summary["correction"][pool])

    def observe(self, generation: Generation, end: float) -> None:
        """Record a finished request; `end` is when it finished (perf_counter)."""
        result = generation.result
        self.requests.labels(result.finish_reason or "error").inc()
        self.prompt_tokens.inc(len(generation.prompt_ids))
        self.generation_tokens.inc(result.num_completion_tokens)
        self.e2e.observe(end - generation.started)
        if result.first_token_at is not None:
            self.ttft.observe(result.first_token_at - generation.started)
            self.expected_cached.inc(result.expected_cached_tokens)
            self.actual_cached.inc(result.num_cached_tokens)
            self.cached_tokens["expected"] += result.expected_cached_tokens
            self.cached_tokens["actual"] += result.num_cached_tokens
        tpot = result.tpot_s(end)
        if tpot is not None:
            self.tpot.observe(tpot)
        if self.slo and result.finish_reason in ("stop", "length") and result.first_token_at is not None:
            ttft_slo, tpot_slo = self.slo
            if result.first_token_at - generation.started <= ttft_slo and (tpot is None or tpot <= tpot_slo):
                self.goodput.inc()

    def replica_families(self) -> list[Metric]:
        """This replica's per-replica families, collected now (what `Replica.families` holds)."""
        return list(self.own.collect())

    def render(self, replicas: list[Replica] | None = None) -> tuple[bytes, str]:
        """The exposition and its content type. Without `replicas` (a bare router), or with
        this replica alone, every family as it is; with two or more (every router replica,
        this one included) `by_replica`'s families, then this replica's cluster-wide ones."""
        for pool in POOLS:
            views = self.workers.workers(pool, routable=False)
            stats = [v.stats for v in views if v.stats is not None]
            self.pool_workers.labels(pool).set(sum(v.routable for v in views))
            self.queue_depth.labels(pool).set(sum(s.num_waiting for s in stats))
            self.queued_tokens.labels(pool).set(sum(s.queued_prefill_tokens for s in stats))
            total = sum(s.num_total_blocks for s in stats)
            self.kv_usage.labels(pool).set(1 - sum(s.num_free_blocks for s in stats) / total if total else 0)
        if replicas is None or len(replicas) < 2:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return generate_latest(_Families([*by_replica(replicas), *self.cluster.collect()])), CONTENT_TYPE_LATEST
