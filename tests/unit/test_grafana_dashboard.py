"""deploy/grafana/pdserve.json queries only metrics pdserve exports: every `pdserve_*` name in
its expressions is a series of a family the router's registry renders (with workers' series
from pdserve.router.worker_metrics and the SLO series a deployment config gives), counting the
`_total` of counters and the `_bucket`/`_sum`/`_count` of histograms. And the Prometheus
config scrapes the router's /metrics."""

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "unknown": ("",)}


class _NoWorkers:
    def workers(self, pool, routable=True):
        return []


def _exported() -> set[str]:
    from prometheus_client import generate_latest

    text = generate_latest(RouterMetrics(_NoWorkers(), ttft_slo_s=2.0, tpot_slo_s=0.15).registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def _queried() -> set[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs, "the dashboard has no queries"
    return {name for expr in exprs for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}


def test_every_metric_the_dashboard_queries_is_exported():
    exported = _exported()
    missing = _queried() - exported
    assert not missing, f"the dashboard queries metrics pdserve does not export: {sorted(missing)}"


def test_the_dashboard_covers_what_operators_watch():
    queried = _queried()
    for needed in ("pdserve_ttft_seconds_bucket", "pdserve_slo_ttft_seconds", "pdserve_tpot_seconds_bucket",
                   "pdserve_slo_tpot_seconds", "pdserve_goodput_requests_total", "pdserve_pool_queue_depth",
                   "pdserve_pool_kv_usage", "pdserve_kv_transfer_worker_bytes_total",
                   "pdserve_kv_transfer_failures_total", "pdserve_autoscaler_target_replicas", "pdserve_pool_workers",
                   "pdserve_migrations_total", "pdserve_worker_prefix_cache_hit_tokens_total"):
        assert needed in queried, needed


def test_prometheus_scrapes_the_routers_metrics():
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
