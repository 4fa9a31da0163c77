"""OpenTelemetry traces of a request across the router, the decode worker and the prefill worker.

Off unless configured (`tracing.otlp_endpoint` in the deployment config, `--otlp-traces-endpoint`
on each process, like vLLM's), and free when off: this module imports nothing of OpenTelemetry
until `configure` turns it on; until then `start_span` and `span` hand back one shared
do-nothing span, `metadata` adds nothing to a call, and no interceptor or middleware is
installed. (Recent FastAPI imports the OpenTelemetry API itself, never the SDK, and its own
telemetry stays off while no global provider is set; this module sets none.) When on, each
process exports its spans over OTLP/gRPC in batches, under its own
`service.name` (SERVICE_NAMES).

One request is one trace (every pdserve span carries `pdserve.request_id`):

    router   POST /v1/completions                (the FastAPI instrumentation's server span)
             └─ pdserve.decode_leg  CLIENT        per decode worker tried; a migrated request
                │                                 has one more leg (pdserve.migration) and a
                │                                 `migration` event on the server span
    decode      └─ /pdserve.DecodeWorker/Generate  SERVER   (the gRPC instrumentation's)
                   ├─ pdserve.queue                waiting for KV blocks
                   ├─ pdserve.prefill_leg  CLIENT  per prefill worker tried
                   │  ├─ pdserve.kv_transfer       receiving the KV (direction=receive)
    prefill        │  └─ /pdserve.PrefillWorker/Prefill  SERVER
                   │     ├─ pdserve.prefill        queued and computed, to the first token
                   │     └─ pdserve.kv_transfer    shipping the KV until flushed (direction=send)
                   ├─ pdserve.prefill              when prefilled here
                   └─ pdserve.decode               from the first token to the finish
                   (and a `first_token` event on the server spans and the decode leg)

The context crosses processes as W3C `traceparent` in gRPC metadata. Servers use the gRPC
instrumentation's aio server interceptor (it extracts the context and keeps the server span
current through a streaming handler, so spans the handler and its tasks start are its
children); only Generate and Prefill are traced, not the Stats polls. Clients make their spans
by hand: the aio client interceptor ends a stream's span only when its response iterator is
exhausted, but pdserve stops reading a Generate stream at its finish chunk and a Prefill stream
at `done` (then half-closes or cancels it), so those spans would end whenever the garbage
collector got to them; and a Prefill call's request id is written after the call starts, out of
the interceptor's reach.
"""

from __future__ import annotations

import argparse
from typing import Any
from urllib.parse import urlparse

SERVICE_NAMES = {"router": "pdserve-router", "decode": "pdserve-decode-worker", "prefill": "pdserve-prefill-worker"}
TRACED_METHODS = ("/pdserve.DecodeWorker/Generate", "/pdserve.PrefillWorker/Prefill")
ATTRIBUTE_PREFIX = "pdserve."  # span(..., request_id=r) sets `pdserve.request_id`

_provider = None  # the SDK's TracerProvider once `configure` turned tracing on; None: off
_tracer = None


class _NoSpan:
    """What every span is when tracing is off: accepts everything, records nothing."""

    def set_attribute(self, key: str, value) -> None:
        pass

    def add_event(self, name: str, attributes=None) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def end(self) -> None:
        pass

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc) -> None:
        return None


NO_SPAN = _NoSpan()


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    group.add_argument("--otlp-traces-endpoint", default=None,
                       help="export OpenTelemetry traces over OTLP/gRPC to this collector, e.g. "
                            "http://127.0.0.1:4317 (https:// for TLS); default: no tracing")


def configure(role: str, otlp_endpoint: str | None, instance_id: str = "") -> bool:
    """Turn tracing on for this process (`role`: router, decode or prefill) when `otlp_endpoint`
    is set; returns whether it is on. The first configuration of a process stands."""
    global _provider, _tracer
    if not otlp_endpoint or _provider is not None:
        return _provider is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": SERVICE_NAMES[role], "service.instance.id": instance_id,
                                "pdserve.role": role})
    provider = TracerProvider(resource=resource)  # flushes its batch at interpreter exit
    exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=urlparse(otlp_endpoint).scheme != "https")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    return True


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans still batched now (blocks up to `timeout_s`; a no-op when off)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def server_interceptors() -> list:
    """gRPC server interceptors that trace Generate and Prefill calls (none when off)."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider,
                                   filter_=lambda details: details.method in TRACED_METHODS)]


def instrument_app(app) -> None:
    """Give the router's FastAPI app a server span per API request (nothing when off)."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, tracer_provider=_provider,
                                       excluded_urls="/health,/metrics,/admin,/dashboard",  # polled
                                       exclude_spans=["receive", "send"])  # not one span per SSE chunk


def _attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {ATTRIBUTE_PREFIX + key: value for key, value in attributes.items()}


def _kind(client: bool):
    from opentelemetry.trace import SpanKind

    return SpanKind.CLIENT if client else SpanKind.INTERNAL


def start_span(name: str, parent=None, client: bool = False, **attributes):
    """A started span, a child of `parent` (a span) or else of the current span; not made
    current, so safe to hold across an async generator's yields. End it with `end`."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    context = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context=context, kind=_kind(client), attributes=_attributes(attributes))


def span(name: str, client: bool = False, **attributes):
    """`with span(...):` a child of the current span, current inside the block (spans started
    and calls made there, in tasks too, are its children); an exception is recorded on it."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_as_current_span(name, kind=_kind(client), attributes=_attributes(attributes))


def end(span, error: BaseException | None = None) -> None:
    """End `span` unless it has ended, marking it failed with `error` if given (not when the
    consumer of a stream closed it: GeneratorExit)."""
    if not span.is_recording():
        return
    if error is not None and not isinstance(error, GeneratorExit):
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def annotate(**attributes) -> None:
    """Set attributes on the current span (in an RPC handler: the server span)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(_attributes(attributes))


def add_event(name: str, on=None, **attributes) -> None:
    """An event on the span `on`, else on the current span."""
    if _tracer is None:
        return
    from opentelemetry import trace

    (on or trace.get_current_span()).add_event(name, _attributes(attributes))


def metadata(span=None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the trace context of `span`, else of the current span, to the
    server the call goes to; None when off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate, trace

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return tuple(carrier.items()) or None
