"""Each worker's own metrics, from its latest Stats (worker_base.telemetry says why the
workers report through the router rather than serve Prometheus themselves). Labelled
`pool` and `worker`; a worker that leaves takes its series along.

    pdserve_worker_running / _waiting                       requests, by the worker's count
    pdserve_worker_kv_blocks{state=used|cached|free}        its KV cache
    pdserve_worker_preemptions_total                        requests preempted (recomputed)
    pdserve_worker_prefill_tokens_computed_total            prompt positions computed
    pdserve_worker_decode_tokens_computed_total             generated positions computed
    pdserve_worker_prefix_cache_hit_tokens_total            prompt tokens found cached
    pdserve_worker_prefix_cache_query_tokens_total          prompt tokens looked up
    pdserve_worker_kv_tier_hit_tokens_total                 prompt tokens loaded from the node's KV tier
    pdserve_worker_kv_tier_decisions_total{reason}          requests whose next blocks the tier held, by
                                                            what was done (load | recompute: slower | load failed)
    pdserve_worker_kv_tier_blocks_written_total             blocks the worker wrote through to the tier
    pdserve_worker_kv_tier_bytes / _blocks                  what the node's tier holds, as the worker reads it
    pdserve_worker_kv_tier_read_bandwidth_bytes_per_second  what the worker's tier reads measured
    pdserve_worker_kv_tier_state{state}                     1 for on, read-only or off (its store degraded)
    pdserve_worker_kv_tier_problems_total{kind}             write_errors, corrupt blocks, dropped puts
    pdserve_worker_step_seconds (histogram)                 each engine step's wall time
    pdserve_worker_batch_size (histogram)                   sequences per engine step
    pdserve_kv_transfer_worker_bytes_total{transport,direction}
    pdserve_kv_transfer_seconds (histogram){transport,direction}   first piece to last
    pdserve_kv_transfer_bandwidth_bytes_per_second{transport,direction}  bytes / seconds, mean
    pdserve_kv_transfer_failures_total{transport,direction,reason}

The kv_tier series are there for workers with the second KV tier on (engine.kv_tier) only.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve.protos import pdserve_pb2 as pb

POOLS = ("prefill", "decode")
_WORKER = ["pool", "worker"]
_TRANSFER = [*_WORKER, "transport", "direction"]


def _buckets(histogram: pb.Histogram) -> list[tuple[str, float]]:
    """Prometheus' cumulative (upper bound, count) pairs, +Inf last."""
    if not histogram.counts:
        return [("+Inf", 0)]
    out, running = [], 0
    bounds = [*(f"{b:g}" for b in histogram.bounds), "+Inf"]
    for bound, count in zip(bounds, histogram.counts, strict=False):
        running += count
        out.append((bound, running))
    return out


class WorkerMetrics:
    """A prometheus_client collector over the registry's workers' latest Stats."""

    def __init__(self, workers) -> None:
        self.workers = workers

    def collect(self):
        gauges = {name: GaugeMetricFamily(f"pdserve_worker_{name}", text, labels=_WORKER)
                  for name, text in (("running", "requests running on the worker"),
                                     ("waiting", "requests waiting on the worker"))}
        blocks = GaugeMetricFamily("pdserve_worker_kv_blocks", "the worker's KV blocks by state",
                                   labels=[*_WORKER, "state"])
        counters = {name: CounterMetricFamily(f"pdserve_worker_{name}", text, labels=_WORKER)
                    for name, text in (("preemptions", "requests preempted (their KV freed, recomputed later)"),
                                       ("prefill_tokens_computed", "prompt positions computed"),
                                       ("decode_tokens_computed", "generated tokens' positions computed"),
                                       ("prefix_cache_hit_tokens", "prompt tokens found in the prefix cache"),
                                       ("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache"))}
        steps = HistogramMetricFamily("pdserve_worker_step_seconds", "engine step wall time", labels=_WORKER)
        batch = HistogramMetricFamily("pdserve_worker_batch_size", "sequences per engine step", labels=_WORKER)
        moved = CounterMetricFamily("pdserve_kv_transfer_worker_bytes", "KV bytes moved", labels=_TRANSFER)
        seconds = HistogramMetricFamily("pdserve_kv_transfer_seconds", "seconds per KV transfer, first piece to "
                                        "last", labels=_TRANSFER)
        bandwidth = GaugeMetricFamily("pdserve_kv_transfer_bandwidth_bytes_per_second", "KV bytes moved per "
                                      "second of transfer, over the worker's transfers", labels=_TRANSFER)
        failures = CounterMetricFamily("pdserve_kv_transfer_failures", "KV transfers that failed, by reason",
                                       labels=[*_TRANSFER, "reason"])
        tier = _TierFamilies()
        for pool in POOLS:
            for view in self.workers.workers(pool, routable=False):
                s = view.stats
                if s is None:
                    continue
                labels = [pool, s.worker_id]
                gauges["running"].add_metric(labels, s.num_running)
                gauges["waiting"].add_metric(labels, s.num_waiting)
                free, cached = s.num_free_blocks, min(s.num_cached_blocks, s.num_free_blocks)
                blocks.add_metric([*labels, "used"], s.num_total_blocks - free)
                blocks.add_metric([*labels, "cached"], cached)  # free, but holding reusable content
                blocks.add_metric([*labels, "free"], free - cached)
                counters["preemptions"].add_metric(labels, s.num_preemptions)
                counters["prefill_tokens_computed"].add_metric(labels, s.prefill_tokens_computed)
                counters["decode_tokens_computed"].add_metric(labels, s.decode_tokens_computed)
                counters["prefix_cache_hit_tokens"].add_metric(labels, s.prefix_cache_hit_tokens)
                counters["prefix_cache_query_tokens"].add_metric(labels, s.prefix_cache_query_tokens)
                steps.add_metric(labels, _buckets(s.step_seconds), s.step_seconds.sum)
                batch.add_metric(labels, _buckets(s.batch_size), s.batch_size.sum)
                if s.kv_tier_store:  # the tier is on
                    tier.add(labels, s)
                for t in s.transfers:
                    key = [*labels, t.transport, t.direction]
                    moved.add_metric(key, t.bytes)
                    seconds.add_metric(key, _buckets(t.seconds), t.seconds.sum)
                    bandwidth.add_metric(key, t.bytes / t.seconds.sum if t.seconds.sum else 0.0)
                    for reason, count in sorted(t.failures.items()):
                        failures.add_metric([*key, reason], count)
        yield from (*gauges.values(), blocks, *counters.values(), steps, batch, moved, seconds, bandwidth, failures,
                    *tier.families())


class _TierFamilies:
    """The workers' second-KV-tier series (the module's docstring)."""

    def __init__(self) -> None:
        self.hits = CounterMetricFamily("pdserve_worker_kv_tier_hit_tokens", "prompt tokens loaded from the node's "
                                        "KV tier (the worker's own cache's: prefix_cache_hit_tokens)", labels=_WORKER)
        self.decisions = CounterMetricFamily("pdserve_worker_kv_tier_decisions", "requests whose next blocks the KV "
                                             "tier held, by what was done", labels=[*_WORKER, "reason"])
        self.written = CounterMetricFamily("pdserve_worker_kv_tier_blocks_written", "blocks the worker wrote "
                                           "through to the KV tier", labels=_WORKER)
        self.bytes = GaugeMetricFamily("pdserve_worker_kv_tier_bytes", "bytes the node's KV tier holds, as the "
                                       "worker's store reads its index", labels=_WORKER)
        self.blocks = GaugeMetricFamily("pdserve_worker_kv_tier_blocks", "blocks the node's KV tier holds, as the "
                                        "worker's store reads its index", labels=_WORKER)
        self.bandwidth = GaugeMetricFamily("pdserve_worker_kv_tier_read_bandwidth_bytes_per_second", "bytes per "
                                           "second the worker's KV tier reads measured (0: none yet)", labels=_WORKER)
        self.state = GaugeMetricFamily("pdserve_worker_kv_tier_state", "1 for the state the worker's KV tier store "
                                       "is in: on, read-only (a write failed: retried each minute) or off (its "
                                       "directory or index failed)", labels=[*_WORKER, "state"])
        self.problems = CounterMetricFamily("pdserve_worker_kv_tier_problems", "the worker's KV tier store's "
                                            "failed write batches (write_errors), blocks refused by their checksum "
                                            "(corrupt) and puts dropped (dropped: full queue, not writable)",
                                            labels=[*_WORKER, "kind"])

    def add(self, labels: list[str], s: pb.WorkerStats) -> None:
        self.hits.add_metric(labels, s.kv_tier_hit_tokens)
        for reason, count in sorted(s.kv_tier_decisions.items()):
            self.decisions.add_metric([*labels, reason], count)
        self.written.add_metric(labels, s.kv_tier_blocks_written)
        self.bytes.add_metric(labels, s.kv_tier_bytes)
        self.blocks.add_metric(labels, s.kv_tier_store.get("files", 0))
        self.bandwidth.add_metric(labels, s.kv_tier_read_bandwidth)
        store = s.kv_tier_store
        current = "on" if store.get("writable") else "read-only" if store.get("enabled") else "off"
        for state in ("on", "read-only", "off"):
            self.state.add_metric([*labels, state], float(state == current))
        for kind in ("write_errors", "corrupt", "dropped"):
            self.problems.add_metric([*labels, kind], store.get(kind, 0))

    def families(self):
        return (self.hits, self.decisions, self.written, self.bytes, self.blocks, self.bandwidth, self.state,
                self.problems)
