"""The dashboard's JSON (router/dashboard.py) without a cluster: the numbers it shows are
the ones /metrics exports; percentiles, goodput and KV bandwidth computed from the router's
finished-request log and the workers' counters; the page itself is served. The browser test
with a real service is tests/e2e/test_dashboard.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.dashboard import TransferRates, latency_view
from pdserve.router.registry import WorkerView
from pdserve.router.state import FinishedRequest, Router
from pdserve.rpc.security import Security

SLO = {"ttft_s": 1.0, "tpot_s": 0.1, "percentile": 90.0}


class FakeRegistry:
    def __init__(self, views: list[WorkerView]) -> None:
        self.views = views

    def workers(self, role: str, routable: bool = True) -> list[WorkerView]:
        return [v for v in self.views if v.role == role and (v.routable or not routable)]


def view(role: str, worker_id: str, state: str = "ready", **stats) -> WorkerView:
    return WorkerView(role, worker_id, f"127.0.0.1:{len(worker_id)}", state, None, None,
                      stats=pb.WorkerStats(worker_id=worker_id, role=role, **stats))


class FakeController:
    """What the dashboard asks of the controller: `status.remote()`, awaited."""

    def __init__(self, status: dict) -> None:
        self.status = self
        self._status = status

    async def remote(self) -> dict:
        return self._status


def make_router(views, controller=None) -> Router:
    config = RouterConfig(model="m", served_model_name="tiny", security=Security("t" * 32))
    return Router(config, FakeRegistry(views), controller)


def metric_samples(client: TestClient) -> dict:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_bare_router_serves_the_page_and_data_that_match_metrics():
    views = [view("decode", "d1", num_running=2, num_free_blocks=30, num_total_blocks=100,
                  prefix_cache_hit_tokens=30, prefix_cache_query_tokens=120, num_waiting=1),
             view("decode", "d2", state="draining", num_free_blocks=100, num_total_blocks=100),
             view("prefill", "p1", num_free_blocks=50, num_total_blocks=100, kv_bytes_sent=4096)]
    router = make_router(views)
    for reason in ("stop", "stop", "length", "abort"):
        router.metrics.requests.labels(reason).inc()
    client = TestClient(build_app(router))  # no lifespan: no tokenizer or registry to start

    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("dashboard/data"' in page.text and 'id="requests-total"' in page.text

    data = client.get("/dashboard/data").json()
    samples = metric_samples(client)
    assert data["has_controller"] is False and data["events"] == [] and data["slo"] is None
    assert data["requests_total"] == 4 == sum(v for (name, _), v in samples.items()
                                              if name == "pdserve_requests_total")
    # what the views above hold, worked out by hand: the draining decode worker is shown and
    # its blocks counted, but it is not routable; only d1 has a request waiting
    want = {"prefill": {"workers_routable": 1, "kv_usage": 0.5, "queue_depth": 0},  # 50 of 100 blocks used
            "decode": {"workers_routable": 1, "kv_usage": 0.35, "queue_depth": 1}}  # 70 of 200 used
    hit_rates = {"d1": 0.25, "d2": 0.0, "p1": 0.0}  # d1: 30 of 120 looked-up tokens; none looked up: 0
    for pool, figures in want.items():
        shown = data["pools"][pool]
        for name, value in figures.items():
            assert shown[name] == pytest.approx(value), (pool, name)
        assert shown["workers_routable"] == samples["pdserve_pool_workers", (("pool", pool),)]
        assert shown["kv_usage"] == samples["pdserve_pool_kv_usage", (("pool", pool),)]
        assert shown["queue_depth"] == samples["pdserve_pool_queue_depth", (("pool", pool),)]
        assert shown["target"] is None
        for w in shown["workers"]:
            key = ("pdserve_worker_prefix_cache_hit_rate", (("pool", pool), ("worker", w["worker_id"])))
            assert w["hit_rate"] == pytest.approx(hit_rates[w["worker_id"]]) and w["hit_rate"] == samples[key]
    assert [(w["worker_id"], w["state"]) for w in data["pools"]["decode"]["workers"]] == [("d1", "ready"),
                                                                                      ("d2", "draining")]
    d1 = data["pools"]["decode"]["workers"][0]
    assert (d1["running"], d1["waiting"], d1["kv_usage"]) == (2, 1, pytest.approx(0.7))


def test_with_metrics_behind_an_api_key_the_data_are_too():
    config = RouterConfig(model="m", served_model_name="tiny", security=Security("t" * 32), api_keys=("k1",),
                          metrics_require_key=True)
    client = TestClient(build_app(Router(config, FakeRegistry([]))))
    assert client.get("/dashboard/data").status_code == 401 == client.get("/metrics").status_code
    assert client.get("/dashboard/data", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert client.get("/dashboard").status_code == 200  # the page itself holds no data


def test_with_a_controller_it_shows_targets_starting_workers_slos_and_events():
    status = {"pools": {"prefill": {"target": 1, "workers": []},
                        "decode": {"target": 2, "workers": [
                            {"worker_id": "d1", "address": "a", "state": "ready"},
                            {"worker_id": "", "address": "", "state": "starting"}]}},
              "events": [{"time": 1.0, "role": "decode", "event": "scale", "detail": "target 2", "worker_id": ""}],
              "autoscaler": {"enabled": True, "overridden": ["decode"], "decisions": [{"time": 1.0}], "slo": SLO}}
    router = make_router([view("decode", "d1", num_total_blocks=10, num_free_blocks=10)], FakeController(status))
    data = TestClient(build_app(router)).get("/dashboard/data").json()
    assert data["controller_ok"] and data["slo"] == SLO and data["events"] == status["events"]
    decode = data["pools"]["decode"]
    assert decode["target"] == 2 and decode["workers_routable"] == 1
    assert [(w["worker_id"], w["state"]) for w in decode["workers"]] == [("d1", "ready"), ("", "starting")]
    assert data["autoscaler"] == {"enabled": True, "overridden": ["decode"], "decisions": [{"time": 1.0}]}


def test_percentiles_rate_and_goodput_over_the_window():
    now = 1000.0

    def done(age_s: float, completion_tokens: int, ttft_s: float, tpot_s: float | None) -> FinishedRequest:
        return FinishedRequest(end=now - age_s, prompt_tokens=10, completion_tokens=completion_tokens,
                               ttft_s=ttft_s, tpot_s=tpot_s, cached_tokens=0, arrival=now - age_s - 1)

    # ages 5, 15, 25, 35 s and one too old
    finished = [done(5, 5, 0.5, 0.05), done(15, 5, 2.0, 0.05), done(25, 1, 0.2, None), done(35, 5, 0.3, 0.5),
                done(400, 5, 9.0, 9.0)]
    lat = latency_view(finished, SLO, now, window_s=60, bucket_s=10)
    overall = lat["overall"]
    assert overall["count"] == 4 and overall["rate"] == 4 / 60
    assert overall["goodput"] == 2 / 60  # the 2 s TTFT and the 0.5 s TPOT miss the SLOs
    assert (overall["ttft_p50"], overall["ttft_p99"]) == (0.5, 2.0)  # nearest rank (engine.stats)
    assert overall["tpot_p99"] == 0.5
    assert [b["ago_s"] for b in lat["series"]] == [50, 40, 30, 20, 10, 0]
    assert [b["count"] for b in lat["series"]] == [0, 0, 1, 1, 1, 1]
    assert lat["series"][-2]["ttft_p90"] == 2.0 and lat["series"][-2]["goodput"] == 0
    assert lat["series"][0]["ttft_p50"] is None
    assert latency_view(finished, None, now)["overall"]["goodput"] is None  # no SLOs known: no goodput


def test_transfer_bandwidth_from_counter_increases():
    rates = TransferRates(min_interval_s=1.0)
    rates.sample([view("prefill", "p1", kv_bytes_sent=1000), view("decode", "d1", kv_bytes_received=1000)], 10.0)
    assert not rates.points  # one sample is no rate yet
    rates.sample([view("prefill", "p1", kv_bytes_sent=5000), view("decode", "d1", kv_bytes_received=3000)], 10.5)
    assert not rates.points  # too soon: the next one measures from the first
    rates.sample([view("prefill", "p1", kv_bytes_sent=9000), view("decode", "d1", kv_bytes_received=9000)], 12.0)
    assert list(rates.points) == [(12.0, 4000.0, 4000.0)]
    # p1 restarted (its counter went back), p2 is new: neither adds bytes it did not ship in the interval
    rates.sample([view("prefill", "p1", kv_bytes_sent=10), view("prefill", "p2", kv_bytes_sent=777),
                  view("decode", "d1", kv_bytes_received=13000)], 14.0)
    assert rates.points[-1] == (14.0, 0.0, 2000.0)


def test_the_autoscalers_observations_carry_each_requests_arrival():
    import time
    from types import SimpleNamespace

    from pdserve.router.generation import Result
    from pdserve.router.responses import begin, end

    router = make_router([])
    started = time.perf_counter() - 2.0  # it arrived two seconds ago and has just finished
    result = Result(num_completion_tokens=5, finish_reason="stop", first_token_at=started + 0.5, num_cached_tokens=4)
    begin(router)
    end(router, [SimpleNamespace(prompt_ids=list(range(10)), started=started, result=result)])
    observed = router.observations(window_s=60)
    assert observed["count"] == 1 and observed["lengths"] == [(10, 5, 4)]
    assert observed["arrivals"][0] == pytest.approx(time.monotonic() - 2.0, abs=0.2)
