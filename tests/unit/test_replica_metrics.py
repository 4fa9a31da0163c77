"""/metrics and /dashboard of one router replica show every replica (router.metrics.by_replica,
router.dashboard), from fake replicas: each replica's per-replica series under its own
`replica` label in valid exposition text, the cluster-wide families once and unlabelled, a
replica that did not answer reported as down; a bare router, and a deployment's only
replica, render as a bare router always did. The
same over a real service with two replicas: tests/e2e/test_replica_metrics.py."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import Replica, RouterMetrics
from pdserve.router.registry import WorkerView
from pdserve.router.state import FinishedRequest, Router
from pdserve.rpc.security import Security


class FakeRegistry:
    def __init__(self) -> None:
        stats = pb.WorkerStats(worker_id="d1", role="decode", num_running=2, num_free_blocks=30, num_total_blocks=100)
        self.views = [WorkerView("decode", "d1", "127.0.0.1:1", "ready", None, None, stats=stats)]

    def workers(self, role: str, routable: bool = True) -> list[WorkerView]:
        return [v for v in self.views if v.role == role]


def replica_metrics(finish_reasons: list[str]) -> RouterMetrics:
    metrics = RouterMetrics(FakeRegistry(), ttft_slo_s=1.0, tpot_slo_s=0.1)
    for reason in finish_reasons:
        metrics.requests.labels(reason).inc()
    return metrics


def parse(text: str) -> list:
    return list(text_string_to_metric_families(text))


def names(registry) -> set[str]:
    return {family.name for family in parse(generate_latest(registry).decode())}


def test_every_replica_s_series_under_its_label_and_cluster_families_once():
    answering, sibling = replica_metrics(["stop"] * 3), replica_metrics(["length", "length", "stop"])
    answering.inflight.set(1)
    replicas = [Replica(0, "http://h:8000", 101, "ready", answering.replica_families()),
                Replica(1, "http://h:8000", 102, "ready", sibling.replica_families()),
                Replica(2, "http://h:8000", 103, "starting")]  # did not answer
    text = answering.render(replicas)[0].decode()
    families = parse(text)  # raises on text that is not valid exposition format

    # one HELP/TYPE per family
    assert len({f.name for f in families}) == len(families), sorted(f.name for f in families)
    assert text.count("# TYPE pdserve_requests_total ") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    requests = {labels: v for (name, labels), v in samples.items() if name == "pdserve_requests_total"}
    assert requests == {(("finish_reason", "stop"), ("replica", "0")): 3,
                        (("finish_reason", "length"), ("replica", "1")): 2,
                        (("finish_reason", "stop"), ("replica", "1")): 1}
    assert samples["pdserve_inflight_requests", (("replica", "0"),)] == 1
    assert samples["pdserve_inflight_requests", (("replica", "1"),)] == 0

    own = names(answering.own)
    cluster = names(answering.cluster)
    assert own and cluster and not own & cluster
    for family in families:
        if family.name in own:  # every answering replica's, labelled (or none yet: a labelled family unused)
            assert {s.labels.get("replica") for s in family.samples} in (set(), {"0", "1"}), family.name
        elif family.name in cluster:  # once, as the answering replica reads it
            assert not any("replica" in s.labels for s in family.samples), family.name
    assert samples["pdserve_worker_running", (("pool", "decode"), ("worker", "d1"))] == 2
    assert samples["pdserve_slo_ttft_seconds", ()] == 1.0

    up = {labels: v for (name, labels), v in samples.items() if name == "pdserve_router_replica_up"}
    assert up == {(("replica", "0"),): 1, (("replica", "1"),): 1, (("replica", "2"),): 0}
    info = sorted(dict(labels)["pid"] for (name, labels), v in samples.items()
                  if name == "pdserve_router_replica_info" and v == 1)
    assert info == ["101", "102", "103"]


def test_a_bare_router_or_a_lone_replica_renders_every_family_unlabelled():
    metrics = replica_metrics(["stop"])
    alone = [Replica(0, "http://h:8000", 101, "ready", metrics.replica_families())]
    for text in (metrics.render()[0].decode(), metrics.render(alone)[0].decode()):
        families = parse(text)
        assert {f.name for f in families} == names(metrics.own) | names(metrics.cluster)
        assert not any("replica" in s.labels for f in families for s in f.samples)
        assert "pdserve_router_replica_up" not in {f.name for f in families}


def finished(end: float, n: int) -> list[FinishedRequest]:
    return [FinishedRequest(end, 8, 4, 0.05, 0.01, 0, end - 0.1) for _ in range(n)]


def test_metrics_and_dashboard_of_an_app_with_the_replicas_hook_show_every_replica():
    config = RouterConfig(model="m", served_model_name="tiny", security=Security("t" * 32))
    router = Router(config, FakeRegistry())
    sibling = replica_metrics(["stop", "stop"])
    router.metrics.requests.labels("stop").inc()
    now = time.monotonic()
    asked = []

    async def replicas(window_s: float = 0.0) -> list[Replica]:
        asked.append(window_s)
        return [Replica(0, "http://h:8000", 101, "ready", router.metrics.replica_families(), finished(now, 1)),
                Replica(1, "http://h:8000", 102, "ready", sibling.replica_families(), finished(now, 2)),
                Replica(2, "http://h:8000", 103, "stopping")]

    app = build_app(router)
    app.state.replicas = replicas
    client = TestClient(app)  # no lifespan: no tokenizer or registry to start

    samples = [s for f in parse(client.get("/metrics").text) for s in f.samples if s.name == "pdserve_requests_total"]
    assert {s.labels["replica"]: s.value for s in samples} == {"0": 1, "1": 2}

    data = client.get("/dashboard/data").json()
    assert asked[-1] > 0, "the dashboard asks for the finished requests of its charts' window"
    assert [(r["replica"], r["pid"], r["answered"], r["requests_total"]) for r in data["routers"]] == [
        (0, 101, True, 1), (1, 102, True, 2), (2, 103, False, None)]
    assert data["requests_total"] == 3  # summed over the replicas that answered
    assert data["latency"]["overall"]["count"] == 3  # their finished requests pooled
    assert 'id="routers"' in client.get("/dashboard").text


def test_a_bare_router_s_dashboard_lists_itself():
    config = RouterConfig(model="m", served_model_name="tiny", security=Security("t" * 32))
    router = Router(config, FakeRegistry())
    router.metrics.requests.labels("stop").inc()
    data = TestClient(build_app(router)).get("/dashboard/data").json()
    assert [(r["replica"], r["answered"], r["requests_total"]) for r in data["routers"]] == [(0, True, 1)]
    assert data["requests_total"] == 1
