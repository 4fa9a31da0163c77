"""OpenTelemetry tracing (rpc.tracing) across real processes: a router, a decode worker and
a prefill worker export to a real OTLP/gRPC receiver run here (opentelemetry-proto's
TraceService). One disaggregated request is one trace: spans from all three services, linked
router -> decode worker -> prefill worker through the `traceparent` in gRPC metadata, each
carrying the request id. With tracing off, nothing is exported and the router process, even
after serving a request, has imported none of the OpenTelemetry SDK, exporters or
instrumentations (the OpenTelemetry API it does import: FastAPI itself depends on it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pdserve.cluster.config import load_config
from pdserve.rpc import tracing
from pdserve.testkit.workers import CLUSTER_TOKEN, ROOT, RouterProcess, WorkerProcess, free_port, stats_of
from tests.e2e.http import post
from tests.integration.streaming import serving_worker, stream_ids

PROMPT = list(range(5, 30))
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "200"}  # the SDK's batch delay, ms (default 5000)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector keeping every span it is sent, flattened to dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [_flatten(span, resource["service.name"]) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)


def _attributes(key_values) -> dict:
    out = {}
    for kv in key_values:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
    return out


def _flatten(span, service: str) -> dict:
    return {"service": service, "name": span.name, "kind": span.kind, "trace_id": span.trace_id.hex(),
            "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
            "attributes": _attributes(span.attributes), "events": [e.name for e in span.events],
            "error": span.status.code == span.status.STATUS_CODE_ERROR}


@pytest.fixture
def receiver():
    receiver = Receiver()
    yield receiver
    receiver.server.stop(0)


def _one(spans: list[dict], service: str, name: str) -> dict:
    found = [s for s in spans if s["service"] == service and s["name"] == name]
    assert len(found) == 1, (service, name, [(s["service"], s["name"]) for s in spans])
    return found[0]


def _wait_for(receiver: Receiver, wanted: set[tuple[str, str]], timeout_s: float = 30.0) -> list[dict]:
    """The spans received once every (service, name) in `wanted` is among them."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.snapshot()
        if wanted <= {(s["service"], s["name"]) for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


ROUTER, DECODE, PREFILL = (tracing.SERVICE_NAMES[r] for r in ("router", "decode", "prefill"))
GENERATE, PREFILL_RPC = tracing.TRACED_METHODS


def test_one_disaggregated_request_is_one_trace_across_the_three_processes(tiny_llama_dir, receiver):
    model, flag = str(tiny_llama_dir), ("--otlp-traces-endpoint", receiver.endpoint)
    with WorkerProcess("prefill", model, *flag, env=FAST_EXPORT) as p, \
            WorkerProcess("decode", model, *flag, env=FAST_EXPORT) as d, \
            RouterProcess(model, [p.address], [d.address], *flag, env=FAST_EXPORT) as router:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "stream": True}
        status, out, _ = post(router.url + "/v1/completions", body)
        assert status == 200 and out["done"], out
        request_id = out["events"][0]["id"]
        decisions = dict(asyncio.run(stats_of(d.address, "decode")).prefill_decisions)
        assert sum(n for k, n in decisions.items() if k.startswith("remote/")) == 1, decisions  # prefilled remotely
        assert asyncio.run(stats_of(p.address, "prefill")).kv_bytes_sent > 0
        spans = _wait_for(receiver, {(ROUTER, "pdserve.decode_leg"), (DECODE, GENERATE), (DECODE, "pdserve.decode"),
                                     (DECODE, "pdserve.prefill_leg"), (PREFILL, PREFILL_RPC),
                                     (PREFILL, "pdserve.kv_transfer"), (DECODE, "pdserve.kv_transfer")})

    assert {s["trace_id"] for s in spans} == {spans[0]["trace_id"]}, "more than one trace"
    assert {s["service"] for s in spans} == {ROUTER, DECODE, PREFILL}
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if not s["parent"]]
    assert [(r["service"], r["kind"]) for r in roots] == [(ROUTER, Span.SPAN_KIND_SERVER)], roots  # the HTTP span
    assert all(s["parent"] in by_id for s in spans if s["parent"]), "a span whose parent was not exported"
    assert not [s for s in spans if s["error"]], [s for s in spans if s["error"]]

    http, leg = roots[0], _one(spans, ROUTER, "pdserve.decode_leg")
    generate, prefill_leg = _one(spans, DECODE, GENERATE), _one(spans, DECODE, "pdserve.prefill_leg")
    prefill_rpc = _one(spans, PREFILL, PREFILL_RPC)
    assert leg["parent"] == http["span_id"] and leg["kind"] == Span.SPAN_KIND_CLIENT
    assert generate["parent"] == leg["span_id"] and generate["kind"] == Span.SPAN_KIND_SERVER
    assert prefill_leg["parent"] == generate["span_id"] and prefill_leg["kind"] == Span.SPAN_KIND_CLIENT
    assert prefill_rpc["parent"] == prefill_leg["span_id"] and prefill_rpc["kind"] == Span.SPAN_KIND_SERVER
    children = [(DECODE, "pdserve.queue", generate), (DECODE, "pdserve.decode", generate),
                (DECODE, "pdserve.kv_transfer", prefill_leg), (PREFILL, "pdserve.prefill", prefill_rpc),
                (PREFILL, "pdserve.kv_transfer", prefill_rpc)]
    for service, name, parent in children:
        assert _one(spans, service, name)["parent"] == parent["span_id"], (service, name)
    assert _one(spans, DECODE, "pdserve.kv_transfer")["attributes"]["pdserve.direction"] == "receive"
    assert _one(spans, PREFILL, "pdserve.kv_transfer")["attributes"]["pdserve.direction"] == "send"
    assert "first_token" in leg["events"] and "first_token" in generate["events"]
    assert "first_token" in prefill_rpc["events"]
    for span in (http, leg, generate, prefill_leg, prefill_rpc):
        assert span["attributes"].get("pdserve.request_id") == request_id, span
    assert generate["attributes"]["pdserve.prefill_where"] == "remote"


def test_a_migrated_request_is_one_trace_with_a_leg_per_decode_worker(tiny_llama_dir, receiver):
    """A decode worker SIGKILLed mid-stream: the router's trace has a second decode leg
    (marked as the first migration, resumed after the tokens already sent) under the same
    HTTP span, which records a `migration` event; the surviving worker's Generate span is the
    second leg's child. (The killed worker's own spans die with it, unexported.)"""
    model, flag = str(tiny_llama_dir), ("--otlp-traces-endpoint", receiver.endpoint)
    with WorkerProcess("prefill", model, *flag, env=FAST_EXPORT) as p, \
            WorkerProcess("decode", model, *flag, env=FAST_EXPORT) as d1, \
            WorkerProcess("decode", model, *flag, env=FAST_EXPORT) as d2, \
            RouterProcess(model, [p.address], [d1.address, d2.address], *flag, env=FAST_EXPORT) as router:
        killed = []

        async def kill_the_serving_worker():
            victim = await serving_worker([d1, d2])
            victim.kill()
            killed.append(victim)

        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0.0}
        ids, finishes, _, errors, done = asyncio.run(stream_ids(router.url, body, 20, kill_the_serving_worker))
        assert not errors and done and finishes == ["length"] and len(ids) == 300, (errors, finishes)
        deadline = time.monotonic() + 30
        while True:  # both legs (the router ends the first when it fails) and the survivor's spans
            spans = receiver.snapshot()
            names = [(s["service"], s["name"]) for s in spans]
            if names.count((ROUTER, "pdserve.decode_leg")) == 2 and (DECODE, GENERATE) in names \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)

    assert {s["trace_id"] for s in spans} == {spans[0]["trace_id"]}, "more than one trace"
    [http] = [s for s in spans if not s["parent"]]
    legs = sorted((s for s in spans if s["service"] == ROUTER and s["name"] == "pdserve.decode_leg"),
                  key=lambda s: s["attributes"]["pdserve.migration"])
    assert [leg["attributes"]["pdserve.migration"] for leg in legs] == [0, 1], legs
    assert all(leg["parent"] == http["span_id"] for leg in legs)
    assert legs[1]["attributes"]["pdserve.resumed_after_tokens"] >= 20
    assert "migration" in http["events"]
    [resumed] = [s for s in spans if s["service"] == DECODE and s["name"] == GENERATE]  # the survivor's
    assert resumed["parent"] == legs[1]["span_id"]


# A router process with tracing off serving one request through `router.server.main`; it
# prints which OpenTelemetry modules beyond the API (FastAPI's own dependency) it had imported.
_ROUTER_OFF = """
import json, sys, threading, time, urllib.request
from pdserve.router.server import main
argv = json.loads(sys.argv[1])
threading.Thread(target=main, args=(argv,), daemon=True).start()
url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
        break
    except OSError:
        time.sleep(0.1)
body = json.dumps({"model": "tiny", "prompt": list(range(5, 30)), "max_tokens": 4, "stream": True}).encode()
request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
with urllib.request.urlopen(request, timeout=120) as response:
    served = response.status == 200 and b"[DONE]" in response.read()
beyond_api = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation", "opentelemetry.proto")
otel = sorted(m for m in sys.modules if m.startswith(beyond_api))
print(json.dumps({"served": served, "otel": otel}), flush=True)
"""


# The positive control: a process that batches one span with the SDK configured by the
# environment alone (endpoint and batch delay) and never flushes it: it arrives by the batch
# delay, as a worker's would.
_CONTROL = """
import time
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
provider = TracerProvider(resource=Resource.create({"service.name": "control"}))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
provider.get_tracer("control").start_span("control").end()
time.sleep(600)
"""


def wait_for_control_span(receiver: Receiver, env: dict, timeout_s: float = 60.0) -> list[dict]:
    """Run the positive control with `env` until the receiver has its span; returns the spans then."""
    control = subprocess.Popen([sys.executable, "-c", _CONTROL], cwd=ROOT, env={**os.environ, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not any(s["service"] == "control" for s in receiver.snapshot()):
            assert control.poll() is None, f"the control process exited: {control.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, f"the control's span did not arrive in {timeout_s} s"
            time.sleep(0.05)
        return receiver.snapshot()
    finally:
        control.kill()
        control.wait(30)


def test_off_exports_nothing_and_the_router_imports_no_sdk(tiny_llama_dir, receiver):
    model = str(tiny_llama_dir)
    # were anything to trace with the SDK's own defaults, it would export here
    trap = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
    with WorkerProcess("prefill", model, env=trap) as p, WorkerProcess("decode", model, env=trap) as d:
        argv = ["--model", model, "--served-model-name", "tiny", "--port", str(free_port()),
                f"--prefill={p.address}", f"--decode={d.address}", "--cluster-token", CLUSTER_TOKEN]
        result = subprocess.run([sys.executable, "-c", _ROUTER_OFF, json.dumps(argv)], cwd=ROOT, capture_output=True,
                                text=True, timeout=300, env={**os.environ, **trap})
        assert result.returncode == 0, result.stderr[-3000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["served"], result.stderr[-3000:]
        assert report["otel"] == [], f"the router imported {report['otel'][:5]} with tracing off"
        assert asyncio.run(stats_of(p.address, "prefill")).kv_bytes_sent > 0  # the request took the full path
        # a span the SDK batches by the same environment, after the request's, has arrived: a
        # worker's span batched the same way would have too
        control = wait_for_control_span(receiver, trap)
        assert {s["service"] for s in receiver.snapshot()} == {"control"}, receiver.snapshot()[:3]
    # the workers have exited (flushing whatever they held)
    assert receiver.snapshot() == control


def test_off_makes_no_spans_and_sends_no_context():
    assert not tracing.enabled()
    assert tracing.start_span("x", request_id="r") is tracing.NO_SPAN
    assert tracing.span("x") is tracing.NO_SPAN
    assert tracing.metadata() is None and tracing.server_interceptors() == []
    assert not tracing.configure("router", None)


def test_the_deployment_config_names_the_endpoint():
    assert load_config(None).tracing.otlp_endpoint is None  # off by default
    config = load_config(None, {"tracing.otlp_endpoint": "http://collector:4317"})
    assert config.tracing.otlp_endpoint == "http://collector:4317"
    with pytest.raises(ValueError, match="tracing.endpoint: Extra inputs are not permitted"):
        load_config(None, {"tracing.endpoint": "http://collector:4317"})
