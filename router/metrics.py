"""Prometheus metrics of the router, prefixed `pdserve_`."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, registry) -> None:
        self.workers = registry
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("pdserve_rejected_requests", "requests refused by admission control", registry=r)
        self.inflight = Gauge("pdserve_inflight_requests", "requests open in the router", registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_seconds", "request latency", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("pdserve_pool_queue_depth", "waiting requests per pool", ["pool"], registry=r)
        self.queued_tokens = Gauge("pdserve_pool_queued_prefill_tokens", "prompt tokens not yet computed",
                                   ["pool"], registry=r)
        self.kv_usage = Gauge("pdserve_pool_kv_usage", "fraction of KV blocks in use", ["pool"], registry=r)
        self.pool_workers = Gauge("pdserve_pool_workers", "routable workers per pool", ["pool"], registry=r)
        self.autoscaler_target = Gauge("pdserve_autoscaler_target_replicas", "pool size the controller keeps",
                                       ["pool"], registry=r)
        self.autoscaler_desired = Gauge("pdserve_autoscaler_desired_replicas", "pool size the last plan wanted",
                                        ["pool"], registry=r)
        self.autoscaler_correction = Gauge("pdserve_autoscaler_correction", "observed/predicted latency factor",
                                           ["pool"], registry=r)
        self.autoscaler_decisions = Gauge("pdserve_autoscaler_decisions", "autoscaler decisions so far", registry=r)

    def set_autoscaler(self, summary: dict) -> None:
        self.autoscaler_decisions.set(summary["decisions"])
        for pool in ("prefill", "decode"):
            self.autoscaler_target.labels(pool).set(summary["targets"][pool])
            self.autoscaler_desired.labels(pool).set(summary["desired"][pool])
            self.autoscaler_correction.labels(pool).set(summary["correction"][pool])

    def observe(self, generation, end: float) -> None:
        """Record a finished request; `end` is when it finished (perf_counter)."""
        result = generation.result
        self.requests.labels(result.finish_reason or "error").inc()
        self.prompt_tokens.inc(len(generation.prompt_ids))
        self.generation_tokens.inc(result.num_completion_tokens)
        self.e2e.observe(end - generation.started)
        if result.first_token_at is not None:
            self.ttft.observe(result.first_token_at - generation.started)
        tpot = result.tpot_s(end)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self) -> tuple[bytes, str]:
        for pool in ("prefill", "decode"):
            views = self.workers.workers(pool, routable=False)
            stats = [v.stats for v in views if v.stats is not None]
            self.pool_workers.labels(pool).set(sum(v.routable for v in views))
            self.queue_depth.labels(pool).set(sum(s.num_waiting for s in stats))
            self.queued_tokens.labels(pool).set(sum(s.queued_prefill_tokens for s in stats))
            total = sum(s.num_total_blocks for s in stats)
            self.kv_usage.labels(pool).set(1 - sum(s.num_free_blocks for s in stats) / total if total else 0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
