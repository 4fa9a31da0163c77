"""/metrics and /dashboard through the shared port of two router replicas (`router.replicas: 2`,
a simulated deployment): whichever replica answers, /metrics holds both replicas'
`pdserve_requests_total` under their `replica` labels, each the count that replica finished,
summing to the requests sent, and the cluster-wide families once; /dashboard's data lists
both replicas with the pids the controller reports and pools their finished requests."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.engine.config import SIM_MODEL
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, post

REQUESTS = 12
SCRAPES = 8  # urllib: a new connection each, which the kernel gives either replica


@pytest.fixture(scope="module")
def replicated(ray_cluster):
    controller, url = start_service(SIM_MODEL, served_model_name=None, **{
        "router.replicas": 2, "prefill.num_cpus": 0.1, "decode.num_cpus": 0.1})
    yield controller, url
    stop_service(controller)


def scrape(url: str) -> dict:
    """/metrics parsed (invalid exposition text raises): {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(url + "/metrics")
    assert status == 200, text
    families = list(text_string_to_metric_families(text))
    assert len({f.name for f in families}) == len(families), "a family rendered twice"
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def by_replica(samples: dict, name: str) -> dict[str, float]:
    """The samples called `name`, summed per `replica` label."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            replica = dict(labels)["replica"]
            out[replica] = out.get(replica, 0) + value
    return out


def test_metrics_and_dashboard_of_either_replica_show_both(replicated):
    import ray

    controller, url = replicated
    routers = ray.get(controller.status.remote(), timeout=60)["routers"]
    pids = {str(r["replica"]): str(r["pid"]) for r in routers}
    assert len(pids) == 2 and len(set(pids.values())) == 2, routers
    handles = ray.get(controller.router_handles.remote(), timeout=60)
    # each replica learns its siblings from the controller's list, polled every 2 s
    deadline = time.monotonic() + 30
    while not all(len([r for r in ray.get(h.replicas.remote(), timeout=30) if r.families is not None]) == 2
                  for h in handles.values()):
        assert time.monotonic() < deadline, "the replicas never listed each other"
        time.sleep(0.5)

    for i in range(REQUESTS):
        status, body, _ = post(url + "/v1/completions", {"model": SIM_MODEL, "prompt": [5, 6, 7, i],
                                                         "max_tokens": 3, "ignore_eos": True})
        assert status == 200, body
    served = {str(i): ray.get(h.requests_total.remote(), timeout=30) for i, h in handles.items()}
    assert sum(served.values()) == REQUESTS, served

    for _ in range(SCRAPES):
        samples = scrape(url)
        assert by_replica(samples, "pdserve_router_replica_up") == {"0": 1, "1": 1}, samples
        assert by_replica(samples, "pdserve_requests_total") == served, samples
        info = {dict(labels)["replica"]: dict(labels)["pid"] for (name, labels), _ in samples.items()
                if name == "pdserve_router_replica_info"}
        assert info == pids
        # cluster-wide: once, not per replica
        assert samples["pdserve_pool_workers", (("pool", "decode"),)] == 1

        data = json.loads(get(url + "/dashboard/data")[1])
        rows = {str(r["replica"]): r for r in data["routers"]}
        assert {i: str(r["pid"]) for i, r in rows.items()} == pids
        assert {i: r["requests_total"] for i, r in rows.items()} == served and all(r["answered"] for r in rows.values())
        assert data["requests_total"] == REQUESTS and data["latency"]["overall"]["count"] == REQUESTS
